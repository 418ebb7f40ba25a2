# Sourced on a lent GPU machine (no network) by gpu_session.sh and gpu_replay.sh: installs the carried
# wheels (.whl/, from scripts/device_deps.sh), unpacks redis-server from the carried Debian packages
# (.deb/) outside /, builds the native IPC extension in place and writes the llama-2-7b random preset
# once (LORAFN_LLAMA2_7B_DIR). Leaves OUT, PYTHONPATH, PATH and LD_LIBRARY_PATH set.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
if ls .deb/*.deb >/dev/null 2>&1 && ! command -v redis-server >/dev/null 2>&1; then
  mkdir -p /tmp/redisroot && for f in .deb/*.deb; do dpkg -x "$f" /tmp/redisroot; done
  export PATH="/tmp/redisroot/usr/bin:$PATH" LD_LIBRARY_PATH="/tmp/redisroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; return 1; }
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
export LORAFN_LLAMA2_7B_DIR="${LORAFN_LLAMA2_7B_DIR:-/tmp/llama-2-7b}"
if [ ! -f "$LORAFN_LLAMA2_7B_DIR/config.json" ]; then
  /usr/bin/time -f "wrote 7B preset in %e s" python3 -m lorafn.cli model random --preset llama-2-7b --dtype bfloat16 \
    --seed 0 --out "$LORAFN_LLAMA2_7B_DIR" 2>&1 | tr '\r' '\n' | grep -v '%|' | tail -12 | tee -a "$OUT/gpu.txt"
  [ -f "$LORAFN_LLAMA2_7B_DIR/config.json" ] || { echo "gpu_env: writing the 7B preset failed"; return 1; }
fi
