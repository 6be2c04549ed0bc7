"""Adam with decoupled weight decay, float32 master weights, clipping and the LR schedule.

One job: the optimizer step of the trainer. Gradients come from megatron-core DDP's float32
buffers (`param.main_grad`, already summed over DP x CP and divided by the global token
count). For float32 models the parameters are their own master weights; for bf16/fp16 models
a float32 master copy is stepped and copied back. The global gradient norm counts every
parameter once across tensor and pipeline parallelism (TP-duplicated parameters such as
layer norms, and the shared word embedding on the last stage, are skipped) and clips to
--clip-grad. fp16 uses a dynamic loss scale (skip the step on inf/nan, halve; double after
1000 clean steps). The learning rate and weight decay follow megatron-core's
`OptimizerParamScheduler` (warmup, then linear/cosine/constant decay to --min-lr).

What it does not do: no distributed optimizer (states are replicated over DP), no CPU offload.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron

__all__ = ["MasterAdam", "build_optimizer"]


class _LossScaler:
    def __init__(self, scale=2.0 ** 16, growth_interval=1000):
        self.scale, self.growth_interval, self.clean = float(scale), growth_interval, 0

    def __call__(self, loss):
        return loss * self.scale

    def update(self, found_inf: bool):
        if found_inf:
            self.scale, self.clean = max(self.scale / 2.0, 1.0), 0
        else:
            self.clean += 1
            if self.clean % self.growth_interval == 0:
                self.scale *= 2.0


class MasterAdam:
    def __init__(self, model, args):
        tp = import_megatron("megatron.core.tensor_parallel")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = args.bf16 or args.fp16
        self.masters = ([p.detach().clone().float() for p in self.params] if self.mixed
                        else self.params)
        decay, no_decay = [], []
        for p, m in zip(self.params, self.masters):
            (no_decay if p.dim() == 1 else decay).append(m)  # biases and norms: no decay
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr,
                                           betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps, weight_decay=args.weight_decay)
        self.clip_grad = args.clip_grad
        self.counted = [tp.param_is_not_tensor_parallel_duplicate(p)
                        and not getattr(p, "shared", False) for p in self.params]
        self.scaler = _LossScaler() if args.fp16 else None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _grad_norm(self, grads) -> float:
        ps = import_megatron("megatron.core.parallel_state")
        total = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else "cpu")
        for g, counted in zip(grads, self.counted):
            if counted:
                total += g.double().pow(2).sum()
        dist.all_reduce(total, group=ps.get_model_parallel_group())
        return math.sqrt(total.item())

    def step(self):
        """-> (updated, grad_norm): updated is False when fp16 found inf/nan (step skipped)."""
        grads = []
        for p, m in zip(self.params, self.masters):
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            g = g.float() if g is not None else torch.zeros_like(m)
            if self.scaler is not None:
                g = g / self.scaler.scale
            m.grad = g
            grads.append(g)
        try:
            norm = self._grad_norm(grads)
            if self.scaler is not None:
                found_inf = not math.isfinite(norm)
                self.scaler.update(found_inf)
                if found_inf:
                    return False, norm
            if self.clip_grad > 0 and norm > self.clip_grad:
                for g in grads:
                    g.mul_(self.clip_grad / (norm + 1e-6))
            self.optimizer.step()
            if self.mixed:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)
            return True, norm
        finally:
            # For float32 models .grad would alias DDP's buffer: autograd would then add into
            # the buffer and DDP's hook add the same gradient again. Never leave it set.
            for m in self.masters:
                m.grad = None

    def reload_model_params(self):
        """Copy the model's (just loaded) weights into the float32 masters; without this a
        bf16/fp16 run whose masters were not loaded would step from its random init."""
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    m.copy_(p)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(),
                "masters": self.masters if self.mixed else None,
                "loss_scale": self.scaler.scale if self.scaler else None,
                "loss_scale_clean_steps": self.scaler.clean if self.scaler else None}

    def load_state_dict(self, state):
        """Optimizer state; float32 masters when the checkpoint has them (a mixed-precision
        run's), else they stay as `reload_model_params` set them."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mixed and state.get("masters") is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)
        if self.scaler is not None and state.get("loss_scale") is not None:
            self.scaler.scale = state["loss_scale"]
            self.scaler.clean = state.get("loss_scale_clean_steps") or 0


def build_optimizer(model, args):
    """-> (MasterAdam, OptimizerParamScheduler)."""
    sched = import_megatron("megatron.core.optimizer_param_scheduler")
    optimizer = MasterAdam(model, args)
    scheduler = sched.OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant")
    return optimizer, scheduler
