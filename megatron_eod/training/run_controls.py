"""Megatron-LM's run-time switches for the lean trainer's loop: --manual-gc,
--empty-unused-memory-level and --exit-signal-handler.

One job: do what each switch asks at the points of an iteration Megatron-LM's loop does it,
and undo it when the run ends (the loop may run inside a longer-lived process: tests, a
notebook):

    controls = RunControls(args)        # gc off, signal handler on, as asked
    controls.after_forward_backward()   # level >= 1: CUDA cache back
    controls.after_step(iteration)      # level 2: CUDA cache back; gc every N iterations
    with controls.around_evaluation(): ...
    controls.signal_received()          # this rank's (the loop reduces it over ranks)
    controls.close()                    # gc and the previous signal handler restored

What it does not do: no collective (the loop reduces the signal flag with its other exit
checks, one all-reduce an iteration), no save.
"""

from __future__ import annotations

import contextlib
import gc
import signal

import torch

__all__ = ["RunControls"]


class RunControls:
    def __init__(self, args):
        self.args = args
        self.gc_was_enabled = gc.isenabled()
        self.received = False
        self.handling = False
        if args.manual_gc:  # as Megatron-LM: off, and one full collection now
            gc.disable()
            gc.collect()
        if args.exit_signal_handler:
            self.signal = signal.Signals[args.exit_signal]
            self.previous_handler = signal.signal(self.signal, self._on_signal)
            self.handling = True

    def _on_signal(self, signum, frame):
        self.received = True

    def signal_received(self) -> bool:
        return self.received

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
        collect = self.args.manual_gc and self.args.manual_gc_eval
        if collect:
            gc.collect()
        try:
            yield
        finally:
            if collect:
                gc.collect()

    def close(self) -> None:
        if self.args.manual_gc and self.gc_was_enabled:
            gc.enable()
        if self.handling:
            signal.signal(self.signal, self.previous_handler)
            self.handling = False
