#!/usr/bin/env python3
"""Pretrain a GPT with EoD reset under context parallelism (Ring, Ulysses or Hybrid).

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --train-iters 10 \
        --lr 1e-3 --data-path runs/quickstart/stdlib_text_document \
        --reset-attention-mask --reset-position-ids --eod-mask-loss \
        --context-parallel-size 4 --context-parallel-algo ring

Two trainers, one EoD wiring. `--trainer auto` (the default) runs Megatron-LM's own
`pretrain()` with our providers whenever `megatron.training` is importable (a Megatron-LM
checkout on PYTHONPATH, or megatron-core >= 0.17): Megatron-LM's flags plus
`--context-parallel-algo`, `--ulysses-degree-in-cp`, `--metrics-file`, so a Megatron-LM
launch script keeps working. Elsewhere it runs our lean trainer (megatron_eod/training/args.py
lists its flags). `--trainer megatron-lm|lean` chooses explicitly.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    chooser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    chooser.add_argument("--trainer", choices=("auto", "megatron-lm", "lean"), default="auto")
    chosen, _ = chooser.parse_known_args(argv)
    from megatron_eod.training.cp_flags import exit_with_error
    from megatron_eod.training.megatron_lm_run import megatron_lm_available, run

    trainer = chosen.trainer
    if trainer == "auto":
        trainer = "megatron-lm" if megatron_lm_available() else "lean"
    if trainer == "megatron-lm":
        if not megatron_lm_available():
            exit_with_error("--trainer megatron-lm needs Megatron-LM's megatron.training: put "
                            "a Megatron-LM checkout on PYTHONPATH (e.g. ../shared/megatron-lm) "
                            "or install megatron-core >= 0.17 (Python >= 3.12)", 2)
        return run(argv)
    from megatron_eod.training.pretrain import pretrain

    return pretrain(argv)


if __name__ == "__main__":
    main()
