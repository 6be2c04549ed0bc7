"""The model flags (mixture of experts, multi-latent attention, the hybrid layer pattern)
megatron-core cannot run beside EoD attention.

One job: `check_moe(args, cuda_available)`, `check_mla(args)` and
`check_hybrid_pattern(args)`, after Megatron-LM's validate_args, raise FlagError naming the
flag and the rule. MoE itself is megatron-core's own
layer (router, token dispatcher, experts) in megatron-core's decoder block spec
(megatron/layer_spec.py); the router counts tokens, not attention pairs, so the document mask
and where CP puts a token change nothing of it (tests/functional/test_moe_training.py: CP=4 ==
CP=1, the load-balancing loss too). Refused:

* `--moe-router-load-balancing-type seq_aux_loss` with `--micro-batch-size` > 1: a
  micro-batch's rows travel packed as ONE sequence (the plan separates documents), so the
  per-sequence balance would span rows;
* `--num-experts` with biases (no `--disable-bias-linear`) under `--transformer-impl local`,
  expert TP 1, without `--moe-grouped-gemm`: megatron-core's sequential experts add their bias
  in place on a view its tensor-parallel reduce returns, a RuntimeError at the first step on
  every rank (megatron-core 0.16-0.19);
* `--moe-grouped-gemm` without CUDA: its grouped GEMMs are TransformerEngine's or the
  grouped_gemm package's CUDA kernels;
* `--multi-latent-attention` on megatron-core 0.16 without TransformerEngine: its MLA tests
  its projection against TransformerEngine's class, which 0.16 then leaves a stand-in (a
  TypeError when the model is built, stock megatron-core's too);
* `--hybrid-layer-pattern` symbols pretrain_hybrid.py does not build (HYBRID_REFUSED, each
  with its reason), a pattern given to pretrain_gpt.py, or none given to pretrain_hybrid.py.

What it does not do: no model building (layer_spec.py), no other flags (args.py, cp_flags.py,
flag_rules.py).
"""

from __future__ import annotations

import importlib
import importlib.util

from packaging.version import Version

from megatron_eod.training.cp_flags import FlagError

__all__ = ["HYBRID_SYMBOLS", "check_hybrid_pattern", "check_mla", "check_moe"]

# --hybrid-layer-pattern symbols pretrain_hybrid.py does not build, and why.
HYBRID_REFUSED = {
    "M": "Mamba-2 layers carry a state across tokens, which must restart at every document: "
         "megatron-core's take document boundaries only as packed_seq_params in its own CP "
         "token order, not the EoD plan's, and need mamba_ssm and causal-conv1d (CUDA)",
    "G": "Gated DeltaNet layers carry a state across tokens, which must restart at every "
         "document: megatron-core's take document boundaries only as packed_seq_params in its "
         "own CP token order, not the EoD plan's, and need flash-linear-attention (CUDA)",
    "D": "DeepSeek sparse attention builds its own mask and top-k index, which do not know "
         "the documents",
    "+": "MLA layers in a hybrid stack are not wired; pretrain_gpt.py runs "
         "--multi-latent-attention",
    "/": "multi-token prediction in a hybrid stack is not wired; pretrain_gpt.py runs "
         "--mtp-num-layers",
}
# The symbols it builds: attention, dense MLP, MoE, and pipeline boundaries.
HYBRID_SYMBOLS = "*-E|"


def _balancing_types(args):
    kind = getattr(args, "moe_router_load_balancing_type", None) or []
    return [kind] if isinstance(kind, str) else list(kind)


def check_moe(args, cuda_available: bool) -> None:
    """The rules in the module's docstring; nothing without --num-experts."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return
    rows = args.micro_batch_size
    if "seq_aux_loss" in _balancing_types(args) and rows > 1:
        raise FlagError(f"--moe-router-load-balancing-type seq_aux_loss with --micro-batch-size "
                        f"{rows}: EoD attention packs a micro-batch's rows into one sequence, so "
                        f"megatron-core's per-sequence balance would span {rows} rows; use "
                        f"aux_loss or global_aux_loss, or --micro-batch-size 1")
    grouped = getattr(args, "moe_grouped_gemm", False)
    if grouped and not cuda_available:
        raise FlagError("--moe-grouped-gemm needs CUDA (TransformerEngine's or the grouped_gemm "
                        "package's kernels); drop it on CPU: the experts then run one after "
                        "another")
    expert_tp = getattr(args, "expert_tensor_parallel_size", None) or \
        args.tensor_model_parallel_size
    if getattr(args, "add_bias_linear", False) and not grouped and expert_tp == 1 and \
            getattr(args, "transformer_impl", "local") == "local":
        raise FlagError(f"--num-experts {experts} with biases on the linear layers (Megatron-LM's "
                        f"default) and --transformer-impl local: megatron-core's sequential "
                        f"experts add their bias in place on a view and stop at the first step "
                        f"(RuntimeError on every rank); pass --disable-bias-linear (as MoE "
                        f"models usually do)" + (" or --moe-grouped-gemm" if cuda_available
                                                 else ""))


def check_mla(args) -> None:
    """--multi-latent-attention where megatron-core can build it (the module's docstring)."""
    if not getattr(args, "multi_latent_attention", False):
        return
    version = Version(importlib.import_module("megatron.core").__version__)
    if version < Version("0.17") and importlib.util.find_spec("transformer_engine") is None:
        raise FlagError(f"--multi-latent-attention with megatron-core {version} needs "
                        f"TransformerEngine: its MLA cannot be built without it there (a "
                        f"TypeError); install TransformerEngine or use megatron-core >= 0.17")


def check_hybrid_pattern(args) -> None:
    """--hybrid-layer-pattern with the entry it needs: pretrain_hybrid.py (args.eod_model
    "hybrid") needs one of symbols it builds (HYBRID_SYMBOLS, or HYBRID_REFUSED's line),
    pretrain_gpt.py takes none."""
    pattern = getattr(args, "hybrid_layer_pattern", None) or \
        getattr(args, "hybrid_override_pattern", None)
    if getattr(args, "eod_model", "gpt") != "hybrid":
        if pattern:
            raise FlagError(f"--hybrid-layer-pattern {pattern!r} builds Megatron-LM's "
                            f"HybridModel: launch pretrain_hybrid.py (the same flags)")
        return
    if not pattern:
        raise FlagError("pretrain_hybrid.py needs --hybrid-layer-pattern, one symbol a layer: "
                        "'*' attention, '-' dense MLP, 'E' MoE (e.g. '*-*-' is a 2-layer GPT)")
    for symbol in dict.fromkeys(pattern):
        if symbol in HYBRID_REFUSED:
            raise FlagError(f"--hybrid-layer-pattern {pattern!r}: '{symbol}': "
                            f"{HYBRID_REFUSED[symbol]}")
        if symbol not in HYBRID_SYMBOLS:
            raise FlagError(f"--hybrid-layer-pattern {pattern!r}: '{symbol}' is not a layer "
                            f"symbol pretrain_hybrid.py builds ({', '.join(HYBRID_SYMBOLS)})")
