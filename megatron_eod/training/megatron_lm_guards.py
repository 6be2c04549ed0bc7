"""The guards around Megatron-LM's own `pretrain()` that megatron_lm_run.py installs.

One job: what must hold or happen around that call on every rank, beside our flag rules:
- `flags_compared_before_groups()`: while it runs, each `initialize_model_parallel` first
  compares every rank's flags and versions with rank 0's (same_flags) and checks that --save
  is one folder for every node (shared_folders);
- `our_errors_end_restarts(pretrain, restarts)`: under --inprocess-restart our flag, data and
  checkpoint errors end nvidia-resiliency-ext's restarts instead of repeating;
- `timeout_minutes()`: --distributed-timeout-minutes for collective_faults' line, "?" before
  Megatron-LM parsed its flags.

What it does not do: no flag rules (megatron_lm_args.py), no call of pretrain().
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

from megatron_eod.data.checks import DatasetError
from megatron_eod.training.checkpointing import CheckpointError
from megatron_eod.training.cp_flags import FlagError, say_error
from megatron_eod.training.metrics_file import check_metrics_file
from megatron_eod.training.same_flags import check_same_flags
from megatron_eod.training.save_lock import (hold_save_folder, release_save_folder,
                                             written_folder)
from megatron_eod.training.shared_folders import check_shared_folders, save_folder

__all__ = ["flags_compared_before_groups", "our_errors_end_restarts", "timeout_minutes"]


@contextlib.contextmanager
def flags_compared_before_groups():
    """While Megatron-LM's pretrain() runs, each of its `initialize_model_parallel` calls
    first checks every rank's flags against rank 0's (sizes differing would leave the ranks
    waiting in it; another --lr on some ranks would train on silently) and that --save is
    one folder for every node (shared_folders)."""
    ps = importlib.import_module("megatron.core.parallel_state")
    original = ps.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):  # every call (in-process restarts too)
        flags = importlib.import_module("megatron.training").get_args()
        check_same_flags(flags, sys.argv[1:])
        check_shared_folders(save_folder(flags), FlagError)
        check_metrics_file(flags, FlagError)
        hold_save_folder(written_folder(flags), FlagError)  # one job at a time there
        return original(*args, **kwargs)

    ps.initialize_model_parallel = initialize_model_parallel
    try:
        yield
    finally:
        ps.initialize_model_parallel = original
        release_save_folder()


def timeout_minutes():
    try:
        return importlib.import_module("megatron.training").get_args(
            ).distributed_timeout_minutes
    except (AssertionError, AttributeError):  # before its args were parsed
        return "?"


def our_errors_end_restarts(pretrain, restarts):
    """Under --inprocess-restart, nvidia-resiliency-ext's Wrapper runs pretrain() again after
    any error, with no limit (Megatron-LM sets none): a flag, data or checkpoint error fails
    the same way every time, so it is said and then raised as the Wrapper's terminal
    RestartAbort. (Not run against the package here: it is not installed; the wiring is
    tested with a stand-in.)"""

    @functools.wraps(pretrain)
    def pretrain_once(*args, **kwargs):
        try:
            return pretrain(*args, **kwargs)
        except (FlagError, DatasetError, CheckpointError) as error:
            if not restarts["on"]:
                raise
            exception = importlib.import_module("nvidia_resiliency_ext.inprocess.exception")
            say_error(f"pretrain_gpt.py: error: {error}")
            raise exception.RestartAbort(str(error)) from None

    return pretrain_once
