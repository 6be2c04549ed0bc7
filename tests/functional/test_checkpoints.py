"""Checkpoints through Megatron-LM's REAL `pretrain()` with our providers, on 4 gloo ranks
(tests/training/runs.py): a run saved and resumed, at the same layout or another, continues
the uninterrupted run's losses; what goes wrong around a save or a resume is one line.

Tolerance 1e-5 relative where the layout changes (another order of sums), none (bitwise)
where it does not.
"""

import os

import pytest

from tests.training.runs import EVALUATE, ITERS, flags, metrics_records, run_ranks, start, train

pytestmark = pytest.mark.timeout(300)


def _close(losses, reference, iterations):
    assert sorted(losses) == list(iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def test_torch_dist_checkpoint_resumes_at_another_layout(baseline, short_docs_data, tmp_path):
    """Saved at CP=4, resumed at CP=2 x DP=2: the uninterrupted CP=1 x DP=4 losses."""
    reference = baseline[0]
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                     ckpt, "--save-interval", "2", "--exit-interval", "2")
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002"))
    resumed, _ = train(tmp_path, "load", short_docs_data, "--context-parallel-size", "2", "--load",
                       ckpt)
    _close(first, reference, [1, 2])
    _close(resumed, reference, [3, 4])


_PP2_CHECKPOINT_FLAGS = ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
                         "--dist-ckpt-optim-fully-reshardable"]


@pytest.fixture(scope="module")
def plain_pp2_checkpoint(short_docs_data, tmp_path_factory):
    """A plain PP=2 x CP=1 run at micro-batch 1, 5 layers split 3 + 2, saved at iteration 2:
    its losses and the checkpoint directory."""
    tmp_path = tmp_path_factory.mktemp("pp2")
    ckpt = str(tmp_path / "ckpt")
    losses, _ = train(tmp_path, "pp2", short_docs_data, *_PP2_CHECKPOINT_FLAGS,
                      "--micro-batch-size", "1", "--pipeline-model-parallel-layout", "Ettt|ttL",
                      "--save", ckpt, "--save-interval", "2")
    assert sorted(losses) == list(range(1, ITERS + 1))
    work = {r["iteration"]: r["seqlen_squared_sum"]
            for r in metrics_records(tmp_path / "pp2.jsonl") if "kind" not in r}
    return losses, ckpt, work


@pytest.mark.parametrize("extra", [
    ["--pipeline-model-parallel-layout", "Ett|t|t|tL", "--micro-batch-size", "1"],
    ["--pipeline-model-parallel-layout", "Ett|t|t|tL", "--context-parallel-size", "2",
     "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1", "--rerun-mode", "disabled", "--num-workers", "2"],
    ["--decoder-first-pipeline-num-layers", "1", "--context-parallel-size", "2"],
], ids=["vpp-cp1-mbs1", "vpp-cp2-mbs2-recompute-planahead", "uneven-first1-cp2"])
def test_other_pipeline_stages_continue_a_plain_pipeline_run(short_docs_data, tmp_path_factory,
                                                            plain_pp2_checkpoint, extra):
    """Virtual pipeline stages (Megatron-LM's interleaved schedule with overlapped p2p: each
    model chunk reads its own data iterator and keeps its own batch contexts, several
    micro-batches in flight), PP=2 x 2 chunks of an uneven layout, and uneven stages of
    1 + 4 layers, continue a torch_dist checkpoint of a plain PP=2 x CP=1 run at micro-batch
    1 (1F1B) on that run's own losses: at CP=1, micro-batch 1 (where gloo used to send freed
    stage outputs: cpu_compat), and at CP=2 with 2 sequences a micro-batch, full recompute
    (each chunk's contexts read again in backward, micro-batches later) and plans made one
    micro-batch ahead (each chunk's iterator a stream of its own, read by Megatron-LM's
    loader workers). A checkpoint, because Megatron-LM seeds each pipeline stage apart and
    chunks hold other layers: the layouts would not start from one model."""
    reference, ckpt, _ = plain_pp2_checkpoint
    tmp_path = tmp_path_factory.mktemp("stages")
    resumed, _ = train(tmp_path, "stages", short_docs_data, *_PP2_CHECKPOINT_FLAGS, "--load",
                       ckpt, "--ckpt-step", "2", *extra)
    if "--pipeline-model-parallel-layout" in extra:
        setup = (tmp_path / "stages.log.rank0").read_text()
        assert "Number of virtual stages per pipeline stage: 2" in setup
    _close(resumed, reference, [3, 4])
    work = [r["seqlen_squared_sum"] for r in metrics_records(tmp_path / "stages.jsonl")
            if "kind" not in r]  # each micro-batch counted once, not once per model chunk
    assert work == [plain_pp2_checkpoint[2][i] for i in (3, 4)]


def test_save_at_the_end_and_another_lr_on_resume(short_docs_data, tmp_path):
    """--save without --save-interval saves the last iteration (Megatron-LM asserted an
    interval, bare); resuming with another --lr is refused by name without a scheduler flag
    (megatron-core's traceback on every rank) and follows the new --lr with
    --override-opt_param-scheduler (Megatron-LM said "overriding learning rate value to
    0.001" and trained on at the checkpoint's 2e-3: the loaded optimizer groups carry it)."""
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "save", short_docs_data, "--save", ckpt)
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    resume = ("--load", ckpt, "--train-iters", "6", "--lr", "1e-3")
    results = run_ranks(start, 4, flags(short_docs_data, tmp_path / "m.jsonl", *resume),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [2] * 4, results
    for _, text in results:
        assert "pretrain_gpt.py: error: --load " in text and "Traceback" not in text, text
        assert "--lr: 0.001 here, 0.002 in the checkpoint; pass --override-opt_param-scheduler" \
            in text

    def resumed_lrs(choice):
        train(tmp_path, choice, short_docs_data, *resume, choice, drop=("--train-iters", "--lr"))
        return {r["iteration"]: r["lr"] for r in metrics_records(tmp_path / f"{choice}.jsonl")
                if "kind" not in r}

    # The LRs iterations 5 and 6 ran at: linear decay over --lr-decay-iters 10 from the new
    # --lr (the checkpoint's 2e-3 gives 1.2e-3, 1e-3).
    assert resumed_lrs("--override-opt_param-scheduler") == {5: pytest.approx(6e-4),
                                                             6: pytest.approx(5e-4)}
    assert resumed_lrs("--use-checkpoint-opt_param-scheduler") == {5: pytest.approx(1.2e-3),
                                                                   6: pytest.approx(1e-3)}
    # --skip-train: the evaluations of the loaded weights, recorded at the loaded iteration
    # (our --metrics-file said 0: no training_log came before them).
    losses, text = train(tmp_path, "skip", short_docs_data, "--load", ckpt, "--skip-train",
                         *EVALUATE)
    import json

    evaluations = json.loads(text.rsplit("\n", 1)[1])
    assert not losses and evaluations["valid"]["iteration"] == evaluations["test"]["iteration"] == 4


def test_decoupled_lr_resumes_on_its_own_schedule(short_docs_data, tmp_path):
    """--decoupled-lr (Megatron-LM's Llama-3 example script) with the distributed optimizer:
    megatron-core 0.16 pairs saved and current parameter groups without their learning
    rates, so the embedding/output group and the default one are the same to it and one's
    max/min LR was loaded into both. The resume loaded without a word and trained 0.9% off
    from its second iteration. Now each group gets its flags' values back after the load."""
    decoupled = ("--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-4")
    reference, _ = train(tmp_path, "whole", short_docs_data, *decoupled)
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "first", short_docs_data, *decoupled, "--save", ckpt, "--save-interval", "2",
          "--exit-interval", "2")
    resumed, _ = train(tmp_path, "resumed", short_docs_data, *decoupled, "--load", ckpt)
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-6), iteration
    # another --decoupled-lr, which megatron-core's scheduler does not compare: refused by
    # name as another --lr is (it trained on at the new value without a word)
    other = ("--decoupled-lr", "4e-3", "--decoupled-min-lr", "1e-4", "--load", ckpt)
    results = run_ranks(start, 4, flags(short_docs_data, tmp_path / "o.jsonl", *other),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [2] * 4, results
    assert "max/min LR 0.004/0.0001 here, 0.005/0.0001 in the checkpoint" in results[0][1]


def test_a_resumed_run_with_dropout_is_the_uninterrupted_run(short_docs_data, tmp_path):
    """Hidden dropout 0.1, CP=2, validation every 2 iterations; saved at iteration 2 and
    resumed: the uninterrupted training and validation losses, bitwise. (On CPU the device
    generator is the CPU one, from which each of Megatron-LM's loaders drew its workers' seed
    when its iterator was made: after the RNG state was restored in a resumed run, shifting
    every later dropout mask; cpu_compat gives the loaders a generator of their own.)"""
    dropout = ("--hidden-dropout", "0.1", "--context-parallel-size", "2", "--eval-interval", "2",
               *EVALUATE)
    drop = ("--hidden-dropout", "--eval-interval")

    def run(name, *extra):
        train(tmp_path, name, short_docs_data, *dropout, *extra, drop=drop)
        records = metrics_records(tmp_path / f"{name}.jsonl")
        losses = {r["iteration"]: r["lm_loss"] for r in records if "kind" not in r}
        valid = {}  # the evaluation in the loop, the first at an iteration
        for r in records:
            if r.get("kind") == "valid":
                valid.setdefault(r["iteration"], r["lm_loss"])
        return losses, valid

    ckpt = str(tmp_path / "ckpt")
    whole, whole_valid = run("whole")
    first, first_valid = run("first", "--exit-interval", "2", "--save", ckpt)
    rest, rest_valid = run("rest", "--load", ckpt)
    assert sorted(first) == [1, 2] and sorted(rest) == [3, 4]
    assert {**first, **rest} == whole
    assert {**first_valid, **rest_valid} == whole_valid and sorted(whole_valid) == [2, 4]


def test_a_save_killed_midway_is_replaced_and_the_run_resumes(short_docs_data, tmp_path):
    """What a kill during a save leaves, a partial iteration folder (shards without the
    metadata written at its end) and the tracker's temporary file, does not stop the resume
    (from the previous whole checkpoint) and is replaced by that iteration's next save."""
    save = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "first", short_docs_data, "--context-parallel-size", "2", "--save",
                     save, "--exit-interval", "2")
    partial = os.path.join(save, "iter_0000004", "__0_0.distcp")
    os.makedirs(os.path.dirname(partial))
    for path in (partial, os.path.join(save, "latest_checkpointed_iteration.txt.tmp")):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
    rest, _ = train(tmp_path, "rest", short_docs_data, "--context-parallel-size", "2", "--load",
                    save, "--save", save)
    assert sorted(first) == [1, 2] and sorted(rest) == [3, 4]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"
    assert os.path.isfile(os.path.join(save, "iter_0000004", "metadata.json"))
    with open(partial, "rb") as f:
        assert f.read() != b"half a checkpoint"
