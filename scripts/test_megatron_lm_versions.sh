#!/usr/bin/env bash
# Usage: bash scripts/test_megatron_lm_versions.sh [VERSION ...] [-- PYTEST ARGS...]
# Runs the tests that face Megatron-LM's trainer against other Megatron-LM releases than CI's
# (requirements/cpu.txt: megatron-core 0.19.2), each in a venv of its own, .venv-mcore-VERSION
# (scripts/setup_cpu_env.sh with MEGATRON_CORE=VERSION):
#   0.17.x, 0.18.x  Python 3.12; the wheel carries megatron.training
#   0.16.1          Python 3.11, torch 2.13.0's CPU build; the wheel has no trainer: Megatron-LM
#                   core_v0.16.1 from $MEGATRON_LM_PATH (default: ../shared/megatron-lm)
# VERSION defaults to "0.18.2 0.17.1 0.16.1". Without pytest args: the trainer-facing tests
# (tests/training, tests/functional except the GPU ones, the steps, plan-ahead, CPU-compat,
# dataset and tokenizer tests); after `--`, your own (e.g. `-- tests` for the whole suite).
# Not in CI: three more venvs (several GB each on Python 3.12). Everything runs on CPU ranks,
# in PYTEST_WORKERS pytest-xdist workers as scripts/test_cpu.sh (default 2; 0: one process).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSIONS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VERSIONS+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.18.2 0.17.1 0.16.1)
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/training tests/functional/test_cpu_training.py tests/functional/test_data_training.py
                                  tests/functional/test_checkpoints.py
                                  tests/functional/test_checkpoint_faults.py
                                  tests/functional/test_moe_training.py
                                  tests/functional/test_mtp_training.py tests/megatron/test_mtp.py
                                  tests/functional/test_mla_training.py tests/megatron/test_mla.py
                                  tests/megatron/test_mtp_stock_equivalence.py
                                  tests/functional/test_hybrid_training.py
                                  tests/megatron/test_stock_equivalence.py tests/megatron/test_steps.py
                                  tests/megatron/test_plan_ahead.py tests/megatron/test_cpu_compat.py
                                  tests/megatron/test_dataset.py tests/data/test_checks.py
                                  tests/data/test_tokenizers.py tests/data/test_core_tokenizers.py)
cd "$ROOT"
WORKERS=()
[ "${PYTEST_WORKERS:-2}" = 0 ] || WORKERS=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
failed=()
for VERSION in "${VERSIONS[@]}"; do
  VENV="$ROOT/.venv-mcore-$VERSION"
  MEGATRON_EOD_VENV="$VENV" MEGATRON_CORE="$VERSION" bash "$ROOT/scripts/setup_cpu_env.sh"
  if [[ "$VERSION" == 0.16.* ]]; then
    TRAINER="${MEGATRON_LM_PATH:-$ROOT/../shared/megatron-lm}"
    [ -d "$TRAINER/megatron/training" ] || {
      echo "[versions] megatron-core $VERSION: no Megatron-LM core_v0.16 checkout at $TRAINER" \
           "(set MEGATRON_LM_PATH)" >&2; exit 2; }
  else
    TRAINER="$("$VENV/bin/python" -c 'import os, megatron.training as t
print(os.path.dirname(os.path.dirname(os.path.dirname(t.__file__))))' 2>/dev/null)"
  fi
  echo "[versions] megatron-core $VERSION ($("$VENV/bin/python" --version)), Megatron-LM's" \
       "trainer from $TRAINER"
  MEGATRON_LM_PATH="$TRAINER" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    "${WORKERS[@]}" "${TESTS[@]}" || failed+=("$VERSION")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[versions] failed: ${failed[*]}" >&2
  exit 1
fi
echo "[versions] passed: ${VERSIONS[*]}"
