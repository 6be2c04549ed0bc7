"""The lean trainer's model flags: declared with Megatron-LM's spellings, dests and defaults,
their defaults derived and their rules checked (args.py calls `add_model_args` and
`check_model`), Megatron-LM's other spellings of them (--encoder-seq-length,
--use-rotary-position-embeddings, --no-position-embedding, --recompute-activations) read
as it reads them. `switches` / `typed` declare a group's plain flags (args.py's groups too).

What it does not do: no config (training/model.py maps these onto megatron-core's
TransformerConfig), no CP rules (cp_flags.py).
"""

from __future__ import annotations

import argparse

from megatron_eod.training.cp_flags import FlagError, check_query_groups
from megatron_eod.training.flag_rules import check_positive as _positive

__all__ = ["add_model_args", "check_model", "switches", "typed"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def switches(g, *flags: str) -> None:
    for flag in flags:
        g.add_argument(flag, action="store_true")


def typed(g, kind, *specs) -> None:
    """(flag, default[, help]) specs of one type; a None default is derived or means 'off'."""
    for flag, default, *help_text in specs:
        g.add_argument(flag, type=kind, default=default, help=(help_text or [None])[0])


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        g.add_argument(flag, type=int, required=True)
    typed(g, int, ("--seq-length", None, "required (or Megatron-LM's --encoder-seq-length)"),
           ("--encoder-seq-length", None, "Megatron-LM's other name of --seq-length"))
    typed(g, int, ("--num-query-groups", None, "key/value heads with --group-query-attention "
                                                "(default there: 1); without it, multi-head "
                                                "attention, as Megatron-LM"),
           ("--ffn-hidden-size", None, "default: 4 x --hidden-size; with --swiglu, 2/3 of "
                                       "that rounded down to a multiple of 64 (Megatron-LM's)"),
           ("--kv-channels", None, "default: --hidden-size / --num-attention-heads"),
           ("--max-position-embeddings", None, "default: --seq-length"),
           ("--rotary-base", 10000), ("--make-vocab-size-divisible-by", 128))
    typed(g, float, ("--rotary-percent", 1.0), ("--init-method-std", 0.02),
           ("--hidden-dropout", 0.1),
           ("--attention-dropout", None, "must be 0: the varlen attention kernels apply none "
                                         "(default here 0, said at start-up; Megatron-LM's "
                                         "0.1)"))
    switches(g, "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights",
              "--qk-layernorm", "--rotary-interleaved", "--use-rope-scaling")
    typed(g, float, ("--rope-scaling-factor", 8.0, "Llama-3 RoPE scaling factor"),
           ("--rotary-seq-len-interpolation-factor", None,
            "divide positions by this factor (linear RoPE interpolation)"),
           ("--embedding-init-method-std", None, "default: --init-method-std"))
    # Megatron-LM's dests (its checkpoints' args carry these names)
    g.add_argument("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon",
                   help="the layer norms' epsilon")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   dest="layernorm_zero_centered_gamma",
                   help="norm weights stored as gamma - 1 (initialised to 0)")
    switches(g, "--add-qkv-bias", "--squared-relu", "--init-method-xavier-uniform",
              "--use-rotary-position-embeddings")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="Megatron-LM's deprecated spelling; only with RoPE")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="default: transformer_engine where it is installed and CUDA is "
                        "present (Megatron-LM's default), else local")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute", "none"),
                   default="learned_absolute",
                   help="all at the reset position ids (default: learned_absolute, Megatron-LM's)")


def _check_megatron_lm_spellings(args) -> None:
    """Megatron-LM's other names: --encoder-seq-length, --use-rotary-position-embeddings,
    --recompute-activations; --no-position-embedding only with RoPE (as Megatron-LM)."""
    if args.seq_length is None:
        _require(args.encoder_seq_length is not None, "--seq-length is required")
        args.seq_length = args.encoder_seq_length
    _require(args.encoder_seq_length in (None, args.seq_length),
             f"--seq-length {args.seq_length} and --encoder-seq-length "
             f"{args.encoder_seq_length} differ: pass one")
    args.encoder_seq_length = args.seq_length
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    _require(args.add_position_embedding or args.position_embedding_type == "rope",
             f"--no-position-embedding is deprecated and, as in Megatron-LM, refused with "
             f"--position-embedding-type {args.position_embedding_type}: drop it ("
             + ("--position-embedding-type none already adds no positions)"
                if args.position_embedding_type == "none" else
                "--position-embedding-type none adds no positions)"))
    if args.recompute_activations:
        _require(args.recompute_granularity in (None, "selective"),
                 f"--recompute-activations means --recompute-granularity selective, not "
                 f"{args.recompute_granularity}: pass one")
        args.recompute_granularity = "selective"


def check_model(args) -> None:
    _check_megatron_lm_spellings(args)
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "kv_channels", "seq_length", "max_position_embeddings",
              "make_vocab_size_divisible_by", "rotary_base", "init_method_std")
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    check_query_groups(args)  # Megatron-LM's meaning: one launch script, one model
    if args.num_query_groups is None:  # Megatron: --group-query-attention alone means 1 group
        args.num_query_groups = 1 if args.group_query_attention else heads
    groups = args.num_query_groups
    _require(heads % groups == 0, f"--num-attention-heads {heads} must be divisible by "
                                  f"--num-query-groups {groups}")
    _require(heads % tp == 0, f"--num-attention-heads {heads} must be divisible by "
                              f"--tensor-model-parallel-size {tp}")
    _require(groups % tp == 0, f"--num-query-groups {groups} must be divisible by "
                               f"--tensor-model-parallel-size {tp}")
    args.group_query_attention = groups < heads
    args.disable_bias_linear = not args.add_bias_linear  # the flag's name, for readers of args
    if args.kv_channels is None:
        _require(args.hidden_size % heads == 0,
                 f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                 f"{heads} (or pass --kv-channels)")
        args.kv_channels = args.hidden_size // heads
    if args.ffn_hidden_size is None:  # Megatron-LM's defaults (the same expression)
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
            _require(args.ffn_hidden_size > 0,
                     f"--swiglu with --hidden-size {args.hidden_size}: the default "
                     f"--ffn-hidden-size (2/3 of 4 x hidden, rounded down to a multiple of 64, "
                     f"as Megatron-LM) is 0; pass --ffn-hidden-size")
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} must be <= --max-position-embeddings "
             f"{args.max_position_embeddings}")
    _positive(args, "rope_scaling_factor", "rotary_seq_len_interpolation_factor")
    _require(0.0 < args.rotary_percent <= 1.0,
             f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    _require(0.0 <= args.hidden_dropout < 1.0,
             f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}")
    _require(not (args.squared_relu and args.swiglu),
             "--squared-relu and --swiglu are exclusive (one activation): pass one")
    _positive(args, "embedding_init_method_std")
    _require(args.layernorm_epsilon > 0,
             f"--norm-epsilon must be positive, got {args.layernorm_epsilon}")
    args.attention_dropout_defaulted = args.attention_dropout is None or getattr(
        args, "attention_dropout_defaulted", False)  # (validating again keeps the answer)
    if args.attention_dropout is None:  # Megatron-LM's default, 0.1, cannot run: said
        args.attention_dropout = 0.0
    _require(args.attention_dropout == 0.0,
             f"--attention-dropout {args.attention_dropout}: our varlen attention kernels "
             f"apply no dropout; pass --attention-dropout 0")
