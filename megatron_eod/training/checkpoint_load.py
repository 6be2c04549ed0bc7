"""Around Megatron-LM's `load_checkpoint`: the start-up checks of --load and the LR flags.

One job: `hook_load_checkpoint(training)` wraps `training.load_checkpoint` (idempotent) so that
- checkpoint_preflight.py checks what it will read first (a damaged, incomplete or mismatched
  checkpoint is one line on every rank, before any file is loaded);
- its bare `sys.exit()` after a failed load (status 0, which a job scheduler reads as
  success) becomes exit 2 with a line;
- the loaded optimizer groups take the LR flags' values where --override-opt_param-scheduler
  asks for them (checkpoint_schedule.py), and a schedule that differs without a scheduler
  flag is one line naming the flags;
- a checkpoint Megatron-LM's rerun machine saved for examination, which this megatron-core
  cannot re-run from, is one line saying how to resume.

What it does not do: no loading of its own.
"""

from __future__ import annotations

import importlib

from megatron_eod.training.checkpoint_files import CheckpointError
from megatron_eod.training.checkpoint_preflight import find_checkpoint
from megatron_eod.training.checkpoint_schedule import (apply_schedule_choice, group_lrs,
                                                       schedule_mismatch,
                                                       schedule_values_to_flags)

__all__ = ["hook_load_checkpoint"]


def hook_load_checkpoint(training) -> None:
    """checkpoint_preflight's checks of --load (one line on every rank, where Megatron-LM's
    load failed with a traceback, or exited 0), Megatron-LM's load_checkpoint
    (a bare sys.exit() in it: exit 2 with a line), then the LR flags where
    --override-opt_param-scheduler asks for them: the loaded optimizer param groups carry the
    checkpoint's max/min LR, which megatron-core 0.16's scheduler reads before its own, so
    Megatron-LM said "overriding" and trained on at the checkpoint's LR. A schedule that
    differs without either scheduler flag: one line naming them."""
    original = training.load_checkpoint
    if getattr(original, "_eod", False):
        return

    def load_checkpoint(model, optimizer, scheduler, *rest, **kwargs):
        args = importlib.import_module("megatron.training").get_args()
        if _checks_its_checkpoint(args, rest, kwargs):
            find_checkpoint(args)
        flags = group_lrs(optimizer) if optimizer is not None else []
        saved = []  # the checkpoint's schedule values per current group
        if optimizer is not None:
            load = optimizer.load_state_dict

            def load_state_dict(state_dict, *a, **kw):  # megatron-core 0.19 pairs saved and
                # current groups by their max/min LR too: another --lr found none and stopped
                # the load before the scheduler flags had a say (checkpoint_schedule.py's rule)
                saved[:] = schedule_values_to_flags(state_dict, optimizer.param_groups)
                return load(state_dict, *a, **kw)

            optimizer.load_state_dict = load_state_dict
        try:
            result = original(model, optimizer, scheduler, *rest, **kwargs)
        except AssertionError as error:
            if "OptimizerParamScheduler" not in str(error):
                raise
            raise CheckpointError(schedule_mismatch(error, args.load)) from None
        except SystemExit as stop:  # its bare sys.exit() after a failed load: status 0
            if stop.code not in (None, 0):
                raise
            raise CheckpointError(f"--load {args.load}: Megatron-LM's load_checkpoint stopped "
                                  f"the run (its message above says why; it exits with status "
                                  f"0, which a job scheduler reads as success)") from None
        finally:
            if optimizer is not None:
                del optimizer.load_state_dict
        _check_rerun_state(importlib.import_module("megatron.training").get_args())
        if scheduler is not None and optimizer is not None:  # loaded anew: the groups too
            apply_schedule_choice(optimizer, flags, saved,
                                  scheduler.override_opt_param_scheduler,
                                  scheduler.use_checkpoint_opt_param_scheduler)
            scheduler.step(0)  # this iteration's LR from them
        return result

    load_checkpoint._eod = True
    training.load_checkpoint = load_checkpoint



def _checks_its_checkpoint(args, rest, kwargs) -> bool:
    """Whether checkpoint_preflight checks what this load_checkpoint call reads: --load (its
    default load_arg) on a local file system, without non-persistent checkpoints (which
    Megatron-LM may prefer to --load's)."""
    load_arg = kwargs.get("load_arg", rest[0] if rest else "load")
    paths = [p for p in (args.load, getattr(args, "pretrained_checkpoint", None)) if p]
    return (load_arg == "load" and not getattr(args, "non_persistent_ckpt_type", None)
            and not any("://" in path for path in paths))



def _check_rerun_state(args) -> None:
    """After a possible transient error, Megatron-LM's rerun machine saves a checkpoint "for
    further examination" and exits (status 17) in its state RERUNNING_IN_PLACE; resumed,
    megatron-core 0.16 re-enters that state without the saved state it re-runs from, and every
    rank stops with a TypeError deep in rerun_state_machine. One line instead, and the way to
    resume: --rerun-mode disabled ignores the machine's saved state (its load_state_dict)."""
    machine = importlib.import_module("megatron.core.rerun_state_machine")
    rsm = machine.get_rerun_state_machine()
    if rsm.state == machine.RerunState.RERUNNING_IN_PLACE and \
            getattr(rsm, "saved_state", True) is None:
        raise CheckpointError(
            f"--load {args.load}: Megatron-LM's rerun machine saved this checkpoint after a "
            f"possible transient error at iteration {rsm.current_iteration}, for examination; "
            f"this megatron-core cannot re-run that iteration from it (a TypeError on every "
            f"rank); pass --rerun-mode disabled to resume from it as from any checkpoint")

