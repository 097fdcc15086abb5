#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, and answer a question with
# the default model (SmolLM2-135M-Instruct) through the engine.
#   bash deploy/quickstart.sh ["your question"]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/deploy/setup.sh"
bash "$ROOT/deploy/build.sh"
QUESTION="${1:-What is the capital of France? Answer in one sentence.}"
"$ROOT/build/server/kvserve" --model "${KVSERVE_MODEL_DIR:-$ROOT/models}/SmolLM2-135M-Instruct.Q4_1.gguf" \
  generate --chat --prompt "$QUESTION" --max-tokens 96
