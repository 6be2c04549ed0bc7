"""Whether every rank was launched with the same flags and the same versions.

One job: `check_same_flags(args, argv)`, called on every rank once the process group exists
and before any other group is made (both trainers), raises FlagError on every rank when some
rank's parsed flags, or its torch / megatron-core version, differ from rank 0's, naming the
flag, both ranks with their hosts and both values.

Why: a launch script computes its flags on each node (an environment variable set on some
nodes only, a script edited while the job's nodes start one after another, a node's container
holding another megatron-core). Different parallel sizes leave the ranks waiting in
`initialize_model_parallel`; a different --lr, --seed or --clip-grad on some data-parallel
ranks trains on silently, the replicas drifting apart. Neither trainer compared flags.

Cheap on purpose: one gather of a 16-byte digest; only when two differ, rank 0 broadcasts its
values and each rank gathers what differs on it in words. Compared: every parsed value of a
plain kind (None, bool, int, float, str, torch.dtype, and lists, tuples and dicts of them;
objects are skipped), except the rank's own numbers (`_PER_RANK`).
"""

from __future__ import annotations

import hashlib
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eod.training.cp_flags import FlagError

__all__ = ["check_same_flags", "comparable_values", "difference"]

# Parsed values that name the rank itself.
_PER_RANK = frozenset({"rank", "local_rank"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype)
_SHOWN = 3  # differences named in the message; the rest are counted


def _plain(value) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _versions() -> dict:
    from megatron_eod.megatron.imports import import_megatron

    core = import_megatron("megatron.core.package_info")
    return {"the torch version": str(torch.__version__),
            "the megatron-core version": str(getattr(core, "__version__", None))}


def comparable_values(args) -> dict:
    """{name: repr(value)} of every parsed value compared across ranks, plus the versions."""
    values = {name: repr(value) for name, value in sorted(vars(args).items())
              if name not in _PER_RANK and _plain(value)}
    values.update(_versions())
    return values


def _spelled(name: str, argvs: Sequence[Sequence[str]]) -> str:
    """`--the-flag` when some rank's command line gives it, else the parsed name."""
    if name.startswith("the "):
        return name
    dashed = name.replace("_", "-")
    for argv in argvs:
        for token in argv:
            option = token.split("=", 1)[0]  # as spelled (--override-opt_param-scheduler)
            if option.replace("_", "-") in (f"--{dashed}", f"--no-{dashed}"):
                return option
    return f"{name} (a default, or set from other flags)"


def difference(reference: dict, ours: dict, argvs=((), ()),
               names=("rank 0", "this rank")) -> Optional[str]:
    """What differs between two ranks' `comparable_values`, in words, or None."""
    missing = "(not set)"
    differ = sorted((name for name in reference.keys() | ours.keys()
                     if reference.get(name, missing) != ours.get(name, missing)),
                    key=lambda name: (_spelled(name, argvs)[0] != "-", name))
    if not differ:
        return None
    said = [f"{_spelled(name, argvs)} {ours.get(name, missing)} where {names[0]} has "
            f"{reference.get(name, missing)}" for name in differ[:_SHOWN]]
    more = f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else ""
    return f"{names[1]} has {'; '.join(said)}{more}"


def _digest(values: dict) -> str:
    return hashlib.blake2b(repr(sorted(values.items())).encode(), digest_size=16).hexdigest()


def _gathered(item) -> list:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, item)
    return found


def check_same_flags(args, argv: Sequence[str]) -> None:
    """Raise FlagError on every rank unless every rank holds rank 0's `comparable_values`
    (a collective of the default group: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    values = comparable_values(args)
    if len(set(_gathered(_digest(values)))) == 1:
        return
    host = socket.gethostname()
    sent = [(values, list(argv), host)]
    dist.broadcast_object_list(sent, src=0)
    reference, reference_argv, reference_host = sent[0]
    rank = dist.get_rank()
    ours = difference(reference, values, (reference_argv, list(argv)),
                      (f"rank 0 ({reference_host})", f"rank {rank} ({host})"))
    found = [said for said in _gathered(ours) if said is not None]
    if not found:
        return
    raise FlagError(f"the ranks were launched with different flags: {found[0]} "
                    f"({len(found)} of {dist.get_world_size()} ranks differ from rank 0). "
                    f"Every rank must run with the same flags and versions: check what the "
                    f"launch script computes on each node")
