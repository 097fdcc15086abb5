#!/usr/bin/env bash
# Builds the GPU suite on this (development) machine and packs it for a GPU
# machine that cannot build it: the lent H200 machines have CUDA 13, CMake
# and ninja but none of this project's Debian libraries (Abseil, gRPC,
# spdlog, GoogleTest, xxHash) and no network. The pack holds stripped
# binaries in the build tree's layout (tests/, bench/, server/), every shared
# library they need except glibc's, libstdc++/libgcc_s and cuBLAS (the GPU
# machine has newer or its own), and stories260K with its goldens when
# ../shared is present. deploy/gpu-check.sh --pack DIR runs from it.
#
#   bash deploy/gpu-pack.sh              # -> gpu-pack/ (ignored by git), sm_90
#   KVSERVE_GPU_ARCH=80 bash deploy/gpu-pack.sh
#
# Then, with the device tool: carry ["gpu-pack"], command
#   bash deploy/gpu-check.sh --pack gpu-pack
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH="${KVSERVE_GPU_ARCH:-90}"
BUILD="${KVSERVE_PACK_BUILD_DIR:-$ROOT/build-gpupack}"
PACK="${KVSERVE_PACK_DIR:-$ROOT/gpu-pack}"
TARGETS=(tests/cuda_kernels_test tests/llama_cuda_test tests/pd_e2e_test bench/kvserve_cuda_bench
  server/kvserve client/kvserve-bench tests/kernels_test)

command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
  { echo "gpu-pack: nvcc not found (bash deploy/setup.sh installs the CUDA toolkit)" >&2; exit 1; }
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DKVSERVE_WITH_CUDA=ON -DKVSERVE_BUILD_BENCH=ON \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >/dev/null
grep -q "KVSERVE_WITH_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" || { echo "gpu-pack: CUDA is off" >&2; exit 1; }
cmake --build "$BUILD" --target cuda_kernels_test llama_cuda_test pd_e2e_test kvserve_cuda_bench \
  kvserve kvserve-bench kernels_test

rm -rf "$PACK"
mkdir -p "$PACK/lib"
for t in "${TARGETS[@]}"; do
  mkdir -p "$PACK/$(dirname "$t")"
  strip -o "$PACK/$t" "$BUILD/$t"
done
# Shared libraries: what the dynamic linker resolves here, minus the C
# runtime (the GPU machine's glibc and libstdc++ are at least as new as
# Debian 12's) and cuBLAS (hundreds of MB; CUDA 13's own is there).
# libcudart is small and must match the toolkit the kernels were built with.
for t in "${TARGETS[@]}"; do ldd "$BUILD/$t"; done | awk '/=> \// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s)\.so' |
  grep -vE '/libcublas(Lt)?\.so|/libcuda\.so|/libnvidia' |
  while read -r lib; do cp -L "$lib" "$PACK/lib/"; done

# UCX's loadable transport modules (cma here; shm and tcp are in libuct
# itself): gpu-check.sh points UCX_MODULE_DIR at them.
UCX_MODULES="$(dirname "$(ldd "$BUILD/server/kvserve" | awk '/libuct\.so/ {print $3}')")/ucx"
if [ -d "$UCX_MODULES" ]; then
  mkdir -p "$PACK/lib/ucx"
  cp -L "$UCX_MODULES"/libuct_cma.so.0 "$PACK/lib/ucx/" 2>/dev/null || true
fi

# SmolLM2's shape with its weights' values dropped (bench/gpu/same_shape_model.py,
# ~1.4 MiB of xz): the serving benchmarks of bench/gpu/run.sh time it there.
SMOL="${KVSERVE_MODEL_DIR:-$ROOT/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$SMOL" ]; then
  python3 "$ROOT/bench/gpu/same_shape_model.py" "$SMOL" "$PACK/smollm2-shape.gguf.xz"
else
  echo "gpu-pack: no $SMOL (bash deploy/setup.sh): no serving benchmarks there"
fi

SHARED="${KVSERVE_SHARED_DIR:-$ROOT/../shared}"
if [ -f "$SHARED/models/stories260K.gguf" ]; then
  mkdir -p "$PACK/shared/models" "$PACK/shared/golden"
  cp "$SHARED/models/stories260K.gguf" "$PACK/shared/models/"
  cp -r "$SHARED/golden/." "$PACK/shared/golden/"
else
  echo "gpu-pack: no stories260K at $SHARED/models: its GPU tests will skip there"
fi

# The newest glibc symbol version anything in the pack needs.
# (objdump fails on what is not an ELF file, lib/ucx/ among them: find files only.)
find "$PACK"/tests "$PACK"/bench "$PACK"/server "$PACK"/client "$PACK"/lib -type f -print0 |
  xargs -0 objdump -T 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 >"$PACK/GLIBC_REQUIRED"
git -C "$ROOT" rev-parse HEAD >"$PACK/COMMIT" 2>/dev/null || true
echo "$ARCH" >"$PACK/CUDA_ARCH"
# Keep the pack out of git without touching .gitignore.
EXCLUDE="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null || true)"
if [ -n "$EXCLUDE" ] && ! grep -qx "/$(basename "$PACK")/" "$EXCLUDE" 2>/dev/null; then
  mkdir -p "$(dirname "$EXCLUDE")"
  echo "/$(basename "$PACK")/" >>"$EXCLUDE"
fi
SIZE="$(du -sm "$PACK" | cut -f1)"
echo "gpu-pack: $PACK ($SIZE MiB; needs $(cat "$PACK/GLIBC_REQUIRED"), sm_$ARCH, commit $(cat "$PACK/COMMIT" 2>/dev/null))"
[ "$SIZE" -lt 60 ] || echo "gpu-pack: warning: over the device tool's 64 MiB working-tree limit with the repo"
echo "gpu-pack: on the GPU machine: bash deploy/gpu-check.sh --pack $(basename "$PACK")"
