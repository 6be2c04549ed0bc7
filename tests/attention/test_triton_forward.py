"""The fused Triton forward (attention/triton_forward.py) against the float64 dense oracle.

On the CPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernel is first defined) in float32: the batched executors with the fused forward, on
random layouts (1-token documents, a document over every group, rows without EoD, GQA, a
head_dim that is not a power of two), give the out and the q, k, v gradients of the oracle
within float32 rounding; the backward is the base kernel's from the fused out and lse, so a
wrong lse fails the gradients. Small tiles (16 rows) make several tiles per document. Also on
gloo ranks, through `context_parallel_attention`. On a GPU (marked): the compiled kernel in
bf16 within twice CP=1's error, and with no host synchronisation.
"""

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from megatron_eod import (build_doc_layout, context_parallel_attention,  # noqa: E402
                          create_hybrid_groups, plan_context_parallel)
from megatron_eod.attention.backends import CPUExactBackend, TorchVarlenBackend  # noqa: E402
from megatron_eod.attention.simulate import SimulatedPlan  # noqa: E402
from megatron_eod.attention.triton_forward import (TritonForwardBackend,  # noqa: E402
                                                   tile_forward)
from megatron_eod.plan.forward_tiles import forward_tiles, with_fused_tiles  # noqa: E402
from tests.attention.test_simulate import _case as simulate_case  # noqa: E402
from tests.attention.test_simulate import _oracle, run_without_host_syncs  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import random_layout_tokens  # noqa: E402

EOD = 50


# CPU tensors need Triton's interpreter, chosen before triton is first imported
# (tests/conftest.py, where there is no GPU; on a GPU machine the compiled kernel runs).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter is off (TRITON_INTERPRET)")


def _case(*args, **kwargs):
    """test_simulate's random case, in float32 unless told (the interpreter's dtype here)."""
    return simulate_case(*args, **{"dtype": torch.float32, **kwargs})


def _small_tiles(simulated, block_m=16, key_block=16):
    """The simulation's schedules with tiles of block_m rows and key tiles of key_block keys
    (the plan's are 128 and 64): tile edges inside the small cases' documents."""
    simulated.schedules = [s if s.forward_tiles is None else
                           with_fused_tiles(s, block_m, key_block)
                           for s in simulated.schedules]
    return simulated


_RING4, _SPANNING = ("ring", 4, None, "mixed", 2, 2, 8, True), ("ring", 4, None, "spanning",
                                                                  1, 4, 12, True)
_HYBRID8, _SHORT = ("hybrid", 8, 2, "mixed", 2, 1, 8, True), ("ring", 2, None, "short", 2, 2, 8,
                                                              False)
_ULYSSES = ("ulysses", 4, None, "mixed", 2, 2, 8, False)


@interpreted
@pytest.mark.parametrize("algo,cp,degree,kind,b,kv_heads,dim,received,exchange,fused_backward", [
    (*case, exchange, fused) for case, exchange, fused in (
        (_RING4, "batched", True), (_RING4, "batched-keep", True),
        (_RING4, "batched+concurrent", False), (_SPANNING, "batched-keep", True),
        (_SPANNING, "batched+concurrent", False), (_HYBRID8, "batched", True),
        (_HYBRID8, "batched-keep", False), (_HYBRID8, "batched+concurrent", False),
        (_SHORT, "batched", True), (_ULYSSES, "batched", True),
        (_ULYSSES, "batched+concurrent", False))])
def test_fused_forward_equals_dense_reference(algo, cp, degree, kind, b, kv_heads, dim,
                                              received, exchange, fused_backward):
    """`received`: whether some tile reads received keys (the planner splits no document
    of the short layout; Ulysses has no ring). Each case with each exchange once, the fused
    backward beside the batched ones (it runs no side stream); not the whole product, for
    CI's time (the interpreter)."""
    cu, (q, k, v, dout) = _case(kind, b, 96, 4, kv_heads, dim, seed=cp + b)
    plan = plan_context_parallel(cu, cp, algo, degree)
    backend = TritonForwardBackend(CPUExactBackend(), fused_backward)
    exchange, _, concurrent = exchange.partition("+")
    simulated = _small_tiles(SimulatedPlan(plan, q, k, v, dout, backend, 0.3, exchange,
                                           bool(concurrent)))
    assert received == any(s.forward_tiles.with_received.shape[0]
                           for s in simulated.schedules)
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), simulated.run(),
                               _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine.double() - ref).abs().max().item() < 2e-5, name


@interpreted
def test_tile_forward_writes_every_row_once_and_only_its_rows():
    """Rows outside the tiles keep what they held; rows inside equal the oracle, lse too."""
    local_cu = torch.tensor([0, 10, 40, 43])
    tiles = forward_tiles(local_cu.numpy(), torch.arange(10, 25).numpy(),
                          torch.tensor([0, 15]).numpy(), torch.tensor([0, 7]).numpy(), 16)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(48, h, 24, generator=gen) for h in (4, 2, 2))
    rk, rv = (torch.randn(7, 2, 24, generator=gen) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, 48), float("nan")).t()
    tile_forward(q, k, v, None, None, tiles.local_only, tiles.row_start, out, lse, 0.3, 16)
    assert out[10:25].isnan().all() and out[43:].isnan().all()
    tile_forward(q, k, v, rk, rv, tiles.with_received, tiles.row_start, out, lse, 0.3, 16)
    assert out[43:].isnan().all() and lse[43:].isnan().all()
    for row in range(43):
        run = 0 if row < 10 else 10 if row < 40 else 40
        keys, values = k[run:row + 1], v[run:row + 1]
        if 10 <= row < 25:
            keys, values = torch.cat([rk, keys]), torch.cat([rv, values])
        s = torch.einsum("hd,khd->hk", q[row].double(),
                         keys.double().repeat_interleave(2, 1)) * 0.3
        expected = torch.einsum("hk,khd->hd", s.softmax(-1),
                                values.double().repeat_interleave(2, 1))
        assert (out[row].double() - expected).abs().max() < 1e-5, row
        assert (lse[row].double() - s.logsumexp(-1)).abs().max() < 1e-5, row


@interpreted
def test_tile_forward_refuses_what_it_cannot_run():
    q, k = torch.randn(8, 2, 512), torch.randn(8, 1, 512)
    tiles = forward_tiles([0, 8], block_m=16)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        tile_forward(q, k, k, None, None, tiles.local_only, tiles.row_start, q,
                     torch.empty(8, 2), 1.0, 16)
    q, k = torch.randn(8, 2, 16), torch.randn(8, 1, 16)
    tiles = forward_tiles([0, 8], block_m=8)
    with pytest.raises(ValueError, match="block_m >= 16"):
        tile_forward(q, k, k, None, None, tiles.local_only, tiles.row_start, q,
                     torch.empty(8, 2), 1.0, 8)


def test_tile_forward_names_what_it_cannot_take(monkeypatch):
    """CPU tensors without the interpreter, tiles not int32 on q's device: a ValueError
    naming the rule (before: "0 active drivers" from Triton's launcher)."""
    q, k = torch.randn(8, 2, 16), torch.randn(8, 1, 16)
    tiles = forward_tiles([0, 8], block_m=16)
    args = (q, k, k, None, None, tiles.local_only, tiles.row_start, q, torch.empty(8, 2), 1.0,
            16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"runs on CUDA tensors, got cpu .*TRITON_INTERPRET"):
        tile_forward(*args)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"tiles must be int32 on q's device"):
        tile_forward(*args[:5], tiles.local_only.long(), *args[6:])


def test_a_plan_the_steps_run_is_said_not_fused(monkeypatch):
    """One document over 8 groups has no batched form (a group would receive 7x its rows):
    the steps executor runs it, unfused; said once per process, not per layer."""
    import warnings

    from megatron_eod.attention import ring

    cu, (q, k, v, _) = _case("spanning", 1, 128, 4, 2, 8, seed=1)
    schedule = plan_context_parallel(cu, 8, "ring").schedule(7)
    assert schedule.batched is None and schedule.forward_tiles is None
    monkeypatch.setattr(ring._RingAttention, "apply", lambda *args: None)
    monkeypatch.setattr(ring, "_SAID", set())
    backend = TritonForwardBackend(CPUExactBackend())
    with pytest.warns(UserWarning, match=r"--cp-fused-forward: .*receive over 4x its own rows"):
        ring.ring_attention(q, k, v, schedule, None, backend, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ring.ring_attention(q, k, v, schedule, None, backend, 0.3)  # said already
        ring.ring_attention(q, k, v, schedule, None, CPUExactBackend(), 0.3)  # not fused


def _rank(rank, world, algo, degree, exchange, fused_backward):
    tokens = random_layout_tokens("mixed", 2, 64, EOD, seed=world)
    layout = build_doc_layout(tokens, EOD)
    plan = plan_context_parallel(layout.cu_seqlens, world, algo, degree)
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    cu, (q, k, v, dout) = _case("mixed", 2, 64, 4, 2, 16, seed=world)
    idx = plan.token_index(rank)
    mine = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, plan, group=dist.group.WORLD, softmax_scale=0.3,
                                     backend=TritonForwardBackend(CPUExactBackend(),
                                                                  fused_backward),
                                     ring_exchange=exchange)
    out.backward(dout[idx])
    ref = _oracle(q, k, v, dout, layout.cu_seqlens, 0.3)
    got = (out, mine[0].grad, mine[1].grad, mine[2].grad)
    return max((g.double() - r[idx]).abs().max().item() for g, r in zip(got, ref))


@interpreted
@pytest.mark.parametrize("algo,world,degree,exchange,fused_backward", [
    ("ring", 4, None, "batched", False), ("hybrid", 4, 2, "batched-keep", True)])
def test_fused_forward_on_gloo_ranks(algo, world, degree, exchange, fused_backward):
    """Real transports: the fused forward, and (hybrid) the fused backward with its received
    keys' gradients sent back and landed."""
    assert max(run_ranks(_rank, world, algo, degree, exchange, fused_backward)) < 2e-5


@interpreted
@pytest.mark.parametrize("forward_beside", [True, False])
def test_forward_side_stream_follows_the_backend(monkeypatch, forward_beside):
    """With concurrent calls, the fused forward's first launch goes beside the second unless
    the backend says not (`forward_beside=False`: the benchmarks' "concurrent backward"
    rows); the result is the same."""
    from megatron_eod.attention import fused

    asked = []

    class Recording(fused.Beside):
        def __init__(self, fn, device, enabled, *args, **kwargs):
            asked.append(enabled)
            super().__init__(fn, device, enabled, *args, **kwargs)

    monkeypatch.setattr(fused, "Beside", Recording)
    cu, (q, k, v, dout) = _case("spanning", 1, 64, 2, 1, 8, seed=3)
    plan = plan_context_parallel(cu, 2, "ring")
    backend = TritonForwardBackend(CPUExactBackend(), forward_beside=forward_beside)
    simulated = _small_tiles(SimulatedPlan(plan, q, k, v, dout, backend, 0.3, "batched", True))
    simulated.forward_group(0)
    assert asked == [forward_beside]


def test_a_plan_without_tiles_is_refused_by_the_fused_forward():
    cu, (q, k, v, dout) = _case("spanning", 1, 64, 2, 1, 8, seed=3)
    plan = plan_context_parallel(cu, 2, "ring", fused_tiles=False)
    simulated = SimulatedPlan(plan, q, k, v, dout, TritonForwardBackend(CPUExactBackend()), 0.3)
    with pytest.raises(ValueError, match=r"needs a plan with its tiles: "
                                         r"plan_context_parallel\(\.\.\., fused_tiles=True\)"):
        simulated.forward_group(0)


def test_launch_shape_per_architecture():
    """The forward's blocks: on sm_90 the shape one H200 measured fastest (32 keys, 4 warps:
    the whole row at 0.87-0.97 of PyTorch's flash kernel, against 0.97-1.02 for 64 keys and
    8 warps); elsewhere the spill-free one; above head dim 128 two stages (shared memory)."""
    from megatron_eod.attention.triton_forward import _launch_shape
    assert _launch_shape(128, 128, 90) == (32, 4, 3)
    assert _launch_shape(128, 128, 80) == _launch_shape(128, 128, None) == (64, 8, 3)
    assert _launch_shape(64, 16, 90) == (16, 4, 3)
    assert _launch_shape(256, 128, 90) == (32, 8, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["batched", "batched-keep", "batched+concurrent",
                                      "batched+backward", "batched-keep+backward",
                                      "batched-keep+atomic", "batched+concurrent-atomic"])
@pytest.mark.parametrize("algo,cp,degree", [("ring", 4, None), ("ring", 8, None),
                                            ("hybrid", 8, 2)])
def test_fused_forward_on_gpu_in_bf16(monkeypatch, algo, cp, degree, exchange):
    """bf16 within twice CP=1's error (with "+backward" the fused backward's gradients too,
    "atomic" with dq by atomic adds: ATOMIC_DQ, with concurrent calls two streams' adds);
    with concurrent_calls (its first launch on a side stream) the forward is the one-stream
    forward bit for bit, run after run."""
    from megatron_eod.attention import triton_backward

    cu, tensors = _case("mixed", 2, 1024, 8, 2, 64, seed=1, device="cuda",
                        dtype=torch.bfloat16)
    plan = plan_context_parallel(cu, cp, algo, degree)
    ref = _oracle(*tensors, cu, 0.125)
    exchange, _, suffix = exchange.partition("+")
    concurrent = suffix.startswith("concurrent")
    monkeypatch.setattr(triton_backward, "ATOMIC_DQ", suffix.endswith("atomic"))
    backend = TritonForwardBackend(TorchVarlenBackend(),
                                   suffix in ("backward", "atomic", "concurrent-atomic"))
    got = SimulatedPlan(plan, *tensors, backend, 0.125, exchange, concurrent).run()
    if concurrent:
        both = SimulatedPlan(plan, *tensors, backend, 0.125, exchange, True)
        alone = SimulatedPlan(plan, *tensors, backend, 0.125, exchange)
        for g in range(plan.ring_size):
            expected = alone.forward_group(g)[0]
            for _ in range(5):
                assert torch.equal(both.forward_group(g)[0], expected)
    one = SimulatedPlan(plan_context_parallel(cu, 1, "ring"), *tensors, TorchVarlenBackend(),
                        0.125).run()
    for name, mine, single, exact in zip(("out", "dq", "dk", "dv"), got, one, ref):
        err = (mine.cpu().double() - exact).abs().max().item()
        base = (single.cpu().double() - exact).abs().max().item()
        print(f"[figure] fused forward {algo} ({exchange}) cp={cp} bf16 {name}: max error vs "
              f"float64 {err:.2e}, CP=1's {base:.2e}")
        assert err <= 2 * base + 1e-3, (name, err, base)


@pytest.mark.gpu
def test_fused_forward_refuses_float32_on_gpu():
    q, k = torch.randn(8, 2, 16, device="cuda"), torch.randn(8, 1, 16, device="cuda")
    tiles = forward_tiles([0, 8], block_m=16).to("cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16 on CUDA, got torch.float32"):
        tile_forward(q, k, k, None, None, tiles.local_only, tiles.row_start, q,
                     torch.empty(8, 2, device="cuda"), 1.0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_backward", [False, True, "atomic"])
def test_fused_forward_makes_no_host_syncs_on_gpu(monkeypatch, fused_backward):
    from megatron_eod.attention import triton_backward

    monkeypatch.setattr(triton_backward, "ATOMIC_DQ", fused_backward == "atomic")
    cu, tensors = _case("mixed", 2, 1024, 8, 2, 64, seed=2, device="cuda",
                        dtype=torch.bfloat16)
    plan = plan_context_parallel(cu, 4, "ring")
    backend = TritonForwardBackend(TorchVarlenBackend(), bool(fused_backward))
    run_without_host_syncs(SimulatedPlan(plan, *tensors, backend, 0.125))
