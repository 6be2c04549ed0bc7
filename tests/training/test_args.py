"""`megatron_eod.training.args`: Megatron-style flags, derived fields and every FlagError rule.

CPU only, no process groups: `world_size` and `cuda_available` are passed explicitly. The
GPU-only rules (dtypes, head dim, --use-flash-attn, gloo on CUDA) are in test_args_gpu.py.
"""

import pytest
import torch

from megatron_eod.training.args import (
    CP_ALGO_ALIASES, FlagError, build_parser, parse_args, validate_args)

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


@pytest.mark.parametrize("spelled,stored,degree", [
    ((), "ring", 1), (("--cp-comm-type", "p2p"), "ring", 1),
    (("--cp-comm-type", "a2a"), "ulysses", 4),
    (("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", 2, 2), "hybrid", 2),
    (("--cp-comm-type", "a2a+p2p", "--ulysses-degree-in-cp", 2), "hybrid", 2),
    (("--cp-comm-type", "a2a", "--context-parallel-algo", "ulysses"), "ulysses", 4),
])
def test_megatron_lms_cp_spellings_run_in_the_lean_trainer(spelled, stored, degree):
    """A Megatron-LM launch script's CP flags (they were refused by name here; a helper's
    sweep of Megatron-LM's example scripts ran into it)."""
    args = parse("--context-parallel-size", 4, *spelled, world_size=8)
    assert args.context_parallel_algo == stored and args.ulysses_degree == degree


@pytest.mark.parametrize("spelled,match", [
    (("--cp-comm-type", "a2a", "--context-parallel-algo", "ring"),
     r"--context-parallel-algo ring contradicts --cp-comm-type a2a \(ulysses\)"),
    (("--cp-comm-type", "a2a+p2p"), r"--cp-comm-type a2a\+p2p needs "
                                    r"--hierarchical-context-parallel-sizes U 4/U"),
    (("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", 3, 2),
     r"product is --context-parallel-size 4"),
    (("--cp-comm-type", "all_gather"), r"--cp-comm-type all_gather: EoD attention implements "
                                       r"p2p \(ring\), a2a \(ulysses\) and a2a\+p2p"),
    (("--cp-comm-type", "p2p", "a2a"), r"one type per layer is not supported"),
])
def test_megatron_lms_cp_spellings_are_checked_in_the_lean_trainer(spelled, match):
    with pytest.raises(FlagError, match=match):
        parse("--context-parallel-size", 4, *spelled, world_size=8)


@pytest.mark.parametrize("sizes", [(), (1, 1)])
def test_a_hybrid_script_at_cp_1_runs_as_cp_1(sizes):
    """--cp-comm-type a2a+p2p at --context-parallel-size 1 (a script templated for hybrid):
    nothing to exchange, plain attention; it was refused naming --context-parallel-algo."""
    sized = ("--hierarchical-context-parallel-sizes", *sizes) if sizes else ()
    args = parse("--context-parallel-size", 1, "--cp-comm-type", "a2a+p2p", *sized)
    assert (args.context_parallel_algo, args.ulysses_degree) == ("ring", 1)
    with pytest.raises(FlagError, match=r"--ulysses-degree-in-cp 2 needs "
                                        r"--context-parallel-size > 2"):
        parse("--context-parallel-size", 1, "--cp-comm-type", "a2a+p2p",
              "--ulysses-degree-in-cp", 2)
    with pytest.raises(FlagError, match=r"--hierarchical-context-parallel-sizes 1: hybrid "
                                        r"takes two sizes"):
        parse("--context-parallel-size", 1, "--cp-comm-type", "a2a+p2p",
              "--hierarchical-context-parallel-sizes", 1)
    for ring in ("ring", "megatron_cp_algo"):  # either spelling of ring agrees at CP=1
        assert parse("--context-parallel-size", 1, "--cp-comm-type", "a2a+p2p",
                     "--context-parallel-algo", ring).context_parallel_algo == "ring"


def test_the_tp_pp_dp_rank_order_with_pipeline_stages_and_cp_is_refused():
    """megatron-core asserts its expert data-parallel groups (CP left out) equal the
    attention's under this order with PP > 1: a traceback on every rank (a review)."""
    mapped = ("--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", 2)
    assert parse(*mapped, world_size=4).use_tp_pp_dp_mapping
    with pytest.raises(FlagError, match=r"--use-tp-pp-dp-mapping with "
                                        r"--pipeline-model-parallel-size 2: megatron-core needs "
                                        r"expert tensor x expert model parallel \(1 x 1\) = "
                                        r"--tensor-model-parallel-size x --context-parallel-size "
                                        r"\(1 x 2\)"):
        parse(*mapped, "--context-parallel-size", 2, world_size=4)


def test_a_save_interval_without_save_saves_nothing_as_in_megatron_lm():
    """A launch script whose --save line is commented out (Megatron-LM runs it, saving
    nothing; the lean trainer refused it)."""
    args = parse("--save-interval", 100)
    assert args.save is None and args.save_interval == 100


def test_cp_ring_exchange():
    assert parse("--context-parallel-size", 4, world_size=4).cp_ring_exchange == "batched"
    for exchange in ("steps", "batched-keep"):
        args = parse("--context-parallel-size", 4, "--cp-ring-exchange", exchange, world_size=4)
        assert args.cp_ring_exchange == exchange
    with pytest.raises(FlagError, match=r"--cp-ring-exchange"):
        parse("--cp-ring-exchange", "ring")
    with pytest.warns(UserWarning, match=r"--cp-ring-exchange steps has no effect"):
        parse("--context-parallel-size", 4, "--context-parallel-algo", "ulysses",
              "--cp-ring-exchange", "steps", world_size=4)


def test_cp_concurrent_calls():
    assert not parse("--context-parallel-size", 4, world_size=4).cp_concurrent_calls
    for exchange in ("batched", "batched-keep"):
        args = parse("--context-parallel-size", 4, "--cp-ring-exchange", exchange,
                     "--cp-concurrent-calls", world_size=4)
        assert args.cp_concurrent_calls
    with pytest.raises(FlagError, match=r"--cp-concurrent-calls .*--cp-ring-exchange batched "
                                        r"or batched-keep, not steps"):
        parse("--context-parallel-size", 4, "--cp-ring-exchange", "steps",
              "--cp-concurrent-calls", world_size=4)
    with pytest.warns(UserWarning, match=r"--cp-concurrent-calls with .*only splits that call"):
        parse("--context-parallel-size", 4, "--context-parallel-algo", "ulysses",
              "--cp-concurrent-calls", world_size=4)


def test_cp_fused_forward(monkeypatch):
    assert not parse("--context-parallel-size", 4, world_size=4).cp_fused_forward
    for exchange in ("batched", "batched-keep"):
        assert parse("--context-parallel-size", 4, "--cp-ring-exchange", exchange,
                     "--cp-fused-forward", "--bf16", world_size=4, cuda=True).cp_fused_forward
    with pytest.raises(FlagError, match=r"--cp-fused-forward .*--cp-ring-exchange batched "
                                        r"or batched-keep, not steps"):
        parse("--context-parallel-size", 4, "--cp-ring-exchange", "steps",
              "--cp-fused-forward", "--bf16", world_size=4, cuda=True)
    args = parse("--context-parallel-size", 4, "--cp-fused-forward", "--cp-fused-backward",
                 "--bf16", world_size=4, cuda=True)
    assert args.cp_fused_forward and args.cp_fused_backward
    with pytest.raises(FlagError, match=r"--cp-fused-backward needs --cp-fused-forward"):
        parse("--context-parallel-size", 4, "--cp-fused-backward", world_size=4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FlagError, match=r"--cp-fused-forward needs CUDA .*drop it on CPU"):
        parse("--context-parallel-size", 4, "--cp-fused-forward", world_size=4)
    monkeypatch.setattr("megatron_eod.training.cp_flags.device_problem",
                        lambda head_dim, dtype, backward: f"too big at {head_dim} in {dtype}")
    with pytest.raises(FlagError, match=r"--cp-fused-forward: too big at 8 in bf16"):
        parse("--context-parallel-size", 4, "--cp-fused-forward", "--bf16", world_size=4,
              cuda=True)
    monkeypatch.setattr("megatron_eod.training.cp_flags.triton_problem", lambda: "not here")
    with pytest.raises(FlagError, match=r"--cp-fused-forward needs Triton: not here"):
        parse("--context-parallel-size", 4, "--cp-fused-forward", "--bf16", world_size=4, cuda=True)


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
    args = parse("--group-query-attention", "--num-query-groups", 2)
    assert args.num_query_groups == 2 and args.group_query_attention
    args = parse()  # Megatron-LM: multi-head attention
    assert args.num_query_groups == 8 and not args.group_query_attention
    with pytest.raises(FlagError, match="--num-query-groups 2 without --group-query-attention: "
                                        "Megatron-LM ignores it"):
        parse("--num-query-groups", 2)
    assert parse("--num-query-groups", 8).num_query_groups == 8  # MHA either way
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
    (["--foo"], r"unrecognized flag --foo \(.*--trainer megatron-lm"),
    (["--foo", "3", "--bar=x"], r"unrecognized flag --foo .*\[and 1 more unrecognized flag: "
                                r"--bar\]"),
    (["--normalization", "BatchNorm"], r"--normalization"),
    (["--tokenizer-type", "SentencePiece"], r"--tokenizer-type"),
    (["--num-layers", "four"], r"--num-layers"),
    (["--seq"], r"unrecognized flag --seq"),  # no abbreviations, as Megatron
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
    (["--group-query-attention", "--num-query-groups", 3], 1, False,
     r"--num-attention-heads 8 must be divisible by --num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", 16], 1, False,
     r"--num-attention-heads 8 must be divisible by --num-query-groups 16"),
    (["--tensor-model-parallel-size", 3], 3, False,
     r"--num-attention-heads 8 must be divisible by --tensor-model-parallel-size 3"),
    (["--group-query-attention", "--num-query-groups", 2, "--tensor-model-parallel-size", 4], 4,
     False,
     r"--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4"),
    (["--swiglu", "--hidden-size", 16], 1, False,
     r"--swiglu with --hidden-size 16: the default --ffn-hidden-size \(2/3 of 4 x hidden, "
     r"rounded down to a multiple of 64, as Megatron-LM\) is 0; pass --ffn-hidden-size"),
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
     r"--ulysses-degree-in-cp 2 asks for hybrid context parallelism, but --cp-comm-type p2p "
     r"\(the default\) is ring: pass --cp-comm-type a2a\+p2p \(or --context-parallel-algo "
     r"hybrid\)"),
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
    (["--eval-iters", -1], 1, False, r"--eval-iters must be >= 0"),
]


@pytest.mark.parametrize("extra,world_size,cuda,match", BAD)
def test_invalid_combinations(extra, world_size, cuda, match):
    with pytest.raises(FlagError, match=match):
        parse(*extra, world_size=world_size, cuda=cuda)



def test_flag_error_is_a_value_error():
    assert issubclass(FlagError, ValueError)
