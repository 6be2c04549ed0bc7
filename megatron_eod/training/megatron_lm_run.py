"""Run Megatron-LM's own `pretrain()` with the EoD providers: the production trainer.

    run(argv)   # Megatron-LM's flags plus ours; what pretrain_gpt.py does when
                # megatron.training is importable (or --trainer megatron-lm)

One job: call Megatron-LM's `pretrain()` the way its own pretrain_gpt.py does, with our
providers, on any Megatron-LM from core_v0.16 to 0.19:
* <= 0.17: `pretrain(datasets, model_provider, model_type, forward_step,
  extra_args_provider=add_eod_args, ...)`; >= 0.18: `parse_and_validate_args` first, then
  `pretrain(cfg_container, datasets, ..., model_provider=...)` (always by keyword);
* our flag rules run right after Megatron-LM's `validate_args` (before it builds the
  process groups, so hybrid's hierarchical CP groups come from --ulysses-degree-in-cp too);
* every rank's flags and versions are compared with rank 0's (same_flags) right before
  Megatron-LM makes its groups (each `initialize_model_parallel`), --save checked to be shared,
  and our errors end in-process restarts (megatron_lm_guards.py);
* `--metrics-file` gets one JSON line per iteration (from Megatron-LM's `training_log`, so
  the loss is the iteration's own, not its log-interval average) and per evaluation;
* megatron-core wheels ship the dataset helpers prebuilt and no Makefile: Megatron-LM's
  start-up `make` is skipped when the built module imports;
* without CUDA: `cpu_compat.apply(megatron_lm=True)` and CUDA_DEVICE_MAX_CONNECTIONS=1; with
  CUDA, `cpu_compat.apply_torch_adamw_fixes()` where megatron-core uses torch's AdamW
  (Megatron-LM asserts it for TP/CP; meaningless on a CPU).

What it does not do: no flag parsing of its own (Megatron-LM's parser with add_eod_args).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megatron_eod.data.checks import DatasetError
from megatron_eod.megatron import cpu_compat, gloo_on_cuda
from megatron_eod.training.checkpoint_preflight import find_checkpoint
from megatron_eod.training.checkpoint_schedule import (apply_schedule_choice, group_lrs,
                                                       schedule_mismatch,
                                                       schedule_values_to_flags)
from megatron_eod.training.checkpointing import CheckpointError
from megatron_eod.training.collective_faults import exit_on_collective_fault
from megatron_eod.training.cp_flags import FlagError, exit_with_error
from megatron_eod.training.flag_rules import check_global_batch
from megatron_eod.training.megatron_lm import EodProviders
from megatron_eod.training.megatron_lm_args import (add_eod_args, check_before_megatron,
                                                    eod_args_from_megatron)
from megatron_eod.training.megatron_lm_guards import (flags_compared_before_groups,
                                                      our_errors_end_restarts, timeout_minutes)
from megatron_eod.training.parent_watch import exit_with_parent, launched_by_torchrun

__all__ = ["megatron_lm_assertion", "megatron_lm_available", "run"]

# Megatron-LM's pretrain_gpt.py default, kept so a user's launch script means the same.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def megatron_lm_available() -> bool:
    """Whether `megatron.training` (Megatron-LM's trainer) can be imported."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def run(argv=None):
    """Train with Megatron-LM's `pretrain()`; raises SystemExit(2) on a flag error."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]  # Megatron-LM parses sys.argv itself
    if launched_by_torchrun():
        exit_with_parent()  # no orphans training on when torchrun's agent dies
    if not torch.cuda.is_available():
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        cpu_compat.apply(megatron_lm=True)
    else:
        cpu_compat.apply_torch_adamw_fixes()  # only where megatron-core uses torch's AdamW
    training = importlib.import_module("megatron.training.training")
    _use_prebuilt_dataset_helpers()
    _check_after_validate()
    _schedule_flags_after_load(training)
    providers = EodProviders()
    _Metrics(providers).install(training)
    model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder
    restart = importlib.import_module("megatron.training.inprocess_restart")
    restarts = {"on": False}
    pretrain, store = restart.maybe_wrap_for_inprocess_restart(
        our_errors_end_restarts(training.pretrain, restarts))
    restarts["on"] = store is not None  # --inprocess-restart
    kwargs = dict(train_valid_test_dataset_provider=providers.datasets_provider,
                  model_provider=providers.model_provider, model_type=model_type,
                  forward_step_func=providers.forward_step, store=store,
                  get_embedding_ranks=_embedding_ranks)
    try:
        with flags_compared_before_groups():
            if "cfg_container" in inspect.signature(training.pretrain).parameters:  # >= 0.18
                arguments = importlib.import_module("megatron.training.arguments")
                args = arguments.parse_and_validate_args(extra_args_provider=add_eod_args,
                                                         args_defaults=ARGS_DEFAULTS)
                config = importlib.import_module("megatron.training.argument_utils")
                pretrain(config.pretrain_cfg_container_from_args(args), **kwargs)
            else:
                pretrain(extra_args_provider=add_eod_args, args_defaults=ARGS_DEFAULTS, **kwargs)
    except (FlagError, DatasetError, CheckpointError) as error:  # raised on every rank
        exit_with_error(error, 2)
    except RuntimeError as error:  # a collective that lost a rank: one line, else raised
        exit_on_collective_fault(error, timeout_minutes())
        raise
    finally:
        if providers._steps is not None:
            providers._steps.close()


def _use_prebuilt_dataset_helpers() -> None:
    utils = importlib.import_module("megatron.core.datasets.utils")
    if os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile")):
        return  # a source checkout: Megatron-LM builds them as usual
    importlib.import_module("megatron.core.datasets.helpers_cpp")  # the wheel's build
    utils.compile_helpers = lambda: None


def _check_after_validate() -> None:
    """Run our rules right after Megatron-LM's validate_args, wherever it is called from (our
    CP spellings right before it: its own assertions on them carry no message)."""
    for name in ("megatron.training.arguments", "megatron.training.initialize"):
        module = importlib.import_module(name)
        original = getattr(module, "validate_args", None)
        if original is None or getattr(original, "_eod", False):
            continue

        def validate_args(args, *rest, _original=original, **kwargs):
            check_before_megatron(args)
            try:
                result = _original(args, *rest, **kwargs)
            except AssertionError as error:  # most carry no message: say the rule and flags
                _global_batch_as_ours(args, error)
                raise FlagError(megatron_lm_assertion(error)) from None
            eod_args_from_megatron(args)
            if gloo_on_cuda.wanted(args, torch.cuda.is_available()):
                gloo_on_cuda.apply()  # before Megatron-LM builds DDP and the attention runs
                gloo_on_cuda.share_devices(args, torch.cuda.device_count())
            return result

        validate_args._eod = True
        module.validate_args = validate_args


def _global_batch_as_ours(args, error: AssertionError) -> None:
    """Megatron-LM >= 0.18 asserts --global-batch-size's multiple as the evaluation batch's
    (`eval_global_batch_size ... data_parallel_size`, neither a flag given): our line,
    where that is the assertion (it holds whatever --decrease-batch-size-if-needed says)."""
    sizes = (getattr(args, name, None) for name in ("micro_batch_size", "data_parallel_size",
                                                    "global_batch_size"))
    if "eval_global_batch_size" in str(error) and all(
            isinstance(size, int) and size > 0 for size in sizes):
        check_global_batch(args, decrease_helps=False)


def _schedule_flags_after_load(training) -> None:
    """checkpoint_preflight's checks of --load (the lines the lean trainer gives, where
    Megatron-LM's load failed with a traceback, or exited 0), Megatron-LM's load_checkpoint
    (a bare sys.exit() in it: exit 2 with a line), then the LR flags where
    --override-opt_param-scheduler asks for them: the loaded optimizer param groups carry the
    checkpoint's max/min LR, which megatron-core 0.16's scheduler reads before its own, so
    Megatron-LM said "overriding" and trained on at the checkpoint's LR (the lean trainer's
    checkpoint_load does the same there). A schedule that differs without either scheduler
    flag: one line naming them."""
    original = training.load_checkpoint
    if getattr(original, "_eod", False):
        return

    def load_checkpoint(model, optimizer, scheduler, *rest, **kwargs):
        args = importlib.import_module("megatron.training").get_args()
        if _checks_its_checkpoint(args, rest, kwargs):
            find_checkpoint(args, lean=False)
        flags = group_lrs(optimizer) if optimizer is not None else []
        saved = []  # the checkpoint's schedule values per current group
        if optimizer is not None:
            load = optimizer.load_state_dict

            def load_state_dict(state_dict, *a, **kw):  # megatron-core 0.19 pairs saved and
                # current groups by their max/min LR too: another --lr found none and stopped
                # the load before the scheduler flags had a say (checkpoint_schedule.py's rule)
                saved[:] = schedule_values_to_flags(state_dict, optimizer.param_groups)
                return load(state_dict, *a, **kw)

            optimizer.load_state_dict = load_state_dict
        try:
            result = original(model, optimizer, scheduler, *rest, **kwargs)
        except AssertionError as error:
            if "OptimizerParamScheduler" not in str(error):
                raise
            raise CheckpointError(schedule_mismatch(error, args.load)) from None
        except SystemExit as stop:  # its bare sys.exit() after a failed load: status 0
            if stop.code not in (None, 0):
                raise
            raise CheckpointError(f"--load {args.load}: Megatron-LM's load_checkpoint stopped "
                                  f"the run (its message above says why; it exits with status "
                                  f"0, which a job scheduler reads as success)") from None
        finally:
            if optimizer is not None:
                del optimizer.load_state_dict
        _check_rerun_state(importlib.import_module("megatron.training").get_args())
        if scheduler is not None and optimizer is not None:  # loaded anew: the groups too
            apply_schedule_choice(optimizer, flags, saved,
                                  scheduler.override_opt_param_scheduler,
                                  scheduler.use_checkpoint_opt_param_scheduler)
            scheduler.step(0)  # this iteration's LR from them
        return result

    load_checkpoint._eod = True
    training.load_checkpoint = load_checkpoint


def _checks_its_checkpoint(args, rest, kwargs) -> bool:
    """Whether checkpoint_preflight checks what this load_checkpoint call reads: --load (its
    default load_arg) on a local file system, without non-persistent checkpoints (which
    Megatron-LM may prefer to --load's)."""
    load_arg = kwargs.get("load_arg", rest[0] if rest else "load")
    paths = [p for p in (args.load, getattr(args, "pretrained_checkpoint", None)) if p]
    return (load_arg == "load" and not getattr(args, "non_persistent_ckpt_type", None)
            and not any("://" in path for path in paths))


def _check_rerun_state(args) -> None:
    """After a possible transient error, Megatron-LM's rerun machine saves a checkpoint "for
    further examination" and exits (status 17) in its state RERUNNING_IN_PLACE; resumed,
    megatron-core 0.16 re-enters that state without the saved state it re-runs from, and every
    rank stops with a TypeError deep in rerun_state_machine. One line instead, and the way to
    resume: --rerun-mode disabled ignores the machine's saved state (its load_state_dict)."""
    machine = importlib.import_module("megatron.core.rerun_state_machine")
    rsm = machine.get_rerun_state_machine()
    if rsm.state == machine.RerunState.RERUNNING_IN_PLACE and \
            getattr(rsm, "saved_state", True) is None:
        raise CheckpointError(
            f"--load {args.load}: Megatron-LM's rerun machine saved this checkpoint after a "
            f"possible transient error at iteration {rsm.current_iteration}, for examination; "
            f"this megatron-core cannot re-run that iteration from it (a TypeError on every "
            f"rank); pass --rerun-mode disabled to resume from it as from any checkpoint")


def megatron_lm_assertion(error: AssertionError) -> str:
    """A one-line account of an assertion of Megatron-LM's argument checks: its message, or
    the asserted line where it has none, the flags it reads, and where it stands."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    line = _asserted(frame.filename, frame.lineno) or (frame.line or "").strip()
    flags = sorted({"--" + dest.replace("_", "-") for dest in re.findall(r"args\.(\w+)", line)})
    where = os.path.join(*frame.filename.split(os.sep)[-3:])
    said = str(error).strip() or f"it requires `{line.removeprefix('assert ')}`"
    return (f"Megatron-LM's flag check refused this run: {said}"
            f"{' (' + ', '.join(flags) + ')' if flags else ''} [{where}:{frame.lineno}]")


def _asserted(filename: str, lineno: int) -> str:
    """The whole `assert` statement around `lineno` of `filename` (a traceback names the line
    of the failing expression, which may be the last of several), on one line."""
    try:
        with open(filename) as f:
            source = f.read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assert) and node.lineno <= lineno <= node.end_lineno:
                test = ast.get_source_segment(source, node.test).replace("\\\n", " ")
                return "assert " + " ".join(test.split())
    except (OSError, SyntaxError, ValueError):
        pass
    return ""


def _embedding_ranks(pp_ranks):
    """As Megatron-LM's pretrain_gpt.py (no MTP): the first stage, and the last one when it
    holds the tied output embedding."""
    args = importlib.import_module("megatron.training").get_args()
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not args.untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return ranks


def _logged_lr(param_groups):
    """The LR Megatron-LM logs of these groups (its first default_config group's)."""
    scheduler = importlib.import_module("megatron.core.optimizer_param_scheduler")
    canonical = getattr(scheduler, "get_canonical_lr_for_logging", None)
    if canonical is not None:
        return canonical(param_groups)
    return param_groups[0]["lr"] if param_groups else None


class _Metrics:
    """--metrics-file under Megatron-LM's loop: the same JSON lines as the lean trainer's
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

        def train_step(*args, **kwargs):  # the LR this iteration runs at, as the lean trainer
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
        self._write({"iteration": iteration, "lm_loss": float(loss),
                     "grad_norm": None if grad_norm is None else float(grad_norm),
                     "lr": None if lr is None else float(lr), "skipped": int(skipped),
                     "tokens": tokens, "tokens_per_s": tokens / seconds,
                     "iteration_ms": seconds * 1e3, "plan_wait_ms": wait * 1e3})

    def _write(self, record):
        args = importlib.import_module("megatron.training").get_args()
        if not args.metrics_file or dist.get_rank() != dist.get_world_size() - 1:
            return
        if self.file is None:
            self.file = open(args.metrics_file, "a")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
