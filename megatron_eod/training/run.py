"""Run Megatron-LM's own `pretrain()` with the EoD providers: the only trainer.

    run(argv)   # Megatron-LM's flags plus ours; what pretrain_gpt.py does

One job: call Megatron-LM's `pretrain()` the way its own pretrain_gpt.py does, with our
providers, on any Megatron-LM from core_v0.16 to 0.19:
* <= 0.17: `pretrain(datasets, model_provider, model_type, forward_step,
  extra_args_provider=add_eod_args, ...)`; >= 0.18: `parse_and_validate_args` first, then
  `pretrain(cfg_container, datasets, ..., model_provider=...)` (always by keyword);
* our flag rules run right after Megatron-LM's `validate_args` (before it builds the
  process groups, so hybrid's hierarchical CP groups come from --ulysses-degree-in-cp too);
* every rank's flags and versions are compared with rank 0's (same_flags) right before
  Megatron-LM makes its groups (each `initialize_model_parallel`), --save checked to be shared
  (startup_checks.py), and our errors end in-process restarts (faults.py);
* under torchrun, no process outlives the job (process_tree.py);
* --load checked before Megatron-LM reads it (checkpoint_load.py); the tracker written
  atomically, the room checked before each save, a failed save one line
  (checkpoint_save.py); `--metrics-file` gets one JSON line per iteration and per
  evaluation (metrics.py);
* megatron-core wheels ship the dataset helpers prebuilt and no Makefile: Megatron-LM's
  start-up `make` is skipped when the built module imports;
* without CUDA: `cpu_compat.apply(megatron_lm=True)` and CUDA_DEVICE_MAX_CONNECTIONS=1; with
  CUDA, `cpu_compat.apply_torch_adamw_fixes()` where megatron-core uses torch's AdamW
  (Megatron-LM asserts it for TP/CP; meaningless on a CPU).

What it does not do: no flag parsing of its own (Megatron-LM's parser with add_eod_args).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback

import torch

from megatron_eod.data.checks import DatasetError
from megatron_eod.megatron import cpu_compat, gloo_on_cuda
from megatron_eod.training.args import add_eod_args, check_before_megatron, eod_args_from_megatron
from megatron_eod.training.checkpoint_files import CheckpointError
from megatron_eod.training.checkpoint_load import hook_load_checkpoint
from megatron_eod.training.checkpoint_save import hook_save_checkpoint
from megatron_eod.training.cp_flags import FlagError, exit_with_error
from megatron_eod.training.faults import (exit_on_collective_fault,
                                          exit_on_failed_validation,
                                          no_save_stops_a_rerun, our_errors_end_restarts,
                                          say_rerun_exit, timeout_minutes)
from megatron_eod.training.flag_rules import check_global_batch
from megatron_eod.training.metrics import EodFlops, MetricsFile
from megatron_eod.training.process_tree import (exit_with_parent, launched_by_torchrun,
                                                reap_group_at_exit)
from megatron_eod.training.providers import EodProviders
from megatron_eod.training.startup_checks import flags_compared_before_groups

__all__ = ["megatron_lm_assertion", "megatron_lm_available", "run"]

# Megatron-LM's pretrain_gpt.py passes {"tokenizer_type": "GPT2BPETokenizer"}; args.py fills
# it in before its validate_args, from the data where no tokenizer flag is given
# (tokenizer_flags.py).
ARGS_DEFAULTS = {}


def megatron_lm_available() -> bool:
    """Whether `megatron.training` (Megatron-LM's trainer) can be imported."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def run(argv=None, model: str = "gpt"):
    """Train with Megatron-LM's `pretrain()`; raises SystemExit(2) on a flag error. `model`:
    "gpt" (pretrain_gpt.py) or "hybrid" (pretrain_hybrid.py: megatron-core's HybridModel)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]  # Megatron-LM parses sys.argv itself
    if launched_by_torchrun():  # no process of the job outlives it
        exit_with_parent()  # a rank, its agent
        reap_group_at_exit()  # what the rank started (checkpoint writers), the rank
    if not torch.cuda.is_available():
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        cpu_compat.apply(megatron_lm=True)
    else:
        cpu_compat.apply_torch_adamw_fixes()  # only where megatron-core uses torch's AdamW
    training = importlib.import_module("megatron.training.training")
    _use_prebuilt_dataset_helpers()
    _check_after_validate()
    hook_load_checkpoint(training)
    no_save_stops_a_rerun(training)
    hook_save_checkpoint(training)
    providers = EodProviders()
    EodFlops(providers).install(training)
    MetricsFile(providers).install(training)
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
    eod_args = functools.update_wrapper(functools.partial(add_eod_args, model=model),
                                        add_eod_args)
    try:
        with flags_compared_before_groups():
            if "cfg_container" in inspect.signature(training.pretrain).parameters:  # >= 0.18
                arguments = importlib.import_module("megatron.training.arguments")
                args = arguments.parse_and_validate_args(extra_args_provider=eod_args,
                                                         args_defaults=ARGS_DEFAULTS)
                config = importlib.import_module("megatron.training.argument_utils")
                pretrain(config.pretrain_cfg_container_from_args(args), **kwargs)
            elif model == "hybrid":
                raise FlagError("pretrain_hybrid.py needs megatron-core >= 0.18 (its "
                                "HybridModel); this Megatron-LM has none")
            else:
                pretrain(extra_args_provider=eod_args, args_defaults=ARGS_DEFAULTS, **kwargs)
    except (FlagError, DatasetError, CheckpointError) as error:  # raised on every rank
        exit_with_error(error, 2)
    except RuntimeError as error:  # a collective that lost a rank, a failed validation: one
        exit_on_collective_fault(error, timeout_minutes())  # line, else raised
        exit_on_failed_validation(error)
        raise
    except SystemExit as stop:  # the rerun machine's exits say why
        say_rerun_exit(stop.code)
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


