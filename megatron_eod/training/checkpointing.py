"""Save and resume in Megatron-LM's checkpoint formats, through megatron-core.

One job: `--save DIR` with the state Megatron-LM's trainer writes and reads (checkpoint_load.py
reads it back), so that a checkpoint of either trainer continues in the other:

    DIR/latest_checkpointed_iteration.txt      the newest complete iteration (written last)
    DIR/iter_0000010/                          --ckpt-format torch_dist (default):
        common.pt, metadata.json, *.distcp     megatron.core.dist_checkpointing: sharded by
                                               global tensor, so --load reshards over TP, PP,
                                               DP and CP
    DIR/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt   --ckpt-format torch (legacy):
                                               one file per TP/PP rank, same sizes to load

The state: `args` (with consumed_train/valid_samples, as Megatron-LM reads them),
`checkpoint_version` 3.0, `iteration`, `model` (GPTModel's sharded state; `model0`,
`model1`, ... one per virtual pipeline stage, as Megatron-LM), `optimizer`
(megatron-core optimizer's sharded state; the distributed optimizer's "dp_reshardable", or
"fully_reshardable" with --dist-ckpt-optim-fully-reshardable), `opt_param_scheduler`,
`rng_state` (per TP/PP rank, replicated over DP x CP) and `num_floating_point_operations_so_far`
(the loaded checkpoint's, plus model_stats.model_flops of each iteration since: the pairs
the document masks need, where Megatron-LM counts every causal pair of a row, so a run moved
between the trainers adds two measures).
With the distributed optimizer, the torch format has its DISTRIB_OPTIM_FILE beside each
mp_rank file.
The format on --load is detected. RNG state is skipped when TP/PP changed (as Megatron-LM).
A save killed midway leaves the tracker on the previous checkpoint; its partial folder is
removed by the next save; `--save-keep-last N` keeps the newest N.

What it does not do: no async or local (non-persistent) checkpoints, no torch_dcp/fsdp_dtensor,
no layer-wise (dist_*) optimizers.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.cp_flags import FlagError

__all__ = ["CheckpointError", "DISTRIB_OPTIM_FILE", "checkpoint_folder", "checkpoint_format",
           "model_keys", "needs_gloo_dp_groups", "read_tracker", "save_checkpoint", "TRACKER"]

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """--load (or --pretrained-checkpoint) names a checkpoint this run cannot load; the
    message names the flag and what to change, on every rank (checkpoint_preflight gathers
    what one rank finds)."""


_LEGACY_FILE = "model_optim_rng.pt"
# The distributed optimizer's state in a --ckpt-format torch checkpoint: one file per (TP, PP)
# rank beside _LEGACY_FILE, gathered to and written by DP x CP rank 0 (Megatron-LM's name).
DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def _ps():
    return import_megatron("megatron.core.parallel_state")


def _iter_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _legacy_file(folder):
    """This rank's file of a --ckpt-format torch checkpoint (Megatron-LM's names)."""
    ps = _ps()
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(folder, name, _LEGACY_FILE)


def _unwrap(model):
    """DDP -> (Float16Module ->) GPTModel, as Megatron-LM's unwrap_model."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _rng_state():
    tp = import_megatron("megatron.core.tensor_parallel")
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            # On CPU the device generator is the CPU one (cpu_compat), as Megatron-LM on CPU.
            "cuda_rng_state": (torch.cuda.get_rng_state() if torch.cuda.is_available()
                               else torch.get_rng_state()),
            "rng_tracker_states": tp.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state):
    tp = import_megatron("megatron.core.tensor_parallel")
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tp.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _sharded_rng_state():
    """Megatron-LM's `rng_state`: one per (PP, TP) rank, DP x CP ranks are its replicas."""
    mapping = import_megatron("megatron.core.dist_checkpointing.mapping")
    ps = _ps()
    return mapping.ShardedObject(
        "rng_state", [_rng_state()],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _content_metadata(args):
    """What megatron-core's sharded_state_dict methods read (Megatron-LM's keys)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _saved_args(args, counters):
    saved = argparse.Namespace(**vars(args))
    saved.consumed_train_samples = counters["consumed_train_samples"]
    saved.consumed_valid_samples = counters["consumed_valid_samples"]
    saved.skipped_train_samples = 0
    saved.add_position_embedding = True  # Megatron-LM compares it, default True
    saved.calculate_per_token_loss = True  # how the lean trainer always trains
    return saved


def model_keys(chunks):
    """Megatron-LM's keys of the model chunks' states: "model", or "model0", "model1", ...
    with virtual pipeline stages."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _state(args, iteration, chunks, optimizer, scheduler, counters, metadata, rng,
           with_optimizer=True, loading=False):
    """Megatron-LM's checkpoint state dict (sharded for torch_dist; to save, or to load into
    with `loading`) of the model chunks (one per virtual pipeline stage)."""
    sharded = loading or args.ckpt_format == "torch_dist"
    state = {"args": _saved_args(args, counters), "checkpoint_version": 3.0,
             "iteration": iteration, "num_floating_point_operations_so_far":
                 counters.get("num_floating_point_operations_so_far", 0),
             "eod_counters": {"skipped": counters["skipped"], "nan": counters["nan"]}}
    for key, chunk in zip(model_keys(chunks), chunks):
        core = _unwrap(chunk)
        state[key] = (core.sharded_state_dict(metadata=metadata) if sharded
                      else core.state_dict_for_save_checkpoint())
    if with_optimizer:
        models = {key: state[key] for key in model_keys(chunks)}  # as Megatron-LM passes them
        state["optimizer"] = (optimizer.sharded_state_dict(models, is_loading=loading,
                                                           metadata=metadata)
                              if sharded else optimizer.state_dict())
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _sharded_rng_state() if sharded else [_rng_state()]
    return state


def read_tracker(root, flag="--load"):
    """The iteration (an int, or "release") `root`'s tracker names; None without a tracker.
    A tracker that cannot be read or holds no iteration is a CheckpointError naming `flag`."""
    path = os.path.join(root, TRACKER)
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{flag} {root}: {path} cannot be read "
                              f"({getattr(error, 'strerror', None) or error})") from None
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{flag} {root}: {path} holds {text[:40]!r}, not an iteration (a "
                              f"save killed while writing it, or a copy cut short): write the "
                              f"iteration to resume into it") from None


def checkpoint_folder(root, iteration) -> str:
    """The folder of `iteration` (an int, or "release") under `root`."""
    return os.path.join(root, "release") if iteration == "release" else _iter_dir(root,
                                                                                 iteration)


def checkpoint_format(folder) -> Optional[str]:
    """"torch_dist" (metadata.json), "torch" (mp_rank_* files) or None (no complete
    checkpoint) of an iteration's folder."""
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        return "torch_dist"
    if os.path.isdir(folder) and any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        return "torch"
    return None


def iterations_under(root) -> list:
    """The iterations of the iteration folders (iter_NNNNNNN) under `root`, oldest first."""
    return sorted(int(name[len("iter_"):]) for name in os.listdir(root)
                  if name.startswith("iter_") and name[len("iter_"):].isdigit())


def is_whole(folder) -> bool:
    """Whether an iteration folder holds a whole checkpoint, as far as its files say without
    reading them: torch_dist writes metadata.json last; a torch-format save writes, per
    mp_rank_* folder, the distributed optimizer's DISTRIB_OPTIM_FILE (where it has one) and
    then the model file (both trainers). A save killed midway leaves a folder without the
    model file (or with a `.tmp`), or with the optimizer's in some folders only; a model
    file without any optimizer's is a save without one (--no-save-optim): whole."""
    kind = checkpoint_format(folder)
    if kind != "torch":
        return kind is not None
    ranks = [os.path.join(folder, name) for name in os.listdir(folder)
             if name.startswith("mp_rank_")]

    def written(name):
        return [os.path.isfile(os.path.join(rank, name)) and
                os.path.getsize(os.path.join(rank, name)) > 0 for rank in ranks]

    optimizer = written(DISTRIB_OPTIM_FILE)
    return all(written(_LEGACY_FILE)) and (all(optimizer) or not any(optimizer))


def _left_by_a_killed_save(folder) -> bool:
    """Whether a folder that is not whole is plainly what a save of these trainers left when
    killed (empty; torch format without its files; torch_dist shards or common.pt without
    the .metadata written at their end): nothing can load it. A folder with .metadata but no
    metadata.json may be another format's checkpoint (torch_dcp, fsdp_dtensor): never."""
    names = os.listdir(folder)
    if checkpoint_format(folder) == "torch":
        return True
    return ".metadata" not in names and all(
        name == "common.pt" or name.endswith((".distcp", ".tmp")) for name in names)


def _torch_format_under(root) -> bool:
    """Whether the latest checkpoint under `root` is a --ckpt-format torch one."""
    try:
        iteration = read_tracker(root)
    except CheckpointError:
        return False  # the load names the damaged tracker
    return iteration is not None and checkpoint_format(
        checkpoint_folder(root, iteration)) == "torch"


def needs_gloo_dp_groups(args) -> bool:
    """Whether this run saves or loads the distributed optimizer's DISTRIB_OPTIM_FILE, which
    megatron-core gathers and scatters over gloo data-parallel groups (Megatron-LM makes them
    unless --disable-gloo-process-groups; the lean trainer only then). The same answer on
    every rank (a shared --load). FlagError where --disable-gloo-process-groups forbids them."""
    if not args.use_distributed_optimizer:
        return False
    loads = bool(args.load) and not args.no_load_optim and not args.finetune and \
        _torch_format_under(args.load)
    if loads and getattr(args, "disable_gloo_process_groups", False):
        raise FlagError(f"--disable-gloo-process-groups: the distributed optimizer's state of "
                        f"the --ckpt-format torch checkpoint under --load {args.load} is read "
                        f"over gloo groups; drop the flag, or pass --no-load-optim to start "
                        f"the optimizer state fresh")
    return loads or (args.ckpt_format == "torch" and bool(args.save)
                     and not args.no_save_optim)


def _clear_partial(root, iteration) -> None:
    """Rank 0, before a save: remove what a killed save of `iteration` left (or another
    run's checkpoint of that iteration in --save, which this save replaces)."""
    try:
        replacing = read_tracker(root, "--save") == iteration
    except CheckpointError:  # a damaged tracker: this save writes a new one
        replacing = False
    if replacing:
        print(f" --save {root}: replacing the checkpoint of iteration {iteration} there",
              flush=True)
    shutil.rmtree(_iter_dir(root, iteration), ignore_errors=True)
    tmp = os.path.join(root, TRACKER + ".tmp")
    if os.path.exists(tmp):
        os.remove(tmp)


def _prune(root, keep: int, newest: int) -> None:
    """Keep the newest `keep` whole checkpoints (never the one just written); remove the
    others, and what killed saves left (`_left_by_a_killed_save`: no load can use them, and
    one above `newest` would otherwise stay for good); leave any other folder alone."""
    found = iterations_under(root)
    whole = [i for i in found if i == newest or is_whole(_iter_dir(root, i))]
    kept = set(whole[-keep:]) | {newest}
    for iteration in found:
        folder = _iter_dir(root, iteration)
        if iteration not in kept and (iteration in whole or _left_by_a_killed_save(folder)):
            shutil.rmtree(folder, ignore_errors=True)


def save_checkpoint(args, iteration, chunks, optimizer, scheduler, counters):
    """Collective: every rank calls it. (The trainer does not call it for the iteration it
    just loaded from this very directory: that checkpoint is already there.)"""
    dcp = import_megatron("megatron.core.dist_checkpointing")
    ps, root = _ps(), args.save
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        _clear_partial(root, iteration)
    dist.barrier()  # nobody writes before rank 0 cleared the folder
    metadata = _content_metadata(args)

    def state():
        return _state(args, iteration, chunks, optimizer, scheduler, counters,
                      {**metadata, "dp_cp_group": ps.get_data_parallel_group(
                          with_context_parallel=True)},
                      rng=not args.no_save_rng, with_optimizer=not args.no_save_optim)

    if args.ckpt_format == "torch_dist":
        folder = _iter_dir(root, iteration)
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        strategies = import_megatron("megatron.core.dist_checkpointing.strategies")
        strategy = strategies.fully_parallel.FullyParallelSaveStrategyWrapper(
            dcp.serialization.get_default_save_sharded_strategy("torch_dist"),
            ps.get_data_parallel_group(with_context_parallel=True))
        dcp.save(state(), folder, strategy, content_metadata=metadata)
    else:
        path = _legacy_file(_iter_dir(root, iteration))
        writer = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        if writer:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        # The optimizer's file first, as Megatron-LM: a save killed midway then leaves no
        # model file (not whole: is_whole), and a model file without an optimizer's beside it
        # means a save without one (--no-save-optim), whole.
        if args.use_distributed_optimizer and not args.no_save_optim:  # collective (DP x CP)
            optimizer.save_parameter_state(os.path.join(os.path.dirname(path),
                                                        DISTRIB_OPTIM_FILE))
        # Built only where it is written, as Megatron-LM: the distributed optimizer's
        # state_dict asserts on a rank whose shard holds no parameter.
        if writer:
            torch.save(state(), path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
        if getattr(args, "save_keep_last", None):
            _prune(root, args.save_keep_last, iteration)
        print(f" saved checkpoint at iteration {iteration} to {root} ({args.ckpt_format})",
              flush=True)
    dist.barrier()
