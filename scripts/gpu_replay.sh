#!/usr/bin/env bash
# A trace replay on a lent GPU machine that outlasts one device call (600 s): `start` sets the machine
# up (scripts/gpu_env.sh), copies the tree to /tmp/replay-run (the next call gets a fresh copy of the
# working tree) and starts `lorafn bench replay` there detached (setsid: it outlives the call), then
# returns after SLEEP seconds (sooner if it ended; never later than CALL_S - 30 s after the call began,
# set-up included: a call that ran past the device's 600 s limit was killed, and its machine lost); `wait`, the next call on the still-warm machine (it goes back ~30 s
# after a call), waits for it and copies the report, the plots, the breakdown and the logs to $OUT.
#
#   C=full [PC_YAML='scale_up_wait_fraction: 0.2'] TAG=full RATE=2 DURATION=600 SLEEP=430 bash scripts/gpu_replay.sh start
#   TAG=full bash scripts/gpu_replay.sh wait        (WAIT_S: at most this long, default 540)
#
# C may name several configurations (C=full,no-warm-pool: ~13 min each at 600 s). Each runs as its own
# `lorafn bench replay` into out/$TAG/<config>, one after another on fresh platforms, so a configuration
# that finished is kept when the machine goes back during a later one; `wait` merges what finished
# (`lorafn bench report`). Two fit one machine's 30 minutes with a second `wait` call. The replay is the 64-function H100 command of docs/benchmarks.md ("Ten minutes at 2 rps"):
# code trace from 1760 s (TRACE=conv TRACE_START=1800 for the smooth one), 90 s warm-up, GSM8K questions,
# outputs <= 128 tokens, r16 all-linear, KV 512 MiB.
# Carry .whl, .deb and .data (scripts/device_deps.sh writes them here).
set -uo pipefail
RUN=/tmp/replay-run
TAG="${TAG:-${C:-full}}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
case "${1:-}" in
  start)
    . scripts/gpu_env.sh || exit 1
    rm -rf "$RUN" && mkdir -p "$RUN" && cp -a . "$RUN/" && cd "$RUN" || exit 1
    export PYTHONPATH="${PYTHONPATH/$OLDPWD/$RUN}"
    pc=()
    if [ -n "${PC_YAML:-}" ]; then printf '%s\n' "$PC_YAML" > platform.yaml; pc=(--platform-config platform.yaml); fi
    cat > run.sh <<RUNEOF
for c in ${C//,/ }; do
  python3 -m lorafn.cli bench replay --device cuda --model "$LORAFN_LLAMA2_7B_DIR" --data-dir .data \
    --functions ${FUNCTIONS:-64} --trace ${TRACE:-code} --trace-start ${TRACE_START:-1760} --rate ${RATE:-2} \
    --duration ${DURATION:-600} --warmup-s ${WARMUP_S:-90} --prompt-size question --max-output-tokens 128 \
    --rank 16 --target-modules all-linear --kv-mib ${KV_MIB:-512} --configs \$c ${pc[*]} \
    --settle-timeout 45 --drain-timeout 20 --no-plots --out out/$TAG/\$c >> replay.log 2>&1
  echo "\$c \$?" >> replay.rc
  echo "=== \$c" >> breakdown.txt; python3 bench/replay_breakdown.py out/$TAG/\$c --config \$c >> breakdown.txt 2>&1
done
touch done
RUNEOF
    cat run.sh
    setsid nohup bash run.sh >/dev/null 2>&1 < /dev/null &
    # bash's SECONDS counts from the call's start: the set-up above (wheels, build, the 7B preset) took 60-90 s
    until_s=$(( SECONDS + ${SLEEP:-430} )); cap_s=$(( ${CALL_S:-600} - 30 ))
    [ "$until_s" -gt "$cap_s" ] && { echo "gpu_replay: sleeping until ${cap_s} s into the call, not ${until_s} (CALL_S ${CALL_S:-600})"; until_s=$cap_s; }
    while [ "$SECONDS" -lt "$until_s" ] && [ ! -f done ]; do sleep 5; done
    tail -c 3000 replay.log
    ;;
  wait)
    cd "$RUN" || { echo "no replay under $RUN (a fresh machine?)"; exit 1; }
    export PYTHONPATH="/tmp/site:$RUN"   # the carried wheels gpu_env.sh installed at start
    for _ in $(seq 1 $(( ${WAIT_S:-540} / 5 ))); do [ -f done ] && break; sleep 5; done
    [ -f done ] || echo "replay still running after ${WAIT_S:-540} s"
    echo "replay rc per configuration:"; cat replay.rc 2>/dev/null
    tail -c 6000 replay.log
    cat breakdown.txt 2>/dev/null | head -150
    d="out/$TAG"
    cp replay.log breakdown.txt replay.rc "$OUT/" 2>/dev/null
    # merge the configurations that finished into one report with plots
    files=$(ls "$d"/*/replay.json 2>/dev/null)
    if [ -n "$files" ]; then
      python3 -m lorafn.cli bench report $files --out "$d/merged" > merge.log 2>&1 || tail -20 merge.log
      cp "$d/merged/replay.json" "$OUT/" 2>/dev/null
      mkdir -p "$OUT/img" && cp "$d"/merged/*.png "$OUT/img/" 2>/dev/null
    fi
    tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude='*.bin' -C "$d" $(cd "$d" && ls -d */runs 2>/dev/null) 2>/dev/null
    ls -la "$OUT" "$OUT/img"
    ;;
  *) echo "usage: gpu_replay.sh start|wait" >&2; exit 2 ;;
esac
