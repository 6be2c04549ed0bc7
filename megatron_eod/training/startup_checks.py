"""The checks every rank makes before Megatron-LM builds its process groups.

One job: `flags_compared_before_groups()`, a context in which each of Megatron-LM's
`initialize_model_parallel` calls (in-process restarts too) first
- compares every rank's flags and versions with rank 0's (same_flags.py: sizes differing
  would leave the ranks waiting in it; another --lr on some ranks would train on silently),
- checks that --save is one folder for every node (shared_folders.py) and that the last rank
  can append to --metrics-file (metrics.py),
- takes the --save folder's lock (save_lock.py: one job at a time there), released when the
  context ends.

What it does not do: no flag rules (args.py), no call of pretrain().
"""

from __future__ import annotations

import contextlib
import importlib
import sys

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.metrics import check_metrics_file
from megatron_eod.training.same_flags import check_same_flags
from megatron_eod.training.save_lock import (hold_save_folder, release_save_folder,
                                             written_folder)
from megatron_eod.training.shared_folders import check_shared_folders, save_folder

__all__ = ["flags_compared_before_groups"]


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

