#!/usr/bin/env python3
"""What a GPU machine offers the project, before anything long runs on it.

    python tools/gpu_env_report.py [--cpu]

Prints the versions (Python, torch, CUDA, megatron-core, Triton, flash-attn, TransformerEngine),
the GPU, the attention backend get_backend picks for bf16, whether Megatron-LM's trainer
imports ($MEGATRON_LM_PATH), and runs one small bf16 varlen forward+backward on the GPU.
Exits 1, saying what is missing, when there is no CUDA device or a package the GPU checks need
does not import (scripts/gpu_checks.sh runs it as its first stage). --cpu runs the same
report on the CPU (float32, the exact CPU kernel): a test keeps the tool working without a GPU.
"""

import importlib
import os
import platform
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NEEDED = ("torch", "numpy", "megatron.core", "einops", "pytest", "pytest_timeout", "hypothesis")
OPTIONAL = ("triton", "flash_attn", "transformer_engine", "apex")


def version(name):
    try:
        with warnings.catch_warnings():  # megatron-core warns that TE/Apex are absent
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - report any import failure, do not stop
        return None, f"{type(error).__name__}: {error}"
    return module, getattr(module, "__version__", "imported")


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="the same report on the CPU (float32, the exact CPU kernel)")
    cpu = parser.parse_args(argv).cpu
    missing = []
    print(f"Python {platform.python_version()} ({sys.executable})")
    for name in NEEDED + OPTIONAL:
        _, text = version(name)
        print(f"  {name:20s} {text}")
        if name in NEEDED and _ is None:
            missing.append(name)
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (carry them: scripts/fetch_offline_wheels.sh)")

    import torch

    if cpu:
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        sys.exit(f"torch {torch.__version__} sees no CUDA device")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {torch.cuda.device_count()} x {props.name}, "
              f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
              f"CUDA {torch.version.cuda}")
    megatron_lm = os.environ.get("MEGATRON_LM_PATH", "")
    training = os.path.join(megatron_lm, "megatron", "training")
    print(f"Megatron-LM trainer: {megatron_lm or 'MEGATRON_LM_PATH unset'} "
          f"({'present' if os.path.isdir(training) else 'absent: its tests skip'})")

    from megatron_eod.attention.backends import get_backend
    from megatron_eod.plan.kv_schedule import call_from_rows
    import numpy as np

    backend = get_backend(device, dtype)
    print(f"attention backend for {dtype}: {backend.name}")
    docs = [np.arange(0, 100), np.arange(100, 356)]
    call = call_from_rows(docs, docs, causal=True).to(device)
    q, k, v = (torch.randn(356, 4, 64, device=device, dtype=dtype) for _ in range(3))
    out, lse = backend.forward(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                               call.max_seqlen_k, True, 0.125)
    grads = backend.backward(torch.ones_like(out), q, k, v, out, lse, call.cu_seqlens_q,
                             call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k, True, 0.125)
    if device.type == "cuda":
        torch.cuda.synchronize()
    finite = all(torch.isfinite(t.float()).all().item() for t in (out, lse, *grads))
    print(f"one varlen forward+backward on {device.type}: out {tuple(out.shape)}, "
          f"finite: {finite}")
    if not finite:
        sys.exit("the varlen kernel returned non-finite values")


if __name__ == "__main__":
    main()
