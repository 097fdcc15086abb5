#!/usr/bin/env bash
# The per-format speed table of docs/benchmarks.md: `kvserve bench` against
# llama.cpp's `llama-bench` (prefill of 128 tokens, decode of 64, one
# sequence) and `llama-batched-bench` (32 sequences) on the same GGUF files,
# same threads, one model at a time, kvserve and llama.cpp back to back; and
# batch-1 decode as a fraction of the machine's read-bandwidth limit (bytes
# read per token: the file's tensor bytes -- a tied output head is read once
# per token as the head, its embedding lookup is one row -- plus the KV of
# the context, divided by BANDWIDTH_GBPS).
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
# (kvserve --repeat and llama-bench -r, default 3), BANDWIDTH_GBPS (28.8,
# this machine's measured read bandwidth), FILES (space-separated file
# names), BATCH (32). Prints Markdown on stdout, raw tool output on stderr.
set -euo pipefail

KVSERVE=${KVSERVE:-build/server/kvserve}
LLAMA_BIN=${LLAMA_BIN:?set LLAMA_BIN to a llama.cpp build/bin directory}
MODELS=${MODELS:?set MODELS to the directory holding the GGUF files}
THREADS=${THREADS:-2}
REPS=${REPS:-3}
BATCH=${BATCH:-32}
BANDWIDTH_GBPS=${BANDWIDTH_GBPS:-28.8}
FILES=${FILES:-"gemma-3-270m-Q4_K_M.gguf smollm2-Q4_K_M.gguf smollm2-Q6_K.gguf smollm2-Q8_0.gguf smollm2-Q4_0.gguf"}
PP=128
TG=64

# kvserve bench's Markdown row for a batch size: prints "prefill decode".
kv_row() {  # file batch
  "$KVSERVE" --log-level warn -t "$THREADS" -m "$1" bench -b "$2" --prompt-tokens $PP \
    --gen-tokens $TG --repeat "$REPS" | tee -a /dev/stderr |
    awk -F'|' -v b="$2" '$2 + 0 == b && $3 + 0 == '$PP' {gsub(/ /, ""); print $5, $6}'
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

# Bytes of one token's decode: the tensor data (file size minus the
# header, close enough: the header is < 1% here) plus the mean KV read over
# the TG steps after a PP-token prompt (f16 K and V).
bytes_per_token() {  # file
  python3 - "$1" $PP $TG <<'PY'
import os, struct, sys
path, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def kv(path):
    # Minimal GGUF metadata walk: block_count, head_count_kv, key/value length.
    f = open(path, "rb"); f.read(4); ver, = struct.unpack("<I", f.read(4))
    n_t, n_kv = struct.unpack("<QQ", f.read(16))
    def s(): n, = struct.unpack("<Q", f.read(8)); return f.read(n).decode("utf-8", "replace")
    size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    def val(t):
        if t == 8: return s()
        if t == 9:
            et, n = struct.unpack("<IQ", f.read(12))
            return [val(et) for _ in range(n)]
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[t]
        return struct.unpack("<" + fmt, f.read(size[t]))[0]
    md = {}
    for _ in range(n_kv):
        k = s(); t, = struct.unpack("<I", f.read(4)); md[k] = val(t)
    arch = md["general.architecture"]
    g = lambda k, d=None: md.get(f"{arch}.{k}", d)
    heads = g("attention.head_count"); kvh = g("attention.head_count_kv", heads)
    if isinstance(kvh, list): kvh = max(kvh)
    dim = g("embedding_length"); kl = g("attention.key_length", dim // heads)
    vl = g("attention.value_length", kl)
    return g("block_count") * kvh * (kl + vl) * 2  # f16 bytes per position
per_pos = kv(path)
mean_ctx = pp + (tg - 1) / 2
print(os.path.getsize(path) + per_pos * mean_ctx)
PY
}

echo "| file | kvserve pp$PP | llama.cpp pp$PP | ratio | kvserve tg$TG | llama.cpp tg$TG | ratio | kvserve b=$BATCH decode | llama-batched-bench b=$BATCH | ratio | MB/token | tg limit at ${BANDWIDTH_GBPS} GB/s | kvserve tg / limit |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for f in $FILES; do
  path="$MODELS/$f"
  if [[ ! -f $path ]]; then
    echo "missing $path" >&2
    continue
  fi
  read -r kv_pp kv_tg < <(kv_row "$path" 1)
  read -r _ kv_b < <(kv_row "$path" "$BATCH")
  ll_pp=$(llama_ts "$path" "pp$PP")
  ll_tg=$(llama_ts "$path" "tg$TG")
  ll_b=$(llama_batched "$path")
  bytes=$(bytes_per_token "$path")
  python3 - "$f" "$kv_pp" "$ll_pp" "$kv_tg" "$ll_tg" "$kv_b" "$ll_b" "$bytes" "$BANDWIDTH_GBPS" <<'PY'
import sys
f, kp, lp, kt, lt, kb, lb, by, bw = sys.argv[1:]
num = lambda v: float(v) if v else float("nan")
kp, lp, kt, lt, kb, lb, by, bw = map(num, (kp, lp, kt, lt, kb, lb, by, bw))
limit = bw * 1e9 / by
print(f"| {f} | {kp:.0f} | {lp:.0f} | {kp/lp:.2f}x | {kt:.0f} | {lt:.0f} | {kt/lt:.2f}x | "
      f"{kb:.0f} | {lb:.0f} | {kb/lb:.2f}x | {by/1e6:.1f} | {limit:.0f} | {kt/limit:.0%} |")
PY
done
