"""Megatron-LM's flags through its REAL parser (core_v0.16.1) and our `add_eod_args`, then
`eod_args_from_megatron`: every flag we refuse raises a FlagError naming it (and, for
Megatron-LM defaults we cannot run, the flag to add); the CP spellings map onto ours with
no fact asked twice; per-token loss is on by default."""

import re
import sys

import pytest

from megatron_eod.training.args import FlagError
from tests.training.megatron_lm_checkout import (import_megatron_lm, megatron_lm_knows,
                                                 needs_megatron_lm)

pytestmark = needs_megatron_lm

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "2", "--data-path", "corpus",
        "--transformer-impl", "local", "--attention-dropout", "0", "--eval-interval", "100"]


def megatron_lm_args(*flags, base=BASE, world=4):
    import_megatron_lm()
    from megatron.training.arguments import parse_args

    from megatron_eod.training.megatron_lm_args import add_eod_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *base, *flags]
    try:
        args = parse_args(add_eod_args)
    finally:
        sys.argv = saved
    args.world_size = world
    return args


def checked(*flags, **kwargs):
    from megatron_eod.training.megatron_lm_args import eod_args_from_megatron

    args = megatron_lm_args(*flags, **kwargs)
    eod_args_from_megatron(args)
    return args


REFUSALS = {
    "moe": (["--num-experts", "4"], "--num-experts 4: MoE"),
    "mla": (["--multi-latent-attention"], "--multi-latent-attention: MLA"),
    "mtp": (["--mtp-num-layers", "1"], "--mtp-num-layers 1: multi-token prediction"),
    "spec": (["--spec", "my.module", "my_spec"], "--spec"),
    "heterogeneous": (["--heterogeneous-layers-config-path", "layers.json"],
                      "--heterogeneous-layers-config-path"),
    "legacy-models": (["--use-legacy-models"], "--use-legacy-models"),
    "attention-variant": (["--experimental-attention-variant", "gated_delta_net"],
                          "--experimental-attention-variant gated_delta_net"),
    "qk-l2-norm": (["--qk-l2-norm"], "--qk-l2-norm"),
    "kitchen-attention": (["--use-kitchen-attention"], "--use-kitchen-attention"),
    "window": (["--window-size", "8,0"], "--window-size"),
    "softmax": (["--softmax-type", "off-by-one"], "--softmax-type off-by-one"),
    "dynamic-hybrid-cp": (["--hybrid-context-parallel"], "--hybrid-context-parallel"),
    "sft": (["--sft"], "--sft"),
    "fim": (["--fim-data"], "--fim-data"),
    "position": (["--position-embedding-type", "mrope"], "--position-embedding-type mrope"),
    "impl": (["--transformer-impl", "inference_optimized"],
             "--transformer-impl inference_optimized"),
    "all-gather": (["--context-parallel-size", "4", "--cp-comm-type", "all_gather"],
                   "--cp-comm-type all_gather"),
    "per-layer-comm": (["--context-parallel-size", "4", "--cp-comm-type", "p2p", "a2a"],
                       "one type per layer"),
    "algo-vs-comm": (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses",
                      "--cp-comm-type", "p2p"], "--context-parallel-algo ulysses contradicts"),
    "sizes-without-hybrid": (["--context-parallel-size", "4", "--cp-comm-type", "p2p",
                              "--hierarchical-context-parallel-sizes", "2", "2"],
                             "only used by --cp-comm-type a2a\\+p2p"),
    "degree-vs-sizes": (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                         "--hierarchical-context-parallel-sizes", "2", "2",
                         "--ulysses-degree-in-cp", "4"], "--ulysses-degree-in-cp 4 contradicts"),
    "no-data": (["--split", "90,8,2"], "no training data: pass --data-path .*--data-args-path, "
                "--train-data-path/--valid-data-path/--test-data-path, "
                "--per-split-data-args-path or --mock-data"),
    "no-validation-split": (["--split", "100,0,0"], "no validation data \\(--split 100,0,0 "
                            "gives none\\) but --eval-iters 100: .*pass --eval-iters 0"),
    "no-validation-blend": (["--train-data-path", "corpus"], "no validation data \\(no "
                            "--valid-data-path.*\\) but --eval-iters 100"),
    "sequence-parallel-rows": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--micro-batch-size", "1", "--seq-length", "129"],
                               "--sequence-parallel needs --micro-batch-size x --seq-length / "
                               "--context-parallel-size = 129 tokens divisible by "
                               "--tensor-model-parallel-size 2"),
    "cuda-graph-layer": (["--cuda-graph-impl", "local"], "--cuda-graph-impl local: a CUDA "
                         "graph would replay one micro-batch's CP plan"),
    "cuda-graph-legacy": (["--enable-cuda-graph"], "--enable-cuda-graph: a CUDA graph"),
    "ulysses-degree-alone": (["--context-parallel-size", "4", "--ulysses-degree-in-cp", "2"],
                             "--ulysses-degree-in-cp 2 asks for hybrid context parallelism, but "
                             "--cp-comm-type p2p \\(the default\\) is ring"),
    "hierarchical-outer-1": (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                              "--hierarchical-context-parallel-sizes", "4", "1"],
                             "--hierarchical-context-parallel-sizes 4 1: hybrid needs two "
                             "sizes > 1"),
    "dataloader-external": (["--dataloader-type", "external"], "--dataloader-type external: "
                            "an external data loader bypasses"),
    "qk-clip": (["--qk-clip"], "--qk-clip: QK-clip reads the core attention's largest"),
    "max-logit": (["--log-max-attention-logit"], "--log-max-attention-logit: the EoD"),
    # Megatron-LM >= 0.18 / 0.19 only (skipped where the parser lacks the flag):
    "eval-rows": (["--eval-micro-batch-size", "1", "--tensor-model-parallel-size", "2",
                   "--sequence-parallel", "--seq-length", "129"],
                  "--eval-micro-batch-size x --seq-length / --context-parallel-size = 129"),
    "inter-document-masking": (["--dataloader-inter-document-masking"],
                               "--dataloader-inter-document-masking: .*pass "
                               "--reset-attention-mask"),
    "distillation": (["--logits-load-dir", "teacher"], "--logits-load-dir teacher"),
    "logits-save": (["--logits-save-dir", "out", "--logits-save-top-k", "4"],
                    "--logits-save-dir out"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused_flags_are_named(name):
    flags, message = REFUSALS[name]
    base = [f for f in BASE if name not in ("no-data", "no-validation-blend")
            or f not in ("--data-path", "corpus")]
    if not megatron_lm_knows(flags[0]):
        pytest.skip(f"this Megatron-LM has no {flags[0]}")
    with pytest.raises(FlagError, match=message):
        checked(*flags, base=base)


@pytest.mark.parametrize("drop,message", [
    (["--attention-dropout", "0"], "is 0.1\\).*pass --attention-dropout 0"),
    (["--transformer-impl", "local"], "pass --transformer-impl local"),
], ids=["attention-dropout", "transformer-engine"])
def test_megatron_lm_defaults_we_cannot_run_say_what_to_add(drop, message):
    base = [f for f in BASE if f not in drop]
    with pytest.raises(FlagError, match=message):
        checked(base=base)


@pytest.mark.parametrize("dest,value,message", [
    ("kitchen_config_file", "recipe.yaml", "--kitchen-config-file recipe.yaml"),
    ("kitchen_recipe_number", 1, "--kitchen-recipe-number 1"),
    ("yaml_cfg", "model.yaml", "--yaml-cfg model.yaml"),
])
def test_flags_read_at_parse_time_are_named(dest, value, message):
    """Megatron-LM adds the Kitchen flags only where NVIDIA Kitchen is installed, and reads
    --yaml-cfg while parsing: set on the parsed args instead."""
    from megatron_eod.training.megatron_lm_args import eod_args_from_megatron

    args = megatron_lm_args()
    setattr(args, dest, value)
    with pytest.raises(FlagError, match=message):
        eod_args_from_megatron(args)


def test_per_token_loss_is_the_default_and_cannot_be_lost():
    from megatron_eod.training.megatron_lm_args import eod_args_from_megatron

    assert checked().calculate_per_token_loss
    args = megatron_lm_args()
    args.calculate_per_token_loss = False
    with pytest.raises(FlagError, match="--calculate-per-token-loss"):
        eod_args_from_megatron(args)


@pytest.mark.parametrize("flags,algo,degree,sizes", [
    ([], "ring", 1, None),
    (["--cp-comm-type", "p2p"], "ring", 1, None),
    (["--cp-comm-type", "a2a"], "ulysses", 4, None),
    (["--context-parallel-algo", "ulysses"], "ulysses", 4, None),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
     "hybrid", 2, [2, 2]),
    (["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2"], "hybrid", 2, [2, 2]),
    (["--context-parallel-algo", "hybrid_cp_algo", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "2", "--ulysses-degree-in-cp", "2"],
     "hybrid", 2, [2, 2]),
], ids=["default", "p2p", "a2a", "algo-ulysses", "a2a+p2p", "algo-hybrid", "both-agree"])
def test_megatron_cp_spellings_map_onto_ours(flags, algo, degree, sizes):
    args = checked("--context-parallel-size", "4", *flags)
    assert (args.context_parallel_algo, args.ulysses_degree) == (algo, degree)
    assert args.hierarchical_context_parallel_sizes == sizes
    assert args.cp_comm_type == [{"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p"}[algo]]


def validated(monkeypatch, *flags, base=BASE):
    """Megatron-LM's parse_args and its REAL validate_args, with the hooks
    training/megatron_lm_run.py installs around it (restored after the test), at world 4."""
    import_megatron_lm()
    from megatron.training import arguments, initialize

    from megatron_eod.training import megatron_lm_run

    monkeypatch.setattr(arguments, "validate_args", arguments.validate_args)
    monkeypatch.setattr(initialize, "validate_args", initialize.validate_args)
    monkeypatch.setattr(megatron_lm_run.gloo_on_cuda, "wanted", lambda *a: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as megatron_lm_run.run sets it
    args = megatron_lm_args("--lr", "1e-3", "--train-iters", "2", "--mock-data",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                            "--max-position-embeddings", "128", *flags,
                            base=[f for f in base if f not in ("--data-path", "corpus")])
    megatron_lm_run._check_after_validate()
    from megatron_eod.megatron import cpu_compat

    cpu_compat.apply(force=True, megatron_lm=True)  # as megatron_lm_run.run does on CPU
    try:
        arguments.validate_args(args)
    finally:
        cpu_compat.remove()
    return args


@pytest.mark.parametrize("flags,message", [
    (["--context-parallel-algo", "hybrid"], "--context-parallel-algo hybrid needs "
                                            "--ulysses-degree-in-cp"),
    (["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "3"],
     "--ulysses-degree-in-cp 3 must divide --context-parallel-size 4"),
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "4"],
     "--ulysses-degree-in-cp 4 must be > 1 and < --context-parallel-size 4 for "
     "--context-parallel-algo hybrid_cp_algo"),
    (["--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p needs "
                                    "--hierarchical-context-parallel-sizes U 4/U"),
    (["--cp-comm-type", "a2a+p2p", "--ulysses-degree-in-cp", "1"],
     "--ulysses-degree-in-cp 1 must be > 1 and < --context-parallel-size 4 for "
     "--cp-comm-type a2a+p2p"),
], ids=["algo-no-degree", "algo-bad-degree", "ascend-degree-cp", "comm-no-sizes",
        "comm-degree-1"])
def test_hybrid_degrees_are_checked_before_megatron_lm_asserts(monkeypatch, flags, message):
    """A hybrid asked for by --context-parallel-algo once reached Megatron-LM's validate_args
    as p2p and got our message after it; resolved before it, it must still get ours, not
    Megatron-LM's assertion that the hierarchical sizes are missing."""
    with pytest.raises(FlagError, match=re.escape(message)):
        validated(monkeypatch, "--context-parallel-size", "4", *flags)


@pytest.mark.parametrize("sizes", [["3", "2"], ["2", "4"], ["4", "1"]])
def test_hierarchical_sizes_are_checked_before_megatron_lm_asserts(monkeypatch, sizes):
    """Megatron-LM's validate_args asserts their product with no message: ours comes first."""
    with pytest.raises(FlagError, match=f"--hierarchical-context-parallel-sizes "
                                        f"{' '.join(sizes)}: hybrid needs two sizes > 1"):
        validated(monkeypatch, "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                  "--hierarchical-context-parallel-sizes", *sizes)


@pytest.mark.parametrize("flags", [
    ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
    ["--cp-comm-type", "a2a+p2p", "--ulysses-degree-in-cp", "2"],  # sizes filled in before
    ["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2"],
], ids=["sizes", "comm-and-degree", "algo-and-degree"])
def test_hybrid_spellings_pass_megatron_lm_validation(monkeypatch, flags):
    args = validated(monkeypatch, "--context-parallel-size", "4", *flags)
    assert (args.context_parallel_algo, args.ulysses_degree) == ("hybrid", 2)
    assert args.hierarchical_context_parallel_sizes == [2, 2]
    assert args.cp_comm_type == ["a2a+p2p"]


# What shapes the model (the weights and what they compute), read from either trainer's args.
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "seq_length", "position_embedding_type", "swiglu",
                "normalization", "untie_embeddings_and_output_weights", "add_bias_linear",
                "qk_layernorm", "rotary_base", "rotary_percent", "rotary_interleaved",
                "init_method_std", "make_vocab_size_divisible_by", "hidden_dropout")


def _model_of(args):
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    return {**{field: getattr(args, field) for field in MODEL_FIELDS}, "key/value heads": groups}


@pytest.mark.parametrize("flags", [
    [], ["--swiglu"], ["--swiglu", "--hidden-size", "256", "--num-attention-heads", "8"],
    ["--group-query-attention"], ["--group-query-attention", "--num-query-groups", "2"],
    ["--num-query-groups", "4"], ["--normalization", "RMSNorm", "--disable-bias-linear"],
    ["--position-embedding-type", "rope", "--rotary-percent", "0.5"],
], ids=["defaults", "swiglu", "swiglu-256", "gqa-alone", "gqa-2", "groups-equal-heads",
        "rmsnorm", "rope"])
def test_the_same_flags_build_the_same_model_in_both_trainers(monkeypatch, flags):
    """`--trainer auto` picks Megatron-LM's trainer where it imports and the lean one
    elsewhere: one launch script must mean one model (the lean trainer's defaults were RoPE,
    GQA from --num-query-groups alone and 4 x hidden under --swiglu)."""
    from megatron_eod.training.args import parse_args as lean_parse_args

    common = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "128", "--micro-batch-size", "2", "--attention-dropout", "0",
              "--transformer-impl", "local", "--eval-interval", "100"]
    theirs = validated(monkeypatch, *flags, base=common)
    ours = lean_parse_args([*common, "--lr", "1e-3", "--train-iters", "2", "--mock-data",
                            *flags], world_size=4)
    assert _model_of(ours) == _model_of(theirs)


def test_eval_interval_has_the_lean_trainers_default():
    """core_v0.16.1's Megatron-LM has none and divides by it at start-up (a TypeError)."""
    base = [f for f in BASE if f not in ("--eval-interval", "100")]
    assert checked(base=base).eval_interval == 1000
    assert checked("--eval-interval", "7", base=base).eval_interval == 7


@pytest.mark.parametrize("groups", ["2", "1"])  # 1: MQA meant, its parser's default too
def test_query_groups_megatron_lm_would_ignore_are_refused(monkeypatch, groups):
    with pytest.raises(FlagError, match=f"--num-query-groups {groups} without "
                                        f"--group-query-attention: Megatron-LM ignores it"):
        validated(monkeypatch, "--num-query-groups", groups)


def test_query_groups_left_to_megatron_lm_are_plain_ints(monkeypatch):
    """Its default, told apart from an explicit 1, leaves as the int 1 (args are pickled into
    checkpoints, which must load without megatron-eod)."""
    for flags in ([], ["--group-query-attention"], ["--num-query-groups", "4"]):
        args = validated(monkeypatch, *flags)
        assert type(args.num_query_groups) is int
    assert validated(monkeypatch, "--group-query-attention").num_query_groups == 1


def test_cp_ring_exchange_is_ours_too():
    assert checked("--context-parallel-size", "4").cp_ring_exchange == "batched"
    for exchange in ("steps", "batched-keep"):
        args = checked("--context-parallel-size", "4", "--cp-ring-exchange", exchange)
        assert args.cp_ring_exchange == exchange


def test_cp_concurrent_calls_is_ours_too():
    assert not checked("--context-parallel-size", "4").cp_concurrent_calls
    assert checked("--context-parallel-size", "4", "--cp-concurrent-calls").cp_concurrent_calls
    with pytest.raises(FlagError, match=r"--cp-concurrent-calls .*not steps"):
        checked("--context-parallel-size", "4", "--cp-ring-exchange", "steps",
                "--cp-concurrent-calls")


def test_honoured_model_flags_pass():
    args = checked("--qk-layernorm", "--rotary-interleaved", "--use-rope-scaling",
                   "--position-embedding-type", "rope", "--rotary-percent", "0.5",
                   "--group-query-attention", "--num-query-groups", "2")
    assert args.qk_layernorm and args.rotary_interleaved and args.use_rope_scaling
    assert checked().position_embedding_type == "learned_absolute"  # Megatron-LM's default


@pytest.mark.parametrize("flag,value", [
    ("--num-layers-per-virtual-pipeline-stage", 1),
    ("--num-virtual-stages-per-pipeline-rank", 2),
    ("--pipeline-model-parallel-layout", "Et|t|t|tL"),
], ids=["layers-per-stage", "stages-per-rank", "layout"])
def test_virtual_pipeline_stages_pass(flag, value):
    """Each way Megatron-LM spells virtual pipeline stages (its run under CP is in
    test_megatron_lm_pretrain.py)."""
    args = checked("--num-layers", "4", "--pipeline-model-parallel-size", "2", flag,
                   str(value))
    assert getattr(args, flag[2:].replace("-", "_")) == value


def test_a_batch_ramp_this_megatron_lm_would_ignore_runs_as_its_step_schedule():
    """Megatron-LM >= 0.18 accepts --rampup-batch-size and trains at the full batch (its
    megatron-core dropped the ramp for --step-batch-size-schedule, which it reads in tokens):
    the rules hand it the same ramp as that schedule; where the ramp is honoured (<= 0.17)
    nothing changes. Beside a schedule, or with --decrease-batch-size-if-needed, refused."""
    import_megatron_lm()
    from megatron_eod.training.args_optim import ramps_by_step_schedule

    ramp = ["--rampup-batch-size", "8", "8", "64", "--global-batch-size", "32"]
    args = checked(*ramp)
    if not ramps_by_step_schedule():
        assert args.rampup_batch_size == [8, 8, 64]
        return
    assert args.rampup_batch_size is None  # samples 0, 22, 43, 64 x --seq-length 128
    assert args.step_batch_size_schedule == "0:8 2816:16 5504:24 8192:32"
    with pytest.raises(FlagError, match="--rampup-batch-size 8 8 64 with "
                                        "--decrease-batch-size-if-needed"):
        checked(*ramp, "--decrease-batch-size-if-needed")


def test_cuda_graphs_capture_only_what_holds_no_attention():
    """Graphs of the MLP pass; a scope with attention is refused (the graph would replay one
    micro-batch's plan)."""
    scope = "--cuda-graph-modules" if megatron_lm_knows("--cuda-graph-modules") else \
        "--cuda-graph-scope"  # Megatron-LM 0.19 renamed it
    assert checked("--cuda-graph-impl", "local", scope, "mlp").cuda_graph_impl == "local"
    with pytest.raises(FlagError, match="--cuda-graph-impl transformer_engine with scope "
                                        "attn mlp: a CUDA graph would replay"):
        checked("--cuda-graph-impl", "transformer_engine", scope, "attn", "mlp")


@pytest.mark.parametrize("flag", ["--overlap-grad-reduce", "--overlap-param-gather"])
def test_gloo_on_cuda_refuses_overlapped_gradient_collectives(monkeypatch, flag):
    """gloo on CUDA reduces gradients bucket by bucket, synchronously (gloo_on_cuda): the
    overlap flags are refused there, as in the lean trainer; nccl, and gloo on CPU, keep them."""
    import torch

    extra = [flag, "--use-distributed-optimizer"]
    assert getattr(checked(*extra, "--distributed-backend", "gloo"), flag[2:].replace("-", "_"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert getattr(checked(*extra, "--bf16"), flag[2:].replace("-", "_"))  # nccl
    with pytest.raises(FlagError, match=flag + " needs --distributed-backend nccl on CUDA"):
        checked(*extra, "--distributed-backend", "gloo", "--bf16")


def test_use_flash_attn_needs_a_flash_attn_the_attention_can_use(monkeypatch):
    """Megatron-LM's --use-flash-attn picks our flash-attn kernel: refused at start-up, as in
    the lean trainer, without CUDA or without a usable flash-attn (attention/backends.py)."""
    import sys
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlagError, match="--use-flash-attn needs CUDA"):
        checked("--use-flash-attn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    old = types.ModuleType("flash_attn")
    old.__version__ = "2.5.9"
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    with pytest.raises(FlagError, match=r"--use-flash-attn .*2\.5\.9 .*>= 2\.6"):
        checked("--use-flash-attn", "--bf16")
    old.__version__ = "2.7.4.post1"
    assert checked("--use-flash-attn", "--bf16").use_flash_attn
    with pytest.raises(FlagError, match=r"on CUDA .* pass --bf16 or --fp16"):
        checked("--use-flash-attn")  # float32: no GPU kernel of ours takes it


def test_full_validation_one_sequence_at_a_time():
    """Megatron-LM >= 0.19 validates --full-validation one sequence a micro-batch: the steps
    accept that row count, and a pipeline (shaped for --micro-batch-size) or a sequence
    parallelism that cannot split one sequence are refused at start-up."""
    import importlib

    from megatron_eod.training.megatron_lm_data import validates_one_row_at_a_time

    import_megatron_lm()
    samplers = importlib.import_module("megatron.training.datasets.data_samplers")
    one_row = hasattr(samplers, "MegatronFullValidationSampler")
    assert validates_one_row_at_a_time(checked("--full-validation")) == one_row
    assert not validates_one_row_at_a_time(checked())
    if not one_row:
        assert checked("--full-validation", "--pipeline-model-parallel-size", "2")
        pytest.skip("this Megatron-LM validates --full-validation in whole micro-batches")
    with pytest.raises(FlagError, match="--full-validation with --pipeline-model-parallel-size "
                                        "2: this Megatron-LM validates one sequence"):
        checked("--full-validation", "--pipeline-model-parallel-size", "2")
    with pytest.raises(FlagError, match="--full-validation with --sequence-parallel needs "
                                        "--seq-length / --context-parallel-size = 33 tokens"):
        checked("--full-validation", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--seq-length", "66", "--context-parallel-size", "2", "--micro-batch-size", "2")
