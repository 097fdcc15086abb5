#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, start the kvserve daemon on
# the default model (SmolLM2-135M-Instruct), ask it a question through
# kvserve-cli, and stop the daemon.
#   bash deploy/quickstart.sh ["your question"]
# To keep the daemon running instead:  build/server/kvserve serve
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/deploy/setup.sh"
# Only what this script runs: the daemon and the client (not the ~270 test
# and benchmark targets deploy/build.sh builds). Configured as build.sh
# configures, so a later build.sh or test.sh reuses these objects.
cmake -S "$ROOT" -B "$ROOT/build" -G Ninja >/dev/null
cmake --build "$ROOT/build" --target kvserve kvserve-cli
QUESTION="${1:-What is the capital of France? Answer in one sentence.}"
MODEL="${KVSERVE_MODEL_DIR:-$ROOT/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
RUN="$(mktemp -d)"
"$ROOT/build/server/kvserve" --log-level warn --model "$MODEL" serve \
  --grpc-address 127.0.0.1:0 --http-port 0 --port-file "$RUN/ports.json" &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null; rm -rf "$RUN"' EXIT
for _ in $(seq 1 300); do
  [ -s "$RUN/ports.json" ] && break
  kill -0 $DAEMON 2>/dev/null || { echo "quickstart: the daemon exited" >&2; exit 1; }
  sleep 0.1
done
GRPC_PORT="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["grpc"])' "$RUN/ports.json")"
HTTP_PORT="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$RUN/ports.json")"
echo "kvserve is listening: gRPC 127.0.0.1:$GRPC_PORT, HTTP 127.0.0.1:$HTTP_PORT"
"$ROOT/build/client/kvserve-cli" --address "127.0.0.1:$GRPC_PORT" chat -p "$QUESTION" --max-tokens 96 --temperature 0
