#!/usr/bin/env python3
"""What planning costs: host time per micro-batch, and how long a training step waits for it.

    python tools/bench_plan.py [--repeats 5] [--skip-trainer] [--trainer-seq 16384]

Part 1 (host arithmetic, one process): for 32k tokens / CP 4, 128k / CP 8, 512k / CP 32,
1M / CP 64 and 1M / CP 128 (plus hybrid u=8 at 1M / CP 64), on three kinds of rows
  web   lognormal document lengths, median 600, sigma 1.0
  one   the whole row one document (no EoD)
  tiny  documents of 1-7 tokens
  ones  one-token documents (b*s documents)
prints, per micro-batch, the time of `plan_context_parallel` and of what a rank pays in all
(the plan, its token index and its own schedule): median and worst of --repeats runs after
one untimed warm-up (a process's very first plan of a size pays first-touch memory, up to 2x),
and the plan's balance against the bound it promises (cost.balance_bound).

Part 2: a short CPU training run of a tiny GPT (4 gloo ranks under torchrun, CP 4 ring,
--trainer-seq tokens per row, 4 micro-batches per iteration) with planning one micro-batch
ahead (the default) and with --no-plan-ahead: the time the steps waited for plans per
iteration (`plan_wait_ms` of --metrics-file) beside the iteration time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_eod import plan_context_parallel  # noqa: E402

CONFIGS = [(1 << 15, 4, "ring", None), (1 << 17, 8, "ring", None), (1 << 19, 32, "ring", None),
           (1 << 20, 64, "ring", None), (1 << 20, 128, "ring", None),
           (1 << 20, 64, "hybrid", 8)]


def row(kind: str, n: int, rng) -> np.ndarray:
    if kind == "one":
        return np.array([0, n])
    if kind == "ones":
        return np.arange(n + 1)
    if kind == "web":
        lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, n // 100 + 10)).astype(int)
    else:
        lengths = rng.integers(1, 8, n)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    return np.concatenate([cu[cu < n], [n]])


def bench_host(repeats: int) -> None:
    print("| tokens / CP | algo | row | documents | plan ms (median / worst) | rank's total "
          "ms (median / worst) | balance | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for n, cp, algo, u in CONFIGS:
        for kind in ("web", "one", "tiny", "ones"):
            plan_ms, total_ms = [], []
            plan_context_parallel(row(kind, n, np.random.default_rng(repeats)), cp, algo,
                                  u).schedule(0)  # warm-up, not timed (first-touch memory)
            for seed in range(repeats):
                cu = torch.from_numpy(row(kind, n, np.random.default_rng(seed)))
                rank = cp // 2
                start = time.perf_counter()
                plan = plan_context_parallel(cu, cp, algo, u)
                planned = time.perf_counter()
                plan.token_index(rank)
                plan.schedule(rank)
                done = time.perf_counter()
                plan_ms.append((planned - start) * 1e3)
                total_ms.append((done - start) * 1e3)
            stats = plan.stats()
            if stats["balance"] > stats["balance_limit"]:
                raise SystemExit(f"balance {stats['balance']:.4f} exceeds the bound "
                                 f"{stats['balance_limit']:.4f} ({n} tokens, CP {cp}, {kind})")
            name = f"{algo}" + (f" u={u}" if u else "")
            print(f"| {n >> 10}k / {cp} | {name} | {kind} | {cu.numel() - 1} | "
                  f"{np.median(plan_ms):.1f} / {max(plan_ms):.1f} | "
                  f"{np.median(total_ms):.1f} / {max(total_ms):.1f} | "
                  f"{stats['balance']:.4f} | {stats['balance_limit']:.4f} |")


def _dataset(work: str) -> str:
    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.sample_corpus import write_sample_corpus
    from megatron_eod.data.tokenizers import ByteTokenizer

    corpus = os.path.join(work, "stdlib.jsonl")
    write_sample_corpus(corpus, max_bytes=3_000_000, seed=1234)
    preprocess_jsonl(corpus, os.path.join(work, "stdlib"), ByteTokenizer(), append_eod=True,
                     log=lambda msg: None)
    return os.path.join(work, "stdlib_text_document")


def _train(work: str, data: str, seq: int, iters: int, *extra: str):
    metrics = os.path.join(work, f"metrics{'_'.join(extra)}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # --metrics-file appends
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
           "--nproc-per-node", "4", os.path.join(ROOT, "pretrain_gpt.py"),
           "--position-embedding-type", "rope", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--distributed-backend", "gloo",
           "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
           "--num-workers", "0", "--seq-length", str(seq), "--max-position-embeddings", str(seq),
           "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(iters),
           "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--data-path", data, "--split", "100,0,0", "--eval-iters", "0", "--data-cache-path",
           os.path.join(work, "cache"), "--reset-attention-mask", "--reset-position-ids",
           "--eod-mask-loss", "--context-parallel-size", "4", "--context-parallel-algo", "ring",
           "--log-interval", "1000", "--metrics-file", metrics, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"training failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if '"plan_wait_ms"' in line]
    return records


def bench_trainer(seq: int, iters: int) -> None:
    print(f"\nShort CPU training run: tiny GPT, 4 gloo ranks, CP 4 ring, {seq} tokens per row, "
          f"4 micro-batches per iteration, {iters} iterations (the first, whose first "
          f"micro-batch cannot be planned ahead, shown apart)")
    print("| planning | iteration 1: plan wait ms | later iterations: plan wait ms per "
          "iteration (mean) | iteration ms (mean) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        data = _dataset(work)
        for name, extra in (("one micro-batch ahead (default)", ()),
                            ("in the step (--no-plan-ahead)", ("--no-plan-ahead",))):
            records = _train(work, data, seq, iters, *extra)
            later = records[1:]
            print(f"| {name} | {records[0]['plan_wait_ms']:.2f} | "
                  f"{np.mean([r['plan_wait_ms'] for r in later]):.3f} | "
                  f"{np.mean([r['iteration_ms'] for r in later]):.0f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="random rows per configuration")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--trainer-seq", type=int, default=16384)
    p.add_argument("--trainer-iters", type=int, default=6)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.trainer_seq < 4 or args.trainer_seq % 4:
        p.error(f"--trainer-seq must be a positive multiple of 4, got {args.trainer_seq}")
    if args.trainer_iters < 2:
        p.error(f"--trainer-iters must be >= 2, got {args.trainer_iters}")
    bench_host(args.repeats)
    if not args.skip_trainer:
        bench_trainer(args.trainer_seq, args.trainer_iters)


if __name__ == "__main__":
    main()
