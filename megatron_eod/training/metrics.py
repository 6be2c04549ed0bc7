"""--metrics-file: one JSON line per iteration and per evaluation, written by the last rank.

One job, two parts:
- `check_metrics_file(args, error_type)`, at start-up: the last rank makes the folder (as
  --save's is made) and opens the file for appending; what it finds reaches every rank, which
  stops with the same line (a folder that did not exist stopped the last rank alone with a
  traceback, the others then waited in their next collective). A collective.
- `MetricsFile(providers).install(training)`: hooks into Megatron-LM's `train_step`,
  `training_log`, `evaluate` and `evaluate_and_print_results` so that each record holds the
  iteration's own loss (Megatron-LM's "lm loss" log line averages over --log-interval, and
  its first line after a start or resume averages two iterations) and its EoD-aware FLOPs.
- `EodFlops(providers).install(training)`: Megatron-LM's FLOPs count (its throughput log
  line, TFLOP/s per GPU, and the checkpoints' num_floating_point_operations_so_far) counts
  the attention pairs the document masks need, not every causal pair of a row: its own
  formula, given the iteration's sum over documents of length^2 where it counts
  batch x seq-length^2. The providers count each training micro-batch's documents;
  one all-reduce of two numbers over the data-parallel group per iteration sums the
  replicas'.

What it does not do: no log lines of its own (Megatron-LM's).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_eod.training.every_rank import gathered

__all__ = ["EodFlops", "MetricsFile", "check_metrics_file", "eod_flops"]


def _ready(path):
    """None, or why `path` cannot be appended to."""
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as error:
        return (f"--metrics-file {path}: cannot be written ({error.strerror or error}"
                f"{': ' + error.filename if error.filename else ''})")
    return None


def check_metrics_file(args, error_type) -> None:
    """Raise `error_type` on every rank where the last rank cannot append to --metrics-file."""
    path = getattr(args, "metrics_file", None)  # may be given to the last rank only
    world = dist.get_world_size() if dist.is_initialized() else 1
    last = not dist.is_initialized() or dist.get_rank() == world - 1
    said = _ready(path) if last and path else None
    if world > 1:  # every rank, flag or not (same_flags lets it differ by rank)
        said = gathered(said)[-1]
    if said:
        raise error_type(said)


def _logged_lr(param_groups):
    """The LR Megatron-LM logs of these groups (its first default_config group's)."""
    scheduler = importlib.import_module("megatron.core.optimizer_param_scheduler")
    canonical = getattr(scheduler, "get_canonical_lr_for_logging", None)
    if canonical is not None:
        return canonical(param_groups)
    return param_groups[0]["lr"] if param_groups else None


class MetricsFile:
    """--metrics-file under Megatron-LM's loop: one JSON line per iteration
    (iteration, lm_loss, grad_norm, lr, tokens, tokens_per_s, iteration_ms, plan_wait_ms;
    lr is the one the iteration ran at, read before its step: Megatron-LM's log line shows the
    one its step leaves for the next;
    kind "valid"/"test" for evaluations, and "set": its index with --multiple-validation-sets),
    written by the last rank."""

    def __init__(self, providers):
        self.providers, self.file, self.iteration = providers, None, 0
        self.last, self.waited, self.eval_losses, self.lr = time.perf_counter(), 0.0, [], None

    def install(self, training):
        log, evaluate, report = (training.training_log, training.evaluate,
                                 training.evaluate_and_print_results)
        step, signature = training.train_step, inspect.signature(training.train_step)

        def train_step(*args, **kwargs):  # the LR this iteration runs at
            optimizer = signature.bind(*args, **kwargs).arguments.get("optimizer")
            self.lr = None if optimizer is None else _logged_lr(optimizer.param_groups)
            return step(*args, **kwargs)

        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                         report_memory_flag, skipped_iter, grad_norm, *rest, **kwargs):
            result = log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                         report_memory_flag, skipped_iter, grad_norm, *rest, **kwargs)
            self._iteration(loss_dict, self.lr, iteration, skipped_iter, grad_norm)
            return result

        def evaluate_(*args, **kwargs):  # once per validation set
            result = evaluate(*args, **kwargs)
            self.eval_losses.append(result[0].get("lm loss") if result and result[0] else None)
            return result

        reported = inspect.signature(report)

        def evaluate_and_print_results(prefix, *args, **kwargs):
            self.eval_losses = []
            result = report(prefix, *args, **kwargs)
            kind = "test" if "test" in str(prefix) else "valid"
            many = len(self.eval_losses) > 1  # --multiple-validation-sets
            # Its own iteration argument: the loaded one under --skip-train.
            at = reported.bind(prefix, *args, **kwargs).arguments.get("iteration",
                                                                      self.iteration)
            for index, loss in enumerate(self.eval_losses):
                if loss is not None:
                    self._write({"kind": kind, "iteration": at,
                                 "lm_loss": float(loss), **({"set": index} if many else {})})
            return result

        training.training_log, training.evaluate = training_log, evaluate_
        training.train_step = train_step
        training.evaluate_and_print_results = evaluate_and_print_results

    def _iteration(self, loss_dict, lr, iteration, skipped, grad_norm):
        now, self.iteration = time.perf_counter(), iteration
        seconds, self.last = now - self.last, now
        steps = self.providers._steps
        waited = steps.plan_wait_s if steps is not None else 0.0
        wait, self.waited = waited - self.waited, waited
        loss = loss_dict.get("lm loss") if loss_dict else None
        if loss is None:
            return  # not the last pipeline stage, or a skipped iteration
        args = importlib.import_module("megatron.training").get_args()
        calculator = importlib.import_module("megatron.core.num_microbatches_calculator")
        tokens = calculator.get_current_global_batch_size() * args.seq_length  # ramps too
        training = importlib.import_module("megatron.training.training")
        flops = training.num_floating_point_operations(
            args, calculator.get_current_global_batch_size())  # EodFlops' where installed
        work = getattr(training.num_floating_point_operations, "_eod_work", lambda: None)()
        self._write({"iteration": iteration, "lm_loss": float(loss),
                     "grad_norm": None if grad_norm is None else float(grad_norm),
                     "lr": None if lr is None else float(lr), "skipped": int(skipped),
                     "tokens": tokens, "tokens_per_s": tokens / seconds,
                     "iteration_ms": seconds * 1e3, "plan_wait_ms": wait * 1e3,
                     "tflops_per_gpu": flops / seconds / dist.get_world_size() / 1e12,
                     "seqlen_squared_sum": None if work is None else work[0]})

    def _write(self, record):
        args = importlib.import_module("megatron.training").get_args()
        if not args.metrics_file or dist.get_rank() != dist.get_world_size() - 1:
            return
        if self.file is None:
            self.file = open(args.metrics_file, "a")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def eod_flops(flops, args, batch_size, seqlen_squared_sum, tokens):
    """Megatron-LM's `num_floating_point_operations` (`flops`) for a global batch whose
    attention is the documents': from 0.18 it takes the sum over sequences of length^2 and
    the tokens; before, its formula is (checked at 0.16 and 0.17) a part linear in tokens plus
    one in batch x seq-length^2, so the latter is measured from two calls at the same tokens
    (half the sequence length, twice the batch) and scaled to the documents'."""
    if "seqlen_squared_sum_in_batch" in inspect.signature(flops).parameters:
        return flops(args, batch_size, seqlen_squared_sum_in_batch=seqlen_squared_sum,
                     total_real_tokens_in_batch=tokens)
    causal = flops(args, batch_size)
    half = copy.copy(args)
    half.seq_length = args.seq_length / 2
    attention = 2 * (causal - flops(half, 2 * batch_size))  # c x batch x seq-length^2
    return causal - attention + attention * seqlen_squared_sum / (
        batch_size * args.seq_length ** 2)


class EodFlops:
    """Megatron-LM's FLOPs count with the documents' attention pairs (module docstring)."""

    def __init__(self, providers):
        self.providers = providers
        self.work = None  # (sum of length^2, tokens) of the last training iteration, global

    def install(self, training):
        if getattr(training.num_floating_point_operations, "_eod", False):
            return
        schedules, step = training.get_forward_backward_func, training.train_step
        flops = training.num_floating_point_operations

        @functools.wraps(schedules)
        def get_forward_backward_func(*args, **kwargs):
            schedule = schedules(*args, **kwargs)
            signature = inspect.signature(schedule)

            @functools.wraps(schedule)
            def forward_backward(*call_args, **call_kwargs):
                bound = signature.bind(*call_args, **call_kwargs)
                if not bound.arguments.get("forward_only", False):  # a rerun's pass too
                    self.providers.work[:] = [0, 0]
                return schedule(*call_args, **call_kwargs)
            return forward_backward

        @functools.wraps(step)  # its signature: MetricsFile binds the optimizer by name
        def train_step(*args, **kwargs):
            result = step(*args, **kwargs)
            self.work = self._summed(self.providers.work)  # collective: every rank steps
            return result

        @functools.wraps(flops)
        def num_floating_point_operations(args, batch_size, *rest, **kwargs):
            if self.work is None or not self.work[1]:
                return flops(args, batch_size, *rest, **kwargs)
            return eod_flops(flops, args, batch_size, *self.work)

        num_floating_point_operations._eod = True
        num_floating_point_operations._eod_work = lambda: self.work
        training.get_forward_backward_func = get_forward_backward_func
        training.train_step = train_step
        training.num_floating_point_operations = num_floating_point_operations

    @staticmethod
    def _summed(work):
        """This rank's count summed over the data-parallel replicas (TP, CP and pipeline
        peers read the same micro-batches)."""
        ps = importlib.import_module("megatron.core.parallel_state")
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        total = torch.tensor(work, dtype=torch.float64, device=device)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        return [int(value) for value in total.tolist()]
