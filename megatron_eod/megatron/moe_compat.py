"""What megatron-core's MoE layer gets wrong in the versions we support, made right: one list.

One job: `apply()`, called when a model with experts is built (layer_spec.py), on any device.

* megatron-core 0.16 without TransformerEngine: its router tests `te_general_gemm`, which it
  never defines there, a NameError at the first step, CPU or GPU. Made right by
  `moe_utils.te_general_gemm = None`, as 0.17 defines it.
* megatron-core 0.16-0.18 with per-token loss (on by default here): the load-balancing and
  z-loss gradients come out 1 / (TP x CP) too small. Each TP+CP rank scales by its own token
  count, where the loss divides by every rank's (0.19 multiplies by the TP+CP group's size;
  measured: MoE at CP=4 trained 1e-4 away from CP=1 by iteration 2). Made right by
  multiplying `TopKRouter.get_aux_loss_coeff` and the z-loss coefficient by the TP+CP group's
  size while the router runs: the gradients 0.19 gives. The logged losses divide by the
  coefficient, so they do not change.

What it does not do: nothing on megatron-core >= 0.19, nothing for dense models.
"""

from __future__ import annotations

import functools
import importlib

from packaging.version import Version

__all__ = ["apply"]


def _version():
    return Version(importlib.import_module("megatron.core").__version__)


def apply() -> None:
    """The fixes this megatron-core needs (the module's list). Idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if _version() >= Version("0.19.0"):
        return
    router = importlib.import_module("megatron.core.transformer.moe.router").TopKRouter
    if getattr(router.get_aux_loss_coeff, "_eod_scaled", False):
        return
    aux_coeff, z_loss = router.get_aux_loss_coeff, router.apply_z_loss

    def size(self):
        return self.tp_cp_group.size() if self.calculate_per_token_loss else 1

    @functools.wraps(aux_coeff)
    def get_aux_loss_coeff(self, *args, **kwargs):
        return aux_coeff(self, *args, **kwargs) * size(self)

    @functools.wraps(z_loss)
    def apply_z_loss(self, *args, **kwargs):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or size(self) == 1:
            return z_loss(self, *args, **kwargs)
        self.config.moe_z_loss_coeff = coeff * size(self)
        try:
            return z_loss(self, *args, **kwargs)
        finally:
            self.config.moe_z_loss_coeff = coeff

    get_aux_loss_coeff._eod_scaled = True
    router.get_aux_loss_coeff, router.apply_z_loss = get_aux_loss_coeff, apply_z_loss
