"""What `cpu_compat` puts in place of megatron-core's and Megatron-LM's CUDA-only pieces.

One job: small CPU stand-ins, each doing on the CPU what the original does on a GPU (or
nothing, where the original only manages a device that is not there). The table that says
where each one goes, and why, is `cpu_compat.PATCHES`; nothing here is applied on import.

What it does not do: no fused kernels, no CUDA graphs, no TransformerEngine, no mixed
precision (the CPU attention kernel takes float32/float64).
"""

from __future__ import annotations

import contextlib
import types

import torch

__all__ = ["TorchOnCpu", "cpu_rng_tracker_class", "clip_grad_by_total_norm_fp32",
           "parameter_type", "batch_invariant_kernels_module", "deallocate_output_after_send",
           "forget_pending_sends", "host_copy"]


def _on_cpu(device):
    """"cuda", "cuda:N", an int ordinal or a CUDA torch.device -> "cpu"; others unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
              "ones_like", "empty_like", "full_like")
_RANDOM = ("rand", "randn", "randint", "randperm")

# What a GPU draws "cuda" random tensors from: not the CPU generator. Megatron-LM's JIT warm-up
# draws [seq/cp, mbs, ffn] random tensors on the device; drawn from the CPU generator they would
# change every parameter initialised from it later (learned position embeddings) with CP size.
DEVICE_GENERATOR = torch.Generator()


def _factory_on_cpu(factory, random: bool = False):
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _on_cpu(device)
            if random and kwargs["device"] != device and kwargs.get("generator") is None:
                kwargs["generator"] = DEVICE_GENERATOR
        return factory(*args, **kwargs)

    return make


class _NoStream:
    """A CUDA stream/event that orders nothing: on the CPU every op is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # wait_stream, synchronize, wait_event, ...
        return lambda *args, **kwargs: None

    def record_event(self, *args, **kwargs):  # the event it returns (MoE's dispatcher waits)
        return _NoStream()

    def query(self):  # done
        return True


class _CudaOnCpu:
    """`torch.cuda` as seen by a module that manages "the" device: one device, the CPU.

    `claims_device` answers is_available()/device_count() as if a GPU were there (only for
    Megatron-LM's start-up, which asserts CUDA and seeds the model-parallel RNG only when
    device_count() > 0); elsewhere they tell the truth."""

    def __init__(self, claims_device: bool):
        self._claims = claims_device

    def is_available(self):
        return self._claims or torch.cuda.is_available()

    def device_count(self):
        return 1 if self._claims else torch.cuda.device_count()

    current_device = staticmethod(lambda: "cpu")
    set_device = synchronize = empty_cache = reset_peak_memory_stats = staticmethod(
        lambda *args, **kwargs: None)
    memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = (
        staticmethod(lambda *args, **kwargs: 0))
    memory_stats = staticmethod(lambda *args, **kwargs: {})
    get_device_properties = staticmethod(lambda *args: types.SimpleNamespace(
        name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0))
    get_rng_state = staticmethod(lambda *args, **kwargs: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *args, **kwargs: torch.set_rng_state(state))
    manual_seed = manual_seed_all = staticmethod(lambda seed: DEVICE_GENERATOR.manual_seed(seed))
    Stream = Event = _NoStream
    current_stream = default_stream = staticmethod(lambda *args: _NoStream())
    stream = staticmethod(lambda *args: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_PENDING_SENDS: list = []  # gloo sends still unmatched whose handle the caller may drop


def _kept(work):
    """Hold an asynchronous send's handle until the send is done. megatron-core's schedules
    drop some unwaited (the last forward send of a forward-only pass with
    --overlap-p2p-communication-warmup-flush, the last of a steady state): NCCL finishes them
    anyway, gloo holds an unmatched send only through its handle and cancels it with the
    handle, and the receiving stage waits forever."""
    _PENDING_SENDS[:] = [w for w in _PENDING_SENDS if not w.is_completed()]
    _PENDING_SENDS.append(work)
    return work


def forget_pending_sends() -> None:
    """Drop the held send handles (when the CPU patches are removed)."""
    _PENDING_SENDS.clear()


class _DistributedKeepingSends:
    """`torch.distributed` whose `isend` keeps its handle until the send is done (`_kept`)."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def isend(*args, **kwargs):
        return _kept(torch.distributed.isend(*args, **kwargs))

    @staticmethod
    def P2POp(op, *args, **kwargs):  # torch accepts its own isend only
        if op is _DistributedKeepingSends.isend:
            op = torch.distributed.isend
        return torch.distributed.P2POp(op, *args, **kwargs)

    @staticmethod
    def batch_isend_irecv(ops):
        return [_kept(work) for work in torch.distributed.batch_isend_irecv(ops)]


class TorchOnCpu:
    """`torch` for one module's global name `torch`: tensor factories asked for a CUDA
    device allocate on the CPU (random ones drawing from DEVICE_GENERATOR, as a GPU draws from
    its own), `torch.cuda` is `_CudaOnCpu` and `torch.distributed.isend` keeps its handle
    until the send is done (`_kept`). Everything else is torch."""

    distributed = _DistributedKeepingSends()

    def __init__(self, claims_device: bool = False):
        self.cuda = _CudaOnCpu(claims_device)

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES or name in _RANDOM:
            return _factory_on_cpu(value, random=name in _RANDOM)
        return value


def cpu_rng_tracker_class():
    """megatron-core's RNG tracker with named CPU generator states instead of CUDA ones."""
    from megatron.core.tensor_parallel import random as mc_random

    class CPURNGStatesTracker(mc_random.CudaRNGStatesTracker):
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


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clipping (scale every gradient by max_norm / total_norm when that is
    below 1), without its assertion that gradients are torch.cuda.FloatTensor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            if grad.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"gradient clipping expects float32 gradients, got {grad.dtype}")
            grads.append(grad.detach())
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)


_TENSOR_TYPE = torch.Tensor.type


def parameter_type(self, dtype=None, non_blocking=False, **kwargs):
    """`Parameter.type()` naming a CPU parameter as its CUDA type ("torch.cuda.FloatTensor"):
    megatron-core's optimizers sort parameters into fp32/fp16/bf16 groups by those names.
    With a dtype argument it converts, as torch does."""
    result = _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)
    if dtype is None and result.startswith("torch.") and not result.startswith("torch.cuda."):
        return "torch.cuda." + result[len("torch."):]
    return result


def deallocate_output_after_send(out, deallocate_pipeline_outputs=False):
    """megatron-core's `deallocate_output_tensor` frees a stage's output right after handing
    it to an asynchronous send, by swapping its `.data` for one element. On a GPU the caching
    allocator keeps the old memory until NCCL's stream has read it. Gloo sends from a
    background thread out of the old memory, which was then free: the interleaved schedule
    (virtual pipeline stages, overlapped p2p) sent whatever reused it, and losses changed
    from run to run. Swap as the original does (its backward expects one element), but keep
    the old memory alive with the tensor, until the schedule drops it after backward."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if isinstance(out, (list, dict)):  # from megatron-core 0.17: a stage's outputs
        for item in out.values() if isinstance(out, dict) else out:
            deallocate_output_after_send(item, deallocate_pipeline_outputs)
        return
    if not isinstance(out, torch.Tensor) or out._base is not None:
        raise AssertionError("expected a Tensor that is not a view, the schedule's output")
    if hasattr(out, "_eod_sent_data"):  # again (the warmup flush's last output is freed by
        return                          # two calls): keep the memory the send still reads
    out._eod_sent_data = out.data  # same memory as the send reads
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def batch_invariant_kernels_module():
    """Stands in for megatron-core's Triton batch-invariant kernels, imported by Megatron-LM's
    start-up; CPU torch has no Triton. Enabling the mode (--batch-invariant-mode) raises."""
    module = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs Triton kernels on a GPU")

    module.enable_batch_invariant_mode = module.set_batch_invariant_mode = \
        enable_batch_invariant_mode
    module.disable_batch_invariant_mode = lambda *args, **kwargs: None
    module.is_batch_invariant_mode_enabled = lambda: False
    return module


def host_copy(tensor, as_numpy=False, record_stream=False):
    """MoE's device-to-host copy of its split sizes (moe_utils.maybe_move_tensor_to_cpu): on
    the CPU already, but as numpy where asked (gloo's all_to_all_single takes a list-like of
    ints, not a tensor)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor
