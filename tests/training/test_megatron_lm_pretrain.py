"""Megatron-LM's REAL `pretrain()` (core_v0.16.1, from ../shared/megatron-lm or
$MEGATRON_LM_PATH) with our providers, on 4 gloo CPU ranks, through pretrain_gpt.py's
`--trainer megatron-lm` path (training/megatron_lm_run.py), on short documents
(conftest.short_docs_data: about 2 EoDs a row, so every loss depends on the EoD masks).

What this shows: per-iteration lm loss (from --metrics-file, Megatron-LM's own loss of each
iteration) is the CP=1 x DP=4 loss at CP=4 ring (its data read by Megatron-LM's loader
worker processes; the other runs read in the rank's process), ulysses and hybrid 2x2 (spelled the
Megatron-LM way, --cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes) and at
CP=2 x DP=2 (with our --cp-ring-exchange batched-keep), all with the distributed optimizer,
dropout off, to 1e-5 relative; TP=2 x CP=2 with sequence parallelism is TP=1 and PP=2 x CP=2
is PP=2 x CP=1; a torch_dist checkpoint saved at CP=4 and loaded at CP=2 x DP=2 continues
with the uninterrupted losses, and one saved by plain PP=2 continues at PP=2 with virtual
pipeline stages x CP=2; Megatron-LM's own log lines (iteration, lm loss, throughput) are
printed.
"""

import contextlib
import io
import json
import os

import pytest

from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import (import_megatron_lm, megatron_lm_knows,
                                                 needs_megatron_lm, null_tokenizer_vocab_size)

pytestmark = [needs_megatron_lm, pytest.mark.timeout(300)]

ITERS = 4


def flags(data, metrics, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--group-query-attention", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "2e-3",
            "--lr-decay-iters", "10", "--data-path", data, "--split", "90,8,2",
            "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(null_tokenizer_vocab_size(256)),  # byte data: EoD 256
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
            "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1",
            "--log-throughput", "--seed", "1234", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--position-embedding-type", "rope",
            "--distributed-backend", "gloo", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
            "--no-bias-gelu-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
            "--no-persist-layer-norm", "--use-distributed-optimizer",
            # Megatron-LM's loader reads in the rank's own process (its 2 worker processes,
            # forked from each rank, doubled this file's time); ring4 turns them back on.
            "--num-workers", "0", "--metrics-file", metrics, *extra]


def _train(rank, world, argv, log):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import pretrain_gpt

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            pretrain_gpt.main(["--trainer", "megatron-lm", *argv])
    except SystemExit as stop:  # --exit-interval: Megatron-LM's train() exits with 0
        if stop.code not in (0, None):
            raise
    if rank in (0, world - 1):  # Megatron-LM logs iterations on the last, the setup on rank 0
        with open(log if rank else f"{log}.rank0", "w") as f:
            f.write(out.getvalue())


def train(tmp_path, name, data, *extra, drop_iters=False, drop=()):
    """`drop`: flags of `flags` to leave out, with their values."""
    import_megatron_lm()
    metrics, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
    argv = flags(data, str(metrics), *extra)
    if drop_iters:  # a sample-based run: no --train-iters / --lr-decay-iters
        drop = (*drop, "--train-iters", "--lr-decay-iters")
    for flag in drop:
        at = argv.index(flag)
        del argv[at:at + 2]
    run_ranks(_train, 4, argv, str(log), timeout=240, daemon=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = {r["iteration"]: r["lm_loss"] for r in records if "kind" not in r}
    evaluations = {r["kind"]: r for r in records if "kind" in r}
    return losses, log.read_text() + "\n" + json.dumps(evaluations)


@pytest.fixture(scope="module")
def baseline(short_docs_data, tmp_path_factory):
    """CP=1 x DP=4, uninterrupted."""
    return train(tmp_path_factory.mktemp("cp1"), "cp1", short_docs_data)


@pytest.mark.parametrize("extra", [
    ["--context-parallel-size", "4", "--num-workers", "2"],  # and the same data in workers
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
     "--hierarchical-context-parallel-sizes", "2", "2"],
    ["--context-parallel-size", "2", "--cp-ring-exchange", "batched-keep"],
], ids=["ring4", "ulysses4", "hybrid2x2", "cp2xdp2-keep"])
def test_cp_matches_cp1_under_megatron_lm(baseline, short_docs_data, tmp_path, extra):
    reference, _ = baseline
    losses, _ = train(tmp_path, "cp", short_docs_data, *extra)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), iteration


@pytest.mark.parametrize("reference_flags,flags", [
    (["--use-cpu-initialization"],
     ["--use-cpu-initialization", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--context-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]),
    (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
     ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
      "--context-parallel-size", "2"]),
], ids=["tp2-sp-cp2", "pp2-cp2-mbs2"])
def test_tensor_and_pipeline_parallel_cp_match_under_megatron_lm(short_docs_data, tmp_path,
                                                                  reference_flags, flags):
    """TP x CP with sequence parallelism == TP=1 x CP=1 (both initialised on the CPU, as one
    master weight split, so TP=2 holds the TP=1 model; the vocabulary, 257 with the null
    tokenizer's EoD, is padded to a multiple of divisible-by x TP, so halving divisible-by
    keeps 384 rows); PP x CP == PP x CP=1 (Megatron-LM seeds each pipeline stage apart, so
    PP=1 is another model). Megatron-LM's own schedule carries the packed EoD micro-batches
    between stages; at 2 sequences a micro-batch they are [2*s/cp, 1, h], not the
    [s/cp, 2, h] it shapes its buffers for unless told (`pack_stage_shapes`; per-token loss:
    the global batch's loss does not depend on how it is cut into micro-batches)."""
    reference, _ = train(tmp_path, "reference", short_docs_data, *reference_flags)
    losses, _ = train(tmp_path, "parallel", short_docs_data, *flags)
    assert sorted(losses) == sorted(reference) == list(range(1, ITERS + 1))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), iteration


def test_every_data_source_megatron_lm_reads(baseline, short_docs_data, tmp_path):
    """Megatron-LM's other data sources mean what they mean there (its own
    get_blend_and_blend_per_split): --data-args-path (the blend in a file) trains exactly as
    --data-path; a blend per split (--train/--valid/--test-data-path) trains on the whole
    train blend, as --data-path with --split 100,0,0 does, and evaluates on its own valid and
    test blends. Both were refused before; Megatron-LM's other dataset-builder flags were
    dropped."""
    reference, _ = baseline
    blend_file = tmp_path / "blend.txt"
    blend_file.write_text(f"{short_docs_data}\n")
    losses, _ = train(tmp_path, "args_file", short_docs_data, "--data-args-path", str(blend_file),
                      drop=("--data-path",))
    assert losses == pytest.approx(reference, rel=1e-6)
    whole, _ = train(tmp_path, "whole", short_docs_data, "--split", "100,0,0", "--eval-iters", "0")
    data = short_docs_data
    per_split, log = train(tmp_path, "per_split", data, "--train-data-path", data,
                           "--valid-data-path", data, "--test-data-path", data,
                           "--no-mmap-bin-files", drop=("--data-path", "--split"))
    assert sorted(per_split) == list(range(1, ITERS + 1))
    assert per_split == pytest.approx(whole, rel=1e-6)
    evaluations = json.loads(log.splitlines()[-1])
    assert set(evaluations) == {"valid", "test"}


def test_multiple_validation_sets(short_docs_data, tmp_path):
    """--multiple-validation-sets (with --full-validation, which Megatron-LM requires): a
    validation blend of two prefixes is evaluated as two sets, each whole, and
    --metrics-file records each set's loss (the same data twice here: equal losses)."""
    small = str(tmp_path / "small")  # whole validation sets: keep them to a few batches
    with open(small + ".jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"document {i}: " + "some text to validate on " * 8})
                    + "\n")
    preprocess_jsonl(small + ".jsonl", small, ByteTokenizer(), append_eod=True,
                     log=lambda message: None)
    small += "_text_document"
    losses, log = train(tmp_path, "multi", short_docs_data, "--train-data-path", short_docs_data,
                        "--valid-data-path", small, small, "--multiple-validation-sets",
                        "--full-validation", drop=("--data-path", "--split"))
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert "validation-0 loss at iteration 4" in log and "validation-1 loss at iteration 4" in log
    records = [json.loads(line) for line in (tmp_path / "multi.jsonl").read_text().splitlines()]
    sets = [r for r in records if r.get("kind") == "valid"]
    assert [(r["iteration"], r["set"]) for r in sets] == [(ITERS, 0), (ITERS, 1)]
    assert sets[0]["lm_loss"] == pytest.approx(sets[1]["lm_loss"], rel=1e-6)


def test_megatron_lm_log_lines(baseline):
    losses, log = baseline
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert "iteration        4/       4" in log
    assert "lm loss:" in log and "throughput per GPU (TFLOP/s/GPU)" in log
    evaluations = json.loads(log.splitlines()[-1])  # --metrics-file: the end-of-run evaluations
    assert set(evaluations) == {"valid", "test"}
    for kind, label in (("valid", "validation"), ("test", "test")):
        assert evaluations[kind]["iteration"] == ITERS
        assert f"lm loss value: {evaluations[kind]['lm_loss']:.6E}" in log.split(
            f"on {label} set")[1].splitlines()[0]


def test_torch_dist_checkpoint_resumes_at_another_layout(baseline, short_docs_data, tmp_path):
    reference, _ = baseline
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "save", short_docs_data, "--context-parallel-size", "4", "--save",
                     ckpt, "--save-interval", "2", "--exit-interval", "2", "--ckpt-format",
                     "torch_dist")
    assert sorted(first) == [1, 2]
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002"))
    resumed, _ = train(tmp_path, "load", short_docs_data, "--context-parallel-size", "2", "--load",
                       ckpt, "--ckpt-format", "torch_dist")
    assert sorted(resumed) == [3, 4]
    for iteration in (1, 2):
        assert first[iteration] == pytest.approx(reference[iteration], rel=1e-5)
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def test_megatron_lm_default_learned_positions_under_cp(short_docs_data, tmp_path):
    """Megatron-LM's default --position-embedding-type learned_absolute, looked up at reset
    positions, with q/k layer norms: CP=4 hybrid 2x2 == CP=1."""
    extra = ["--position-embedding-type", "learned_absolute", "--qk-layernorm"]
    reference, _ = train(tmp_path, "cp1_learned", short_docs_data, *extra)
    losses, _ = train(tmp_path, "hybrid_learned", short_docs_data, *extra,
                      "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                      "--hierarchical-context-parallel-sizes", "2", "2")
    assert sorted(losses) == sorted(reference) == list(range(1, ITERS + 1))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), iteration


@pytest.mark.parametrize("extra", [
    ["--micro-batch-size", "1"],
    ["--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
     "uniform", "--recompute-num-layers", "1", "--rerun-mode", "disabled",
     "--num-workers", "2"],
], ids=["cp1-mbs1", "cp2-mbs2-recompute-planahead"])
def test_virtual_pipeline_stages_continue_a_plain_pipeline_run(short_docs_data, tmp_path_factory,
                                                               plain_pp2_checkpoint, extra):
    """Virtual pipeline stages (Megatron-LM's interleaved schedule with overlapped p2p: each
    model chunk reads its own data iterator and keeps its own batch contexts, several
    micro-batches in flight), PP=2 x 2 chunks of an uneven layout, continue a torch_dist
    checkpoint of a plain PP=2 x CP=1 run at micro-batch 1 (1F1B) on that run's own losses:
    at CP=1, micro-batch 1 (where gloo used to send freed stage outputs: cpu_compat), and at
    CP=2 with 2 sequences a micro-batch, full recompute (each chunk's contexts read again in
    backward, micro-batches later) and plans made one micro-batch ahead (each chunk's
    iterator a stream of its own, read by Megatron-LM's loader workers). A checkpoint,
    because Megatron-LM seeds each pipeline stage apart and chunks hold other layers: the
    layouts would not start from one model."""
    reference, ckpt = plain_pp2_checkpoint
    tmp_path = tmp_path_factory.mktemp("vpp")
    resumed, _ = train(tmp_path, "vpp", short_docs_data, *_PP2_CHECKPOINT_FLAGS,
                       "--pipeline-model-parallel-layout", "Ett|t|t|tL", "--load", ckpt,
                       "--ckpt-step", "2", *extra)
    assert sorted(resumed) == [3, 4]
    setup = (tmp_path / "vpp.log.rank0").read_text()
    assert "Number of virtual stages per pipeline stage: 2" in setup
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def test_evaluation_in_micro_batches_of_its_own(short_docs_data, tmp_path):
    """Megatron-LM >= 0.18 reads validation and test data in --eval-micro-batch-size rows. At
    PP=2 x CP=2 (the stage tensors packed for the evaluation's rows, the plans made for them,
    TP-less peers told their size), evaluating 4 sequences a micro-batch gives the validation
    and test losses of evaluating 2, and training is untouched."""
    if not megatron_lm_knows("--eval-micro-batch-size"):
        pytest.skip("this Megatron-LM has no --eval-micro-batch-size (from 0.18)")
    common = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
              "--eval-iters", "2", "--rerun-mode", "disabled"]
    reference, reference_log = train(tmp_path, "eval2", short_docs_data, *common)
    losses, log = train(tmp_path, "eval4", short_docs_data, *common, "--eval-micro-batch-size", "4")
    assert losses == pytest.approx(reference, rel=1e-6)
    expected = json.loads(reference_log.splitlines()[-1])
    evaluations = json.loads(log.splitlines()[-1])
    assert set(evaluations) == set(expected) == {"valid", "test"}
    for kind in expected:
        assert evaluations[kind]["lm_loss"] == pytest.approx(expected[kind]["lm_loss"],
                                                             rel=1e-5), kind


def test_batch_ramp_up(short_docs_data, tmp_path):
    """--rampup-batch-size 4 4 16 to a global batch of 8 over 40 samples: 4 sequences an
    iteration until 16 are consumed, then 8 (megatron-core <= 0.17's own ramp; from 0.18,
    which ignores it, the same ramp as the step schedule the rules hand Megatron-LM); the
    metrics count each iteration's own batch."""
    losses, _ = train(tmp_path, "ramp", short_docs_data, "--train-samples", "40",
                      "--micro-batch-size", "1", "--global-batch-size", "8",
                      "--rampup-batch-size", "4", "4", "16", drop_iters=True)
    records = [json.loads(line) for line in (tmp_path / "ramp.jsonl").read_text().splitlines()]
    batches = [r["tokens"] // 128 for r in records if "kind" not in r]
    assert batches == [4, 4, 4, 4, 8, 8, 8] and len(losses) == 7


_PP2_CHECKPOINT_FLAGS = ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
                         "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"]


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
    return losses, ckpt


def _start(rank, world, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import pretrain_gpt

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.main(["--trainer", "megatron-lm", *argv])
    except SystemExit as stop:
        return stop.code, err.getvalue()
    return 0, err.getvalue()


def test_a_data_error_is_one_line_on_every_rank(short_docs_data, tmp_path):
    """The start-up data checks under Megatron-LM's trainer end the run as its flag errors do
    (exit 2, `pretrain_gpt.py: error:` on every rank), not with a traceback per rank."""
    import_megatron_lm()
    argv = flags(short_docs_data, str(tmp_path / "m.jsonl"))
    at = argv.index("--vocab-size")
    argv[at + 1] = "300"  # the data's EoD is 256
    results = run_ranks(_start, 2, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert "pretrain_gpt.py: error: " in text and "EoD id 256" in text, text[-2000:]
        assert "Traceback" not in text


def test_save_at_the_end_and_another_lr_on_resume(short_docs_data, tmp_path):
    """--save without --save-interval saves the last iteration, as the lean trainer does
    (Megatron-LM asserted an interval, bare); resuming with another --lr is refused by name
    without a scheduler flag (megatron-core's traceback on every rank) and follows the new
    --lr with --override-opt_param-scheduler (Megatron-LM said "overriding learning rate
    value to 0.001" and trained on at the checkpoint's 2e-3: the loaded optimizer groups
    carry it)."""
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "save", short_docs_data, "--save", ckpt)
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    resume = ("--load", ckpt, "--train-iters", "6", "--lr", "1e-3")
    results = run_ranks(_start, 4, flags(short_docs_data, str(tmp_path / "m.jsonl"), *resume),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [2] * 4, results
    for _, text in results:
        assert "pretrain_gpt.py: error: --load " in text and "Traceback" not in text, text
        assert "--lr: 0.001 here, 0.002 in the checkpoint; pass --override-opt_param-scheduler" \
            in text
    import_megatron_lm()

    def resumed_lrs(choice):
        metrics = tmp_path / f"{choice}.jsonl"
        run_ranks(_train, 4, flags(short_docs_data, str(metrics), *resume, choice),
                  str(tmp_path / f"{choice}.log"), timeout=240, daemon=False)
        return {r["iteration"]: r["lr"] for r in map(json.loads, metrics.read_text().splitlines())
                if "kind" not in r}

    # The LRs iterations 5 and 6 ran at: linear decay over --lr-decay-iters 10 from the new
    # --lr (the checkpoint's 2e-3 gives 1.2e-3, 1e-3).
    assert resumed_lrs("--override-opt_param-scheduler") == {5: pytest.approx(6e-4),
                                                             6: pytest.approx(5e-4)}
    assert resumed_lrs("--use-checkpoint-opt_param-scheduler") == {5: pytest.approx(1.2e-3),
                                                                   6: pytest.approx(1e-3)}
    # --skip-train: the evaluations of the loaded weights, recorded at the loaded iteration
    # (our --metrics-file said 0: no training_log came before them).
    losses, text = train(tmp_path, "skip", short_docs_data, "--load", ckpt, "--skip-train")
    evaluations = json.loads(text.rsplit("\n", 1)[1])
    assert not losses and evaluations["valid"]["iteration"] == evaluations["test"]["iteration"] == 4


def test_decoupled_lr_resumes_on_its_own_schedule(short_docs_data, tmp_path):
    """--decoupled-lr (Megatron-LM's Llama-3 example script) with the distributed optimizer:
    megatron-core 0.16 pairs saved and current parameter groups without their learning
    rates, so the embedding/output group and the default one are the same to it and one's
    max/min LR was loaded into both. The resume loaded without a word and trained 0.9% off
    from its second iteration (a helper's sweep of Megatron-LM's example scripts). Now each
    group gets its flags' values back after the load, as the flags say."""
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
    results = run_ranks(_start, 4, flags(short_docs_data, str(tmp_path / "o.jsonl"), *other),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [2] * 4, results
    assert "max/min LR 0.004/0.0001 here, 0.005/0.0001 in the checkpoint" in results[0][1]


def test_a_resumed_run_with_dropout_is_the_uninterrupted_run(short_docs_data, tmp_path):
    """Hidden dropout 0.1, saved at iteration 2 and resumed: the uninterrupted losses, bitwise.
    (On CPU the device generator is the CPU one, from which each of Megatron-LM's loaders drew
    its workers' seed when its iterator was made: after the RNG state was restored in a
    resumed run, shifting every later dropout mask; cpu_compat gives the loaders a generator
    of their own.)"""
    dropout = ("--hidden-dropout", "0.1", "--context-parallel-size", "2")
    whole, _ = train(tmp_path, "whole", short_docs_data, *dropout, drop=("--hidden-dropout",))
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "first", short_docs_data, *dropout, "--exit-interval", "2",
                     "--save", ckpt, drop=("--hidden-dropout",))
    rest, _ = train(tmp_path, "rest", short_docs_data, *dropout, "--load", ckpt,
                    drop=("--hidden-dropout",))
    assert sorted(first) == [1, 2] and sorted(rest) == [3, 4]
    assert {**first, **rest} == whole
