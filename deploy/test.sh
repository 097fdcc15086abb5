#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (CTest), then runs the GGUF
# fuzz test again under AddressSanitizer + UBSan in a separate build.
#   bash deploy/test.sh            # everything
#   bash deploy/test.sh --no-asan  # skip the sanitizer stage
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASAN=1
for arg in "$@"; do
  case "$arg" in
    --no-asan) ASAN=0 ;;
    *) echo "test.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
JOBS="$(nproc)"

bash "$ROOT/deploy/setup.sh"
bash "$ROOT/deploy/build.sh"
# The official openai Python client, for the HTTP compatibility test
# (PyPI, in a venv of the project's own).
if [ ! -x "$ROOT/.venv/bin/python" ] || ! "$ROOT/.venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install --quiet "openai==3.57.0"
fi
export KVSERVE_PYTHON="$ROOT/.venv/bin/python"
ctest --test-dir "$ROOT/build" --output-on-failure -j "$JOBS" --timeout 600

if [ "$ASAN" = 1 ]; then
  ASAN_BUILD="$ROOT/build-asan"
  cmake -S "$ROOT" -B "$ASAN_BUILD" -G Ninja -DKVSERVE_SANITIZE=ON -DKVSERVE_WITH_CUDA=OFF \
    -DKVSERVE_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build "$ASAN_BUILD" --target gguf_fuzz_test gguf_test tokenizer_test cache_test \
    scheduler_test
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  for t in gguf_fuzz_test gguf_test tokenizer_test cache_test; do
    echo "test.sh: $t under AddressSanitizer"
    "$ASAN_BUILD/tests/$t" --gtest_brief=1
  done
  # The engine with the prefix cache (block sharing, copy-on-write,
  # eviction, preemption) on the small models; SmolLM2 is too slow unoptimized.
  echo "test.sh: scheduler_test under AddressSanitizer"
  "$ASAN_BUILD/tests/scheduler_test" --gtest_brief=1 --gtest_filter='-*SmolLM2*'
fi
echo "test.sh: all tests passed"
