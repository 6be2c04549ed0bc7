"""The communication rules NCCL enforces and gloo does not, checked on gloo by recording every
point-to-point operation of real ring and hybrid attention (forward and backward, both ring
executors) at CP 2-8 on random layouts, where they reach torch.distributed
(`batch_isend_irecv`, the only p2p call comm.py makes):

1. a group's first batched p2p call may leave ranks out only after a collective on the group
   (PyTorch's rule): every rank warms each group up before its first p2p on it;
2. NCCL matches p2p messages between a pair by order, not by tag: for every ordered pair of
   ranks, the messages src sends to dst, in order, are exactly those dst receives from src,
   in order: the same sizes and dtypes, and the same tags (gloo matches by tag, so a tag
   names the message on both sides: two messages of one size sent in the other order, keys
   for values say, would pass gloo and land in the wrong buffers on NCCL).
A checker that cannot fail proves nothing: it is also run on logs with a swapped pair of
messages (of other sizes, and of one size with other tags) and with a p2p before the
warm-up, and must flag each.
"""

import contextlib

import pytest
import torch.distributed as dist

import megatron_eod.attention.comm as comm
import megatron_eod.attention.ring as ring
from megatron_eod import build_doc_layout, plan_context_parallel
from tests.attention.test_context_parallel_attention import EOD, _check_rank
from tests.harness import run_ranks
from tests.reference import random_layout_tokens


@contextlib.contextmanager
def recording(log):
    """Append every p2p operation of this rank to `log` while inside, and every warm-up that
    runs its collective (a group seen for the first time). A group is named by its ranks and
    its object's id: two groups of the same ranks (WORLD and a hybrid ring group of degree 1)
    are warmed up apart."""
    real_batch, real_warm = dist.batch_isend_irecv, ring.warm_up

    def named(group):
        return tuple(dist.get_process_group_ranks(group)), id(group)

    def batch_isend_irecv(ops):
        me = dist.get_rank()
        log.append(("batch", len(ops)))
        for op in ops:
            what = (op.tensor.numel(), str(op.tensor.dtype), op.tag)
            if op.op is dist.isend:
                log.append(("send", named(op.group), me, op.peer, what))
            else:
                log.append(("recv", named(op.group), op.peer, me, what))
        return real_batch(ops)

    def warm_up(group, device):
        if not comm.is_warm(group):
            log.append(("warm", named(group)))
        return real_warm(group, device)

    dist.batch_isend_irecv, ring.warm_up = batch_isend_irecv, warm_up
    try:
        yield log
    finally:
        dist.batch_isend_irecv, ring.warm_up = real_batch, real_warm


def _recorded(rank, world, algo, degree, kind, b, s, seed, exchange):
    log = []
    with recording(log):
        _check_rank(rank, world, algo, degree, kind, b, s, 2, None, seed, exchange)
    return log


def violations(logs):
    """Rule breaks in per-rank op logs (see the module docstring)."""
    found = []
    for rank, log in enumerate(logs):
        warm = set()
        for entry in log:
            if entry[0] == "warm":
                warm.add(entry[1])
            elif entry[0] != "batch" and entry[1] not in warm:
                found.append(f"rank {rank}: p2p on group {entry[1][0]} before any collective "
                             f"on it")
    sent, received = {}, {}
    for log in logs:
        for entry in log:
            if entry[0] in ("send", "recv"):
                kind, (ranks, _), src, dst, what = entry
                (sent if kind == "send" else received).setdefault((ranks, src, dst),
                                                                  []).append(what)
    for key in set(sent) | set(received):
        if sent.get(key, []) != received.get(key, []):
            found.append(f"{key[1]} -> {key[2]} in group {key[0]}: sends {sent.get(key, [])} "
                         f"but receives {received.get(key, [])}")
    return found


@pytest.mark.parametrize("exchange", ["batched", "batched-keep", "steps"])
@pytest.mark.parametrize("algo,world,degree", [
    ("ring", 2, None), ("ring", 4, None), ("ring", 8, None), ("hybrid", 4, 2),
    ("hybrid", 8, 2), ("hybrid", 8, 4)])
@pytest.mark.parametrize("kind,b,s,seed", [("mixed", 2, 96, 3), ("spanning", 1, 128, 5),
                                           ("short", 3, 32, 7)])
def test_ring_and_hybrid_obey_nccl_p2p_rules(algo, world, degree, kind, b, s, seed, exchange):
    logs = run_ranks(_recorded, world, algo, degree, kind, b, s, seed, exchange)
    assert all(log and log[0][0] == "warm" for log in logs)  # every rank ran ring attention
    if kind == "spanning":  # a document over every rank: keys/values must move
        assert any(entry[0] == "send" for log in logs for entry in log)
    assert violations(logs) == []
    tokens = random_layout_tokens(kind, b, s, EOD, seed)
    plan = plan_context_parallel(build_doc_layout(tokens, EOD).cu_seqlens, world, algo, degree)
    if exchange != "steps" and plan.batched_ring:  # one batched call for keys/values
        for log in logs:  # forward, one backward (none when kept), one for the gradients,
            calls = sum(entry[0] == "batch" for entry in log)  # whatever R
            most = 2 if exchange == "batched-keep" else 3
            assert calls <= most and (calls >= 1 or kind != "spanning"), calls


def test_the_checker_flags_order_and_warm_up_breaks():
    group, twin = ((0, 1), 7), ((0, 1), 8)  # the same ranks, two group objects
    good = [[("warm", group), ("send", group, 0, 1, (8, "f", 0)),
             ("send", group, 0, 1, (4, "f", 1)), ("send", group, 0, 1, (4, "f", 2))],
            [("warm", group), ("recv", group, 0, 1, (8, "f", 0)),
             ("recv", group, 0, 1, (4, "f", 1)), ("recv", group, 0, 1, (4, "f", 2))]]
    assert violations(good) == []
    swapped = [good[0], [good[1][0], good[1][2], good[1][1], good[1][3]]]
    assert violations(swapped) and "0 -> 1" in violations(swapped)[0]
    same_size = [good[0], [good[1][0], good[1][1], good[1][3], good[1][2]]]
    assert violations(same_size) and "0 -> 1" in violations(same_size)[0]
    cold = [good[0][1:], good[1]]
    assert any("before any collective" in v for v in violations(cold))
    cold_twin = [good[0] + [("send", twin, 0, 1, (2, "f", 3))],
                 good[1] + [("warm", twin), ("recv", twin, 0, 1, (2, "f", 3))]]
    assert [v for v in violations(cold_twin) if "rank 0" in v and "before" in v]
