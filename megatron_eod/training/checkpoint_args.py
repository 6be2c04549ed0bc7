"""`--use-checkpoint-args`: the model's flags from the args saved with the checkpoint.

One job: before the flags are validated, read the args that Megatron-LM's trainer or the lean
trainer saved with the latest checkpoint of --pretrained-checkpoint, then of --load (whose
values win), in either format, and set the model's shape from them, as Megatron-LM's
`load_args_from_checkpoint` does: the sizes where the launch script leaves them out, the
architecture switches always (the checkpoint's value wins over the script's, and the start-up
line says so), the tokenizer's type and model unless --no-use-tokenizer-model-from-checkpoint-args,
the TP/PP sizes (and the virtual pipeline stages, where the script sets none) with
--use-mp-args-from-checkpoint-args. Beyond Megatron-LM 0.16.1's list it
also takes --qk-layernorm, --apply-layernorm-1p and --norm-epsilon, which the resume check
(checkpoint_load.py) compares: Megatron-LM then fails its load on missing keys. Hidden
dropout is the checkpoint's, as Megatron-LM takes it (so one launch script trains one run
under either trainer; a stock checkpoint at 0.1 under a script saying 0 was 4.8e-3 apart
after 6 iterations). Attention dropout stays the launch script's, as under Megatron-LM's
trainer here: it must be 0 (the varlen kernels apply none) whatever a checkpoint trained with.

What it does not do: no collective (every rank reads the same small file: `common.pt`, or
a `--ckpt-format torch` file memory-mapped), no weights; loading them is checkpoint_load.py's.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_eod.megatron.imports import import_megatron
from megatron_eod.training.checkpointing import (TRACKER, CheckpointError, checkpoint_folder,
                                                 checkpoint_format, read_tracker)
from megatron_eod.training.cp_flags import FlagError

__all__ = ["REQUIRED", "apply_checkpoint_args", "checkpoint_args_notice"]

# Required flags a checkpoint may give.
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
# Taken where the launch script leaves them out (Megatron-LM's _set_arg without force).
_SIZES = (*REQUIRED, "ffn_hidden_size", "seq_length", "kv_channels", "max_position_embeddings")
# Always the checkpoint's (force=True there), plus the three the resume check compares.
_ARCHITECTURE = ("num_query_groups", "group_query_attention", "position_embedding_type",
                 "add_position_embedding", "use_rotary_position_embeddings", "rotary_base",
                 "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias",
                 "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
                 "normalization", "qk_layernorm", "layernorm_zero_centered_gamma",
                 "layernorm_epsilon")
# Always the checkpoint's too (Megatron-LM also forces attention_dropout: see the module).
_DROPOUT = ("hidden_dropout",)
_TOKENIZER = ("tokenizer_type", "tokenizer_model")
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# Taken with the TP/PP sizes where the script gives neither (they are exclusive).
_VIRTUAL = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
# The stages' split, likewise (Megatron-LM takes none of these: its saved split then meets
# the script's, or the default even one).
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _saved_args(root: str) -> Optional[Tuple[str, argparse.Namespace]]:
    """(where, args) of the latest checkpoint under `root`; None where it has none."""
    try:
        iteration = read_tracker(root)
    except CheckpointError as error:  # a damaged tracker: one line
        raise FlagError(f"--use-checkpoint-args: {error}") from None
    if iteration is None:
        return None
    folder = checkpoint_folder(root, iteration)
    try:
        found = checkpoint_format(folder)
        if found is None:
            raise FlagError(f"--use-checkpoint-args: {root}/{TRACKER} names iteration "
                            f"{iteration} but {folder} holds no complete checkpoint")
        if found == "torch_dist":
            dcp = import_megatron("megatron.core.dist_checkpointing")
            where, state = folder, dcp.load_common_state_dict(folder)
        else:
            first = min(name for name in os.listdir(folder) if name.startswith("mp_rank_"))
            where = os.path.join(folder, first, "model_optim_rng.pt")
            state = torch.load(where, map_location="cpu", weights_only=False, mmap=True)
    except FlagError:
        raise
    except Exception as error:  # a damaged file: one line, naming it
        raise FlagError(f"--use-checkpoint-args: cannot read the args saved in {folder}: "
                        f"{type(error).__name__}: {error}") from None
    saved = state.get("args") if isinstance(state, dict) else None
    if not isinstance(saved, argparse.Namespace):
        raise FlagError(f"--use-checkpoint-args: {where} holds no saved args to take the model "
                        f"from; pass the model's flags instead")
    return where, saved


# dest -> the flag that sets it, for the dests a flag turns off (their value shown inverted).
_INVERTED = {"add_bias_linear": "--disable-bias-linear",
             "add_position_embedding": "--no-position-embedding"}
_SPELLED = {"layernorm_zero_centered_gamma": "--apply-layernorm-1p",
            "layernorm_epsilon": "--norm-epsilon"}


def _flag(dest: str) -> str:
    return _INVERTED.get(dest) or _SPELLED.get(dest) or "--" + dest.replace("_", "-")


def _shown(dest: str, value) -> str:
    """`value` of `dest` as its flag says it (--disable-bias-linear=True: no biases)."""
    return f"{_flag(dest)}={(not value) if dest in _INVERTED else value}"


def _saved_value(saved: argparse.Namespace, dest: str):
    if dest == "add_bias_linear" and hasattr(saved, "disable_bias_linear"):
        return not saved.disable_bias_linear  # Megatron-LM's one-off conversion
    if dest == "layernorm_zero_centered_gamma" and getattr(saved, dest, None) is None:
        return getattr(saved, "apply_layernorm_1p", None)  # older Megatron-LM spelling
    return getattr(saved, dest, None)


def apply_checkpoint_args(args: argparse.Namespace, given: Dict[str, object],
                          parser: argparse.ArgumentParser) -> None:
    """Set `args` from the saved args (see the module's doc); `given` holds the dests the
    launch script's flags set. Records what it set that matters in `args.checkpoint_args`
    (dest -> (value, the script's value or None)): every size, and a switch where it is not
    the trainer's default or not what the script said."""
    args.checkpoint_args = {}
    if not args.use_checkpoint_args:
        return
    if args.load is None and args.pretrained_checkpoint is None:
        raise FlagError("--use-checkpoint-args needs --load DIR or --pretrained-checkpoint DIR")
    found: List[Tuple[str, argparse.Namespace]] = [
        read for read in (_saved_args(root) for root in (args.pretrained_checkpoint, args.load)
                          if root) if read is not None]
    args.checkpoint_args_from = [where for where, _ in found]
    choices = {a.dest: tuple(a.choices) for a in parser._actions if a.choices}
    defaults = {a.dest: a.default for a in parser._actions}
    dests = list(_SIZES) + list(_ARCHITECTURE) + list(_DROPOUT)
    if args.use_tokenizer_model_from_checkpoint_args:
        dests += _TOKENIZER
    if args.use_mp_args_from_checkpoint_args:
        dests += _PARALLEL
        if not any(dest in given for dest in _VIRTUAL):
            dests += _VIRTUAL
        if not any(dest in given for dest in _UNEVEN):
            dests += _UNEVEN
    for where, saved in found:  # --load's last: its values win
        for dest in dests:
            if dest == "num_query_groups" and not getattr(saved, "group_query_attention", True):
                args.num_query_groups = None  # multi-head attention, whatever number
                continue  # Megatron-LM left there (or the script gave)
            value = _saved_value(saved, dest)
            if value is None or (dest in _SIZES and dest in given):
                continue
            if dest in choices and value not in choices[dest]:
                raise FlagError(f"--use-checkpoint-args: {where} was saved with {_flag(dest)} "
                                f"{value}, which this trainer does not take (choose from "
                                f"{', '.join(map(str, choices[dest]))})")
            if dest == "tokenizer_model" and os.path.isabs(value) and \
                    not os.path.exists(value):  # saved on another machine
                if dest in given:
                    continue  # the flags' own, kept
                raise FlagError(f"--use-checkpoint-args: {where} was saved with "
                                f"--tokenizer-model {value}, which is not on this machine; "
                                f"pass --tokenizer-model PATH (kept over the checkpoint's "
                                f"then), or --no-use-tokenizer-model-from-checkpoint-args")
            setattr(args, dest, value)
            if dest in _SIZES or value != defaults.get(dest) or (
                    dest in given and given[dest] != value):
                args.checkpoint_args[dest] = (value, given.get(dest))
            else:
                args.checkpoint_args.pop(dest, None)
    for dest in REQUIRED:
        if getattr(args, dest) is None:
            looked = " or ".join(f"--{name.replace('_', '-')} {root}" for name, root in (
                ("pretrained_checkpoint", args.pretrained_checkpoint), ("load", args.load))
                if root)
            raise FlagError(f"{_flag(dest)} is required: --use-checkpoint-args found no "
                            f"checkpoint under {looked} to take it from")


def checkpoint_args_notice(args) -> Optional[str]:
    """The line rank 0 prints: what --use-checkpoint-args took, and the flags it overrode."""
    taken = getattr(args, "checkpoint_args", None)
    if not getattr(args, "use_checkpoint_args", False):
        return None
    if not taken:
        return "megatron-eod: --use-checkpoint-args: no checkpoint yet; the flags given are used"
    words = []
    for dest, (value, script) in taken.items():
        over = script is not None and script != value
        said = _shown(dest, script).split("=", 1)[1]
        words.append(_shown(dest, value) + (f" (not {said}, as the flags said)" if over else ""))
    return (f"megatron-eod: --use-checkpoint-args: from {', '.join(args.checkpoint_args_from)}: "
            + ", ".join(words) + "; the other model flags at their defaults")
