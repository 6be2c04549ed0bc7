"""When a collective, a save or a validated result fails, every rank ends, each with one line.

One job, these cases (the processes of a rank or launcher that died: process_tree.py):
- `exit_on_collective_fault(error, timeout_minutes)`: a RuntimeError from a collective that
  waited past --distributed-timeout-minutes (a rank stopped answering) or that lost its peer
  (gloo: "Connection closed by peer", "Connection reset by peer", "Read error"; the store at
  start-up: a DistNetworkError, or a wait timeout where a rank never joined) or could not
  reach one at all (gloo's "Connection refused", within seconds: not a timeout) becomes
  `pretrain_gpt.py: error: rank R: ... in <the innermost megatron frame>: <the message>` and
  exit status 1 on every rank that meets it. Any other error is left to the caller.
- `our_errors_end_restarts(pretrain, restarts)`: under --inprocess-restart our flag, data and
  checkpoint errors end nvidia-resiliency-ext's restarts instead of repeating.
- a result Megatron-LM validates (a NaN or Inf loss or gradient: --check-for-nan-in-loss-and-
  grad, on by default; a spiky loss: --check-for-spiky-loss) that fails: under
  --rerun-mode disabled, its RuntimeError ("Unexpected result") on every rank becomes one line
  (`exit_on_failed_validation`, exit 1); under its default --rerun-mode validate_results, its
  rerun machine reruns the iteration in place and, where the result reproduces, saves a
  checkpoint and exits 16 for the job to resume on other GPUs, then 17 if the result fails
  again there: each exit is said in one line (`say_rerun_exit`), and without --save, where it
  stopped every rank with a TypeError in its save, it stops with one line and 17
  (`no_save_stops_a_rerun`).
- a failed save: checkpoint_save.py says it (its peers then meet the closed connection, above).

What it does not do: no detection of its own (NCCL's watchdog and gloo's timeouts decide), no
retry.
"""

from __future__ import annotations

import functools
import importlib
import os
import traceback

import torch.distributed as dist

from megatron_eod.data.checks import DatasetError
from megatron_eod.training.checkpoint_files import CheckpointError
from megatron_eod.training.cp_flags import FlagError, say_error

__all__ = ["collective_fault", "exit_on_collective_fault", "exit_on_failed_validation",
           "no_save_stops_a_rerun", "our_errors_end_restarts", "say_rerun_exit",
           "timeout_minutes"]

# Megatron-LM's rerun machine's exit codes (megatron/core/rerun_state_machine.py).
RESUME_TO_DISAMBIGUATE, FAILED_ON_RESULT_VALIDATION = 16, 17
_NAN_FLAGS = ("(Megatron-LM's --check-for-nan-in-loss-and-grad, on by default; "
              "--no-check-for-nan-in-loss-and-grad trains on)")

_LOST_PEER = ("closed by peer", "reset by peer", "read error")


def _where(error) -> str:
    """The innermost megatron/megatron_eod frame of an exception: which collective waited."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "megatron" in f.filename]
    return f"{frames[-1].name} ({os.path.basename(frames[-1].filename)})" if frames else "?"


def collective_fault(error, timeout_minutes="?"):
    """What went wrong, where `error` is a collective's timeout or lost peer; None otherwise."""
    said = str(error).lower()
    if not isinstance(error, RuntimeError):
        return None
    if "connection refused" in said:  # before "timed out": gloo says "timed out connecting"
        return ("a peer rank could not be reached (nothing listens at its address: it stopped, "
                "or it is not of this launch, e.g. after torchrun restarted the workers)")
    if "timed out" in said or "wait timeout" in said:  # the latter: the store at start-up
        return (f"a collective waited longer than --distributed-timeout-minutes "
                f"{timeout_minutes} (a rank stopped answering or died: see its own error)")
    if any(words in said for words in _LOST_PEER) or isinstance(
            error, getattr(dist, "DistNetworkError", ())):
        return "a peer rank closed its connection (it stopped: see its own error)"
    return None


def exit_on_collective_fault(error: RuntimeError, timeout_minutes) -> None:
    """SystemExit(1) after one line where `error` is a collective's timeout or lost peer;
    returns (for the caller to re-raise) otherwise."""
    what = collective_fault(error, timeout_minutes)
    if what is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    message = " ".join(str(error).split())  # one line (gloo's carry newlines)
    message = message if len(message) <= 600 else message[:600] + " ..."
    say_error(f"pretrain_gpt.py: error: rank {rank}: {what} in {_where(error)}: {message}")
    raise SystemExit(1) from None


def timeout_minutes():
    try:
        return importlib.import_module("megatron.training").get_args(
            ).distributed_timeout_minutes
    except (AssertionError, AttributeError):  # before its args were parsed
        return "?"


def our_errors_end_restarts(pretrain, restarts):
    """Under --inprocess-restart, nvidia-resiliency-ext's Wrapper runs pretrain() again after
    any error, with no limit (Megatron-LM sets none): a flag, data or checkpoint error fails
    the same way every time, so it is said and then raised as the Wrapper's terminal
    RestartAbort. (Not run against the package here: it is not installed; the wiring is
    tested with a stand-in.)"""

    @functools.wraps(pretrain)
    def pretrain_once(*args, **kwargs):
        try:
            return pretrain(*args, **kwargs)
        except (FlagError, DatasetError, CheckpointError) as error:
            if not restarts["on"]:
                raise
            exception = importlib.import_module("nvidia_resiliency_ext.inprocess.exception")
            say_error(f"pretrain_gpt.py: error: {error}")
            raise exception.RestartAbort(str(error)) from None

    return pretrain_once


def _rank():
    return dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")


def _iteration():
    machine = importlib.import_module("megatron.core.rerun_state_machine")
    return machine.get_rerun_state_machine().current_iteration


def exit_on_failed_validation(error: RuntimeError) -> None:
    """SystemExit(1) after one line where `error` is the rerun machine's failed validation
    under --rerun-mode disabled ("Rank R, ..., iteration N: Unexpected result nan
    (message='found NaN in ...')"); returns otherwise."""
    if "Unexpected result" not in str(error):
        return
    say_error(f"pretrain_gpt.py: error: {' '.join(str(error).split())} {_NAN_FLAGS}")
    raise SystemExit(1) from None


def say_rerun_exit(code) -> None:
    """One line for the rerun machine's exits (16, 17) from Megatron-LM's pretrain(), by the
    state it exits in."""
    if code not in (RESUME_TO_DISAMBIGUATE, FAILED_ON_RESULT_VALIDATION):
        return
    machine = importlib.import_module("megatron.core.rerun_state_machine")
    state = getattr(machine.get_rerun_state_machine().state, "name", "")
    said = {
        "WILL_RERUN_FROM_CHECKPOINT": "failed again when rerun in place; Megatron-LM saved a "
                                      "checkpoint at --save: resume the job from it, on other "
                                      "GPUs, to tell a faulty GPU (it then trains on) from a "
                                      "diverged run (it then exits 17)",
        "RERUNNING_IN_PLACE": "gave another result when rerun in place (a transient fault, e.g. "
                              "a flaky GPU): resume from the last checkpoint",
        "RERUNNING_FROM_CHECKPOINT": "failed again when rerun from its checkpoint: the run "
                                     "diverged (lower --lr, or resume from an earlier "
                                     "checkpoint)",
        "RERUNNING_AGAIN_FROM_CHECKPOINT": "gave another result when rerun from its checkpoint: "
                                           "resume from it once more to establish which",
    }.get(state, f"(rerun state {state or '?'})")
    say_error(f"pretrain_gpt.py: rank {_rank()}: iteration {_iteration()}: a result failed "
              f"validation {_NAN_FLAGS} and {said}; Megatron-LM's --rerun-mode "
              f"validate_results exits {code}")


def no_save_stops_a_rerun(training) -> None:
    """Megatron-LM's rerun machine checkpoints for a rerun elsewhere whether or not --save is
    given (the only save its loop does not guard by --save): without it, one line and exit
    17 instead of a TypeError on every rank. Idempotent."""
    original = training.save_checkpoint_and_time
    if getattr(original, "_eod", False):
        return

    def save_checkpoint_and_time(*args, **kwargs):
        if not importlib.import_module("megatron.training").get_args().save:
            say_error(f"pretrain_gpt.py: error: rank {_rank()}: iteration {_iteration()}: a "
                      f"result failed validation and again when rerun in place {_NAN_FLAGS}; "
                      f"Megatron-LM's --rerun-mode validate_results saves a checkpoint for a "
                      f"rerun on other GPUs, but no --save is given: stopping (pass --save to "
                      f"tell a faulty GPU from a diverged run)")
            raise SystemExit(FAILED_ON_RESULT_VALIDATION)
        return original(*args, **kwargs)

    save_checkpoint_and_time._eod = True
    training.save_checkpoint_and_time = save_checkpoint_and_time
