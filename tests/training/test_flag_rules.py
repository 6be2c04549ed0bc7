"""`megatron_eod.training.flag_rules`: the rules run on Megatron-LM's args (most are checked
through its real parser in test_args.py), and --rampup-batch-size as the step schedule
megatron-core >= 0.18 reads instead."""

import importlib
import re

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_eod.training.flag_rules import rampup_as_step_schedule


def _batch_at(schedule: str, consumed: int) -> int:
    """A step schedule's batch at `consumed` samples (megatron-core >= 0.18's rule: the batch
    of the last threshold reached)."""
    batch = None
    for entry in schedule.split():
        threshold, size = map(int, entry.split(":"))
        if consumed >= threshold:
            batch = size
    return batch


@settings(max_examples=300, deadline=None)
@given(start=st.integers(1, 64), increment=st.integers(1, 32), increments=st.integers(1, 40),
       samples=st.integers(1, 5000))
def test_rampup_as_a_step_schedule_is_megatron_cores_ramp(start, increment, increments,
                                                          samples):
    """megatron-core >= 0.18 ignores --rampup-batch-size; the step schedule the rules hand it
    instead gives megatron-core <= 0.17's own ramp (RampupBatchsizeNumMicroBatchesCalculator,
    run where this megatron-core has it; else its rule as 0.16 states it) its batch at every
    consumed-sample count."""
    gbs = start + increment * increments
    schedule = rampup_as_step_schedule(start, increment, samples, gbs)
    thresholds = [int(entry.split(":")[0]) for entry in schedule.split()]
    assert thresholds[0] == 0 and thresholds == sorted(set(thresholds))
    batch_at = _megatron_core_ramp(start, increment, samples, gbs)
    for consumed in sorted({*range(0, min(samples, 400) + 3), *thresholds,
                            *(t - 1 for t in thresholds if t), samples, samples + 1}):
        assert _batch_at(schedule, consumed) == batch_at(consumed), consumed


def _megatron_core_ramp(start, increment, samples, gbs):
    """consumed samples -> megatron-core <= 0.17's ramped global batch."""
    calculators = importlib.import_module("megatron.core.num_microbatches_calculator")
    ramp_class = getattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator", None)
    if ramp_class is not None:
        ramp = ramp_class(global_batch_size=gbs, micro_batch_size=1, data_parallel_size=1,
                          decrease_batch_size_if_needed=False, rank=1,
                          start_global_batch_size=start, batch_size_increment=increment,
                          ramup_samples=samples)

        def batch_at(consumed):
            ramp.update(consumed, consistency_check=False)
            return ramp.get_current_global_batch_size()
        return batch_at
    per_increment = samples / ((gbs - start) // increment)  # 0.16's update(), a float

    def rule(consumed):
        if consumed > samples:
            return gbs
        return start + int(consumed / per_increment) * increment
    return rule


def test_use_checkpoint_args_keeps_the_flags_attention_dropout(monkeypatch, capsys):
    """A checkpoint trained without EoD attention has Megatron-LM's attention dropout, 0.1;
    --use-checkpoint-args makes it Megatron-LM's value whatever the flags say, and EoD
    attention has none: --attention-dropout 0 on the command line is kept over it (Megatron-
    LM's trainer refused the run, asking for the --attention-dropout 0 it had been given)."""
    import argparse

    from megatron_eod.training.flag_rules import keep_the_flags_attention_dropout

    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--attention-dropout", "0"])
    args = argparse.Namespace(use_checkpoint_args=True, attention_dropout=0.1, rank=0)
    keep_the_flags_attention_dropout(args)
    assert args.attention_dropout == 0.0
    assert "--attention-dropout 0 kept over the checkpoint's 0.1 (--use-checkpoint-args)" in \
        capsys.readouterr().out
    args = argparse.Namespace(use_checkpoint_args=False, attention_dropout=0.1)
    keep_the_flags_attention_dropout(args)  # without it, Megatron-LM's value: refused later
    assert args.attention_dropout == 0.1


@pytest.mark.parametrize("words,refused", [
    (["a", "b"], None), (["a"], None), (["0.3", "a", "0.7", "b"], None), (["2", "a"], None),
    (["0", "a", "1", "b"], "the weight of a is 0; weights must be above 0"),
    (["1", "a", "-0.5", "b"], "the weight of b is -0.5"),
    (["nan", "a"], "the weight of a is nan"), (["inf", "a"], "the weight of a is inf"),
    (["0.3", "a", "0.7"], "3 words; give prefixes alone, or \"WEIGHT PREFIX\" pairs"),
    (["0.3", "a", "b", "c"], "pairs expected, got \"b c\""),
    (["1", "2", "3", "a"], "pairs expected, got \"1 2\""),
])
@pytest.mark.parametrize("dest", ["data_path", "train_data_path", "valid_data_path",
                                  "test_data_path"])
def test_blend_weights(words, refused, dest):
    import types

    from megatron_eod.training.cp_flags import FlagError
    from megatron_eod.training.flag_rules import check_blend_weights

    args = types.SimpleNamespace(**{dest: words})
    if refused is None:
        check_blend_weights(args)
        return
    with pytest.raises(FlagError, match=re.escape(refused)) as error:
        check_blend_weights(args)
    assert str(error.value).startswith(f"--{dest.replace('_', '-')} \"{' '.join(words)}\"")
