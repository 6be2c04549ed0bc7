#!/usr/bin/env python3
"""The attention kernel's dispatch: what the tail of a varlen call costs a layout (a model).

    python tools/dispatch_model.py [--samples 3] [--heads 32 --kv-heads 8] [--slots 264]

The tile model (tools/tile_model.py) counts the tiles a rank computes; it put ring's busiest
rank within 2-6% of the ideal, yet on an H100 the same work in ONE call ran 13-17% over
(docs/BENCHMARKS.md). This model adds how the kernel runs its tiles. FlashAttention-2 (and
PyTorch's copy of it) launches a varlen call as a grid of blocks (CTAs): forward, one per
(query block, sequence, head), in that order, the query block fastest; backward, one per
(key block, sequence, head). A CTA loops over its key (query) tiles; the longest sequence
sets the grid, so shorter sequences' surplus CTAs exit at once. The GPU hands CTAs out in
grid order, each to the first free slot (SMs x CTAs per SM). So a call lasts about its
work / slots PLUS the tail: the last head's CTAs start near the end, and a CTA over a long
key range (the last query blocks of a long document) runs far past the others. The whole
row's one call has cp times more work over the same longest CTAs, so its tail weighs cp
times less: that is the gap between a rank and the ideal that no tile count shows.

Calls on concurrent CUDA streams are modelled as one queue of CTAs in launch order: a later
call's CTAs fill the slots an earlier call's tail leaves idle (the executor option
`concurrent_calls` makes the batched ring do this; tools/bench_cp_gpu.py measures it), and
with the local call in its two parts (plan/local_split.py) around the received keys' call.

`DispatchModel` holds the parameters, in tiles of work: a CTA's fixed cost, a masked
(diagonal) tile's cost, an empty CTA's cost, and the slots (132 SMs x 2 CTAs at head dim 128
on an H100). They were not fitted: with the 2026-11-24 H100 table the predictions match the
measured one-call rows within ~0.05 for ring, hybrid and doc-zigzag whatever the first three
(0 / 1 / 0 up to 4 / 1.5 / 0.1), so the tail, not those costs, is what the model explains.
A model, not a measurement: the next GPU run checks it (docs/BENCHMARKS.md).

main() prints, for the mixes of tools/bench_cp_gpu.py (same rows, same seeds), the busiest
rank over the ideal in this model, forward / backward, for the layouts the bench times and
for our batched ring with its calls in sequence (the default executor), concurrent, and
concurrent with the local call split.
"""

import argparse
import heapq
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tile_model import TILES, plan_calls  # noqa: E402

__all__ = ["DispatchModel", "cta_costs", "makespan", "calls_time", "ideal_times",
           "dispatch_over_ideal", "split_calls"]


@dataclass(frozen=True)
class DispatchModel:
    slots: int = 264  # SMs x CTAs resident per SM (H100: 132 x 2 at head dim 128, bf16)
    cta_cost: float = 2.0  # a CTA's fixed work (loading its block, writing its result)
    masked_tile: float = 1.5  # a tile on the causal diagonal (masking) against a full one
    empty_cta: float = 0.05  # a CTA past its sequence's end, which exits at once


def _blocks(n, block):
    return -(-np.asarray(n, dtype=np.int64) // block)


def cta_costs(cu_seqlens_q, cu_seqlens_k, causal, heads, direction, model=DispatchModel()):
    """float64 [CTAs]: each CTA's work in grid order (block fastest, then sequence, then
    head) for one varlen call. Causal calls align the last query with the last key, as flash
    does (query i of lq sees keys < i + 1 + lk - lq)."""
    bq, bk = TILES[direction]
    lq = np.diff(np.asarray(cu_seqlens_q, dtype=np.int64))
    lk = np.diff(np.asarray(cu_seqlens_k, dtype=np.int64))
    if lq.size == 0 or lq.max() == 0:
        return np.zeros(0)
    forward = direction == "forward"
    grid = int(_blocks(lq.max() if forward else lk.max(), bq if forward else bk))
    per_head = np.full((lq.size, grid), model.empty_cta)
    for s in range(lq.size):
        if lq[s] == 0 or lk[s] == 0:
            continue
        if forward:  # CTA = query block m: its key tiles
            m = np.arange(int(_blocks(lq[s], bq)))
            if causal:
                shift = lk[s] - lq[s]
                last = np.clip(np.minimum(lq[s], (m + 1) * bq) + shift, 0, lk[s])
                first = np.clip(m * bq + 1 + shift, 0, lk[s])  # keys every row sees
                total, full = _blocks(last, bk), first // bk
            else:
                total = full = np.full(m.size, int(_blocks(lk[s], bk)))
        else:  # CTA = key block n: its query tiles
            n = np.arange(int(_blocks(lk[s], bk)))
            q_blocks = int(_blocks(lq[s], bq))
            if causal:
                shift = lk[s] - lq[s]
                first_row = np.maximum(n * bk - shift, 0)  # the first row seeing the block
                all_rows = np.clip(np.minimum(lk[s], (n + 1) * bk) - 1 - shift, 0, lq[s])
                total = np.where(first_row < lq[s], q_blocks - first_row // bq, 0)
                full = q_blocks - _blocks(all_rows, bq)
            else:
                total = full = np.full(n.size, q_blocks)
        cost = model.cta_cost + full + model.masked_tile * (total - full)
        per_head[s, :total.size] = np.where(total > 0, cost, model.empty_cta)
    return np.tile(per_head.ravel(), heads)


def makespan(costs, slots) -> float:
    """When the last CTA ends if each, in order, goes to the first free slot."""
    if len(costs) == 0:
        return 0.0
    free = [0.0] * min(slots, len(costs))
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def calls_time(calls, heads, direction, concurrent=False, model=DispatchModel()):
    """A rank's KernelCalls (in launch order) one after another on one stream, or on
    concurrent streams (one queue of CTAs)."""
    costs = [cta_costs(c.cu_seqlens_q.cpu().numpy(), c.cu_seqlens_k.cpu().numpy(), c.causal,
                       heads, direction, model) for c in calls]
    if concurrent:
        return makespan(np.concatenate(costs) if costs else [], model.slots)
    return sum(makespan(c, model.slots) for c in costs)


def ideal_times(cu, cp, heads, model=DispatchModel()):
    """{direction: the whole row's one causal call / cp}, modelled: the ideal a row's layouts
    are measured against (computed once per row; its grid is the largest)."""
    from megatron_eod.plan.kv_schedule import call_from_rows

    docs = [np.arange(a, b) for a, b in zip(cu[:-1], cu[1:])]
    whole = call_from_rows(docs, docs, causal=True)
    return {direction: calls_time([whole], heads, direction, model=model) / cp
            for direction in TILES}


def dispatch_over_ideal(calls_per_rank, ideal, heads, concurrent=False, model=DispatchModel()):
    """{direction: the busiest rank's modelled time / ideal[direction]} (`ideal_times`);
    calls_per_rank: [KernelCalls] per rank, each run over `heads` heads (a hybrid group's
    calls stand for each of its ranks: H/u heads)."""
    return {direction: max(calls_time(calls, heads, direction, concurrent, model)
                           for calls in calls_per_rank) / ideal[direction]
            for direction in TILES}


def split_calls(plan):
    """[KernelCalls per ring group] in the order the batched ring launches them with
    concurrent_calls where the local call splits (plan/local_split.py): its first part, the
    received keys' call, its other part."""
    from megatron_eod.attention.ring import BATCHED, executor_for

    out = []
    for schedule, calls in zip(plan.schedules, plan_calls(plan, "batched")):
        parts = schedule.local_parts
        if parts is None or executor_for(schedule, "batched") not in BATCHED:
            out.append(calls)  # one sequence, or the steps run (they ignore the parts)
        else:
            out.append([parts[0]] + calls[1:] + [parts[1]])
    return out


def layout_rows(cu, cp, heads, model=DispatchModel()):
    """{layout: {direction: ratio}} for one row: the bench's one-call layouts and our batched
    ring's calls in sequence and concurrent."""
    import torch
    from bench_cp_gpu import (contiguous_segments, doc_zigzag_segments, plan_segments,
                              prefix_calls)

    from megatron_eod import plan_context_parallel

    ideal = ideal_times(cu, cp, heads, model)
    rows = {}
    for name, algo, u in (("ours ring", "ring", None), ("ours hybrid u=2", "hybrid", 2)):
        plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, u)
        rank_heads = heads // (u or 1)
        calls = plan_calls(plan, "batched")
        rows[name] = dispatch_over_ideal(calls, ideal, rank_heads, model=model)
        rows[f"{name} (concurrent)"] = dispatch_over_ideal(calls, ideal, rank_heads, True,
                                                           model)
        rows[f"{name} (concurrent, split)"] = dispatch_over_ideal(split_calls(plan), ideal,
                                                                  rank_heads, True, model)
        one = [[c] for c in prefix_calls(cu, [plan_segments(plan, g, cu)
                                              for g in range(plan.ring_size)])]
        rows[f"{name} (one call)"] = dispatch_over_ideal(one, ideal, rank_heads, model=model)
    others = {"contiguous": contiguous_segments(cu, cp),
              "doc-zigzag (padded)": doc_zigzag_segments(cu, cp)[0]}
    for name, segments in others.items():
        rows[name] = dispatch_over_ideal([[c] for c in prefix_calls(cu, segments)], ideal,
                                         heads, model=model)
    return rows


def main(argv=None):
    from bench_selection import mix_rows, parse_configs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3, help="random rows per configuration")
    p.add_argument("--heads", type=int, default=32, help="query heads of a ring rank")
    p.add_argument("--configs", default="32768:4,131072:8", help="comma-separated TOKENS:CP")
    p.add_argument("--slots", type=int, default=DispatchModel.slots)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    configs = parse_configs(p, args.configs)
    model = DispatchModel(slots=args.slots)
    print(f"dispatch model: {args.heads} heads per ring rank (hybrid: {args.heads // 2}), "
          f"{model.slots} slots; busiest rank over the ideal, forward / backward (mean over "
          f"{args.samples} rows)")
    for mix, n, cp, cus in mix_rows(configs, args.samples, args.seed):
        rows = [layout_rows(cu, cp, args.heads, model) for cu in cus]
        print(f"\n{mix} {n // 1024}k tokens / CP {cp}")
        print("| layout | model: fwd / bwd |")
        print("|---|---|")
        for layout in rows[0]:
            f, b = (float(np.mean([r[layout][d] for r in rows])) for d in TILES)
            print(f"| {layout} | {f:.2f} / {b:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
