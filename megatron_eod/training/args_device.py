"""The lean trainer's device flags: precision (--bf16/--fp16 -> params_dtype), the attention
and cross-entropy implementations, --distributed-backend (its default: nccl on CUDA, gloo
without) and --deterministic-mode, each checked at start-up against the machine (CUDA or not)
and the packages installed, with a FlagError naming the flag and the rule.

What it does not do: no CP rules (cp_flags.py), no rules Megatron-LM's trainer shares
(flag_rules.py; this module calls them).
"""

from __future__ import annotations

import os

import torch

from megatron_eod.attention.backends import has_transformer_engine
from megatron_eod.training.cp_flags import FlagError, check_gloo_on_cuda, check_gpu_attention
from megatron_eod.training.flag_rules import (check_backend_device, check_device_precision,
                                              check_rank_order)

__all__ = ["check_device_flags"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def check_device_flags(args, cuda_available: bool) -> None:
    """Check the flags above and set args.params_dtype and args.distributed_backend."""
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; pass one")
    check_device_precision(args, cuda_available)
    args.params_dtype = (torch.bfloat16 if args.bf16 else
                         torch.float16 if args.fp16 else torch.float32)
    check_gpu_attention(args, cuda_available)
    _require(not (args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te")
             or has_transformer_engine(),
             "--cross-entropy-fusion-impl te needs the transformer_engine package; pass "
             "--cross-entropy-fusion-impl native or install it")
    if args.transformer_impl == "transformer_engine":
        _require(cuda_available, "--transformer-impl transformer_engine needs CUDA; pass "
                                 "--transformer-impl local on CPU")
        _require(has_transformer_engine(), "--transformer-impl transformer_engine needs the "
                                           "transformer_engine package; pass --transformer-impl "
                                           "local or install it")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    check_backend_device(args, cuda_available)
    check_rank_order(args)
    check_gloo_on_cuda(args, cuda_available)
    _check_deterministic(args, cuda_available)


# What torch's cuBLAS calls and Megatron-LM's --deterministic-mode check accept.
CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")
NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def _check_deterministic(args, cuda_available: bool) -> None:
    """--deterministic-mode's rules, checked at start-up: Megatron-LM's (no fused cross
    entropy; NCCL_ALGO pinned), and the CUBLAS_WORKSPACE_CONFIG that torch would otherwise
    ask for only at the first matmul, after the model and the data were built."""
    if not args.deterministic_mode:
        return
    _require(not args.cross_entropy_loss_fusion,
             "--deterministic-mode with --cross-entropy-loss-fusion: the fused cross entropy "
             "is not deterministic (Megatron-LM refuses it too); drop one")
    if not cuda_available:
        return
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    _require(cublas in CUBLAS_WORKSPACE_CONFIGS,
             f"--deterministic-mode on CUDA needs the environment variable "
             f"CUBLAS_WORKSPACE_CONFIG set to {' or '.join(CUBLAS_WORKSPACE_CONFIGS)} (torch's "
             f"rule for deterministic cuBLAS), got {cublas!r}")
    algo = os.environ.get("NCCL_ALGO")
    _require(args.distributed_backend != "nccl" or algo in NCCL_ALGOS,
             f"--deterministic-mode with NCCL needs the environment variable NCCL_ALGO set to "
             f"one of {', '.join(NCCL_ALGOS)} (Megatron-LM's rule: one reduction order), got "
             f"{algo!r}")
