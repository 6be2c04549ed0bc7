"""Host reads of tensor values, caught on CPU: the no-host-sync rule checked without a GPU.

On a GPU every read of a device tensor's value by the host (`.item()`, `int(t)`, `if t:`,
`.tolist()`, `.numpy()`, and ops whose output size depends on values: `nonzero`, boolean-mask
indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`) waits for
the device to finish, which stalls the launch queue once per call, per layer. The GPU tests
check it with `torch.cuda.set_sync_debug_mode("error")`, on a machine CI never has; this
module catches those reads on CPU tensors, where nothing syncs, by watching the ops
dispatched and the two Tensor methods that read memory directly.

    with HostReads() as reads:
        ...                      # the code that must not read values on the host
    assert reads.found == []     # each: "op name at file:line" (innermost frame in the package)

Only reads made from `megatron_eod` code count (the innermost package frame is named);
megatron-core's own reads are its business. Tensor creation from Python data (`torch.tensor`)
counts too: on a GPU it is a host-to-device copy from pageable memory, which syncs.
What it cannot see: a copy to the host (`.cpu()`, `.to("cpu")`), which dispatches nothing for
a CPU tensor; and where a tensor lives: a read of a tensor kept on the host on GPUs too (by
design, like the batch context's id) is found like any other and must be exempted by name.
CUDA's sync debug mode in the GPU tests remains the last word.
"""

from __future__ import annotations

import os
import sys
from typing import Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_eod") + os.sep
_ALWAYS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero",
           "masked_select", "unique_consecutive", "_unique", "_unique2", "unique_dim",
           "bincount", "histc", "lift_fresh"}


def _reads_values(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in _ALWAYS:
        return True
    if name == "repeat_interleave":  # repeats as a tensor: the output size is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and \
            kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices)
    return False


def _where(package: str, exempt) -> str | None:
    """The innermost frame under `package`, as "file:line", or None outside it or where that
    frame's function (qualified name) starts with one of `exempt`."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(package):
            if code.co_qualname.startswith(exempt):
                return None
            return f"{os.path.relpath(code.co_filename, os.path.dirname(package))}:" \
                   f"{frame.f_lineno}"
        frame = frame.f_back
    return None


class HostReads(TorchDispatchMode):
    """Records host reads made from code under `package` (a folder, default megatron_eod/),
    except those made in functions whose qualified names start with one of `exempt`."""

    def __init__(self, package: str = PACKAGE, exempt: Tuple[str, ...] = ()):
        super().__init__()
        self.package = os.path.join(os.path.abspath(package), "")
        self.exempt = tuple(exempt)
        self.found = []
        self._methods = {}

    def _note(self, what: str):
        where = _where(self.package, self.exempt)
        if where is not None:
            self.found.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            self._note(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            real = getattr(torch.Tensor, name)
            self._methods[name] = real

            def watched(tensor, *a, _real=real, _name=name, **k):
                self._note(f"Tensor.{_name}")
                return _real(tensor, *a, **k)

            setattr(torch.Tensor, name, watched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._methods.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)
