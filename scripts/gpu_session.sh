#!/usr/bin/env bash
# Runs on a lent GPU machine (no network): sets it up (scripts/gpu_env.sh: carried wheels, redis-server,
# the native IPC extension, the llama-2-7b random preset), then runs what STEPS names.
# Usage: STEPS="tests engine sharing" bash scripts/gpu_session.sh   (results under $OUT)
set -uo pipefail
. scripts/gpu_env.sh || exit 1
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
