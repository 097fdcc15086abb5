#!/usr/bin/env bash
# The per-format speed table of docs/benchmarks.md: `kvserve bench` against
# llama.cpp's `llama-bench` (prefill of 128 tokens, decode of 64, one
# sequence) and `llama-batched-bench` (32 sequences) on the same GGUF files,
# same threads, one model at a time, kvserve and llama.cpp back to back; and
# batch-1 decode as a fraction of the machine's read bandwidth, from
# `kvserve bench --bandwidth`: bytes read per decode step (the weights the
# forward streams -- a tied output head is read once per token as the head,
# its embedding lookup is one row -- plus the K/V the step attends to) times
# steps per second, over the read bandwidth kernels::ReadProbe measures on
# the same threads right after each run (median of the runs' ratios). A
# fixed figure cannot judge a run: on the 2-vCPU development VM (a shared
# host) a 2-thread huge-page read gives ~60 GB/s in some minutes and ~35 in
# others (kernels/cpu/read_probe.h).
#
# Nothing of llama.cpp or of the models is part of this repository: point
# LLAMA_BIN at a llama.cpp build (llama-bench, llama-batched-bench) and
# MODELS at a directory holding the files named in FILES (requantize SmolLM2
# with `llama-quantize --allow-requantize IN OUT TYPE`; Gemma 3 270M Q4_K_M
# comes from `deploy/setup.sh --models all`).
#
#   LLAMA_BIN=/path/llama.cpp/build/bin MODELS=/path/models \
#     bench/formats_vs_llamacpp.sh > table.md
#
# Environment: KVSERVE (default build/server/kvserve), THREADS (2), REPS
# (kvserve --repeat and llama-bench -r, default 3), FILES (space-separated
# file names), BATCH (32). Prints Markdown on stdout, raw tool output on stderr.
set -euo pipefail

KVSERVE=${KVSERVE:-build/server/kvserve}
LLAMA_BIN=${LLAMA_BIN:?set LLAMA_BIN to a llama.cpp build/bin directory}
MODELS=${MODELS:?set MODELS to the directory holding the GGUF files}
THREADS=${THREADS:-2}
REPS=${REPS:-3}
BATCH=${BATCH:-32}
FILES=${FILES:-"gemma-3-270m-Q4_K_M.gguf smollm2-Q4_K_M.gguf smollm2-Q6_K.gguf smollm2-Q8_0.gguf smollm2-Q4_0.gguf"}
PP=128
TG=64

# kvserve bench's Markdown row for a batch size: prints "prefill decode MB
# read/step, read GB/s, decode/read %" (the last three from --bandwidth).
kv_row() {  # file batch
  "$KVSERVE" --log-level warn -t "$THREADS" -m "$1" bench -b "$2" --prompt-tokens $PP \
    --gen-tokens $TG --repeat "$REPS" --bandwidth | tee -a /dev/stderr |
    awk -F'|' -v b="$2" '$2 + 0 == b && $3 + 0 == '$PP' {gsub(/[ %]/, ""); print $5, $6, $9, $11, $12}'
}

# llama-bench's t/s for one test name (pp128 / tg64).
llama_ts() {  # file test
  local flag
  if [[ $2 == pp* ]]; then flag="-p $PP -n 0"; else flag="-p 0 -n $TG"; fi
  # shellcheck disable=SC2086
  "$LLAMA_BIN/llama-bench" -m "$1" -t "$THREADS" $flag -r "$REPS" -o md | tee -a /dev/stderr |
    awk -F'|' -v t="$2" '$0 ~ t {split($(NF-1), a, "±"); gsub(/ /, "", a[1]); print a[1]}'
}

# llama-batched-bench's decode rate (S_TG t/s) at BATCH sequences.
llama_batched() {  # file
  "$LLAMA_BIN/llama-batched-bench" -m "$1" -t "$THREADS" -c $(((PP + TG) * BATCH + 64)) \
    -b 2048 -ub 512 -npp $PP -ntg $TG -npl "$BATCH" 2>&1 | tee -a /dev/stderr |
    awk -F'|' 'NF > 9 && $2 + 0 == '$PP' {gsub(/ /, "", $9); print $9}'
}

echo "| file | kvserve pp$PP | llama.cpp pp$PP | ratio | kvserve tg$TG | llama.cpp tg$TG | ratio | kvserve b=$BATCH decode | llama-batched-bench b=$BATCH | ratio | MB read/token | read GB/s after the run | kvserve tg / read bandwidth |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for f in $FILES; do
  path="$MODELS/$f"
  if [[ ! -f $path ]]; then
    echo "missing $path" >&2
    continue
  fi
  read -r kv_pp kv_tg mb read_gbps share < <(kv_row "$path" 1)
  read -r _ kv_b _ _ _ < <(kv_row "$path" "$BATCH")
  ll_pp=$(llama_ts "$path" "pp$PP")
  ll_tg=$(llama_ts "$path" "tg$TG")
  ll_b=$(llama_batched "$path")
  python3 - "$f" "$kv_pp" "$ll_pp" "$kv_tg" "$ll_tg" "$kv_b" "$ll_b" "$mb" "$read_gbps" "$share" <<'PY'
import sys
f, kp, lp, kt, lt, kb, lb, mb, bw, share = sys.argv[1:]
num = lambda v: float(v) if v else float("nan")
kp, lp, kt, lt, kb, lb, mb, bw, share = map(num, (kp, lp, kt, lt, kb, lb, mb, bw, share))
print(f"| {f} | {kp:.0f} | {lp:.0f} | {kp/lp:.2f}x | {kt:.0f} | {lt:.0f} | {kt/lt:.2f}x | "
      f"{kb:.0f} | {lb:.0f} | {kb/lb:.2f}x | {mb:.1f} | {bw:.1f} | {share:.0f}% |")
PY
done
