"""The flags of virtual pipeline stages (megatron-core's interleaved schedule), as Megatron-LM's.

One job: `--num-layers-per-virtual-pipeline-stage` / `--num-virtual-stages-per-pipeline-rank`,
`--microbatch-group-size-per-virtual-pipeline-stage`, `--no-overlap-p2p-communication` and
`--overlap-p2p-communication-warmup-flush`: parse them, derive
`virtual_pipeline_model_parallel_size` (None without chunks) and
`microbatch_group_size_per_vp_stage`, and check Megatron-LM's rules plus the schedule's
micro-batch rule for every step of a batch ramp (megatron-core raises it mid-run).

What it does not do: no uneven stages or layouts (refused in args_megatron_lm_only.py).
"""

from __future__ import annotations

import argparse

from megatron_eod.training.args_model import typed
from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.flag_rules import check_positive as _positive

__all__ = ["add_virtual_pipeline_args", "check_interleaved_micro_batches",
           "check_virtual_pipeline"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FlagError(message)


def add_virtual_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("virtual pipeline stages")
    typed(g, int, ("--num-layers-per-virtual-pipeline-stage", None,
                   "interleaved pipeline: this many layers a model chunk (Megatron-LM's)"),
          ("--num-virtual-stages-per-pipeline-rank", None,
           "interleaved pipeline: this many model chunks a pipeline rank"),
          ("--microbatch-group-size-per-virtual-pipeline-stage", None,
           "consecutive micro-batches a chunk runs (default: --pipeline-model-parallel-size)"))
    g.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm",
                   help="interleaved pipeline: batched, not overlapped, p2p (needs "
                        "--pipeline-model-parallel-size > 2, as Megatron-LM)")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                   dest="overlap_p2p_comm_warmup_flush",
                   help="interleaved pipeline: overlap the warmup's and flush's p2p too")


def check_virtual_pipeline(args) -> None:
    """Megatron-LM's rules: one of the two VP flags, layers divisible, PP > 1 (> 2 without
    overlapped p2p); sets `virtual_pipeline_model_parallel_size` (None without chunks) and
    `microbatch_group_size_per_vp_stage` (default PP)."""
    args.microbatch_group_size_per_vp_stage = getattr(
        args, "microbatch_group_size_per_virtual_pipeline_stage", None)
    per_layer, per_rank = (args.num_layers_per_virtual_pipeline_stage,
                           args.num_virtual_stages_per_pipeline_rank)
    pp = args.pipeline_model_parallel_size
    _require(per_layer is None or per_rank is None,
             "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
             "are exclusive; pass one")
    chunks = None
    if per_layer is not None:
        _positive(args, "num_layers_per_virtual_pipeline_stage")
        per_stage = args.num_layers // pp if args.num_layers % pp == 0 else None
        _require(per_stage is not None and per_stage % per_layer == 0,
                 f"--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} must be "
                 f"a multiple of --num-layers-per-virtual-pipeline-stage {per_layer}")
        chunks = per_stage // per_layer
    elif per_rank is not None:
        _positive(args, "num_virtual_stages_per_pipeline_rank")
        _require(args.num_layers % (pp * per_rank) == 0,
                 f"--num-layers {args.num_layers} must be divisible by "
                 f"--pipeline-model-parallel-size x --num-virtual-stages-per-pipeline-rank = "
                 f"{pp} x {per_rank}")
        chunks = per_rank
    args.virtual_pipeline_model_parallel_size = chunks if chunks and chunks > 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        _require(args.microbatch_group_size_per_vp_stage is None,
                 "--microbatch-group-size-per-virtual-pipeline-stage needs virtual pipeline "
                 "stages (--num-layers-per-virtual-pipeline-stage or "
                 "--num-virtual-stages-per-pipeline-rank giving more than one a rank)")
        _require(not args.overlap_p2p_comm_warmup_flush,
                 "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages")
        args.overlap_p2p_comm = False  # as Megatron-LM, outside the interleaved schedule
        return
    _require(args.overlap_p2p_comm or not args.overlap_p2p_comm_warmup_flush,
             "--overlap-p2p-communication-warmup-flush overlaps p2p: drop "
             "--no-overlap-p2p-communication or it")
    _require(pp > (1 if args.overlap_p2p_comm else 2),
             f"virtual pipeline stages need --pipeline-model-parallel-size > 1, and > 2 with "
             f"--no-overlap-p2p-communication (two batched p2p calls between the same two "
             f"ranks), got {pp}")
    if args.microbatch_group_size_per_vp_stage is None:
        args.microbatch_group_size_per_vp_stage = pp
    _require(args.microbatch_group_size_per_vp_stage >= pp,
             f"--microbatch-group-size-per-virtual-pipeline-stage "
             f"{args.microbatch_group_size_per_vp_stage} must be >= "
             f"--pipeline-model-parallel-size {pp} (megatron-core's interleaved schedule)")


def check_interleaved_micro_batches(args) -> None:
    """megatron-core's interleaved schedule, for every micro-batch count of the run (each
    step of a --rampup-batch-size ramp too), at start-up instead of a ValueError mid-run: a
    chunk runs G = --microbatch-group-size-per-virtual-pipeline-stage micro-batches in a
    row, so a count M needs M >= G, and M % G either 0 or >= the pipeline size."""
    if args.virtual_pipeline_model_parallel_size is None:
        return
    group, pp = args.microbatch_group_size_per_vp_stage, args.pipeline_model_parallel_size
    unit = args.micro_batch_size * args.data_parallel_size
    batches = [args.global_batch_size]
    if args.rampup_batch_size is not None:
        start, increment, _ = map(int, args.rampup_batch_size)
        batches += list(range(start, args.global_batch_size, increment))
    for batch in sorted(set(batches)):
        count = max(1, batch // unit)
        _require(count >= group and (count % group == 0 or count % group >= pp),
                 f"virtual pipeline stages: {count} micro-batches a step (batch {batch} / "
                 f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                 f"{args.data_parallel_size}) do not fit "
                 f"--microbatch-group-size-per-virtual-pipeline-stage {group} (the count must "
                 f"be >= it, and leave 0 or >= --pipeline-model-parallel-size {pp} over); "
                 f"raise --global-batch-size or lower the group size")
