"""training/run.py: pretrain_gpt.py's call into Megatron-LM's `pretrain()`.

Megatron-LM's REAL validate_args with the hooks run.py puts around it: our CP spellings and
the tokenizer from the data resolved and checked before it (its own assertions on them carry
no message), our rules after it, its own assertions as one line. The >= 0.18 signature (a
config container first, parse_and_validate_args before) and in-process restarts, with the
functions they call stood in for, in a forked rank (run() patches them).
"""

import inspect
import re

import pytest

import pretrain_gpt
from megatron_eod.training import run
from megatron_eod.training.cp_flags import FlagError
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm, megatron_lm_knows
from tests.training.parsed_flags import BASE


def validated(monkeypatch, *flags, base=BASE, mock=True):
    """Megatron-LM's parse_args and its REAL validate_args, with the hooks training/run.py
    installs around it (restored after the test), at world 4; on --mock-data, or (mock=False)
    on the --data-path of `base`."""
    return validated_argv(monkeypatch, [
        *[f for f in base if not mock or f not in ("--data-path", "corpus")], "--lr", "1e-3",
        "--train-iters", "2", *(["--mock-data"] if mock else []), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "256", "--max-position-embeddings", "128", *flags])


def validated_argv(monkeypatch, argv, world=4, cuda=False):
    """`argv` through Megatron-LM's parse_args and validate_args with run.py's hooks, as on
    `world` ranks of a machine with CUDA or without."""
    import_megatron_lm()
    import torch
    from megatron.training import arguments, initialize

    for module in (arguments, initialize):  # restored after the test (>= 0.18: arguments)
        if hasattr(module, "validate_args"):
            monkeypatch.setattr(module, "validate_args", module.validate_args)
    monkeypatch.setattr(run.gloo_on_cuda, "wanted", lambda *a: False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as run.run sets it
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(extra_args_provider=run.add_eod_args)
    run._check_after_validate()
    from megatron_eod.megatron import cpu_compat

    cpu_compat.apply(force=True, megatron_lm=True)  # as run.run does on CPU
    try:
        with monkeypatch.context() as device:
            device.setattr(torch.cuda, "is_available", lambda: cuda)
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
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs "
                                               "--vocab-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs "
                                                   "--tokenizer-model"),
], ids=["log-interval", "eval-interval", "save-interval", "split-four", "split-zero",
        "split-no-train", "global-batch", "gpt2-files", "hf-model"])
def test_megatron_lm_failures_are_refused_by_name(monkeypatch, flags, message):
    """Each was a bare AssertionError, a ZeroDivisionError after the first iteration, or a
    traceback in our own split check, under Megatron-LM's trainer."""
    if flags == ["--tokenizer-type", "GPT2BPETokenizer"] and _fetches_gpt2():
        pytest.skip("this Megatron-LM (>= 0.17) fetches GPT-2's vocabulary itself")
    # Megatron-LM >= 0.18 asserts the global batch in validate_args itself, as the evaluation
    # batch's (eval_global_batch_size ... data_parallel_size, neither a flag given): ours.
    with pytest.raises(FlagError, match=re.escape(message)):
        validated(monkeypatch, *flags, mock=False)


def test_megatron_lm_0_19s_global_batch_assertion_becomes_ours():
    """>= 0.18 asserts the multiple as eval_global_batch_size's (checked against the 0.19.2
    wheel by scripts/test_megatron_lm_versions.sh; CI's core_v0.16.1 never asserts it): our
    line, without --decrease-batch-size-if-needed, which does not help there; other
    assertions and unusable sizes keep Megatron-LM's own line (a review: a ZeroDivisionError
    at --micro-batch-size 0, a TypeError without it)."""
    import argparse

    from megatron_eod.training.run import _global_batch_as_ours

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
    from megatron_eod.training.tokenizer_flags import _fetched_vocabularies

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
    """Megatron-LM asserts an interval: none given, no iteration reaches ours, and its loop
    saves the last iteration whenever the interval does not divide it."""
    from megatron_eod.training.args import SAVE_AT_THE_END

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


@pytest.mark.parametrize("world,extra,named", [
    (4, ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid",
         "--ulysses-degree-in-cp", "3"], ["--ulysses-degree-in-cp", "--context-parallel-size"]),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2"],
     ["--num-attention-heads", "--context-parallel-size"]),
    (4, ["--context-parallel-size", "4", "--seq-length", "130", "--max-position-embeddings",
         "130"], ["--seq-length", "--context-parallel-size"]),
    (2, ["--context-parallel-size", "2", "--context-parallel-algo", "zigzag"],
     ["--context-parallel-algo"]),
    (4, ["--context-parallel-size", "3"], ["--context-parallel-size 3", "WORLD_SIZE",
                                           "--nproc-per-node"]),
    (2, ["--data-path", "0.5", "DATA", "0", "DATA"], ["--data-path", "weight of DATA is 0"]),
    (2, ["--data-path", "0.5", "DATA", "DATA"], ["--data-path", "\"WEIGHT PREFIX\" pairs"]),
    (2, ["--hybrid-layer-pattern", "*-*-"], ["--hybrid-layer-pattern", "pretrain_hybrid.py"]),
], ids=["ulysses-degree", "heads", "seq-length", "unknown-algo", "world-size", "blend-weight",
        "blend-odd", "hybrid-pattern"])
def test_bad_flags_stop_every_rank_at_start_up(short_docs_data, world, extra, named):
    """Exit status 2 and one line on every rank naming the flags, before any model or data is
    built (not rank 0 alone: torchrun ends every rank once the first exits, so a line left to
    rank 0 was lost whenever it started later than the others). The world size: Megatron-LM
    asserted "world size (4) is not divisible by total_model_size", naming no flag."""
    if not megatron_lm_knows(extra[0]):
        pytest.skip(f"this Megatron-LM has no {extra[0]}")
    from tests.training.runs import error_lines, flags, start

    import_megatron_lm()
    extra = [word.replace("DATA", short_docs_data) for word in extra]  # (the fixture's path)
    named = [word.replace("DATA", short_docs_data) for word in named]
    results = run_ranks(start, world, flags(short_docs_data, None, *extra), timeout=120,
                        daemon=False)
    assert [code for code, _ in results] == [2] * world, results
    for lines in error_lines(results):
        assert len(lines) == 1 and all(flag in lines[0] for flag in named), results
    assert "Traceback" not in results[-1][1]


def test_without_megatron_lm_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(run, "megatron_lm_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(["--lr", "1"])
    assert stop.value.code == 2
    assert "megatron-core >= 0.17" in capsys.readouterr().err


def _call_with_019_signature(rank, world):
    from megatron.training import argument_utils, arguments, training

    seen = {}

    def pretrain(cfg_container, train_valid_test_dataset_provider, model_type,
                 forward_step_func, model_provider=None, process_non_loss_data_func=None,
                 get_embedding_ranks=None, get_position_embedding_ranks=None,
                 non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
        seen.update(cfg=cfg_container, model_provider=model_provider.__name__,
                    datasets=train_valid_test_dataset_provider.__name__,
                    forward=forward_step_func.__name__)

    def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                                args_defaults={}):
        seen.update(extra=extra_args_provider.__name__, defaults=dict(args_defaults))
        return "parsed args"

    training.pretrain = pretrain
    arguments.parse_and_validate_args = parse_and_validate_args
    argument_utils.pretrain_cfg_container_from_args = lambda args, model_cfg=None: (
        "container of " + args)
    run.run(["--lr", "1"])
    assert "cfg_container" in inspect.signature(training.pretrain).parameters
    return seen


def test_pretrain_018_and_later_get_a_config_container_and_keywords():
    import_megatron_lm()
    seen, = run_ranks(_call_with_019_signature, 1)
    assert seen == {"extra": "add_eod_args", "defaults": {},
                    "cfg": "container of parsed args", "model_provider": "model_provider",
                    "datasets": "datasets_provider", "forward": "forward_step"}


def _restarted_by_a_stand_in(rank, world, restarting):
    """nvidia-resiliency-ext's Wrapper (not installed here) stood in for: it runs pretrain()
    again after any exception but its terminal RestartAbort, up to 3 times here (Megatron-LM
    sets no limit)."""
    import contextlib
    import io
    import sys
    import types

    from megatron.training import inprocess_restart, training

    from megatron_eod.training.cp_flags import FlagError

    class RestartAbort(BaseException):
        pass

    package = types.ModuleType("nvidia_resiliency_ext.inprocess.exception")
    package.RestartAbort = RestartAbort
    sys.modules["nvidia_resiliency_ext.inprocess.exception"] = package
    attempts = []

    def pretrain(*args, **kwargs):
        attempts.append(1)
        raise FlagError("--lr: the same error on every attempt")

    def maybe_wrap(pretrain):
        if not restarting:
            return pretrain, None

        def wrapper(*args, **kwargs):
            for _ in range(3):
                try:
                    return pretrain(*args, **kwargs)
                except Exception:
                    continue

        return wrapper, "store"

    training.pretrain = pretrain
    inprocess_restart.maybe_wrap_for_inprocess_restart = maybe_wrap
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run.run(["--lr", "1"])
        except RestartAbort:
            return "RestartAbort", len(attempts), err.getvalue()
        except SystemExit as stop:
            return stop.code, len(attempts), err.getvalue()


@pytest.mark.parametrize("restarting", [True, False])
def test_our_errors_end_in_process_restarts(restarting):
    """--inprocess-restart re-ran pretrain() after every error, without limit: a flag, data or
    checkpoint error fails the same way each time, so it ends the restarts (said once)."""
    import_megatron_lm()
    (outcome, attempts, said), = run_ranks(_restarted_by_a_stand_in, 1, restarting)
    assert (outcome, attempts) == (("RestartAbort" if restarting else 2), 1)
    assert said == "pretrain_gpt.py: error: --lr: the same error on every attempt\n"
