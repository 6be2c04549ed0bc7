"""`--load`: read back a checkpoint of this trainer or of Megatron-LM's, resharding it.

One job: load the checkpoint checkpoint_preflight found under --load (or
--pretrained-checkpoint when --load has none; the same on every rank, its files whole) in its
format (torch_dist: `metadata.json` in the iteration folder; torch: `mp_rank_*` files),
check that it holds this model (a clear error names the flag that
differs instead of a shape error deep inside dist_checkpointing), and load the model, the
optimizer and LR schedule, the RNG states and the sample counters into this run. torch_dist
checkpoints reshard: megatron-core maps every global tensor onto this run's TP/PP/DP/CP
layout (the distributed optimizer's state across TP/PP only when it was saved
"fully_reshardable"); RNG states are skipped when TP/PP changed, as Megatron-LM does.
--finetune (and --pretrained-checkpoint) loads the weights only and starts at iteration 0.

What it does not do: no conversion between the regular and the distributed optimizer's
state (pass --no-load-optim to start that state fresh), no torch_dcp/fsdp_dtensor.
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.args_pipeline import pipeline_split
from megatron_eod.training.checkpoint_preflight import (check_optimizer_saved, find_checkpoint,
                                                       raise_on_every_rank)
from megatron_eod.training.checkpointing import (DISTRIB_OPTIM_FILE, CheckpointError,
                                                 _content_metadata, _legacy_file, _ps,
                                                 _set_rng_state, _state, _unwrap, model_keys)

__all__ = ["CheckpointError", "apply_schedule_choice", "group_lrs", "load_checkpoint",
           "schedule_mismatch", "schedule_values_to_flags"]


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


_SCHEDULED = ("max_lr", "min_lr", "start_wd", "end_wd")  # per group, read by the scheduler

# megatron-core's OptimizerParamScheduler names for its values -> the flags that set them.
_SCHEDULE_FLAGS = {
    "learning rate": "--lr", "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters/-samples/-fraction",
    "total number of iterations": "--lr-decay-iters/-samples (default: --train-iters/-samples)",
    "learning rate decay style": "--lr-decay-style",
    "start weight decay": "--start-weight-decay", "end weight decay": "--end-weight-decay",
    "total number of weight decay iterations": "--train-iters/-samples",
    "weight decay incr style": "--weight-decay-incr-style"}


def schedule_mismatch(error: AssertionError, folder) -> str:
    """The line for megatron-core's assertion that a resumed run's LR schedule differs from
    its checkpoint's (both trainers: a traceback on every rank, counting samples as
    'iterations', naming no flag)."""
    found = re.search(r"class input value (.*) and checkpoint ?value (.*) for (.*) do not match",
                      str(error))
    if found is None:
        said = str(error)
    else:
        now, saved, name = found.groups()
        flag = _SCHEDULE_FLAGS.get(name, name)
        unit = " (in samples)" if "iterations" in name else ""
        said = f"{flag}: {now}{unit} here, {saved} in the checkpoint"
    return (f"--load {folder}: this run's learning-rate schedule differs from the checkpoint's: "
            f"{said}; pass --override-opt_param-scheduler to follow the flags, or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")


def group_lrs(optimizer):
    """Each optimizer param group's (max_lr, min_lr): the flags' before a load."""
    return [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]


def apply_schedule_choice(optimizer, flag_lrs, saved, override: bool, use_checkpoint: bool):
    """After the optimizer's load: the loaded param groups carry the checkpoint's per-group
    max/min LR, which megatron-core's scheduler reads before its own. With
    --use-checkpoint-opt_param-scheduler the checkpoint's stay (`saved`, from
    schedule_values_to_flags); otherwise the flags' values (`group_lrs` before the load) go
    back: with --override-opt_param-scheduler (megatron-core 0.16.1 alone kept the
    checkpoint's, unlike the flag's documentation), and without either flag, where the
    scheduler has checked that the flags' schedule is the checkpoint's, because megatron-core
    0.16 pairs groups without their LRs: --decoupled-lr's group (embedding and output layer)
    and the default one were one to it, and one's max/min LR came back in both."""
    if use_checkpoint and not override:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)
        return
    if not override:  # the scheduler compares --lr / --min-lr (the default groups' LRs);
        for group, (max_lr, min_lr), values in zip(optimizer.param_groups, flag_lrs, saved):
            if group.get("default_config", True):  # a group's own LRs (--decoupled-lr) here
                continue
            theirs = (values.get("max_lr", max_lr), values.get("min_lr", min_lr))
            if max_lr is not None and any(
                    a is not None and b is not None and abs(a - b) > 1e-9 * max(abs(a), abs(b))
                    for a, b in zip((max_lr, min_lr), theirs)):
                raise CheckpointError(
                    f"--load: a parameter group's learning rates differ from the checkpoint's: "
                    f"max/min LR {max_lr:g}/{min_lr:g} here, {theirs[0]:g}/{theirs[1]:g} in "
                    f"the checkpoint (--decoupled-lr / --decoupled-min-lr set them for the "
                    f"embedding and output layer); pass --override-opt_param-scheduler to "
                    f"follow the flags, or --use-checkpoint-opt_param-scheduler to keep the "
                    f"checkpoint's schedule")
    for group, (max_lr, min_lr) in zip(optimizer.param_groups, flag_lrs):
        if max_lr is not None:
            group["max_lr"], group["min_lr"] = max_lr, min_lr


def schedule_values_to_flags(loaded_optimizer, current_groups):
    """megatron-core 0.19 pairs each saved optimizer param group with a current one by its
    identifier keys, the schedule's per-group values (max/min LR, start/end weight decay)
    among them: a resume with another --lr found no group and stopped in the optimizer's
    load, before the scheduler's own rule (--override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler) had a say. Give each saved group the current
    group's values (paired by the other keys; earlier versions pair without them) and return
    the saved values per current group, for the run where the checkpoint wins (all three
    cases then as in megatron-core 0.16)."""
    saved_values = [{} for _ in current_groups]
    current_keys = [_structural_key(g) for g in current_groups]
    for groups in _saved_param_groups(loaded_optimizer):
        in_order = [_structural_key(g) for g in groups] == current_keys  # the same groups,
        for at, group in enumerate(groups):  # built alike: paired by place (several may
            key = _structural_key(group)     # share a key: --decoupled-lr's and the default)
            matches = [at] if in_order else [i for i, k in enumerate(current_keys) if k == key]
            if len(matches) != 1:
                continue  # no or several candidates: left to megatron-core's own pairing
            current = current_groups[matches[0]]
            for name in _SCHEDULED:
                if name in group and name in current:
                    saved_values[matches[0]][name] = group[name]
                    group[name] = current[name]
    return saved_values


def _structural_key(group) -> tuple:
    """megatron-core's own identifier of a param group, less the schedule's values."""
    keys = import_megatron("megatron.core.optimizer").param_group_identifier_keys
    return tuple(group.get(k) for k in keys if k not in _SCHEDULED)


def _saved_param_groups(state):
    """Every param-group list in a loaded optimizer state (megatron-core nests it in its
    wrappers: mixed precision, chained and distributed optimizers)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                yield value
            else:
                yield from _saved_param_groups(value)
    elif isinstance(state, (list, tuple)):
        for item in state:
            yield from _saved_param_groups(item)


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
    _load_chunks(chunks, state, path)
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
