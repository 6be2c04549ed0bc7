"""pretrain_gpt.py's choice of trainer and the call into Megatron-LM's `pretrain()`.

`--trainer auto` runs Megatron-LM's trainer exactly when `megatron.training` imports, the lean
one otherwise; `--trainer megatron-lm` without it stops with what to install. The >= 0.18
signature (a config container first, parse_and_validate_args before) cannot be installed on
Python 3.11, so that call is checked against Megatron-LM 0.16's modules with 0.19's
`pretrain` signature and helpers put in their place, in a forked rank (run() patches them).
"""

import inspect

import pytest

import pretrain_gpt
from megatron_eod.training import megatron_lm_run
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm, needs_megatron_lm


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr("megatron_eod.training.pretrain.pretrain",
                        lambda argv: seen.append(("lean", argv)))
    monkeypatch.setattr(megatron_lm_run, "run", lambda argv: seen.append(("megatron-lm", argv)))
    return seen


@pytest.mark.parametrize("available,argv,expected", [
    (False, ["--lr", "1"], ("lean", ["--lr", "1"])),
    (True, ["--lr", "1"], ("megatron-lm", ["--lr", "1"])),
    (True, ["--trainer", "lean", "--lr", "1"], ("lean", ["--trainer", "lean", "--lr", "1"])),
    (True, ["--trainer=lean", "--lr", "1"], ("lean", ["--trainer=lean", "--lr", "1"])),
    (True, ["--trainer", "megatron-lm", "--lr", "1"],
     ("megatron-lm", ["--trainer", "megatron-lm", "--lr", "1"])),
], ids=["auto-lean", "auto-megatron-lm", "lean", "lean-equals", "megatron-lm"])
def test_trainer_choice(monkeypatch, calls, available, argv, expected):
    monkeypatch.setattr(megatron_lm_run, "megatron_lm_available", lambda: available)
    pretrain_gpt.main(argv)
    assert calls == [expected]


def test_megatron_lm_trainer_missing_says_what_to_install(monkeypatch, calls, capsys):
    monkeypatch.setattr(megatron_lm_run, "megatron_lm_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(["--trainer", "megatron-lm"])
    assert stop.value.code == 2 and not calls
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
    megatron_lm_run.run(["--lr", "1"])
    assert "cfg_container" in inspect.signature(training.pretrain).parameters
    return seen


@needs_megatron_lm
def test_pretrain_018_and_later_get_a_config_container_and_keywords():
    import_megatron_lm()
    seen, = run_ranks(_call_with_019_signature, 1)
    assert seen == {"extra": "add_eod_args", "defaults": {"tokenizer_type": "GPT2BPETokenizer"},
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
            megatron_lm_run.run(["--lr", "1"])
        except RestartAbort:
            return "RestartAbort", len(attempts), err.getvalue()
        except SystemExit as stop:
            return stop.code, len(attempts), err.getvalue()


@needs_megatron_lm
@pytest.mark.parametrize("restarting", [True, False])
def test_our_errors_end_in_process_restarts(restarting):
    """--inprocess-restart re-ran pretrain() after every error, without limit: a flag, data or
    checkpoint error fails the same way each time, so it ends the restarts (said once)."""
    import_megatron_lm()
    (outcome, attempts, said), = run_ranks(_restarted_by_a_stand_in, 1, restarting)
    assert (outcome, attempts) == (("RestartAbort" if restarting else 2), 1)
    assert said == "pretrain_gpt.py: error: --lr: the same error on every attempt\n"
