"""Import megatron-core modules without its import-time noise.

megatron-core warns at import when TransformerEngine / apex are missing, which is the normal
state on CPU; those warnings, and only those, are silenced here.
"""

import importlib
import warnings
from types import ModuleType

__all__ = ["import_megatron"]

_EXPECTED = r"Transformer Engine and Apex are not installed"


def import_megatron(name: str) -> ModuleType:
    """`importlib.import_module(name)` with megatron-core's missing-TE/apex warnings silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EXPECTED)
        return importlib.import_module(name)
