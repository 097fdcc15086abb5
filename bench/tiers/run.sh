#!/bin/bash
# Issue 16's tier benchmarks, one run per configuration, alternated:
#   bench/tiers/run.sh shared-prefix|multi-turn|capacity|restart|no-reuse [model.gguf]
# `capacity`: the shared-prefix workload on the 48 MiB pool + host tier, on a
# 56 MiB pool + host tier (room for two requests' 156 blocks at once) and on
# the 1 GiB pool, alternated twice: what the 48 MiB pool's admission wait costs.
# The daemon runs on core 1 with one thread, kvserve-bench on core 0.
# `restart` drops the page cache (needs root) for its cold-disk point.
# Output: one TTFT / cached line pair per run, under $OUT (default /tmp/kvserve-tiers).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODE="${1:?shared-prefix|multi-turn|capacity|restart|no-reuse}"
M="${2:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
KVSERVE="${KVSERVE:-$ROOT/build/server/kvserve}"
BENCH="${BENCH:-$ROOT/build/client/kvserve-bench}"
OUT="${OUT:-/tmp/kvserve-tiers}"
mkdir -p "$OUT"
PORT=$((52000 + RANDOM % 1000))
SP=""
serve() {  # name, serve flags...
  local name=$1; shift
  PORT=$((PORT + 1))
  taskset -c 1 "$KVSERVE" --log-level info -t 1 -m "$M" serve --grpc-address 127.0.0.1:$PORT \
    --http-port 0 "$@" >"$OUT/$name.serve.log" 2>&1 &
  SP=$!
  for _ in $(seq 200); do
    sleep 0.3
    (echo >/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return 0
  done
  echo "daemon $name did not start" >&2; exit 1
}
stop() { kill -INT "$SP"; wait "$SP" || true; }
bench() {  # name, kvserve-bench flags...
  local name=$1; shift
  taskset -c 0 "$BENCH" --grpc 127.0.0.1:$PORT "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name"; grep -E 'TTFT |cached prompt' "$OUT/$name.txt"
}
case "$MODE" in
  shared-prefix|multi-turn)
    if [ "$MODE" = shared-prefix ]; then
      W=(--workload shared-prefix --num-prefixes 6 --prefix-len 1200 --questions-per-prefix 5
         --input-len 20 --output-len 16 --concurrency 2 --seed 5)
    else
      W=(--workload multi-turn --num-prompts 8 --turns 5 --input-len 200 --output-len 24
         --concurrency 4 --seed 5)
    fi
    for round in 1 2; do
      serve "$MODE-host-$round" --kv-cache-memory 48MiB --kv-host-memory 1GiB
      bench "$MODE-host-$round" "${W[@]}"; stop
      serve "$MODE-big-$round" --kv-cache-memory 1GiB
      bench "$MODE-big-$round" "${W[@]}"; stop
    done
    serve "$MODE-small" --kv-cache-memory 48MiB
    bench "$MODE-small" "${W[@]}"; stop
    ;;
  capacity)
    W=(--workload shared-prefix --num-prefixes 6 --prefix-len 1200 --questions-per-prefix 5
       --input-len 20 --output-len 16 --concurrency 2 --seed 5)
    for round in 1 2; do
      serve "capacity-host48-$round" --kv-cache-memory 48MiB --kv-host-memory 1GiB
      bench "capacity-host48-$round" "${W[@]}"; stop
      serve "capacity-host56-$round" --kv-cache-memory 56MiB --kv-host-memory 1GiB
      bench "capacity-host56-$round" "${W[@]}"; stop
      serve "capacity-big-$round" --kv-cache-memory 1GiB
      bench "capacity-big-$round" "${W[@]}"; stop
    done
    ;;
  restart)
    D="$OUT/disk"
    rm -rf "$D"
    python3 -c 'import json,sys; w=open("/usr/share/common-licenses/GPL-3").read().split(); print(json.dumps({"prompt": " ".join(w[:1400])}))' >"$OUT/prompt.jsonl"
    F=(--workload file --file "$OUT/prompt.jsonl" --output-len 4 --concurrency 1)
    serve fill --kv-cache-memory 48MiB --kv-disk-dir "$D" --kv-disk-bytes 4GiB
    bench fill "${F[@]}" --requests 3; stop
    serve warm --kv-cache-memory 48MiB --kv-disk-dir "$D" --kv-disk-bytes 4GiB
    bench warm "${F[@]}" --requests 1; stop
    sync; echo 3 >/proc/sys/vm/drop_caches
    serve dropped --kv-cache-memory 48MiB --kv-disk-dir "$D" --kv-disk-bytes 4GiB
    bench dropped "${F[@]}" --requests 1; stop
    serve cold --kv-cache-memory 48MiB
    bench cold "${F[@]}" --requests 1; stop
    ;;
  no-reuse)
    # Every prompt new: the tiers only cost (write-back of every evicted
    # block); the goal is no throughput loss. Two rounds, alternated.
    W=(--workload synthetic --num-prompts 48 --input-len 512 --output-len 64 --concurrency 8
       --seed 5)
    for round in 1 2; do
      serve "no-reuse-off-$round" --kv-cache-memory 48MiB
      bench "no-reuse-off-$round" "${W[@]}"; grep -E 'tokens/s' "$OUT/no-reuse-off-$round.txt"; stop
      serve "no-reuse-host-$round" --kv-cache-memory 48MiB --kv-host-memory 1GiB
      bench "no-reuse-host-$round" "${W[@]}"; grep -E 'tokens/s' "$OUT/no-reuse-host-$round.txt"; stop
    done
    ;;
  *) echo "unknown mode $MODE" >&2; exit 2 ;;
esac
