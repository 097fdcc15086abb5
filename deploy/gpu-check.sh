#!/usr/bin/env bash
# One-shot GPU check (issue 7): on a fresh NVIDIA machine with CUDA 13 and
# this repository, builds the CUDA kernels, runs their unit tests against the
# CPU reference (a skipped test is a failure here), runs them once more under
# compute-sanitizer when it is installed, measures the device's copy
# bandwidth and the paged decode attention bandwidth, and prints a summary.
# Fails loudly when no GPU is visible. Budget: < 10 minutes on 16 cores.
#
#   bash deploy/gpu-check.sh               # everything
#   bash deploy/gpu-check.sh --no-setup    # skip deploy/setup.sh (packages present)
#   bash deploy/gpu-check.sh --quick       # skip compute-sanitizer, shorter benchmark
#
# Output: build dir $KVSERVE_BUILD_DIR (default build-gpu); logs and the
# benchmark's JSON under $KVSERVE_GPU_CHECK_OUT (default <build>/gpu-check).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${KVSERVE_BUILD_DIR:-$ROOT/build-gpu}"
OUT="${KVSERVE_GPU_CHECK_OUT:-$BUILD/gpu-check}"
SETUP=1
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --no-setup) SETUP=0 ;;
    --quick) QUICK=1 ;;
    *) echo "gpu-check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
die() { echo "gpu-check: FAILED: $*" >&2; exit 1; }
step() { echo; echo "=== gpu-check: $* ($(date +%T))"; }
START=$SECONDS

step "device"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi -L | grep -q "GPU " || die "nvidia-smi lists no GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || die "nvcc not found (install CUDA 13 or set CUDACXX)"
"$NVCC" --version | tail -1
# Compile for this GPU only (80 and 90 are what CI builds; one is enough here).
CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
[ -n "$CAP" ] || CAP="80;90"

if [ "$SETUP" = 1 ]; then
  step "setup (packages only)"
  bash "$ROOT/deploy/setup.sh" --no-model
fi

step "configure + build (CUDA arch $CAP)"
mkdir -p "$OUT"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DKVSERVE_WITH_CUDA=ON -DKVSERVE_BUILD_BENCH=ON \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CAP" >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; die "cmake configure"; }
grep -q "KVSERVE_WITH_CUDA=ON" "$OUT/configure.log" || die "CUDA was not enabled (see $OUT/configure.log)"
cmake --build "$BUILD" --target cuda_kernels_test kvserve_cuda_bench -j "$(nproc)" \
  >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; die "build"; }

step "unit tests (GPU kernels vs CPU reference)"
TEST_RC=0
timeout 300 "$BUILD/tests/cuda_kernels_test" --gtest_brief=1 >"$OUT/tests.log" 2>&1 || TEST_RC=$?
tail -25 "$OUT/tests.log"
SKIPPED="$(grep -c '^\[  SKIPPED \]' "$OUT/tests.log" || true)"
PASSED_LINE="$(grep '^\[  PASSED  \]' "$OUT/tests.log" || true)"
FAILED_LINES="$(grep '^\[  FAILED  \]' "$OUT/tests.log" || true)"

SAN_RC=skipped
if [ "$QUICK" = 0 ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer memcheck (leaks + out-of-bounds, one config per kernel)"
  SAN_RC=0
  timeout 240 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
    "$BUILD/tests/cuda_kernels_test" --gtest_brief=1 \
    --gtest_filter='CudaTest.Pool*:CudaTest.RmsNorm*:CudaTest.Argmax*:*f16_b16_d128_g4*:*f32_b8_d64_g1*' \
    >"$OUT/sanitizer.log" 2>&1 || SAN_RC=$?
  tail -5 "$OUT/sanitizer.log"
fi

step "bandwidth probe + paged decode attention benchmark"
MIN_TIME=0.3
[ "$QUICK" = 1 ] && MIN_TIME=0.1
BENCH_RC=0
timeout 240 "$BUILD/bench/kvserve_cuda_bench" --benchmark_counters_tabular=true \
  --benchmark_min_time="$MIN_TIME" --benchmark_out="$OUT/cuda_bench.json" \
  --benchmark_out_format=json >"$OUT/bench.log" 2>&1 || BENCH_RC=$?
cat "$OUT/bench.log"

step "summary ($((SECONDS - START)) s)"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo "unit tests: rc=$TEST_RC ${PASSED_LINE:-no PASSED line}; skipped=$SKIPPED"
[ -n "$FAILED_LINES" ] && echo "$FAILED_LINES"
echo "compute-sanitizer: $SAN_RC"
grep -E "device->device|host->device|device->host" "$OUT/bench.log" || true
grep -E "^BM_PagedDecodeAttention|ctx:" "$OUT/bench.log" | head -20 || true
echo "logs: $OUT"

[ "$TEST_RC" = 0 ] || die "unit tests (rc=$TEST_RC, see $OUT/tests.log)"
[ "$SKIPPED" = 0 ] || die "$SKIPPED GPU tests skipped although a GPU is visible (see $OUT/tests.log)"
[ "$SAN_RC" = 0 ] || [ "$SAN_RC" = skipped ] || die "compute-sanitizer (rc=$SAN_RC, see $OUT/sanitizer.log)"
[ "$BENCH_RC" = 0 ] || die "benchmark (rc=$BENCH_RC, see $OUT/bench.log)"
echo "gpu-check: OK"
