"""Megatron-LM's checkpoint flags that its trainer would run into a wall with, caught at start-up.

One job: the rules megatron_lm_args.py applies around Megatron-LM's `validate_args` for
checkpoints: `--attention-dropout` given on the command line kept over the one
`--use-checkpoint-args` takes from a checkpoint (EoD attention has no dropout), the persistent
checkpoint worker refused without CUDA (it dies at the first save and the run waits), and
`--decoupled-lr` refused where this megatron-core cannot load the checkpoints it would write.

What it does not do: no loading (training/megatron_lm_run.py hooks Megatron-LM's).
"""

from __future__ import annotations

import importlib
import sys

from megatron_eod.training.cp_flags import FlagError

__all__ = ["check_decoupled_lr_checkpoints", "check_persistent_ckpt_worker",
           "keep_the_flags_attention_dropout"]


def _flag_value(argv, flag: str):
    """The last value `argv` gives `flag` (`--flag V` or `--flag=V`), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1:]
    return value


def keep_the_flags_attention_dropout(args) -> None:
    """--use-checkpoint-args: Megatron-LM sets --attention-dropout from the checkpoint's args
    whatever the flags say, and a checkpoint trained without EoD attention has its default,
    0.1, which EoD attention cannot run: the flags' value is kept over it (said on rank 0)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    given = _flag_value(sys.argv[1:], "--attention-dropout")
    if given is None or float(given) == args.attention_dropout:
        return
    if getattr(args, "rank", 0) == 0:
        print(f" megatron-eod: --attention-dropout {given} kept over the checkpoint's "
              f"{args.attention_dropout} (--use-checkpoint-args): EoD attention has no dropout",
              flush=True)
    args.attention_dropout = float(given)


def check_persistent_ckpt_worker(args, cuda_available: bool) -> None:
    """Megatron-LM's persistent checkpoint worker (--async-save --use-persistent-ckpt-worker)
    sets a CUDA device unconditionally: without CUDA the worker dies at the first save
    (ZeroDivisionError in its process) and the run waits for that save forever."""
    if cuda_available or not (getattr(args, "async_save", False)
                              and getattr(args, "use_persistent_ckpt_worker", False)):
        return
    raise FlagError("--use-persistent-ckpt-worker needs CUDA: Megatron-LM's worker sets a CUDA "
                    "device and, without one, dies at the first save while the run waits for "
                    "it; drop --use-persistent-ckpt-worker (Megatron-LM then saves "
                    "synchronously) or run on GPUs")


def check_decoupled_lr_checkpoints(args) -> None:
    """megatron-core 0.16's regular optimizer matches saved parameter groups to its own by
    (wd_mult, lr_mult, expert, decoupled) only: --decoupled-lr's group (the embedding and
    output layer) differs from the default group in its learning rate alone, one overwrites
    the other, and every --load of the run's own checkpoints stops with "loaded state dict
    contains a parameter group that doesn't match" (measured on CPU, both formats). Later
    megatron-cores (0.19.2) match by the learning rates too; the distributed optimizer loads
    by another path and resumes (one group's max/min LR in both, put right after the load:
    checkpoint_schedule.apply_schedule_choice)."""
    loads_optimizer = getattr(args, "load", None) and not (
        getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))
    if getattr(args, "decoupled_lr", None) is None or args.use_distributed_optimizer or not (
            getattr(args, "save", None) or loads_optimizer):
        return
    keys = getattr(importlib.import_module("megatron.core.optimizer.optimizer"),
                   "param_group_identifier_keys", ())
    if "max_lr" in keys:
        return
    raise FlagError(f"--decoupled-lr {args.decoupled_lr} without --use-distributed-optimizer: "
                    f"this megatron-core's optimizer cannot load the checkpoints this run would "
                    f"write (its decoupled and default parameter groups differ only in their "
                    f"learning rate, which it does not compare: a ValueError at every --load); "
                    f"add --use-distributed-optimizer, or use megatron-core >= 0.19")
