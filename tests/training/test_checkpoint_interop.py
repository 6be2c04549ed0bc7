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
import shutil

import pytest
import torch

from tests.functional.tiny_gpt import train_rank
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import needs_megatron_lm
from tests.training.test_megatron_lm_pretrain import baseline, flags  # noqa: F401
from tests.training.test_megatron_lm_pretrain import train as megatron_lm_train

pytestmark = [needs_megatron_lm, pytest.mark.timeout(300)]

_MEGATRON_LM_ONLY = {"--log-throughput", "--no-gradient-accumulation-fusion",
                     "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
                     "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm"}


_MODEL = {"--num-layers": 1, "--hidden-size": 1, "--num-attention-heads": 1,
          "--num-query-groups": 1, "--group-query-attention": 0, "--max-position-embeddings": 1,
          "--position-embedding-type": 1}  # flag -> its number of values


def lean_train(tmp_path, name, data, *extra, model_flags=True):
    """The lean trainer on 4 gloo ranks with the Megatron-LM test's flags -> {iteration: loss};
    without `model_flags`, none of the flags that shape the model (--use-checkpoint-args)."""
    metrics = tmp_path / f"{name}.jsonl"
    argv = [f for f in flags(data, str(metrics), *extra) if f not in _MEGATRON_LM_ONLY]
    if not model_flags:
        kept, skip = [], 0
        for word in argv:
            if skip:
                skip -= 1
            elif word in _MODEL:
                skip = _MODEL[word]
            else:
                kept.append(word)
        argv = kept
    run_ranks(train_rank, 4, argv, timeout=240, daemon=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "kind" not in r}


def test_lean_checkpoint_continues_in_megatron_lm(short_docs_data, tmp_path):
    reference = lean_train(tmp_path, "lean", short_docs_data)
    ckpt = str(tmp_path / "ckpt")
    first = lean_train(tmp_path, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                       ckpt, "--exit-interval", "2")
    assert sorted(first) == [1, 2]
    resumed, _ = megatron_lm_train(tmp_path, "load", short_docs_data, "--context-parallel-size",
                                     "2", "--load", ckpt, "--ckpt-format", "torch_dist")
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


@pytest.fixture(scope="module")
def megatron_lm_ckpt(short_docs_data, tmp_path_factory):
    """Megatron-LM's trainer's torch_dist checkpoint at iteration 2 (CP=4)."""
    root = tmp_path_factory.mktemp("megatron_lm_ckpt")
    ckpt = str(root / "ckpt")
    megatron_lm_train(root, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                      ckpt, "--save-interval", "2", "--exit-interval", "2", "--ckpt-format",
                      "torch_dist")
    return ckpt


def test_megatron_lm_checkpoint_continues_in_lean(baseline, megatron_lm_ckpt, short_docs_data,  # noqa: F811
                                                  tmp_path):
    reference, _ = baseline
    ckpt = megatron_lm_ckpt
    resumed = lean_train(tmp_path, "load", short_docs_data, "--context-parallel-size", "2",
                         "--load", ckpt)
    # The same, the model's shape read from Megatron-LM's saved args (--use-checkpoint-args).
    taken = lean_train(tmp_path, "load_args", short_docs_data, "--context-parallel-size", "2",
                       "--load", ckpt, "--use-checkpoint-args", model_flags=False)
    assert sorted(resumed) == sorted(taken) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration
        assert taken[iteration] == resumed[iteration], iteration


def test_use_checkpoint_args_keeps_the_flags_attention_dropout(baseline, megatron_lm_ckpt,  # noqa: F811
                                                              short_docs_data, tmp_path):
    """A checkpoint trained without EoD attention has Megatron-LM's attention dropout, 0.1;
    --use-checkpoint-args makes it Megatron-LM's value whatever the flags say, and EoD
    attention has none: --attention-dropout 0 is kept over it (Megatron-LM's trainer refused
    the run, asking for the --attention-dropout 0 it had been given; the lean trainer keeps
    the flags' attention dropout too)."""
    reference, _ = baseline
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron_lm_ckpt, ckpt)
    common = ckpt / "iter_0000002" / "common.pt"
    if not common.exists():  # (the flags' rule is ours, the same at every version)
        pytest.skip("this megatron-core keeps the saved args inside the .distcp files")
    state = torch.load(common, weights_only=False)
    state["args"].attention_dropout = 0.1
    torch.save(state, common)
    resumed, _ = megatron_lm_train(tmp_path, "load", short_docs_data,
                                   "--context-parallel-size", "2", "--load", str(ckpt),
                                   "--ckpt-format", "torch_dist", "--use-checkpoint-args")
    setup = (tmp_path / "load.log.rank0").read_text()  # rank 0 says it
    assert "--attention-dropout 0 kept over the checkpoint's 0.1 (--use-checkpoint-args)" in setup
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration
    taken = lean_train(tmp_path, "lean", short_docs_data, "--context-parallel-size", "2",
                       "--load", str(ckpt), "--use-checkpoint-args", model_flags=False)
    assert taken == pytest.approx(resumed, rel=1e-5)


def test_lean_virtual_pipeline_checkpoint_continues_in_megatron_lm(short_docs_data, tmp_path):
    """Virtual pipeline stages (the state's "model0", "model1", with the distributed
    optimizer's state over both chunks): the lean trainer's checkpoint continues in
    Megatron-LM's trainer at the same layout as in the lean trainer itself."""
    layout = ("--num-layers", "4", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--ckpt-format", "torch_dist")
    ckpt = str(tmp_path / "ckpt")
    lean = lean_train(tmp_path, "save", short_docs_data, *layout, "--save", ckpt,
                      "--save-interval", "2")  # at 2, then 4
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("2")  # resume from 2 (iteration 4's save is the run's last)
    resumed, _ = megatron_lm_train(tmp_path, "load", short_docs_data, *layout, "--load", ckpt)
    assert sorted(lean) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(lean[iteration], rel=1e-5), iteration
