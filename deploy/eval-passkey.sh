#!/usr/bin/env bash
# Passkey retrieval under each KV policy (token eviction): a 5-digit number
# hidden at a depth of a long filler text, then asked for at the end; greedy,
# 8 tokens. Prints one line per (depth, policy): found or not, and the answer.
#   bash deploy/eval-passkey.sh [FILLER_REPEATS] [DEPTHS...]
#   bash deploy/eval-passkey.sh 120 0.1 0.5 0.9     # ~3,000 SmolLM2 tokens
# Policies: none (every token), window 1024, sinks 4 + 1020, h2o (budget
# 1024: 4 sinks, 512 recent, the rest heavy hitters). Needs a build
# (deploy/build.sh) and the default model (deploy/setup.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K="${KVSERVE_BIN:-$ROOT/build/server/kvserve}"
REPEATS="${1:-120}"
shift $(( $# > 0 ? 1 : 0 )) || true
DEPTHS=("$@")
[ ${#DEPTHS[@]} -gt 0 ] || DEPTHS=(0.1 0.5 0.9)
KEY="${PASSKEY:-68413}"
FILLER="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE="The pass key is $KEY. Remember it. $KEY is the pass key. "
QUESTION="What is the pass key? The pass key is"
POLICIES=("none:--kv-policy none"
          "window:--kv-policy window --kv-window 1024"
          "sinks:--kv-policy sinks --kv-sinks 4 --kv-window 1020"
          "h2o:--kv-policy h2o --kv-sinks 4 --kv-window 512 --kv-budget 1024")
for depth in "${DEPTHS[@]}"; do
  at=$(awk -v r="$REPEATS" -v d="$depth" 'BEGIN { printf "%d", r * d }')
  prompt=""
  for ((i = 0; i < REPEATS; ++i)); do
    [ "$i" = "$at" ] && prompt+="$NEEDLE"
    prompt+="$FILLER"
  done
  prompt+="$QUESTION"
  for p in "${POLICIES[@]}"; do
    name="${p%%:*}"
    # shellcheck disable=SC2086
    out=$("$K" --log-level warn generate -p "$prompt" -n 8 --temperature 0 ${p#*:} --json)
    text=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["text"].strip())' <<<"$out")
    found=no
    [[ "$text" == *"$KEY"* ]] && found=yes
    echo "depth $depth policy $name: found $found ($text)"
  done
done
