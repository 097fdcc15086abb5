#!/usr/bin/env bash
# Router + 1 prefill + 1 decode node on one machine (docs/disaggregation.md).
#   deploy/pd-local.sh [MODEL]          # Ctrl-C stops all three
# Env: KVSERVE (binary, default build/server/kvserve), PD_TLS (UCX_TLS for KV
# transfers, e.g. tcp; default UCX's choice), PD_MODE (auto|always|never),
# ROUTER_PORT (gRPC, default 50051), PIN=1 to pin prefill and decode to one
# core each with taskset.
set -euo pipefail
cd "$(dirname "$0")/.."
KVSERVE=${KVSERVE:-build/server/kvserve}
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUTER_PORT=${ROUTER_PORT:-50051}
PD_MODE=${PD_MODE:-auto}
DIR=$(mktemp -d /tmp/kvserve-pd.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT INT TERM

pin() { if [[ "${PIN:-0}" == 1 ]]; then echo "taskset -c $1"; fi; }
start_node() {  # role core
  $(pin "$2") "$KVSERVE" -t 1 -m "$MODEL" serve --role "$1" --grpc-address 127.0.0.1:0 \
    --http-port 0 --port-file "$DIR/$1.json" ${PD_TLS:+--pd-ucx-tls "$PD_TLS"} \
    >"$DIR/$1.log" 2>&1 &
  pids+=($!)
}
wait_file() {
  for _ in $(seq 1 600); do [[ -s "$1" ]] && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2; exit 1
}
grpc_port() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["grpc"])' "$1"; }

start_node prefill 0
start_node decode 1
wait_file "$DIR/prefill.json"; wait_file "$DIR/decode.json"
P=$(grpc_port "$DIR/prefill.json"); D=$(grpc_port "$DIR/decode.json")
"$KVSERVE" route --grpc-address "127.0.0.1:$ROUTER_PORT" --http-port 0 \
  --port-file "$DIR/router.json" --nodes "127.0.0.1:$P,127.0.0.1:$D" --pd-mode "$PD_MODE" \
  >"$DIR/router.log" 2>&1 &
pids+=($!)
wait_file "$DIR/router.json"
echo "prefill 127.0.0.1:$P, decode 127.0.0.1:$D, router 127.0.0.1:$ROUTER_PORT (logs in $DIR)"
echo "try: build/client/kvserve-cli --address 127.0.0.1:$ROUTER_PORT generate 'Once upon a time'"
wait -n "${pids[@]}"
