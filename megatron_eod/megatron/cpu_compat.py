"""Run megatron-core 0.16 on CPUs with gloo: the whole list of patches, applied by one `apply()`.

One job: let the unmodified megatron-core GPT stack (parallel_state, tensor-parallel layers,
RNG tracker, GPTModel, RoPE) run on a machine without a GPU, for tests and the CPU quickstart.
`apply()` does nothing when CUDA is available: on GPUs megatron-core runs as shipped.

| target (megatron-core 0.16.1)                           | why it breaks on CPU                     |
|---------------------------------------------------------|------------------------------------------|
| `torch.cuda.current_device`                             | ~40 call sites pass it as `device=`;     |
|                                                         | returns "cpu" instead of raising         |
| `tensor_parallel.random.CudaRNGStatesTracker`           | seeds/forks CUDA generators; ours forks  |
|                                                         | the CPU generator (dropout, init on CPU) |
| `tensor_parallel.random._get/_set_cuda_rng_state`       | recompute saves/restores the "device"    |
|                                                         | RNG; on CPU that is the CPU generator    |
| `transformer.utils.get_default_causal_mask` (and its    | hard-codes device="cuda"                 |
| by-name import in `fusions.fused_softmax`)              |                                          |
| `rope_utils.get_pos_emb_on_this_cp_rank` (and its       | pin_memory() + .cuda() on the CP index   |
| by-name import in `rotary_pos_embedding`)               |                                          |
| `pipeline_parallel.schedules.torch` (the module's own   | each schedule counts tokens in           |
| reference to torch)                                     | `torch.zeros(..., device="cuda")`; the   |
|                                                         | proxy maps that one literal to the CPU   |
| `LanguageModule.setup_embeddings_and_output_layer`      | with PP > 1 it moves the tied embedding  |
|                                                         | with `.cuda()` before an all-reduce; the |
|                                                         | wrapper makes `.cuda()` a no-op inside   |

What it does not do: nothing at import time, no walking of loaded modules, no patches for
features the CPU path does not use (TransformerEngine, fused kernels, CUDA graphs, the
distributed optimizer). Keep the fusion flags (bias_activation_fusion, masked_softmax_fusion,
...) off on CPU. `remove()` restores every original (used by tests).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Dict, List, Tuple

import torch

__all__ = ["apply", "remove", "is_applied", "PATCHES"]


def _current_device() -> str:
    return "cpu"


def _get_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's zigzag slice (chunks r and 2*cp-1-r of 2*cp), on the tensor's own device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


class _TorchWithoutCudaZeros:
    """torch, except that `zeros(..., device="cuda")` allocates on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _embeddings_setup_on_cpu():
    original = _originals[(_LANGUAGE_MODULE, "setup_embeddings_and_output_layer")]

    def setup_embeddings_and_output_layer(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda

    return setup_embeddings_and_output_layer


_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module:LanguageModule"


def _target(name: str):
    """A module, or a class inside one ("package.module:Class")."""
    module_name, _, class_name = name.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mc_random

    class CPURNGStatesTracker(mc_random.CudaRNGStatesTracker):
        """Megatron's tracker with named CPU generator states instead of CUDA ones."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CPURNGStatesTracker


# (module, attribute, replacement factory). Factories run at apply() time, so importing this
# file imports nothing from megatron-core.
PATCHES: List[Tuple[str, str, Callable[[], object]]] = [
    ("torch.cuda", "current_device", lambda: _current_device),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", _cpu_rng_tracker_class),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", lambda: _get_rng_state),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", lambda: _set_rng_state),
    ("megatron.core.transformer.utils", "get_default_causal_mask", lambda: _default_causal_mask),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask",
     lambda: _default_causal_mask),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
     lambda: _pos_emb_on_this_cp_rank),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding",
     "get_pos_emb_on_this_cp_rank", lambda: _pos_emb_on_this_cp_rank),
    ("megatron.core.pipeline_parallel.schedules", "torch", _TorchWithoutCudaZeros),
    (_LANGUAGE_MODULE, "setup_embeddings_and_output_layer", _embeddings_setup_on_cpu),
]

_originals: Dict[Tuple[str, str], object] = {}


def is_applied() -> bool:
    return bool(_originals)


def apply(force: bool = False) -> bool:
    """Apply every patch once (idempotent). Returns True when the patches are in effect.

    Without `force`, does nothing on a machine where CUDA is available.
    """
    if _originals:
        return True
    if torch.cuda.is_available() and not force:
        return False
    for module_name, attr, make in PATCHES:
        _originals[(module_name, attr)] = getattr(_target(module_name), attr)
    # Build replacements only after every original is saved (the tracker subclasses one).
    for module_name, attr, make in PATCHES:
        setattr(_target(module_name), attr, make())
    from megatron.core.tensor_parallel import random as mc_random

    # A tracker built before apply() is a CUDA one; the next seeding must build ours.
    mc_random.initialize_rng_tracker(force_reset=True)
    return True


def remove() -> None:
    """Restore every original (for tests); a no-op when nothing is applied."""
    if not _originals:
        return
    for (module_name, attr), original in _originals.items():
        setattr(_target(module_name), attr, original)
    _originals.clear()
    from megatron.core.tensor_parallel import random as mc_random

    mc_random.initialize_rng_tracker(force_reset=True)
