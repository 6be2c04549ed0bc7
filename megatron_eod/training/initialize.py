"""Start-up: process group, megatron-core parallel state, CPU compat, hybrid groups, seeds.

One job: bring a rank from "launched by torchrun" (or "forked by a test with a process group
already up") to "ready to build the model". Every rank's flags and versions are compared with
rank 0's first (same_flags), before any group is made, and --save is checked to be one
folder for every node (shared_folders). NCCL on GPUs, gloo on CPUs; on a
machine without CUDA the megatron-core CPU patches are applied (cpu_compat), and gloo on CUDA
gets its two stand-ins (gloo_on_cuda). For Hybrid CP, parallel_state builds the Ulysses
(consecutive) and Ring (strided) sub-groups as its hierarchical CP groups and they are handed
to the attention (`register_hybrid_groups`). megatron-core's micro-batch calculator is set up
for --global-batch-size / --rampup-batch-size (as a step schedule where megatron-core >= 0.18
ignores the ramp). --deterministic-mode turns torch's deterministic algorithms on for the
run. Seeds follow Megatron: seed + 100 * pipeline rank for the default generators, and
megatron-core's model-parallel RNG tracker (`model_parallel_cuda_manual_seed`).

What it does not do: no teardown of a process group it did not create (`shutdown`).
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_eod.megatron import cpu_compat, gloo_on_cuda
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training import eod_wiring as wiring
from megatron_eod.training.args_optim import ramp_as_step_schedule
from megatron_eod.training.checkpointing import needs_gloo_dp_groups
from megatron_eod.training.parent_watch import exit_with_parent, launched_by_torchrun
from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.metrics_file import check_metrics_file
from megatron_eod.training.same_flags import check_same_flags
from megatron_eod.training.save_lock import (hold_save_folder, release_save_folder,
                                             written_folder)
from megatron_eod.training.shared_folders import check_shared_folders, save_folder

__all__ = ["initialize", "shutdown"]

_OWNS_PROCESS_GROUP = False
_DETERMINISTIC_BEFORE = None  # (mode, warn_only) to give back, set by --deterministic-mode


def initialize(args, argv=()):
    global _OWNS_PROCESS_GROUP, _DETERMINISTIC_BEFORE
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        cpu_compat.apply_torch_adamw_fixes()  # only where megatron-core uses torch's AdamW
        if gloo_on_cuda.wanted(args, True):
            gloo_on_cuda.apply()
    else:
        cpu_compat.apply()
    if args.deterministic_mode:  # as Megatron-LM's; given back by shutdown
        _DETERMINISTIC_BEFORE = (torch.are_deterministic_algorithms_enabled(),
                                 torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True)
    if launched_by_torchrun():
        exit_with_parent()  # no orphans training on when torchrun's agent dies
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(args.distributed_backend, timeout=timeout)
        _OWNS_PROCESS_GROUP = True
    if dist.get_world_size() != args.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the flags "
                         f"were validated for WORLD_SIZE {args.world_size}")
    check_same_flags(args, argv)  # before any group: sizes differing would hang there
    check_shared_folders(save_folder(args), FlagError)
    check_metrics_file(args, FlagError)
    hold_save_folder(written_folder(args), FlagError)  # one job at a time there
    ps = import_megatron("megatron.core.parallel_state")
    if getattr(args, "gloo_dp_groups", None) is None:  # pretrain() decides it at start-up
        args.gloo_dp_groups = needs_gloo_dp_groups(args)
    cp, u = args.context_parallel_size, args.ulysses_degree
    hybrid = args.context_parallel_algo == "hybrid" and cp > 1
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        hierarchical_context_parallel_sizes=[u, cp // u] if hybrid else None,
        create_gloo_process_groups=args.gloo_dp_groups,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp")
    wiring.hybrid_groups(args)
    calculator = import_megatron("megatron.core.num_microbatches_calculator")
    calculator.init_num_microbatches_calculator(
        dist.get_rank(), args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, args.decrease_batch_size_if_needed,
        **_step_schedule(ramp_as_step_schedule(args)))
    seed = args.seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    import_megatron("megatron.core.tensor_parallel").model_parallel_cuda_manual_seed(seed)


def _step_schedule(schedule) -> dict:
    return {} if schedule is None else {"step_batch_size_schedule": schedule}


def shutdown():
    global _OWNS_PROCESS_GROUP, _DETERMINISTIC_BEFORE
    release_save_folder()
    import_megatron("megatron.core.parallel_state").destroy_model_parallel()
    import_megatron("megatron.core.num_microbatches_calculator").unset_num_microbatches_calculator()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        _OWNS_PROCESS_GROUP = False
    cpu_compat.remove()
    gloo_on_cuda.remove()
    if _DETERMINISTIC_BEFORE is not None:
        mode, warn_only = _DETERMINISTIC_BEFORE
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        _DETERMINISTIC_BEFORE = None
