"""Two kernel calls at once: one of them queued on a side CUDA stream.

One job: let the batched ring (batched.py) run its local call beside its call over the
received keys, so that the second call's blocks fill the SMs the first one's tail leaves
idle. A varlen flash kernel lasts about its work / the GPU's slots plus a tail, set by its
longest blocks (the last query blocks of a long document) starting late; a CP rank's call
has 1/cp of the whole row's work over the same longest blocks, so its tail weighs cp times
more (tools/dispatch_model.py models it; docs/BENCHMARKS.md has the figures). Two calls on
one stream pay two tails; on two streams the later one's blocks run in the earlier one's.

    side = Beside(lambda: backend.forward(...), enabled)   # queued on the side stream, after
                                                           # all work queued so far
    ... more work on the current stream ...
    out, lse = side.result()   # the current stream waits for the side work (no host sync)

Several side streams (`which`) run several calls at once. A call launched after other work
was queued on the current stream, but independent of it, waits only for the work queued
before a `fork_point` taken earlier (`after=`): the batched ring launches its local call's
second part after the received keys' call without waiting for that call.

Memory: the side stream starts after everything the current stream had queued (its inputs
are ready), and the current stream waits for it before using its results; the tensors it
returns are marked as used by the current stream (`record_stream`), so the allocator does
not hand their memory to the side stream again before the current stream is done with them.
The inputs stay referenced by the caller until `result()`, after which the current stream's
later work is ordered after the side work. Disabled, or off CUDA: `fn` runs at once, in
order (the CPU path and its tests are unchanged).

What it does not do: no choice of what runs beside what (batched.py), no host syncs.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["Beside", "fork_point", "side_stream"]

_SIDE: Dict[Tuple[int, int], "torch.cuda.Stream"] = {}
SIDE_STREAMS = 2


def side_stream(device: torch.device, which: int = 0) -> "torch.cuda.Stream":
    """Side stream `which` (0 or 1) of a CUDA device (made on first use)."""
    if not 0 <= which < SIDE_STREAMS:
        raise ValueError(f"side stream {which}: there are {SIDE_STREAMS} (0 .. "
                         f"{SIDE_STREAMS - 1})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, which) not in _SIDE:
        _SIDE[index, which] = torch.cuda.Stream(device=index)
    return _SIDE[index, which]


def fork_point(device: torch.device, enabled: bool) -> Optional["torch.cuda.Event"]:
    """An event at the tip of the current stream of `device` (None disabled or off CUDA):
    `Beside(after=...)` then waits for the work queued before it only."""
    if not enabled or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


class Beside:
    """`fn()`'s kernels on side stream `which` of `device`, concurrent with the current
    stream's next work, after the current stream's work queued so far (or before `after`, a
    `fork_point`); `result()` joins them. Disabled or off CUDA: `fn()` runs now."""

    def __init__(self, fn: Callable, device: torch.device, enabled: bool, which: int = 0,
                 after: Optional["torch.cuda.Event"] = None):
        self._stream = None
        if not enabled or device.type != "cuda":
            self._value = fn()
            return
        self._current = torch.cuda.current_stream(device)
        side = side_stream(device, which)
        if after is not None:
            side.wait_event(after)
        else:
            side.wait_stream(self._current)
        with torch.cuda.stream(side):
            self._value = fn()
        self._stream = side

    def result(self):
        if self._stream is not None:
            self._current.wait_stream(self._stream)
            for t in _tensors(self._value):
                t.record_stream(self._current)
            self._stream = None
        return self._value
