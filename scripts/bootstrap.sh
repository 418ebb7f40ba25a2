#!/usr/bin/env bash
# Installs everything lorafn needs on a fresh Debian/Ubuntu machine (or a venv): redis-server, the
# Python package with its dev extras (CPU PyTorch), and a real helm binary. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*"; }

if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing PyTorch (CPU build)"
  # Machines of this workplace carry a CPU wheel in /opt/wheels (PIP_FIND_LINKS); elsewhere use the
  # CPU index so that pip does not pull several GB of CUDA libraries.
  if ls /opt/wheels/torch-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --find-links /opt/wheels "torch==$(ls /opt/wheels/torch-*.whl | head -1 | sed -E 's/.*torch-([0-9.]+).*/\1/')"
  else
    "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi

log "installing lorafn with its dev extras"
"$PY" -m pip install -q -e '.[dev]'

if [ -x scripts/install_helm.sh ] || [ -f scripts/install_helm.sh ]; then
  bash scripts/install_helm.sh
fi
log "ready"
