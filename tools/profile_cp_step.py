#!/usr/bin/env python3
"""Where a CP rank's attention time goes: attention kernels, glue kernels, idle device.

    python tools/profile_cp_step.py [--configs 32768:4,131072:8] [--mixes stdlib,web]
                                    [--only REGEX]

tools/bench_cp_gpu.py says how far the busiest rank is from the ideal; this says why. For
the busiest group of our ring and hybrid (u=2) plans, with both ring executors (batched also
with --cp-concurrent-calls, whose streams' kernels overlap, and with the local call's two
parts forced as bench_cp_gpu.py does), on the same rows, sizes and
kernel, it times the forward alone and the forward+backward (each best of --repeats, no
profiler) and profiles one more of each with torch.profiler, then splits the time (the
forward apart, because the bench's forward is the direction furthest from its kernels):
  attention  device time in the attention kernels (names with flash / fmha / attention)
  glue       device time in every other kernel: merges, gathers, casts, gradient sums
  idle       the rest of the wall time: the device waits for the host to launch work
             (many small launches, Python overhead)
and lists the glue kernels that take the most time. On a GPU it also gives the pass's memory:
the peak allocated and the peak reserved by PyTorch's caching allocator, over what was there
before (after emptying the cache), across --repeats runs: each CUDA stream keeps its own
pool of cached blocks, so the concurrent rows' side streams may reserve more than they
allocate. Times are per rank (for hybrid: one rank
of the group, its H/u heads over the group's rows). Busy time is the union of kernel
intervals, so overlapping kernels count once (the concurrent rows' attention share is then
the time some attention kernel runs). On a CPU the same split covers the top-level aten
operators of the profiled run (no device: "idle" is Python overhead between them), which only
smoke-tests the tool.
"""

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench_cp_gpu import random_qkv, timed, ulysses_rank_inputs  # noqa: E402
from bench_layouts import (add_model_options, concurrent_calls, device_setup,  # noqa: E402
                           layout_backend, our_layouts)
from bench_selection import (mix_rows, parse_configs, parse_mixes, parse_only,  # noqa: E402
                             positive_int, tokens_label, wanted)
from megatron_eod import plan_context_parallel  # noqa: E402
from megatron_eod.attention.simulate import SimulatedPlan  # noqa: E402

_ATTENTION = re.compile(r"flash|fmha|attention", re.IGNORECASE)


def kernel_intervals(prof, device):
    """[(name, start_us, end_us)] of the work the device ran: CUDA kernels, or on a CPU the
    top-level aten operators."""
    if device.type == "cuda":
        return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.name.startswith("aten::") and not _has_aten_parent(e)]


def _has_aten_parent(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def busy_us(intervals):
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((s, e) for _, s, e in intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def split_time(intervals, wall_s):
    """{attention, glue, idle: seconds} adding up to wall_s (idle >= 0), and the glue
    kernels' {name: (count, seconds)}."""
    attention = [i for i in intervals if _ATTENTION.search(i[0])]
    glue = [i for i in intervals if not _ATTENTION.search(i[0])]
    att_s, glue_s = busy_us(attention) / 1e6, busy_us(glue) / 1e6
    by_name = {}
    for name, start, end in glue:
        count, seconds = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, seconds + (end - start) / 1e6)
    return {"attention": att_s, "glue": glue_s,
            "idle": max(0.0, wall_s - att_s - glue_s), "wall": wall_s}, by_name


def memory_mib(run, device, repeats):
    """(peak allocated, peak reserved) MiB over `repeats` runs of `run()`, above what was
    allocated / reserved before, the allocator's cache emptied first; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        run()
    torch.cuda.synchronize(device)
    return ((torch.cuda.max_memory_allocated(device) - allocated) / 2**20,
            (torch.cuda.max_memory_reserved(device) - reserved) / 2**20)


def profile_pass(run, device, repeats):
    """(split, glue by name, attention kernel count, glue kernel count, memory_mib) of
    `run()`."""
    wall = timed(run, repeats, device)  # its first run warms up (compiles, workspaces)
    memory = memory_mib(run, device, repeats)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiled_wall = time.perf_counter() - start
    if device.type != "cuda":  # operators run on the host: the profiler slows them all
        wall = profiled_wall
    intervals = kernel_intervals(prof, device)
    split, by_name = split_time(intervals, wall)
    n_att = sum(1 for i in intervals if _ATTENTION.search(i[0]))
    return split, by_name, n_att, len(intervals) - n_att, memory


PASSES = ("fwd", "fwd+bwd")


def profile_group(sim, g, device, repeats):
    """{pass: profile_pass(...)} of group g: its forward alone, and forward+backward."""
    runs = {"fwd": lambda: sim.forward_group(g), "fwd+bwd": lambda: sim.run_group(g)}
    return {name: profile_pass(runs[name], device, repeats) for name in PASSES}


def profile_row(cu, cp, args, device, dtype, backend):
    """{layout: {pass: profile_pass(...)}} for the busiest group of each of our layouts."""
    n = int(cu[-1])
    q, k, v, dout = random_qkv(n, args, device, dtype, torch.Generator().manual_seed(0))
    scale = args.head_dim ** -0.5
    out = {}
    for name, algo, u, exchange, concurrent in our_layouts():
        if not wanted(args.only, name):
            continue
        plan = plan_context_parallel(torch.from_numpy(cu), cp, algo, u)
        sim = SimulatedPlan(plan, *ulysses_rank_inputs(q, k, v, dout, u or 1),  # one rank's
                            layout_backend(backend, concurrent), scale, exchange,  # heads
                            concurrent_calls(concurrent))
        g = max(range(plan.ring_size),
                key=lambda g: timed(lambda: sim.run_group(g), 1, device))
        out[name] = profile_group(sim, g, device, args.repeats)
    return out


def report(mix, n, cp, results, top):
    print(f"\n{mix} {tokens_label(n)} tokens / CP {cp}: busiest group, per rank")
    print("| layout | pass | wall ms | attention ms | glue ms | idle ms | "
          "kernels: attention / glue | peak MiB: allocated / reserved |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, passes in results.items():
        for name in PASSES:
            split, _, n_att, n_glue, memory = passes[name]
            wall = split["wall"]
            cells = " | ".join(f"{split[k] * 1e3:.3f} ({100 * split[k] / wall:.0f}%)"
                               for k in ("attention", "glue", "idle"))
            mib = "- / -" if memory is None else f"{memory[0]:.0f} / {memory[1]:.0f}"
            print(f"| {layout} | {name} | {wall * 1e3:.3f} | {cells} | {n_att} / {n_glue} | "
                  f"{mib} |")
    for layout, passes in results.items():
        for name in PASSES:
            ranked = sorted(passes[name][1].items(), key=lambda item: -item[1][1])[:top]
            print(f"\n{layout}, {name}: top glue kernels (count, ms)")
            for kernel, (count, seconds) in ranked:
                print(f"  {seconds * 1e3:8.3f} ms  x{count:<4d} {kernel[:100]}")
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="32768:4,131072:8", help="comma-separated TOKENS:CP")
    p.add_argument("--mixes", default="stdlib,web", help="comma-separated: stdlib, web")
    add_model_options(p)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--top", type=positive_int, default=8, help="glue kernels listed per layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", metavar="REGEX",
                   help="profile only the layouts whose name this regular expression finds "
                        "(as tools/bench_cp_gpu.py --only)")
    args = p.parse_args(argv)
    configs = parse_configs(p, args.configs)
    mixes = parse_mixes(p, args.mixes)
    args.only = parse_only(p, args.only, [name for name, *_ in our_layouts()])
    device, dtype, backend = device_setup(
        p, args, f"one row per configuration, wall = best of {args.repeats}")
    for mix, n, cp, (cu,) in mix_rows(configs, 1, args.seed, mixes):
        report(mix, n, cp, profile_row(cu, cp, args, device, dtype, backend), args.top)


if __name__ == "__main__":
    main()
