#!/bin/sh
# llama.cpp's draftless speculation (llama-server --spec-type ngram-*) on the
# workloads of run.sh, through the same client (kvserve-bench, chat API), so
# its on/off ratios stand beside kvserve's (docs/speculation.md).
# Usage: LLAMA_SERVER=/path/to/llama-server bench/speculation/vs-llamacpp.sh [MODEL] [SPEC_TYPE]
#   SPEC_TYPE: a llama.cpp --spec-type, default ngram-simple.
# Each load point runs four servers in turn, off / SPEC_TYPE / SPEC_TYPE / off
# (the second of a pair on a freshly started server as well, so the order is
# balanced), each pinned to core LLAMA_CORE (default 1) with one thread,
# the client on core 0. llama.cpp is not built by this script: point
# LLAMA_SERVER at a build of your own.
# Environment: SPEC_WORKLOADS (default "code-edit summarize chat"),
# SPEC_CONCURRENCY (default "1 4"), SPEC_REQUESTS_X (default 2),
# LLAMA_FLAGS (extra llama-server flags), KVSERVE_BENCH.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
spec=${2:-ngram-simple}
server=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}
bench=${KVSERVE_BENCH:-$root/build/client/kvserve-bench}
core=${LLAMA_CORE:-1}
port=${LLAMA_PORT:-18437}
tmp=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

# Four slots (the largest concurrency here), 2048 tokens each; no host
# prompt cache (kvserve's side runs with --no-prefix-cache).
start() {
  taskset -c "$core" "$server" -m "$model" -t 1 -tb 1 -np 4 -c 8192 --cache-ram 0 \
    --host 127.0.0.1 --port "$port" --no-webui ${LLAMA_FLAGS:-} "$@" >"$tmp/log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "vs-llamacpp.sh: llama-server did not come up" >&2
  cat "$tmp/log" >&2
  exit 1
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }

for w in ${SPEC_WORKLOADS:-code-edit summarize chat}; do
  for c in ${SPEC_CONCURRENCY:-1 4}; do
    n=$((c < 4 ? 4 : 8))
    n=$((n * ${SPEC_REQUESTS_X:-2}))
    for mode in off "$spec" "$spec" off; do
      if [ "$mode" = off ]; then start; else start --spec-type "$mode"; fi
      echo "### llama.cpp workload=$w concurrency=$c requests=$n mode=$mode"
      taskset -c 0 "$bench" --url "http://127.0.0.1:$port" --api chat --workload file \
        --file "$here/$w.jsonl" --concurrency "$c" --requests "$n" --temperature 0 \
        --no-ignore-eos -q --warmup 1 2>/dev/null | grep -E "output tokens/s|prompt / output"
      sed -nE 's/.*draft acceptance = [0-9.]+ \( *([0-9]+) accepted \/ *([0-9]+) generated\).*/\1 \2/p' \
        "$tmp/log" | awk '{a += $1; g += $2} END {if (g) printf "draft tokens accepted / generated  %d / %d\n", a, g}'
      stop
    done
  done
done
