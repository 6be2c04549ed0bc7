"""The optimizer and LR schedule of the lean trainer: megatron-core's own, from Megatron's flags.

One job: turn the flags into megatron-core's `OptimizerConfig` (Adam or SGD, float32 master
weights for bf16/fp16, Megatron's dynamic grad scaler for fp16: initial scale 2^32,
hysteresis 2, window 1000, or a fixed --loss-scale), build the optimizer with
`get_megatron_optimizer` (the distributed optimizer with --use-distributed-optimizer,
weight decay skipped for biases and 1-D parameters as Megatron-LM does) and the
`OptimizerParamScheduler` counted in samples, as Megatron-LM counts it, so that its state in a
checkpoint means the same thing to both trainers.

    optimizer, scheduler = build_optimizer(ddp_model_chunks, args)
    updated, grad_norm, _ = optimizer.step()   # grad_norm None when --clip-grad 0
    scheduler.step(increment=global_batch_size)

The config is filled the way Megatron-LM's trainer fills it: every `OptimizerConfig` field
whose name is a flag's dest takes that flag's value (Megatron's spellings are the contract).

What it does not do: no optimizer of its own, no Muon, no CPU offload, no decoupled LR.
"""

from __future__ import annotations

import dataclasses

from megatron_eod.megatron.imports import import_megatron

__all__ = ["build_optimizer", "optimizer_config", "build_scheduler", "scheduler_steps"]


def optimizer_config(args):
    """megatron-core's Adam/SGD OptimizerConfig from the flags (Megatron-LM's field mapping)."""
    opt = import_megatron("megatron.core.optimizer")
    cls = opt.AdamOptimizerConfig if args.optimizer == "adam" else opt.SGDOptimizerConfig
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.name in vars(args)}
    return cls(**kwargs)


def scheduler_steps(args):
    """(warmup, decay, wsd decay, weight-decay increment) lengths in samples."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        decay = args.lr_decay_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
        wd_incr = args.train_samples
    else:
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
        wd_incr = args.train_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup, decay, wsd, wd_incr


def build_scheduler(optimizer, args):
    sched = import_megatron("megatron.core.optimizer_param_scheduler")
    warmup, decay, wsd, wd_incr = scheduler_steps(args)
    return sched.OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay, wd_incr_steps=wd_incr,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)


def build_optimizer(chunks, args):
    """-> (megatron-core MegatronOptimizer, OptimizerParamScheduler) for the DDP model chunks."""
    opt = import_megatron("megatron.core.optimizer")
    config = optimizer_config(args)
    optimizer = opt.get_megatron_optimizer(
        config, list(chunks), config_overrides=opt.get_standard_config_overrides(config),
        use_gloo_process_groups=getattr(args, "gloo_dp_groups", False))
    return optimizer, build_scheduler(optimizer, args)
