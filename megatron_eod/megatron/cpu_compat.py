"""Run megatron-core 0.16 (and Megatron-LM's own trainer) on CPUs with gloo: one table of
patches, applied by `apply()` only on a machine without CUDA, plus the "torch-adamw" fixes
that megatron-core's distributed optimizer needs on any device where it uses torch's AdamW.

One job: let the unmodified megatron-core GPT stack (parallel_state, tensor-parallel layers,
RNG tracker, GPTModel, RoPE, DDP, optimizers, dist_checkpointing) and, with
`apply(megatron_lm=True)`, Megatron-LM's `pretrain()` run without a GPU, for tests and the
CPU quickstart. On GPUs both run as shipped. The stand-ins live in cpu_stand_ins.py.

Scope "core" (every CPU run):

| target                                           | why it breaks on CPU                      |
|--------------------------------------------------|-------------------------------------------|
| `torch.cuda.current_device`                      | ~40 call sites pass it as `device=`       |
| `torch.Tensor.cuda`, `torch.nn.Module.cuda`      | "move to the GPU" (GPTModel's tied        |
|                                                  | embedding, Megatron-LM's get_model): the  |
|                                                  | CPU is the device, so they return self    |
| `tensor_parallel.random.CudaRNGStatesTracker`,   | seed/fork/save CUDA generators; on CPU    |
| `_get_cuda_rng_state`, `_set_cuda_rng_state`     | the device generator is the CPU one       |
| `transformer.utils.get_default_causal_mask` (and | hard-codes device="cuda"                  |
| its by-name import in `fusions.fused_softmax`)   |                                           |
| `rope_utils.get_pos_emb_on_this_cp_rank` (and    | pin_memory() + .cuda() on the CP index    |
| its by-name imports in `rotary_pos_embedding`,   | (YaRN, MLA's RoPE, calls it when built)   |
| `yarn_rotary_pos_embedding`)                     |                                           |
| module `torch` of core's schedules, pipeline p2p,| `device="cuda"` tensors (random ones from |
| utils, optimizer, clip_grads, DDP and its        | their own generator, as a GPU draws from  |
| buffers, rerun state machine, dist_checkpointing | its own), synchronize, streams, memory    |
| strategies                                       | reports, CUDA RNG state                   |
| module `torch` of core's MoE dispatcher, layer,  | CUDA streams and events (device-to-host   |
| utilities and shared experts                     | copies, overlap), device tensors          |
| `moe_utils.maybe_move_tensor_to_cpu` (and its    | copies split sizes to the host as numpy   |
| by-name import in `moe.token_dispatcher`)        | only from CUDA: gloo's all-to-all refused |
|                                                  | the CPU tensors (expert parallelism)      |
| `torch.nn.Parameter.type`                        | optimizers group params by CUDA type name |
| `clip_grad_by_total_norm_fp32` (clip_grads and   | asserts torch.cuda.FloatTensor gradients  |
| its by-name import in optimizer.optimizer)       |                                           |
| `filesystem_async._get_write_results_queue`      | spawns a Manager process per rank (~270 MB|
|                                                  | each, outlives forked ranks); a sync save |
|                                                  | needs an in-process queue only            |
| `schedules.deallocate_output_tensor`             | frees a stage output while gloo's async   |
|                                                  | send still reads it (the interleaved      |
|                                                  | schedule sent garbage): kept until its    |
|                                                  | backward                                  |

Scope "torch-adamw" (with "core" on CPU; `apply_torch_adamw_fixes()` on ANY device where
megatron-core falls back to torch's AdamW, i.e. neither TransformerEngine nor Apex):

| target                                           | why it breaks                             |
|--------------------------------------------------|-------------------------------------------|
| `DistributedOptimizer.sharded_state_dict`        | loading a torch_dist checkpoint asserts   |
|                                                  | on the empty state of an unstepped AdamW  |
| `..._set_main_param_and_optimizer_states`        | copies into leaf views with grad on, and  |
|                                                  | copies "step" from sources that have none |
| `DistributedOptimizer.load_state_dict`           | all params end up sharing ONE "step"      |
|                                                  | tensor (AdamW then counts it N times)     |

Scope "megatron-lm" (`apply(megatron_lm=True)`: Megatron-LM's trainer on CPU):

| target                                           | why it breaks on CPU                      |
|--------------------------------------------------|-------------------------------------------|
| `sys.modules[...batch_invariant_kernels]`        | imports Triton (absent from CPU torch)    |
| module `torch` of Megatron-LM's initialize,      | as in "core"; initialize also asserts     |
| training, utils, checkpointing                   | CUDA and seeds only if device_count() > 0 |
| `megatron.legacy.fused_kernels.load`             | probes nvcc (no fused kernels are used)   |
| `initialize._warmup_jit_function`                | compiles the bias-gelu and bias-dropout-  |
|                                                  | add fusions with inductor, ~7 s a rank at |
|                                                  | every launch; the fusion flags are off on |
|                                                  | CPU, so nothing it compiles is used       |
| `training.build_pretraining_data_loader`         | each loader's iterator draws its workers' |
|                                                  | base seed from the default generator,     |
|                                                  | which on CPU is also the device one: a    |
|                                                  | resumed run's dropout masks shifted (on a |
|                                                  | GPU they come from the CUDA generator);   |
|                                                  | the loaders get a generator of their own  |

What it does not do: nothing at import time, no walking of loaded modules, no patches for
features the CPU path does not use (TransformerEngine, fused kernels, CUDA graphs, fp16/bf16).
Keep the fusion flags off on CPU. `remove()` restores every original (used by tests).
"""

from __future__ import annotations

import importlib
import importlib.util
import queue
from typing import Callable, Dict, List, Tuple

import torch

from megatron_eod.megatron import cpu_stand_ins as stand_ins

__all__ = ["apply", "apply_torch_adamw_fixes", "uses_torch_adamw", "remove", "is_applied",
           "PATCHES"]

_MISSING = object()


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's zigzag slice (chunks r and 2*cp-1-r of 2*cp), on the tensor's own device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def _stays(tensor_or_module, *args, **kwargs):
    return tensor_or_module


def _batch_invariant_kernels():
    if importlib.util.find_spec("triton") is not None:
        return importlib.import_module(_BATCH_INVARIANT)
    return stand_ins.batch_invariant_kernels_module()


_DIST_OPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def _loader_with_own_generator(build):
    """Megatron-LM's loader builder whose DataLoaders draw their workers' base seed from a
    generator of their own, not from the default one (the device generator on CPU)."""

    def build_pretraining_data_loader(*args, **kwargs):
        loader = build(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(0)
        return loader

    return build_pretraining_data_loader


def _sharded_state_dict_with_state():
    original = _originals[(_DIST_OPT, "sharded_state_dict")]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:  # states to load into (TE/Apex make them)
            self._init_optimizer_states_with_dummy_values()
        return original(self, model_sharded_state_dict, is_loading, **kwargs)

    return sharded_state_dict


def _load_state_dict_with_own_steps():
    original = _originals[(_DIST_OPT, "load_state_dict")]

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        steps = {group["step"] for group in state_dict["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise ValueError(f"optimizer checkpoint has several steps {sorted(steps)}")
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            state["step"] = torch.tensor(step)  # one tensor per parameter, as torch keeps it

    return load_state_dict


def _set_states_without_step():
    """The original copies every state of the destination, "step" included, from a source
    that never has one (the fully_reshardable load drops it); and copies into leaf views with
    grad enabled. Copy the states both have, without grad; steps come from load_state_dict."""
    original = _originals[(_DIST_OPT, "_set_main_param_and_optimizer_states")]

    @torch.no_grad()
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, tensor in destination.items():
            if key in tensors:
                tensor.copy_(tensors[key])

    return set_states


_RESULTS_QUEUE = queue.Queue()


def _in_process_results_queue():
    """A synchronous torch_dist save gathers its write results in the saving process itself;
    the original starts a spawned multiprocessing Manager per process for them (~270 MB and
    seconds each, and it outlives forked test ranks)."""
    return lambda: _RESULTS_QUEUE


_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_TORCH_ON_CPU = lambda: stand_ins.TorchOnCpu()  # noqa: E731
_CORE_TORCH = [  # megatron-core modules whose global `torch` becomes TorchOnCpu
    "megatron.core.timers", "megatron.core.utils", "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    # MoE: the all-to-all dispatcher's device-to-host stream, shared experts' stream, the
    # router's and utilities' device tensors
    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.shared_experts",
]
_MEGATRON_LM_TORCH = [  # Megatron-LM's trainer modules whose global `torch` becomes TorchOnCpu
    "megatron.training.training", "megatron.training.checkpointing",
    "megatron.training.utils.common_utils|megatron.training.utils",  # a package from 0.18
]

# (target, attribute, replacement factory, scope). A target is a module, a class inside one
# ("package.module:Class") or a dict ("sys:modules", the attribute is then a key); "a|b" in
# either names what a later megatron-core moved or renamed: the first the installed one has;
# "module?" a module a later version dropped (the row is then skipped). Factories
# run at apply() time, after every original of the scope is saved.
PATCHES: List[Tuple[str, str, Callable[[], object], str]] = [
    ("torch.cuda", "current_device", lambda: (lambda: "cpu"), "core"),
    ("torch:Tensor", "cuda", lambda: _stays, "core"),
    ("torch.nn:Module", "cuda", lambda: _stays, "core"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker",
     stand_ins.cpu_rng_tracker_class, "core"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
     lambda: (lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
     "core"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
     lambda: (lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
     "core"),
    ("megatron.core.transformer.utils", "get_default_causal_mask",
     lambda: _default_causal_mask, "core"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask",
     lambda: _default_causal_mask, "core"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
     lambda: _pos_emb_on_this_cp_rank, "core"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding",
     "get_pos_emb_on_this_cp_rank", lambda: _pos_emb_on_this_cp_rank, "core"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
     "get_pos_emb_on_this_cp_rank", lambda: _pos_emb_on_this_cp_rank, "core"),
    *[(module, "torch", _TORCH_ON_CPU, "core") for module in _CORE_TORCH],
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
     lambda: stand_ins.host_copy, "core"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
     lambda: stand_ins.host_copy, "core"),
    ("torch.nn:Parameter", "type", lambda: stand_ins.parameter_type, "core"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
     lambda: stand_ins.clip_grad_by_total_norm_fp32, "core"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
     lambda: stand_ins.clip_grad_by_total_norm_fp32, "core"),
    (_DIST_OPT, "sharded_state_dict", _sharded_state_dict_with_state, "torch-adamw"),
    (_DIST_OPT, "_set_main_param_and_optimizer_states", _set_states_without_step,
     "torch-adamw"),
    (_DIST_OPT, "load_state_dict", _load_state_dict_with_own_steps, "torch-adamw"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async",  # public from 0.17
     "_get_write_results_queue|get_write_results_queue", _in_process_results_queue, "core"),
    ("megatron.core.pipeline_parallel.schedules", "deallocate_output_tensor",
     lambda: stand_ins.deallocate_output_after_send, "core"),
    ("sys:modules", _BATCH_INVARIANT, _batch_invariant_kernels, "megatron-lm"),
    ("megatron.training.initialize", "torch",
     lambda: stand_ins.TorchOnCpu(claims_device=True), "megatron-lm"),
    *[(module, "torch", _TORCH_ON_CPU, "megatron-lm") for module in _MEGATRON_LM_TORCH],
    ("megatron.legacy.fused_kernels?", "load", lambda: (lambda args: None),  # not in wheels
     "megatron-lm"),
    ("megatron.training.initialize", "_warmup_jit_function",  # 0.19 adds tp_size=
     lambda: (lambda *args, **kwargs: None), "megatron-lm"),
    ("megatron.training.training", "build_pretraining_data_loader",
     lambda: _loader_with_own_generator(
         _originals[("megatron.training.training", "build_pretraining_data_loader")]),
     "megatron-lm"),
]

_originals: Dict[Tuple[str, str], object] = {}
_scopes: List[str] = []


def _target(name: str):
    """A module, a class inside one ("package.module:Class") or a dict ("sys:modules")."""
    module_name, _, inner = name.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, inner) if inner else module


def _resolve(name: str, attr: str):
    """The spellings of a row ("a|b" in target or attribute: moved or renamed in a later
    megatron-core) that the installed version has: the first target that imports, and its
    first attribute found. None for an optional row ("module?") when no target imports."""
    names, spellings = name.rstrip("?").split("|"), attr.split("|")
    if len(names) == len(spellings) == 1 and not name.endswith("?"):
        return name, attr
    imported = False
    for candidate in names:
        try:
            target = _target(candidate)
        except ImportError:
            continue
        imported = True
        for spelling in spellings:
            if (spelling in target) if isinstance(target, dict) else hasattr(target, spelling):
                return candidate, spelling
    if name.endswith("?") and not imported:
        return None
    raise AttributeError(f"none of {names} has any of {spellings} (megatron-core "
                         f"{importlib.import_module('megatron.core').__version__})")


def _get(name: str, attr: str):
    target = _target(name)
    if isinstance(target, dict):
        return target.get(attr, _MISSING)
    # The class's own attribute (not an inherited one), so remove() restores exactly it.
    return vars(target).get(attr, _MISSING) if isinstance(target, type) else getattr(target, attr)


def _set(name: str, attr: str, value) -> None:
    target = _target(name)
    if isinstance(target, dict):
        if value is _MISSING:
            target.pop(attr, None)
        else:
            target[attr] = value
    elif value is _MISSING:
        delattr(target, attr)
    else:
        setattr(target, attr, value)


def is_applied() -> bool:
    return bool(_scopes)


def uses_torch_adamw() -> bool:
    """Whether megatron-core's optimizers fall back to torch's Adam/AdamW (neither
    TransformerEngine's nor Apex's fused Adam imports): the "torch-adamw" rows are needed."""
    return bool(importlib.import_module("megatron.core.optimizer").USING_PYTORCH_OPTIMIZER)


def apply_torch_adamw_fixes() -> bool:
    """On ANY device: the "torch-adamw" rows (megatron-core 0.16.1's distributed optimizer with
    torch's AdamW cannot resume a torch_dist checkpoint without them), when that fallback is
    in use. Idempotent; True when they are in effect."""
    if not uses_torch_adamw():
        return False
    _apply_scopes(["torch-adamw"])
    return True


def apply(force: bool = False, megatron_lm: bool = False) -> bool:
    """Apply the "core" patches once (idempotent), the "torch-adamw" ones where megatron-core
    uses torch's AdamW, and the "megatron-lm" ones too when asked (they import Megatron-LM's
    `megatron.training`). Returns True when the patches are in effect. Without `force`, does
    nothing on a machine where CUDA is available (call apply_torch_adamw_fixes there)."""
    if torch.cuda.is_available() and not force:
        return False
    _apply_scopes(["core"] + (["torch-adamw"] if uses_torch_adamw() else [])
                  + (["megatron-lm"] if megatron_lm else []))
    from megatron.core.tensor_parallel import random as mc_random

    # A tracker built before apply() is a CUDA one; the next seeding must build ours.
    mc_random.initialize_rng_tracker(force_reset=True)
    return True


def _apply_scopes(wanted) -> None:
    for scope in wanted:
        if scope in _scopes:
            continue
        # The Triton stand-in must be in place before Megatron-LM's modules are imported
        # (resolving a row imports its module).
        rows = sorted((row for row in PATCHES if row[3] == scope),
                      key=lambda row: row[0] != "sys:modules")
        resolved = []
        for name, attr, make, _ in rows:
            found = _resolve(name, attr)
            if found is None:
                continue
            _originals[found] = _get(*found)
            if name == "sys:modules":
                _set(*found, make())
            else:
                resolved.append((*found, make))
        for name, attr, make in resolved:
            _set(name, attr, make())
        _scopes.append(scope)


def remove() -> None:
    """Restore every original (for tests); a no-op when nothing is applied."""
    if not _scopes:
        return
    for (name, attr), original in reversed(list(_originals.items())):
        _set(name, attr, original)
    _originals.clear()
    _scopes.clear()
    stand_ins.forget_pending_sends()
    from megatron.core.tensor_parallel import random as mc_random

    mc_random.initialize_rng_tracker(force_reset=True)
