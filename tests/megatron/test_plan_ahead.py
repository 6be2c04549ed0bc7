"""PlanAhead: plans one micro-batch ahead on a worker thread, keeps every stream's order,
keeps the train and validation streams apart on TP peers (which hold no iterator), and ends
a stream on every rank at the same call."""

import threading
import types

import pytest

from megatron_eod.megatron.plan_ahead import PlanAhead, ReadFailed


def counting_iterator(name, n):
    for i in range(n):
        yield f"{name}{i}"


class Pair:
    """A TP source and one peer wired in-process: the peer gets the source's header and
    batches, as the broadcasts would give them."""

    def __init__(self):
        self.wire = []
        self.planned_on = set()
        plan = self.plan
        self.source = PlanAhead(self.read, self.send, plan, is_source=True)
        self.peer = PlanAhead(self.read, self.receive, plan, is_source=False)

    @staticmethod
    def read(iterator):
        return next(iterator, None)

    def plan(self, batch):
        self.planned_on.add(threading.current_thread().name)
        return "plan of " + batch

    def send(self, header, batches):
        self.wire.append((list(header), list(batches)))
        return header, batches

    def receive(self, header, batches):
        assert header == [] and batches == []  # a peer reads nothing itself
        header, batches = self.wire.pop(0)
        # What steps._share gives a peer: nothing sent for a failed read, only its size -1.
        return header, [ReadFailed() if size == -1 else batch
                        for size, batch in zip(PlanAhead.batches_in(header), batches)]

    def next(self, iterator):
        """(source result, peer result): the peer passes None, as TP ranks > 0 do."""
        results = []
        for side, it in ((self.source, iterator), (self.peer, None)):
            try:
                results.append(side.next(it))
            except StopIteration:
                results.append(StopIteration)
            except RuntimeError as error:
                results.append(str(error))
        return tuple(results)


def test_streams_keep_their_order_and_peers_follow_the_source():
    pair = Pair()
    train, valid = counting_iterator("t", 5), counting_iterator("v", 3)
    order = [train, train, valid, train, valid, valid, valid, train, train, train]
    want = ["t0", "t1", "v0", "t2", "v1", "v2", StopIteration, "t3", "t4", StopIteration]
    for iterator, expected in zip(order, want):
        source, peer = pair.next(iterator)
        assert source == peer
        if expected is StopIteration:
            assert source is StopIteration
        else:
            assert source == (expected, "plan of " + expected)
    assert pair.planned_on and all(name.startswith("eod-plan") for name in pair.planned_on)


def test_the_next_batch_is_read_and_planned_before_it_is_asked_for():
    pair = Pair()
    train = counting_iterator("t", 10)
    pair.next(train)
    batch, future = pair.source._pending[0]
    assert batch == "t1" and future is not None  # read ahead, its plan submitted
    assert future.result() == "plan of t1"
    assert pair.next(train)[0] == ("t1", "plan of t1")


class Stream:
    """A finite iterator that can be weakly referenced (like a DataLoader iterator)."""

    def __init__(self, name, n):
        self.items = iter([f"{name}{i}" for i in range(n)])

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)


def test_a_stream_is_forgotten_only_once_its_iterator_is_gone():
    pair = Pair()
    live = [Stream(f"s{k}_", 4) for k in range(12)]
    for iterator in live:  # many live streams: none loses its read-ahead batch
        assert pair.next(iterator)[0][0].endswith("_0")
    for iterator in live:
        assert pair.next(iterator)[0][0].endswith("_1")
    assert len(pair.source._pending) == len(pair.peer._pending) == 12
    gone = Stream("gone", 3)
    pair.next(gone)
    del gone  # its iterator no longer exists: the next call forgets it on every rank
    assert pair.next(live[0])[0][0] == "s0_2"
    assert pair.source._pending.keys() == pair.peer._pending.keys()
    assert len(pair.source._pending) == 12
    kept = counting_iterator("g", 3)  # generators can be weakly referenced too
    assert pair.next(kept)[0][0] == "g0"


def test_an_error_while_planning_reaches_the_step():
    def plan(batch):
        raise ValueError(f"cannot plan {batch}")

    ahead = PlanAhead(lambda it: next(it, None), lambda h, b: (h, b), plan, is_source=True)
    with pytest.raises(ValueError, match="cannot plan a0"):
        ahead.next(counting_iterator("a", 3))
    ahead.close()


def ends_with_an_error(name, n):
    """Like training/data.MicroBatches: past its dataset's end it raises, not StopIteration."""
    yield from counting_iterator(name, n)
    raise RuntimeError(f"{name} has {n} samples")


def test_a_read_ahead_that_fails_matters_only_if_its_batch_is_asked_for():
    """A run that ends exactly where its data ends finishes (the read ahead of the batch past
    the end failed, and nobody asks for it); asking for that batch raises the source's error
    on the source and a RuntimeError naming it on the peer, at the same call."""
    pair = Pair()
    data = ends_with_an_error("t", 3)
    assert [pair.next(data)[0][0] for _ in range(3)] == ["t0", "t1", "t2"]
    source, peer = pair.next(data)
    assert source == "t has 3 samples" and "TP rank 0) could not read" in peer
    pair.source.close()


def test_a_read_the_step_needs_now_fails_on_every_tp_rank():
    """The first read of a stream is needed at once: if it raises on the source, the peer is
    told through the header and raises too, instead of waiting for a batch that never comes."""
    def broken():
        raise RuntimeError("cannot read the first micro-batch")
        yield  # a generator

    pair = Pair()
    source, peer = pair.next(broken())
    assert source == "cannot read the first micro-batch"
    assert "TP rank 0) could not read" in peer


def test_no_planning_thread_lives_while_a_new_stream_is_first_read():
    """A stream's first read may be where its data loader forks its workers (Megatron-LM's
    validation loader at the first evaluation): a fork while the planning thread
    runs numpy/torch code can leave a lock it held locked in the children. Later reads of a
    stream keep the thread (no start-up cost per micro-batch)."""
    seen = []

    def read(iterator):  # whether this PlanAhead's worker thread is alive (other tests' may be)
        pool = ahead._pool
        seen.append(pool is not None and any(t.is_alive() for t in pool._threads))
        return next(iterator, None)

    ahead = PlanAhead(read, lambda header, batches: (header, batches), lambda b: "plan of " + b,
                      is_source=True)
    train, valid = Stream("t", 6), Stream("v", 4)
    for iterator in (train, train, train, valid, valid, train):
        ahead.next(iterator)
    ahead.close()
    # reads: t0 t1 (the stream's first), t2, t3, v0 v1 (first), v2, t4
    assert seen == [False, False, True, True, False, False, True, True]


def test_megatron_lms_replays_reuse_their_plans_and_keep_the_one_read_ahead(monkeypatch):
    """Megatron-LM's rerun machine (--rerun-mode validate_results) wraps each iterator in its
    RerunDataIterator, which saves an iteration's micro-batches and, after a failed
    validation, hands them out again. Read ahead beneath the wrapper, the next iteration's
    first micro-batch is saved with that iteration, not this one; the replayed micro-batches
    get the plans they had (the same objects, planned once), on the source and its TP peer;
    and the stream then goes on in order. Under --rerun-mode disabled nothing is kept."""
    from megatron.core import rerun_state_machine as machine

    planned = []

    class Counted(Pair):
        def plan(self, batch):
            planned.append(batch)
            return ["plan of " + batch]  # a new object each time it is planned

    for mode, kept in ((machine.RerunMode.VALIDATE_RESULTS, True),
                       (machine.RerunMode.DISABLED, False)):
        # The wrapper reads the mode of the process's rerun machine; a stand-in, since the
        # real one is a process global Megatron-LM's start-up in later forked ranks must
        # find unset.
        monkeypatch.setattr(machine, "get_rerun_state_machine",
                            lambda mode=mode: types.SimpleNamespace(get_mode=lambda: mode))
        planned.clear()
        pair = Counted()
        data = machine.RerunDataIterator(counting_iterator("t", 9))
        first = [pair.next(data) for _ in range(3)]  # an iteration of 3 micro-batches
        assert [source[0] for source, _ in first] == ["t0", "t1", "t2"]
        for side in (pair.source, pair.peer):  # t3's plans done (they run on worker threads)
            side._pending[0][1].result()
        planned_once = sorted(["t0", "t1", "t2", "t3"] * 2)  # source and peer, t3 ahead
        assert sorted(planned) == planned_once
        assert len(data.saved_microbatches) == (3 if kept else 0)
        if not kept:
            assert pair.source._kept == pair.peer._kept == {}
            pair.source.close()
            pair.peer.close()
            continue
        data.rewind()  # a result failed validation: the iteration runs again
        again = [pair.next(data) for _ in range(3)]
        for (source, peer), (source_0, peer_0) in zip(again, first):
            assert source[0] == peer[0] == source_0[0]
            assert source[1] is source_0[1] and peer[1] is peer_0[1]  # the plan it had
        assert sorted(planned) == planned_once  # nothing planned again
        data.advance()  # the next iteration: the one read ahead first, saved with it
        source, peer = pair.next(data)
        assert source == peer == ("t3", ["plan of t3"])
        assert len(data.saved_microbatches) == 1 and data.saved_microbatches[0] == "t3"
        pair.source.close()  # both: t4 is being planned on each side's worker thread
        pair.peer.close()
