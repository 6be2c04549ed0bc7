#!/usr/bin/env python3
"""Pretrain a GPT with EoD reset under context parallelism (Ring, Ulysses or Hybrid), through
Megatron-LM's own `pretrain()`.

    torchrun --nproc-per-node 4 pretrain_gpt.py <Megatron-LM's GPT flags> \
        --reset-attention-mask --reset-position-ids --eod-mask-loss \
        --context-parallel-size 4 --cp-comm-type p2p     # or a2a, or a2a+p2p (hybrid)

Megatron-LM's flags mean what they mean in its own pretrain_gpt.py; ours are added to its
parser (`--context-parallel-algo`, `--ulysses-degree-in-cp`, `--metrics-file`, ...:
megatron_eod/training/args.py). Megatron-LM's trainer comes from megatron-core >= 0.17
(Python 3.12) or, for 0.16, a Megatron-LM checkout on PYTHONPATH.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    from megatron_eod.training.cp_flags import exit_with_error
    from megatron_eod.training.run import megatron_lm_available, run

    if not megatron_lm_available():
        exit_with_error("pretrain_gpt.py needs Megatron-LM's trainer (megatron.training): "
                        "install megatron-core >= 0.17 on Python 3.12 (bash "
                        "scripts/setup_cpu_env.sh does), or put a Megatron-LM checkout on "
                        "PYTHONPATH", 2)
    return run(argv)


if __name__ == "__main__":
    main()
