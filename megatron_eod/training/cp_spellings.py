"""Context parallelism, one fact asked once, in either spelling (both trainers).

Megatron-LM's `--cp-comm-type` maps onto ours: p2p = ring, a2a = ulysses, a2a+p2p with
`--hierarchical-context-parallel-sizes U CP/U` = hybrid with Ulysses degree U.
`--context-parallel-algo` / `--ulysses-degree-in-cp` may say the same instead (then the
hierarchical sizes are filled in for Megatron-LM to build the groups); saying both and
differently is an error naming both.

One job: `resolve_cp_spellings(args)`, on the lean trainer's args (which take both spellings,
so a Megatron-LM launch script's CP flags run there) or Megatron-LM's before its
validate_args. The CP rules themselves are cp_flags.check_context_parallel's.
"""

from __future__ import annotations

from megatron_eod.training.cp_flags import CP_ALGO_ALIASES, FlagError, check_hybrid_degree

__all__ = ["ALGO_TO_COMM", "COMM_TO_ALGO", "NotGiven", "resolve_cp_spellings"]

COMM_TO_ALGO = {"p2p": "ring", "a2a": "ulysses", "a2a+p2p": "hybrid"}
ALGO_TO_COMM = {algo: comm for comm, algo in COMM_TO_ALGO.items()}


class NotGiven(list):
    """The default of --cp-comm-type (["p2p"]), told apart from an explicit --cp-comm-type."""


def resolve_cp_spellings(args) -> None:
    """Megatron-LM's spellings and ours made one: sets `context_parallel_algo`, the Ulysses
    degree of hybrid (from --hierarchical-context-parallel-sizes where given) and, for
    Megatron-LM to build its groups, `cp_comm_type` and the hierarchical sizes; FlagError
    names the flags that disagree."""
    cp = args.context_parallel_size
    comm = getattr(args, "cp_comm_type", None)
    comm_given = comm is not None and not isinstance(comm, NotGiven)
    comm = list(comm or ["p2p"])
    if len(comm) != 1:
        raise FlagError(f"--cp-comm-type {' '.join(comm)}: one type per layer is not "
                        f"supported; EoD attention uses one algorithm for every layer")
    if comm[0] not in COMM_TO_ALGO:
        raise FlagError(f"--cp-comm-type {comm[0]}: EoD attention implements p2p (ring), a2a "
                        f"(ulysses) and a2a+p2p (hybrid)")
    sizes = list(getattr(args, "hierarchical_context_parallel_sizes", None) or [])
    given = args.context_parallel_algo
    if given is not None and given not in CP_ALGO_ALIASES:
        raise FlagError(f"--context-parallel-algo {given!r} is not supported; choose one of "
                        f"{', '.join(CP_ALGO_ALIASES)}")
    if cp == 1 and comm[0] == "a2a+p2p" and CP_ALGO_ALIASES.get(given) in (None, "ring"):
        # A launch script templated for hybrid, run at CP=1 (Megatron-LM takes it with sizes
        # whose product is 1): nothing is exchanged, so it runs as plain CP=1 attention
        # ("ring": what this sets, read again on a second pass).
        shown = f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}"
        if sizes and len(sizes) != 2:
            raise FlagError(f"{shown}: hybrid takes two sizes, Ulysses (inner) then Ring "
                            f"(outer)")
        if sizes and sizes[0] * sizes[1] != 1:
            raise FlagError(f"{shown}: their product must be --context-parallel-size 1")
        u = args.ulysses_degree_in_cp
        if u not in (None, 1):
            raise FlagError(f"--ulysses-degree-in-cp {u} needs --context-parallel-size > {u}")
        args.context_parallel_algo = "ring"
        return
    algo = CP_ALGO_ALIASES.get(given, given) if given is not None else COMM_TO_ALGO[comm[0]]
    if given is not None and comm_given and COMM_TO_ALGO[comm[0]] != algo:
        raise FlagError(f"--context-parallel-algo {given} contradicts --cp-comm-type {comm[0]} "
                        f"({COMM_TO_ALGO[comm[0]]}); pass one of them")
    args.context_parallel_algo = algo
    u = args.ulysses_degree_in_cp
    if given is None and algo != "hybrid" and u not in (None, 1, cp if algo == "ulysses" else 1):
        raise FlagError(f"--ulysses-degree-in-cp {u} asks for hybrid context parallelism, but "
                        f"--cp-comm-type {comm[0]}{'' if comm_given else ' (the default)'} is "
                        f"{algo}: pass --cp-comm-type a2a+p2p (or --context-parallel-algo "
                        f"hybrid)")
    if algo != "hybrid":
        if sizes:
            raise FlagError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} "
                            f"is only used by --cp-comm-type a2a+p2p (hybrid), not by {algo}")
    elif cp > 1:
        if sizes:
            shown = f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}"
            if len(sizes) != 2:
                raise FlagError(f"{shown}: hybrid takes two sizes, Ulysses (inner) then Ring "
                                f"(outer)")
            if sizes[0] * sizes[1] != cp or min(sizes) < 2:
                raise FlagError(f"{shown}: hybrid needs two sizes > 1 whose product is "
                                f"--context-parallel-size {cp} (an inner size of 1 is ring: "
                                f"--cp-comm-type p2p; an outer size of 1 is ulysses: a2a)")
            if u is not None and u != sizes[0]:
                raise FlagError(f"--ulysses-degree-in-cp {u} contradicts "
                                f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}")
            args.ulysses_degree_in_cp = u = sizes[0]
        # Checked here, not only in check_context_parallel: this runs before Megatron-LM's
        # validate_args (check_before_megatron), whose assertions on a2a+p2p have no message.
        if given is None and u is None:
            raise FlagError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes "
                            f"U {cp}/U (Ulysses inside, Ring across), or --ulysses-degree-in-cp "
                            f"U")
        check_hybrid_degree(u, cp, f"--context-parallel-algo {given}" if given is not None
                            else "--cp-comm-type a2a+p2p")
        args.hierarchical_context_parallel_sizes = [u, cp // u]  # Megatron-LM builds them
    if algo != "hybrid" or cp > 1:
        args.cp_comm_type = [ALGO_TO_COMM[algo]]
    elif isinstance(args.cp_comm_type, NotGiven):  # args go into checkpoints: a plain list
        args.cp_comm_type = list(args.cp_comm_type)
