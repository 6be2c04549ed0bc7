"""Runs of Megatron-LM's REAL `pretrain()` with our providers, on forked gloo CPU ranks,
through pretrain_gpt.py: the tiny GPT every training test trains, and how they run it.

    train(tmp_path, name, data, *extra)   -> (losses by iteration, log text + evaluations)
    run_ranks(train_rank, world, argv, log)   each rank trains; the log of rank 0 and the last
    run_ranks(start, world, argv)         -> per rank (exit status, stderr)

The tiny GPT: 2 layers, hidden 64, 4 heads over 2 query groups, RoPE, sequence 128, micro-batch
2, global batch 8, ITERS iterations, no evaluation (EVALUATE turns it on), float32, dropout
off (dropout masks depend on which rank holds a token, so they would differ between CP
sizes), EoD reset on, the distributed
optimizer, the byte-level data's tokenizer (NullTokenizer at the --vocab-size that makes 256
its EoD on this megatron-core), Megatron-LM's fused kernels off (they need TransformerEngine
or Apex).
"""

import contextlib
import importlib
import io
import json
import os

from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm, null_tokenizer_vocab_size

__all__ = ["EVALUATE", "ITERS", "error_lines", "flags", "metrics_records", "relative",
           "run_ranks", "start", "start_each", "train", "train_rank"]

ITERS = 4

# Flags that turn on the evaluations `flags` leaves off: one validation and one test batch at
# the end (and every --eval-interval). They cost a fifth of a tiny-GPT run, so only the
# tests of evaluations (and the CP=1 baseline they compare with) pay for them.
EVALUATE = ("--eval-iters", "1")


def flags(data, metrics, *extra):
    """The tiny GPT's flags on `data`, writing `metrics` (None: no --metrics-file)."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--group-query-attention", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "2e-3",
            "--lr-decay-iters", "10", "--data-path", data, "--split", "90,8,2",
            "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(null_tokenizer_vocab_size(256)),  # byte data: EoD 256
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
            "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1",
            "--log-throughput", "--seed", "1234", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--position-embedding-type", "rope",
            "--distributed-backend", "gloo", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
            "--no-bias-gelu-fusion", "--no-masked-softmax-fusion",
            "--no-persist-layer-norm", "--use-distributed-optimizer",
            # Megatron-LM's loader reads in the rank's own process (its 2 worker processes,
            # forked from each rank, doubled the suite's training time).
            "--num-workers", "0", *(["--metrics-file", str(metrics)] if metrics else []),
            *extra]


def _as_rank(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))


def train_rank(rank, world, argv, log, entry="pretrain_gpt"):
    """One rank's training; Megatron-LM logs iterations on the last rank, its setup on rank 0:
    those two ranks' output goes to `log` and `log`.rank0. `entry`: pretrain_gpt or
    pretrain_hybrid."""
    _as_rank(rank, world)
    script = importlib.import_module(entry)

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            script.main(list(argv))
    except SystemExit as stop:  # --exit-interval: Megatron-LM's train() exits with 0
        if stop.code not in (0, None):
            raise
    if rank in (0, world - 1):
        with open(log if rank else f"{log}.rank0", "w") as f:
            f.write(out.getvalue())


def start(rank, world, argv):
    """One rank's run to its end: (exit status, what it wrote to stderr)."""
    _as_rank(rank, world)
    import pretrain_gpt

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.main(list(argv))
    except SystemExit as stop:
        return stop.code, err.getvalue()
    return 0, err.getvalue()


def start_each(rank, world, argvs):
    """`start` with each rank's own command line."""
    return start(rank, world, argvs[rank])


def error_lines(results):
    """Each rank's `pretrain_gpt.py: error:` lines, from `start`'s results."""
    return [[line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error:")]
            for _, text in results]


def relative(losses, reference):
    """The largest relative difference of `losses` from `reference`, over reference's keys
    (iterations, or (iteration, head))."""
    return max(abs(losses[i] - reference[i]) / abs(reference[i]) for i in reference)


def metrics_records(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


def train(tmp_path, name, data, *extra, drop=(), world=4, entry="pretrain_gpt"):
    """Train the tiny GPT on `world` ranks with `extra` flags (`drop`: flags of `flags` to
    leave out, with their values; `entry`: pretrain_gpt or pretrain_hybrid): (training
    losses by iteration, the last rank's log with the end-of-run evaluations' --metrics-file
    records as its last line)."""
    import_megatron_lm()
    metrics, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
    argv = flags(data, str(metrics), *extra)
    for flag in drop:
        at = argv.index(flag)
        del argv[at:at + (2 if at + 1 < len(argv) and not argv[at + 1].startswith("--")
                          else 1)]
    run_ranks(train_rank, world, argv, str(log), entry, timeout=240, daemon=False)
    records = metrics_records(metrics)
    losses = {r["iteration"]: r["lm_loss"] for r in records if "kind" not in r}
    evaluations = {r["kind"]: r for r in records if "kind" in r}
    return losses, log.read_text() + "\n" + json.dumps(evaluations)
