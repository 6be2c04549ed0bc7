"""End-to-end CPU training of the tiny GPT (tests/training/runs.py) through Megatron-LM's REAL
`pretrain()` with our providers, on 4 gloo ranks: the losses do not depend on how the work is
split, and every EoD flag and model feature reaches the attention.

float32, dropout off; each iteration's own lm loss from --metrics-file (Megatron-LM's "lm loss"
log line averages over --log-interval, and its first line after a start averages two
iterations). Tolerance 1e-5 relative: CP changes only the order of floating-point sums
(attention partials merged by log-sum-exp, losses and gradients summed over ranks), which over
4 Adam steps stays around 1e-7. The data is conftest.short_docs_data (about 2 EoDs a row), on
which dropping any EoD flag moves the losses 60-170x the tolerance
(`test_the_parity_data_makes_each_eod_flag_matter`).
"""

import json
import math
import os

import pytest

from tests.functional.tiny_gpt import ITERS as GOLDEN_ITERS
from tests.functional.tiny_gpt import golden_flags
from tests.training.megatron_lm_checkout import import_megatron_lm, megatron_lm_knows
from tests.training.runs import (EVALUATE, ITERS, flags, metrics_records, run_ranks, train,
                                 train_rank)

pytestmark = pytest.mark.timeout(300)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_cpu_losses.json")
TOL = 1e-5


def assert_same(losses, reference, tol=TOL, iterations=None):
    iterations = iterations or sorted(reference)
    assert sorted(losses) == list(iterations), (sorted(losses), iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(reference[iteration], rel=tol), iteration


def test_cp1_matches_golden_losses(tiny_data, tmp_path):
    """Golden per-iteration losses of the golden tiny GPT on one rank (as Megatron's functional
    tests keep; test_gpu_training.py compares its GPU runs with them). Regenerate with
    MEGATRON_EOD_UPDATE_GOLDEN=1 after an intended change."""
    import_megatron_lm()
    metrics = tmp_path / "golden.jsonl"
    argv = golden_flags(tiny_data, "--metrics-file", str(metrics), "--distributed-backend",
                        "gloo")
    run_ranks(_quiet_rank, 1, argv, timeout=240, daemon=False)
    losses = [r["lm_loss"] for r in metrics_records(metrics) if "kind" not in r]
    if os.environ.get("MEGATRON_EOD_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump({"lm_loss": losses}, f, indent=1)
    with open(GOLDEN) as f:
        golden = json.load(f)["lm_loss"]
    assert len(losses) == len(golden) == GOLDEN_ITERS
    for i, (a, b) in enumerate(zip(losses, golden)):  # across machines: thread counts
        assert a == pytest.approx(b, rel=1e-4), f"iteration {i + 1}"  # change sum orders
    assert losses[-1] < losses[0] - 0.3  # and it learns


def _quiet_rank(rank, world, argv):
    import contextlib
    import io

    from tests.training.runs import _as_rank

    _as_rank(rank, world)
    import pretrain_gpt

    with contextlib.redirect_stdout(io.StringIO()):
        pretrain_gpt.main(list(argv))


@pytest.mark.parametrize("extra", [
    ["--context-parallel-size", "4", "--num-workers", "2"],  # and the data in loader workers
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
     "--hierarchical-context-parallel-sizes", "2", "2"],
    ["--context-parallel-size", "2", "--cp-ring-exchange", "batched-keep",
     "--deterministic-mode"],
], ids=["ring4", "ulysses4", "hybrid2x2", "cp2xdp2-keep-deterministic"])
def test_cp_matches_cp1(baseline, short_docs_data, tmp_path, extra, monkeypatch):
    """The losses, the end-of-run validation and test losses, and the attention work
    Megatron-LM's FLOPs count (the documents' sum of length^2, summed over the data-parallel
    replicas once each, whatever the CP layout)."""
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # --deterministic-mode asks for it before 0.19
    losses, log = train(tmp_path, "cp", short_docs_data, *extra, *EVALUATE)
    assert_same(losses, baseline[0])
    evaluations, expected = (json.loads(text.splitlines()[-1]) for text in (log, baseline[1]))
    assert set(evaluations) == set(expected) == {"valid", "test"}
    for kind in expected:
        assert evaluations[kind]["lm_loss"] == pytest.approx(expected[kind]["lm_loss"],
                                                             rel=TOL), kind
    assert _work(metrics_records(tmp_path / "cp.jsonl")) == _work(baseline[2])


def _work(records):
    return [r["seqlen_squared_sum"] for r in records if "kind" not in r]


@pytest.mark.parametrize("reference_flags,flags_", [
    (["--use-cpu-initialization", "--qk-layernorm"],
     ["--use-cpu-initialization", "--qk-layernorm", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--context-parallel-size", "2",
      "--make-vocab-size-divisible-by", "64"]),
    (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
     ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
      "--context-parallel-size", "2"]),
], ids=["tp2-sp-cp2-qk-layernorm", "pp2-cp2-mbs2"])
def test_tensor_and_pipeline_parallel_cp(short_docs_data, tmp_path, reference_flags, flags_):
    """TP x CP with sequence parallelism and q/k layer norms (torch norms that allow sequence
    parallelism, their weight gradients summed over TP) == TP=1 x CP=1, both initialised on
    the CPU, as one master weight split, so TP=2 holds the TP=1 model (the vocabulary, 257
    with the null tokenizer's EoD, is padded to a multiple of divisible-by x TP: halving
    divisible-by keeps 384 rows); PP x CP == PP x CP=1 (Megatron-LM seeds each pipeline stage
    apart, so PP=1 is another model). Megatron-LM's own schedule carries the packed EoD
    micro-batches between stages: at 2 sequences a micro-batch they are [2*s/cp, 1, h], not
    the [s/cp, 2, h] it shapes its buffers for unless told (`pack_stage_shapes`)."""
    reference, _ = train(tmp_path, "reference", short_docs_data, *reference_flags)
    losses, _ = train(tmp_path, "parallel", short_docs_data, *flags_)
    assert_same(losses, reference)


def test_rope_variants_and_recompute_under_cp(short_docs_data, tmp_path):
    """Interleaved RoPE with Llama-3 scaling and another base, at reset positions, reach the
    attention the same way at every CP layout: CP=4 hybrid 2x2 with full recompute (each
    layer's batch context read again in backward) == CP=1 with selective recompute (that each
    RoPE layout is right is checked against stock megatron-core in
    tests/megatron/test_stock_equivalence.py)."""
    rope = ["--rotary-interleaved", "--use-rope-scaling", "--rotary-base", "500000"]
    reference, _ = train(tmp_path, "cp1", short_docs_data, *rope,
                         "--recompute-granularity", "selective")
    losses, _ = train(tmp_path, "hybrid", short_docs_data, *rope, "--context-parallel-size",
                      "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                      "2", "2", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1")
    assert_same(losses, reference)


def test_learned_positions_and_qk_layernorm_under_cp(learned_cp1, short_docs_data, tmp_path):
    """Megatron-LM's default --position-embedding-type learned_absolute, looked up at reset
    positions, with q/k layer norms: CP=4 hybrid 2x2 (our spelling) == CP=1."""
    losses, _ = train(tmp_path, "hybrid", short_docs_data, "--position-embedding-type",
                      "learned_absolute", "--qk-layernorm", "--context-parallel-size", "4",
                      "--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2")
    assert_same(losses, learned_cp1[0])


@pytest.mark.parametrize("flag", ["--reset-attention-mask", "--eod-mask-loss",
                                  "--reset-position-ids"])
def test_the_parity_data_makes_each_eod_flag_matter(baseline, learned_cp1, short_docs_data,
                                                    tmp_path, flag):
    """Without each EoD flag the same run gives other losses (measured 6e-4 to 1.7e-3
    relative, against the parity tests' 1e-5): on this data a CP run that got a document's
    mask, loss mask or position ids wrong cannot match CP=1. With RoPE, position ids do not
    matter inside a document-masked attention (its angles are relative); with learned
    absolute positions they do."""
    learned = flag == "--reset-position-ids"
    extra = ["--position-embedding-type", "learned_absolute", "--qk-layernorm"] * learned
    reference = (learned_cp1 if learned else baseline)[0]
    without, _ = train(tmp_path, "without", short_docs_data, *extra, drop=(flag,))
    assert max(abs(without[i] - reference[i]) / reference[i] for i in reference) > 1e-4


def test_upstreams_inter_document_masking_under_cp(baseline, short_docs_data,
                                                  short_docs_without_eod, tmp_path):
    """Megatron-LM 0.19's --dataloader-inter-document-masking (upstream: CP=1 only, its issue
    6156) means what it means there: the dataset's document index cuts the documents, not
    EoD tokens, and positions restart at every document. On data whose documents end in an
    EoD it is the EoD reset (the baseline's losses, at CP=4 ring); on data with no EoD at all
    the documents still matter (other losses than the plain causal rows), and CP=4 hybrid
    (Ulysses within pairs, a ring across) gives CP=1's losses."""
    if not megatron_lm_knows("--dataloader-inter-document-masking"):
        pytest.skip("this Megatron-LM has no --dataloader-inter-document-masking (from 0.19)")
    masking = ("--dataloader-inter-document-masking",)
    eod_flags = ("--reset-attention-mask", "--reset-position-ids")
    with_eod, _ = train(tmp_path, "with_eod", short_docs_data, *masking,
                        "--context-parallel-size", "4", drop=eod_flags)
    assert_same(with_eod, baseline[0])
    data = short_docs_without_eod
    cp1, _ = train(tmp_path, "cp1", data, *masking, drop=eod_flags)
    hybrid, _ = train(tmp_path, "hybrid", data, *masking, "--context-parallel-size", "4",
                      "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
                      "2", drop=eod_flags)
    assert_same(hybrid, cp1)
    causal, _ = train(tmp_path, "causal", data, drop=eod_flags)
    assert max(abs(causal[i] - cp1[i]) / cp1[i] for i in cp1) > 1e-4


@pytest.fixture
def fused_calls(monkeypatch, tmp_path):
    """A file each rank's fused kernel launches append their process id to (the ranks are
    forked after the patch): shows the flags reached the attention."""
    from megatron_eod.attention import triton_backward, triton_forward

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

    def ranks(name):
        """The processes that launched `name`."""
        lines = log.read_text().split() if log.exists() else []
        return {line.split(":")[1] for line in lines if line.startswith(name + ":")}
    return ranks


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels on a CPU need Triton's interpreter")
def test_fused_kernels_train_as_cp1(short_docs_data, tmp_path, fused_calls):
    """--cp-fused-forward and --cp-fused-backward (attention/triton_forward.py and
    triton_backward.py, through Triton's interpreter here): every rank's attention forward and
    backward are the fused kernels, the loss that of CP=1 (one iteration of one-row
    micro-batches: the interpreter is slow)."""
    small = ("--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1")
    drop = ("--micro-batch-size", "--global-batch-size", "--train-iters")
    reference, _ = train(tmp_path, "cp1", short_docs_data, *small, drop=drop)
    losses, _ = train(tmp_path, "fused", short_docs_data, *small, "--context-parallel-size",
                      "2", "--cp-fused-forward", "--cp-fused-backward", drop=drop)
    assert_same(losses, reference)
    for kernel in ("tile_forward", "tile_dq", "tile_dkdv"):
        assert len(fused_calls(kernel)) == 4, kernel


def _noting_plan_threads(rank, world, argv, log):
    """train_rank, returning the threads this rank planned its micro-batches on."""
    import threading

    from megatron_eod.megatron import steps

    names, plan = set(), steps.EodGPTSteps._plan

    def noted(self, batch):
        names.add(threading.current_thread().name.split("_")[0])
        return plan(self, batch)

    steps.EodGPTSteps._plan = noted
    train_rank(rank, world, argv, log)
    return sorted(names)


def test_planning_ahead_changes_nothing(short_docs_data, tmp_path):
    """Plans made one micro-batch ahead on a worker thread (the default, under Megatron-LM's
    default --rerun-mode validate_results too: read beneath its wrapper) give exactly the
    losses of plans made in the step, with TP 2 (peers follow the source's streams through
    the header broadcast) and validation interleaved with training every 2 iterations."""
    import_megatron_lm()
    common = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
              "--make-vocab-size-divisible-by", "64", "--eval-interval", "2", *EVALUATE]
    runs = {}
    for name, extra in (("ahead", []), ("inline", ["--no-plan-ahead"])):
        threads = run_ranks(_noting_plan_threads, 4, flags(
            short_docs_data, tmp_path / f"{name}.jsonl", *common, *extra),
            str(tmp_path / f"{name}.log"), timeout=240, daemon=False)
        runs[name] = metrics_records(tmp_path / f"{name}.jsonl"), threads
    assert runs["ahead"][0] == [{**r, **{k: runs["ahead"][0][i][k] for k in r if k.endswith(
        ("_ms", "_per_s", "tflops_per_gpu"))}} for i, r in enumerate(runs["inline"][0])]
    assert runs["ahead"][1] == [["eod-plan"]] * 4  # every rank's plans on its worker thread
    assert runs["inline"][1] == [["MainThread"]] * 4


def _lrs():
    """The tiny GPT's LR at each iteration: 2e-3 decayed linearly over --lr-decay-iters 10 to
    megatron-core's min LR 0, no warmup (the LR the iteration ran at, not the one its step
    leaves for the next, which Megatron-LM's log line shows)."""
    return [pytest.approx(2e-3 * (1 - (i - 1) / 10), rel=1e-9) for i in range(1, ITERS + 1)]


def test_log_lines_and_metrics_records(baseline):
    """Megatron-LM's own log lines, and one --metrics-file record per iteration (its own loss,
    the LR it ran at, its tokens) and per end-of-run evaluation, whose losses are the ones
    Megatron-LM prints."""
    losses, log, _ = baseline
    assert "iteration        4/       4" in log
    assert "lm loss:" in log and "throughput per GPU (TFLOP/s/GPU)" in log
    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"iteration')]
    assert records == []  # the records are in --metrics-file, not the log
    evaluations = json.loads(log.splitlines()[-1])
    assert set(evaluations) == {"valid", "test"}
    for kind, label in (("valid", "validation"), ("test", "test")):
        assert evaluations[kind]["iteration"] == ITERS
        assert f"lm loss value: {evaluations[kind]['lm_loss']:.6E}" in log.split(
            f"on {label} set")[1].splitlines()[0]


def test_metrics_records_hold_each_iteration(short_docs_data, tmp_path):
    losses, _ = train(tmp_path, "m", short_docs_data, "--context-parallel-size", "2")
    records = [r for r in metrics_records(tmp_path / "m.jsonl") if "kind" not in r]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert [r["lr"] for r in records] == _lrs()
    for r in records:
        assert r["lm_loss"] == losses[r["iteration"]] and math.isfinite(r["grad_norm"])
        assert r["tokens"] == 8 * 128 and r["tokens_per_s"] > 0  # global batch x seq length
        # the documents' attention (about 2 EoDs a row), under causal's 8 rows x 128^2
        assert 0 < r["seqlen_squared_sum"] < 8 * 128 * 128 and r["tflops_per_gpu"] > 0
    causal, _ = train(tmp_path, "causal", short_docs_data, "--context-parallel-size", "2",
                      "--train-iters", "1", drop=("--reset-attention-mask", "--train-iters"))
    (record,) = [r for r in metrics_records(tmp_path / "causal.jsonl") if "kind" not in r]
    assert record["seqlen_squared_sum"] == 8 * 128 * 128


def test_batch_ramp_up(short_docs_data, tmp_path):
    """--rampup-batch-size 4 4 16 to a global batch of 8 over 40 samples: 4 sequences an
    iteration until 16 are consumed, then 8 (megatron-core <= 0.17's own ramp; from 0.18,
    which ignores it, the same ramp as the step schedule the rules hand Megatron-LM); the
    metrics count each iteration's own batch."""
    losses, _ = train(tmp_path, "ramp", short_docs_data, "--train-samples", "40",
                      "--micro-batch-size", "1", "--global-batch-size", "8",
                      "--rampup-batch-size", "4", "4", "16",
                      drop=("--train-iters", "--lr-decay-iters"))
    records = metrics_records(tmp_path / "ramp.jsonl")
    batches = [r["tokens"] // 128 for r in records if "kind" not in r]
    assert batches == [4, 4, 4, 4, 8, 8, 8] and len(losses) == 7


def test_the_overlapped_warmup_and_flush_train_as_the_default_schedule(short_docs_data,
                                                                      tmp_path):
    """--overlap-p2p-communication-warmup-flush (a Megatron-LM functional-test config: PP=4,
    two chunks, groups of 5 of 10 micro-batches) on gloo: megatron-core frees the warmup's
    last output twice while its send is pending, and drops the last forward send of a
    forward-only pass unwaited. The CPU stand-ins freed the memory the send still read (NaN
    losses, different each run) and let gloo cancel the dropped send (the next stage waited
    forever at the first evaluation)."""
    layout = ("--num-layers", "8", "--pipeline-model-parallel-size", "4",
              "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
              "--global-batch-size", "10", "--microbatch-group-size-per-virtual-pipeline-stage",
              "5", "--train-iters", "3", "--eval-interval", "2", *EVALUATE)
    records = []
    for name, extra in (("default", ()), ("flush", ("--overlap-p2p-communication-warmup-flush",))):
        train(tmp_path, name, short_docs_data, *layout, *extra,
              drop=("--num-layers", "--micro-batch-size", "--global-batch-size", "--train-iters",
                    "--eval-interval"))
        records.append([(r.get("kind"), r["iteration"], r["lm_loss"], r.get("grad_norm"))
                        for r in metrics_records(tmp_path / f"{name}.jsonl")])
    assert records[0] == records[1] and len(records[0]) == 3 + 3  # 2 validations and a test
    assert all(math.isfinite(loss) for _, _, loss, _ in records[0])
