"""Multi-latent attention (megatron-core's MLASelfAttention) with EoD reset under CP.

One job: `eod_mla_self_attention()`, megatron-core's MLA self-attention whose RoPE is taken at
the micro-batch's RESET position ids. MLA applies RoPE itself, to the decoupled rope part of q
and k, with angles for positions 0..s-1 (under CP, megatron-core's zigzag share of them); the
subclass makes its rotary module answer, while its forward runs, the angles of this rank's
tokens' reset positions instead (in plan order, not sliced again). The core attention is EoD
attention without a RoPE of its own (layer_spec.py), which takes q/k head dim != v head dim
(core_attention.py pads the narrower).

What it does not do: no attention of its own, no fused MLA RoPE (--apply-rope-fusion is off
with EoD attention), no MLA inference paths.
"""

from __future__ import annotations

import contextvars
import functools

from megatron_eod.megatron.imports import import_megatron

__all__ = ["eod_mla_self_attention"]

_RUNNING = contextvars.ContextVar("eod_mla_context", default=None)


def _at_reset_positions(rope, original, *args, **kwargs):
    """The rotary module's forward: megatron-core's own while no EoD MLA forward runs; else
    its angles (Yarn: and mscale) for the running micro-batch's local reset positions."""
    context = _RUNNING.get()
    if context is None:
        return original(*args, **kwargs)
    # MLA asks for the sequence's length (its local rows x CP): every reset position is below
    # it, so no host sync on the positions' maximum (a layer's forward would wait for it).
    max_seq_len = args[0] if args else kwargs["max_seq_len"]
    positions = context.position_ids
    found = rope.get_emb(max_seq_len, 0)
    if isinstance(found, tuple):  # YarnRotaryEmbedding: (angles, mscale)
        angles, mscale = found
        return angles[positions.to(angles.device)], mscale
    return found[positions.to(found.device)]


@functools.lru_cache(maxsize=None)
def eod_mla_self_attention():
    """megatron-core's MLASelfAttention with RoPE at the reset positions (the module's)."""
    base = import_megatron("megatron.core.transformer.multi_latent_attention").MLASelfAttention

    class EodMLASelfAttention(base):
        """megatron-core's MLA self-attention, its RoPE at the micro-batch's reset position
        ids (megatron/mla.py); `registry`: the model's EodContextRegistry."""

        def __init__(self, *args, registry=None, **kwargs):
            super().__init__(*args, **kwargs)
            if registry is None:
                raise ValueError("EodMLASelfAttention needs the model's EodContextRegistry")
            self.eod_registry = registry
            rope = self.rotary_pos_emb
            rope.forward = functools.partial(_at_reset_positions, rope, rope.forward)

        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            token = _RUNNING.set(self.eod_registry.lookup(attention_mask))
            try:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            finally:
                _RUNNING.reset(token)

    return EodMLASelfAttention
