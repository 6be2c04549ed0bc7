"""The log-sum-exp merge: the fused (torch.compile) path gives the eager result, by index and
on a run of rows, keeps rows without keys at out 0 / lse -inf, leaves other rows untouched,
and falls back to eager with a warning when compiling fails. (On CUDA the fused path is the default; here it is forced on the CPU, in a child
process.)"""

import pytest
import torch

from megatron_eod.attention import lse as lse_module
from megatron_eod.attention.lse import merge_into
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _accumulators(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(12, 3, 8, generator=gen, dtype=dtype)
    lse = torch.randn(12, 3, generator=gen, dtype=dtype)
    out[:2], lse[:2] = 0.0, float("-inf")  # rows 0, 1: no key seen yet
    rows = torch.tensor([0, 1, 3, 7, 11])
    part = torch.randn(5, 3, 8, generator=gen, dtype=dtype)
    part_lse = torch.randn(5, 3, generator=gen, dtype=dtype)
    part_lse[0] = float("-inf")  # row 0 gets no key from this part either
    part[0] = 0.0
    return out, lse, rows, part, part_lse


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_fused_merge_equals_eager(dtype, tol):
    # In a child process: torch.compile leaves compile workers and threads in the process
    # that ran it, and later tests fork training ranks from this one (a lock held at fork
    # time deadlocks the children: Megatron-LM's jit_fuser compiles there too).
    run_ranks(_fused_merge_equals_eager, 1, dtype, tol, daemon=False, timeout=240)


def _fused_merge_equals_eager(rank, world, dtype, tol):
    # Both forms: rows by index (gather, merge, scatter in one compiled function) and a run of
    # rows as slices updated in place (rows 0.., with the rows that saw no key); two row
    # counts each (dynamic shapes).
    for span in (False, True):
        for size in (5, 3):
            eager = _accumulators(dtype)
            rows = torch.arange(size) if span else eager[2][:size]
            eager = (eager[0], eager[1], rows, eager[3][:size], eager[4][:size])
            fused = tuple(t.clone() for t in eager)
            cut = (0, size) if span else None
            merge_into(*eager, span=cut, fused=False)
            merge_into(*fused, span=cut, fused=True)
            assert (fused[0] - eager[0]).abs().max() < tol
            assert torch.equal(torch.isinf(fused[1]), torch.isinf(eager[1]))
            finite = torch.isfinite(eager[1])
            assert (fused[1][finite] - eager[1][finite]).abs().max() < tol
            assert not torch.isnan(fused[0]).any()
            untouched = torch.ones(12, dtype=torch.bool)
            untouched[rows] = False  # rows not merged keep their values exactly
            assert torch.equal(fused[0][untouched], _accumulators(dtype)[0][untouched])
    eager = _accumulators(dtype)
    merge_into(*eager, fused=False)
    assert torch.equal(eager[0][0], torch.zeros_like(eager[0][0]))
    assert torch.isinf(eager[1][0]).all() and torch.isfinite(eager[1][1]).all()
    assert not lse_module._FUSED["failed"]  # it really compiled (no eager fallback)


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(fn, dynamic):
        def fail(*args):
            raise RuntimeError("no triton")
        return fail

    monkeypatch.setattr(lse_module, "_FUSED", {"rows": None, "span": None, "failed": False})
    monkeypatch.setattr(torch, "compile", broken)
    got, want = _accumulators(torch.float64), _accumulators(torch.float64)
    with pytest.warns(UserWarning, match="fused log-sum-exp merge unavailable"):
        merge_into(*got, fused=True)
    merge_into(*want, fused=False)
    assert torch.equal(got[0], want[0]) and lse_module._FUSED["failed"]
