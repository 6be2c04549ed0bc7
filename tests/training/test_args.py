"""Megatron-LM's flags through its REAL parser and our `add_eod_args`, then
`eod_args_from_megatron`: every flag we refuse raises a FlagError naming it (and, for
Megatron-LM defaults we cannot run, the flag to add); the CP spellings map onto ours with
no fact asked twice; per-token loss is on by default. (What needs CUDA, or a GPU run needs:
test_device_flags.py.)"""

import pytest

from megatron_eod.training.cp_flags import CP_ALGO_ALIASES, FlagError
from tests.training.megatron_lm_checkout import import_megatron_lm, megatron_lm_knows
from tests.training.parsed_flags import BASE, checked, megatron_lm_args

REFUSALS = {
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
    "seq-length-cp": (["--context-parallel-size", "4", "--seq-length", "126",
                       "--max-position-embeddings", "128"],
                      "--seq-length 126 must be divisible by --context-parallel-size 4"),
    "zigzag": (["--context-parallel-algo", "zigzag"], "--context-parallel-algo 'zigzag' is not "
               "supported; choose one of ring, ulysses, hybrid, megatron_cp_algo, "
               "ulysses_cp_algo, hybrid_cp_algo"),
    "ulysses-heads": (["--context-parallel-size", "4", "--cp-comm-type", "a2a",
                       "--num-attention-heads", "2"],
                      "--num-attention-heads 2 / --tensor-model-parallel-size 1 = 2 heads per "
                      "rank must be divisible by --context-parallel-size 4"),
    "hybrid-heads": (["--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p",
                      "--hierarchical-context-parallel-sizes", "4", "2",
                      "--num-attention-heads", "6", "--hidden-size", "96"],
                     "--num-attention-heads 6 / --tensor-model-parallel-size 1 = 6 heads per "
                     "rank must be divisible by --ulysses-degree-in-cp 4"),
    "degree-vs-ring": (["--context-parallel-size", "4", "--context-parallel-algo",
                        "megatron_cp_algo", "--ulysses-degree-in-cp", "4"],
                       "--ulysses-degree-in-cp 4 contradicts --context-parallel-algo ring"),
    "degree-vs-ulysses": (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses",
                           "--ulysses-degree-in-cp", "2"],
                          "--ulysses-degree-in-cp 2 contradicts --context-parallel-algo ulysses"),
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
    (["--no-gradient-accumulation-fusion"], r"--gradient-accumulation-fusion \(Megatron-LM's "
     r"default\) needs apex's CUDA extension fused_weight_gradient_mlp_cuda, which is not "
     r"installed: pass --no-gradient-accumulation-fusion"),
], ids=["attention-dropout", "transformer-engine", "gradient-accumulation-fusion"])
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
    from megatron_eod.training.args import eod_args_from_megatron

    args = megatron_lm_args()
    setattr(args, dest, value)
    with pytest.raises(FlagError, match=message):
        eod_args_from_megatron(args)


@pytest.mark.parametrize("flags,message", [
    (["--train-iters", "4", "--lr-warmup-iters", "4"],
     r"^--lr-warmup-iters 4 must be in \[0, --lr-decay-iters 4\) \(the warmup must end"),
    (["--train-iters", "8", "--lr-decay-iters", "3", "--lr-warmup-iters", "5"],
     r"^--lr-warmup-iters 5 must be in \[0, --lr-decay-iters 3\)"),
    (["--train-iters", "8", "--lr-warmup-fraction", "1.0"],
     r"^--lr-warmup-fraction must be in \[0, 1\), got 1.0"),
])
def test_a_warmup_past_the_decay_is_one_line(flags, message):
    """megatron-core's scheduler asserted it bare on every rank, after the model was built."""
    with pytest.raises(FlagError, match=message):
        checked(*flags)
    checked("--train-iters", "8", "--lr-warmup-iters", "4")


def test_per_token_loss_is_the_default_and_cannot_be_lost():
    from megatron_eod.training.args import eod_args_from_megatron

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


def test_eval_interval_has_a_default():
    """core_v0.16.1's Megatron-LM has none and divides by it at start-up (a TypeError)."""
    base = [f for f in BASE if f not in ("--eval-interval", "100")]
    assert checked(base=base).eval_interval == 1000
    assert checked("--eval-interval", "7", base=base).eval_interval == 7


def test_cp_ring_exchange_is_ours_too():
    assert checked("--context-parallel-size", "4").cp_ring_exchange == "batched"
    for exchange in ("steps", "batched-keep"):
        args = checked("--context-parallel-size", "4", "--cp-ring-exchange", exchange)
        assert args.cp_ring_exchange == exchange


def test_cp_concurrent_calls_is_ours_too():
    assert checked("--context-parallel-size", "4", "--cp-concurrent-calls").cp_concurrent_calls
    with pytest.raises(FlagError, match=r"--cp-concurrent-calls .*not steps"):
        checked("--context-parallel-size", "4", "--cp-ring-exchange", "steps",
                "--cp-concurrent-calls")


def test_cp_fused_forward_is_ours_too(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU's way to run it (tests)
    assert checked("--context-parallel-size", "4", "--cp-fused-forward").cp_fused_forward
    assert checked("--context-parallel-size", "4", "--cp-fused-forward",
                   "--cp-fused-backward").cp_fused_backward
    with pytest.raises(FlagError, match=r"--cp-fused-forward .*not steps"):
        checked("--context-parallel-size", "4", "--cp-ring-exchange", "steps",
                "--cp-fused-forward")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(FlagError, match=r"--cp-fused-forward needs CUDA"):
        checked("--context-parallel-size", "4", "--cp-fused-forward")


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
    from megatron_eod.training.flag_rules import ramps_by_step_schedule

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


def test_a_huggingface_tokenizer_is_what_transformers_reads(tmp_path, monkeypatch):
    """Megatron-LM's trainer reads HuggingFaceTokenizer with transformers' AutoTokenizer (a
    docs walk: a tokenizer.json path, or no transformers, was a traceback on every rank)."""
    import importlib.util

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    hf = ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model")
    with pytest.raises(FlagError, match=f"--tokenizer-model {folder}/tokenizer.json: .*takes "
                                        f"its directory .*: pass --tokenizer-model {folder}$"):
        checked(*hf, str(folder / "tokenizer.json"))
    find_spec = importlib.util.find_spec

    def transformers_is(found):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found if name ==
                            "transformers" else find_spec(name, *a))

    transformers_is(None)
    with pytest.raises(FlagError, match=r"needs the transformers package: pip install "):
        checked(*hf, str(folder))
    transformers_is(object())
    assert checked(*hf, str(folder)).tokenizer_model == str(folder)
    assert checked(*hf, "meta-llama/Llama-3.1-8B").tokenizer_type == "HuggingFaceTokenizer"


def test_the_tp_pp_dp_rank_order_follows_megatron_cores_rule():
    """Megatron-LM's *_dp_last CP configs pair the order with an expert tensor size of
    TP x CP; without one, PP x CP under it stopped in megatron-core's group assertion."""
    mapped = ("--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2")
    with pytest.raises(FlagError, match=r"--use-tp-pp-dp-mapping with "
                                        r"--pipeline-model-parallel-size 2: .*\(1 x 1\)"):
        checked(*mapped, "--context-parallel-size", "2", world=4)
    assert checked(*mapped, "--context-parallel-size", "2", "--expert-tensor-parallel-size",
                   "2", world=4).use_tp_pp_dp_mapping


def test_decoupled_lr_checkpoints_that_megatron_core_cannot_load_are_refused(tmp_path):
    """megatron-core 0.16.1's regular optimizer cannot load a --decoupled-lr run's own
    checkpoint (its groups differ only in max_lr, which it does not compare; measured: a
    ValueError at the resume, torch and torch_dist); the distributed optimizer resumes
    (test_megatron_lm_pretrain.py::test_decoupled_lr_resumes_on_its_own_schedule)."""
    from megatron.core.optimizer import optimizer

    save = ("--save", str(tmp_path))
    assert checked("--decoupled-lr", "2e-4").decoupled_lr == 2e-4  # saves nothing: nothing lost
    for fresh in ("--no-load-optim", "--finetune"):  # loads no optimizer state, saves none
        assert checked("--decoupled-lr", "2e-4", "--load", str(tmp_path), fresh).decoupled_lr
    assert checked("--decoupled-lr", "2e-4", *save, "--use-distributed-optimizer").decoupled_lr
    if "max_lr" in optimizer.param_group_identifier_keys:  # a megatron-core that compares it
        assert checked("--decoupled-lr", "2e-4", *save).decoupled_lr
        return
    with pytest.raises(FlagError, match=r"--decoupled-lr 0.0002 without "
                                        r"--use-distributed-optimizer: this megatron-core's"):
        checked("--decoupled-lr", "2e-4", *save)


def test_full_validation_one_sequence_at_a_time():
    """Megatron-LM >= 0.19 validates --full-validation one sequence a micro-batch: the steps
    accept that row count, and a pipeline (shaped for --micro-batch-size) or a sequence
    parallelism that cannot split one sequence are refused at start-up."""
    import importlib

    from megatron_eod.training.data import validates_one_row_at_a_time

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


def test_xavier_init_that_this_megatron_lm_cannot_build_is_named():
    """core_v0.16.1's core_transformer_config_from_args gives TransformerConfig a
    `scaled_init_method` that megatron-core 0.16 lacks: a TypeError at model build."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    import_megatron_lm()
    if "scaled_init_method" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        assert checked("--init-method-xavier-uniform").init_method_xavier_uniform
        return
    with pytest.raises(FlagError, match="--init-method-xavier-uniform: this Megatron-LM passes "
                                        "megatron-core a `scaled_init_method`"):
        checked("--init-method-xavier-uniform")


def test_a_checkpoint_the_rerun_machine_saved_for_examination_is_one_line(monkeypatch):
    """After a possible transient error Megatron-LM's rerun machine saves a checkpoint and
    exits (17); resumed, megatron-core 0.16 stopped every rank with a TypeError in its rerun
    machine (a helper's sweep, Megatron-LM's reruns_transient config). Checked by hand: the
    one line's remedy, --rerun-mode disabled, resumes from it. (A stand-in machine: the real
    one is a process global that Megatron-LM's start-up in forked ranks must find unset.)"""
    import argparse
    import types

    from megatron.core import rerun_state_machine as machine

    from megatron_eod.training.checkpoint_files import CheckpointError
    from megatron_eod.training.checkpoint_load import _check_rerun_state

    loaded = types.SimpleNamespace(state=machine.RerunState.NOT_RUNNING_YET, saved_state=None,
                                   current_iteration=2)
    monkeypatch.setattr(machine, "get_rerun_state_machine", lambda: loaded)
    args = argparse.Namespace(load="ckpt")
    _check_rerun_state(args)  # a checkpoint of a normal run
    loaded.state = machine.RerunState.RERUNNING_IN_PLACE
    with pytest.raises(CheckpointError, match=r"--load ckpt: Megatron-LM's rerun machine saved "
                                              r"this checkpoint after a possible transient "
                                              r"error at iteration 2.* pass --rerun-mode "
                                              r"disabled"):
        _check_rerun_state(args)


def test_algo_aliases_cover_the_plan_algorithms():
    from megatron_eod.plan.cp_plan import ALGORITHMS

    assert set(CP_ALGO_ALIASES.values()) == set(ALGORITHMS)


def test_flag_error_is_a_value_error():
    assert issubclass(FlagError, ValueError)
