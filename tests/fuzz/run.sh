#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/CMakeLists.txt, clang, ASan +
# UBSan) and runs each for a bounded time on a copy of its committed seed
# corpus; any crash, sanitizer report or leak fails (exit non-zero) and
# leaves the reproducer in $BUILD/crashes/<target>/.
#   bash tests/fuzz/run.sh [seconds per target, default 30]
# Reproduce one:  build-fuzz/<target>_fuzz build-fuzz/crashes/<target>/crash-...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SECONDS_PER_TARGET="${1:-30}"
BUILD="${KVSERVE_FUZZ_BUILD:-$ROOT/build-fuzz}"
CXX_FUZZ="${KVSERVE_FUZZ_CXX:-clang++}"
LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

cmake -S "$ROOT/tests/fuzz" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER="$CXX_FUZZ" \
  "${LAUNCHER[@]}" >/dev/null
t0="$(date +%s)"
cmake --build "$BUILD" -j "$(nproc)"
echo "fuzz: build took $(($(date +%s) - t0))s"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# One libFuzzer process per core at a time (KVSERVE_FUZZ_JOBS, default nproc):
# each target still gets its full SECONDS_PER_TARGET of one core, the stage
# takes targets/jobs times as long.
JOBS="${KVSERVE_FUZZ_JOBS:-$(nproc)}"
run_one() {
  local t="$1"
  local work="$BUILD/corpus/$t"
  local crashes="$BUILD/crashes/$t"
  mkdir -p "$work" "$crashes"
  cp -n "$ROOT/tests/fuzz/corpus/$t/"* "$work/" 2>/dev/null || true
  "$BUILD/${t}_fuzz" -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$crashes/" \
    "$work" > "$BUILD/$t.log" 2>&1
}
status=0
pids=()
names=()
report() {  # waits for the oldest running target and reports it
  local t="${names[0]}"
  if ! wait "${pids[0]}"; then
    echo "fuzz: $t FAILED; reproducer in $BUILD/crashes/$t, log $BUILD/$t.log"
    tail -40 "$BUILD/$t.log"
    status=1
  else
    echo "fuzz: $t passed: $(grep -E "^stat::number_of_executed_units|^#[0-9]+.*DONE" \
      "$BUILD/$t.log" | tail -1 || true)"
  fi
  pids=("${pids[@]:1}")
  names=("${names[@]:1}")
}
for t in openai_request gguf chat_template tokenizer; do
  [ "${#pids[@]}" -lt "$JOBS" ] || report
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  run_one "$t" &
  pids+=("$!")
  names+=("$t")
done
while [ "${#pids[@]}" -gt 0 ]; do report; done
exit "$status"
