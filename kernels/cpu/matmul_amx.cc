// The AMX int8 panel kernel on the hardware tiles: matmul_amx_kernel.h over
// the _tile_* intrinsics. Compiled with -mamx-tile -mamx-int8 (plus the
// AVX-512 flags for the epilogue); entered only after UseAmx(), which has
// asked the kernel for the tile-data permission (dispatch.cc). The tile
// configuration is loaded by every call on the calling thread and released
// at its end, so each pool thread configures its own tiles.

#include <immintrin.h>

#include "kernels/cpu/matmul_amx_kernel.h"

namespace kvserve::kernels::internal {
namespace {

// GCC 12's tile load/store intrinsics are asm statements without a memory
// clobber: the compiler may move ordinary loads and stores across them (read
// cbuf before TILESTORED wrote it, or sink the Q4 unpack stores past the
// TILELOADD that reads them). A compiler barrier on each side keeps C++
// memory accesses ordered with the tile instructions; it emits no code.
inline void CompilerBarrier() { __asm__ __volatile__("" ::: "memory"); }

// Tile numbers must be immediates in the intrinsics, hence one branch per
// index rather than a template argument pasted into the instruction.
struct HardwareTiles {
  static void Configure(const AmxTileConfig& c) {
    CompilerBarrier();
    _tile_loadconfig(&c);
  }
  static void Release() { _tile_release(); }
  template <int I>
  static void LoadA(const void* p, int64_t stride) {
    CompilerBarrier();
    if constexpr (I == 0) {
      _tile_loadd(2, p, stride);
    } else {
      _tile_loadd(3, p, stride);
    }
  }
  template <int I>
  static void LoadB(const void* p, int64_t stride) {
    CompilerBarrier();
    if constexpr (I == 0) {
      _tile_loadd(4, p, stride);
    } else {
      _tile_loadd(5, p, stride);
    }
  }
  template <int I>
  static void ZeroC() {
    if constexpr (I == 0) {
      _tile_zero(0);
    } else {
      _tile_zero(1);
    }
  }
  // C += A (signed bytes) . B (unsigned bytes).
  template <int I>
  static void DotC() {
    if constexpr (I == 0) {
      _tile_dpbsud(0, 2, 4);
    } else {
      _tile_dpbsud(1, 3, 5);
    }
  }
  template <int I>
  static void StoreC(void* p, int64_t stride) {
    if constexpr (I == 0) {
      _tile_stored(0, p, stride);
    } else {
      _tile_stored(1, p, stride);
    }
    CompilerBarrier();
  }
};

}  // namespace

void MatMulPanelsAmx(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                     int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  AmxPanelsDispatch<HardwareTiles>(w, acts, n_tokens, r0, r1, y, y_stride);
}

}  // namespace kvserve::kernels::internal
