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
# and benchmark targets deploy/build.sh builds), through ccache as
# deploy/test.sh builds.
CONFIG=()
if command -v ccache >/dev/null 2>&1; then
  CONFIG+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
fi
# The CUDA kernels (nvcc, two GPU architectures: the slowest files of the
# build) only where a GPU can run them, and then for that GPU alone. Without
# one the daemon runs on the CPU and --device cuda answers that CUDA is not
# built; deploy/test.sh turns them back on wherever nvcc is installed.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "GPU "; then
  CONFIG+=(-DCMAKE_CUDA_ARCHITECTURES=native)
else
  CONFIG+=(-DKVSERVE_WITH_CUDA=OFF)
fi
T0="$(date +%s)"
cmake -S "$ROOT" -B "$ROOT/build" -G Ninja "${CONFIG[@]}" >/dev/null
cmake --build "$ROOT/build" --target kvserve kvserve-cli
echo "quickstart: built kvserve and kvserve-cli in $(($(date +%s) - T0)) s"
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
