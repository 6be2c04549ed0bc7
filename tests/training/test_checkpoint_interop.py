"""A checkpoint of either trainer continues in the other: the lean trainer's torch_dist
checkpoint loads in Megatron-LM's REAL `pretrain()` (core_v0.16.1, ../shared/megatron-lm) and
Megatron-LM's loads in the lean trainer, at another CP size (resharded), with the distributed
optimizer; iterations 3-4 after the load are the uninterrupted run's to 1e-5. (The two
trainers draw their initial weights differently, so their first iterations differ; from a
checkpoint they compute the same steps.)

Same model, data and optimizer flags on both sides (test_megatron_lm_pretrain.flags, minus
the Megatron-LM-only fusion and logging switches the lean trainer does not take).
"""

import json

import pytest

from tests.functional.tiny_gpt import train_rank
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import needs_megatron_lm
from tests.training.test_megatron_lm_pretrain import baseline, flags  # noqa: F401
from tests.training.test_megatron_lm_pretrain import train as megatron_lm_train

pytestmark = [needs_megatron_lm, pytest.mark.timeout(300)]

_MEGATRON_LM_ONLY = {"--log-throughput", "--no-gradient-accumulation-fusion",
                     "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
                     "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm"}


def lean_train(tmp_path, name, data, *extra):
    """The lean trainer on 4 gloo ranks with the Megatron-LM test's flags -> {iteration: loss}."""
    metrics = tmp_path / f"{name}.jsonl"
    argv = [f for f in flags(data, str(metrics), *extra) if f not in _MEGATRON_LM_ONLY]
    run_ranks(train_rank, 4, argv, timeout=240, daemon=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "kind" not in r}


def test_lean_checkpoint_continues_in_megatron_lm(short_docs_data, tmp_path):
    reference = lean_train(tmp_path, "lean", short_docs_data)
    ckpt = str(tmp_path / "ckpt")
    first = lean_train(tmp_path, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                       ckpt, "--exit-interval", "2")
    assert sorted(first) == [1, 2]
    resumed, log = megatron_lm_train(tmp_path, "load", short_docs_data, "--context-parallel-size",
                                     "2", "--load", ckpt, "--ckpt-format", "torch_dist")
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def test_megatron_lm_checkpoint_continues_in_lean(baseline, short_docs_data, tmp_path):  # noqa: F811
    reference, _ = baseline
    ckpt = str(tmp_path / "ckpt")
    megatron_lm_train(tmp_path, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                      ckpt, "--save-interval", "2", "--exit-interval", "2", "--ckpt-format",
                      "torch_dist")
    resumed = lean_train(tmp_path, "load", short_docs_data, "--context-parallel-size", "2",
                         "--load", ckpt)
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration
