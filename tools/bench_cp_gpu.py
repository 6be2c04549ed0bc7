#!/usr/bin/env python3
"""Attention compute per CP rank on one GPU: our plan against the layouts others use.

    python tools/bench_cp_gpu.py [--samples 3] [--heads 32 --kv-heads 8 --head-dim 128]
                                 [--mixes stdlib,web,capped] [--only REGEX]

For the two document mixes of tools/bench_cp.py at 32k tokens / CP 4 and 128k / CP 8, runs on
ONE device, group after group (megatron_eod.attention.simulate), the forward+backward kernel
work each CP rank does, in bf16 through the GPU varlen kernel, and reports the BUSIEST rank's
time (it sets the step time), forward, backward (forward+backward minus forward) and both, for:
  ideal        one varlen call over the whole row, divided by cp (perfect balance, no overhead)
  ours ring    our plan, batched ring (the default): local call + ONE call over every
               received key, one lse merge
  ours ring (steps)  the same plan, one call and one merge per ring step (--cp-ring-exchange
               steps; with --steps only)
  ours ring (concurrent)  the batched ring with its local call on a second CUDA stream beside
               the call over received keys (--cp-concurrent-calls; on a CPU: in sequence)
  ours ring (concurrent, split)  the same with the local call in its two parts on two more
               streams (plan/local_split.py), forced: where the kernel cannot write into
               given tensors (PyTorch < 2.12's forward, its backward), the parts' results
               are copied, a cost the executor itself avoids by not splitting there
  ours ... (fused)  the batched ring with its forward as ONE fused Triton kernel over query
               tiles, longest first, each row's received and local keys in one softmax
               (attention/triton_forward.py; no merge), the backward the kernel's own;
               "whole row, fused kernel" is the whole row as one launch of it, / cp
               ("... fwd+bwd": with the fused backward's kernels too);
               "(fused, concurrent)": also --cp-concurrent-calls (the fused forward's
               first launch on a side stream; the backward's calls side by side);
               "(fused, concurrent backward)": the same but the forward on one stream
               (`TritonForwardBackend(forward_beside=False)`: only the backward's calls
               side by side);
               "(fused fwd+bwd)": the backward fused too (--cp-fused-backward), and
               "(fused fwd+bwd, concurrent)" with --cp-concurrent-calls (the forward's
               first launch and the backward's local keys' dk/dv on side streams);
               --fused-config, --fused-backward-config and --key-tile-keys sweep the
               kernels' shapes
  ours hybrid  Ulysses degree 2: what ONE rank of a group computes after the all-to-all:
               the group's rows over H/2 query heads (and its share of key/value heads),
               batched and steps (before 2026-11-25 this was the group's all-head work / 2,
               which hides the kernel's tail: see tools/dispatch_model.py)
  ours ... (one call)  the same placement's rank (group) work as ONE causal call with every
               key in place before timing: what no executor of that placement can beat
               (no merge, no second pass over the queries; the gap to it is the executor's)
  contiguous   row cut in cp pieces; each piece attends to its documents' earlier keys
  doc-zigzag   every document padded to 2*cp and zigzagged (TransformerEngine THD layout);
               computed here as ONE call per rank (generous: TE makes one per ring step)
with "useful TFLOP/s per GPU": the pairs a document mask needs x 4*H*D flops x 3.5 (forward
+ backward), over cp x the busiest rank's time. Communication is not included (one GPU).
Two clocks: the wall time of the work alone (host launch overhead included: the attention of a
small row can be launch-bound), and "device-only", the same forward+backward with the host's
launches hidden behind a sleep kernel, which is what it costs inside a training step whose
matrix multiplies keep the host ahead. The reference layouts' inputs are gathered before
timing (their data arrives in their layout); ours pay every gather they make. "tile floor":
the tile model's bound for each layout's busiest rank (tools/tile_model.py): how much of the
device-only ratio the kernels' partial tiles explain, the rest being glue.
On a CPU it runs the same with the exact CPU kernel in float32 (slow: use small sizes).
"""

import argparse
import contextlib
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_selection import (mix_rows, parse_configs, parse_mixes, parse_only,  # noqa: E402
                             positive_int, tokens_label, wanted)
from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.attention.simulate import SimulatedPlan  # noqa: E402
from megatron_eod.attention.triton_forward import TritonForwardBackend  # noqa: E402
from megatron_eod.attention.ulysses import kv_repeat_for_degree  # noqa: E402
from megatron_eod.plan.cost import doc_pairs  # noqa: E402
from megatron_eod.plan.kv_schedule import call_from_rows  # noqa: E402
from tile_model import plan_calls, tiles_over_ideal  # noqa: E402
from bench_layouts import (FUSED_IDEALS, add_fused_options, add_model_options,  # noqa: E402
                           apply_fused_options, concurrent_calls, device_setup, fused,
                           fused_schedules, layout_backend, layout_names, one_call,
                           our_layouts)


def timed(fn, repeats, device):
    """Best wall-clock seconds of fn over `repeats` runs after one warm-up: what a step of this
    work alone takes, host launch overhead included."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


MAX_LATE = 3  # doublings of the sleep before device_timed gives up


def device_timed(fn, repeats, device):
    """Best device seconds of fn with the host's launches hidden: a sleep kernel holds the
    stream while the host enqueues all of fn, so its kernels then run back to back. This is
    what fn costs inside a training step, where the model's long matrix multiplies keep the
    host ahead of the device. A run whose sleep ended before the host had enqueued everything
    is redone with twice the sleep, at most MAX_LATE times; then fn cannot be hidden (a host
    sync inside, or more launches than the device queue holds): NaN, with a warning. On a
    CPU there is no device: the wall time."""
    if device.type != "cuda":
        return timed(fn, repeats, device)
    host = timed(fn, 0, device)  # also the warm-up
    # Enqueueing takes less than the wall time (which also waits for the last kernels).
    cycles = int((1.25 * host + 1e-3) * _sleep_cycles_per_second())
    best, measured, late_runs = float("inf"), 0, 0
    while measured < max(repeats, 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        if start.query():  # the sleep ended before the host had enqueued everything
            torch.cuda.synchronize()
            late_runs += 1
            if late_runs > MAX_LATE:
                warnings.warn(f"device-only clock: {getattr(fn, '__name__', fn)} could not be "
                              f"hidden behind a {cycles} cycle sleep (a host sync inside?)")
                return float("nan")
            cycles *= 2
            continue
        torch.cuda.synchronize()
        best, measured = min(best, start.elapsed_time(end) / 1e3), measured + 1
    return best
_SLEEP_RATE = []


def _sleep_cycles_per_second():
    if not _SLEEP_RATE:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_RATE.append(50_000_000 / (start.elapsed_time(end) / 1e3))
    return _SLEEP_RATE[0]


def prefix_calls(cu, owner_rows):
    """One causal call per rank: each of its (document, segment) query runs attends to the
    document's keys from its start to the segment's end."""
    calls = []
    for segments in owner_rows:
        q_rows = [np.arange(a, b) for a, b, _ in segments]
        k_rows = [np.arange(ds, b) for a, b, ds in segments]
        calls.append(call_from_rows(q_rows, k_rows, causal=True))
    return calls


def plan_segments(plan, group, cu):
    """A ring group's (start, end, document start) runs of stream positions: its pieces."""
    tokens = plan.group_tokens(group).numpy()
    doc = np.searchsorted(cu, tokens, side="right") - 1
    cut = np.flatnonzero((np.diff(tokens) != 1) | (np.diff(doc) != 0)) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, tokens.size]
    return [(int(tokens[a]), int(tokens[b - 1]) + 1, int(cu[doc[a]]))
            for a, b in zip(starts, ends)]


def contiguous_segments(cu, cp):
    n = int(cu[-1])
    out = []
    for r in range(cp):
        lo, hi = r * n // cp, (r + 1) * n // cp
        segs = []
        for ds, de in zip(cu[:-1], cu[1:]):
            a, b = max(ds, lo), min(de, hi)
            if a < b:
                segs.append((int(a), int(b), int(ds)))
        out.append(segs)
    return out


def doc_zigzag_segments(cu, cp):
    lengths = np.diff(cu)
    padded = -(-lengths // (2 * cp)) * (2 * cp)
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    out = [[] for _ in range(cp)]
    for ds, size in zip(starts, padded):
        chunk = size // (2 * cp)
        for c in range(2 * cp):
            r = c if c < cp else 2 * cp - 1 - c
            out[r].append((int(ds + c * chunk), int(ds + (c + 1) * chunk), int(ds)))
    return out, int(padded.sum())


def call_fns(backend, call, q, k, v, dout, scale):
    """(forward, forward+backward) of one causal varlen call over `call`'s rows, gathered
    BEFORE timing: the reference layouts get their inputs already in place (kernel time
    only)."""
    qs, ks, vs, ds = q[call.q_index], k[call.k_index], v[call.k_index], dout[call.q_index]
    shape = (call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k, True,
             scale)

    def forward():
        return backend.forward(qs, ks, vs, *shape)

    def both():
        o, lse = forward()
        backend.backward(ds, qs, ks, vs, o, lse, *shape)
    return forward, both


@contextlib.contextmanager
def row_failure(name, times, tiles):
    """A layout whose run fails (a kernel that does not compile or launch on this GPU) is
    reported, its traceback on stderr, and its cells NaN: the other rows of a short lease
    still come back."""
    try:
        yield
    except Exception:  # noqa: BLE001 - any failure of one row must not lose the others
        print(f"[bench] {name} failed:", file=sys.stderr)
        traceback.print_exc()
        nan = float("nan")
        times[name] = (nan, nan, nan)
        tiles[name] = {"forward": nan, "backward": nan}
        if torch.cuda.is_available():
            try:  # a host-side failure's queued work; a device fault raises here again
                torch.cuda.synchronize()
            except RuntimeError:
                traceback.print_exc()


def busiest(fns, repeats, device, share=1):
    """(forward, forward+backward, device-only forward+backward) seconds of the busiest rank
    (by each clock); fns: (forward, both) per rank; `share`: ranks that split one function's
    work (a hybrid group's u)."""
    times = [(timed(f, repeats, device), timed(b, repeats, device),
              device_timed(b, repeats, device)) for f, b in fns]
    worst = max(times, key=lambda t: t[1])
    return worst[0] / share, worst[1] / share, max(t[2] for t in times) / share


def random_qkv(n, args, device, dtype, gen):
    make = lambda h: torch.randn(n, h, args.head_dim, generator=gen).to(device, dtype)  # noqa: E731
    return make(args.heads), make(args.kv_heads), make(args.kv_heads), make(args.heads)


def ulysses_rank_inputs(q, k, v, dout, degree):
    """q, k, v, dout as ONE rank of a Ulysses group of `degree` holds them after the
    all-to-all, for timing: H/degree query heads and its whole key/value heads (repeated as
    ulysses.py repeats them where G < degree); the group's rows. Contents are not the rank's
    own heads (timing only needs the shapes)."""
    if degree == 1:
        return q, k, v, dout
    heads, kv_heads = q.shape[1], k.shape[1]
    repeat = kv_repeat_for_degree(heads, kv_heads, degree)
    rank_kv = kv_heads * repeat // degree
    kv = lambda t: t.repeat_interleave(repeat, 1)[:, :rank_kv]  # noqa: E731
    return (q[:, :heads // degree].contiguous(), kv(k).contiguous(), kv(v).contiguous(),
            dout[:, :heads // degree].contiguous())


def bench_row(cu, cp, args, device, dtype, backend):
    n = int(cu[-1])
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = random_qkv(n, args, device, dtype, gen)
    scale = args.head_dim ** -0.5
    to_dev = lambda c: c.to(device)  # noqa: E731
    times = {}
    docs = [np.arange(a, b) for a, b in zip(cu[:-1], cu[1:])]
    full = to_dev(call_from_rows(docs, docs, causal=True))
    fns = lambda c, *t: call_fns(backend, c, *t, scale)  # noqa: E731
    times["ideal"] = busiest([fns(full, q, k, v, dout)], args.repeats, device, cp)
    tiles = {"ideal": {"forward": 1.0, "backward": 1.0}}
    for name, algo, u, exchange, concurrent in our_layouts(args.steps):
        one = one_call(name, exchange, concurrent)
        run_one = one is not None and wanted(args.only, one)
        if not (wanted(args.only, name) or run_one):
            continue
        plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, u)
        rank_qkv = ulysses_rank_inputs(q, k, v, dout, u or 1)  # one rank's heads
        if wanted(args.only, name):
            with row_failure(name, times, tiles):
                sim = SimulatedPlan(plan, *rank_qkv, layout_backend(backend, concurrent), scale,
                                    exchange, concurrent_calls(concurrent))
                if fused(concurrent):
                    sim.schedules = fused_schedules(plan, device, args.tile_rows,
                                                    args.key_tile_keys)
                times[name] = busiest([(lambda g=g: sim.forward_group(g),
                                        lambda g=g: sim.run_group(g))
                                       for g in range(plan.ring_size)], args.repeats, device)
                fused_tiles = [s.forward_tiles for s in sim.schedules] if fused(concurrent) and \
                    all(s.forward_tiles is not None for s in sim.schedules) else None
                tiles[name] = tiles_over_ideal(plan_calls(plan, exchange), cu, cp, u or 1,
                                               fused_tiles)
        if run_one:
            with row_failure(one, times, tiles):
                calls = [to_dev(c) for c in prefix_calls(
                    cu, [plan_segments(plan, g, cu) for g in range(plan.ring_size)])]
                times[one] = busiest([fns(c, *rank_qkv) for c in calls], args.repeats, device)
                tiles[one] = tiles_over_ideal([[c] for c in calls], cu, cp, u or 1)
    for row, fused_backward in FUSED_IDEALS.items():
        if not wanted(args.only, row):
            continue
        with row_failure(row, times, tiles):
            whole = plan_context_parallel(torch.from_numpy(cu), 1, "ring")
            sim = SimulatedPlan(whole, q, k, v, dout,
                                TritonForwardBackend(backend, fused_backward), scale)
            sim.schedules = fused_schedules(whole, device, args.tile_rows, args.key_tile_keys)
            times[row] = busiest([(lambda s=sim: s.forward_group(0),
                                   lambda s=sim: s.run_group(0))], args.repeats, device, cp)
            tiles[row] = tiles_over_ideal([[whole.schedules[0].local]], cu, cp, 1,
                                          [s.forward_tiles for s in sim.schedules])
    if wanted(args.only, "contiguous"):
        calls = [to_dev(c) for c in prefix_calls(cu, contiguous_segments(cu, cp))]
        times["contiguous"] = busiest([fns(c, q, k, v, dout) for c in calls], args.repeats,
                                      device)
        tiles["contiguous"] = tiles_over_ideal([[c] for c in calls], cu, cp)
    if wanted(args.only, "doc-zigzag (padded)"):
        segments, padded_n = doc_zigzag_segments(cu, cp)
        pq, pk, pv, pd = random_qkv(padded_n, args, device, dtype, gen)
        calls = [to_dev(c) for c in prefix_calls(cu, segments)]
        times["doc-zigzag (padded)"] = busiest([fns(c, pq, pk, pv, pd) for c in calls],
                                               args.repeats, device)
        tiles["doc-zigzag (padded)"] = tiles_over_ideal([[c] for c in calls], cu, cp)
    needed = float(doc_pairs(np.diff(cu)).sum())
    flops = needed * 4 * args.heads * args.head_dim * 3.5
    return {name: (fwd, total, flops / (cp * total) / 1e12, dev, tiles[name]["forward"],
                   tiles[name]["backward"])
            for name, (fwd, total, dev) in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=positive_int, default=3, help="random rows per configuration")
    add_model_options(p)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--configs", default="32768:4,131072:8",
                   help="comma-separated TOKENS:CP pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", action="store_true",
                   help="also time the steps executor (--cp-ring-exchange steps; its rows of "
                        "2026-11-24 are in docs/BENCHMARKS.md)")
    p.add_argument("--mixes", default="stdlib,web",
                   help="comma-separated: stdlib, web, capped (documents of at most a quarter "
                        "of the row: MagiAttention's setting)")
    add_fused_options(p)
    p.add_argument("--only", metavar="REGEX",
                   help="time only the layouts whose name this regular expression finds "
                        "(the ideal row always): '^ours' leaves out the reference layouts, "
                        "'ring' keeps ring's rows; a short GPU lease's way to the open rows")
    args = p.parse_args(argv)
    configs = parse_configs(p, args.configs)
    mixes = parse_mixes(p, args.mixes)
    args.only = parse_only(p, args.only, layout_names(args.steps))
    apply_fused_options(p, args)
    device, dtype, backend = device_setup(
        p, args, f"busiest rank forward+backward, best of {args.repeats}, {args.samples} rows "
                 f"per configuration")
    for mix, n, cp, cus in mix_rows(configs, args.samples, args.seed, mixes):
        rows = [bench_row(cu, cp, args, device, dtype, backend) for cu in cus]
        print(f"\n{mix} {tokens_label(n)} tokens / CP {cp}")
        print("| layout | busiest rank ms: fwd / bwd / both | over ideal: fwd / bwd / both "
              "| device-only ms: both (over ideal) | tile floor: fwd / bwd "
              "| useful TFLOP/s per GPU |")
        print("|---|---|---|---|---|---|")
        # A layout's cells over the samples; one that failed in a sample is NaN there.
        nan_row = (float("nan"),) * 6
        mean = lambda layout, i: float(np.mean([r.get(layout, nan_row)[i]  # noqa: E731
                                                for r in rows]))
        ideal_fwd, ideal = mean("ideal", 0), mean("ideal", 1)
        ideal_dev = mean("ideal", 3)
        for layout in dict.fromkeys(layout for r in rows for layout in r):
            fwd, t, tf, dev, tile_f, tile_b = (mean(layout, i) for i in range(6))
            print(f"| {layout} | {fwd * 1e3:.3f} / {(t - fwd) * 1e3:.3f} / {t * 1e3:.3f} | "
                  f"{fwd / ideal_fwd:.2f} / {(t - fwd) / (ideal - ideal_fwd):.2f} / "
                  f"{t / ideal:.2f} | {dev * 1e3:.3f} ({dev / ideal_dev:.2f}) | "
                  f"{tile_f:.2f} / {tile_b:.2f} | {tf:.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
