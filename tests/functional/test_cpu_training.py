"""End-to-end CPU training of the tiny GPT (tiny_gpt.py): the losses do not depend on how the
work is split.

Each test forks gloo ranks and runs the real trainer (`pretrain`, megatron-core schedules,
DDP, our attention). float32; tolerance 1e-5 relative per iteration: CP changes only the
order of floating-point sums (attention partials merged by log-sum-exp, losses and
gradients summed over ranks), which over 10 Adam steps stays around 1e-6.
"""

import json
import math
import os

import pytest
import torch

from tests.functional.tiny_gpt import (ITERS, losses_of, megatron_lm_tiny_flags, tiny_flags,
                                      train_rank)
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import (import_megatron_lm, needs_megatron_lm,
                                                 null_tokenizer_vocab_size)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_cpu_losses.json")
TOL = 1e-5


def train(world, data, *extra, drop=()):
    """Per-iteration losses of the tiny config plus `extra` flags, minus `drop`."""
    # Not daemonic: megatron-core's torch_dist checkpoint writer starts processes.
    return losses_of(run_ranks(train_rank, world, tiny_flags(data, *extra, drop=drop),
                               timeout=200, daemon=False))


def assert_same(losses, reference, tol=TOL):
    assert len(losses) == len(reference) == ITERS
    for i, (a, b) in enumerate(zip(losses, reference)):
        assert a == pytest.approx(b, rel=tol), f"iteration {i + 1}: {a} != {b}"


@pytest.fixture(scope="module")
def cp1(short_docs_data):
    """The CP=1 reference of the parity tests, on short documents (conftest.short_docs_data:
    about 2 EoDs a row, so masks, position ids and the loss mask shape every loss)."""
    return train(1, short_docs_data)


def test_cp1_matches_golden_losses(tiny_data):
    """Golden per-iteration losses of the tiny config (as Megatron's functional tests keep;
    tests/functional/test_gpu_training.py compares its GPU runs with them). Regenerate with
    MEGATRON_EOD_UPDATE_GOLDEN=1 after an intended change."""
    cp1 = train(1, tiny_data)
    if os.environ.get("MEGATRON_EOD_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump({"lm_loss": cp1}, f, indent=1)
    with open(GOLDEN) as f:
        golden = json.load(f)["lm_loss"]
    assert_same(cp1, golden, tol=1e-4)  # across machines: thread counts change sum orders
    assert cp1[-1] < cp1[0] - 0.3  # and it learns


@pytest.mark.parametrize("flag,extra", [
    ("--reset-attention-mask", []), ("--eod-mask-loss", []),
    # With RoPE, position ids do not matter inside a document-masked attention (its angles are
    # relative); with learned absolute positions they do.
    ("--reset-position-ids", ["--position-embedding-type", "learned_absolute"])])
def test_the_parity_data_makes_each_eod_flag_matter(cp1, short_docs_data, flag, extra):
    """Without each EoD flag the same run gives other losses (measured: 1.2e-3, 1.7e-3 and
    6e-4 relative, against the parity tests' 1e-5): on this data a CP run that got a
    document's mask, loss mask or position ids wrong cannot match CP=1. (On tiny_data the
    first 10 iterations see no EoD: the three differences are 0.)"""
    reference = train(1, short_docs_data, *extra) if extra else cp1
    without = train(1, short_docs_data, *extra, drop=(flag,))
    assert max(abs(a - b) / b for a, b in zip(without, reference)) > 1e-4


def _megatron_lm_rank(rank, world, argv):
    import contextlib
    import io

    import pretrain_gpt

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain_gpt.main(["--trainer", "megatron-lm", *argv])


def test_every_data_source_trains_as_its_data_path_twin(cp1, short_docs_data, tmp_path):
    """The lean trainer reads Megatron's other data sources: --data-args-path (the blend in a
    file) trains exactly as --data-path, and so does --no-mmap-bin-files; a blend per split (--train-data-path ..., or the same
    in --per-split-data-args-path) trains on the whole train blend, as --split 100,0,0."""
    words = tmp_path / "blend.txt"
    words.write_text(short_docs_data + "\n")
    assert_same(train(1, short_docs_data, "--data-args-path", str(words),
                      drop=("--data-path",)), cp1)
    assert_same(train(1, short_docs_data, "--no-mmap-bin-files"), cp1)  # read, not mapped
    whole = train(1, short_docs_data, "--split", "100,0,0")
    assert_same(train(1, short_docs_data, "--train-data-path", short_docs_data, "--valid-data-path",
                      short_docs_data, drop=("--data-path", "--split")), whole)
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": short_docs_data, "valid": short_docs_data}))
    assert_same(train(1, short_docs_data, "--per-split-data-args-path", str(spec),
                      drop=("--data-path", "--split")), whole)


@needs_megatron_lm
def test_megatron_lm_trainer_trains_like_the_lean_trainer(cp1, short_docs_data, tmp_path):
    """Megatron-LM's own `pretrain()` with our providers trains the tiny GPT to the lean
    trainer's losses, on the short documents (so its masks, position ids and loss mask are
    the lean trainer's): same initialisation (--use-cpu-initialization, as the lean trainer
    always does without CUDA; Megatron-LM otherwise draws the weights from its model-parallel
    generator), data order, schedule and loss (measured: equal to 5e-8).
    tests/functional/test_gpu_training.py repeats it on a GPU."""
    import_megatron_lm()
    metrics = tmp_path / "megatron_lm.jsonl"
    argv = megatron_lm_tiny_flags(short_docs_data, null_tokenizer_vocab_size(256),
                                  "--metrics-file", str(metrics), "--distributed-backend", "gloo",
                                  "--eval-interval", "1000", "--use-cpu-initialization")
    run_ranks(_megatron_lm_rank, 1, argv, timeout=200, daemon=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert_same([r["lm_loss"] for r in records if "kind" not in r], cp1)
    # The LR each iteration ran at, as the lean trainer's --metrics-file has it (Megatron-LM's
    # log line has the one its step leaves for the next: 1e-3 at iteration 1).
    assert [r["lr"] for r in records if "kind" not in r] == tiny_lrs()


@needs_megatron_lm
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused forward on a CPU needs Triton's interpreter")
def test_megatron_lm_trainer_with_the_fused_forward(cp1, short_docs_data, tmp_path,
                                                   fused_calls):
    """Megatron-LM's `pretrain()` at CP=2 ring with --cp-fused-forward: both ranks' attention
    forward is the fused kernel, CP=1's losses."""
    import_megatron_lm()
    metrics = tmp_path / "megatron_lm.jsonl"
    argv = megatron_lm_tiny_flags(short_docs_data, null_tokenizer_vocab_size(256),
                                  "--metrics-file", str(metrics), "--distributed-backend", "gloo",
                                  "--eval-interval", "1000", "--use-cpu-initialization",
                                  "--context-parallel-size", "2", "--cp-fused-forward")
    run_ranks(_megatron_lm_rank, 2, argv, timeout=200, daemon=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert_same([r["lm_loss"] for r in records if "kind" not in r], cp1)
    assert len(fused_calls()) == 2


def tiny_lrs():
    """The tiny GPT's LR at each iteration: --lr 2e-3 warmed up over 2 iterations of 4 samples,
    then cosine to --min-lr 2e-4 at iteration 10 (megatron-core counts samples)."""
    def lr(samples):
        if samples <= 8:
            return 2e-3 * samples / 8
        return 2e-4 + 0.5 * (math.cos(math.pi * (samples - 8) / 32) + 1) * 1.8e-3
    return [pytest.approx(lr(4 * (i - 1)), rel=1e-9) for i in range(1, ITERS + 1)]


@pytest.mark.parametrize("world,algo", [
    (2, ["ring"]), (4, ["ring"]), (2, ["ulysses"]), (4, ["ulysses"]),
    (4, ["hybrid", "--ulysses-degree-in-cp", "2"]), (4, ["hybrid_cp_algo",
                                                         "--ulysses-degree-in-cp", "2"])],
    ids=["ring2", "ring4", "ulysses2", "ulysses4", "hybrid2x2", "ascend-hybrid2x2"])
def test_cp_losses_equal_cp1(cp1, short_docs_data, world, algo):
    losses = train(world, short_docs_data, "--context-parallel-size", str(world),
                   "--context-parallel-algo", *algo)
    assert_same(losses, cp1)


@pytest.fixture
def fused_calls(monkeypatch, tmp_path):
    """A file each rank's fused kernel launches append their process id to (the ranks are
    forked after the patch): shows the flag reached the attention."""
    from megatron_eod.attention import triton_forward

    from megatron_eod.attention import triton_backward

    log = tmp_path / "fused_calls"

    def counting(module, name):
        launch = getattr(module, name)

        def counted(*args, **kwargs):
            with open(log, "a") as f:
                f.write(f"{name}:{os.getpid()}\n")
            return launch(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    for module, name in ((triton_forward, "tile_forward"), (triton_backward, "tile_dq"),
                         (triton_backward, "tile_dkdv")):
        counting(module, name)

    def ranks(name="tile_forward"):
        """The processes that launched `name`."""
        lines = log.read_text().split() if log.exists() else []
        return {line.split(":")[1] for line in lines if line.startswith(name + ":")}
    return ranks


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused forward on a CPU needs Triton's interpreter")
@pytest.mark.parametrize("world,algo,backward", [
    (2, ["ring"], False), (2, ["ring"], True)], ids=["ring2", "ring2-backward"])
def test_fused_forward_trains_as_cp1(cp1, short_docs_data, world, algo, backward, fused_calls):
    """--cp-fused-forward (attention/triton_forward.py, through Triton's interpreter here),
    and --cp-fused-backward: every rank's attention forward (and backward) is the fused
    kernels, the losses those of CP=1."""
    losses = train(world, short_docs_data, "--context-parallel-size", str(world),
                   "--context-parallel-algo", *algo, "--cp-fused-forward",
                   *(["--cp-fused-backward"] if backward else []))
    assert_same(losses, cp1)
    assert len(fused_calls()) == world
    assert len(fused_calls("tile_dq")) == len(fused_calls("tile_dkdv")) == \
        (world if backward else 0)


def test_tp2_cp2_equals_cp1(cp1, short_docs_data):
    """CPU initialisation makes tensor-parallel weights TP-invariant; the vocabulary is padded
    to a multiple of divisible-by x TP, so halve divisible-by to keep 384 rows."""
    losses = train(4, short_docs_data, "--tensor-model-parallel-size", "2",
                   "--context-parallel-size", "2", "--sequence-parallel",
                   "--make-vocab-size-divisible-by", "64")
    assert_same(losses, cp1)


def test_planning_ahead_changes_nothing(short_docs_data):
    """Plans made one micro-batch ahead on a worker thread (the default) give exactly the
    losses of plans made in the step, with TP 2 (peers follow the source's streams through
    the header broadcast) and validation interleaved with training every 5 iterations."""
    flags = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
             "--make-vocab-size-divisible-by", "64"]
    assert train(4, short_docs_data, *flags) == train(4, short_docs_data, *flags, "--no-plan-ahead")


def test_tp2_with_empty_validation_and_test_splits_finishes(short_docs_data):
    """Only TP rank 0 reads data; every TP rank must agree to skip an empty split's
    evaluation (else the others wait in the TP broadcast for a batch that never comes)."""
    losses = train(2, short_docs_data, "--tensor-model-parallel-size", "2", "--split", "100,0,0")
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("granularity", [["full", "--recompute-method", "uniform"],
                                         ["selective"]])
def test_recompute_with_cp2_equals_cp1(cp1, short_docs_data, granularity):
    losses = train(2, short_docs_data, "--context-parallel-size", "2",
                   "--recompute-granularity", *granularity)
    assert_same(losses, cp1)


@pytest.fixture(scope="module")
def pp2(short_docs_data):
    """PP=2's curve: Megatron seeds each pipeline stage differently (seed + 100 * stage), so
    PP=2 starts from other weights than PP=1."""
    return train(2, short_docs_data, "--pipeline-model-parallel-size", "2")


def test_pp2_cp2_equals_pp2_cp1(pp2, short_docs_data):
    """CP must not change PP=2's curve."""
    losses = train(4, short_docs_data, "--pipeline-model-parallel-size", "2",
                   "--context-parallel-size", "2")
    assert_same(losses, pp2)


def _pipeline_ranks(rank, world, argv):
    from megatron.core import parallel_state as ps

    from megatron_eod.training.args import parse_args
    from megatron_eod.training.initialize import initialize, shutdown

    initialize(parse_args(argv, world_size=world))
    try:
        return torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    finally:
        shutdown()


def test_tp_pp_dp_mapping_places_stages_as_megatron_lm_does(pp2, short_docs_data):
    """--use-tp-pp-dp-mapping (Megatron-LM's CP functional configs "*_dp_last"): pipeline
    stages on neighbouring ranks, data-parallel replicas apart; it was refused as a CUDA-graph
    or communication-tuning flag. The curve is PP=2's at DP=2 either way."""
    flags = tiny_flags(short_docs_data, "--pipeline-model-parallel-size", "2")
    assert run_ranks(_pipeline_ranks, 4, flags)[0] == [0, 2]
    assert run_ranks(_pipeline_ranks, 4, flags + ["--use-tp-pp-dp-mapping"])[0] == [0, 1]
    assert_same(train(4, short_docs_data, "--pipeline-model-parallel-size", "2",
                      "--use-tp-pp-dp-mapping"), pp2)


def test_data_parallel_cp_equals_cp1(cp1, short_docs_data, tmp_path):
    """DP=2 x CP=2: each DP rank trains half of the global batch. Its --metrics-file holds
    one record per iteration with the reported losses, and validation records."""
    metrics = tmp_path / "metrics.jsonl"
    losses = train(4, short_docs_data, "--context-parallel-size", "2",
                   "--metrics-file", str(metrics))
    assert_same(losses, cp1)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_records = [r for r in records if "kind" not in r]
    assert [r["iteration"] for r in train_records] == list(range(1, ITERS + 1))
    assert [r["lm_loss"] for r in train_records] == losses
    for r in train_records:
        assert r["tokens"] == 4 * 128  # --global-batch-size x --seq-length
        assert r["tokens_per_s"] > 0 and r["attention_tflops"] > 0 and r["grad_norm"] > 0
    # Megatron's warmup: the first step runs at lr 0, then lr rises to --lr and decays.
    assert [r["lr"] for r in train_records] == tiny_lrs()
    # in the loop at 5 and 10, then at the end of training (the next batch), as Megatron-LM
    assert [r["iteration"] for r in records if r.get("kind") == "valid"] == [5, 10, 10]


def test_kill_and_resume_is_bit_identical(cp1, short_docs_data, tmp_path):
    save = str(tmp_path / "ckpt")
    first = train(2, short_docs_data, "--context-parallel-size", "2", "--save", save,
                  "--exit-interval", "4")
    assert len(first) == 4
    rest = train(2, short_docs_data, "--context-parallel-size", "2", "--load", save)
    full = train(2, short_docs_data, "--context-parallel-size", "2")
    assert first + rest == full  # exactly, not approximately
    assert_same(full, cp1)


def test_rope_variants_and_learned_positions_under_cp(short_docs_data):
    """The lean trainer builds through the same EoD wiring as Megatron-LM's providers:
    learned absolute positions with q/k layer norms, and interleaved, Llama-3-scaled RoPE,
    each at CP=4 hybrid 2x2 == CP=1 (that each layout is right is checked against stock
    megatron-core in tests/megatron/test_stock_equivalence.py)."""
    for extra in (["--position-embedding-type", "learned_absolute", "--qk-layernorm"],
                  ["--rotary-interleaved", "--use-rope-scaling", "--rotary-base", "500000"]):
        hybrid = ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid",
                  "--ulysses-degree-in-cp", "2"]
        assert_same(train(4, short_docs_data, *extra, *hybrid), train(1, short_docs_data, *extra))


def test_qk_layernorm_with_sequence_parallel_equals_tp1(short_docs_data):
    """q/k norms are torch norms that allow sequence parallelism (megatron-core's refuse it:
    the run stopped while building the model), their weight gradients summed over TP."""
    reference = train(1, short_docs_data, "--qk-layernorm")
    assert_same(train(4, short_docs_data, "--qk-layernorm", "--tensor-model-parallel-size", "2",
                      "--sequence-parallel", "--context-parallel-size", "2",
                      "--make-vocab-size-divisible-by", "64"), reference)
