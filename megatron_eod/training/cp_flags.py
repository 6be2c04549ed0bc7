"""The context-parallel flags, and the error every flag rule raises.

One job, for Megatron-LM's args: `resolve_cp_spellings(args)` makes one fact of the two
spellings of context parallelism (before Megatron-LM's validate_args): Megatron-LM's
`--cp-comm-type` maps onto ours, p2p = ring, a2a = ulysses, a2a+p2p with
`--hierarchical-context-parallel-sizes U CP/U` = hybrid with Ulysses degree U;
`--context-parallel-algo` / `--ulysses-degree-in-cp` may say the same instead (then the
hierarchical sizes are filled in for Megatron-LM to build the groups); saying both and
differently is an error naming both. `check_context_parallel(args)`, after it:
normalises `context_parallel_algo` (the Ascend spellings too), sets `ulysses_degree` from the
plan's one rule, and raises `FlagError` naming the flags; `check_sequence_parallel_rows(args)`
checks that sequence parallelism can split a rank's packed micro-batch over TP;
`check_gloo_on_cuda(args, cuda_available)` refuses what gloo on CUDA cannot overlap
(megatron/gloo_on_cuda.py reduces gradients bucket by bucket there); `check_gpu_attention`
refuses what the GPU flash kernels cannot take (float32, a head dim off their sizes) and
--use-flash-attn without CUDA or without a flash-attn the attention can use;
`check_query_groups` keeps --num-query-groups to Megatron-LM's meaning; `exit_with_error`
says a FlagError (or any start-up error) and exits.

What it does not do: no parsing (args.py).
"""

from __future__ import annotations

import sys
import warnings

from megatron_eod.attention.backends import flash_attn_problem
from megatron_eod.attention.triton_forward import (device_problem, interpreting_triton,
                                                   triton_problem)
from megatron_eod.attention.ring import RING_EXCHANGES
from megatron_eod.megatron import gloo_on_cuda
from megatron_eod.plan import ulysses_degree_for

__all__ = ["CONCURRENT_CALLS_HELP", "attention_head_dim", "CP_ALGO_ALIASES", "FUSED_BACKWARD_HELP",
           "FUSED_FORWARD_HELP", "FlagError",
           "RING_EXCHANGES",
           "RING_EXCHANGE_HELP", "check_context_parallel", "check_gloo_on_cuda",
           "check_gpu_attention", "check_hybrid_degree", "check_query_groups",
           "check_sequence_parallel_rows", "exit_with_error", "resolve_cp_spellings",
           "say_error"]

RING_EXCHANGE_HELP = ("how ring and hybrid CP move keys/values: batched (default: all of a "
                      "layer's transfers at once, 2 attention calls per direction), "
                      "batched-keep (the same, the received keys/values kept from forward to "
                      "backward: no second exchange and the gradients' return overlapped, for "
                      "the memory of those rows per layer) or steps (one transfer, call and "
                      "merge per ring step; holds less received data and overlaps every "
                      "transfer with compute)")

CONCURRENT_CALLS_HELP = ("on GPUs, run each CP rank's attention kernel calls side by side on "
                         "CUDA streams (batched ring executors): the local call beside the "
                         "call over received keys and, where the kernel writes into given "
                         "tensors (PyTorch >= 2.12's forward, flash-attn 2.7-2.8's forward, "
                         "flash-attn's backward), the local call in two parts, the one with "
                         "the longest document first, so that each call's tail is filled by "
                         "the others' blocks; no effect on CPU. On one H200 (attention alone, "
                         "docs/BENCHMARKS.md) 0.02-0.06x of the ideal faster at 128k tokens "
                         "by the wall clock, 0.04-0.08x by the device's with "
                         "--cp-fused-forward; the default on GPUs with a ring (ring, hybrid) "
                         "and a batched exchange (training/gpu_defaults.py); "
                         "--no-cp-concurrent-calls turns it off")

FUSED_FORWARD_HELP = ("on GPUs, run the attention forward of the batched executors (ring and "
                      "hybrid groups; Ulysses' and CP=1's one call too) as ONE fused Triton "
                      "kernel over query tiles, longest first, each row's received and local "
                      "keys in one softmax (attention/triton_forward.py): one launch per half "
                      "of the exchange instead of two calls and a log-sum-exp merge; the "
                      "backward is unchanged; a plan that falls back to the steps executor "
                      "(a rank receiving over 4x its rows) is not fused, said once. Needs "
                      "CUDA and Triton (PyTorch's CUDA wheels bring it). On one H200 the "
                      "busiest rank's forward went from 1.15-1.43x the ideal to 0.95-1.11x, "
                      "and with --cp-concurrent-calls its attention to 1.00-1.07x (device "
                      "time; docs/BENCHMARKS.md). The default on GPUs where its kernel "
                      "compiles and fits (else PyTorch's flash kernels, said once); "
                      "--no-cp-fused-forward turns it off")

FUSED_BACKWARD_HELP = ("with --cp-fused-forward, the backward too as fused Triton kernels "
                       "(attention/triton_backward.py): dq over the forward's query tiles, "
                       "dk/dv over key tiles with every query head of a key/value head, no "
                       "atomics; with --cp-concurrent-calls the local keys' dk/dv beside "
                       "the rest. Exact, but on one H200 2.1-2.3x slower than PyTorch's "
                       "backward (before its dk/dv kernel's rewrite, not yet timed): for work "
                       "on the kernels, not for training")

# Accepted --context-parallel-algo values -> the name stored in args.context_parallel_algo.
CP_ALGO_ALIASES = {"ring": "ring", "ulysses": "ulysses", "hybrid": "hybrid",
                   "megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses",
                   "hybrid_cp_algo": "hybrid"}


class FlagError(ValueError):
    """An invalid flag or flag combination; the message names the flags and the rule."""


def exit_with_error(error, code: int):
    """`pretrain_gpt.py: error: <error>` on this rank's stderr, then exit with `code`.

    Every rank says it, not rank 0 alone: the ranks meet the same error (the same flags, the
    same data, a gathered check), and torchrun ends the others as soon as the first exits, so
    rank 0's line was lost whenever another rank got there first (a rank 0 starting 3 s late
    lost it every time)."""
    say_error(f"pretrain_gpt.py: error: {error}")
    raise SystemExit(code) from None


def say_error(line: str) -> None:
    """`line` and its newline on stderr in ONE write: every rank says the same error at once,
    and print's two writes (the text, then the newline; stderr is unbuffered under torchrun)
    ran the ranks' lines together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def check_query_groups(args) -> None:
    """--num-query-groups counts only with --group-query-attention (Megatron-LM's meaning,
    one launch script, one model); without it Megatron-LM builds
    multi-head attention and says nothing, so a value given that would change the model is
    refused (None: not given)."""
    heads, groups = args.num_attention_heads, args.num_query_groups
    if not args.group_query_attention and groups not in (None, heads):
        raise FlagError(f"--num-query-groups {groups} without --group-query-attention: "
                        f"Megatron-LM ignores it and builds multi-head attention ({heads} "
                        f"key/value heads); add --group-query-attention, or drop "
                        f"--num-query-groups")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def check_hybrid_degree(given, cp: int, spelled: str = "--context-parallel-algo hybrid") -> None:
    """Hybrid's Ulysses degree `given` (--ulysses-degree-in-cp) at CP size `cp`: set, strictly
    between 1 and cp, dividing cp. `spelled`: how the user asked for hybrid."""
    _require(given is not None, f"{spelled} needs --ulysses-degree-in-cp")
    _require(1 < given < cp, f"--ulysses-degree-in-cp {given} must be > 1 and < "
                             f"--context-parallel-size {cp} for {spelled} (use ring for 1, "
                             f"ulysses for {cp})")
    _require(cp % given == 0, f"--ulysses-degree-in-cp {given} must divide "
                              f"--context-parallel-size {cp}")


def check_context_parallel(args) -> None:
    """The CP rules on any namespace with Megatron's attribute names (Megatron-LM's args too):
    normalises `context_parallel_algo`, sets `ulysses_degree`; FlagError names the flags."""
    algo = CP_ALGO_ALIASES.get(args.context_parallel_algo)
    _require(algo is not None, f"--context-parallel-algo {args.context_parallel_algo!r} is not "
                               f"supported; choose one of {', '.join(CP_ALGO_ALIASES)}")
    args.context_parallel_algo = algo
    cp, tp, given = (args.context_parallel_size, args.tensor_model_parallel_size,
                     args.ulysses_degree_in_cp)
    _require(args.seq_length % cp == 0, f"--seq-length {args.seq_length} must be divisible by "
                                        f"--context-parallel-size {cp}")
    # Flag-worded checks first; the degree itself comes from the plan's one rule.
    _require(algo != "ring" or given in (None, 1),
             f"--ulysses-degree-in-cp {given} contradicts --context-parallel-algo ring "
             f"(Ulysses degree 1)")
    _require(algo != "ulysses" or given in (None, cp),
             f"--ulysses-degree-in-cp {given} contradicts --context-parallel-algo ulysses "
             f"(degree = --context-parallel-size {cp})")
    if algo == "hybrid":
        check_hybrid_degree(given, cp)
    degree = ulysses_degree_for(algo, cp, given)
    source = {"ring": None, "ulysses": "--context-parallel-size",
              "hybrid": "--ulysses-degree-in-cp"}[algo]
    heads_per_rank = args.num_attention_heads // tp
    _require(source is None or heads_per_rank % degree == 0,
             f"--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size "
             f"{tp} = {heads_per_rank} heads per rank must be divisible by {source} {degree} "
             f"(--context-parallel-algo {algo} spreads heads over the Ulysses group)")
    args.ulysses_degree = degree
    exchange = getattr(args, "cp_ring_exchange", "batched")  # argparse checked the choice
    if exchange != "batched" and (cp == 1 or algo == "ulysses"):
        warnings.warn(f"--cp-ring-exchange {exchange} has no effect with "
                      f"--context-parallel-size {cp} --context-parallel-algo {algo} (no ring)")
    _require(not getattr(args, "cp_fused_forward", False) or exchange != "steps",
             "--cp-fused-forward fuses the batched ring executors' forward: it needs "
             "--cp-ring-exchange batched or batched-keep, not steps")
    if getattr(args, "cp_concurrent_calls", False):
        _require(exchange != "steps",
                 "--cp-concurrent-calls runs the batched ring executors' two calls side by "
                 "side: it needs --cp-ring-exchange batched or batched-keep, not steps")
        if cp == 1 or algo == "ulysses":
            warnings.warn(f"--cp-concurrent-calls with --context-parallel-size {cp} "
                          f"--context-parallel-algo {algo} (no ring: one call per layer) only "
                          f"splits that call in two, which takes a kernel writing into given "
                          f"tensors (PyTorch >= 2.12's forward, flash-attn 2.7-2.8's forward, "
                          f"flash-attn's backward); without one it has no effect")


def check_sequence_parallel_rows(args) -> None:
    """Sequence parallelism splits a rank's packed micro-batch, mbs x s / cp tokens, over the
    TP group: training's, and evaluation's where Megatron-LM (>= 0.18) has its own
    --eval-micro-batch-size. Caught at start-up, not at the first step or evaluation."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if not args.sequence_parallel or tp == 1:
        return
    for dest in ("micro_batch_size", "eval_micro_batch_size"):
        rows = getattr(args, dest, None)
        tokens = None if rows is None else rows * args.seq_length // cp
        _require(tokens is None or tokens % tp == 0,
                 f"--sequence-parallel needs --{dest.replace('_', '-')} x --seq-length / "
                 f"--context-parallel-size = {tokens} tokens divisible by "
                 f"--tensor-model-parallel-size {tp}")


def check_gloo_on_cuda(args, cuda_available: bool) -> None:
    """--distributed-backend gloo with CUDA reduces gradients one bucket at a time,
    synchronously (megatron/gloo_on_cuda.py): the overlap flags cannot work there."""
    if not gloo_on_cuda.wanted(args, cuda_available):
        return
    for flag in ("overlap_grad_reduce", "overlap_param_gather"):
        _require(not getattr(args, flag, False),
                 f"--{flag.replace('_', '-')} needs --distributed-backend nccl on CUDA (with "
                 f"gloo, CUDA gradients are reduced one bucket at a time, synchronously)")


def attention_head_dim(args):
    """The head dim the attention kernels see: --kv-channels (default --hidden-size /
    --num-attention-heads); with --multi-latent-attention the wider of q/k's (--qk-head-dim +
    --qk-pos-emb-head-dim) and v's (--v-head-dim), the narrower being padded to it
    (megatron/core_attention.py). None where the flags do not say yet."""
    if getattr(args, "multi_latent_attention", False):
        return max(args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim)
    head_dim = getattr(args, "kv_channels", None)
    if head_dim is None and getattr(args, "num_attention_heads", None):  # before validate_args
        head_dim = args.hidden_size // args.num_attention_heads
    return head_dim


def check_gpu_attention(args, cuda_available: bool) -> None:
    """The GPU attention kernels' rules, checked at start-up rather than at the first layer:
    FlashAttention-2 (PyTorch's or flash-attn's, called below their Python wrappers, which
    would pad) takes bf16 or fp16, and a head dim that is a multiple of 8, at most 256;
    --use-flash-attn needs CUDA and a flash-attn the attention can use (attention/backends.py:
    importable, >= 2.6)."""
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    _require(half or not cuda_available,
             "on CUDA the attention's flash kernels take bfloat16 or float16: pass --bf16 or "
             "--fp16 (float32 attention runs on CPU only)")
    head_dim = attention_head_dim(args)
    if cuda_available and head_dim is not None:
        _require(head_dim % 8 == 0 and head_dim <= 256,
                 f"the attention head dim (--kv-channels, default --hidden-size / "
                 f"--num-attention-heads; with --multi-latent-attention the wider of "
                 f"--qk-head-dim + --qk-pos-emb-head-dim and --v-head-dim) is {head_dim}: "
                 f"the GPU flash kernels take a multiple of 8, at most 256")
    _require(not getattr(args, "cp_fused_backward", False) or
             getattr(args, "cp_fused_forward", False),
             "--cp-fused-backward needs --cp-fused-forward (its kernels are the fused "
             "forward's backend's; the default on GPUs where it compiles)")
    if getattr(args, "cp_fused_forward", False):
        _require(cuda_available or interpreting_triton(),
                 "--cp-fused-forward needs CUDA (its Triton kernel runs on CPU tensors only "
                 "through Triton's interpreter, TRITON_INTERPRET=1, for tests); drop it on CPU")
        problem = triton_problem()
        _require(problem is None, f"--cp-fused-forward needs Triton: {problem}")
        if cuda_available and head_dim is not None and not interpreting_triton():
            problem = device_problem(head_dim, "bf16" if getattr(args, "bf16", False)
                                     else "fp16",
                                     backward=getattr(args, "cp_fused_backward", False))
            _require(problem is None, f"--cp-fused-forward: {problem}")
    if not getattr(args, "use_flash_attn", False):
        return
    _require(cuda_available, "--use-flash-attn needs CUDA; drop it on CPU")
    problem = flash_attn_problem()
    _require(problem is None, f"--use-flash-attn needs a usable flash-attn: {problem}; drop "
                              f"the flag to use PyTorch's varlen flash kernels")


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
