"""The fastest attention path by default on GPUs, and why not where it cannot run.

One job, for Megatron-LM's args after the CP flags are resolved: `choose_attention_path(args,
cuda_available)` turns the two unset flags (None) into choices:

* `--cp-fused-forward`: on CUDA, on where the fused kernel compiles for this GPU and Triton
  at this head dim and fits its shared memory, with a batched exchange; else off, said once
  with why. On CPU, off.
* `--cp-concurrent-calls`: on CUDA with a ring (ring, hybrid) and a batched exchange. On CPU,
  off.

`--no-cp-fused-forward` / `--no-cp-concurrent-calls` turn each off; the flag itself asks for
it and is refused at start-up where it cannot run (cp_flags.check_gpu_attention). On one H200
the two together took the busiest rank's attention from 1.10-1.22x the ideal to 1.01-1.17x
(docs/BENCHMARKS.md).

What it does not do: no checks of a flag given (cp_flags.py), no kernel (attention/).
"""

from __future__ import annotations

import warnings

from megatron_eod.attention.triton_forward import (device_problem, interpreting_triton,
                                                   triton_problem)
from megatron_eod.training.cp_flags import attention_head_dim

__all__ = ["choose_attention_path", "why_not_fused"]


def why_not_fused(args, problem=device_problem):
    """None where the fused forward can be the default on this CUDA device, else why not,
    in words that end a sentence ("... runs unfused: <why>"). `problem`: the device check
    (triton_forward.device_problem; a stand-in in tests)."""
    exchange = getattr(args, "cp_ring_exchange", "batched")
    if exchange == "steps":
        return "--cp-ring-exchange steps has no fused form"
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return "it takes --bf16 or --fp16"
    if interpreting_triton():
        return "TRITON_INTERPRET=1 is set (Triton's interpreter, for tests)"
    missing = triton_problem()
    if missing is not None:
        return missing
    head_dim = attention_head_dim(args)
    if head_dim is None:
        return "the head dim is unknown"
    try:
        found = problem(head_dim, "bf16" if getattr(args, "bf16", False) else "fp16",
                        backward=getattr(args, "cp_fused_backward", False))
    except Exception as error:  # noqa: BLE001 - whatever Triton raises, the unfused path runs
        first = (str(error).splitlines() or [""])[0][:200]
        found = f"checking its kernel raised {type(error).__name__}: {first}"
    return found


def choose_attention_path(args, cuda_available: bool, problem=device_problem) -> None:
    """Sets args.cp_fused_forward and args.cp_concurrent_calls where they are None (not
    given): the rules in the module's docstring. A fused forward that cannot be the default on
    CUDA is said once, with why."""
    ring = args.context_parallel_size > 1 and args.context_parallel_algo != "ulysses"
    batched = getattr(args, "cp_ring_exchange", "batched") != "steps"
    if getattr(args, "cp_fused_forward", None) is None:
        reason = why_not_fused(args, problem) if cuda_available else "no CUDA"
        args.cp_fused_forward = reason is None
        if reason is not None and cuda_available:
            warnings.warn(f"the attention forward runs unfused (PyTorch's flash kernels), not "
                          f"as the fused Triton kernel that is the default on GPUs: {reason}; "
                          f"--no-cp-fused-forward says so without this note")
    if getattr(args, "cp_concurrent_calls", None) is None:
        args.cp_concurrent_calls = cuda_available and ring and batched
