"""`--distributed-backend gloo` on CUDA (several ranks sharing one GPU, as the GPU tests run
them, or a machine whose NCCL is unusable): what gloo cannot do with device
tensors, done another way.

One job, two changes, both made by `apply()` (our hook after Megatron-LM's validate_args) and
undone by `remove()` (the flags that cannot work there are refused by training/cp_flags.py's
`check_gloo_on_cuda`):
- megatron-core's DDP coalesces each bucket group's gradient reduction (and the distributed
  optimizer's parameter gather) with `torch.distributed._coalescing_manager`, which hands
  gloo `allreduce_coalesced`: CPU tensors only ("unsupported device type cuda"). The stand-in
  issues each bucket's collective on its own (gloo runs a single all-reduce, reduce-scatter
  or all-gather on CUDA tensors). It is synchronous: the trainer refuses --overlap-grad-reduce
  and --overlap-param-gather with gloo on CUDA (cp_flags), so megatron-core never asks it
  for a handle to wait on later.
- the attention's p2p and all-to-all go through host memory (comm's host staging): gloo
  sends and receives CPU tensors only.
And `share_devices(args)`, for Megatron-LM's trainer: its start-up sets the device to
`args.local_rank`, so more processes than GPUs on a node stopped at "invalid device ordinal";
a local rank beyond the visible GPUs runs on `local_rank % device_count`.

NCCL runs (every production GPU run) touch neither.
"""

from __future__ import annotations

import contextlib

from megatron_eod.attention import comm
from megatron_eod.megatron.imports import import_megatron

__all__ = ["apply", "remove", "share_devices", "uncoalesced", "wanted"]

_SAVED = {}


class _NothingInFlight:
    """What the stand-in yields: every collective inside it has already finished."""

    works = ()

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def uncoalesced(group=None, device=None, async_ops: bool = False):
    """`_coalescing_manager`'s signature; each collective inside runs on its own."""
    if async_ops:
        raise AssertionError("gloo on CUDA runs gradient collectives synchronously: "
                             "--overlap-grad-reduce and --overlap-param-gather are refused")
    yield _NothingInFlight()


def wanted(args, cuda_available: bool) -> bool:
    """Whether these flags run gloo on CUDA."""
    return bool(cuda_available) and args.distributed_backend == "gloo"


def share_devices(args, device_count: int) -> None:
    """Processes sharing GPUs over gloo: Megatron-LM's `torch.cuda.set_device(args.local_rank)`
    gets a device that exists (NCCL runs keep one process per GPU and are not touched)."""
    if device_count > 0 and args.local_rank >= device_count:
        args.local_rank %= device_count


def apply() -> None:
    buffers = import_megatron("megatron.core.distributed.param_and_grad_buffer")
    if "coalescing" not in _SAVED:
        _SAVED["coalescing"] = buffers._coalescing_manager
        _SAVED["staging"] = comm.set_host_staging(True)
    buffers._coalescing_manager = uncoalesced


def remove() -> None:
    if "coalescing" in _SAVED:
        import_megatron("megatron.core.distributed.param_and_grad_buffer")._coalescing_manager = \
            _SAVED.pop("coalescing")
        comm.set_host_staging(_SAVED.pop("staging"))
