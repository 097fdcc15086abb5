#!/bin/sh
# Speculation on vs off, one daemon, per-request modes (docs/speculation.md).
# Usage: bench/speculation/run.sh [MODEL] [MODE]   (MODE: ngram or suffix; default ngram)
# Prints kvserve-bench's tables and B/A ratios (B = MODE, A = off) for each
# workload at concurrency 1, 4 and 16.
# Environment: KVSERVE, KVSERVE_BENCH (binaries), SPEC_WORKLOADS (default
# "code-edit summarize json chat"), SPEC_CONCURRENCY (default "1 4 16"),
# SPEC_REQUESTS_X (requests per load point times this, default 1: longer
# runs for figures that must stand out of noise), SPEC_DAEMON_FLAGS (extra
# serve flags), SPEC_LOG (the daemon's stderr to this file), SPEC_ABBA=1 (each load point also with the order reversed,
# MODE then off: the mode measured second runs on a warmer daemon, and the
# geometric mean of the two orders' ratios cancels that; table.py does it).
# SPEC_FRESH=1 instead measures MODE on prompts the daemon has not seen: a
# fresh daemon per workload, MODE first, each prompt of the file once at
# concurrency 1, then off; so `suffix` drafts only from the other prompts'
# answers (in the default runs both modes send the same prompts, and the
# suffix index holds the very answers it drafts).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mode=${2:-ngram}
kvserve=${KVSERVE:-$root/build/server/kvserve}
bench=${KVSERVE_BENCH:-$root/build/client/kvserve-bench}
tmp=$(mktemp -d)
pid=
start_daemon() {
  rm -f "$tmp/ports"
  "$kvserve" --log-level warn -m "$model" serve --grpc-address 127.0.0.1:0 --http-port 0 \
    --port-file "$tmp/ports" --speculative off --no-prefix-cache ${SPEC_DAEMON_FLAGS:-} 2>>"${SPEC_LOG:-$tmp/log}" &
  pid=$!
  for i in $(seq 1 600); do [ -s "$tmp/ports" ] && break; sleep 0.1; done
  port=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[\"http\"])" "$tmp/ports")
}
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
if [ "${SPEC_FRESH:-0}" = 1 ]; then
  for w in ${SPEC_WORKLOADS:-code-edit summarize json chat}; do
    start_daemon
    n=$(grep -c . "$here/$w.jsonl")
    echo "### fresh workload=$w concurrency=1 requests=$n"
    "$bench" --url "http://127.0.0.1:$port" --api chat --workload file --file "$here/$w.jsonl" \
      --concurrency 1 --requests "$n" --temperature 0 --no-ignore-eos -q \
      --speculative "$mode,off"
    kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=
  done
  exit 0
fi
start_daemon
for w in ${SPEC_WORKLOADS:-code-edit summarize json chat}; do
  for c in ${SPEC_CONCURRENCY:-1 4 16}; do
    n=$((c < 4 ? 4 : c))
    [ "$c" = 4 ] && n=8
    n=$((n * ${SPEC_REQUESTS_X:-1}))
    echo "### workload=$w concurrency=$c requests=$n"
    "$bench" --url "http://127.0.0.1:$port" --api chat --workload file --file "$here/$w.jsonl" \
      --concurrency "$c" --requests "$n" --temperature 0 --no-ignore-eos -q \
      --speculative "off,$mode" --warmup 1
    if [ "${SPEC_ABBA:-0}" = 1 ]; then
      echo "### reversed workload=$w concurrency=$c requests=$n"
      "$bench" --url "http://127.0.0.1:$port" --api chat --workload file --file "$here/$w.jsonl" \
        --concurrency "$c" --requests "$n" --temperature 0 --no-ignore-eos -q \
        --speculative "$mode,off" --warmup 1
    fi
  done
done
