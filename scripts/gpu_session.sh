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
    rope) # EngineConfig.rope_in_attention (off: timed slower from batch 8 on, twenty-ninth session): kernel A/B,
      # its GPU tests and the RoPE kernels against torch's roundings; then STEPS=rope-engine: TPOT beside the default
      python3 bench/decode_attention.py --rope --batches 1,8,16,64 --contexts 512,2048 --json "$OUT/rope_attn.json" \
        2>&1 | tee "$OUT/rope_attn.log" | tail -20
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py -k "rope_in or rope_kernels_round or restored_decode_graphs" \
        tests/gpu/test_graph_restore_gpu.py 2>&1 | tee "$OUT/rope_tests.log" | tail -20 ;;
    rope-engine) # (its own call: with the 7B engines above it passes one call's 600 s)
      python3 bench/engine.py --model "$LORAFN_LLAMA2_7B_DIR" --skip-hf --batches 1,8,64 --expand-modes '' \
        --skinny-rows '' --rope-in-attention --repeats 2 --json "$OUT/engine_rope.json" 2>&1 \
        | tee "$OUT/engine_rope.log" | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
