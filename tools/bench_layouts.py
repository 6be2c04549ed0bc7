"""The layouts the GPU benchmarks time (tools/bench_cp_gpu.py, tools/profile_cp_step.py).

One job: name our layouts and say how each runs: its algorithm, Ulysses degree, ring
executor, and mode (--cp-concurrent-calls, its forced split, the fused kernels); the reference
layouts and the "(one call)" and whole-row fused rows; `--only`'s names; the backend and
schedules a layout runs with; the fused rows' options (tile sizes, launch shapes); the
attention's shape options and the device and backend the GPU tools run on.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_selection import positive_int  # noqa: E402
from megatron_eod.attention.backends import get_backend  # noqa: E402
from megatron_eod.attention import triton_backward, triton_forward  # noqa: E402
from megatron_eod.attention.triton_forward import TritonForwardBackend  # noqa: E402
from megatron_eod.plan.forward_tiles import DEFAULT_BLOCK_M  # noqa: E402
from megatron_eod.plan.forward_tiles import with_fused_tiles  # noqa: E402

__all__ = ["OURS", "REFERENCES", "FUSED_IDEALS", "SplitForced", "concurrent_calls", "fused",
           "fused_schedules", "layout_backend", "layout_names", "one_call", "our_layouts",
           "add_fused_options", "apply_fused_options", "parse_backward_shape", "power_of_two",
           "add_model_options", "device_setup"]


# Our layouts: (name, algo, Ulysses degree, ring executor); the other tools report the same.
OURS = (("ours ring", "ring", None, "batched"), ("ours ring (steps)", "ring", None, "steps"),
        ("ours hybrid u=2", "hybrid", 2, "batched"),
        ("ours hybrid u=2 (steps)", "hybrid", 2, "steps"))


def our_layouts(steps=True):
    """(name, algo, Ulysses degree, ring exchange, concurrency) of each of our layouts the
    GPU tools time: OURS (the steps rows only with `steps`), then the batched ones with
    --cp-concurrent-calls, concurrency "beside" (as the executor runs it with this kernel)
    and "split" (the local call's parts forced: `layout_backend`); False without."""
    rows = [(name, algo, u, exchange, False) for name, algo, u, exchange in OURS
            if exchange != "steps" or steps]
    return rows + [(f"{name} ({label})", algo, u, exchange, mode)
                   for label, mode in (("concurrent", "beside"), ("concurrent, split", "split"),
                                       ("fused", "fused"), ("fused, concurrent", "fused beside"),
                                       ("fused, concurrent backward", "fused beside-bwd"),
                                       ("fused fwd+bwd", "fused both"),
                                       ("fused fwd+bwd, concurrent", "fused both beside"))
                   for name, algo, u, exchange in OURS if exchange == "batched"]


def power_of_two(size) -> bool:
    """A block size Triton's matrix products take: a power of two >= 16."""
    return size >= 16 and not size & (size - 1)


def _parse_shape(p, flag, text, fields, example, blocks_rule, more_warps=None, shown=None):
    """FIELDS...:WARPS:STAGES as a tuple of ints, the leading fields block sizes, each checked
    (argparse error, naming `shown` if given, else `text`); `more_warps`: the name of an
    optional last field, warps too."""
    parts = text.split(":")
    text = text if shown is None else shown
    count = len(fields.split(":"))
    if more_warps is not None:
        fields += f"[:{more_warps}]"
    if len(parts) not in (count, count + (more_warps is not None)) or \
            not all(x.isdigit() for x in parts):
        p.error(f"{flag}: {fields} (e.g. {example}), got {text!r}")
    *blocks, warps, stages = (int(x) for x in parts[:count])
    extra = tuple(int(x) for x in parts[count:])
    if not all(map(power_of_two, blocks)) or stages < 1 or \
            not all(w in (1, 2, 4, 8, 16) for w in (warps, *extra)):
        p.error(f"{flag} {text}: {blocks_rule}, WARPS 1, 2, 4, 8 or 16, STAGES >= 1")
    return (*blocks, warps, stages, *extra)


def parse_backward_shape(p, flag, text):
    """A fused backward's launch shape DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS], or
    with `atomic` for DQ_BLOCK_N no dq kernel (dq added by dk/dv's: ATOMIC_DQ), as
    (triton_backward.BACKWARD_OVERRIDE's tuple, ATOMIC_DQ); argparse errors name `flag`."""
    head, sep, rest = text.partition(":")
    atomic = head == "atomic"
    # (atomic: the dq kernel's block is unused, the default's stands in)
    parsed = f"{triton_backward.DQ_BLOCK_N}{sep}{rest}" if atomic else text
    fields, example = ("atomic:DKDV_BLOCK_M:WARPS:STAGES", "atomic:32:8:2") if atomic else \
        ("DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES", "32:32:8:2")
    return _parse_shape(p, flag, parsed, fields, example, "the blocks powers of two >= 16",
                        "DKDV_WARPS", text), atomic


def add_fused_options(p):
    """The fused rows' options: tile sizes and the kernels' launch shapes."""
    p.add_argument("--tile-rows", type=positive_int, default=DEFAULT_BLOCK_M,
                   help="query rows per tile of the fused rows (a power of two >= 16)")
    p.add_argument("--fused-config", metavar="BLOCK_N:WARPS:STAGES",
                   help="the fused kernel's key block, warps and pipeline stages for every "
                        "launch (default: attention/triton_forward.py's choice per head dim)")
    p.add_argument("--fused-backward-config",
                   metavar="DQ_BLOCK_N:DKDV_BLOCK_M:WARPS:STAGES[:DKDV_WARPS]",
                   help="the fused backward's blocks (dq's keys, dk/dv's query rows), warps "
                        "(dk/dv's apart if given) and stages for every launch (default: "
                        "attention/triton_backward.py's); 'atomic' for DQ_BLOCK_N: no dq "
                        "kernel, the dk/dv kernel adds dq by float32 atomic adds")
    p.add_argument("--key-tile-keys", type=positive_int,
                   help="keys per tile of the fused backward's dk/dv (a power of two >= 16; "
                        "default: plan/key_tiles.py's 64)")


def apply_fused_options(p, args):
    """Checks `add_fused_options`' values (argparse errors) and sets the kernels' launch
    overrides they name (triton_forward.LAUNCH_OVERRIDE, triton_backward.BACKWARD_OVERRIDE)."""
    for flag, size in (("--tile-rows", args.tile_rows), ("--key-tile-keys", args.key_tile_keys)):
        if size is not None and not power_of_two(size):
            p.error(f"{flag} must be a power of two >= 16, got {size}")
    if args.fused_config is not None:
        triton_forward.LAUNCH_OVERRIDE = _parse_shape(
            p, "--fused-config", args.fused_config, "BLOCK_N:WARPS:STAGES", "64:8:3",
            "BLOCK_N a power of two >= 16")
    if args.fused_backward_config is not None:
        triton_backward.BACKWARD_OVERRIDE, triton_backward.ATOMIC_DQ = parse_backward_shape(
            p, "--fused-backward-config", args.fused_backward_config)


def add_model_options(p):
    """The attention's shape: --heads, --kv-heads, --head-dim (the GPU tools' defaults)."""
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)


def device_setup(p, args, what):
    """(device, dtype, backend) the GPU tools run with (bf16 through the GPU's varlen kernel;
    on a CPU float32 through the exact one), after checking `add_model_options`' values
    (argparse error); prints the run's header line, `what` its last words."""
    if args.heads % args.kv_heads:
        p.error("--heads must be divisible by --kv-heads")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = get_backend(device, dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, backend {backend.name}, {dtype}, heads {args.heads}/{args.kv_heads} x "
          f"{args.head_dim}, {what}")
    return device, dtype, backend


def concurrent_calls(mode) -> bool:
    """Whether a layout of `our_layouts` runs with --cp-concurrent-calls."""
    return mode == "split" or "beside" in (mode or "")  # the modes say so


def fused(mode) -> bool:
    """Whether a layout of `our_layouts` runs with --cp-fused-forward."""
    return (mode or "").startswith("fused")


class SplitForced:
    """`backend` claiming to write into given tensors, so that the batched ring runs the
    local call in its two parts with concurrent_calls whatever the kernel (every backend
    takes out= and grads=, copying there where its kernel cannot)."""

    writes_out = writes_grads = True

    def __init__(self, backend):
        self.backend, self.name = backend, backend.name

    def forward(self, *args, **kwargs):
        return self.backend.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.backend.backward(*args, **kwargs)


REFERENCES = ("contiguous", "doc-zigzag (padded)")


def one_call(name, exchange, concurrent):
    """The name of the "(one call)" row made from our layout `name`, or None: only the
    batched executor without concurrency has one."""
    return f"{name} (one call)" if exchange == "batched" and not concurrent else None


def layout_names(steps=True):
    """Every layout a bench row can time, in its table's order but for the "(one call)"
    rows, which follow the row they are made from."""
    layouts = our_layouts(steps)
    ones = [one_call(name, exchange, mode) for name, _, _, exchange, mode in layouts]
    return (["ideal"] + [name for name, *_ in layouts] + [one for one in ones if one] +
            list(FUSED_IDEALS) + list(REFERENCES))


# The whole row as ONE launch of the fused forward kernel (and its backward's), divided by
# cp: the ideal with those kernels. {row name: fused backward}
FUSED_IDEALS = {"whole row, fused kernel": False, "whole row, fused kernels fwd+bwd": True}


def layout_backend(backend, mode):
    """The backend a layout of `our_layouts` runs with: "fused", the batched forward as the
    fused Triton kernel over query tiles (attention/triton_forward.py), its backward the
    kernel's own ("fused both", "fused both beside": the fused backward's; "fused
    beside-bwd": the forward on one stream even with concurrent calls)."""
    if fused(mode):
        return TritonForwardBackend(backend, fused_backward=mode.startswith("fused both"),
                                    forward_beside=mode != "fused beside-bwd")
    return SplitForced(backend) if mode == "split" else backend


def fused_schedules(plan, device, tile_rows, key_block=None):
    """The plan's schedules on `device`, their forward tiles of `tile_rows` query rows and
    their key tiles of `key_block` keys (None: the plan's)."""
    return [(s if s.forward_tiles is None or (tile_rows == s.forward_tiles.block_m and
                                              key_block in (None, s.key_tiles.block_n))
             else with_fused_tiles(s, tile_rows, key_block)).to(device)
            for s in plan.schedules]
