"""The flags that split the layers over pipeline stages, as Megatron-LM's: virtual stages
(megatron-core's interleaved schedule) and uneven stages.

One job: parse `--num-layers-per-virtual-pipeline-stage` / `--num-virtual-stages-per-pipeline-rank`,
`--microbatch-group-size-per-virtual-pipeline-stage`, `--no-overlap-p2p-communication`,
`--overlap-p2p-communication-warmup-flush`, `--decoder-first-pipeline-num-layers`,
`--decoder-last-pipeline-num-layers`, `--account-for-embedding-in-pipeline-split` and
`--account-for-loss-in-pipeline-split`; derive `virtual_pipeline_model_parallel_size` (None
without chunks), `microbatch_group_size_per_vp_stage` and `pipeline_stage_layers` (the
transformer layers each stage builds, all its chunks); check Megatron-LM's and megatron-core's
rules as one line naming the flags, plus the schedule's micro-batch rule for every step of a
batch ramp (megatron-core raises it mid-run).

What it does not do: no `--pipeline-model-parallel-layout` (refused in
args_megatron_lm_only.py); megatron-core builds each stage's layers from the same fields.
"""

from __future__ import annotations

import argparse

from megatron_eod.training.args_model import typed
from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.flag_rules import check_positive as _positive

__all__ = ["add_virtual_pipeline_args", "check_interleaved_micro_batches",
           "check_pipeline_stages", "check_virtual_pipeline", "chunk_layers", "pipeline_split",
           "stage_layers"]

_FIRST, _LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
_EMBEDDING = "--account-for-embedding-in-pipeline-split"
_LOSS = "--account-for-loss-in-pipeline-split"


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
    g = p.add_argument_group("uneven pipeline stages")
    typed(g, int, (_FIRST, None, "layers of the first pipeline stage; the others share the rest "
                                 "evenly (Megatron-LM's)"),
          (_LAST, None, "layers of the last pipeline stage; the others share the rest evenly"))
    g.add_argument(_EMBEDDING, action="store_true",
                   help="split --num-layers + 1 evenly, the embedding taking a layer's place "
                        "on the first stage")
    g.add_argument(_LOSS, action="store_true",
                   help="split --num-layers + 1 evenly, the output layer and loss taking a "
                        "layer's place on the last stage")


def _slots(args) -> int:
    """What Megatron-LM splits evenly: the layers, plus the embedding / loss where counted."""
    return (args.num_layers + bool(getattr(args, "account_for_embedding_in_pipeline_split", 0))
            + bool(getattr(args, "account_for_loss_in_pipeline_split", 0)))


def _slots_said(args) -> str:
    said = f"--num-layers {args.num_layers}"
    for flag, dest in ((_EMBEDDING, "account_for_embedding_in_pipeline_split"),
                       (_LOSS, "account_for_loss_in_pipeline_split")):
        if getattr(args, dest, False):
            said += f" + 1 ({flag})"
    return said


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
    uneven = (getattr(args, "decoder_first_pipeline_num_layers", None) is not None
              or getattr(args, "decoder_last_pipeline_num_layers", None) is not None)
    if per_layer is not None:
        _positive(args, "num_layers_per_virtual_pipeline_stage")
        _require(not uneven, f"uneven pipeline stages ({_FIRST}, {_LAST}) take their virtual "
                             f"stages from --num-virtual-stages-per-pipeline-rank, not "
                             f"--num-layers-per-virtual-pipeline-stage (Megatron-LM's rule)")
        slots = _slots(args)
        per_stage = slots // pp if slots % pp == 0 else None
        _require(per_stage is not None and per_stage % per_layer == 0,
                 f"{_slots_said(args)} / --pipeline-model-parallel-size {pp} must be "
                 f"a multiple of --num-layers-per-virtual-pipeline-stage {per_layer}")
        chunks = per_stage // per_layer
    elif per_rank is not None:
        _positive(args, "num_virtual_stages_per_pipeline_rank")
        _require(uneven or _slots(args) % (pp * per_rank) == 0,
                 f"{_slots_said(args)} must be divisible by "
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


def stage_layers(num_layers: int, pp: int, chunks: int = 1, first=None, last=None,
                 embedding: bool = False, loss: bool = False):
    """The transformer layers each pipeline stage builds (all its chunks), as megatron-core's
    get_num_layers_to_build counts them; a FlagError where its rules refuse the split."""
    if first is None and last is None:
        slots = num_layers + embedding + loss
        said = f"--num-layers {num_layers}" + (f" + 1 ({_EMBEDDING})" if embedding else "") + (
            f" + 1 ({_LOSS})" if loss else "")
        _require(slots % pp == 0, f"{said} must be divisible by --pipeline-model-parallel-size "
                                  f"{pp}")
        _require((slots // pp) % chunks == 0,
                 f"{said} must be divisible by --pipeline-model-parallel-size x virtual stages "
                 f"a rank = {pp} x {chunks}")
        layers = [slots // pp] * pp
        layers[0] -= embedding
        layers[-1] -= loss
        return layers
    _require(not (embedding or loss), f"{_FIRST} / {_LAST} and {_EMBEDDING} / {_LOSS} are "
                                      f"exclusive (megatron-core's rule): pass one way")
    ends = []
    for flag, value in ((_FIRST, first), (_LAST, last)):
        if value is not None:
            _require(value >= 1, f"{flag} must be >= 1, got {value}")
            _require(value % chunks == 0, f"{flag} {value} must be divisible by the virtual "
                                          f"stages a rank ({chunks})")
            ends.append(value)
    others = pp - len(ends)
    _require(others >= 0, f"{_FIRST} and {_LAST} together need --pipeline-model-parallel-size "
                          f">= 2, got {pp}")
    rest = num_layers - sum(ends)
    given = " and ".join(f"{flag} {value}" for flag, value in ((_FIRST, first), (_LAST, last))
                         if value is not None)
    if others == 0:
        _require(rest == 0, f"--num-layers {num_layers} must equal {given} added: there is no "
                            f"other pipeline stage")
        return [first, last] if len(ends) == 2 else [ends[0]]
    share = rest // others if rest > 0 and rest % others == 0 else 0
    _require(share > 0 and share % chunks == 0,
             f"--num-layers {num_layers} less {given} leaves {rest} layers for the other "
             f"{others} pipeline stage{'s' if others > 1 else ''}: they need the same number "
             f"each, at least 1" + (f" and divisible by the virtual stages a rank ({chunks})"
                                    if chunks > 1 else ""))
    return ([] if first is None else [first]) + [share] * others + (
        [] if last is None else [last])


def _split_of(ns):
    """stage_layers of a namespace (missing uneven fields: the even split)."""
    return stage_layers(ns.num_layers, getattr(ns, "pipeline_model_parallel_size", 1) or 1,
                        getattr(ns, "virtual_pipeline_model_parallel_size", None) or 1,
                        getattr(ns, "decoder_first_pipeline_num_layers", None),
                        getattr(ns, "decoder_last_pipeline_num_layers", None),
                        bool(getattr(ns, "account_for_embedding_in_pipeline_split", False)),
                        bool(getattr(ns, "account_for_loss_in_pipeline_split", False)))


def pipeline_split(ns):
    """The stage layers of a checkpoint's args; None where they predate the fields or do not
    build."""
    try:
        return _split_of(ns)
    except (AttributeError, TypeError, FlagError):
        return None


def chunk_layers(args):
    """The transformer layers of every model chunk of every stage (a stage's own list when
    it has no virtual stages), as megatron-core builds them."""
    chunks = args.virtual_pipeline_model_parallel_size or 1
    layers = [[n // chunks] * chunks for n in args.pipeline_stage_layers]
    if args.decoder_first_pipeline_num_layers is None and \
            args.decoder_last_pipeline_num_layers is None:  # the even split: slots a chunk
        slots = _slots(args) // args.pipeline_model_parallel_size // chunks
        layers = [[slots] * chunks for _ in args.pipeline_stage_layers]
        layers[0][0] -= bool(args.account_for_embedding_in_pipeline_split)
        layers[-1][-1] -= bool(args.account_for_loss_in_pipeline_split)
    return [n for stage in layers for n in stage]


def check_pipeline_stages(args) -> None:
    """Sets `pipeline_stage_layers`; the split's rules as one line naming the flags."""
    args.pipeline_stage_layers = _split_of(args)


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
