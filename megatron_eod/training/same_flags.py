"""Whether every rank was launched with the same flags and the same versions.

One job: `check_same_flags(args, argv)`, called on every rank once the process group exists
and before any other group is made, raises FlagError on every rank when some
rank's parsed flags, or its torch / megatron-core version, differ from rank 0's, naming the
flag, both ranks with their hosts and both values.

Why: a launch script computes its flags on each node (an environment variable set on some
nodes only, a script edited while the job's nodes start one after another, a node's container
holding another megatron-core). Different parallel sizes leave the ranks waiting in
`initialize_model_parallel`; a different --lr, --seed or --clip-grad on some data-parallel
ranks trains on silently, the replicas drifting apart. Neither trainer compared flags.

Cheap on purpose: one gather of a 16-byte digest; only when two differ, rank 0 broadcasts its
values and each rank gathers what differs on it in words. Compared: every parsed value of a
plain kind (None, bool, int, float, str, torch.dtype, enums by name, and lists, tuples and
dicts of them; objects are skipped), except the rank's own numbers and what may differ by node
(`_PER_RANK`: log destinations, loader workers).
"""

from __future__ import annotations

import enum
import hashlib
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.every_rank import gathered

__all__ = ["check_same_flags", "comparable_values", "difference"]

# Parsed values that name the rank itself, or may differ from node to node without changing
# what is trained: where the one rank that logs writes (a launch script may stamp a time or
# host into it), how many loader or index-builder workers a node starts, how it reads a .bin.
_PER_RANK = frozenset({"rank", "local_rank", "tensorboard_dir", "wandb_save_dir",
                       "wandb_exp_name", "wandb_project", "wandb_entity", "metrics_file",
                       "config_logger_dir", "memory_snapshot_path", "num_workers",
                       "num_dataset_builder_threads", "mmap_bin_files"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype)
_VERSIONS = ("the torch version", "the megatron-core version")
_SHOWN = 3  # differences named in the message; the rest are counted
_LONGEST = 120  # characters of a value shown (a blend of 1,000 files is one value)


def _comparable(value):
    """A stable text for a plain value (enums by name), or None for an object."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (list, tuple)):
        items = [_comparable(item) for item in value]  # a namedtuple, a torch.Size: a tuple
        ends = "()" if isinstance(value, tuple) else "[]"
        return None if None in items else ends[0] + ", ".join(items) + ends[1]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _comparable(v) for k, v in value.items()}
        return None if None in items.values() else \
            "{" + ", ".join(f"{k!r}: {v}" for k, v in items.items()) + "}"
    return None


def _versions() -> dict:
    from megatron_eod.megatron.imports import import_megatron

    core = import_megatron("megatron.core.package_info")
    return dict(zip(_VERSIONS, (str(torch.__version__), str(getattr(core, "__version__", None)))))


def comparable_values(args) -> dict:
    """{name: stable text of its value} of every parsed value compared across ranks, plus the
    versions."""
    values = {}
    for name, value in sorted(vars(args).items()):
        text = None if name in _PER_RANK else _comparable(value)
        if text is not None:
            values[name] = text
    values.update(_versions())
    return values


def _spelled(name: str, argvs: Sequence[Sequence[str]], whose=(0, 1)) -> Optional[str]:
    """The option as the command lines `whose` (0: rank 0's, 1: this rank's) spell it
    (--override-opt_param-scheduler), or None."""
    dashed = name.replace("_", "-")
    for at in whose:
        for token in argvs[at]:
            option = token.split("=", 1)[0]
            if option.replace("_", "-") in (f"--{dashed}", f"--no-{dashed}"):
                return option
    return None


def _shown(value: str) -> str:
    return value if len(value) <= _LONGEST else value[:_LONGEST] + "..."


def _options(argv) -> set:
    return {token.split("=", 1)[0] for token in argv if token.startswith("--")}


def difference(reference: dict, ours: dict, argvs=((), ()),
               names=("rank 0", "this rank")) -> Optional[str]:
    """What differs between two ranks' `comparable_values`, in words, or None: the versions
    alone where they differ, else flags a command line gives first, then the values a default
    or other flags set; and the options one command line has and the other lacks (a flag
    stored under another name: --disable-bias-linear sets add_bias_linear)."""
    argvs = (tuple(argvs) + ((), ()))[:2]
    missing = "(not set)"
    differ = [name for name in reference.keys() | ours.keys()
              if reference.get(name, missing) != ours.get(name, missing)]
    if not differ:
        return None
    versions = [name for name in _VERSIONS if name in differ]
    differ = versions or sorted(differ, key=lambda name: (_spelled(name, argvs) is None, name))
    said = []
    for name in differ[:_SHOWN]:
        theirs, value = _shown(reference.get(name, missing)), _shown(ours.get(name, missing))
        option = None if name in _VERSIONS else _spelled(name, argvs)
        if option is None:
            what = name if name in _VERSIONS else f"{name} (a default, or set from other flags)"
            said.append(f"{what} {value} where {names[0]} has {theirs}")
        elif option.replace("_", "-").startswith("--no-") and \
                not name.replace("_", "-").startswith("no-"):
            if _spelled(name, argvs, (1,)) == option:
                said.append(f"{option}: {name} {value} where {names[0]} has {theirs}")
            else:  # rank 0's command line gave it
                said.append(f"{name} {value} where {names[0]} has {theirs} (its {option})")
        else:
            said.append(f"{option} {value} where {names[0]} has {theirs}")
    more = f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else ""
    added, lacking = (sorted(_options(argvs[1]) - _options(argvs[0])),
                      sorted(_options(argvs[0]) - _options(argvs[1])))
    lines = [f"{verb} {' '.join(options[:6])}{' ...' if len(options) > 6 else ''}"
             for verb, options in (("adds", added), ("lacks", lacking)) if options]
    command = f" (its command line {'; '.join(lines)})" if lines and not versions else ""
    return f"{names[1]} has {'; '.join(said)}{more}{command}"


def _digest(values: dict) -> str:
    return hashlib.blake2b(repr(sorted(values.items())).encode(), digest_size=16).hexdigest()



def check_same_flags(args, argv: Sequence[str]) -> None:
    """Raise FlagError on every rank unless every rank holds rank 0's `comparable_values`
    (a collective of the default group: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    values = comparable_values(args)
    if len(set(gathered(_digest(values)))) == 1:
        return
    host = socket.gethostname()
    sent = [(values, list(argv), host)]
    dist.broadcast_object_list(sent, src=0)
    reference, reference_argv, reference_host = sent[0]
    rank = dist.get_rank()
    ours = difference(reference, values, (reference_argv, list(argv)),
                      (f"rank 0 ({reference_host})", f"rank {rank} ({host})"))
    found = [said for said in gathered(ours) if said is not None]
    if not found:
        return
    raise FlagError(f"the ranks were launched with different flags: {found[0]} "
                    f"({len(found)} of {dist.get_world_size()} ranks differ from rank 0). "
                    f"Every rank must run with the same flags and versions: check what the "
                    f"launch script computes on each node")
