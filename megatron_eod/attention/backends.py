"""Local varlen attention kernels with log-sum-exp and a separate backward.

One job: one interface over three kernels, so the CP algorithms never touch a kernel:

    out, lse = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                               out=None)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                  causal, softmax_scale, grads=None)

q: [Tq, H, D], k/v: [Tk, Hk, D] (Hk divides H: GQA without repeating), out: like q,
lse: float32 (float64 for float64 inputs) [Tq, H], -inf for a row with no visible key.
`causal` is bottom-right aligned per sequence (query i of sq sees keys 0..i + sk - sq), as
flash-attn. `backward` takes the FINAL out and lse of a row (after merging partial results):
that makes the per-block gradients exact pieces of the full gradient. `out=` (a tensor like
q) and `grads=` ((dq, dk, dv) like q, k, v) take the results into given tensors, e.g. slices
of one larger tensor (the batched ring's local call in two parts, batched.py): every backend
accepts them; `writes_out` / `writes_grads` say whether its kernel writes there itself (else
the result is copied there, which costs the copy the caller wanted to avoid).

* `CPUExactBackend`: PyTorch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`
  and its backward) over batches of sequences with a block-diagonal additive mask (bounded
  size per call). Exact, fp32/fp64; the test oracle's partner.
* `TorchVarlenBackend`: PyTorch's CUDA flash kernels (`aten._flash_attention_forward/_backward`,
  what `torch.nn.attention.varlen.varlen_attn` runs), for GPUs without flash-attn; fp16/bf16.
* `FlashAttnBackend`: flash-attn's varlen forward/backward (>= 2.6), when installed;
  fp16/bf16. Where one is installed but unusable (too old, its extension does not load),
  "auto" warns and takes `TorchVarlenBackend`; "flash_attn" (--use-flash-attn) refuses.

What it does not do: no communication, no merging (lse.py), no dropout.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import warnings
from typing import List, Optional, Tuple

import torch

__all__ = ["CPUExactBackend", "TorchVarlenBackend", "FlashAttnBackend", "get_backend",
           "has_transformer_engine", "accumulation_dtype", "default_scale", "backward_lse",
           "flash_attn_problem", "writes_given_out", "unit_stride_heads", "FLASH_ATTN_MISSING",
           "MIN_FLASH_ATTN"]

_GPU_DTYPES = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype):
    """What lse, merges and gradient sums accumulate in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_stride_heads(*tensors):
    """Each tensor with a dense last dim (head_dim), copied only where it is not (e.g. an
    einsum's result): PyTorch's CPU flash kernel reads a strided head_dim as if it were dense,
    silently wrong, and the GPU kernels need it dense too."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


class CPUExactBackend:
    """Exact attention on CPU through PyTorch's flash kernel, a few sequences per call."""

    name = "cpu"
    max_mask_elements = 1 << 22  # query x key elements of one call's additive mask
    writes_out = writes_grads = True

    def _batches(self, cu_q: List[int], cu_k: List[int]) -> List[Tuple[int, int]]:
        batches, first = [], 0
        for i in range(len(cu_q) - 1):
            size = (cu_q[i + 1] - cu_q[first]) * (cu_k[i + 1] - cu_k[first])
            if i > first and size > self.max_mask_elements:
                batches.append((first, i))
                first = i
        if len(cu_q) > 1:
            batches.append((first, len(cu_q) - 1))
        return batches

    @staticmethod
    def _mask(cu_q, cu_k, a, b, causal, dtype):
        """Additive [tq, tk] mask for sequences a..b-1, and which rows see any key."""
        lq = torch.tensor([cu_q[i + 1] - cu_q[i] for i in range(a, b)])
        lk = torch.tensor([cu_k[i + 1] - cu_k[i] for i in range(a, b)])
        seq_q = torch.repeat_interleave(torch.arange(b - a), lq)
        seq_k = torch.repeat_interleave(torch.arange(b - a), lk)
        pos_q = torch.arange(int(lq.sum())) - torch.repeat_interleave(torch.cumsum(lq, 0) - lq, lq)
        pos_k = torch.arange(int(lk.sum())) - torch.repeat_interleave(torch.cumsum(lk, 0) - lk, lk)
        allowed = seq_q[:, None] == seq_k[None, :]
        if causal:
            shift = torch.repeat_interleave(lk - lq, lq)
            allowed &= pos_k[None, :] <= (pos_q + shift)[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        return mask, allowed.any(dim=1)

    def _blocks(self, q, k, cu_q, cu_k, causal):
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for a, b in self._batches(cq, ck):
            mask, has_key = self._mask(cq, ck, a, b, causal, q.dtype)
            yield slice(cq[a], cq[b]), slice(ck[a], ck[b]), mask, has_key

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, out=None):
        q, k, v = unit_stride_heads(q, k, v)
        out = torch.zeros_like(q) if out is None else out.zero_()
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=accumulation_dtype(q.dtype))
        for qs, ks, mask, has_key in self._blocks(q, k, cu_q, cu_k, causal):
            if qs.stop == qs.start or ks.stop == ks.start:
                continue
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[qs].transpose(0, 1).unsqueeze(0), k[ks].transpose(0, 1).unsqueeze(0),
                v[ks].transpose(0, 1).unsqueeze(0), 0.0, False, attn_mask=mask,
                scale=softmax_scale)
            o, l = o[0].transpose(0, 1), l[0].transpose(0, 1).to(lse.dtype)
            # The kernel returns lse = 0 and out = 0 for rows without keys: make lse -inf.
            out[qs] = o
            lse[qs] = torch.where(has_key[:, None], l, torch.full_like(l, float("-inf")))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                 softmax_scale, grads=None):
        if grads is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            dq, dk, dv = (g.zero_() for g in grads)
        q, k, v, out = unit_stride_heads(q, k, v, out)
        for qs, ks, mask, has_key in self._blocks(q, k, cu_q, cu_k, causal):
            if qs.stop == qs.start or ks.stop == ks.start:
                continue
            l = backward_lse(lse[qs], accumulation_dtype(q.dtype)).unsqueeze(0)
            g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[qs].transpose(0, 1).unsqueeze(0).contiguous(),
                q[qs].transpose(0, 1).unsqueeze(0), k[ks].transpose(0, 1).unsqueeze(0),
                v[ks].transpose(0, 1).unsqueeze(0), out[qs].transpose(0, 1).unsqueeze(0),
                l, 0.0, False, attn_mask=mask, scale=softmax_scale)
            dq[qs] += g_q[0].transpose(0, 1)
            dk[ks] += g_k[0].transpose(0, 1)
            dv[ks] += g_v[0].transpose(0, 1)
        return dq, dk, dv


def _lse_to_token_major(lse, total_q, heads):
    """Kernels give [H, Tq] (packed) or [B, H, max_q] (padded, old flash-attn): -> [Tq, H]
    float32 (float64 from a float64 lse) (a view of H-major memory), in one kernel."""
    if lse.dim() == 2 and lse.shape == (heads, total_q):
        # flash kernels mark rows without any key with +inf (so that their backward is 0);
        # the contract here is -inf (no probability mass), which merges correctly. NaN stays.
        return torch.nan_to_num(lse.to(accumulation_dtype(lse.dtype)), nan=math.nan,
                                posinf=-math.inf, neginf=-math.inf).transpose(0, 1)
    raise ValueError(f"unexpected softmax_lse shape {tuple(lse.shape)} for {total_q} queries "
                     f"and {heads} heads (flash-attn < 2.6 pads lse per row; use >= 2.6)")


def backward_lse(lse_TH, dtype=torch.float32):
    """The lse a kernel's backward takes: [H, Tq] contiguous in `dtype`, a row without any key
    (-inf here, +inf in flash's own marking: it contributes nothing) given 0, which the
    kernels accept (an infinite lse would make exp(s - lse) NaN). One kernel, whatever the
    layout of lse_TH; NaN stays NaN. (nan_to_num would turn an infinity it is not told about
    into the largest float: both are named.)"""
    out = torch.empty((lse_TH.shape[1], lse_TH.shape[0]), dtype=dtype, device=lse_TH.device)
    return torch.nan_to_num(lse_TH.transpose(0, 1).to(dtype), nan=math.nan, posinf=0.0,
                            neginf=0.0, out=out)


# PyTorch >= 2.12 has a flash forward that writes into a given out (what varlen_attn_out
# runs); before, the result is copied there.
_FORWARD_INTO_OUT = hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace")


def writes_given_out(q, k, max_q) -> bool:
    """Whether a FlashAttention-2 varlen forward (flash-attn's, or PyTorch's copy of it)
    given an out writes the result there. Not where every query sequence has one row and q
    has more heads than k: there it regroups the heads of q and out (its decoding path,
    `seqlenq_ngroups_swapped`) into new tensors, writes those and returns them, the given
    tensor in general not written. A split local call's part of 1-token documents under GQA
    is such a call; its result is then copied into out (`_into`)."""
    return not (max_q == 1 and q.shape[1] > k.shape[1])


class TorchVarlenBackend:
    """PyTorch's own CUDA flash kernels (no flash-attn needed)."""

    name = "torch_varlen"
    writes_out = _FORWARD_INTO_OUT
    writes_grads = False  # its backward always allocates the gradients

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, out=None):
        if out is not None and _FORWARD_INTO_OUT and writes_given_out(q, k, max_q):
            lse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(
                out, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                scale=softmax_scale)
            return out, _lse_to_token_major(lse, q.shape[0], q.shape[1])
        result, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=softmax_scale)
        return _into(out, result), _lse_to_token_major(lse, q.shape[0], q.shape[1])

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                 softmax_scale, grads=None):
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, backward_lse(lse), cu_q, cu_k, max_q, max_k, 0.0,
            causal, unused, unused, scale=softmax_scale)
        if grads is None:
            return dq, dk, dv
        return tuple(_into(given, g) for given, g in zip(grads, (dq, dk, dv)))


# flash-attn: 2.6 is the first to return the varlen log-sum-exp unpadded ([H, total_q]);
# 2.7 renamed window_size (a pair) to window_size_left/right and returns (out, lse, ...)
# instead of (out, q, k, v, out_padded, lse, ...). Its extension's varlen_fwd takes an out
# (the 4th of its 21 positional arguments, from 2.6.1 to 2.8.x at least): used, to write a
# given out, only for the versions read to have that signature.
MIN_FLASH_ATTN = (2, 6)
_FLASH_ATTN_OUT_VERSIONS = ((2, 7), (2, 9))  # [first, last): varlen_fwd(q, k, v, out, ...)


def _version(text: str) -> Tuple[int, ...]:
    """(2, 8, 3) of "2.8.3.post1" or "2.8.3+cu121torch2.3": the leading numbers of the public
    version; () where there are none."""
    numbers = []
    for part in str(text).split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


FLASH_ATTN_MISSING = "flash-attn is not installed (pip install flash-attn)"


def flash_attn_problem() -> Optional[str]:
    """None where a flash-attn this backend can use imports, else why not (for the flag
    checks and the kernel choice): FLASH_ATTN_MISSING, or what is wrong with the one there."""
    try:
        import flash_attn  # noqa: F401 - optional extra
    except ModuleNotFoundError as error:
        if error.name == "flash_attn":
            return FLASH_ATTN_MISSING
        return f"flash-attn is installed but cannot be imported ({error!r})"
    except Exception as error:  # noqa: BLE001 - its CUDA extension or op registration
        return f"flash-attn is installed but cannot be imported ({error!r})"
    version = getattr(flash_attn, "__version__", None)
    needed = ".".join(map(str, MIN_FLASH_ATTN))
    if not _version(version):
        return (f"flash-attn is installed, but its version ({version!r}) cannot be read; "
                f"megatron-eod needs flash-attn >= {needed}")
    if _version(version) < MIN_FLASH_ATTN:
        return (f"flash-attn {version} is installed, but megatron-eod needs flash-attn >= "
                f"{needed} (earlier versions pad the varlen log-sum-exp per sequence)")
    return None


class FlashAttnBackend:
    """flash-attn's varlen kernels (imported only here, only when used), 2.6 and later."""

    name = "flash_attn"
    writes_grads = True  # its backward takes dq, dk, dv

    def __init__(self):
        problem = flash_attn_problem()
        if problem is not None:
            raise ImportError(problem)
        import flash_attn
        from flash_attn import flash_attn_interface as fai

        self._fai = fai
        version = _version(flash_attn.__version__)
        self._pair_window = version < (2, 7)  # window_size=(-1, -1); lse 6th of 8 results
        first, last = _FLASH_ATTN_OUT_VERSIONS
        extension = getattr(fai, "flash_attn_gpu", None) or getattr(fai, "flash_attn_cuda", None)
        self._varlen_fwd = getattr(extension, "varlen_fwd", None) \
            if first <= version < last else None
        # The forward writes into a given out where the extension's call is known (else the
        # Python forward allocates out, and the result is copied there).
        self.writes_out = self._varlen_fwd is not None

    def _windows(self):
        return ({"window_size": (-1, -1)} if self._pair_window
                else {"window_size_left": -1, "window_size_right": -1})

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, out=None):
        if out is not None and self.writes_out and writes_given_out(q, k, max_q):
            # What _flash_attn_varlen_forward passes, with out given (and q, k, v made
            # contiguous in their last dimension as it makes them).
            q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
            result = self._varlen_fwd(
                q, k, v, out, cu_q, cu_k, None, None, None, None, max_q, max_k, 0.0,
                softmax_scale, False, causal, -1, -1, 0.0, False, None)
            return out, _lse_to_token_major(result[1], q.shape[0], q.shape[1])
        result = self._fai._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=softmax_scale,
            causal=causal, softcap=0.0, alibi_slopes=None, return_softmax=False,
            block_table=None, **self._windows())
        lse = result[5] if self._pair_window else result[1]
        return _into(out, result[0]), _lse_to_token_major(lse, q.shape[0], q.shape[1])

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                 softmax_scale, grads=None):
        # Given gradients are written by the kernel (slices of contiguous tensors are too).
        dq, dk, dv = grads if grads is not None else \
            (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        self._fai._flash_attn_varlen_backward(
            dout.contiguous(), q, k, v, out, backward_lse(lse, accumulation_dtype(q.dtype)), dq,
            dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=softmax_scale,
            causal=causal, softcap=0.0, alibi_slopes=None,
            deterministic=torch.are_deterministic_algorithms_enabled(),  # --deterministic-mode
            rng_state=None, **self._windows())
        return dq, dk, dv


def _into(given, result):
    """result, copied into `given` when one is given (a kernel that cannot write there)."""
    return result if given is None else given.copy_(result)


def get_backend(device: torch.device, dtype: torch.dtype, prefer: str = "auto"):
    """The kernel for tensors on `device` with `dtype`; errors name the rule broken."""
    if device.type == "cpu":
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the CPU attention backend takes float32 or float64, got {dtype}")
        return CPUExactBackend()
    if device.type != "cuda":
        raise ValueError(f"no attention backend for device type {device.type!r}")
    if dtype not in _GPU_DTYPES:
        raise ValueError(f"GPU varlen attention kernels take float16 or bfloat16, got {dtype} "
                         f"(train with --bf16 or --fp16)")
    if prefer in ("auto", "flash_attn"):
        try:
            return FlashAttnBackend()
        except ImportError as error:
            if prefer == "flash_attn":
                raise ValueError(f"backend 'flash_attn' requested (--use-flash-attn): "
                                 f"{error}") from None
            if str(error) != FLASH_ATTN_MISSING:  # there but unusable: say so, go on
                _warn_once(f"{error}; using PyTorch's varlen flash kernels instead")
    return TorchVarlenBackend()


_WARNED = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message)


def has_transformer_engine() -> bool:
    """Whether TransformerEngine is importable (its layer spec is used on GPUs when it is)."""
    return importlib.util.find_spec("transformer_engine") is not None


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
