"""Multi-rank tests on CPU: fork `world_size` gloo ranks, run a function in each, collect results.

Why fork: children inherit the parent's imported torch and megatron-core, so a 4-rank test
costs ~0.4 s instead of ~7 s with spawn. Two rules keep forked ranks from hanging:
`torch.set_num_threads(1)` is the first thing a rank does (a child that inherits a used
OpenMP pool deadlocks on its first parallel op), and each run gets a fresh FileStore in its own
temp dir (no port races between tests). A rank that raises reports its traceback; a rank that
hangs (a collective waiting forever) is killed at `timeout` and named in the failure. A rank
freezes the objects it inherits (gc.freeze), so that its garbage collector leaves them, and the
memory pages they share with the parent, alone.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _rank_main(fn, rank, world_size, store_path, conn, args, kwargs):
    torch.set_num_threads(1)
    gc.freeze()  # the inherited objects: a collection here would copy every page they hold
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Every rank's connections made before any goes on: a rank whose function ends at
        # once (a refused input) closed its side while a peer was still connecting ("Gloo
        # connectFullMesh failed ... Connection closed by peer", seen once in 1200 tests).
        dist.barrier()
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            if dist.is_initialized():  # a test may have ended it to make its own
                dist.destroy_process_group()
        message = ("ok", result)
    except BaseException:  # noqa: BLE001 - the parent re-raises with the rank named
        message = ("error", traceback.format_exc())
    try:
        # Plain pickle copies tensor data; Connection.send would pass tensors through shared
        # memory that dies with this process.
        conn.send_bytes(pickle.dumps(message))
    except BaseException:  # noqa: BLE001 - an unpicklable result
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)  # skip atexit hooks inherited from the pytest parent


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
              daemon: bool = True, **kwargs) -> List[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return results.

    `daemon=False` lets ranks start processes of their own (Megatron-LM's data loader workers
    and checkpoint writer); a hung rank is still killed at `timeout`.

    `fn` must be importable or defined before the fork (it is inherited, not pickled); its
    return value must be picklable. Raises AssertionError naming every failed or hung rank.
    """
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="eod_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        pipes, procs = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, daemon=daemon,
                               args=(fn, rank, world_size, store_path, child_end, args, kwargs))
            proc.start()
            child_end.close()
            pipes.append(parent_end)
            procs.append(proc)
        results, failures = [None] * world_size, []
        remaining = {rank: pipe for rank, pipe in enumerate(pipes)}
        end = time.monotonic() + timeout
        while remaining and time.monotonic() < end:
            ready = multiprocessing.connection.wait(list(remaining.values()),
                                                    timeout=end - time.monotonic())
            for pipe in ready:
                rank = pipes.index(pipe)
                try:
                    status, payload = pickle.loads(pipe.recv_bytes())
                except (EOFError, OSError):
                    status, payload = "error", "rank exited without a result (crashed?)"
                del remaining[rank]
                if status == "ok":
                    results[rank] = payload
                else:
                    failures.append(f"rank {rank} failed:\n{payload}")
                    end = min(end, time.monotonic() + 10)  # peers may now hang: give 10 s
        for rank in remaining:
            failures.append(f"rank {rank} hung (no result within {timeout:.0f} s)")
        for rank, proc in enumerate(procs):
            if rank in remaining:
                proc.kill()  # hung: do not wait for it
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if failures:
            raise AssertionError("\n".join(failures))
        return results
