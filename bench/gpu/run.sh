#!/usr/bin/env bash
# Serving benchmarks on a lent GPU, from a pack (deploy/gpu-pack.sh): the
# daemon with `--device cuda` on SmolLM2's shape (bench/gpu/same_shape_model.py;
# real shape, values dropped, so timings hold and texts do not), driven by
# kvserve-bench over gRPC on 127.0.0.1. One run per configuration:
#   tiers   issue 16's workloads: shared-prefix and multi-turn with a 48 MiB
#           device pool alone, + a 1 GiB host tier, + a disk tier alone, and a
#           1 GiB device pool; a warm restart from the disk tier vs cold; a
#           workload with no reuse, tiers on vs off
#   pd      router + prefill + decode node (device pools, KV through UCX's
#           host staging) vs one `both` node (stall-free steps on and off),
#           same workload
#   roofline  issue 45's baseline, one run under 10 minutes: `kvserve probe`,
#           kvserve_cuda_bench's paged decode attention per KV codec at 1k-32k
#           positions (GB/s vs the probe's copy traffic, tokens/s), `kvserve
#           bench` decode at batch 1/16/64, and three daemon runs (batch-1
#           TPOT, a mixed workload at concurrency 64, the no-reuse prefill
#           workload); bench/gpu/roofline_table.py writes $OUT/roofline.md,
#           the table for docs/gpu.md
#   bash bench/gpu/run.sh --pack gpu-pack [tiers] [pd] [roofline]   (default: tiers pd)
# --pack also takes a build tree (the pack has its layout), e.g. an emulator
# build for a dry run: SMALL=1 shrinks every size so that it finishes there.
# Env: DEVICE (default cuda; cpu tries the script here), MODEL (default the
# pack's SmolLM2 shape), DEADLINE_S (stop starting runs after this many seconds, default 300),
# OUT (results; default $PACK/gpu-bench).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PACK=""
WHAT=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) PACK="$(cd "${2:?--pack needs a directory}" && pwd)"; shift ;;
    tiers|pd|roofline) WHAT+=("$1") ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$PACK" ] || { echo "run.sh: --pack DIR is required" >&2; exit 2; }
[ ${#WHAT[@]} -gt 0 ] || WHAT=(tiers pd)
OUT="${OUT:-$PACK/gpu-bench}"
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${DEADLINE_S:-300}))
KVSERVE="$PACK/server/kvserve"
BENCH="$PACK/client/kvserve-bench"
CUDA_LIBS=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); print(" ".join(os.path.join(p, "nvidia", x, "lib") for x in ("cublas", "cuda_runtime")))' 2>/dev/null); do
  if [ -e "$d/libcublas.so.13" ] || [ -e "$d/libcudart.so.13" ]; then CUDA_LIBS="$CUDA_LIBS:$d"; fi
done
export LD_LIBRARY_PATH="$PACK/lib$CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -d "$PACK/lib/ucx" ] && export UCX_MODULE_DIR="$PACK/lib/ucx"
M="${MODEL:-/tmp/smollm2-shape.gguf}"
[ -f "$M" ] || python3 "$ROOT/bench/gpu/same_shape_model.py" --unpack "$PACK/smollm2-shape.gguf.xz" "$M" ||
  { echo "run.sh: no model"; exit 1; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait 2>/dev/null; pids=(); }
trap cleanup EXIT
late() { [ $SECONDS -lt $DEADLINE ] && return 1; echo "(deadline: $1 not run)"; return 0; }
wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && return 0; sleep 0.1; done; echo "timed out: $1"; return 1; }
port_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
# node NAME [serve flags...]: sets PORT
node() {
  local name=$1; shift
  rm -f "$OUT/$name.json"
  "$KVSERVE" --log-level info -m "$M" serve --device "${DEVICE:-cuda}" --grpc-address 127.0.0.1:0 --http-port 0 \
    --port-file "$OUT/$name.json" "$@" >"$OUT/$name.serve.log" 2>&1 &
  pids+=($!)
  wait_file "$OUT/$name.json" || { tail -5 "$OUT/$name.serve.log"; return 1; }
  PORT=$(port_of "$OUT/$name.json" grpc)
}
# bench NAME [kvserve-bench flags...] against $PORT
bench() {
  local name=$1; shift
  timeout 90 "$BENCH" --grpc "127.0.0.1:$PORT" -q --json-out "$OUT/$name.result.json" "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name (rc $?)"; grep -E 'TTFT |TPOT |cached prompt|output tok/s|tier' "$OUT/$name.txt" | head -8
}
metrics() { curl -s "http://127.0.0.1:$(port_of "$OUT/$1.json" http)/metrics" 2>/dev/null |
  grep -E '^kvserve:kv_tier_(demotions|promotions|hit_tokens|checksum|load_predicted|recompute_chosen)|^kvserve:kv_tier_load_latency_seconds_(sum|count)' | head -16; }

SP=(--workload shared-prefix --num-prefixes 6 --prefix-len 1200 --questions-per-prefix 5
    --input-len 20 --output-len 16 --concurrency 2 --seed 5)
MT=(--workload multi-turn --num-prompts 8 --turns 5 --input-len 200 --output-len 24
    --concurrency 4 --seed 5)
NR=(--workload synthetic --num-prompts 64 --input-len 512 --output-len 64 --concurrency 8 --seed 5)

tiers() {
  echo "### tiers on the GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
  local W name
  for W in SP MT; do
    local w
    if [ $W = SP ]; then w=("${SP[@]}"); else w=("${MT[@]}"); fi
    for cfg in small host disk big; do
      late "$W-$cfg" && return 0
      name="$W-$cfg"
      case $cfg in
        small) node "$name" --kv-cache-memory 48MiB || continue ;;
        host) node "$name" --kv-cache-memory 48MiB --kv-host-memory 1GiB || continue ;;
        disk) rm -rf /tmp/kvdisk-$W; node "$name" --kv-cache-memory 48MiB --kv-disk-dir /tmp/kvdisk-$W \
                --kv-disk-bytes 4GiB --kv-disk-min-hits 0 || continue ;;
        big) node "$name" --kv-cache-memory 1GiB || continue ;;
      esac
      bench "$name" "${w[@]}"
      [ "$cfg" = host ] || [ "$cfg" = disk ] && metrics "$name"
      cleanup
    done
  done
  # Warm restart: a 1,694-token prompt's blocks on disk, a new daemon.
  late restart && return 0
  python3 -c 'import json; w=open("/usr/share/common-licenses/GPL-3").read().split() if __import__("os").path.exists("/usr/share/common-licenses/GPL-3") else ["word%d" % (i % 97) for i in range(1400)]; print(json.dumps({"prompt": " ".join(w[:1400])}))' >"$OUT/prompt.jsonl"
  local F=(--workload file --file "$OUT/prompt.jsonl" --output-len 4 --concurrency 1)
  rm -rf /tmp/kvdisk-r
  node fill --kv-cache-memory 48MiB --kv-disk-dir /tmp/kvdisk-r --kv-disk-bytes 4GiB && bench fill "${F[@]}" --requests 3; cleanup
  node warm --kv-cache-memory 48MiB --kv-disk-dir /tmp/kvdisk-r --kv-disk-bytes 4GiB && bench warm "${F[@]}" --requests 1; cleanup
  node cold --kv-cache-memory 48MiB && bench cold "${F[@]}" --requests 1; cleanup
  for cfg in off on; do
    late "noreuse-$cfg" && return 0
    if [ $cfg = on ]; then node "NR-$cfg" --kv-cache-memory 48MiB --kv-host-memory 1GiB || continue
    else node "NR-$cfg" --kv-cache-memory 48MiB || continue; fi
    bench "NR-$cfg" "${NR[@]}"; cleanup
  done
}

pd() {
  echo "### prefill/decode on the GPU: router + P + D vs one both node"
  late pd && return 0
  local W=(--workload synthetic --num-prompts 48 --input-len 1024 --output-len 32 --concurrency 4 --seed 7)
  node both --kv-cache-memory 1GiB && bench pd-both "${W[@]}"; cleanup
  # The same node with whole-budget steps: tells stall-free chunking apart
  # from the split's second engine thread as the reason the split wins.
  node both-nostall --kv-cache-memory 1GiB --max-stall-factor 0 &&
    bench pd-both-nostall "${W[@]}"; cleanup
  late pd-split && return 0
  node prefill --role prefill --kv-cache-memory 1GiB || return 0
  local P=$PORT
  node decode --role decode --kv-cache-memory 1GiB || return 0
  local D=$PORT
  rm -f "$OUT/router.json"
  "$KVSERVE" route --grpc-address 127.0.0.1:0 --http-port 0 --port-file "$OUT/router.json" \
    --nodes "127.0.0.1:$P,127.0.0.1:$D" --pd-mode always >"$OUT/router.log" 2>&1 &
  pids+=($!)
  wait_file "$OUT/router.json" || return 0
  sleep 1.5
  PORT=$(port_of "$OUT/router.json" grpc)
  bench pd-split "${W[@]}"
  curl -s "http://127.0.0.1:$(port_of "$OUT/decode.json" http)/metrics" | grep -E '^kvserve:[a-z_]*(pd|lease|pull)' | head -12
  cleanup
}

roofline() {
  echo "### roofline baseline on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi')"
  local R="$OUT/roofline" small="${SMALL:-0}"
  mkdir -p "$R"
  local t0=$SECONDS
  local pflags=()
  [ "$small" = 1 ] && pflags=(--mib 4 --iters 2)
  timeout 60 "$KVSERVE" probe "${pflags[@]}" >"$R/probe.txt" 2>&1
  echo "== probe (rc $?)"; cat "$R/probe.txt"
  # Decode attention: 16 sequences x 8 KV heads of 128, every codec, 1k..32k.
  local filter='BM_PagedDecodeAttention/' min_time=0.2s limit=240
  # The emulator takes ~15 s a launch at 1k positions: f16 only there.
  [ "$small" = 1 ] && filter='BM_PagedDecodeAttention/ctx:1024/dtype:1/' && min_time=0.001s && limit=600
  timeout "$limit" "$PACK/bench/kvserve_cuda_bench" --benchmark_filter="$filter" \
    --benchmark_min_time="$min_time" --benchmark_counters_tabular=true \
    --benchmark_out="$R/decode_attention.json" --benchmark_out_format=json >"$R/decode_attention.txt" 2>&1
  echo "== decode attention (rc $?, $((SECONDS - t0)) s)"; tail -4 "$R/decode_attention.txt"
  # The engine alone: decode ms/step at batch 1, 16, 64 (SmolLM2's shape).
  local b=1,16,64 pt=128 gt=64
  [ "$small" = 1 ] && b=1,2 && pt=8 && gt=4
  timeout 150 "$KVSERVE" -m "$M" bench --device "${DEVICE:-cuda}" -b "$b" --prompt-tokens "$pt" \
    --gen-tokens "$gt" --repeat 2 >"$R/engine_bench.txt" 2>&1
  echo "== kvserve bench (rc $?, $((SECONDS - t0)) s)"; grep -E '^\|' "$R/engine_bench.txt"
  # The daemon: batch-1 TPOT, a mixed workload at concurrency 64, and the
  # no-reuse prefill workload of docs/gpu.md (64 x 512 tokens, concurrency 8).
  local C1=(--workload synthetic --num-prompts 8 --input-len 128 --output-len 128 --concurrency 1 --seed 5)
  local MIX=(--workload synthetic --num-prompts 256 --input-len uniform:32:1024
             --output-len uniform:16:256 --concurrency 64 --seed 5)
  local NRW=("${NR[@]}")
  if [ "$small" = 1 ]; then
    C1=(--workload synthetic --num-prompts 2 --input-len 8 --output-len 4 --concurrency 1 --seed 5)
    MIX=(--workload synthetic --num-prompts 4 --input-len uniform:4:24 --output-len uniform:2:6
         --concurrency 4 --seed 5)
    NRW=(--workload synthetic --num-prompts 2 --input-len 16 --output-len 2 --concurrency 2 --seed 5)
  fi
  if node roofline-daemon --kv-cache-memory "${KV_MEM:-4GiB}"; then
    local saved_out="$OUT"; OUT="$R"
    bench c1 "${C1[@]}"
    bench mixed "${MIX[@]}"
    bench noreuse "${NRW[@]}"
    OUT="$saved_out"
  fi
  cleanup
  echo "(roofline: $((SECONDS - t0)) s)"
  python3 "$ROOT/bench/gpu/roofline_table.py" "$R" >"$R/roofline.md" && cat "$R/roofline.md"
}

for w in "${WHAT[@]}"; do "$w"; done
echo "results: $OUT"
