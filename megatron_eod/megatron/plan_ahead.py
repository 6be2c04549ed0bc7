"""Plan the next micro-batch while this one trains: the CP plan off the step's critical path.

One job: for every data stream (train, validation, test), read one micro-batch ahead and
plan it on a worker thread (`batch.plan_batch`: layout, plan, this rank's token index and
schedule), so `get_batch` finds its plan ready instead of computing it before the forward.

Reading stays on the step's thread and in lockstep over the tensor-parallel group, because
only the TP source rank holds the iterator: each call first broadcasts a small fixed-size
header from the source (which stream, whether a batch of it is already read, a stream to
forget, which reads happened and what each holds: its rows, or 0 at the end), then the
batches read. Peers key their
pending batch by the stream number the source sent, so the train and validation streams never
mix, and an exhausted iterator raises StopIteration on every TP rank at the same call instead
of hanging the peers in a broadcast. Samples keep their order: the batch read ahead is the
stream's next one. No worker thread is alive while a stream's first read runs: that read may
be where a data loader forks its worker processes (Megatron-LM's loader workers), and a fork
while this thread runs numpy or torch code can leave a lock it held locked forever in the
children. A stream is forgotten (its read-ahead batch dropped, on every
rank) only once its iterator no longer exists, so no live stream ever loses a sample. A read
ahead that raises (a sampler past its dataset's end, a bad batch) fails only if that
micro-batch is asked for, then on every TP rank: a run that ends exactly where its data ends
finishes. A read the step needs now that raises also raises on every TP rank (the peers are
told by the header instead of waiting in a broadcast that never comes).

Megatron-LM's rerun machine (--rerun-mode validate_results, its default) wraps each data
iterator in a RerunDataIterator that saves every micro-batch it hands out during an iteration
and, where a result fails validation, hands them out again (a replay). The micro-batch read
ahead is read beneath that wrapper (`_Lookahead`), so it is saved when the step asks for it,
as the next iteration's; a replayed micro-batch reuses the plan it was given when first read
(each rank keeps the plans of the iteration running, in the order the wrapper saved them:
the header says which).

What it does not do: no planning itself (batch.py), no choice of which stream comes next.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["PlanAhead", "ReadFailed", "read_or_failure", "header_size"]

Batch = Dict[str, object]  # tokens / labels / loss_mask tensors of one micro-batch


class ReadFailed:
    """A micro-batch whose read raised: the error on the source rank, None on its peers (the
    header's size -1 tells them); raised when the micro-batch is asked for."""

    def __init__(self, error: Optional[BaseException] = None):
        self.error = error

    def raise_(self):
        if self.error is not None:
            raise self.error
        raise RuntimeError("the tensor-parallel source rank (TP rank 0) could not read this "
                           "micro-batch; its error says why")


class PlanAhead:
    """next(iterator) -> (batch, planned), the plan computed one micro-batch early.

    read(iterator) -> batch or None at the end (called on the TP source rank only);
    share(header, batches) -> (header, batches): the source's header (HEADER_SIZE ints) and
        the batches `batches_in(header)` marks present, broadcast to the TP group (the
        identity without TP); peers pass [] and [];
    plan(batch) -> planned: host work, run on the worker thread;
    worker_init: run once on the worker thread first (e.g. select the CUDA device);
    size(batch) -> a positive int the header announces for each batch read, for peers to
        allocate it (e.g. its rows: training and evaluation micro-batches may differ); share
        sends no batch for a size of 0 (None: the stream ended) or -1 (ReadFailed()).
    """

    HEADER_SIZE = 8  # stream, pending, stream to forget (-1: none), reads, read 1 and read 2
    #                  sizes (0: the stream ended, -1: the read failed), the micro-batch's
    #                  place in its iteration (-1: nothing replays it), whether it is a replay

    def __init__(self, read: Callable, share: Callable, plan: Callable, is_source: bool,
                 worker_init: Optional[Callable[[], None]] = None,
                 size: Callable[[Batch], int] = lambda batch: 1):
        self.read, self.share, self.plan, self.is_source = read, share, plan, is_source
        self.worker_init, self.size = worker_init, size
        self.waited_s = 0.0  # seconds `next` waited for a plan (the step's cost of planning)
        self._iterators: Dict[int, Callable[[], object]] = {}  # source: stream -> (weak) ref
        self._streams_seen = 0
        self._pending: Dict[int, Tuple[Optional[Batch], Optional[Future]]] = {}
        self._kept: Dict[int, List[object]] = {}  # stream -> this iteration's plans, in order
        self._pool: Optional[ThreadPoolExecutor] = None

    @staticmethod
    def batches_in(header: List[int]) -> List[int]:
        """The sizes of the batches a header announces (0: the stream ended)."""
        return list(header[4:4 + header[3]])

    def next(self, iterator):
        header, read = self._read(iterator) if self.is_source else ([], [])
        header, read = self.share(header, read)
        stream, pending, forget = header[0], bool(header[1]), header[2]
        position, replay = header[6], bool(header[7])
        if forget >= 0:
            self._pending.pop(forget, None)
            self._kept.pop(forget, None)
        if replay:  # the batch read again; its plan is the one it had (the pending one stays)
            batch = read.pop(0)
            _raise_if_not_a_batch(batch)
            return batch, self._kept[stream][position]
        current = self._pending.pop(stream) if pending else self._start(read.pop(0))
        self._pending[stream] = self._start(read.pop(0)) if read else (None, None)
        batch, future = current
        _raise_if_not_a_batch(batch)
        start = time.perf_counter()
        planned = future.result()
        self.waited_s += time.perf_counter() - start
        if position >= 0:  # kept for a replay of this iteration
            kept = self._kept.setdefault(stream, [])
            if position == 0:
                kept.clear()
            kept.append(planned)
        return batch, planned

    def close(self) -> None:
        self._quiesce()
        self._pending.clear()
        self._kept.clear()

    def _quiesce(self) -> None:
        """The worker thread finished and gone (the plans submitted stay readable); the next
        plan starts another."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _read(self, iterator) -> Tuple[List[int], List[Optional[Batch]]]:
        """Source rank: the header and the batches read (None at the end)."""
        forget = next((n for n, ref in self._iterators.items() if ref() is None), -1)
        self._iterators.pop(forget, None)
        stream, new = self._stream(iterator)
        if new:
            self._quiesce()  # its first read may fork a loader's workers
        pending = stream in self._pending
        beneath = _lookahead(iterator)  # None: a plain iterator, read ahead directly
        position, replay = -1, False
        if beneath is not None:
            replay = bool(iterator.replaying)
            position = iterator.replay_pos if replay else len(iterator.saved_microbatches)
        reads: List[Optional[Batch]] = []
        if replay or not pending:
            reads.append(read_or_failure(self.read, iterator))  # a failure: every TP rank
        elif beneath is not None:  # the wrapper hands out (and saves) the one read ahead
            try:
                next(iterator)
            except Exception:  # noqa: BLE001 - the pending batch says it (end, failure)
                pass
        if beneath is not None and not replay and not iterator.saved_microbatches:
            position = -1  # --rerun-mode disabled: it saves nothing, replays nothing
        if not replay and _more(reads[-1] if reads else self._pending[stream][0]):
            # The next one, to plan while this one trains (from beneath the rerun machine's
            # wrapper: it is saved when asked for); a failure counts only if this micro-batch
            # is asked for.
            reads.append(read_or_failure(self.read, iterator if beneath is None
                                         else _Peek(beneath)))
        sizes = [header_size(b, self.size) for b in reads] + [0] * (2 - len(reads))
        return [stream, int(pending and not replay), forget, len(reads)] + sizes + [
            position, int(replay)], reads

    def _stream(self, iterator) -> Tuple[int, bool]:
        """Source rank: (the stream number of an iterator, whether it is new); a weak
        reference where the type allows one, so that a stream whose iterator is gone can be
        forgotten."""
        for number, ref in self._iterators.items():
            if ref() is iterator:
                return number, False
        number = self._streams_seen
        self._streams_seen += 1
        try:
            self._iterators[number] = weakref.ref(iterator)
        except TypeError:  # e.g. a list iterator: kept, and so never forgotten
            self._iterators[number] = lambda: iterator
        return number, True

    def _start(self, batch: Optional[Batch]):
        if not _more(batch):
            return batch, None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eod-plan",
                                            initializer=self.worker_init)
        return batch, self._pool.submit(self.plan, batch)


class _Lookahead:
    """Beneath a RerunDataIterator, in place of the iterator it wraps: `peek` reads the next
    item early (an error or the end kept as what the wrapper's next read then raises)."""

    def __init__(self, iterable):
        self.iterable, self._ahead = iterable, []

    def __iter__(self):
        return self

    def __next__(self):
        if not self._ahead:
            return next(self.iterable)
        item = self._ahead.pop()
        if isinstance(item, BaseException):
            raise item
        return item

    def peek(self):
        if not self._ahead:
            try:
                self._ahead.append(next(self.iterable))
            except Exception as error:  # noqa: BLE001 - StopIteration included: raised again
                self._ahead.append(error)
        if isinstance(self._ahead[0], BaseException):
            raise self._ahead[0]
        return self._ahead[0]


class _Peek:
    """An iterator whose next() is the lookahead's peek: what `read` reads ahead from."""

    def __init__(self, lookahead: _Lookahead):
        self.lookahead = lookahead

    def __next__(self):
        return self.lookahead.peek()


def _lookahead(iterator) -> Optional[_Lookahead]:
    """The lookahead beneath Megatron-LM's RerunDataIterator (put there on first use), or None
    for any other iterator."""
    if not all(hasattr(iterator, name) for name in ("iterable", "replaying", "replay_pos",
                                                    "saved_microbatches")):
        return None
    if not isinstance(iterator.iterable, _Lookahead):
        iterator.iterable = _Lookahead(iterator.iterable)
    return iterator.iterable


def _raise_if_not_a_batch(batch) -> None:
    if batch is None:
        raise StopIteration
    if isinstance(batch, ReadFailed):
        batch.raise_()


def _more(batch) -> bool:
    """Whether the stream goes on after `batch` (not its end, nor a failed read)."""
    return batch is not None and not isinstance(batch, ReadFailed)


def read_or_failure(read: Callable, iterator):
    """read(iterator), or ReadFailed holding what it raised (to be raised on every TP rank)."""
    try:
        return read(iterator)
    except Exception as error:
        return ReadFailed(error)


def header_size(batch, size: Callable) -> int:
    """What a header announces for a read: size(batch), 0 at the stream's end, -1 where the
    read failed."""
    if batch is None:
        return 0
    return -1 if isinstance(batch, ReadFailed) else size(batch)
