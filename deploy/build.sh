#!/usr/bin/env bash
# Configures and builds kvserve into build/ (Release with debug info).
# Extra arguments go to CMake, e.g. -DKVSERVE_WITH_CUDA=OFF.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${KVSERVE_BUILD_DIR:-$ROOT/build}"
cmake -S "$ROOT" -B "$BUILD" -G Ninja "$@" >/dev/null
cmake --build "$BUILD"
