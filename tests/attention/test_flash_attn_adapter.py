"""FlashAttnBackend against each flash-attn release's calling convention, on a CPU.

flash-attn cannot be installed here, so `fake_flash_attn` stands in: its entry points have
the signatures of v2.6.0, v2.6.3, v2.7.0, v2.7.4 and v2.8.3 as they read in flash-attn's
source and compute with the exact CPU kernel, asserting the C++ side's checks and argument
types and that the sequence maxima are the sequences'. A wrong keyword, window form, result
index, extension name or misplaced positional argument of its varlen_fwd fails here (two
arguments of one type and value swapped would not: the GPU tests would); the kernels
themselves are checked by the GPU-marked tests of test_backends.py wherever flash-attn is
installed.
"""

import pytest
import torch

from megatron_eod import plan_context_parallel
from megatron_eod.attention import backends
from megatron_eod.attention.backends import (FlashAttnBackend, TorchVarlenBackend,
                                             flash_attn_problem, get_backend)
from megatron_eod.attention.simulate import SimulatedPlan
from tests.attention import fake_flash_attn
from tests.attention.test_backends import check_backend, check_given_tensors
from tests.attention.test_simulate import _case, _oracle

# 2.7.0: the new calling convention under the old extension name (flash_attn_cuda).
RELEASES = ["2.6.0", "2.6.3", "2.7.0", "2.7.4.post1", "2.8.3"]


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_computes_exactly_and_writes_into_given_tensors(monkeypatch, release):
    fake_flash_attn.install(monkeypatch, release)
    assert flash_attn_problem() is None
    backend = FlashAttnBackend()
    # Its extension's forward takes an out from 2.7 (the signature read up to 2.8.x).
    assert backend.writes_out == (release >= "2.7") and backend.writes_grads
    check_backend(backend, "cpu", torch.float64, 1e-12)
    check_given_tensors(backend, "cpu", torch.float64)
    assert not fake_flash_attn.SWAPPED  # one row per sequence under GQA: not given out


def test_one_row_per_sequence_under_gqa_is_not_written_into_a_given_out(monkeypatch):
    """The kernel regroups heads there and leaves a given out untouched: without the rule
    (`writes_given_out`) the caller's out would keep whatever it held."""
    fake_flash_attn.install(monkeypatch, "2.8.3")
    monkeypatch.setattr(backends, "writes_given_out", lambda q, k, max_q: True)
    with pytest.raises(AssertionError):
        check_given_tensors(FlashAttnBackend(), "cpu", torch.float64)
    assert fake_flash_attn.SWAPPED


@pytest.mark.parametrize("release", ["2.6.3", "2.8.3"])
@pytest.mark.parametrize("executor", ["batched", "batched+concurrent"])
def test_ring_with_flash_attn_equals_the_dense_reference(monkeypatch, release, executor):
    """The batched ring through the adapter (with concurrent_calls the local call in two
    parts, written into slices of one out where the release's forward can), on layouts with
    1-token documents, against the float64 oracle."""
    fake_flash_attn.install(monkeypatch, release)
    exchange, _, concurrent = executor.partition("+")
    for algo, cp, degree, kind in (("ring", 4, None, "short"), ("hybrid", 8, 2, "mixed")):
        cu, (q, k, v, dout) = _case(kind, 2, 128, 4, 2, 8, seed=cp)
        plan = plan_context_parallel(cu, cp, algo, degree)
        got = SimulatedPlan(plan, q, k, v, dout, FlashAttnBackend(), 0.3, exchange,
                            bool(concurrent)).run()
        for mine, ref in zip(got, _oracle(q, k, v, dout, cu, 0.3)):
            assert (mine - ref).abs().max().item() < 1e-10, (algo, cp)
    # The local call's parts went through the extension's forward into slices of one out.
    assert bool(fake_flash_attn.INTO_OUT) == (bool(concurrent) and release >= "2.7")
    assert not fake_flash_attn.SWAPPED


def test_too_old_release_is_refused_by_name_and_auto_falls_back(monkeypatch):
    fake_flash_attn.install(monkeypatch, "2.5.9.post1")
    assert "flash-attn 2.5.9.post1 is installed" in flash_attn_problem()
    assert ">= 2.6" in flash_attn_problem()
    with pytest.raises(ImportError, match=r">= 2\.6"):
        FlashAttnBackend()
    cuda = torch.device("cuda")  # only chosen here, nothing runs on it
    backends._WARNED.clear()
    with pytest.warns(UserWarning, match=r"2\.5\.9.*PyTorch's varlen flash kernels"):
        assert isinstance(get_backend(cuda, torch.bfloat16), TorchVarlenBackend)
    with pytest.raises(ValueError, match=r"--use-flash-attn.*>= 2\.6"):
        get_backend(cuda, torch.bfloat16, prefer="flash_attn")


def test_missing_flash_attn_falls_back_quietly_unless_asked_for(monkeypatch, recwarn):
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)
    assert flash_attn_problem() == backends.FLASH_ATTN_MISSING
    cuda = torch.device("cuda")
    assert isinstance(get_backend(cuda, torch.bfloat16), TorchVarlenBackend)
    assert not [w for w in recwarn if "flash" in str(w.message)]
    with pytest.raises(ValueError, match=r"--use-flash-attn.*pip install flash-attn"):
        get_backend(cuda, torch.bfloat16, prefer="flash_attn")


def test_torch_kernels_write_into_a_given_out_except_where_they_regroup_heads(monkeypatch):
    """TorchVarlenBackend on PyTorch >= 2.12 (its in-place forward), with PyTorch's flash
    ops stood in for on the CPU: a given out is written by the kernel, except with one query
    row per sequence under GQA, where the result is copied there."""
    fake_flash_attn.install_torch_ops(monkeypatch)
    backend = TorchVarlenBackend()
    check_given_tensors(backend, "cpu", torch.float64)
    assert fake_flash_attn.INTO_OUT and not fake_flash_attn.SWAPPED
    assert all(call[0] > 1 for call in fake_flash_attn.INTO_OUT)
    monkeypatch.setattr(backends, "writes_given_out", lambda q, k, max_q: True)
    with pytest.raises(AssertionError):  # without the rule: the caller's out left as it was
        check_given_tensors(backend, "cpu", torch.float64)


def test_versions_are_read_as_released(monkeypatch):
    assert backends._version("2.8.3.post1") == (2, 8, 3)
    assert backends._version("2.6.0+cu121torch2.3") == (2, 6, 0)  # a local build's tag
    assert backends._version("2.7.0rc1") == (2, 7, 0)
    assert backends._version(None) == () and backends._version("dev") == ()
    fake_flash_attn.install(monkeypatch, "dev")
    assert "cannot be read" in flash_attn_problem()
