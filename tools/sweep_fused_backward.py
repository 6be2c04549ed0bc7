#!/usr/bin/env python3
"""The fused backward's launch shapes, swept in one process: its time over PyTorch's backward.

    python tools/sweep_fused_backward.py --shapes 32:32:8:2,32:16:8:3:4@128 [--samples 1]
                                         [--repeats 3] [--configs 32768:4,131072:8]
                                         [--mixes stdlib,web]

A shape is DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS][@KEYS] (dq's key block, dk/dv's
query rows, warps, pipeline stages, dk/dv's warps if not dq's, and keys per dk/dv tile,
plan/key_tiles.py's 64 unless given): attention/triton_backward.py's BACKWARD_OVERRIDE and the
key tiles' size; `atomic` for DQ_BLOCK_N runs no dq kernel, the dk/dv kernel adding dq by
float32 atomic adds (ATOMIC_DQ, FlashAttention-2's backward: its dq time is in dk/dv's).
For each mix's rows (tools/bench_cp.py's document mixes) the whole row is one
plan (CP=1: every document in the fused kernels' tiles, as tools/bench_cp_gpu.py's "whole
row, fused kernels fwd+bwd"), its forward the fused kernel's; its backward (forward+backward
minus forward) is timed with PyTorch's kernels (the base backend's, as training runs it
without --cp-fused-backward) and with the fused backward at each shape, by the wall clock and
the device-only clock (bench_cp_gpu's two clocks). Reported per shape and mix: the backward's
time over PyTorch's by each clock; each of its kernels' device time (dq, dk/dv, delta, by CUDA
events around each launch, the run queued behind a sleep kernel) over PyTorch's whole
backward (device-only), to say which kernel to work on; and
the largest normwise gradient difference from PyTorch's
(max |fused - PyTorch| / max |PyTorch| over dq, dk, dv: a shape computing wrongly shows;
bf16 rounding alone gives ~1e-2). A shape that does not compile or launch is NaN, its
traceback on stderr, and the others still run. Last, the best shape by each clock (mean over
the mixes, among those that ran everywhere and computed within WRONG of PyTorch's): what
`--fused-backward-config` takes next. Each shape compiles its kernels during its
warm-up run. Each mix's cells are printed ("[sweep] ...") as soon as it ends, the tables
after all: a run its time limit cuts off keeps the mixes done.
On a CPU (tests) it runs through Triton's interpreter in float32: slowly, at small sizes.
"""

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_cp_gpu import (MAX_LATE, _sleep_cycles_per_second, device_timed,  # noqa: E402
                          random_qkv, timed)
from bench_layouts import (add_model_options, device_setup, fused_schedules,  # noqa: E402
                           parse_backward_shape, power_of_two)
from bench_selection import (mix_rows, parse_configs, parse_mixes, positive_int,  # noqa: E402
                             tokens_label)
from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.attention import triton_backward  # noqa: E402
from megatron_eod.attention.simulate import SimulatedPlan  # noqa: E402
from megatron_eod.attention.triton_forward import TritonForwardBackend  # noqa: E402
from megatron_eod.plan.forward_tiles import DEFAULT_BLOCK_M  # noqa: E402


def parse_shapes(p, text):
    """[(label, (BACKWARD_OVERRIDE tuple, ATOMIC_DQ), keys per dk/dv tile or None)] from
    --shapes."""
    shapes = []
    for item in text.split(","):
        shape, _, keys = item.partition("@")
        override = parse_backward_shape(p, "--shapes", shape)
        if keys and not (keys.isdigit() and power_of_two(int(keys))):
            p.error(f"--shapes {item}: KEYS after @ must be a power of two >= 16")
        shapes.append((item, override, int(keys) if keys else None))
    return shapes


def backward_seconds(sim, repeats, device):
    """(wall, device-only) seconds of the backward: forward+backward minus forward."""
    fwd, both = (lambda: sim.forward_group(0)), (lambda: sim.run_group(0))
    wall = timed(both, repeats, device) - timed(fwd, repeats, device)
    return wall, device_timed(both, repeats, device) - device_timed(fwd, repeats, device)


KERNELS = {"dq": "dq_tiles", "dk/dv": "dkdv_tiles", "delta": "row_delta"}


def kernel_seconds(sim, device):
    """{kernel: seconds} of one forward+backward's fused backward kernels (KERNELS: the
    backend's launches, each timed by CUDA events around it, summed; on a CPU the wall
    clock). On a GPU the run is queued behind a sleep kernel, as bench_cp_gpu's device-only
    clock does, so that no event pair times the host's launch (redone with twice the sleep
    where the sleep ended first, at most MAX_LATE times; then NaN)."""
    backend, spent = sim.backend, {}

    def clocked(name, launch):
        def run(*args, **kwargs):
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                result = launch(*args, **kwargs)
                end.record()
                spent[name].append((start, end))
            else:
                began = time.perf_counter()
                result = launch(*args, **kwargs)
                spent[name].append(time.perf_counter() - began)
            return result
        return run

    cuda = device.type == "cuda"
    cycles = int((1.25 * timed(lambda: sim.run_group(0), 0, device) + 1e-3) *
                 _sleep_cycles_per_second()) if cuda else 0
    for name, method in KERNELS.items():
        setattr(backend, method, clocked(name, getattr(backend, method)))
    try:
        for _ in range(MAX_LATE + 1):
            spent.update({name: [] for name in KERNELS})
            if not cuda:
                sim.run_group(0)
                return {name: sum(times) for name, times in spent.items()}
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            first = torch.cuda.Event()
            first.record()
            sim.run_group(0)
            late = first.query()  # the sleep ended before everything was queued
            torch.cuda.synchronize()
            if not late:
                return {name: sum(a.elapsed_time(b) for a, b in pairs) / 1e3
                        for name, pairs in spent.items()}
            cycles *= 2
        return {name: float("nan") for name in KERNELS}
    finally:
        for method in KERNELS.values():
            delattr(backend, method)  # the class's own again


def gradient_gap(mine, theirs):
    """Largest normwise difference of dq, dk, dv (run()'s last three) from PyTorch's."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
               .item() for a, b in zip(mine[1:], theirs[1:]))


def sweep_row(cu, args, device, dtype, backend, shapes):
    """{label: (wall ratio, device-only ratio, gradient gap)} for one row; "PyTorch" first."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = random_qkv(int(cu[-1]), args, device, dtype, gen)
    scale = args.head_dim ** -0.5
    whole = plan_context_parallel(torch.from_numpy(cu), 1, "ring")

    def simulated(fused_backward, keys=None):
        sim = SimulatedPlan(whole, q, k, v, dout, TritonForwardBackend(backend, fused_backward),
                            scale)
        sim.schedules = fused_schedules(whole, device, args.tile_rows, keys)
        return sim

    base = simulated(False)
    base_wall, base_dev = backward_seconds(base, args.repeats, device)
    reference = base.run()
    nan = float("nan")
    results = {"PyTorch": (1.0, 1.0, 0.0) + (nan,) * len(KERNELS)}
    for label, override, keys in shapes:
        triton_backward.BACKWARD_OVERRIDE, triton_backward.ATOMIC_DQ = override
        try:
            sim = simulated(True, keys)
            wall, dev = backward_seconds(sim, args.repeats, device)
            kernels = kernel_seconds(sim, device)
            results[label] = (wall / base_wall, dev / base_dev, gradient_gap(sim.run(), reference),
                              *(kernels[name] / base_dev for name in KERNELS))
        except Exception:  # noqa: BLE001 - one shape failing must not lose the others
            print(f"[sweep] {label} failed:", file=sys.stderr)
            traceback.print_exc()
            results[label] = (nan,) * (3 + len(KERNELS))
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except RuntimeError:
                    traceback.print_exc()
        finally:
            triton_backward.BACKWARD_OVERRIDE, triton_backward.ATOMIC_DQ = None, False
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", required=True,
                   help="comma-separated DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS]"
                        "[@KEYS], DQ_BLOCK_N 'atomic' for dq by the dk/dv kernel")
    p.add_argument("--samples", type=positive_int, default=1, help="random rows per config")
    p.add_argument("--repeats", type=positive_int, default=3)
    add_model_options(p)
    p.add_argument("--configs", default="32768:4,131072:8",
                   help="comma-separated TOKENS:CP pairs (CP only picks the mixes' rows)")
    p.add_argument("--mixes", default="stdlib,web", help="comma-separated: stdlib, web")
    p.add_argument("--tile-rows", type=positive_int, default=DEFAULT_BLOCK_M,
                   help="query rows per forward tile (dq's programs)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shapes = parse_shapes(p, args.shapes)
    configs, mixes = parse_configs(p, args.configs), parse_mixes(p, args.mixes)
    device, dtype, backend = device_setup(
        p, args, f"the whole row's backward over PyTorch's, best of {args.repeats}, "
                 f"{args.samples} rows per configuration")
    table = {}
    for mix, n, _, cus in mix_rows(configs, args.samples, args.seed, mixes):
        rows = [sweep_row(cu, args, device, dtype, backend, shapes) for cu in cus]
        column = f"{mix} {tokens_label(n)}"
        table[column] = {label: tuple(float(np.mean([r[label][i] for r in rows]))
                                      for i in range(3 + len(KERNELS)))
                         for label in rows[0]}
        # Each mix as it ends: a run cut off by its time limit keeps the mixes done.
        for label, cell in table[column].items():
            print(f"[sweep] {column} | {label} | backward {cell[0]:.2f} ({cell[1]:.2f}), gap "
                  f"{cell[2]:.1e} | " + " / ".join(f"{x:.2f}" for x in cell[3:]), flush=True)
    columns = list(table)
    print_table("the backward over PyTorch's, wall (device-only); the largest gradient gap",
                table, lambda cell: f"{cell[0]:.2f} ({cell[1]:.2f}); {cell[2]:.1e}")
    fused_only = {c: {label: cells for label, cells in table[c].items() if label != "PyTorch"}
                  for c in columns}
    print_table("each kernel's device time (events, its launches queued behind a sleep) "
                "over PyTorch's whole backward (device-only): " + " / ".join(KERNELS),
                fused_only, lambda cell: " / ".join(f"{x:.2f}" for x in cell[3:]))
    for clock, at in (("device-only", 1), ("wall", 0)):
        best = best_shape(fused_only, at)
        print(f"[sweep] best by the {clock} clock (mean over the mixes): " +
              ("none (every shape failed or computed wrongly)" if best is None else
               f"{best[0]}, {best[1]:.2f} of PyTorch's backward"))
    return table


# A shape whose gradients differ from PyTorch's by more than this (normwise) computes wrongly:
# bf16 rounding alone gives ~1e-2.
WRONG = 5e-2


def best_shape(table, at):
    """(label, mean ratio) of the shape whose ratio `at` (0 wall, 1 device-only) is least on
    average over the mixes, among those run everywhere with gradients within WRONG; or
    None."""
    means = {}
    for label in table[next(iter(table))]:
        cells = [table[column][label] for column in table]
        if all(np.isfinite(c[at]) and c[2] <= WRONG for c in cells):
            means[label] = float(np.mean([c[at] for c in cells]))
    return min(means.items(), key=lambda item: item[1]) if means else None


def print_table(what, table, cell_text):
    """A markdown table: a row per shape, a column per mix, `what` its cells."""
    columns = list(table)
    print(f"\nCells: {what}\n")
    print("| shape | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label in table[columns[0]]:
        print(f"| {label} | " + " | ".join(cell_text(table[c][label]) for c in columns) + " |")


if __name__ == "__main__":
    main()
