"""`EodCoreAttention`: the `core_attention` of a megatron-core GPT layer spec.

One job: take q/k/v from megatron-core's SelfAttention ([s, b, heads, dim], heads already
split over tensor parallelism, no rotary applied because the model is built with
position_embedding_type="none"), apply RoPE at the micro-batch's RESET position ids, and run
`context_parallel_attention` with the micro-batch's plan. The micro-batch arrives packed as
b = 1 row of the rank's b*s/cp tokens in plan order (see batch_context.py for how the plan
gets here). Returns [s, b, heads*dim] as megatron-core expects.

RoPE follows the TransformerConfig and the GPTModel rotary arguments as megatron-core's own
RotaryEmbedding does (base, percent, interleaved layout, Llama-3 scaling, position
interpolation, no RoPE on the layers of --no-rope-freq): its inverse frequencies, at the
reset positions. Settings this module cannot honour (attention dropout, sliding windows,
non-vanilla softmax, MLA) raise, naming them.

What it does not do: no dropout on attention probabilities (varlen kernels here have none;
--attention-dropout must be 0), no padding masks (pads are documents of their own).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_eod.attention import context_parallel_attention
from megatron_eod.attention.backends import default_scale, get_backend
from megatron_eod.attention.ring import check_ring_exchange
from megatron_eod.attention.triton_forward import TritonForwardBackend
from megatron_eod.megatron.imports import import_megatron

__all__ = ["EodCoreAttention"]

_module = import_megatron("megatron.core.transformer.module")
_rope = import_megatron("megatron.core.models.common.embeddings.rope_utils")
_rotary = import_megatron("megatron.core.models.common.embeddings.rotary_pos_embedding")


def _refuse_unsupported(config, dropout) -> None:
    """The TransformerConfig settings megatron-core's own core attention honours and this
    one cannot: ValueError naming the setting (and its Megatron-LM flag)."""
    if dropout:
        raise ValueError(f"--attention-dropout must be 0 with EoD attention (got {dropout}): "
                         f"the varlen kernels apply no dropout")
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"TransformerConfig.window_size={config.window_size} "
                         f"(--window-size): EoD attention is full causal within documents")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"TransformerConfig.softmax_type={config.softmax_type!r} "
                         f"(--softmax-type): EoD attention's kernels compute the vanilla softmax")


class EodCoreAttention(_module.MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, registry=None, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0,
                 seq_len_interpolation_factor: Optional[float] = None, kernel: str = "auto",
                 ring_exchange: str = "batched", concurrent_calls: bool = False,
                 fused_forward: bool = False, fused_backward: bool = False,
                 k_channels=None, v_channels=None):
        # k_channels, v_channels: multi-latent attention's q/k and v head dims, which the
        # tensors carry (forward pads the narrower).
        super().__init__(config=config)
        if kernel not in ("auto", "flash_attn", "torch"):
            raise ValueError(f"kernel must be 'auto', 'flash_attn' or 'torch', got {kernel!r}")
        check_ring_exchange(ring_exchange)
        if registry is None:
            raise ValueError("EodCoreAttention needs the model's EodContextRegistry "
                             "(build the spec with get_gpt_layer_eod_spec(registry))")
        _refuse_unsupported(config, config.attention_dropout if attention_dropout is None
                            else attention_dropout)
        self.registry = registry
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or default_scale(self.head_dim)
        # No RoPE with rotary_percent = 0 (--position-embedding-type none) or on the layers
        # --no-rope-freq marks (as megatron-core's Attention; layer_number is 1-based, global).
        skip = config.no_rope_freq[layer_number - 1] if config.no_rope_freq else False
        self.rotary = None
        if rotary_percent and not skip:
            # megatron-core's own frequencies (base, percent, Llama-3 scaling); the angles
            # are taken at the reset position ids instead of 0..s-1.
            self.rotary = _rotary.RotaryEmbedding(
                self.head_dim, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base, rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor, use_cpu_initialization=True)
        self.kernel = kernel  # GPU kernel choice (--use-flash-attn: "flash_attn"); CPU: exact
        self.ring_exchange = ring_exchange  # the ring executor (--cp-ring-exchange)
        self.concurrent_calls = concurrent_calls  # --cp-concurrent-calls
        self.fused_forward = fused_forward  # --cp-fused-forward
        self.fused_backward = fused_backward  # --cp-fused-backward (with fused_forward)
        if fused_backward and not fused_forward:
            raise ValueError("fused_backward (--cp-fused-backward) needs fused_forward "
                             "(--cp-fused-forward)")
        self._backends = {}  # (device, dtype) -> backend: chosen once, not per forward
        self._inv_freq = {}  # device -> the rotary inverse frequencies there

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("EodCoreAttention takes no packed_seq_params or attention_bias: "
                             "documents come from the EoD plan")
        ctx = self.registry.lookup(attention_mask)
        s, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"EodCoreAttention expects the micro-batch packed as one row "
                             f"([s, 1, ...]), got b={b}")
        if self.rotary is not None:
            freqs = ctx.rotary_freqs(self._inverse_frequencies(query.device),
                                     self.config.rotary_interleaved,
                                     self.rotary.seq_len_interpolation_factor)
            query = _rope.apply_rotary_pos_emb(query, freqs, self.config, cp_group=ctx.cp_group)
            key = _rope.apply_rotary_pos_emb(key, freqs, self.config, cp_group=ctx.cp_group)
        # Multi-latent attention: q/k head dim (its nope + rope parts) != v head dim. The
        # narrower side is padded with zeros (exact: zero columns of q and k add nothing to
        # q.k, zero columns of v give zero outputs, cut off again) so that every kernel and
        # executor sees one head dim; the cost is the padding's share of the work.
        qk_dim, v_dim = query.shape[-1], value.shape[-1]
        if v_dim < qk_dim:
            value = torch.nn.functional.pad(value, (0, qk_dim - v_dim))
        elif v_dim > qk_dim:
            query = torch.nn.functional.pad(query, (0, v_dim - qk_dim))
            key = torch.nn.functional.pad(key, (0, v_dim - qk_dim))
        out = context_parallel_attention(query[:, 0], key[:, 0], value[:, 0], ctx.plan,
                                         group=ctx.cp_group, softmax_scale=self.softmax_scale,
                                         backend=self._backend(query),
                                         ring_exchange=self.ring_exchange,
                                         concurrent_calls=self.concurrent_calls)
        if out.shape[-1] != v_dim:
            out = out[..., :v_dim]
        return out.reshape(s, 1, -1)

    def _inverse_frequencies(self, device):
        if device not in self._inv_freq:
            self._inv_freq[device] = self.rotary.inv_freq.to(device)
        return self._inv_freq[device]

    def _backend(self, query):
        key = (query.device, query.dtype)
        if key not in self._backends:
            backend = get_backend(query.device, query.dtype, prefer=self.kernel)
            if self.fused_forward:  # its kernel names tensors it cannot take
                backend = TritonForwardBackend(backend, self.fused_backward)
            self._backends[key] = backend
        return self._backends[key]
