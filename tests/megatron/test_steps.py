"""`EodGPTSteps.get_batch` on real ranks: TP 2 x CP 2 over gloo, a train and a validation
stream read alternately until both run out, with and without planning ahead; validation
micro-batches have other rows (Megatron-LM's --eval-micro-batch-size).

What this shows: TP peers (which hold no iterator) get the source's batches of the right
stream, size and order, every rank ends a stream at the same call (nobody hangs in a
broadcast), CP ranks compute identical plans (compared by a digest of the pieces), and
planning ahead changes nothing; a micro-batch of neither size is refused naming both flags.
"""

import hashlib

import pytest
import torch

from megatron_eod.megatron import cpu_compat
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.steps import EodGPTSteps
from tests.harness import run_ranks

EOD, SEQ, MBS, EVAL_MBS = 9, 32, 2, 3
ORDER = "ttvtvvvtttt"  # t: train (5 micro-batches), v: validation (3)


def stream(seed, n, rows=MBS):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        tokens = torch.randint(0, 10, (rows, SEQ), generator=gen)
        tokens[0, 0] = 100 * seed + i  # names the sample
        yield {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(rows, SEQ)}


def _rank(rank, world, plan_ahead):
    from megatron.core import parallel_state as ps

    cpu_compat.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    try:
        steps = EodGPTSteps(EOD, EodContextRegistry(), SEQ, MBS, algo="ring",
                            ulysses_degree=1, plan_ahead=plan_ahead,
                            eval_micro_batch_size=EVAL_MBS)
        source = ps.get_tensor_model_parallel_rank() == 0
        train, valid = (stream(1, 5), stream(2, 3, EVAL_MBS)) if source else (None, None)
        seen = []
        for which in ORDER:
            try:
                batch = steps.get_batch(train if which == "t" else valid)
            except StopIteration:
                seen.append((which, "end", None, 0))
                continue
            p = batch.plan.pieces
            digest = hashlib.sha1(b"".join(a.tobytes() for a in (p.start, p.end, p.group)))
            name = int(batch.tokens.flatten()[(batch.tokens.flatten() >= 100)].max()) \
                if (batch.tokens >= 100).any() else None
            seen.append((which, digest.hexdigest(), name, batch.tokens.numel()))
        steps.close()
        return ps.get_context_parallel_rank(), seen
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_tp_peers_follow_each_stream_and_stop_together(plan_ahead):
    results = run_ranks(_rank, 4, plan_ahead, timeout=120)
    by_rank = [seen for _, seen in results]
    # Each stream's samples in order, then its end (and again when asked again).
    assert [s[0] for s in by_rank[0]] == list(ORDER)
    # The sample's name lands on one of the CP ranks (0 and 2; 0/1 and 2/3 are TP pairs).
    names = [max(filter(None, (a[2], b[2])), default=None) if a[1] != "end" else "end"
             for a, b in zip(by_rank[0], by_rank[2])]
    assert names == [100, 101, 200, 102, 201, 202, "end", 103, 104, "end", "end"]
    # This CP rank's share of each micro-batch: its rows x SEQ / CP.
    assert [s[3] for s in by_rank[0] if s[1] != "end"] == [
        (EVAL_MBS if which == "v" else MBS) * SEQ // 2 for which in "ttvtvvtt"]
    # Every rank saw the same plans (identical on every CP rank, and on TP peers).
    digests = [[s[1] for s in seen] for seen in by_rank]
    assert all(d == digests[0] for d in digests)
    # Each TP pair holds the same rows: ranks 0/1 are one TP group, 2/3 the other.
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3]


def test_planning_ahead_gives_the_same_batches():
    ahead = run_ranks(_rank, 4, True, timeout=120)
    now = run_ranks(_rank, 4, False, timeout=120)
    assert ahead == now


def test_a_micro_batch_of_neither_size_names_both_flags():
    steps = EodGPTSteps(EOD, EodContextRegistry(), SEQ, MBS, eval_micro_batch_size=EVAL_MBS)
    with pytest.raises(ValueError, match=r"tokens has shape \(4, 32\), expected "
                                         r"\[--micro-batch-size, --seq-length\] = \[2, 32\] "
                                         r"or \[--eval-micro-batch-size, --seq-length\] = "
                                         r"\[3, 32\]"):
        steps._read(stream(1, 1, rows=4))
    assert steps._read(stream(1, 1, rows=EVAL_MBS))["tokens"].shape == (EVAL_MBS, SEQ)


@pytest.mark.gpu
def test_reading_a_micro_batch_onto_the_gpu_makes_no_host_sync():
    """A micro-batch (pinned, as the DataLoader gives it on a GPU) reaches the device without
    a blocking copy: each would drain the device's queue once per micro-batch."""
    steps = EodGPTSteps(EOD, EodContextRegistry(), SEQ, MBS, algo="ring", ulysses_degree=1,
                        device=torch.device("cuda"), plan_ahead=False)
    sample = next(stream(1, 1))
    pinned = {key: t.pin_memory() for key, t in sample.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = steps._read(iter([pinned]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key in ("tokens", "labels", "loss_mask"):
        assert batch[key].is_cuda and torch.equal(batch[key].cpu(), sample[key].to(
            batch[key].dtype)), key


@pytest.mark.parametrize("one_row", [False, True])
def test_full_validation_reads_one_sequence_a_micro_batch_when_told(one_row):
    """Megatron-LM >= 0.19's --full-validation reads 1 sequence a micro-batch whatever the
    micro-batch size: accepted only when the steps are told (megatron_lm_data decides)."""
    steps = EodGPTSteps(256, EodContextRegistry(), 8, 2, device=torch.device("cpu"),
                        one_row_evaluation=one_row)
    sample = {"tokens": torch.zeros(1, 8, dtype=torch.int64),
              "labels": torch.zeros(1, 8, dtype=torch.int64), "loss_mask": torch.ones(1, 8)}
    if one_row:
        assert steps._read(iter([sample]))["tokens"].shape == (1, 8)
    else:
        with pytest.raises(ValueError, match=r"expected \[--micro-batch-size, --seq-length\]"):
            steps._read(iter([sample]))
