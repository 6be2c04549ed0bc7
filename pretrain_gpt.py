#!/usr/bin/env python3
"""Pretrain a GPT with EoD reset under context parallelism (Ring, Ulysses or Hybrid).

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --train-iters 10 \
        --lr 1e-3 --data-path runs/quickstart/stdlib_text_document \
        --reset-attention-mask --reset-position-ids --eod-mask-loss \
        --context-parallel-size 4 --context-parallel-algo ring

Megatron-LM's flag spellings (see megatron_eod/megatron/args.py); NCCL on GPUs, gloo on CPUs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_eod.training.pretrain import pretrain  # noqa: E402

if __name__ == "__main__":
    pretrain()
