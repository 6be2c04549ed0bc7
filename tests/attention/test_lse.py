"""The log-sum-exp merge: the fused (torch.compile) path gives the eager result, by index and
on a run of rows at any offset and length (1 included), keeps rows without keys at out 0 /
lse -inf, leaves other rows untouched, compiles every shape it will see before touching real
accumulators, falls back to eager with a warning when compiling fails, and raises when a
validated graph fails half-way. (On CUDA the fused path is the default; here it is forced on
the CPU, in a child process.)"""

import pytest
import torch
from hypothesis import settings

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


@pytest.mark.slow
def test_fused_merge_equals_eager():
    """The two merges a bf16 GPU run makes, in one process as there: the steps executor's
    (float32 out and lse, the kernel's bf16 part) and the batched ring's (bf16 out, float32
    lse); each set of dtypes has dynamo's whole recompile limit to itself (float64 is the CPU
    tests' dtype, merged eagerly there)."""
    # In a child process: torch.compile leaves compile workers and threads in the process
    # that ran it, and later tests fork training ranks from this one (a lock held at fork
    # time deadlocks the children: Megatron-LM's jit_fuser compiles there too).
    # Under the CI profile through dynamo's aot_eager backend: dynamo's guards and recompiles,
    # without inductor's C++ compiles (~45 s on CI's cold cache; on GPUs inductor emits Triton,
    # which a CPU cannot check anyway); inductor adds its own guards (an aligned offset or not:
    # 4 graphs for a run of rows where aot_eager has 2). `--hypothesis-profile=long` compiles
    # with inductor, as a GPU run does.
    backend = "inductor" if settings.default.max_examples > 100 else "aot_eager"
    run_ranks(_fused_merges, 1, backend, daemon=False, timeout=240)


def _fused_merges(rank, world, backend):
    compile_ = torch.compile
    torch.compile = lambda fn, **options: compile_(fn, backend=backend, **options)
    graphs = _fused_merge_equals_eager(rank, world, torch.float32, 1e-6,
                                       part_dtype=torch.bfloat16)
    # The recompile limit down to what one dtype set compiled for one form: the second set
    # compiles as many again, which fits only in graphs of its own (one function shared by
    # both sets held 8 inductor graphs of 8 for a run of rows: one more and it went eager).
    torch._dynamo.config.recompile_limit = graphs
    _fused_half_out(rank, world)
    assert not lse_module._FUSED["failed"]  # both stayed on the compiled path


def _fused_merge_equals_eager(rank, world, dtype, tol, part_dtype):
    from torch._dynamo.utils import counters

    # Both forms: rows by index (gather, merge, scatter in one compiled function) and a run of
    # rows updated in place at an offset (rows `start`.., with the rows that saw no key when
    # start is 0); several row counts and offsets (dynamic shapes; dynamo specialises 1 row
    # and offset 0).
    # Parts alternate between views (slices) and plain tensors: both share the graphs.
    per_form = []
    for span in (False, True):
        compiled = None
        for i, (size, start) in enumerate(((3, 2), (5, 0), (1, 0), (1, 4), (4, 1), (2, 9))):
            eager = _accumulators(dtype)
            rows = torch.arange(start, start + size) if span else eager[2][:size]
            parts = (eager[3].to(part_dtype)[:size], eager[4][:size])
            if i % 2:
                parts = tuple(t.clone() for t in parts)
            eager = (eager[0], eager[1], rows) + parts
            fused = tuple(t.clone() for t in eager)
            cut = (start, start + size) if span else None
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
            assert torch.equal(fused[1][untouched], _accumulators(dtype)[1][untouched])
            # The first merge of a form compiled every shape it meets later (no recompile).
            compiled = compiled or counters["stats"]["unique_graphs"]
            assert counters["stats"]["unique_graphs"] == compiled, ("recompiled", span, i)
        per_form.append(compiled - sum(per_form))
    # Random accumulator sizes, offsets and row counts (a training run's variety): no graph
    # beyond those compiled up front (dynamo's recompile limit would end the fused path).
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        t = int(torch.randint(2, 300, (), generator=gen))
        n = int(torch.randint(1, t + 1, (), generator=gen))
        start = int(torch.randint(0, t - n + 1, (), generator=gen))
        out, lse = torch.randn(t, 3, 8, dtype=dtype), torch.randn(t, 3, dtype=dtype)
        part, part_lse = torch.randn(n, 3, 8, dtype=part_dtype), torch.randn(n, 3, dtype=dtype)
        merge_into(out, lse, None, part, part_lse, span=(start, start + n), fused=True)
        merge_into(out, lse, torch.randperm(t, generator=gen)[:n], part, part_lse, fused=True)
    assert counters["stats"]["unique_graphs"] == compiled, "random shapes recompiled the merge"
    eager = _accumulators(dtype)
    merge_into(*eager, fused=False)
    assert torch.equal(eager[0][0], torch.zeros_like(eager[0][0]))
    assert torch.isinf(eager[1][0]).all() and torch.isfinite(eager[1][1]).all()
    assert not lse_module._FUSED["failed"]  # it really compiled (no eager fallback)
    return max(per_form)


def _fake_compile(monkeypatch, fail):
    """torch.compile -> the eager function, except that `fail(args)` may raise instead."""
    monkeypatch.setattr(lse_module, "_FUSED", {"compiled": {}, "failed": False,
                                               "validated": set()})

    def compile_(fn, **options):
        def run(*args):
            fail(args)
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", compile_)


def _no_triton(args):
    raise RuntimeError("no triton")


def _half_then_fail(args):
    args[0][: args[0].shape[0] // 2] += 1.0  # a partial write into what it was given
    raise RuntimeError("launch failed")


@pytest.mark.parametrize("fail", [_no_triton, _half_then_fail])
def test_a_failure_on_first_use_falls_back_to_eager_with_nothing_touched(monkeypatch, fail):
    """A graph that fails on its very first run, even after writing half its result: it ran on
    copies, not on the real accumulators, so the eager fallback gives the exact result."""
    _fake_compile(monkeypatch, fail)
    got, want = _accumulators(torch.float64), _accumulators(torch.float64)
    with pytest.warns(UserWarning, match="fused log-sum-exp merge unavailable"):
        merge_into(*got, fused=True)
    merge_into(*want, fused=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert lse_module._FUSED["failed"]


def test_a_failure_after_validation_is_raised_not_merged_again(monkeypatch):
    real = _accumulators(torch.float64)

    def on_real_tensors(args):
        if args[0].data_ptr() == real[0].data_ptr():
            raise RuntimeError("illegal memory access")

    _fake_compile(monkeypatch, on_real_tensors)
    with pytest.raises(RuntimeError, match="MEGATRON_EOD_FUSED_MERGE=0"):
        merge_into(*real, fused=True)


@pytest.mark.parametrize("error", [torch._dynamo.exc.TorchDynamoException("recompile failed"),
                                   torch._dynamo.exc.FailOnRecompileLimitHit("recompile failed")])
def test_a_recompile_failure_falls_back_to_eager(monkeypatch, error):
    """Dynamo's compile errors (and its recompile limit, under fullgraph) surface before the
    graph runs anything: merging eagerly then is exact."""
    real = _accumulators(torch.float64)

    def on_real_tensors(args):
        if args[0].data_ptr() == real[0].data_ptr():
            raise error

    _fake_compile(monkeypatch, on_real_tensors)
    want = _accumulators(torch.float64)
    with pytest.warns(UserWarning, match="recompile failed"):
        merge_into(*real, fused=True)
    merge_into(*want, fused=False)
    assert torch.equal(real[0], want[0]) and lse_module._FUSED["failed"]


def test_a_span_must_match_the_partial_result():
    out, lse, rows, part, part_lse = _accumulators(torch.float64)
    with pytest.raises(ValueError, match=r"span \(0, 4\) holds 4 rows .* has 5"):
        merge_into(out, lse, None, part, part_lse, span=(0, 4), fused=False)


def test_half_precision_out_merges_in_the_lse_dtype():
    """The batched ring merges once into the kernel's bf16 out with a float32 lse: the
    arithmetic runs in float32 and rounds once, to bf16, at the end (not in bf16 throughout,
    which loses ~3 bits here)."""
    out, lse, rows, part, part_lse = _accumulators(torch.float32, seed=3)
    out16, part16 = out.to(torch.bfloat16), part.to(torch.bfloat16)
    before = out16[rows].clone()
    want = lse_module.merged(before.float(), lse[rows], part16.float(), part_lse)[0]
    exact = lse_module.merged(before.double(), lse[rows].double(), part16.double(),
                              part_lse.double())[0]
    in_bf16 = lse_module.merged(before, lse[rows].bfloat16(), part16, part_lse.bfloat16())[0]
    merge_into(out16, lse, rows, part16, part_lse, fused=False)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16[rows], want.to(torch.bfloat16))
    error = (out16[rows].double() - exact).abs().max()
    assert error <= 2 ** -8 * exact.abs().max()  # half a bf16 ulp of the largest value
    assert error < (in_bf16.double() - exact).abs().max()  # bf16 arithmetic: worse


def _fused_half_out(rank, world):
    """The batched ring's merge form on GPUs (bf16 out, float32 lse), compiled: the same
    result as eager, by index and on a run of rows."""
    for span in (False, True):
        for size, start in ((5, 0), (1, 4), (3, 2)):
            out, lse, rows, part, part_lse = _accumulators(torch.float32, seed=size)
            out, part = out.to(torch.bfloat16), part[:size].to(torch.bfloat16)
            rows = torch.arange(start, start + size) if span else rows[:size]
            cut = (start, start + size) if span else None
            eager = (out, lse, rows, part, part_lse[:size])
            fused = tuple(t.clone() for t in eager)
            merge_into(*eager, span=cut, fused=False)
            merge_into(*fused, span=cut, fused=True)
            assert fused[0].dtype == torch.bfloat16 and not lse_module._FUSED["failed"]
            assert (fused[0].float() - eager[0].float()).abs().max() <= 2 ** -8 * \
                eager[0].float().abs().max()
            finite = torch.isfinite(eager[1])
            assert torch.equal(finite, torch.isfinite(fused[1]))
            assert (fused[1][finite] - eager[1][finite]).abs().max() < 1e-6
