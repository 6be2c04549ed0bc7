"""Varlen kernels behind one interface: out, lse (-inf for rows without keys) and a backward
that takes the FINAL out/lse, checked against a dense float64 computation.

CPU: exact (1e-12 in float64). GPU (marked, skipped without CUDA): PyTorch's flash kernels and
flash-attn when installed, in bf16 against the float64 reference; tolerance 2e-2 of the largest
reference value (`close`): bf16 keeps 8 bits of mantissa, so a gradient of 4-8 is rounded to
steps of 1/32 (the H200 measured 0.020-0.034 absolute on such gradients, one for each dout
drawn, when dout was not seeded: the test process's global generator is seeded at random),
and the softmax sums hundreds of terms.
"""

import itertools

import pytest
import torch

from megatron_eod.attention.backends import (CPUExactBackend, FlashAttnBackend,
                                             TorchVarlenBackend, _lse_to_token_major,
                                             backward_lse)
from megatron_eod.attention.lse import merge_into


def reference(q, k, v, cu_q, cu_k, causal, scale):
    outs, lses = [], []
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].double()
        ks = k[cu_k[i]:cu_k[i + 1]].double().repeat_interleave(rep, 1)
        vs = v[cu_k[i]:cu_k[i + 1]].double().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            sq, sk = qs.shape[0], ks.shape[0]
            allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
            s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s),
                        torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def varlen_case(device, dtype, causal, seed=0, one_row=False):
    """Four sequences, GQA (4 query heads, 2 key heads); one_row: every sequence one query
    row (a part of 1-token documents; flash kernels take another path there)."""
    gen = torch.Generator().manual_seed(seed)
    lq, lk = [5, 1, 17, 3], ([9, 1, 17, 3] if causal else [4, 2, 30, 0])
    if one_row:
        lq, lk = [1, 1, 1, 1], ([3, 1, 2, 1] if causal else [4, 2, 30, 0])
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lq), 4, 16, generator=gen)
    k = torch.randn(sum(lk), 2, 16, generator=gen)
    v = torch.randn(sum(lk), 2, 16, generator=gen)
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (move(q), move(k), move(v), cu(lq).to(device), cu(lk).to(device), max(lq),
            max(lk))


def close(mine, ref, tol):
    """Whether mine is within tol of ref relative to ref's largest value (normwise, at least
    tol absolute): a wrong mask or scale errs by a large part of the values themselves."""
    return (mine.cpu().double() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def check_backend(backend, device, dtype, tol):
    for causal, one_row in itertools.product((False, True), (False, True)):
        q, k, v, cu_q, cu_k, mq, mk = varlen_case(device, dtype, causal, one_row=one_row)
        out, lse = backend.forward(q, k, v, cu_q, cu_k, mq, mk, causal, 0.3)
        ref_out, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), causal,
                                     0.3)
        assert close(out, ref_out, tol)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse.cpu()), finite)  # -inf exactly where no keys
        assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max() < tol
        qr, kr, vr = (t.cpu().double().requires_grad_() for t in (q, k, v))
        dout = torch.randn(ref_out.shape, dtype=ref_out.dtype,
                           generator=torch.Generator().manual_seed(1))
        ro, _ = reference(qr, kr, vr, cu_q.cpu(), cu_k.cpu(), causal, 0.3)
        gq, gk, gv = torch.autograd.grad(ro, (qr, kr, vr), dout)
        dq, dk, dv = backend.backward(dout.to(device, dtype), q, k, v, out, lse, cu_q, cu_k, mq,
                                      mk, causal, 0.3)
        for name, mine, ref in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
            assert close(mine, ref, tol), (name, causal, one_row)


def check_given_tensors(backend, device, dtype):
    """out= and grads= (slices of larger tensors, as the batched ring's local call in two
    parts passes them): the same values as without, written there and nowhere else; also
    where every sequence has one query row under GQA, where flash kernels regroup heads."""
    for causal, one_row in itertools.product((False, True), (False, True)):
        q, k, v, cu_q, cu_k, mq, mk = varlen_case(device, dtype, causal, seed=2,
                                                  one_row=one_row)
        out, lse = backend.forward(q, k, v, cu_q, cu_k, mq, mk, causal, 0.3)
        dout = torch.randn_like(q)
        grads = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal, 0.3)
        sentinel = 7.0
        big_out = torch.full((q.shape[0] + 5,) + tuple(q.shape[1:]), sentinel, dtype=dtype,
                             device=device)
        got, got_lse = backend.forward(q, k, v, cu_q, cu_k, mq, mk, causal, 0.3,
                                       out=big_out[2:-3])
        assert got.data_ptr() == big_out[2:-3].data_ptr()
        assert torch.equal(got, out) and torch.equal(got_lse, lse)
        assert torch.all(big_out[:2] == sentinel) and torch.all(big_out[-3:] == sentinel)
        bigs = [torch.full((x.shape[0] + 4,) + tuple(x.shape[1:]), sentinel, dtype=dtype,
                           device=device) for x in (q, k, v)]
        given = tuple(b[1:-3] for b in bigs)
        got = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal, 0.3,
                               grads=given)
        for mine, ref, g, b in zip(got, grads, given, bigs):
            assert mine.data_ptr() == g.data_ptr() and torch.equal(mine, ref)
            assert torch.all(b[:1] == sentinel) and torch.all(b[-3:] == sentinel)


def test_cpu_backend_is_exact_in_float64():
    check_backend(CPUExactBackend(), "cpu", torch.float64, 1e-12)


def test_cpu_backend_writes_into_given_tensors():
    backend = CPUExactBackend()
    assert backend.writes_out and backend.writes_grads
    check_given_tensors(backend, "cpu", torch.float64)


def test_cpu_backend_batches_large_calls():
    backend = CPUExactBackend()
    backend.max_mask_elements = 64  # force one kernel call per sequence
    check_backend(backend, "cpu", torch.float64, 1e-12)


def test_two_key_blocks_merged_equal_one_call():
    """The ring's contract: partial results merged by lse, block backward from final out/lse."""
    backend = CPUExactBackend()
    q, k, v, cu_q, cu_k, mq, mk = varlen_case("cpu", torch.float64, False, seed=1)
    cu_q, cu_k = cu_q[:3], cu_k[:3]  # sequences with keys on both sides of the split
    q, k, v = q[:cu_q[-1]], k[:cu_k[-1]], v[:cu_k[-1]]
    first = torch.tensor([0, 2, 3], dtype=torch.int32)  # keys 0..1 of seq 0, key 0 of seq 1
    rows_a = torch.cat([torch.arange(0, 2), torch.arange(4, 5)])
    rows_b = torch.cat([torch.arange(2, 4), torch.arange(5, 6)])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    all_rows = torch.arange(q.shape[0])
    for rows, cu in ((rows_a, first), (rows_b, torch.tensor([0, 2, 3], dtype=torch.int32))):
        o, l = backend.forward(q, k[rows], v[rows], cu_q, cu, mq, 2, False, 0.3)
        merge_into(out, lse, all_rows, o, l)
    full_out, full_lse = backend.forward(q, k, v, cu_q, cu_k, mq, mk, False, 0.3)
    assert (out - full_out).abs().max() < 1e-12 and (lse - full_lse).abs().max() < 1e-12
    dout = torch.randn_like(out)
    dq_full, dk_full, dv_full = backend.backward(dout, q, k, v, full_out, full_lse, cu_q, cu_k,
                                                 mq, mk, False, 0.3)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows, cu in ((rows_a, first), (rows_b, torch.tensor([0, 2, 3], dtype=torch.int32))):
        gq, gk, gv = backend.backward(dout, q, k[rows], v[rows], out, lse, cu_q, cu, mq, 2,
                                      False, 0.3)
        dq += gq
        dk[rows] += gk
        dv[rows] += gv
    for mine, ref in ((dq, dq_full), (dk, dk_full), (dv, dv_full)):
        assert (mine - ref).abs().max() < 1e-12


@pytest.mark.gpu
def test_torch_varlen_backend_on_gpu():
    check_backend(TorchVarlenBackend(), "cuda", torch.bfloat16, 2e-2)
    check_given_tensors(TorchVarlenBackend(), "cuda", torch.bfloat16)
    print(f"[figure] torch varlen forward writes into a given out: "
          f"{TorchVarlenBackend.writes_out} (torch {torch.__version__})")


@pytest.mark.gpu
def test_flash_attn_backend_on_gpu():
    pytest.importorskip("flash_attn")
    check_backend(FlashAttnBackend(), "cuda", torch.bfloat16, 2e-2)
    check_given_tensors(FlashAttnBackend(), "cuda", torch.bfloat16)


def test_lse_fix_ups_are_one_kernel_each_and_keep_nan():
    """Flash's [H, T] lse -> [T, H] with +inf (a row without keys) as -inf, -inf kept; and back
    for a backward: [H, T] contiguous with either infinity as 0 (the kernel's exp(s - lse)
    must not be NaN), from either layout. No infinity may become the largest float, and a
    NaN (a bug upstream) must stay visible, not become a number."""
    inf, nan = float("inf"), float("nan")
    kernel = torch.tensor([[1.0, inf, nan, -inf], [-2.0, 3.0, inf, 0.5]])  # [H=2, T=4]
    lse = _lse_to_token_major(kernel, 4, 2)
    assert lse.shape == (4, 2)
    expected = torch.tensor([[1.0, -2.0], [-inf, 3.0], [nan, -inf], [-inf, 0.5]])
    assert torch.equal(lse.isnan(), expected.isnan())
    assert torch.equal(lse.nan_to_num(7.0), expected.nan_to_num(7.0))
    with pytest.raises(ValueError, match="softmax_lse shape"):
        _lse_to_token_major(kernel, 2, 3)
    lse[3, 1] = inf  # flash's own marking of a row without keys, should one reach a backward
    for layout in (lse, lse.contiguous()):  # H-major memory (the forward's) or token-major
        back = backward_lse(layout, torch.float64)
        assert back.is_contiguous() and back.shape == (2, 4) and back.dtype == torch.float64
        want = torch.tensor([[1.0, 0.0, nan, 0.0], [-2.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
        assert torch.equal(back.isnan(), want.isnan())
        assert torch.equal(back.nan_to_num(7.0), want.nan_to_num(7.0))
