#!/usr/bin/env bash
# The README's test command: set the machine up, then lint, check the layering, run the tests
# (GPU tests skip themselves where CUDA is absent; cluster tests without a kubeconfig).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.tools/bin:$PATH"
PY="${PYTHON:-python3}"
echo "[test] ruff"; "$PY" -m ruff check . && "$PY" -m ruff format --check lorafn tests bench examples scripts
echo "[test] import-linter"; lint-imports
echo "[test] pytest"; "$PY" -m pytest "$@"
