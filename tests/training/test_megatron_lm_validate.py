"""Megatron-LM's REAL validate_args (core_v0.16.1) with the hooks training/megatron_lm_run.py
puts around it: our CP spellings resolved and checked before it (its own assertions on them
carry no message), our rules after it; and the same flags build the same model in Megatron-LM's
trainer and in the lean one (`--trainer auto` picks either)."""

import re

import pytest

from megatron_eod.training.args import FlagError
from tests.training.megatron_lm_checkout import import_megatron_lm, needs_megatron_lm
from tests.training.test_megatron_lm_args import BASE, megatron_lm_args

pytestmark = needs_megatron_lm


def validated(monkeypatch, *flags, base=BASE, mock=True):
    """Megatron-LM's parse_args and its REAL validate_args, with the hooks
    training/megatron_lm_run.py installs around it (restored after the test), at world 4;
    on --mock-data, or (mock=False) on the --data-path of `base`."""
    import_megatron_lm()
    from megatron.training import arguments, initialize

    from megatron_eod.training import megatron_lm_run

    for module in (arguments, initialize):  # restored after the test (>= 0.18: arguments)
        if hasattr(module, "validate_args"):
            monkeypatch.setattr(module, "validate_args", module.validate_args)
    monkeypatch.setattr(megatron_lm_run.gloo_on_cuda, "wanted", lambda *a: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as megatron_lm_run.run sets it
    args = megatron_lm_args("--lr", "1e-3", "--train-iters", "2",
                            *(["--mock-data"] if mock else []),
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                            "--max-position-embeddings", "128", *flags,
                            base=[f for f in base if not mock or f not in ("--data-path",
                                                                           "corpus")])
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


def test_a_hybrid_script_at_cp_1_runs_as_cp_1(monkeypatch):
    """A launch script templated for hybrid run at --context-parallel-size 1, as Megatron-LM
    takes it (sizes of product 1); we refused it naming --context-parallel-algo, a flag the
    script never gave."""
    args = validated(monkeypatch, "--context-parallel-size", "1", "--cp-comm-type", "a2a+p2p",
                     "--hierarchical-context-parallel-sizes", "1", "1")
    assert (args.context_parallel_algo, args.ulysses_degree) == ("ring", 1)
    assert args.cp_comm_type == ["a2a+p2p"]
    with pytest.raises(FlagError, match=re.escape("--hierarchical-context-parallel-sizes 2 2: "
                                                  "their product must be "
                                                  "--context-parallel-size 1")):
        validated(monkeypatch, "--context-parallel-size", "1", "--cp-comm-type", "a2a+p2p",
                  "--hierarchical-context-parallel-sizes", "2", "2")


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
              "--transformer-impl", "local", "--eval-interval", "100",
              "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion"]
    theirs = validated(monkeypatch, *flags, base=common)
    ours = lean_parse_args([*common, "--lr", "1e-3", "--train-iters", "2", "--mock-data",
                            *flags], world_size=4)
    assert _model_of(ours) == _model_of(theirs)


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


@pytest.mark.parametrize("flags,message", [
    (["--log-interval", "0"], "--log-interval must be positive, got 0"),
    (["--eval-interval", "0"], "--eval-interval must be positive, got 0"),
    (["--save", "ckpt", "--save-interval", "0"], "--save-interval must be positive, got 0"),
    (["--split", "90,5,3,2"], "--split 90,5,3,2: give up to three shares"),
    (["--split", "0,0,0"], "--split 0,0,0: give up to three shares"),
    (["--split", "0,50,50"], "--split 0,50,50 gives training no share of the data"),
    (["--global-batch-size", "6"], "--global-batch-size 6 must be a multiple of "
                                   "--micro-batch-size 2 x data-parallel size 4"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer (Megatron-LM's "
                                               "default where none is given; byte-level data, the "
                                               "lean trainer's default: --tokenizer-type "
                                               "NullTokenizer --vocab-size 256) needs --vocab-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs "
                                                   "--tokenizer-model"),
], ids=["log-interval", "eval-interval", "save-interval", "split-four", "split-zero",
        "split-no-train", "global-batch", "gpt2-files", "hf-model"])
def test_flags_the_lean_trainer_refuses_by_name_are_refused_so_here(monkeypatch, flags, message):
    """Each was a bare AssertionError, a ZeroDivisionError after the first iteration, or a
    traceback in our own split check, under Megatron-LM's trainer; the lean trainer refuses
    the same flags with the same line."""
    from megatron_eod.training.args import parse_args as lean_parse_args

    if flags == ["--tokenizer-type", "GPT2BPETokenizer"] and _fetches_gpt2():
        pytest.skip("this Megatron-LM (>= 0.17) fetches GPT-2's vocabulary itself")
    # Megatron-LM >= 0.18 asserts the global batch in validate_args itself, as the evaluation
    # batch's (eval_global_batch_size ... data_parallel_size, neither a flag given): ours.
    with pytest.raises(FlagError, match=re.escape(message)):
        validated(monkeypatch, *flags, mock=False)
    lean = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--micro-batch-size", "2", "--lr", "1e-3",
            "--train-iters", "2", "--data-path", "corpus", *flags]
    ours = re.sub(r" \(Megatron-LM's default where none is given.*\)", "", message)  # Byte...
    with pytest.raises(FlagError, match=re.escape(ours)):
        lean_parse_args(lean, world_size=4)


def test_megatron_lm_0_19s_global_batch_assertion_becomes_ours():
    """>= 0.18 asserts the multiple as eval_global_batch_size's (checked against the 0.19.2
    wheel by scripts/test_megatron_lm_versions.sh; CI's core_v0.16.1 never asserts it): our
    line, without --decrease-batch-size-if-needed, which does not help there; other
    assertions and unusable sizes keep Megatron-LM's own line (a review: a ZeroDivisionError
    at --micro-batch-size 0, a TypeError without it)."""
    import argparse

    from megatron_eod.training.megatron_lm_run import _global_batch_as_ours

    theirs = AssertionError("eval_global_batch_size (10) must be divisible by "
                            "eval_micro_batch_size (2) * data_parallel_size (4)")
    args = argparse.Namespace(micro_batch_size=2, data_parallel_size=4, global_batch_size=10,
                              decrease_batch_size_if_needed=True)
    with pytest.raises(FlagError, match=r"--global-batch-size 10 must be a multiple of "
                                        r"--micro-batch-size 2 x data-parallel size 4$"):
        _global_batch_as_ours(args, theirs)
    _global_batch_as_ours(args, AssertionError("num_attention_heads % tp == 0"))  # not ours
    for unusable in (0, None):
        args.micro_batch_size = unusable
        _global_batch_as_ours(args, theirs)


def _fetches_gpt2():
    from megatron_eod.training.megatron_lm_args import _fetched_vocabularies

    import_megatron_lm()
    return "GPT2BPETokenizer" in _fetched_vocabularies(object())  # no --legacy-tokenizer


@pytest.mark.parametrize("flags,message", [
    (["--min-lr", "1"], "Megatron-LM's flag check refused this run: it requires "
                        "`args.min_lr <= args.lr` (--lr, --min-lr) [megatron/training/"
                        "arguments.py:"),
    (["--train-samples", "16"], "Megatron-LM's flag check refused this run: expected "
                                "iteration-based training (--train-samples) [megatron/"
                                "training/arguments.py:"),
], ids=["bare", "with-message"])
def test_megatron_lm_assertions_are_one_line_naming_the_flags(monkeypatch, flags, message):
    """Its own checks' assertions (most with no message) as one line, not a traceback on
    every rank."""
    with pytest.raises(FlagError, match=re.escape(message)):
        validated(monkeypatch, *flags)


def test_save_without_an_interval_saves_at_the_end(monkeypatch):
    """As in the lean trainer (Megatron-LM asserts an interval): no iteration reaches it, and
    its loop saves the last iteration whenever the interval does not divide it."""
    from megatron_eod.training.megatron_lm_args import SAVE_AT_THE_END

    assert validated(monkeypatch, "--save", "ckpt").save_interval == SAVE_AT_THE_END
    assert validated(monkeypatch, "--save", "ckpt", "--save-interval", "5").save_interval == 5
    assert validated(monkeypatch).save_interval is None


def test_what_megatron_lm_does_not_read_is_not_refused(monkeypatch):
    """The shared rules stop only where Megatron-LM would: mock data ignores --split (megatron-
    core splits it 1,1,1), --save-interval counts only with --save, --eval-interval sizes the
    validation data only when the run trains."""
    validated(monkeypatch, "--split", "0,1,0")  # --mock-data
    validated(monkeypatch, "--split", "100,0,0")  # evaluates: mock data has validation
    validated(monkeypatch, "--save-interval", "0")
    validated(monkeypatch, "--eval-interval", "0", "--skip-train")
    with pytest.raises(FlagError, match="or pass --skip-train to evaluate only"):
        validated(monkeypatch, "--split", "0,1,0", mock=False)
    validated(monkeypatch, "--split", "0,1,0", "--skip-train", mock=False)


def test_megatron_lm_assertions_show_the_whole_statement(monkeypatch, tmp_path):
    """A multi-line assert was shown by its last line, and --save-retain-interval without
    --save-interval by the interval filled in for --save alone."""
    spec = tmp_path / "splits.json"
    spec.write_text('{"train": ["a"]}')
    with pytest.raises(FlagError, match=re.escape(
            "it requires `args.save_interval is not None` (--save-interval)")):
        validated(monkeypatch, "--save", "ckpt", "--save-retain-interval", "10")
    with pytest.raises(FlagError) as refused:
        validated(monkeypatch, "--train-data-path", "a", "--per-split-data-args-path", str(spec))
    assert "--train-data-path" in str(refused.value), refused.value
