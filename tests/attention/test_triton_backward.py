"""The fused Triton backward (attention/triton_backward.py) against the float64 dense oracle.

Through Triton's interpreter on the CPU, as tests/attention/test_triton_forward.py (whose
cases, small tiles and oracle it shares; the fused backward's main cases are there, beside
the forward's): blocks smaller than the tiles (the unmasked blocks' edges), the side stream
with concurrent calls, the delta kernel, and the blocks a GPU cannot take.
"""

import pytest
import torch

pytest.importorskip("triton")

from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.attention.backends import CPUExactBackend  # noqa: E402
from megatron_eod.attention.simulate import SimulatedPlan  # noqa: E402
from megatron_eod.attention.triton_forward import TritonForwardBackend  # noqa: E402
from tests.attention.test_simulate import _oracle  # noqa: E402
from tests.attention.test_triton_forward import _case, _small_tiles, interpreted  # noqa: E402


# Documents 10, 30, 10 rows long: packed in 32-row tiles, the second tile's first row is 22
# rows into the 30-row document (one 16-key block before it), and its last rows are the next
# document's, which must not see that block.
PACKED_ACROSS = [0, 10, 40, 50, 128, 138, 168, 178, 256]


@interpreted
@pytest.mark.parametrize("algo,cp,kind,seed,atomic", [
    ("ring", 2, "mixed", 1, False), ("ring", 2, "mixed", 6, False),
    ("ulysses", 2, "short", 2, False), ("ulysses", 2, PACKED_ACROSS, 3, False),
    ("ring", 2, "mixed", 1, True), ("ulysses", 2, PACKED_ACROSS, 3, True)])
def test_fused_backward_blocks_smaller_than_the_tiles(monkeypatch, algo, cp, kind, seed,
                                                      atomic):
    """The fused backward's unmasked blocks: dq's key blocks (16) before a 32-row tile's first
    row, dk/dv's row blocks (16) past a 32-key tile's last key, which short documents packed
    across the tile's edge must still mask (the rows after the edge see only their own
    document's keys). `atomic`: dq added by the dk/dv kernels (ATOMIC_DQ), its row blocks
    the same."""
    from megatron_eod.attention import triton_backward

    monkeypatch.setattr(triton_backward, "BACKWARD_OVERRIDE", (16, 16, 4, 2))
    monkeypatch.setattr(triton_backward, "ATOMIC_DQ", atomic)
    cu, (q, k, v, dout) = _case("mixed" if isinstance(kind, list) else kind, 2, 128, 4, 2, 8,
                                seed=seed)
    cu = torch.tensor(kind, dtype=cu.dtype) if isinstance(kind, list) else cu
    plan = plan_context_parallel(cu, cp, algo)
    backend = TritonForwardBackend(CPUExactBackend(), fused_backward=True)
    simulated = _small_tiles(SimulatedPlan(plan, q, k, v, dout, backend, 0.3), 32, 32)
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), simulated.run(),
                               _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine.double() - ref).abs().max().item() < 2e-5, name


@interpreted
@pytest.mark.parametrize("exchange", ["batched", "batched-keep"])
@pytest.mark.parametrize("concurrent", [True, False])
def test_fused_backward_side_stream_follows_concurrent_calls(monkeypatch, exchange,
                                                             concurrent):
    """With concurrent calls the fused backward's local dk/dv goes beside the rest (on a
    CPU, inline: the same result as without); with ATOMIC_DQ (concurrent only) too, its dq
    adds and the received keys' going to the one buffer."""
    from megatron_eod.attention import fused, triton_backward

    monkeypatch.setattr(triton_backward, "ATOMIC_DQ", concurrent)

    asked = []

    class Recording(fused.Beside):
        def __init__(self, fn, device, enabled, *args, **kwargs):
            asked.append((getattr(fn, "__name__", ""), enabled))
            super().__init__(fn, device, enabled, *args, **kwargs)

    monkeypatch.setattr(fused, "Beside", Recording)
    cu, (q, k, v, dout) = _case("spanning", 1, 64, 2, 1, 8, seed=3)
    plan = plan_context_parallel(cu, 2, "ring")
    backend = TritonForwardBackend(CPUExactBackend(), fused_backward=True)
    simulated = _small_tiles(SimulatedPlan(plan, q, k, v, dout, backend, 0.3, exchange,
                                           concurrent))
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), simulated.run(),
                               _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine.double() - ref).abs().max().item() < 2e-5, name
    assert [enabled for fn, enabled in asked if fn == "local_dkdv"] == [concurrent] * 2


@interpreted
def test_backward_blocks_under_16_and_row_delta(monkeypatch):
    """Blocks a GPU's matrix products cannot take are named before any launch (the
    interpreter would run them); row_delta's kernel sums dout . out in float32 over strided
    rows (a fused qkv's view), a row count not a multiple of its blocks and a head dim not a
    power of two; none for no rows; CPU tensors without the interpreter named."""
    from megatron_eod.attention import triton_backward

    q = torch.zeros(8, 2, 16)
    tiles = torch.zeros(0, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"key tiles' keys \(key_block\) must be a power of "
                                         r"two >= 16, got 8"):
        triton_backward.tile_dkdv(q, q, q, q, None, None, tiles, tiles[:, 0], q, q, 0.3, True,
                                  8)
    with pytest.raises(ValueError, match=r"dq's key block must be a power of two >= 16"):
        triton_backward.tile_dq(q, q, q, q, None, None, None, None, tiles, tiles[:, 0], q, 0.3,
                                16, block_n=8)
    with pytest.raises(ValueError, match=r"dq32 must be float32 of q's shape \(8, 2, 16\) "
                                         r"on q's device \(cpu\) with a unit last stride, "
                                         r"got torch.float16 \(8, 2, 16\) on cpu"):
        triton_backward.tile_dkdv(q, q, q, q, None, None, tiles, tiles[:, 0], q, q, 0.3, True,
                                  16, dq32=q.half())
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(131, 3, 20, generator=gen)
    out = torch.randn(131, 9, 20, generator=gen)[:, 3:6]  # rows 9 heads apart
    delta = triton_backward.row_delta(dout, out)
    assert delta.dtype == torch.float32 and delta.shape == (131, 3)
    assert torch.allclose(delta.double(), (dout.double() * out.double()).sum(-1), atol=1e-5)
    assert triton_backward.row_delta(dout[:0], out[:0]).shape == (0, 3)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors, got cpu"):
        triton_backward.row_delta(dout, out)


@interpreted
def test_atomic_dq_is_refused_by_name_on_a_triton_that_cannot_compile_it(monkeypatch):
    """Triton 3.2 aborts the process compiling the dk/dv kernel that adds dq, 3.3 fails
    (scripts/test_triton_versions.sh): refused before any launch, naming the version; 3.0-3.1
    and 3.4 on compile it."""
    import triton

    from megatron_eod.attention import triton_backward

    q = torch.zeros(16, 2, 16)
    tiles = torch.zeros(0, 4, dtype=torch.int32)
    monkeypatch.setattr(triton, "__version__", "3.3.1")
    with pytest.raises(ValueError, match=r"the fused backward \(--cp-fused-backward\): dq by "
                                         r"atomic adds does not compile with Triton 3.2 .*"
                                         r"found 3.3.1"):
        triton_backward.tile_dkdv(q, q, q, q, None, None, tiles, tiles[:, 0], q, q, 0.3, True,
                                  16, dq32=torch.zeros(16, 2, 16))
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    assert triton_backward.atomic_dq_problem() is not None
    for version in ("3.1.0", "3.4.0+git1234"):
        monkeypatch.setattr(triton, "__version__", version)
        assert triton_backward.atomic_dq_problem() is None
