#!/usr/bin/env bash
# Token eviction quality sweep: teacher-forced perplexity, mean KL and top-1
# agreement against full KV for each KV policy at several budgets, on a long
# text (default: Debian's GPL-3, ~7k SmolLM2 tokens).
#   bash deploy/eval-kv-policies.sh [TEXT] [MAX_TOKENS] [BUDGETS...]
#   bash deploy/eval-kv-policies.sh /usr/share/common-licenses/GPL-3 6144 256 512 1024
# Needs a build (deploy/build.sh) and the default model (deploy/setup.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K="${KVSERVE_BIN:-$ROOT/build/server/kvserve}"
TEXT="${1:-/usr/share/common-licenses/GPL-3}"
MAX="${2:-6144}"
shift $(( $# > 2 ? 2 : $# )) || true
BUDGETS=("$@")
[ ${#BUDGETS[@]} -gt 0 ] || BUDGETS=(256 512 1024)
for b in "${BUDGETS[@]}"; do
  half=$(( b / 2 ))
  "$K" --log-level warn kv-eval -f "$TEXT" --max-tokens "$MAX" --kv-policy window --kv-window "$b"
  "$K" --log-level warn kv-eval -f "$TEXT" --max-tokens "$MAX" --kv-policy sinks --kv-sinks 4 \
    --kv-window $(( b - 4 ))
  # H2O as in the paper: half heavy hitters, half recent (4 of them sinks).
  "$K" --log-level warn kv-eval -f "$TEXT" --max-tokens "$MAX" --kv-policy h2o --kv-sinks 4 \
    --kv-window "$half" --kv-budget "$b"
done
