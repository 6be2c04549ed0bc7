"""The tiny GPT of the CPU functional tests: its flags, and a rank function that trains it.

2 layers, hidden 64, 4 heads over 2 query groups (GQA), RoPE (both spelled out: Megatron-LM's
defaults, which both trainers share, are multi-head attention and learned positions),
sequence 128, micro-batch 2, global batch 4, 10 iterations, float32, dropout off (dropout
masks depend on which rank holds a token, so they would differ between CP sizes), EoD reset
on.
"""

from megatron_eod.training.pretrain import pretrain

ITERS = 10


def tiny_flags(data_path, *extra, drop=()):
    """The tiny config's flags plus `extra`; `drop` removes some of ours (with their values)."""
    flags = _tiny_flags(data_path)
    kept = []
    for i, token in enumerate(flags):
        dropped = token in drop or (not token.startswith("--") and flags[i - 1] in drop)
        if not dropped:
            kept.append(token)
    return kept + list(extra)


def _tiny_flags(data_path):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2",
            "--position-embedding-type", "rope", "--seq-length", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "2e-3",
            "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--hidden-dropout", "0", "--data-path", data_path, "--split", "90,8,2",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
            "--eval-interval", "5", "--eval-iters", "1", "--log-interval", "100",
            "--seed", "1234"]


def megatron_lm_tiny_flags(data_path, vocab_size, *extra):
    """The same tiny GPT for Megatron-LM's own trainer (`--trainer megatron-lm`): our byte
    data through its NullTokenizer (`vocab_size`: the --vocab-size that makes 256 its EoD,
    megatron_lm_checkout.null_tokenizer_vocab_size), the settings the lean trainer fixes
    spelled out (the maximum positions, no attention dropout), its fused kernels off (they need
    TransformerEngine or Apex, absent from the CPU and the lent GPU machine)."""
    return tiny_flags(
        data_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
        "--max-position-embeddings", "128", "--attention-dropout", "0",
        "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
        "--no-bias-gelu-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", *extra)


def train_rank(rank, world_size, argv):
    """Train on this forked rank; the last rank returns the per-iteration losses."""
    losses = pretrain(argv)
    return losses if rank == world_size - 1 else None


def losses_of(results):
    return results[-1]
