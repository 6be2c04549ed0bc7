"""Numbers about the model for the log: --log-params-norm and --log-throughput.

One job: the L2 norm of all parameters, each counted once over TP and PP (as Megatron-LM's
`calc_params_l2_norm`: TP duplicates such as layer norms and biases of row-parallel layers,
and the shared embedding's copy on the last pipeline stage, are left out, the rest summed over
the model-parallel group), and the model FLOPs of one training iteration.

    norm = params_norm(ddp_model_chunks)                # collective over TP x PP
    flops = model_flops(args, vocab_size, tokens, attention_pairs)

FLOPs: 6 per matmul weight per token (forward and backward) for the QKV, projection, MLP and
output-layer weights, plus the attention of the query-key pairs the document mask needs
(4 x heads x head size a pair forward, twice that backward, per layer). Megatron-LM's
--log-throughput counts every causal pair of the whole sequence instead, so it reports more
FLOPs for the same work when documents are short.

What it does not do: no norm of the optimizer's float32 master copies (the model's own
weights, in float32 arithmetic), no FLOPs of norms, softmax or the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron

__all__ = ["params_norm", "model_flops", "matmul_weights", "attention_flops"]


def params_norm(chunks) -> float:
    tp = import_megatron("megatron.core.tensor_parallel")
    module = import_megatron("megatron.core.transformer.module")
    ps = import_megatron("megatron.core.parallel_state")
    squares = None
    for param in (p for chunk in chunks for p in chunk.parameters()):
        if not (module.param_is_not_shared(param)
                and tp.param_is_not_tensor_parallel_duplicate(param)):
            continue
        part = torch.linalg.vector_norm(param.detach(), dtype=torch.float32) ** 2
        squares = part if squares is None else squares + part
    if squares is None:
        squares = torch.zeros((), device=next(chunks[0].parameters()).device)
    squares = squares.reshape(1)
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    return squares.sqrt().item()


def matmul_weights(args, vocab_size: int) -> int:
    """The weights each token multiplies through, whole model (all TP/PP ranks together)."""
    h, heads, groups, head = (args.hidden_size, args.num_attention_heads,
                              args.num_query_groups, args.kv_channels)
    attention = h * (heads + 2 * groups) * head + heads * head * h
    mlp = (3 if args.swiglu else 2) * h * args.ffn_hidden_size
    return args.num_layers * (attention + mlp) + h * vocab_size


def attention_flops(args, attention_pairs: float) -> float:
    """FLOPs of the attention of `attention_pairs` query-key pairs, forward and backward:
    4 x heads x head size a pair forward, twice that backward, per layer."""
    return attention_pairs * 4 * args.num_attention_heads * args.kv_channels * 3 \
        * args.num_layers


def model_flops(args, vocab_size: int, tokens: int, attention_pairs: float) -> float:
    """FLOPs of one training iteration over `tokens` tokens whose document masks hold
    `attention_pairs` query-key pairs in all."""
    return 6.0 * matmul_weights(args, vocab_size) * tokens + attention_flops(args,
                                                                             attention_pairs)
