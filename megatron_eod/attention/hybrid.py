"""Ulysses and Hybrid attention, composed from the Ulysses all-to-alls and the Ring function.

One job: Ulysses inside a group of u consecutive ranks (all-to-all to head-sharding), the
document-aware Ring across the R = cp/u groups (strided ranks) on the group's tokens, then
the all-to-all back. Pure Ulysses is the case R = 1 (the ring has no steps: one local varlen
call over the group's whole documents); pure Ring is u = 1 and never calls this module.
"""

from megatron_eod.attention.ring import ring_attention
from megatron_eod.attention.ulysses import head_to_seq, seq_to_head

__all__ = ["ulysses_ring_attention"]


def ulysses_ring_attention(q_nHD, k_nGD, v_nGD, schedule, ulysses_group, ring_group, degree,
                           backend, softmax_scale):
    q_THD, k_TGD, v_TGD = seq_to_head(q_nHD, k_nGD, v_nGD, ulysses_group, degree)
    out_THD = ring_attention(q_THD, k_TGD, v_TGD, schedule, ring_group, backend, softmax_scale)
    return head_to_seq(out_THD, ulysses_group, degree)
