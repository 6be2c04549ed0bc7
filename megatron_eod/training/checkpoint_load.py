"""`--load`: read back a checkpoint of this trainer or of Megatron-LM's, resharding it.

One job: load the checkpoint checkpoint_preflight found under --load (or
--pretrained-checkpoint when --load has none; the same on every rank, its files whole) in its
format (torch_dist: `metadata.json` in the iteration folder; torch: `mp_rank_*` files), check
that it holds this model (a clear error names the flag that differs instead of a shape error
deep inside dist_checkpointing), and load the model, the optimizer and LR schedule
(checkpoint_schedule.py's rules), the RNG states and the sample counters into this run. A
read that fails on one rank is raised on every rank (`raise_on_every_rank`), before the next
collective. torch_dist checkpoints reshard: megatron-core maps every global tensor onto this
run's TP/PP/DP/CP layout (the distributed optimizer's state across TP/PP only when it was
saved "fully_reshardable"); RNG states are skipped when TP/PP changed, as Megatron-LM does.
--finetune (and --pretrained-checkpoint) loads the weights only and starts at iteration 0.

What it does not do: no conversion between the regular and the distributed optimizer's
state (pass --no-load-optim to start that state fresh), no torch_dcp/fsdp_dtensor.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.args_pipeline import pipeline_split
from megatron_eod.training.checkpoint_preflight import (check_optimizer_saved, find_checkpoint,
                                                       raise_on_every_rank)
from megatron_eod.training.checkpoint_schedule import (apply_schedule_choice, group_lrs,
                                                       schedule_mismatch,
                                                       schedule_values_to_flags)
from megatron_eod.training.checkpointing import (DISTRIB_OPTIM_FILE, CheckpointError,
                                                 _content_metadata, _legacy_file, _ps,
                                                 _set_rng_state, _state, _unwrap, model_keys)

__all__ = ["CheckpointError", "load_checkpoint"]


_FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")


def _groups(ns):
    heads = getattr(ns, "num_attention_heads", None)
    if getattr(ns, "group_query_attention", False):
        return getattr(ns, "num_query_groups", heads)
    return heads


def _qkv_bias(ns):
    """Whether the QKV projection has a bias (--add-qkv-bias, or biases everywhere); None
    for args that do not say (a checkpoint of neither trainer)."""
    if getattr(ns, "add_bias_linear", None) is None:
        return None
    return bool(ns.add_bias_linear or getattr(ns, "add_qkv_bias", False))


# (how to read a value from args, its flag) for everything that shapes the weights or what
# they mean (a norm weight stored as gamma - 1 read as gamma is another model). Older
# checkpoints without a field are not compared on it.
_SHAPE = [(lambda ns, name=name: getattr(ns, name, None), f"--{name.replace('_', '-')}")
          for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "kv_channels", "swiglu", "squared_relu", "add_bias_linear",
                       "qk_layernorm", "normalization", "untie_embeddings_and_output_weights",
                       "position_embedding_type")]
_SHAPE += [(_groups, "--num-query-groups"), (_qkv_bias, "--add-qkv-bias"),
           (lambda ns: getattr(ns, "layernorm_zero_centered_gamma", None),
            "--apply-layernorm-1p"),
           (lambda ns: getattr(ns, "layernorm_epsilon", None), "--norm-epsilon")]


def _learned_positions(ns):
    """The learned position table's rows (RoPE's angles are not weights)."""
    if getattr(ns, "position_embedding_type", None) != "learned_absolute":
        return None
    return getattr(ns, "max_position_embeddings", None)


def _padded_vocab(ns):
    return getattr(ns, "padded_vocab_size", None)


_PADDED_VOCAB = "the padded vocabulary (--make-vocab-size-divisible-by, the tokenizer's size)"


def _check_model_args(saved, args, where, torch_format=False):
    """`torch_format`: the embedding's rows are compared too (torch_dist reshards them, as
    Megatron-LM compares them only without it)."""
    differ = []
    shape = _SHAPE + [(_learned_positions, "--max-position-embeddings")]
    if torch_format:
        shape.append((_padded_vocab, _PADDED_VOCAB))
    for read, flag in shape:
        theirs, ours = read(saved), read(args)
        if theirs is not None and ours is not None and theirs != ours:
            differ.append(f"{flag} {theirs} (this run: {ours})")
    if differ:
        raise CheckpointError(f"--load {where} holds another model: it was saved with "
                              + "; ".join(differ))


def _load_chunks(chunks, state, where):
    """Each model chunk's weights from its key ("model", or "model0", ... with virtual
    pipeline stages); a --ckpt-format torch checkpoint of other virtual stages names them."""
    keys = model_keys(chunks)
    if not all(key in state for key in keys):
        saved = sorted(key for key in state if key == "model" or key[5:].isdigit()
                       and key.startswith("model"))
        raise CheckpointError(f"--load {where} holds the model chunks {saved}, this run has "
                              f"{keys}: a --ckpt-format torch checkpoint loads only at the "
                              f"virtual pipeline stages it was saved with (save with "
                              f"--ckpt-format torch_dist to reshard)")
    for key, chunk in zip(keys, chunks):
        _unwrap(chunk).load_state_dict(state[key], strict=True)


def _load_torch_dist(args, folder, finetune, chunks, optimizer, scheduler):
    dcp = import_megatron("megatron.core.dist_checkpointing")
    ps = _ps()
    common, error = None, None
    try:  # rank 0 read it in checkpoint_preflight; another node may hold another copy
        common = dcp.load_common_state_dict(folder)
    except Exception as said:  # noqa: BLE001
        error = (f"{os.path.join(folder, 'common.pt')} cannot be read ({type(said).__name__}: "
                 f"{said})")
    raise_on_every_rank(error)
    saved = common.get("args") or argparse.Namespace()
    _check_model_args(saved, args, folder)
    same_tp_pp = (getattr(saved, "tensor_model_parallel_size", 1),
                  getattr(saved, "pipeline_model_parallel_size", 1)) == (
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size) and _same_split(
        saved, args)
    content = dcp.load_content_metadata(preloaded_state_dict=common) or {}
    load_optim = (not finetune and not args.no_load_optim and "opt_param_scheduler" in common)
    same_vp = getattr(saved, "virtual_pipeline_model_parallel_size", None) == \
        args.virtual_pipeline_model_parallel_size
    if load_optim:
        _check_optimizer_state(args, content.get("distrib_optim_sharding_type"),
                               same_tp_pp and same_vp, folder)
        _check_optimizer_vocab(args, saved, content.get("distrib_optim_sharding_type"), folder)
        metadata = dict(content)
    else:
        metadata = _content_metadata(args)
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    load_rng = (same_tp_pp and not finetune and not args.no_load_rng
                and not getattr(saved, "no_save_rng", False))
    counters = {"consumed_train_samples": 0, "consumed_valid_samples": 0, "skipped": 0,
                "nan": 0}
    request = _state(args, 0, chunks, optimizer, scheduler, counters, metadata, rng=load_rng,
                     with_optimizer=load_optim, loading=True)
    try:
        loaded = dcp.load(request, folder, strict=args.dist_ckpt_strictness)
    except dcp.core.CheckpointingException as error:
        said = " ".join(str(error).split())  # one line; the key sets can be long
        said = said if len(said) <= 800 else said[:800] + " ..."
        if "shape mismatch" in said:
            raise CheckpointError(f"--load {folder}: a saved tensor's shape differs from this "
                                  f"run's ({said})") from None
        if "keys" not in said:
            raise
        raise CheckpointError(f"--load {folder} (--dist-ckpt-strictness "
                              f"{args.dist_ckpt_strictness}): {said}") from None
    if isinstance(loaded, tuple):  # --dist-ckpt-strictness return_*: the keys come back
        loaded, missing, unexpected = loaded
        if dist.get_rank() == 0 and (missing or unexpected):
            print(f" --load {folder} (--dist-ckpt-strictness {args.dist_ckpt_strictness}): "
                  f"missing {sorted(missing)}, unexpected {sorted(unexpected)}", flush=True)
    _load_chunks(chunks, loaded, folder)
    _finish(args, loaded, load_optim, load_rng, optimizer, scheduler)
    if dist.get_rank() == 0 and not same_tp_pp:
        print(f" --load {folder}: TP/PP or the stages' layers changed, RNG states not loaded", flush=True)
    return loaded, saved


def _same_split(saved, args) -> bool:
    """Whether every pipeline stage holds the layers it held at the save (a checkpoint whose
    args cannot say is taken at its word)."""
    theirs = pipeline_split(saved)
    return theirs is None or theirs == args.pipeline_stage_layers


def _check_optimizer_state(args, sharding, same_tp_pp, folder):
    hint = "or pass --no-load-optim to start the optimizer state fresh"
    if args.use_distributed_optimizer and sharding is None:
        raise CheckpointError(f"--load {folder} holds the regular optimizer's state; this run has "
                              f"--use-distributed-optimizer: drop it, {hint}")
    if not args.use_distributed_optimizer and sharding is not None:
        raise CheckpointError(f"--load {folder} holds the distributed optimizer's state "
                              f"({sharding}): add --use-distributed-optimizer, {hint}")
    if sharding is not None and not same_tp_pp and sharding not in _FULLY_RESHARDABLE:
        raise CheckpointError(f"--load {folder}: the distributed optimizer's state was saved "
                              f"{sharding!r}, which reshards over DP/CP only, and this run changes "
                              f"TP/PP or the virtual pipeline stages: save with "
                              f"--dist-ckpt-optim-fully-reshardable, {hint}")


def _check_optimizer_vocab(args, saved, sharding, folder):
    """The distributed optimizer's "dp_reshardable" state holds flat buckets of the saved
    shapes: other embedding rows failed deep inside its load (a shape mismatch of a bucket)."""
    theirs, ours = _padded_vocab(saved), _padded_vocab(args)
    if sharding is None or sharding in _FULLY_RESHARDABLE or theirs in (None, ours):
        return
    raise CheckpointError(f"--load {folder}: {_PADDED_VOCAB} is {theirs} in the checkpoint, "
                          f"{ours} here, and the distributed optimizer's state saved "
                          f"{sharding!r} keeps the saved shapes: use the checkpoint's padding, or "
                          f"pass --no-load-optim to start the optimizer state fresh")


def _finish(args, loaded, load_optim, load_rng, optimizer, scheduler):
    if load_optim:
        flag_lrs = group_lrs(optimizer)
        saved = schedule_values_to_flags(loaded["optimizer"], optimizer.param_groups)
        optimizer.load_state_dict(loaded["optimizer"])
        apply_schedule_choice(optimizer, flag_lrs, saved, args.override_opt_param_scheduler,
                              args.use_checkpoint_opt_param_scheduler)
        try:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as error:
            raise CheckpointError(schedule_mismatch(error, args.load)) from None
    elif args.bf16 or args.fp16:
        optimizer.reload_model_params()  # float32 main weights follow the loaded ones
    if load_rng:
        _set_rng_state(loaded["rng_state"][0])


def _load_torch(args, found, chunks, optimizer, scheduler):
    error = None
    try:  # this rank's own file: what any rank finds, every rank raises
        state, saved, load_optim, param_state = _read_torch(args, found, chunks)
    except CheckpointError as said:
        error = str(said)
    raise_on_every_rank(error)
    load_rng = not found.finetune and not args.no_load_rng and "rng_state" in state
    _finish(args, state, load_optim, load_rng, optimizer, scheduler)
    if load_optim and args.use_distributed_optimizer:  # collective over the DP x CP group
        optimizer.load_parameter_state(param_state, update_legacy_format=False)
    return state, saved


def _read_torch(args, found, chunks):
    """This rank's --ckpt-format torch file, checked and loaded into the model chunks ->
    (state, saved args, whether to load the optimizer, the distributed optimizer's file)."""
    root, path = found.root, _legacy_file(found.folder)
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {root}: {path} is missing; a --ckpt-format torch checkpoint "
                              f"loads only at the --tensor-model-parallel-size and "
                              f"--pipeline-model-parallel-size it was saved with (save with "
                              f"--ckpt-format torch_dist to reshard)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 (damaged in a way its zip directory hides)
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if "sizes" in state and "args" not in state:
        raise CheckpointError(f"--load {root}: written by megatron-eod before it used "
                              f"megatron-core's optimizer and checkpoint formats; it cannot resume "
                              f"here (start a new run, or load it with the release that wrote it)")
    saved = state.get("args") or argparse.Namespace()
    _check_model_args(saved, args, path, torch_format=True)
    sizes = {flag: (getattr(saved, dest, None), getattr(args, dest)) for flag, dest in (
        ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"))}
    for flag, (theirs, ours) in sizes.items():
        if theirs is not None and theirs != ours:
            raise CheckpointError(f"--load {root}: a --ckpt-format torch checkpoint saved at "
                                  f"{flag} {theirs} loads only at that size (this run: "
                                  f"{ours}); save with --ckpt-format torch_dist to reshard")
    if not _same_split(saved, args):
        raise CheckpointError(f"--load {root}: a --ckpt-format torch checkpoint saved with "
                              f"{pipeline_split(saved)} layers on the pipeline stages loads only "
                              f"with that split (this run: {args.pipeline_stage_layers}: "
                              f"--decoder-first/last-pipeline-num-layers, "
                              f"--account-for-embedding/loss-in-pipeline-split); save with "
                              f"--ckpt-format torch_dist to reshard")
    check_optimizer_saved(args, found, "optimizer" in state)
    load_optim = not found.finetune and not args.no_load_optim and "optimizer" in state
    param_state = os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILE)
    if load_optim:  # the distributed optimizer's shards: DP rank 0's file beside this one
        saved_distributed = os.path.isfile(param_state) or bool(
            getattr(saved, "use_distributed_optimizer", False))
        _check_optimizer_state(args, DISTRIB_OPTIM_FILE if saved_distributed else None, True,
                               root)
        if args.use_distributed_optimizer and not os.path.isfile(param_state):
            raise CheckpointError(f"--load {root}: {param_state} is missing (the distributed "
                                  f"optimizer's state of a --ckpt-format torch checkpoint); "
                                  f"pass --no-load-optim to start the optimizer state fresh")
    try:
        _load_chunks(chunks, state, path)
    except RuntimeError as error:  # a shape the model checks above do not know
        raise CheckpointError(f"--load {root}: {path} does not fit this model "
                              f"({str(error).strip().splitlines()[-1]})") from None
    return state, saved, load_optim, param_state


def load_checkpoint(args, chunks, optimizer, scheduler):
    """-> (iteration, counters) of the latest checkpoint under --load (or
    --pretrained-checkpoint), or (0, {}) when there is none. Collective."""
    found = find_checkpoint(args)
    if found is None:
        if dist.get_rank() == 0 and args.load:
            print(f" no checkpoint under --load {args.load}; starting from scratch", flush=True)
        return 0, {}
    root, folder, finetune = found.root, found.folder, found.finetune
    if found.format == "torch_dist":
        loaded, saved = _load_torch_dist(args, folder, finetune, chunks, optimizer, scheduler)
    else:
        loaded, saved = _load_torch(args, found, chunks, optimizer, scheduler)
    dist.barrier()
    flops = {"num_floating_point_operations_so_far": loaded.get(
        "num_floating_point_operations_so_far", 0)}  # kept by a finetune too, as Megatron-LM
    if finetune:
        if dist.get_rank() == 0:
            print(f" loaded the weights of {folder} (--finetune: iteration 0, fresh optimizer)",
                  flush=True)
        return 0, flops
    counters = {"consumed_train_samples": getattr(saved, "consumed_train_samples", 0),
                "consumed_valid_samples": getattr(saved, "consumed_valid_samples", 0),
                **flops,
                **loaded.get("eod_counters", {})}
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {root} at iteration {loaded['iteration']}", flush=True)
    return loaded["iteration"], counters
