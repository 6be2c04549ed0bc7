#!/usr/bin/env bash
# Usage: bash scripts/test_megatron_lm_versions.sh [VERSION] [PYTEST ARGS...]
# Runs the tests that face Megatron-LM's own trainer against the megatron-core wheel that GPU
# users install (VERSION, default 0.19.2: from 0.17 the wheels carry megatron.training and
# need Python >= 3.12), in a venv of its own, .venv-mcore-VERSION (scripts/setup_cpu_env.sh
# with MEGATRON_CORE=VERSION). With no pytest args: the Megatron-LM trainer, flag,
# checkpoint, data-check, step, tokenizer and CPU-compat tests; pass `tests` for the whole
# suite.
# Not in CI (CI runs megatron-core 0.16.1 with ../shared/megatron-lm on Python 3.11): on
# Python 3.12 pip resolves torch==2.13.0 to its CUDA build, several GB. Everything still runs
# on CPU ranks with gloo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-0.19.2}"
[ $# -gt 0 ] && shift
VENV="$ROOT/.venv-mcore-$VERSION"
MEGATRON_EOD_VENV="$VENV" MEGATRON_CORE="$VERSION" bash "$ROOT/scripts/setup_cpu_env.sh"

# The wheel's megatron/training is Megatron-LM's trainer: the tests find it there.
MEGATRON_LM_PATH="$("$VENV/bin/python" -c 'import os, megatron.training as t
print(os.path.dirname(os.path.dirname(os.path.dirname(t.__file__))))' 2>/dev/null)"
export MEGATRON_LM_PATH
echo "[test] megatron-core $VERSION, Megatron-LM's trainer from $MEGATRON_LM_PATH"

cd "$ROOT"
if [ $# -eq 0 ]; then
  set -- tests/training/test_megatron_lm.py tests/training/test_megatron_lm_args.py \
    tests/training/test_megatron_lm_pretrain.py tests/training/test_megatron_lm_validate.py \
    tests/training/test_trainer_choice.py tests/training/test_megatron_lm_flags_in_lean.py \
    tests/training/test_checkpoint_interop.py tests/training/test_data_checks_at_startup.py \
    tests/training/test_args_optim.py tests/training/test_optimizer.py \
    tests/training/test_checkpoint_preflight.py tests/training/test_same_flags.py \
    tests/megatron/test_cpu_compat.py tests/megatron/test_steps.py \
    tests/megatron/test_stock_equivalence.py tests/data/test_checks.py \
    tests/data/test_tokenizers.py tests/data/test_preprocess.py
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
