#!/usr/bin/env bash
# Runs HERE (a machine with network), before a GPU session on a lent machine that has none:
# downloads the wheels lorafn needs that the device image lacks (.whl/), redis-server's Debian
# packages (.deb/), and copies the replay data (.data/ from ../shared/data). All three folders are
# git-ignored and travel with the device call's `carry`. Versions follow this machine's install.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection
      typing-extensions redis fastapi starlette uvicorn openai httpx2 httpcore2 truststore jiter sniffio
      anyio annotated-doc opentelemetry-api h11 typer
      pytest-asyncio)
pins=()
for p in "${PKGS[@]}"; do
  v=$(python3 -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "device_deps: $p is not installed here (run scripts/bootstrap.sh first)" >&2; exit 1; }
  pins+=("$p==$v")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
rm -rf .deb && mkdir -p .deb
(cd .deb && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 >/dev/null)
rm -rf .data && mkdir -p .data
cp ../shared/data/azure_llm_2023_code.csv ../shared/data/azure_llm_2023_conv.csv ../shared/data/gsm8k_test.jsonl .data/
du -sh .whl .deb .data
