"""`megatron_eod.training.args`: Megatron-style flags, derived fields and every FlagError rule.

CPU only, no process groups: `world_size` and `cuda_available` are passed explicitly, so the
GPU-only rules (--bf16, --use-flash-attn, nccl) are exercised both ways on any machine.
"""

import sys
import types

import pytest
import torch

from megatron_eod.data.tokenizers import TOKENIZER_TYPES
from megatron_eod.training.args import (
    CP_ALGO_ALIASES, FlagError, build_parser, parse_args, validate_args)
from megatron_eod.megatron.dataset import parse_data_path

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "128", "--train-iters", "10", "--lr", "1e-3"]


def parse(*extra, world_size=1, cuda=False, data=("--mock-data",)):
    """The tiny config plus `extra` (a later flag overrides the same flag in MODEL)."""
    return parse_args(MODEL + list(data) + [str(x) for x in extra], world_size=world_size,
                      cuda_available=cuda)


def test_tiny_config_defaults():
    args = parse()
    assert args.world_size == 1 and args.data_parallel_size == 1
    assert args.context_parallel_algo == "ring" and args.ulysses_degree == 1
    assert args.params_dtype is torch.float32
    assert args.num_query_groups == 8 and not args.group_query_attention
    assert args.ffn_hidden_size == 256 and args.kv_channels == 8
    assert args.max_position_embeddings == 128
    assert args.global_batch_size == 1 and args.num_micro_batches == 1
    assert args.lr_decay_iters == 10 and args.lr_decay_style == "linear"
    assert args.attention_mask_type == "causal" and not args.reset_attention_mask
    assert args.distributed_backend == "gloo"
    assert args.tokenizer_type == "ByteTokenizer" and args.split == "969,30,1"
    assert args.add_bias_linear and not args.disable_bias_linear and not args.sequence_parallel
    assert args.recompute_method is None and args.recompute_num_layers is None
    assert (args.attention_dropout, args.hidden_dropout, args.clip_grad) == (0.0, 0.1, 1.0)
    assert (args.eval_interval, args.eval_iters, args.log_interval) == (1000, 100, 100)
    assert args.num_workers == 0 and args.seed == 1234 and args.rotary_base == 10000


def test_megatron_dest_names():
    args = parse("--disable-bias-linear", "--untie-embeddings-and-output-weights", "--swiglu",
                 "--normalization", "RMSNorm", "--no-load-optim", "--no-load-rng",
                 "--use-cpu-initialization", "--position-embedding-type", "none",
                 "--make-vocab-size-divisible-by", "64", "--save", "ckpt", "--save-interval", 5)
    assert args.add_bias_linear is False and args.disable_bias_linear is True
    assert args.untie_embeddings_and_output_weights and args.swiglu
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "none"
    assert args.no_load_optim and args.no_load_rng and args.use_cpu_initialization
    assert args.make_vocab_size_divisible_by == 64
    assert (args.save, args.save_interval) == ("ckpt", 5)


def test_parallel_sizes_and_batches():
    args = parse("--tensor-model-parallel-size", 2, "--context-parallel-size", 2,
                 "--micro-batch-size", 2, world_size=8)
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 4 and args.num_micro_batches == 1
    args = parse("--tensor-model-parallel-size", 2, "--context-parallel-size", 2,
                 "--micro-batch-size", 2, "--global-batch-size", 16, world_size=8)
    assert args.num_micro_batches == 4


@pytest.mark.parametrize("algo,given,stored,degree", [
    ("ring", None, "ring", 1), ("ring", 1, "ring", 1),
    ("ulysses", None, "ulysses", 4), ("ulysses", 4, "ulysses", 4),
    ("hybrid", 2, "hybrid", 2),
    ("megatron_cp_algo", None, "ring", 1), ("ulysses_cp_algo", None, "ulysses", 4),
    ("hybrid_cp_algo", 2, "hybrid", 2),
])
def test_context_parallel_algos(algo, given, stored, degree):
    extra = ["--context-parallel-size", 4, "--context-parallel-algo", algo]
    if given is not None:
        extra += ["--ulysses-degree-in-cp", given]
    args = parse(*extra, world_size=8)
    assert args.context_parallel_algo == stored and args.ulysses_degree == degree
    assert args.data_parallel_size == 2


def test_algo_aliases_cover_the_plan_algorithms():
    from megatron_eod.plan.cp_plan import ALGORITHMS
    assert set(CP_ALGO_ALIASES.values()) == set(ALGORITHMS)


def test_attention_mask_type():
    assert parse("--reset-attention-mask").attention_mask_type == "general"
    args = parse("--attention-mask-type", "general")
    assert args.reset_attention_mask and args.attention_mask_type == "general"
    args = parse("--attention-mask-type", "causal")
    assert not args.reset_attention_mask and args.attention_mask_type == "causal"


def test_query_groups():
    args = parse("--num-query-groups", 2)
    assert args.num_query_groups == 2 and args.group_query_attention
    args = parse("--group-query-attention")  # Megatron: the flag alone means one group
    assert args.num_query_groups == 1 and args.group_query_attention
    args = parse("--group-query-attention", "--num-query-groups", 8)
    assert args.num_query_groups == 8 and not args.group_query_attention


def test_explicit_model_sizes():
    args = parse("--hidden-size", 60, "--kv-channels", 16, "--ffn-hidden-size", 100,
                 "--max-position-embeddings", 512)
    assert (args.kv_channels, args.ffn_hidden_size, args.max_position_embeddings) == (16, 100,
                                                                                     512)


def test_recompute_defaults():
    args = parse("--recompute-granularity", "full")
    assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)
    args = parse("--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", 2, "--pipeline-model-parallel-size", 2, world_size=2)
    assert (args.recompute_method, args.recompute_num_layers) == ("block", 2)
    assert parse("--recompute-granularity", "selective").recompute_method is None


def test_sequence_parallel():
    assert not parse("--sequence-parallel").sequence_parallel  # TP 1: off, as Megatron
    args = parse("--sequence-parallel", "--tensor-model-parallel-size", 2, world_size=2)
    assert args.sequence_parallel


@pytest.mark.parametrize("flags,dtype", [
    ([], torch.float32), (["--bf16"], torch.bfloat16), (["--fp16"], torch.float16)])
def test_cuda_dtypes_and_backend(flags, dtype):
    args = parse(*flags, cuda=True)
    assert args.params_dtype is dtype and args.distributed_backend == "nccl"
    assert parse(*flags, "--distributed-backend", "gloo", cuda=True).distributed_backend == "gloo"


def test_flash_attn_available(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert parse("--use-flash-attn", cuda=True).use_flash_attn


def test_flash_attn_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    with pytest.raises(FlagError, match=r"--use-flash-attn .*pip install flash-attn"):
        parse("--use-flash-attn", cuda=True)


@pytest.mark.parametrize("name", TOKENIZER_TYPES)
def test_tokenizer_types_accepted(name):
    extra = {"HuggingFaceTokenizer": ["--tokenizer-model", "tok.json"],
             "GPT2BPETokenizer": ["--vocab-file", "v.json", "--merge-file", "m.txt"],
             "NullTokenizer": ["--vocab-size", 1000],
             "TikTokenizer": ["--tokenizer-model", "v.json", "--tiktoken-pattern", "v2"]}.get(
        name, ["--tokenizer-model", "tok.model"] if "SentencePiece" in name or "Llama" in name
        else [])
    assert parse("--tokenizer-type", name, *extra).tokenizer_type == name


def test_data_path_feeds_dataset(tmp_path):
    prefixes = [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            open(prefix + ext, "wb").close()
    args = parse(data=["--data-path", "0.3", prefixes[0], "0.7", prefixes[1]])
    assert args.data_path == ["0.3", prefixes[0], "0.7", prefixes[1]] and not args.mock_data
    assert parse_data_path(args.data_path) == (prefixes, [0.3, 0.7])


def test_world_size_and_cuda_defaults(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse_args(MODEL + ["--mock-data", "--context-parallel-size", "2"])
    assert (args.world_size, args.data_parallel_size, args.distributed_backend) == (4, 2, "gloo")
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(FlagError, match="WORLD_SIZE must be an integer"):
        parse_args(MODEL + ["--mock-data"])


def test_validate_args_is_idempotent():
    args = parse("--context-parallel-size", 4, "--context-parallel-algo", "hybrid_cp_algo",
                 "--ulysses-degree-in-cp", 2, "--reset-attention-mask",
                 "--recompute-granularity", "full", world_size=8)
    before = dict(vars(args))
    assert vars(validate_args(args, 8, False)) == before


def test_build_parser_help_lists_flags():
    text = build_parser().format_help()
    for flag in ("--context-parallel-algo", "--ulysses-degree-in-cp", "--attention-mask-type",
                 "--tokenizer-type", "--metrics-file"):
        assert flag in text


@pytest.mark.parametrize("argv,match", [
    (["--foo"], r"unrecognized flags: --foo"),
    (["--foo", "3", "--bar=x"], r"unrecognized flags: --foo 3 --bar=x"),
    (["--normalization", "BatchNorm"], r"--normalization"),
    (["--tokenizer-type", "SentencePiece"], r"--tokenizer-type"),
    (["--num-layers", "four"], r"--num-layers"),
    (["--seq"], r"unrecognized flags: --seq"),  # no abbreviations, as Megatron
])
def test_parser_errors_are_flag_errors(argv, match):
    with pytest.raises(FlagError, match=match):
        parse(*argv)


def test_missing_required_flag():
    with pytest.raises(FlagError, match=r"--num-layers"):
        parse_args(MODEL[2:] + ["--mock-data"], world_size=1, cuda_available=False)


@pytest.mark.parametrize("flag", [
    "--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups",
    "--ffn-hidden-size", "--kv-channels", "--seq-length", "--max-position-embeddings",
    "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr", "--lr-decay-iters",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--make-vocab-size-divisible-by", "--save-interval", "--eval-interval", "--log-interval",
    "--exit-interval", "--vocab-size",
])
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_must_be_positive(flag, value):
    with pytest.raises(FlagError, match=rf"{flag} must be positive, got {value}"):
        parse(flag, value, "--save", "ckpt")


def test_world_size_must_be_positive():
    args = build_parser().parse_args(MODEL + ["--mock-data"])
    with pytest.raises(FlagError, match="WORLD_SIZE must be a positive integer"):
        validate_args(args, 0, False)


CP4 = ["--context-parallel-size", 4]

BAD = [
    # world size and model shape
    (["--tensor-model-parallel-size", 2, "--context-parallel-size", 2], 6, False,
     r"WORLD_SIZE 6 is not divisible by --tensor-model-parallel-size x "
     r"--pipeline-model-parallel-size x --context-parallel-size = 2 x 1 x 2 = 4"),
    (["--num-query-groups", 3], 1, False,
     r"--num-attention-heads 8 must be divisible by --num-query-groups 3"),
    (["--num-query-groups", 16], 1, False,
     r"--num-attention-heads 8 must be divisible by --num-query-groups 16"),
    (["--tensor-model-parallel-size", 3], 3, False,
     r"--num-attention-heads 8 must be divisible by --tensor-model-parallel-size 3"),
    (["--num-query-groups", 2, "--tensor-model-parallel-size", 4], 4, False,
     r"--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4"),
    (["--hidden-size", 60], 1, False,
     r"--hidden-size 60 must be divisible by --num-attention-heads 8"),
    (["--max-position-embeddings", 64], 1, False,
     r"--seq-length 128 must be <= --max-position-embeddings 64"),
    (["--pipeline-model-parallel-size", 3], 3, False,
     r"--num-layers 4 must be divisible by --pipeline-model-parallel-size 3"),
    (["--attention-dropout", 0.1], 1, False,
     r"--attention-dropout 0.1: our varlen attention kernels apply no dropout"),
    (["--hidden-dropout", 1.0], 1, False, r"--hidden-dropout must be in \[0, 1\)"),
    (["--rotary-percent", 0], 1, False, r"--rotary-percent must be in \(0, 1\]"),
    (["--rope-scaling-factor", 0], 1, False, "--rope-scaling-factor must be positive"),
    (["--rotary-seq-len-interpolation-factor", -2], 1, False,
     "--rotary-seq-len-interpolation-factor must be positive"),
    # context parallelism
    (["--seq-length", 126] + CP4, 4, False,
     r"--seq-length 126 must be divisible by --context-parallel-size 4"),
    (["--context-parallel-algo", "zigzag"], 1, False,
     r"--context-parallel-algo 'zigzag' is not supported; choose one of ring, ulysses, "
     r"hybrid, megatron_cp_algo, ulysses_cp_algo, hybrid_cp_algo"),
    (["--seq-length", 96, "--context-parallel-size", 3, "--context-parallel-algo", "ulysses",
      "--tensor-model-parallel-size", 2], 6, False,
     r"--num-attention-heads 8 / --tensor-model-parallel-size 2 = 4 heads per rank must be "
     r"divisible by --context-parallel-size 3"),
    (CP4 + ["--context-parallel-algo", "hybrid"], 4, False,
     r"--context-parallel-algo hybrid needs --ulysses-degree-in-cp"),
    (CP4 + ["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", 1], 4, False,
     r"--ulysses-degree-in-cp 1 must be > 1 and < --context-parallel-size 4"),
    (CP4 + ["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", 4], 4, False,
     r"--ulysses-degree-in-cp 4 must be > 1 and < --context-parallel-size 4"),
    (CP4 + ["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", 3], 4, False,
     r"--ulysses-degree-in-cp 3 must divide --context-parallel-size 4"),
    (["--hidden-size", 96, "--num-attention-heads", 6, "--context-parallel-size", 8,
      "--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", 4], 8, False,
     r"--num-attention-heads 6 / --tensor-model-parallel-size 1 = 6 heads per rank must be "
     r"divisible by --ulysses-degree-in-cp 4"),
    (CP4 + ["--ulysses-degree-in-cp", 2], 4, False,
     r"--ulysses-degree-in-cp 2 contradicts --context-parallel-algo ring"),
    (CP4 + ["--context-parallel-algo", "megatron_cp_algo", "--ulysses-degree-in-cp", 4], 4,
     False, r"--ulysses-degree-in-cp 4 contradicts --context-parallel-algo ring"),
    (CP4 + ["--context-parallel-algo", "ulysses", "--ulysses-degree-in-cp", 2], 4, False,
     r"--ulysses-degree-in-cp 2 contradicts --context-parallel-algo ulysses"),
    (["--sequence-parallel", "--tensor-model-parallel-size", 2, "--seq-length", 127], 2, False,
     r"--sequence-parallel needs --micro-batch-size x --seq-length / --context-parallel-size "
     r"= 127 tokens divisible by --tensor-model-parallel-size 2"),
    # batches, learning rate, optimizer
    (["--micro-batch-size", 2, "--global-batch-size", 3], 1, False,
     r"--global-batch-size 3 must be a multiple of --micro-batch-size 2"),
    (["--global-batch-size", 4], 8, False,
     r"--global-batch-size 4 must be a multiple of --micro-batch-size 1 x data-parallel size 8"),
    (["--min-lr", 2e-3], 1, False, r"--min-lr 0.002 must be in \[0, --lr 0.001\]"),
    (["--min-lr", -1e-4], 1, False, r"--min-lr -0.0001 must be in \[0, --lr 0.001\]"),
    (["--lr-warmup-iters", 20], 1, False,
     r"--lr-warmup-iters 20 must be in \[0, --lr-decay-iters 10\)"),
    (["--lr-warmup-iters", 10], 1, False,
     r"--lr-warmup-iters 10 must be in \[0, --lr-decay-iters 10\) \(the warmup must end"),
    (["--lr-warmup-fraction", 1.0], 1, False, r"--lr-warmup-fraction must be in \[0, 1\)"),
    (["--start-weight-decay", 0.1, "--end-weight-decay", 0.01, "--weight-decay-incr-style",
      "linear"], 1, False, r"--end-weight-decay 0.01 must be >= --start-weight-decay 0.1"),
    (["--lr-warmup-iters", 5, "--lr-decay-iters", 4], 1, False,
     r"--lr-warmup-iters 5 must be in \[0, --lr-decay-iters 4\)"),
    (["--lr-warmup-iters", -1], 1, False, r"--lr-warmup-iters -1 must be in"),
    (["--weight-decay", -0.1], 1, False, r"--weight-decay must be >= 0"),
    (["--clip-grad", -1], 1, False, r"--clip-grad must be >= 0"),
    (["--adam-beta2", 1.0], 1, False, r"--adam-beta2 must be in \[0, 1\)"),
    (["--adam-eps", 0], 1, False, r"--adam-eps must be positive"),
    (["--train-samples", 40], 1, False, r"pass exactly one of --train-iters .* and "
     r"--train-samples"),
    (["--lr-decay-samples", 40], 1, False, r"--lr-decay-samples needs a --train-samples run; "
     r"this run counts in iters \(use --lr-decay-iters\)"),
    (["--lr-warmup-samples", 8], 1, False, r"--lr-warmup-samples needs a --train-samples run"),
    (["--global-batch-size", 4, "--rampup-batch-size", 2, 2, 10], 1, False,
     r"--rampup-batch-size needs a sample-based run: pass --train-samples"),
    (["--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 2], 1, False,
     r"--lr-warmup-fraction and --lr-warmup-iters are exclusive"),
    (["--lr-decay-style", "WSD"], 1, False,
     r"--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", 20], 1, False,
     r"--lr-wsd-decay-iters 20 must be <= --lr-decay-iters 10"),
    (["--lr-warmup-init", 1.0], 1, False, r"--lr-warmup-init 1.0 must be in \[0, --lr 0.001\]"),
    (["--start-weight-decay", 0.1, "--end-weight-decay", 0.2], 1, False,
     r"--start-weight-decay 0.1 and --end-weight-decay 0.2 differ: pass "
     r"--weight-decay-incr-style linear or cosine"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], 1, False,
     r"are exclusive"),
    (["--sgd-momentum", 1.0], 1, False, r"--sgd-momentum must be in \[0, 1\)"),
    (["--loss-scale", 0], 1, False, r"--loss-scale must be positive"),
    (["--hysteresis", 0], 1, False, r"--hysteresis >= 1"),
    (["--ddp-bucket-size", 10, "--ddp-num-buckets", 2], 1, False,
     r"--ddp-bucket-size and --ddp-num-buckets are exclusive"),
    (["--ddp-num-buckets", 0], 1, False, r"--ddp-num-buckets must be positive"),
    (["--overlap-param-gather"], 1, False,
     r"--overlap-param-gather needs --use-distributed-optimizer"),
    (["--dist-ckpt-optim-fully-reshardable"], 1, False,
     r"--dist-ckpt-optim-fully-reshardable needs --use-distributed-optimizer"),
    (["--ckpt-format", "torch", "--use-distributed-optimizer"], 1, False,
     r"--ckpt-format torch with --use-distributed-optimizer: .* pass --ckpt-format torch_dist"),
    (["--finetune"], 1, False, r"--finetune needs --load DIR or --pretrained-checkpoint DIR"),
    (["--transformer-impl", "transformer_engine"], 1, False,
     r"--transformer-impl transformer_engine needs CUDA; pass --transformer-impl local"),
    # recompute
    (["--recompute-method", "uniform"], 1, False,
     r"--recompute-method needs --recompute-granularity full"),
    (["--recompute-num-layers", 1], 1, False,
     r"--recompute-num-layers needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], 1, False,
     r"--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", 5], 1, False,
     r"--recompute-num-layers 5 must be in \[1, --num-layers / "
     r"--pipeline-model-parallel-size = 4\]"),
    (["--recompute-granularity", "full", "--recompute-num-layers", 3,
      "--pipeline-model-parallel-size", 2], 2, False,
     r"--recompute-num-layers 3 must be in \[1, --num-layers / "
     r"--pipeline-model-parallel-size = 2\]"),
    (["--recompute-granularity", "full", "--recompute-num-layers", 0], 1, False,
     r"--recompute-num-layers 0 must be in \[1"),
    # device flags
    (["--bf16", "--fp16"], 1, True, r"--bf16 and --fp16 are exclusive"),
    (["--bf16"], 1, False,
     r"--bf16 needs CUDA: the CPU attention kernel takes float32/float64; drop --bf16 on CPU"),
    (["--fp16"], 1, False, r"--fp16 needs CUDA: .*drop --fp16 on CPU"),
    (["--use-flash-attn"], 1, False, r"--use-flash-attn needs CUDA"),
    (["--distributed-backend", "nccl"], 1, False, r"--distributed-backend nccl needs CUDA"),
    # tokenizer
    (["--tokenizer-type", "HuggingFaceTokenizer"], 1, False,
     r"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    (["--tokenizer-type", "GPT2BPETokenizer"], 1, False,
     r"--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], 1, False,
     r"--tokenizer-type GPT2BPETokenizer needs --merge-file"),
    (["--tokenizer-type", "NullTokenizer"], 1, False,
     r"--tokenizer-type NullTokenizer needs --vocab-size"),
    (["--num-workers", -1], 1, False, r"--num-workers must be >= 0"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "v.json"], 1, False,
     r"--tokenizer-type TikTokenizer needs --tiktoken-pattern"),
    (["--tokenizer-type", "Llama2Tokenizer"], 1, False,
     r"--tokenizer-type Llama2Tokenizer needs --tokenizer-model"),
    # EoD, logging, checkpoints
    (["--reset-attention-mask", "--attention-mask-type", "causal"], 1, False,
     r"--attention-mask-type causal contradicts --reset-attention-mask"),
    (["--save-interval", 100], 1, False, r"--save-interval needs --save"),
    (["--eval-iters", -1], 1, False, r"--eval-iters must be >= 0"),
]


@pytest.mark.parametrize("extra,world_size,cuda,match", BAD)
def test_invalid_combinations(extra, world_size, cuda, match):
    with pytest.raises(FlagError, match=match):
        parse(*extra, world_size=world_size, cuda=cuda)


def parse_samples(*extra, world_size=1):
    """A sample-based run: MODEL without --train-iters."""
    model = MODEL[:MODEL.index("--train-iters")] + MODEL[MODEL.index("--train-iters") + 2:]
    return parse_args(model + ["--mock-data"] + [str(x) for x in extra], world_size=world_size,
                      cuda_available=False)


def test_megatron_optimizer_and_schedule_defaults():
    args = parse()
    assert (args.optimizer, args.initial_loss_scale, args.hysteresis) == ("adam", 2.0 ** 32, 2)
    assert args.loss_scale is None and args.loss_scale_window == 1000
    assert args.start_weight_decay == args.end_weight_decay == args.weight_decay == 0.01
    assert args.ckpt_format == "torch_dist" and not args.use_distributed_optimizer
    assert args.train_samples is None and args.lr_warmup_init == 0.0
    assert args.lr_wsd_decay_style == "exponential" and args.transformer_impl is None


def test_sample_based_runs_derive_their_iterations():
    args = parse_samples("--train-samples", 100, "--global-batch-size", 4)
    assert (args.train_iters, args.lr_decay_samples) == (25, 100)
    # Ramp 2 -> 4 (+2 after 8 samples): 2, 2, 2, 2, then 4 from sample 8: 4 + (100 - 12) // 4
    args = parse_samples("--train-samples", 100, "--global-batch-size", 4,
                         "--rampup-batch-size", 2, 2, 8)
    assert args.train_iters == 5 + 22


@pytest.mark.parametrize("extra,world_size,match", [
    (["--train-samples", 3, "--global-batch-size", 4], 1, r"--train-samples 3 is less than one "
     r"global batch \(4\)"),
    (["--train-samples", 40, "--lr-decay-iters", 5], 1, r"--lr-decay-iters needs a "
     r"--train-iters run; this run counts in samples"),
    (["--train-samples", 40, "--lr-warmup-iters", 2], 1, r"--lr-warmup-iters needs a "
     r"--train-iters run"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 2, 4, 10], 1,
     r"--rampup-batch-size start 2 must be below --global-batch-size 8 and reach it in steps "
     r"of 4"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 8, 2, 10], 1,
     r"start 8 must be below --global-batch-size 8"),
    (["--train-samples", 40, "--global-batch-size", 8, "--rampup-batch-size", 2, 2, 10], 4,
     r"--rampup-batch-size start 2 and increment 2 must be multiples of --micro-batch-size 1 x "
     r"data-parallel size 4"),
    (["--train-samples", 40, "--rampup-batch-size", 0, 1, 10], 1,
     r"start, increment and samples must be positive"),
    (["--train-samples", 40, "--global-batch-size", 4, "--rampup-batch-size", 2, 2, 0], 1,
     r"start, increment and samples must be positive"),
])
def test_sample_based_errors(extra, world_size, match):
    with pytest.raises(FlagError, match=match):
        parse_samples(*extra, world_size=world_size)


def test_decrease_batch_size_if_needed_relaxes_divisibility():
    args = parse("--global-batch-size", 6, "--micro-batch-size", 4,
                 "--decrease-batch-size-if-needed")
    assert args.num_micro_batches == 1


@pytest.mark.parametrize("data,match", [
    ([], r"--data-path PREFIX \.\.\. is required \(or pass --mock-data\)"),
    (["--data-path"], r"--data-path PREFIX \.\.\. is required"),
    (["--data-path", "corpus_text_document", "--mock-data"],
     r"--data-path and --mock-data are exclusive"),
])
def test_data_flags(data, match):
    with pytest.raises(FlagError, match=match):
        parse(data=data)


def test_flag_error_is_a_value_error():
    assert issubclass(FlagError, ValueError)
