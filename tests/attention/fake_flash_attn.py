"""A stand-in for flash-attn on machines without it (CPU): the Python entry points our
FlashAttnBackend calls, with each release's signatures as they read in flash-attn's source
(v2.6.0, v2.6.3, v2.7.0, v2.7.4, v2.8.3: flash_attn/flash_attn_interface.py and csrc's
mha_varlen_fwd; zero_tensors, added in 2.7.3 and never passed, left out), computing with the
exact CPU kernel and asserting what the C++ checks (dtypes, layouts, shapes, argument
types) and that the sequence maxima are the sequences'.

What it proves: that the adapter speaks each release's calling convention (keyword names,
the window argument's form, where lse sits in the results, the extension's 21 positional
arguments with out 4th) and obeys the kernel's known behaviour that matters to it: with one
query row per sequence under GQA the extension regroups heads into a copy of the given out
and writes that, not the given tensor (`seqlenq_ngroups_swapped`; modelled as never
written). Not the kernels themselves: the GPU-marked tests run the real flash-attn wherever
it is installed.

`install(monkeypatch, version)` puts it in sys.modules as `flash_attn` for one test.
"""

import sys
import types

import torch

from megatron_eod.attention.backends import CPUExactBackend

_CPU = CPUExactBackend()
# The extension's varlen_fwd calls given an out: (max query rows, query heads, key heads);
# those at which it regrouped heads (so that the given out was left untouched).
INTO_OUT = []
SWAPPED = []


def _flash_lse(lse_TH):
    """Our [T, H] lse (-inf for a row without keys) as flash returns it: [H, T], +inf (in
    the accumulation dtype: float64 here, so that the checks can be exact)."""
    return torch.where(torch.isinf(lse_TH), torch.full_like(lse_TH, float("inf")),
                       lse_TH).transpose(0, 1).contiguous()


def _check_call(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal):
    """What the kernel's C++ checks (dtypes, layouts, shapes), and that the maxima are the
    sequences' (the kernel sizes its grid by them; swapped, the result would differ)."""
    assert q.dtype == k.dtype == v.dtype and all(x.stride(-1) == 1 for x in (q, k, v))
    assert k.shape == v.shape and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.numel() == cu_k.numel()
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]
    assert type(max_q) is int and type(max_k) is int, (max_q, max_k)
    assert max_q == int(cu_q.diff().max()) and max_k == int(cu_k.diff().max()), (max_q, max_k)
    assert type(dropout_p) is float and dropout_p == 0.0 and type(scale) is float
    assert type(causal) is bool


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    _check_call(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal)
    assert window == (-1, -1), window
    out, lse = _CPU.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return out, _flash_lse(lse)


def _backward(dout, q, k, v, out, lse_HT, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
              scale, causal, window, deterministic, rng_state):
    _check_call(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal)
    assert window == (-1, -1) and rng_state is None and type(deterministic) is bool
    assert all(g.shape == x.shape and g.dtype == x.dtype and g.stride(-1) == 1
               for g, x in ((dq, q), (dk, k), (dv, v)))
    assert lse_HT.shape == (q.shape[1], q.shape[0]) and lse_HT.is_contiguous()
    assert torch.isfinite(lse_HT).all(), "the backward needs rows without keys given 0"
    _CPU.backward(dout, q, k, v, out, lse_HT.transpose(0, 1), cu_q, cu_k, max_q, max_k,
                  causal, scale, grads=(dq, dk, dv))


def _interface(version):
    """flash_attn.flash_attn_interface of `version` (a tuple)."""
    fai = types.ModuleType("flash_attn.flash_attn_interface")
    pair = version < (2, 7)

    # 2.6.0 and 2.6.3 (2.6.1/2.6.2 lie between: leftpad_k, then the defaults, arrive)
    if version < (2, 6, 1):  # no defaults, block_table required, no leftpad_k
        def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax,
                    block_table):
            out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal,
                                tuple(window_size))
            return out, q, k, v, out, lse, None, None
    elif pair:
        def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                    seqused_k=None):
            out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal,
                                tuple(window_size))
            return out, q, k, v, out, lse, None, None
    else:  # 2.7.3 added zero_tensors (to the backward too); not passed by the adapter
        def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                    softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
                    leftpad_k=None, seqused_k=None):
            out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal,
                                (window_size_left, window_size_right))
            return out, lse, None, None

    if pair:
        def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                     softcap, alibi_slopes, deterministic, rng_state=None):
            _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                      tuple(window_size), deterministic, rng_state)
            return dq, dk, dv, None
    else:
        def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                     window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                     rng_state=None):
            _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                      (window_size_left, window_size_right), deterministic, rng_state)
            return dq, dk, dv, None

    def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k,
                   block_table, alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout,
                   softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
                   softcap, return_softmax, gen):
        assert (seqused_k, leftpad_k, block_table, alibi_slopes, gen) == (None,) * 5
        assert (zero_tensors, softcap, return_softmax) == (False, 0.0, False)
        assert type(zero_tensors) is bool and type(softcap) is float
        assert type(return_softmax) is bool
        assert type(window_size_left) is int and type(window_size_right) is int
        if out_ is not None:
            assert out_.shape == q.shape and out_.dtype == q.dtype and out_.stride(-1) == 1
        result, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, p_dropout, softmax_scale, is_causal,
                               (window_size_left, window_size_right))
        out = torch.empty_like(q) if out_ is None else out_
        if out_ is not None:
            INTO_OUT.append((max_seqlen_q, q.shape[1], k.shape[1]))
        if max_seqlen_q == 1 and q.shape[1] > k.shape[1]:  # heads regrouped: out_ untouched
            SWAPPED.append((max_seqlen_q, q.shape[1], k.shape[1]))
            out = out.clone()
        out.copy_(result)
        return out, lse, None, None

    def other_varlen_fwd(*args):  # 2.6: 20 or 21 arguments, 8 results; not called by us
        raise AssertionError("flash-attn < 2.7's varlen_fwd: not the signature the adapter "
                             "was written for")

    fai._flash_attn_varlen_forward = forward
    fai._flash_attn_varlen_backward = backward
    extension = types.ModuleType("flash_attn_2_cuda")
    extension.varlen_fwd = other_varlen_fwd if pair else varlen_fwd
    # The extension's name in the interface module: flash_attn_cuda up to 2.7.0.post2.
    setattr(fai, "flash_attn_gpu" if version >= (2, 7, 1) else "flash_attn_cuda", extension)
    return fai


def install(monkeypatch, version: str):
    """flash_attn `version` ("2.8.3", ...) as `import flash_attn` finds it, for one test."""
    from megatron_eod.attention.backends import _version

    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.flash_attn_interface = _interface(_version(version))
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface",
                        package.flash_attn_interface)
    INTO_OUT.clear()
    SWAPPED.clear()
    return package


def install_torch_ops(monkeypatch):
    """PyTorch's flash ops as TorchVarlenBackend calls them (>= 2.12: with the in-place
    forward), computed on the CPU and regrouping heads as the CUDA kernel does, for one test."""
    import torch.ops

    from megatron_eod.attention import backends

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, scale=None):
        out, lse = _forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal,
                            (-1, -1))
        return out, lse, None, None, None

    def forward_inplace(out, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug,
                        scale=None):
        INTO_OUT.append((max_q, q.shape[1], k.shape[1]))
        result, lse, *_ = forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug,
                                  scale)
        if max_q == 1 and q.shape[1] > k.shape[1]:  # heads regrouped: out untouched
            SWAPPED.append((max_q, q.shape[1], k.shape[1]))
            return lse
        out.copy_(result)
        return lse

    def backward(dout, q, k, v, out, lse_HT, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                 seed, offset, scale=None):
        grads = tuple(torch.empty_like(x) for x in (q, k, v))
        _backward(dout, q, k, v, out, lse_HT.to(q.dtype), *grads, cu_q, cu_k, max_q, max_k,
                  dropout_p, scale, causal, (-1, -1), False, None)
        return grads

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace",
                        forward_inplace, raising=False)  # PyTorch < 2.12 has none
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    monkeypatch.setattr(backends, "_FORWARD_INTO_OUT", True)
    INTO_OUT.clear()
    SWAPPED.clear()
