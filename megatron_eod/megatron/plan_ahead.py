"""Plan the next micro-batch while this one trains: the CP plan off the step's critical path.

One job: for every data stream (train, validation, test), read one micro-batch ahead and
plan it on a worker thread (`batch.plan_batch`: layout, plan, this rank's token index and
schedule), so `get_batch` finds its plan ready instead of computing it before the forward.

Reading stays on the step's thread and in lockstep over the tensor-parallel group, because
only the TP source rank holds the iterator: each call first broadcasts a small header from
the source (which stream, whether a batch of it is already read, which reads hit the end),
then the batches. Peers key their pending batch by the stream number the source sent, so the
train and validation streams never mix, and an exhausted iterator raises StopIteration on
every TP rank at the same call instead of hanging the peers in a broadcast. Samples keep
their order: the batch read ahead is the stream's next one.

What it does not do: no planning itself (batch.py), no choice of which stream comes next.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["PlanAhead"]

Batch = Dict[str, object]  # tokens / labels / loss_mask tensors of one micro-batch


class PlanAhead:
    """next(iterator) -> (batch, planned), the plan computed one micro-batch early.

    read(iterator) -> batch or None at the end (called on the TP source rank only);
    share(header, batches) -> (header, batches): the source's header (list of ints) and
        batches, broadcast to the TP group (the identity without TP);
    plan(batch) -> planned: host work, run on the worker thread.
    """

    MAX_STREAMS = 8  # streams remembered; an older one loses its read-ahead batch

    def __init__(self, read: Callable, share: Callable, plan: Callable, is_source: bool):
        self.read, self.share, self.plan, self.is_source = read, share, plan, is_source
        self.waited_s = 0.0  # seconds `next` waited for a plan (the step's cost of planning)
        self._iterators: Dict[int, object] = {}  # source rank: stream number -> iterator
        self._streams_seen = 0
        self._recent: "OrderedDict[int, None]" = OrderedDict()  # same order on every rank
        self._pending: Dict[int, Tuple[Optional[Batch], Optional[Future]]] = {}
        self._pool: Optional[ThreadPoolExecutor] = None

    def next(self, iterator):
        header, read = self._read(iterator) if self.is_source else ([], [])
        header, read = self.share(header, read)
        stream, pending = header[0], bool(header[1])
        self._touch(stream)
        current = self._pending.pop(stream) if pending else self._start(read.pop(0))
        self._pending[stream] = self._start(read.pop(0)) if read else (None, None)
        batch, future = current
        if batch is None:
            raise StopIteration
        start = time.perf_counter()
        planned = future.result()
        self.waited_s += time.perf_counter() - start
        return batch, planned

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending.clear()

    def _read(self, iterator) -> Tuple[List[int], List[Optional[Batch]]]:
        """Source rank: [stream, pending, reads...] and the batches read (None at the end)."""
        stream = self._stream(iterator)
        pending = stream in self._pending
        reads: List[Optional[Batch]] = []
        if not pending:
            reads.append(self.read(iterator))
        if (reads[-1] if reads else self._pending[stream][0]) is not None:
            reads.append(self.read(iterator))  # the next one, to plan while this one trains
        return [stream, int(pending), len(reads)] + [int(b is not None) for b in reads], reads

    def _stream(self, iterator) -> int:
        """Source rank: the stream number of an iterator (holding it keeps ids unique)."""
        for number, known in self._iterators.items():
            if known is iterator:
                return number
        number = self._streams_seen
        self._streams_seen += 1
        self._iterators[number] = iterator
        return number

    def _touch(self, stream: int) -> None:
        """Every rank, from the header: most recent first out last; the oldest stream beyond
        MAX_STREAMS is forgotten (an iterator no longer used, e.g. a finished test run)."""
        self._recent[stream] = None
        self._recent.move_to_end(stream)
        while len(self._recent) > self.MAX_STREAMS:
            old, _ = self._recent.popitem(last=False)
            self._pending.pop(old, None)
            self._iterators.pop(old, None)

    def _start(self, batch: Optional[Batch]):
        if batch is None:
            return None, None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eod-plan")
        return batch, self._pool.submit(self.plan, batch)
