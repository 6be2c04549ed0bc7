"""Megatron-LM's run-time switches for the lean trainer's loop: --manual-gc,
--empty-unused-memory-level and --exit-signal-handler.

One job: do what each switch asks at the points Megatron-LM's loop does it, and undo it
when the run ends (the loop may run inside a longer-lived process: tests, a notebook):

    controls = RunControls(args)        # at start-up: the signal handler, as Megatron-LM's
    controls.begin_training()           # --manual-gc: the collector off, one collection
    controls.after_forward_backward()   # level >= 1: CUDA cache back
    controls.after_step(iteration)      # level 2: CUDA cache back; gc every N iterations
    with controls.around_evaluation(): ...   # the loop's evaluations: full gc before,
                                             # generation 0 after (--no-manual-gc-eval: none)
    controls.signal_received()          # this rank's (the loop reduces it over ranks)
    controls.close()                    # gc and the previous signal handler restored

The signal is remembered, not acted on: the loop saves and stops after the iteration, on
every rank. Except when the launcher is gone: parent_watch asks Linux for SIGTERM when
torchrun's agent dies, and an orphan must stop then, not train on to a save its dead peers
never join; a signal that finds this process re-parented is delivered as if unhandled.

What it does not do: no collective, no save.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal

import torch

__all__ = ["RunControls"]


class RunControls:
    def __init__(self, args):
        self.args = args
        self.gc_was_enabled = gc.isenabled()
        self.gc_off = False
        self.received = False
        self.handling = False
        if args.exit_signal_handler:
            self.parent = os.getppid()
            self.signal = signal.Signals[args.exit_signal]
            self.previous_handler = signal.signal(self.signal, self._on_signal)
            self.handling = True

    def _on_signal(self, signum, frame):
        if os.getppid() != self.parent:  # the launcher died: PR_SET_PDEATHSIG's signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = True

    def signal_received(self) -> bool:
        return self.received

    def begin_training(self) -> None:
        if self.args.manual_gc:  # as Megatron-LM: off, and one full collection now
            gc.disable()
            self.gc_off = True
            gc.collect()

    def _empty_cache(self, level: int) -> None:
        if self.args.empty_unused_memory_level >= level and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def after_forward_backward(self) -> None:
        self._empty_cache(1)

    def after_step(self, iteration: int) -> None:
        self._empty_cache(2)
        interval = self.args.manual_gc_interval
        if self.args.manual_gc and interval and iteration % interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self):
        """An evaluation of the training loop (the final ones are not: Megatron-LM's are
        not)."""
        collect = self.args.manual_gc and self.args.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)  # what the evaluation made and dropped

    def close(self) -> None:
        if self.gc_off and self.gc_was_enabled:
            gc.enable()
        self.gc_off = False
        if self.handling:
            signal.signal(self.signal, self.previous_handler)
            self.handling = False
