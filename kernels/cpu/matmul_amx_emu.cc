// matmul_amx_kernel.h over a software model of the AMX tile registers
// (TILELOADD, TILEZERO, TDPBSUD, TILESTORED with the palette-1 shapes the
// kernel configures), so the AMX kernel's tiling, padding, Q4 unpacking and
// epilogue are tested bit for bit against the VNNI kernel on CPUs without
// AMX. Tests only; compiled with the AVX-512 flags.

#include <cstring>

#include "kernels/cpu/matmul_amx_kernel.h"

namespace kvserve::kernels::internal {
namespace {

struct EmulatedTiles {
  struct State {
    AmxTileConfig config;
    alignas(64) uint8_t tile[8][16][64];
  };
  static State& S() {
    thread_local State s;
    return s;
  }
  static void Configure(const AmxTileConfig& c) {
    S().config = c;
    std::memset(S().tile, 0, sizeof(S().tile));
  }
  static void Release() { S().config = AmxTileConfig{}; }
  static void Load(int t, const void* p, int64_t stride) {
    const auto* src = static_cast<const uint8_t*>(p);
    for (int r = 0; r < S().config.rows[t]; ++r) {
      std::memcpy(S().tile[t][r], src + r * stride, S().config.colsb[t]);
    }
  }
  template <int I>
  static void LoadA(const void* p, int64_t stride) {
    Load(2 + I, p, stride);
  }
  template <int I>
  static void LoadB(const void* p, int64_t stride) {
    Load(4 + I, p, stride);
  }
  template <int I>
  static void ZeroC() {
    std::memset(S().tile[I], 0, sizeof(S().tile[I]));
  }
  // TDPBSUD: C[m][n] += sum_k sum_i s8(A[m][4k + i]) * u8(B[k][4n + i]),
  // m < rows(C), n < colsb(C) / 4, k < colsb(A) / 4.
  template <int I>
  static void DotC() {
    const AmxTileConfig& c = S().config;
    const int a = 2 + I;
    const int b = 4 + I;
    for (int m = 0; m < c.rows[I]; ++m) {
      for (int n = 0; n < c.colsb[I] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, &S().tile[I][m][4 * n], 4);
        for (int k = 0; k < c.colsb[a] / 4; ++k) {
          for (int i = 0; i < 4; ++i) {
            sum += static_cast<int8_t>(S().tile[a][m][4 * k + i]) *
                   static_cast<int32_t>(S().tile[b][k][4 * n + i]);
          }
        }
        std::memcpy(&S().tile[I][m][4 * n], &sum, 4);
      }
    }
  }
  template <int I>
  static void StoreC(void* p, int64_t stride) {
    auto* dst = static_cast<uint8_t*>(p);
    for (int r = 0; r < S().config.rows[I]; ++r) {
      std::memcpy(dst + r * stride, S().tile[I][r], S().config.colsb[I]);
    }
  }
};

}  // namespace

void MatMulPanelsAmxEmulated(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                             int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  AmxPanelsDispatch<EmulatedTiles>(w, acts, n_tokens, r0, r1, y, y_stride);
}

}  // namespace kvserve::kernels::internal
