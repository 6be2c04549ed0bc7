#!/usr/bin/env python3
"""Context-parallel layouts side by side, and a CPU wall-clock run of the three algorithms.

    python tools/bench_cp.py [--samples 16] [--skip-wallclock] [--wall-tokens 4096]

Part 1 (no communication, pure host arithmetic): for two document-length mixes,
  stdlib  the offline sample corpus (Python stdlib text, byte tokens + EoD) packed into rows
          the way megatron-core's GPTDataset does (documents cut at row edges),
  web     lognormal lengths, median 600 tokens, sigma 1.0,
at 32k tokens over CP 4 and 128k tokens over CP 8 (one row per batch, `--samples` random
batches), prints for our plan (ring; hybrid with Ulysses degree 2) and the layouts others use:
  contiguous   the row cut in cp equal pieces, document-aware ring (computes only same-document
               pairs; the fair version of a plain split)
  zigzag       Megatron's global zigzag: 2*cp chunks, rank r holds r and 2cp-1-r, doc-aware
  doc-zigzag   every document padded to a multiple of 2*cp and zigzagged over all ranks
               (TransformerEngine THD / the Ascend extension)
  dense-ring   zigzag ring computing full blocks under a dense mask
the balance (max/mean causal pairs per rank, mean and worst over samples; ours is asserted
within `cost.balance_bound`, 1% plus a granularity term, and the run stops if not), wasted pairs
(computed / needed by a document mask), busiest-rank key/value tokens received per layer over
a plain ring's (cp-1)/cp of the row, and padding tokens.

Part 2: ring, ulysses, hybrid (2x2) and one process over the whole batch, on 4 forked gloo
ranks, forward+backward of one attention layer, float32, same batch; wall-clock seconds.
"""

import argparse
import functools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.plan.cost import (doc_pairs, kv_tokens_received_per_rank,  # noqa: E402
                                    pairs_per_rank)

CONFIGS = [(32768, 4), (131072, 8)]


@functools.cache
def stdlib_lengths():
    """The token count (bytes + EoD) of each document of the sample corpus: read once per
    process (writing the corpus takes seconds), read-only."""
    from megatron_eod.data.sample_corpus import write_sample_corpus

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        write_sample_corpus(path)
        with open(path, encoding="utf-8") as f:
            lengths = np.array([len(json.loads(line)["text"].encode()) + 1 for line in f])
    lengths.flags.writeable = False
    return lengths


def pack_rows(lengths, n, rng):
    """One row of n tokens cut from the documents laid end to end (GPTDataset-style)."""
    order = rng.permutation(lengths.size)
    cum = np.concatenate([[0], np.cumsum(lengths[order])])
    while cum[-1] < 2 * n:
        cum = np.concatenate([cum, cum[-1] + cum[1:]])
    start = rng.integers(0, cum[-1] - n)
    inner = cum[(cum > start) & (cum < start + n)] - start
    return np.concatenate([[0], inner, [n]])


def web_row(n, rng):
    lengths = np.maximum(1, rng.lognormal(math.log(600), 1.0, size=n // 100 + 10)).astype(int)
    return pack_rows(lengths, n, rng)


def capped_row(n, rng):
    """One row of n tokens whose documents are each at most n / 4 long, lengths uniform in
    [1, n / 4] (the last one cut): MagiAttention's benchmark setting ("varlen causal, documents
    at most a quarter of the sequence"); its own length sampler is not reproduced."""
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(rng.integers(1, n // 4 + 1)))
    lengths[-1] -= sum(lengths) - n
    return np.concatenate([[0], np.cumsum(lengths)])


def owners_contiguous(cu, cp):
    n = int(cu[-1])
    return np.arange(n) // (n // cp)


def owners_zigzag(cu, cp):
    n = int(cu[-1])
    chunk = np.arange(n) // (n // (2 * cp))
    return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)


def doc_zigzag_stats(cu, cp):
    """Per-document zigzag with padding: each padded document split into 2cp chunks."""
    lengths = np.diff(cu)
    padded = -(-lengths // (2 * cp)) * (2 * cp)
    pads = int((padded - lengths).sum())
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    padded_cu = np.concatenate([starts, [padded.sum()]])
    chunk = (np.arange(int(padded.sum())) - np.repeat(starts, padded)) // np.repeat(
        padded // (2 * cp), padded)
    owner = np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    pairs = pairs_per_rank(padded_cu, owner, cp)
    kv = kv_tokens_received_per_rank(padded_cu, owner, cp)
    return pairs, kv, pads


def layout_rows(cu, cp):
    n = int(cu[-1])
    needed = int(doc_pairs(np.diff(cu)).sum())
    rows = {}
    for name, algo, u in (("ours ring", "ring", None), ("ours hybrid u=2", "hybrid", 2)):
        stats = plan_context_parallel(torch.from_numpy(cu), cp, algo, u).stats()
        if stats["balance"] > stats["balance_limit"]:  # the planner's promise (cost.py)
            raise SystemExit(f"{name}: balance {stats['balance']:.4f} exceeds the bound "
                             f"{stats['balance_limit']:.4f} ({n} tokens, CP {cp})")
        rows[name] = (np.array(stats["pairs_per_rank"]), np.array(
            stats["kv_tokens_received_per_rank"]), 0, sum(stats["pairs_per_rank"]) / (
            u or 1))
    for name, owner in (("contiguous", owners_contiguous(cu, cp)),
                        ("zigzag", owners_zigzag(cu, cp))):
        pairs = pairs_per_rank(cu, owner, cp)
        rows[name] = (pairs, kv_tokens_received_per_rank(cu, owner, cp), 0, pairs.sum())
    pairs, kv, pads = doc_zigzag_stats(cu, cp)
    rows["doc-zigzag (padded)"] = (pairs, kv, pads, pairs.sum())
    dense = np.full(cp, n * (n + 1) / 2 / cp)
    rows["dense-ring"] = (dense, np.full(cp, n * (cp - 1) // cp), 0, dense.sum())
    out = {}
    for name, (pairs, kv, pads, computed) in rows.items():
        out[name] = (pairs.max() / pairs.mean(), computed / needed,
                     kv.max() / ((cp - 1) / cp * n), pads)
    return out


def bench_layouts(samples, seed):
    mixes = {"stdlib": None, "web": None}
    std = stdlib_lengths()
    print(f"stdlib corpus: {std.size} documents, median {int(np.median(std))} tokens, "
          f"max {std.max()}")
    for mix in mixes:
        for n, cp in CONFIGS:
            rng = np.random.default_rng(seed)
            results = []
            for _ in range(samples):
                cu = pack_rows(std, n, rng) if mix == "stdlib" else web_row(n, rng)
                results.append(layout_rows(cu, cp))
            print(f"\n{mix} {n // 1024}k tokens / CP {cp} ({samples} batches)")
            print("| layout | balance mean | balance worst | wasted pairs | busiest kv / ring "
                  "| padding tokens |")
            print("|---|---|---|---|---|---|")
            for name in results[0]:
                vals = np.array([r[name] for r in results], dtype=float)
                print(f"| {name} | {vals[:, 0].mean():.3f} | {vals[:, 0].max():.3f} | "
                      f"{vals[:, 1].mean():.3f} | {vals[:, 2].mean():.3f} | "
                      f"{vals[:, 3].mean():.0f} |")


def _wall_rank(rank, world, store, n_tokens, algo, degree, conn):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megatron_eod import context_parallel_attention, create_hybrid_groups

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    rng = np.random.default_rng(0)
    cu = web_row(n_tokens, rng)
    plan = plan_context_parallel(torch.from_numpy(cu), world, algo, degree)
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    gen = torch.Generator().manual_seed(1)
    idx = plan.token_index(rank)
    q, k, v = (torch.randn(n_tokens, 8, 64, generator=gen)[idx].requires_grad_()
               for _ in range(3))
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        context_parallel_attention(q, k, v, plan).sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    conn.send(min(times))
    dist.destroy_process_group()


def bench_wallclock(n_tokens):
    from megatron_eod.attention.backends import CPUExactBackend

    print(f"\nCPU wall clock, one attention layer forward+backward, {n_tokens} tokens (web mix), "
          f"8 heads x 64, float32, 4 gloo ranks, best of 3")
    ctx = multiprocessing.get_context("fork")
    for algo, degree in (("ring", None), ("ulysses", None), ("hybrid", 2)):
        with tempfile.TemporaryDirectory() as tmp:
            pipes, procs = [], []
            for rank in range(4):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_wall_rank, args=(rank, 4, os.path.join(tmp, "s"),
                                                         n_tokens, algo, degree, child))
                p.start()
                pipes.append(parent)
                procs.append(p)
            seconds = max(pipe.recv() for pipe in pipes)
            for p in procs:
                p.join()
        print(f"  {algo:8s} {seconds * 1e3:9.1f} ms")
    cu = torch.from_numpy(web_row(n_tokens, np.random.default_rng(0))).to(torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n_tokens, 8, 64, generator=gen) for _ in range(3))
    backend = CPUExactBackend()
    torch.set_num_threads(1)
    max_len = int((cu[1:] - cu[:-1]).max())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out, lse = backend.forward(q, k, v, cu, cu, max_len, max_len, True, 0.125)
        backend.backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, max_len, max_len,
                         True, 0.125)
        best = min(best, time.perf_counter() - start)
    print(f"  {'1 process':8s} {best * 1e3:9.1f} ms (the whole batch, 1 thread)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16, help="random batches per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-wallclock", action="store_true")
    p.add_argument("--wall-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    if args.wall_tokens < 4 or args.wall_tokens % 4:
        p.error(f"--wall-tokens must be a positive multiple of 4, got {args.wall_tokens}")
    bench_layouts(args.samples, args.seed)
    if not args.skip_wallclock:
        bench_wallclock(args.wall_tokens)


if __name__ == "__main__":
    main()
