"""A tiny megatron-core GPT with EoD attention: loss and gradients at CP=N equal CP=1.

Same weights (CPU initialization is CP-invariant), same full micro-batch on every rank; each
CP rank runs the model on its plan tokens; the loss sum and the parameter gradients are
summed over the CP group. float32, tolerance 2e-5 relative on the loss and 1e-4 on gradients:
only the summation order differs (attention partials merged by log-sum-exp, loss summed per
rank). One hand-picked batch per CP layout, then 20 random ones through one model per run
(every document mix, pad runs, each Megatron flag drawn; 200 with --hypothesis-profile=long).
"""

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_eod.megatron import cpu_compat
from megatron_eod.megatron.batch import slice_batch_for_cp
from megatron_eod.megatron.batch_context import EodContextRegistry
from tests.harness import run_ranks
from tests.plan.mixes import MIXES, examples, make_cu_seqlens
from tests.megatron.tiny_model import EOD, cp_setup, tiny_gpt
from tests.reference import random_layout_tokens

B, S = 2, 48


def _loss_and_grads(rank, world, algo, degree, exchange="batched"):
    with cp_setup(world, algo, degree) as cp_group:
        registry = EodContextRegistry()
        model = tiny_gpt(world, registry, seed=1234, ring_exchange=exchange)
        stream = random_layout_tokens("mixed", B, S + 1, EOD, seed=5)
        return _step(model, registry, stream, rank, world, cp_group, algo, degree,
                     eod_mask_loss=True)


def _step(model, registry, stream, rank, world, cp_group, algo, degree, **flags):
    """(loss, {name: gradient}) of one micro-batch `stream` [b, s+1], loss and gradients
    summed over the CP group."""
    model.zero_grad(set_to_none=True)
    batch = slice_batch_for_cp(stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), EOD,
                               registry, cp_size=world, cp_rank=rank, cp_group=cp_group,
                               algo=algo, ulysses_degree=degree, **flags)
    losses = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    loss_sum = (losses.float() * batch.loss_mask).sum()
    totals = torch.stack([loss_sum.detach(), batch.loss_mask.sum()])
    if cp_group is not None:
        dist.all_reduce(totals, group=cp_group)
    count = totals[1].clamp_min(1)  # a batch of pads and masked EoDs only has no loss
    (loss_sum / count).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if cp_group is not None:
            dist.all_reduce(grad, group=cp_group)
        grads[name] = grad
    return (totals[0] / count).item(), grads


@pytest.fixture(scope="module")
def cp1():
    return run_ranks(_loss_and_grads, 1, "ring", None)[0]


@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 2, None, "batched"), ("ring", 4, None, "batched"), ("ring", 4, None, "steps"),
    ("ulysses", 2, None, "batched"), ("hybrid", 4, 2, "batched"), ("hybrid", 4, 2, "steps"),
    ("ring", 4, None, "batched-keep")])
def test_cp_equals_cp1(cp1, algo, world, degree, exchange):
    loss1, grads1 = cp1
    for loss, grads in run_ranks(_loss_and_grads, world, algo, degree, exchange):
        assert loss == pytest.approx(loss1, rel=2e-5)
        for name, g1 in grads1.items():
            assert (grads[name] - g1).abs().max().item() < 1e-4, name


def test_rope_uses_the_reset_positions_of_each_rank():
    """RoPE is relative, so model outputs cannot reveal absolute positions; instead record the
    rotary angles each layer applies and compare them with the reset position ids of the
    rank's tokens. Fails if RoPE used 0..s-1 (or the unpermuted order)."""
    for recorded, expected in run_ranks(_record_rope_angles, 2):
        assert len(recorded) == 4  # 2 layers x (q, k)
        for freqs in recorded:
            assert torch.allclose(freqs, expected)


def _record_rope_angles(rank, world):
    import megatron_eod.megatron.core_attention as core_attention
    from megatron.core import parallel_state

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    original = core_attention._rope.apply_rotary_pos_emb
    recorded = []

    def recording(t, freqs, *args, **kwargs):
        recorded.append(freqs[:, 0, 0, :].clone())
        return original(t, freqs, *args, **kwargs)

    core_attention._rope.apply_rotary_pos_emb = recording
    try:
        registry = EodContextRegistry()
        model = tiny_gpt(world, registry, seed=7, num_query_groups=None)
        tokens = random_layout_tokens("mixed", B, S, EOD, seed=9)
        batch = slice_batch_for_cp(tokens, tokens, EOD, registry, cp_size=world, cp_rank=rank,
                                   cp_group=parallel_state.get_context_parallel_group())
        model(batch.tokens, batch.position_ids, batch.attention_mask)
        # Expected angles: position (reset at every EoD) times the inverse frequencies.
        from megatron_eod import build_doc_layout

        positions = build_doc_layout(tokens, EOD).position_ids.reshape(-1)
        local = positions[batch.plan.token_index(rank)].float()
        assert torch.equal(local.long(), batch.position_ids[0])
        assert (positions == 0).sum() > B  # the positions do restart inside rows
        assert not torch.equal(local, torch.arange(local.numel()).float())
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
        angles = local[:, None] * inv_freq[None, :]
        return recorded, torch.cat([angles, angles], dim=-1)
    finally:
        core_attention._rope.apply_rotary_pos_emb = original
        parallel_state.destroy_model_parallel()
        cpu_compat.remove()


def _random_batch(index):
    """The index-th random micro-batch (tokens [b, S+1]) and flags of the sequence below:
    documents from every mix of tests/plan/mixes.py (EoD at each document's end, at a row's
    end one time in two), pad runs ending some rows, each Megatron flag drawn."""
    rng = np.random.default_rng([SEQUENCE_SEED, index])
    b = int(rng.integers(1, 4))
    cu = make_cu_seqlens(str(rng.choice(MIXES)), b, S + 1, 1, int(rng.integers(2**32)))
    tokens = torch.from_numpy(rng.integers(0, EOD - 1, b * (S + 1))).view(b, S + 1)
    ends = cu[1:] - 1
    ends = ends[((ends + 1) % (S + 1) != 0) | (rng.random(ends.size) < 0.5)]
    tokens.view(-1)[torch.from_numpy(ends)] = EOD
    pad = None
    if rng.random() < 0.25:  # fine-tuning style: a pad run at the end of some rows
        pad = EOD - 1
        for row in range(b):
            if rng.random() < 0.5:
                tokens[row, S + 1 - int(rng.integers(1, S // 2)):] = pad
    flags = dict(reset_position_ids=bool(rng.random() < 0.8),
                 reset_attention_mask=bool(rng.random() < 0.8),
                 eod_mask_loss=bool(rng.random() < 0.5), pad_token_id=pad)
    return tokens, flags


def _many_losses_and_grads(rank, world, algo, degree, exchange, count):
    """Per random micro-batch: (loss, {name: gradient}) of one model at CP `world`."""
    with cp_setup(world, algo, degree) as cp_group:
        registry = EodContextRegistry()
        model = tiny_gpt(world, registry, seed=1234, ring_exchange=exchange)
        results = []
        for index in range(count):
            stream, flags = _random_batch(index)
            results.append(_step(model, registry, stream, rank, world, cp_group, algo, degree,
                                 **flags))
        return results


@functools.lru_cache(maxsize=1)
def _cp1_losses_and_grads(count):
    """The CP=1 run every parametrization below compares with (the same batches): once."""
    return run_ranks(_many_losses_and_grads, 1, "ring", None, "batched", count,
                     timeout=120.0 + 1.0 * count)[0]


SEQUENCE_SEED = 20261124


@pytest.mark.slow
@pytest.mark.parametrize("algo,world,degree,exchange", [
    ("ring", 4, None, "batched"), ("hybrid", 4, 2, "steps"), ("ulysses", 2, None, "batched")])
def test_cp_equals_cp1_over_many_random_batches(algo, world, degree, exchange):
    """A run meets every layout: 20 random micro-batches (every document mix, pads, every
    flag) through one model at CP=N and at CP=1, loss and gradients equal batch by batch."""
    count = examples(20)
    drawn = [_random_batch(i)[1] for i in range(count)]
    assert any(f["pad_token_id"] is not None for f in drawn)
    assert all(any(not f[name] for f in drawn) for name in (
        "reset_position_ids", "reset_attention_mask", "eod_mask_loss"))
    timeout = 120.0 + 1.0 * count * world
    single = _cp1_losses_and_grads(count)
    for rank_results in run_ranks(_many_losses_and_grads, world, algo, degree, exchange, count,
                                  timeout=timeout):
        for index, ((loss, grads), (loss1, grads1)) in enumerate(zip(rank_results, single)):
            assert loss == pytest.approx(loss1, rel=2e-5, abs=1e-6), (index, _random_batch(index))
            for name, g1 in grads1.items():
                assert (grads[name] - g1).abs().max().item() < 1e-4, (index, name,
                                                                      _random_batch(index)[1])
