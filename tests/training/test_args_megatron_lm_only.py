"""Megatron-LM's flags under the lean trainer: every flag of Megatron-LM's REAL parser
(core_v0.16.1) is honoured, accepted with no effect (and said at start-up), or refused naming
the flag and the feature; a flag of neither gets the nearest lean flag."""

import argparse

import pytest

from megatron_eod.training.args import FlagError, build_parser, parse_args
from megatron_eod.training.args_megatron_lm_only import (NO_EFFECT, explain_unrecognized,
                                                         no_effect_notice, why_absent)
from tests.training.megatron_lm_checkout import import_megatron_lm, needs_megatron_lm

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--mock-data", "--train-iters", "10", "--lr", "1e-3"]


def lean(*flags):
    return parse_args([*BASE, *flags], world_size=1, cuda_available=False)


def _megatron_lm_actions():
    import_megatron_lm()
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(add_help=False))
    return {flag: action for flag, action in parser._option_string_actions.items()
            if flag.startswith("--")}


@needs_megatron_lm
def test_every_megatron_lm_flag_is_honoured_accepted_or_refused_with_its_reason():
    from megatron.core import package_info

    actions = _megatron_lm_actions()
    if not package_info.__version__.startswith("0.16."):
        pytest.skip(f"the lean trainer runs where megatron.training is absent (megatron-core "
                    f"0.16); this is {package_info.__version__}, whose own trainer runs")
    known = build_parser()._option_string_actions
    loose = sorted(flag for flag in actions if flag not in known and (
        why_absent(flag) is None
        or explain_unrecognized([flag], known).startswith("unrecognized flag")))
    assert not loose, f"Megatron-LM flags the lean trainer neither knows nor explains: {loose}"


@needs_megatron_lm
def test_no_effect_flags_take_the_values_megatron_lm_gives_them():
    """A switch here is a switch there, a flag with a value takes one there too: a script's
    next word is never eaten or left over."""
    actions = _megatron_lm_actions()
    for flag, (values, _) in NO_EFFECT.items():
        action = actions.get(flag)
        if action is None:  # another Megatron-LM than 0.16 may lack it
            continue
        takes = 0 if action.nargs == 0 else "+" if action.nargs in ("+", "*") else 1
        assert takes == values, flag


@pytest.mark.parametrize("flags", [
    ["--use-mcore-models", "--attention-backend", "fused", "--timing-log-level", "2",
     "--log-timers-to-tensorboard", "--async-save"],
    ["--rerun-mode", "disabled", "--calculate-per-token-loss", "--local-rank=3"],
])
def test_no_effect_flags_are_accepted_and_said(flags):
    args = lean(*flags)
    notice = no_effect_notice(args)
    for flag in flags:
        if flag.startswith("--"):
            assert flag.split("=")[0] in notice
    assert no_effect_notice(lean("--attention-dropout", "0")) is None


def test_no_effect_values_are_still_checked():
    with pytest.raises(FlagError, match="--attention-backend.*invalid choice: 'flashh'"):
        lean("--attention-backend", "flashh")
    with pytest.raises(FlagError, match="--rerun-mode validate_results: Megatron-LM's rerun "
                                        "engine.*--rerun-mode disabled"):
        lean("--rerun-mode", "validate_results")


@pytest.mark.parametrize("flags,message", [
    (["--fp8-format", "hybrid"], "--fp8-format: Megatron-LM's FP8/FP4 training.*which the "
                                 "lean trainer does not have.*--trainer megatron-lm"),
    (["--num-experts", "8"], "--num-experts: Megatron-LM's mixture of experts, refused by "
                             "both trainers: MoE layers are not wired with EoD attention"),
    (["--moe-router-topk", "2"], "--moe-router-topk: .*refused by both trainers"),
    (["--hybrid-context-parallel"], "--hybrid-context-parallel: Megatron-LM's dynamic context "
                                    "parallelism \\(a CP size per sequence\\), refused by both "
                                    "trainers: .*use --cp-comm-type a2a\\+p2p"),
    (["--wandb-project=run"], "--wandb-project: Megatron-LM's profiling and Weights"),
    (["--profile", "--use-torch-fsdp2"], "--profile: .*\\[and 1 more unrecognized flag: "
                                         "--use-torch-fsdp2\\]"),
])
def test_megatron_lm_features_the_lean_trainer_lacks_are_named(flags, message):
    with pytest.raises(FlagError, match=message):
        lean(*flags)


@pytest.mark.parametrize("word,near", [("--num-layer", "--num-layers"),
                                       ("--micro-batchsize", "--micro-batch-size"),
                                       # a family's prefix (--ddp-), a lean flag's typo
                                       ("--ddp-bucket-sizes", "--ddp-bucket-size"),
                                       ("--frobnicate", None)])
def test_a_flag_of_neither_gets_the_nearest_lean_flag(word, near):
    with pytest.raises(FlagError, match=f"unrecognized flag {word}") as raised:
        lean(word, "3")
    if near is None:
        assert "did you mean" not in str(raised.value)
    else:
        assert f"did you mean {near}?" in str(raised.value)


def test_a_misspelt_required_flag_is_named_as_a_misspelling():
    """`--num-layer 2` for --num-layers (the README's example) said only "the following
    arguments are required: --num-layers"; a missing flag alone still says that."""
    base = [f for f in BASE if f not in ("--num-layers", "2")]
    with pytest.raises(FlagError, match=r"unrecognized flag --num-layer; did you mean "
                                        r"--num-layers\?"):
        parse_args([*base, "--num-layer", "2"], world_size=1, cuda_available=False)
    with pytest.raises(FlagError, match=r"the following arguments are required: --num-layers"):
        parse_args(base, world_size=1, cuda_available=False)


@pytest.mark.parametrize("flag,instead", [("--checkpoint-activations", "--recompute-activations"),
                                          ("--batch-size", "--micro-batch-size"),
                                          ("--model-parallel-size",
                                           "--tensor-model-parallel-size")])
def test_flags_megatron_lm_removed_name_their_replacement(flag, instead):
    with pytest.raises(FlagError, match=f"{flag}: removed from Megatron-LM \\(its trainer "
                                        f"refuses it too\\); pass {instead}"):
        lean(flag, *(["2"] if flag != "--checkpoint-activations" else []))


def test_words_that_are_not_flags():
    assert explain_unrecognized(["stray"], []) == "unrecognized arguments: stray"


def test_fully_reshardable_without_the_distributed_optimizer_is_said_to_change_nothing():
    """Megatron-LM accepts it there (24 of its GPT functional-test configs pass it without
    --use-distributed-optimizer); the lean trainer refused it."""
    notice = no_effect_notice(lean("--dist-ckpt-optim-fully-reshardable"))
    assert notice and "--dist-ckpt-optim-fully-reshardable (it shapes the distributed " \
                      "optimizer's checkpoint; without --use-distributed-optimizer" in notice
    used = lean("--dist-ckpt-optim-fully-reshardable", "--use-distributed-optimizer",
                "--attention-dropout", "0")
    assert used.dist_ckpt_optim_fully_reshardable and no_effect_notice(used) is None


def test_an_attention_dropout_left_to_its_default_is_said():
    """Megatron-LM's default is 0.1, which its trainer here refuses (naming the flag); the
    lean trainer runs 0 and, where the script says nothing, says so: one script, one
    model, and no silent difference between the trainers."""
    said = no_effect_notice(lean())
    assert said == ("megatron-eod: --attention-dropout not given: 0 here, where Megatron-LM's "
                    "default is 0.1 (the varlen attention kernels apply no dropout; "
                    "Megatron-LM's trainer stops without --attention-dropout 0)")
    assert said[len("megatron-eod: "):] in no_effect_notice(lean("--use-mcore-models"))
    assert no_effect_notice(lean("--attention-dropout", "0.0")) is None
