#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (CTest), then runs the GGUF
# fuzz test and the engine again under AddressSanitizer + UBSan in a separate
# build, and the CUDA backend on the CPU emulator (kernels/cuda/emu) in a third.
#   bash deploy/test.sh            # everything
#   bash deploy/test.sh --no-asan  # skip the sanitizer stage
#   bash deploy/test.sh --no-emu   # skip the CUDA emulator stage
#   bash deploy/test.sh --no-fuzz  # skip the libFuzzer stage
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASAN=1
EMU=1
FUZZ=1
for arg in "$@"; do
  case "$arg" in
    --no-asan) ASAN=0 ;;
    --no-emu) EMU=0 ;;
    --no-fuzz) FUZZ=0 ;;
    *) echo "test.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
JOBS="$(nproc)"

# Wall time of each stage, and the CPU time (user + system) of the commands
# it ran, printed as it ends and as a table at the end (also when a stage
# fails), so a CI log shows where its minutes go. On a machine shared with
# other work the CPU column is the steadier figure of the two.
STAGE_NAMES=()
STAGE_SECS=()
STAGE_CPU=()
STAGE_NAME=""
STAGE_T0=0
STAGE_C0=0
T_ALL="$(date +%s)"
TIMES_FILE="$(mktemp)"
# Sets CPU_NOW to the user + system seconds of this shell's finished
# children. `times` must run in this shell, not in a $(...) subshell, which
# has no finished children of its own (it read 0 there).
cpu_now() {
  times > "$TIMES_FILE"
  CPU_NOW="$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); n += p[1] * 60 + p[2] }
       printf "%d\n", n }' "$TIMES_FILE")"
}
stage() {
  stage_end
  STAGE_NAME="$1"
  STAGE_T0="$(date +%s)"
  cpu_now
  STAGE_C0="$CPU_NOW"
  echo "test.sh: stage $STAGE_NAME"
}
stage_end() {
  [ -n "$STAGE_NAME" ] || return 0
  local dt=$(($(date +%s) - STAGE_T0))
  cpu_now
  local dc=$((CPU_NOW - STAGE_C0))
  STAGE_NAMES+=("$STAGE_NAME")
  STAGE_SECS+=("$dt")
  STAGE_CPU+=("$dc")
  echo "test.sh: stage $STAGE_NAME took ${dt}s (${dc} CPU-s)"
  STAGE_NAME=""
}
stage_table() {
  local rc=$?
  if [ -n "${BG_PID:-}" ]; then kill -- -"$BG_PID" 2>/dev/null || true; fi
  stage_end
  echo "test.sh: time per stage:          wall s    CPU s"
  local i
  for i in "${!STAGE_NAMES[@]}"; do
    printf 'test.sh:   %-24s %8d %8d\n' "${STAGE_NAMES[$i]}" "${STAGE_SECS[$i]}" "${STAGE_CPU[$i]}"
  done
  cpu_now
  printf 'test.sh:   %-24s %8d %8d%s\n' total "$(($(date +%s) - T_ALL))" "$CPU_NOW" \
    "$([ "$rc" = 0 ] || echo " (failed, exit $rc)")"
  rm -f "$TIMES_FILE"
}
trap stage_table EXIT

# Four configurations (the main build, ASan, the CUDA emulator, libFuzzer),
# each built once and only for what it runs. With ccache installed every
# build goes through it, keyed relative to the checkout: the emulator build
# differs from the main one only in kernels/cuda and three tests, so the rest
# of its daemon (server, scheduler, model, ...) comes from the main build's
# objects instead of compiling again (both pass the CUDA headers as SYSTEM
# includes, so their command lines match: kernels/cuda/CMakeLists.txt).
stage setup
bash "$ROOT/deploy/setup.sh"
LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
  # Debug info names the build directory; without this the directory is
  # part of the key and build/ and build-emu/ never share an object.
  export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
fi

stage build
# -UKVSERVE_WITH_CUDA: back to the default (the CUDA kernels compiled by nvcc
# wherever it is installed) if deploy/quickstart.sh left them out of build/.
bash "$ROOT/deploy/build.sh" -UKVSERVE_WITH_CUDA "${LAUNCHER[@]}"
stage venv
# The official openai Python client, for the HTTP compatibility test
# (PyPI, in a venv of the project's own).
# msgspec + pyzmq: the vLLM-format KV event subscriber; prometheus_client: the
# exposition-format check of /metrics; kubernetes: the manifests' schemas;
# jsonschema: validates every structured output against its schema.
if [ ! -x "$ROOT/.venv/bin/python" ] ||
   ! "$ROOT/.venv/bin/python" -c "import openai, msgspec, zmq, prometheus_client, kubernetes, jsonschema" 2>/dev/null; then
  python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install --quiet "openai==3.57.0" "msgspec==0.23.0" "pyzmq==27.3.0" \
    "prometheus_client==0.26.0" "kubernetes==37.0.3" "jsonschema==4.26.0"
fi
export KVSERVE_PYTHON="$ROOT/.venv/bin/python"
# promtool, for `promtool check metrics` on /metrics (metrics_compat_e2e):
# only the binary, unpacked from Debian's prometheus package into .tools/
# (installing the package would start a Prometheus server).
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$ROOT/.tools/promtool" ] &&
   command -v apt-get >/dev/null 2>&1; then
  tmp_deb="$(mktemp -d)"
  if (cd "$tmp_deb" && apt-get download -q prometheus >/dev/null 2>&1 &&
      dpkg-deb -x prometheus_*.deb x); then
    mkdir -p "$ROOT/.tools"
    cp "$tmp_deb/x/usr/bin/promtool" "$ROOT/.tools/promtool"
  else
    echo "test.sh: warning: could not unpack promtool from Debian's prometheus package;" \
      "metrics_compat_e2e checks the exposition format without it" >&2
  fi
  rm -rf "$tmp_deb"
fi
if [ -x "$ROOT/.tools/promtool" ]; then
  export KVSERVE_PROMTOOL="$ROOT/.tools/promtool"
fi
if [ -n "${KVSERVE_PROMTOOL:-}" ] || command -v promtool >/dev/null 2>&1; then
  # The test fails instead of skipping promtool if it goes missing.
  export KVSERVE_REQUIRE_PROMTOOL=1
fi
# The ASan and CUDA emulator configurations build while the main suite runs,
# at the lowest CPU priority (nice 19): the suite leaves ~40% of two cores
# idle (tests waiting on daemons, timeouts and its RUN_SERIAL tail), which the
# compiles take, and a test that wakes takes its core back at once (a nice-0
# task outweighs a nice-19 one 68 to 1). Their output goes to a log, printed
# if they fail; the stage "builds-wait" is what is left of them after ctest,
# and its CPU column holds all of theirs (counted when they are waited for).
ASAN_BUILD="$ROOT/build-asan"
EMU_BUILD="$ROOT/build-emu"
HAVE_CUDA_HEADERS=0
if [ -f /usr/local/cuda/include/cuda_runtime.h ] || command -v nvcc >/dev/null 2>&1; then
  HAVE_CUDA_HEADERS=1
fi
build_asan() {
  # Without xgrammar: none of the tests below constrains decoding (grammar_test
  # and the structured-output e2e cases run in the main build), and xgrammar
  # at -O2 under ASan + UBSan took 312 of this build's 733 CPU s.
  cmake -S "$ROOT" -B "$ASAN_BUILD" -G Ninja -DKVSERVE_SANITIZE=ON -DKVSERVE_WITH_CUDA=OFF \
    -DKVSERVE_WITH_XGRAMMAR=OFF -DKVSERVE_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug \
    "${LAUNCHER[@]}" >/dev/null
  # Only the targets run below.
  cmake --build "$ASAN_BUILD" --target gguf_fuzz_test gguf_test tokenizer_test cache_test \
    scheduler_test engine_seams_test embed_test
}
build_emu() {
  cmake -S "$ROOT" -B "$EMU_BUILD" -G Ninja -DKVSERVE_CUDA_EMULATOR=ON \
    -DKVSERVE_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo "${LAUNCHER[@]}" >/dev/null
  # pd_e2e_test (and the kvserve it starts): prefill/decode nodes with
  # CUDA KV pools (PdCudaTest), moved through UCX's host staging.
  cmake --build "$EMU_BUILD" --target cuda_emu_test cuda_kernels_test llama_cuda_test \
    kvserve pd_e2e_test
}
BG_LOG="$(mktemp)"
BG_PID=""
if [ "$ASAN" = 1 ] || { [ "$EMU" = 1 ] && [ "$HAVE_CUDA_HEADERS" = 1 ]; }; then
  # Its own process group (set -m), so that an early exit stops the compilers too.
  set -m
  (
    renice -n 19 -p "$BASHPID" >/dev/null
    t0="$(date +%s)"
    if [ "$ASAN" = 1 ]; then
      build_asan
      echo "test.sh: the ASan build took $(($(date +%s) - t0)) s behind ctest"
    fi
    t1="$(date +%s)"
    if [ "$EMU" = 1 ] && [ "$HAVE_CUDA_HEADERS" = 1 ]; then
      build_emu
      echo "test.sh: the emulator build took $(($(date +%s) - t1)) s behind ctest"
    fi
  ) >"$BG_LOG" 2>&1 &
  BG_PID=$!
  set +m
fi
stage ctest
ctest --test-dir "$ROOT/build" --output-on-failure -j "$JOBS" --timeout 600

if [ -n "$BG_PID" ]; then
  stage builds-wait
  if ! wait "$BG_PID"; then
    cat "$BG_LOG"
    echo "test.sh: the ASan / emulator build failed" >&2
    exit 1
  fi
  BG_PID=""
  grep '^test.sh:' "$BG_LOG" || true
fi
rm -f "$BG_LOG"

if [ "$ASAN" = 1 ]; then
  stage asan-run
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  # Each binary is one single-threaded process, so they run $JOBS at a time,
  # the longest first; each one's output is printed whole when it ends.
  ASAN_LOGS="$(mktemp -d)"
  asan_one() {  # test binary, its extra arguments
    local t="$1"
    shift
    if "$ASAN_BUILD/tests/$t" --gtest_brief=1 "$@" >"$ASAN_LOGS/$t.log" 2>&1; then
      echo 0 >"$ASAN_LOGS/$t.rc"
      echo "test.sh: $t under AddressSanitizer: passed"
    else
      echo 1 >"$ASAN_LOGS/$t.rc"
      cat "$ASAN_LOGS/$t.log"
      echo "test.sh: $t under AddressSanitizer: FAILED"
    fi
  }
  ASAN_STARTED=()
  asan_start() {
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    ASAN_STARTED+=("$1")
    asan_one "$@" &
  }
  # The engine with the prefix cache (block sharing, copy-on-write,
  # eviction, preemption) on the small models; SmolLM2 is too slow unoptimized.
  asan_start scheduler_test --gtest_filter='-*SmolLM2*'
  asan_start cache_test
  asan_start tokenizer_test
  asan_start engine_seams_test
  asan_start gguf_fuzz_test
  # The sentence encoder's parsers (safetensors, tokenizer.json, UTF-8 text)
  # and three short forwards; the reference sweep is too slow unoptimized.
  asan_start embed_test \
    --gtest_filter='Safetensors*:BertTokenizer*:SentenceEncoderLoadTest*:BrokenModelDirTest.Missing*:BrokenModelDirTest.Truncated*:SentenceEncoderTest.Similar*'
  asan_start gguf_test
  wait
  for t in "${ASAN_STARTED[@]}"; do
    if [ "$(cat "$ASAN_LOGS/$t.rc" 2>/dev/null)" != 0 ]; then
      echo "test.sh: $t failed under AddressSanitizer" >&2
      exit 1
    fi
  done
  rm -rf "$ASAN_LOGS"
fi
if [ "$EMU" = 1 ]; then
  # No GPU here or in CI: the CUDA kernels, the CUDA forward and the backend
  # seam run on the CPU emulator, against the same CPU references the GPU
  # tests use. Needs only the toolkit's headers.
  if [ "$HAVE_CUDA_HEADERS" = 1 ]; then
    stage emu-run
    echo "test.sh: CUDA tests on the CPU emulator"
    ctest --test-dir "$EMU_BUILD" -R 'Cuda|BackendSelection' --output-on-failure -j "$JOBS" \
      --timeout 900
    # The start-up errors of a machine without a GPU, through the emulator.
    KVSERVE_CUDA_EMU_DEVICES=0 "$EMU_BUILD/tests/llama_cuda_test" --gtest_brief=1 \
      --gtest_filter='BackendSelection*'
  else
    echo "test.sh: no CUDA toolkit headers; CUDA emulator stage skipped"
  fi
fi
if [ "$FUZZ" = 1 ]; then
  # libFuzzer targets (tests/fuzz): the OpenAI request parser, the GGUF
  # reader, the chat-template renderer and the tokenizers under ASan +
  # UBSan, 20 s each; a crash fails CI.
  stage fuzz
  bash "$ROOT/tests/fuzz/run.sh" 20
fi
echo "test.sh: all tests passed"
