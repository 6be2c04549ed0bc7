"""A collective that failed because another rank stopped, said in one line: both trainers.

One job: `exit_on_collective_fault(error, timeout_minutes)` turns a RuntimeError from a
collective that waited past --distributed-timeout-minutes (a rank stopped answering) or that
lost its peer (gloo: "Connection closed by peer", "Connection reset by peer", "Read error";
the store at start-up: a DistNetworkError, or a wait timeout where a rank never joined, e.g.
one stopped by a flag valid on other nodes only; a rank exited, was killed, or its node died)
or could not reach a peer at all (gloo's "Connection refused", within seconds: not a timeout)
into `pretrain_gpt.py: error: rank R: ... in
<the innermost megatron frame>: <the message>` and exit status 1, on every rank that meets
it (the stopped one may be any of them). Any other error is left to the caller.

What it does not do: no detection of its own (NCCL's watchdog and gloo's timeouts decide),
no retry.
"""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist

from megatron_eod.training.cp_flags import say_error

__all__ = ["exit_on_collective_fault"]

_LOST_PEER = ("closed by peer", "reset by peer", "read error")


def _where(error) -> str:
    """The innermost megatron/megatron_eod frame of an exception: which collective waited."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "megatron" in f.filename]
    return f"{frames[-1].name} ({os.path.basename(frames[-1].filename)})" if frames else "?"


def exit_on_collective_fault(error: RuntimeError, timeout_minutes) -> None:
    """SystemExit(1) after one line where `error` is a collective's timeout or lost peer;
    returns (for the caller to re-raise) otherwise."""
    said = str(error).lower()
    if "connection refused" in said:  # before "timed out": gloo says "timed out connecting"
        what = ("a peer rank could not be reached (nothing listens at its address: it stopped, "
                "or it is not of this launch, e.g. after torchrun restarted the workers)")
    elif "timed out" in said or "wait timeout" in said:  # the latter: the store at start-up
        what = (f"a collective waited longer than --distributed-timeout-minutes "
                f"{timeout_minutes} (a rank stopped answering or died: see its own error)")
    elif any(words in said for words in _LOST_PEER) or isinstance(
            error, getattr(dist, "DistNetworkError", ())):
        what = "a peer rank closed its connection (it stopped: see its own error)"
    else:
        return
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    message = " ".join(str(error).split())  # one line (gloo's carry newlines)
    message = message if len(message) <= 600 else message[:600] + " ..."
    say_error(f"pretrain_gpt.py: error: rank {rank}: {what} in {_where(error)}: {message}")
    raise SystemExit(1) from None
