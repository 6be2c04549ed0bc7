"""Save and resume: model, optimizer, LR schedule, data position and every rank's RNG.

One job: `--save DIR` / `--load DIR` in Megatron's legacy layout, so that a resumed run
continues the loss curve exactly (bit-identical on CPU in float32):

    DIR/latest_checkpointed_iteration.txt          the newest complete iteration
    DIR/iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt   one per (TP, PP) rank, written by DP
                                                   rank 0 / CP rank 0 (replicas are equal)
    DIR/iter_0000010/rng/rank_NNNNN.pt             every rank's CPU/CUDA/tracker RNG states

The tracker file is written last, after a barrier, so a run killed while saving leaves the
previous checkpoint as the latest. Loading checks that the parallel sizes match (a checkpoint
of another TP/PP size cannot be loaded: no resharding here). The `.tmp` files a save killed
midway leaves are removed at the next save or load; `--save-keep-last N` deletes all but the
newest N iteration folders after each save (default: keep all, as Megatron-LM).

What it does not do: no distributed (sharded) checkpoints, no resharding, no async saving.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from megatron_eod.megatron.imports import import_megatron

__all__ = ["save_checkpoint", "load_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"


def _ps():
    return import_megatron("megatron.core.parallel_state")


def _iter_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _model_file(root, iteration):
    ps = _ps()
    name = (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"{ps.get_pipeline_model_parallel_rank():03d}")
    return os.path.join(_iter_dir(root, iteration), name, "model_optim_rng.pt")


def _rng_file(root, iteration):
    return os.path.join(_iter_dir(root, iteration), "rng", f"rank_{dist.get_rank():05d}.pt")


def _rng_state():
    tp = import_megatron("megatron.core.tensor_parallel")
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tp.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state):
    tp = import_megatron("megatron.core.tensor_parallel")
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tp.get_cuda_rng_tracker().set_states(state["tracker"])


def _sizes(args):
    return {"tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size}


def _remove_stale_tmp(root) -> None:
    """A run killed mid-save leaves `*.tmp` files; nothing reads them: remove them."""
    for folder, _, files in os.walk(root):
        for name in files:
            if name in (TRACKER + ".tmp", "model_optim_rng.pt.tmp"):
                os.remove(os.path.join(folder, name))


def _prune(root, keep: int, newest: int) -> None:
    """Keep the newest `keep` iteration folders (never the one just written)."""
    found = sorted(int(name[len("iter_"):]) for name in os.listdir(root)
                   if name.startswith("iter_") and name[len("iter_"):].isdigit())
    for iteration in found[:-keep] if keep < len(found) else []:
        if iteration != newest:
            shutil.rmtree(_iter_dir(root, iteration), ignore_errors=True)


def save_checkpoint(args, iteration, model, optimizer, scheduler, counters):
    """Collective: every rank calls it."""
    ps = _ps()
    root = args.save
    dist.barrier()  # nobody is writing: rank 0 may clear what a killed save left
    if dist.get_rank() == 0 and os.path.isdir(root):
        _remove_stale_tmp(root)
    dist.barrier()
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        path = _model_file(root, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"iteration": iteration, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "counters": dict(counters), "sizes": _sizes(args)}, path + ".tmp")
        os.replace(path + ".tmp", path)
    rng_path = _rng_file(root, iteration)
    os.makedirs(os.path.dirname(rng_path), exist_ok=True)
    torch.save(_rng_state(), rng_path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
        if getattr(args, "save_keep_last", None):
            _prune(root, args.save_keep_last, iteration)
    dist.barrier()


def load_checkpoint(args, model, optimizer, scheduler):
    """-> (iteration, counters) of the latest checkpoint under --load, or (0, {}) if none."""
    root = args.load
    if dist.get_rank() == 0 and os.path.isdir(root):
        _remove_stale_tmp(root)
    dist.barrier()
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        if dist.get_rank() == 0:
            print(f" no checkpoint under --load {root}; starting from scratch", flush=True)
        return 0, {}
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = _model_file(root, iteration)
    if not os.path.isfile(path):
        raise ValueError(f"--load {root}: {path} is missing (was it saved with other "
                         f"--tensor-model-parallel-size/--pipeline-model-parallel-size?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["sizes"] != _sizes(args):
        raise ValueError(f"--load {root}: saved with {state['sizes']}, this run has "
                         f"{_sizes(args)}; resharding is not supported")
    model.load_state_dict(state["model"])
    optimizer.reload_model_params()  # masters follow the loaded weights ...
    if not args.no_load_optim:  # ... unless the checkpoint has its own float32 masters
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    rng_path = _rng_file(root, iteration)
    if not args.no_load_rng:
        if not os.path.isfile(rng_path):
            raise ValueError(f"--load {root}: {rng_path} is missing (saved with another world "
                             f"size? pass --no-load-rng to start fresh RNG streams)")
        _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=False))
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {root} at iteration {iteration}", flush=True)
    return iteration, state["counters"]
