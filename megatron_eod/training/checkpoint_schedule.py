"""A resumed run's learning-rate schedule against its checkpoint's.

One job: the rules a resume follows for the optimizer's per-group schedule values (max/min
LR, start/end weight decay) that megatron-core's optimizer and OptimizerParamScheduler carry
in a checkpoint: the flags' values by default (refused by name where the schedule differs,
`schedule_mismatch`), the flags' with --override-opt_param-scheduler, the checkpoint's with
--use-checkpoint-opt_param-scheduler (`apply_schedule_choice`), and the saved param groups
paired with the current ones whatever megatron-core version pairs them by
(`schedule_values_to_flags`). Used by checkpoint_load.py, around Megatron-LM's own load.

What it does not do: no loading (Megatron-LM's), no scheduler of its own.
"""

from __future__ import annotations

import re

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.checkpoint_files import CheckpointError

__all__ = ["apply_schedule_choice", "group_lrs", "schedule_mismatch", "schedule_values_to_flags"]

_SCHEDULED = ("max_lr", "min_lr", "start_wd", "end_wd")  # per group, read by the scheduler

# megatron-core's OptimizerParamScheduler names for its values -> the flags that set them.
_SCHEDULE_FLAGS = {
    "learning rate": "--lr", "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters/-samples/-fraction",
    "total number of iterations": "--lr-decay-iters/-samples (default: --train-iters/-samples)",
    "learning rate decay style": "--lr-decay-style",
    "start weight decay": "--start-weight-decay", "end weight decay": "--end-weight-decay",
    "total number of weight decay iterations": "--train-iters/-samples",
    "weight decay incr style": "--weight-decay-incr-style"}


def schedule_mismatch(error: AssertionError, folder) -> str:
    """The line for megatron-core's assertion that a resumed run's LR schedule differs from
    its checkpoint's (a traceback on every rank, counting samples as 'iterations', naming
    no flag)."""
    found = re.search(r"class input value (.*) and checkpoint ?value (.*) for (.*) do not match",
                      str(error))
    if found is None:
        said = str(error)
    else:
        now, saved, name = found.groups()
        flag = _SCHEDULE_FLAGS.get(name, name)
        unit = " (in samples)" if "iterations" in name else ""
        said = f"{flag}: {now}{unit} here, {saved} in the checkpoint"
    return (f"--load {folder}: this run's learning-rate schedule differs from the checkpoint's: "
            f"{said}; pass --override-opt_param-scheduler to follow the flags, or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")


def group_lrs(optimizer):
    """Each optimizer param group's (max_lr, min_lr): the flags' before a load."""
    return [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]


def apply_schedule_choice(optimizer, flag_lrs, saved, override: bool, use_checkpoint: bool):
    """After the optimizer's load: the loaded param groups carry the checkpoint's per-group
    max/min LR, which megatron-core's scheduler reads before its own. With
    --use-checkpoint-opt_param-scheduler the checkpoint's stay (`saved`, from
    schedule_values_to_flags); otherwise the flags' values (`group_lrs` before the load) go
    back: with --override-opt_param-scheduler (megatron-core 0.16.1 alone kept the
    checkpoint's, unlike the flag's documentation), and without either flag, where the
    scheduler has checked that the flags' schedule is the checkpoint's, because megatron-core
    0.16 pairs groups without their LRs: --decoupled-lr's group (embedding and output layer)
    and the default one were one to it, and one's max/min LR came back in both."""
    if use_checkpoint and not override:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)
        return
    if not override:  # the scheduler compares --lr / --min-lr (the default groups' LRs);
        for group, (max_lr, min_lr), values in zip(optimizer.param_groups, flag_lrs, saved):
            if group.get("default_config", True):  # a group's own LRs (--decoupled-lr) here
                continue
            theirs = (values.get("max_lr", max_lr), values.get("min_lr", min_lr))
            if max_lr is not None and any(
                    a is not None and b is not None and abs(a - b) > 1e-9 * max(abs(a), abs(b))
                    for a, b in zip((max_lr, min_lr), theirs)):
                raise CheckpointError(
                    f"--load: a parameter group's learning rates differ from the checkpoint's: "
                    f"max/min LR {max_lr:g}/{min_lr:g} here, {theirs[0]:g}/{theirs[1]:g} in "
                    f"the checkpoint (--decoupled-lr / --decoupled-min-lr set them for the "
                    f"embedding and output layer); pass --override-opt_param-scheduler to "
                    f"follow the flags, or --use-checkpoint-opt_param-scheduler to keep the "
                    f"checkpoint's schedule")
    for group, (max_lr, min_lr) in zip(optimizer.param_groups, flag_lrs):
        if max_lr is not None:
            group["max_lr"], group["min_lr"] = max_lr, min_lr


def schedule_values_to_flags(loaded_optimizer, current_groups):
    """megatron-core 0.19 pairs each saved optimizer param group with a current one by its
    identifier keys, the schedule's per-group values (max/min LR, start/end weight decay)
    among them: a resume with another --lr found no group and stopped in the optimizer's
    load, before the scheduler's own rule (--override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler) had a say. Give each saved group the current
    group's values (paired by the other keys; earlier versions pair without them) and return
    the saved values per current group, for the run where the checkpoint wins (all three
    cases then as in megatron-core 0.16)."""
    saved_values = [{} for _ in current_groups]
    current_keys = [_structural_key(g) for g in current_groups]
    for groups in _saved_param_groups(loaded_optimizer):
        in_order = [_structural_key(g) for g in groups] == current_keys  # the same groups,
        for at, group in enumerate(groups):  # built alike: paired by place (several may
            key = _structural_key(group)     # share a key: --decoupled-lr's and the default)
            matches = [at] if in_order else [i for i, k in enumerate(current_keys) if k == key]
            if len(matches) != 1:
                continue  # no or several candidates: left to megatron-core's own pairing
            current = current_groups[matches[0]]
            for name in _SCHEDULED:
                if name in group and name in current:
                    saved_values[matches[0]][name] = group[name]
                    group[name] = current[name]
    return saved_values


def _structural_key(group) -> tuple:
    """megatron-core's own identifier of a param group, less the schedule's values."""
    keys = import_megatron("megatron.core.optimizer").param_group_identifier_keys
    return tuple(group.get(k) for k in keys if k not in _SCHEDULED)


def _saved_param_groups(state):
    """Every param-group list in a loaded optimizer state (megatron-core nests it in its
    wrappers: mixed precision, chained and distributed optimizers)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                yield value
            else:
                yield from _saved_param_groups(value)
    elif isinstance(state, (list, tuple)):
        for item in state:
            yield from _saved_param_groups(item)
