#!/usr/bin/env bash
# Runs on a lent GPU machine (no network): installs carried wheels (.whl/), builds the native IPC
# extension in place, writes the llama-2-7b random preset once, then runs what STEPS names.
# Usage: STEPS="tests engine sharing" bash scripts/gpu_session.sh   (results under $OUT)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
# redis-server for the platform runs (`lorafn up`): Debian packages carried in .deb/ (apt-get download
# redis-server redis-tools libjemalloc2 liblzf1), unpacked outside / (no network there).
if ls .deb/*.deb >/dev/null 2>&1 && ! command -v redis-server >/dev/null 2>&1; then
  mkdir -p /tmp/redisroot && for f in .deb/*.deb; do dpkg -x "$f" /tmp/redisroot; done
  export PATH="/tmp/redisroot/usr/bin:$PATH" LD_LIBRARY_PATH="/tmp/redisroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
export LORAFN_LLAMA2_7B_DIR=/tmp/llama-2-7b
if [ ! -f "$LORAFN_LLAMA2_7B_DIR/config.json" ]; then
  /usr/bin/time -f "wrote 7B preset in %e s" python3 -m lorafn.cli model random --preset llama-2-7b --dtype bfloat16 \
    --seed 0 --out "$LORAFN_LLAMA2_7B_DIR" 2>&1 | tail -2 | tee -a "$OUT/gpu.txt"
fi
for step in ${STEPS:-tests}; do
  case "$step" in
    tests) python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    tests-all) python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
    engine) python3 bench/engine.py --model "$LORAFN_LLAMA2_7B_DIR" --json "$OUT/engine.json" ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" | tail -40 ;;
    sharing) python3 bench/sharing.py --model "$LORAFN_LLAMA2_7B_DIR" --json "$OUT/sharing.json" ${SHARING_ARGS:-} 2>&1 | tee "$OUT/sharing.log" | tail -40 ;;
    coldstart) python3 bench/coldstart.py --model "$LORAFN_LLAMA2_7B_DIR" --device cuda --workdir /tmp/cs \
      --json "$OUT/coldstart.json" ${COLDSTART_ARGS:-} 2>&1 | tee "$OUT/coldstart.log" | tail -30
      cp /tmp/cs/up.log "$OUT/coldstart_up.log" 2>/dev/null ;;
    graphs) python3 bench/graph_restore.py --preset tiny --device cuda --workdir /tmp/gr_tiny \
      --out "$OUT/graph_restore_tiny.json" ${GRAPHS_ARGS:-} 2>&1 | tee "$OUT/graph_restore_tiny.log" | tail -40 ;;
    graphs7b) python3 bench/graph_restore.py --model "$LORAFN_LLAMA2_7B_DIR" --device cuda --workdir /tmp/gr_7b \
      --out "$OUT/graph_restore_7b.json" ${GRAPHS_ARGS:-} 2>&1 | tee "$OUT/graph_restore_7b.log" | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
