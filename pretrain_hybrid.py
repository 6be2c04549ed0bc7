#!/usr/bin/env python3
"""Pretrain a hybrid model (megatron-core's HybridModel, upstream's successor to GPTModel) with
EoD reset under context parallelism, through Megatron-LM's own `pretrain()`.

    torchrun --nproc-per-node 4 pretrain_hybrid.py <Megatron-LM's flags> \
        --hybrid-layer-pattern '*-*-*-*-' \
        --reset-attention-mask --reset-position-ids --eod-mask-loss \
        --context-parallel-size 4 --cp-comm-type p2p     # or a2a, or a2a+p2p (hybrid CP)

The same flags as pretrain_gpt.py, plus --hybrid-layer-pattern: '*' attention (EoD attention),
'-' dense MLP, 'E' MoE, '|' pipeline boundaries; a GPT block is '*-' or '*E'. Mamba-2 ('M'),
Gated DeltaNet ('G'), DeepSeek sparse attention ('D'), MLA ('+') and MTP ('/') are refused
with the reason. A GPT torch_dist checkpoint of pretrain_gpt.py continues here through
megatron-core's load-time translation (megatron-core >= 0.19). Needs megatron-core >= 0.18.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    from megatron_eod.training.cp_flags import exit_with_error
    from megatron_eod.training.run import megatron_lm_available, run

    if not megatron_lm_available():
        exit_with_error("pretrain_hybrid.py needs Megatron-LM's trainer (megatron.training): "
                        "install megatron-core >= 0.18 on Python 3.12 (bash "
                        "scripts/setup_cpu_env.sh does)", 2)
    return run(argv, model="hybrid")


if __name__ == "__main__":
    main()
