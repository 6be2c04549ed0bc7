"""Megatron-LM's flags through its REAL parser and our `add_eod_args` (`megatron_lm_args`),
then our `eod_args_from_megatron` (`checked`): what the flag tests share."""

import sys

from tests.training.megatron_lm_checkout import import_megatron_lm

__all__ = ["BASE", "checked", "megatron_lm_args"]

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "2", "--data-path", "corpus",
        "--transformer-impl", "local", "--attention-dropout", "0", "--eval-interval", "100",
        "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion"]


def megatron_lm_args(*flags, base=BASE, world=4):
    import_megatron_lm()
    from megatron.training.arguments import parse_args

    from megatron_eod.training.args import add_eod_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *base, *flags]
    try:
        args = parse_args(add_eod_args)
    finally:
        sys.argv = saved
    args.world_size = world
    return args


def checked(*flags, **kwargs):
    from megatron_eod.training.args import eod_args_from_megatron

    args = megatron_lm_args(*flags, **kwargs)
    eod_args_from_megatron(args)
    return args
