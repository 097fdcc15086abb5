// The AMX int8 panel kernel, written once over a tile back end so the same
// code runs on the hardware tiles (matmul_amx.cc) and on a software model
// of them (matmul_amx_emu.cc, for tests on CPUs without AMX). Include only
// from those two translation units (AVX-512 flags required).
//
// Per 16-token chunk, per panel, per 32-element block b:
//   A = the chunk's int8 activations of block b (16 rows x 32 bytes, read in
//       place from QuantizedActs; a zero-padded copy for a short last chunk),
//   B = the panel's unsigned weights of block b (8 rows x 64 bytes: the
//       packed Q8_0 bytes as they are; Q4 nibbles unpacked once per panel),
//   C = 0, then TDPBSUD C += A . B: C[t][n] is the exact int32 block sum of
//       token t and row n, the same integer the VNNI kernel's lanes hold,
// and C's row t goes through PanelBlockEpilogue as the VNNI kernel does. One
// tile dot per block (K = 32, half a tile's depth) is the price of exact
// per-block sums; two C tiles alternate so a block's epilogue overlaps the
// next block's dot.
//
// Tiles (palette 1): 0, 1 = C (16 x 64 bytes); 2, 3 = A (16 x 32 bytes);
// 4, 5 = B (8 x 64 bytes).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/matmul_panels.h"

namespace kvserve::kernels::internal {
namespace {

struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline AmxTileConfig PanelTileConfig() {
  AmxTileConfig c;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = 16;  // C
    c.colsb[i] = 64;
    c.rows[2 + i] = 16;  // A
    c.colsb[2 + i] = 32;
    c.rows[4 + i] = 8;  // B
    c.colsb[4 + i] = 64;
  }
  return c;
}

// Tiles is a back end with static Configure(const AmxTileConfig&), Release(),
// LoadA<i>(ptr, stride), LoadB<i>(ptr, stride), ZeroC<i>(), DotC<i>() (C_i +=
// A_i . B_i, signed A by unsigned B) and StoreC<i>(ptr, stride), i in {0, 1}.
template <class Tiles, DType kType>
void AmxPanels(const PackedWeight& w, const QuantizedActs& a, int64_t n_tokens, int64_t r0,
               int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.n_blocks;
  const int64_t act_stride = nb * kQK;
  thread_local std::vector<int8_t> pad;         // a short last token chunk, zero-padded
  thread_local std::vector<uint8_t> unpacked;  // one Q4 panel as unsigned bytes
  alignas(64) int32_t cbuf[2][16][16];

  const int64_t full_chunks = n_tokens / 16;
  const int64_t tail = n_tokens % 16;
  if (tail > 0) {
    pad.assign(static_cast<size_t>(16 * act_stride), 0);
    std::memcpy(pad.data(), a.qs + full_chunks * 16 * act_stride,
                static_cast<size_t>(tail * act_stride));
  }
  if constexpr (kType != DType::kQ8_0) unpacked.resize(static_cast<size_t>(nb * 512));

  Tiles::Configure(PanelTileConfig());
  const int64_t pb = r0 / kPanelRows;
  const int64_t pe = (r1 + kPanelRows - 1) / kPanelRows;
  for (int64_t p = pb; p < pe; ++p) {
    // B tile of block b: packed Q8_0 bytes in place, else the unpacked copy.
    const uint8_t* bsrc = nullptr;
    if constexpr (kType != DType::kQ8_0) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_load_si512(w.Qs(p, b) + 64 * j);
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (kType == DType::kQ6_K) {
            lo = PanelQ6Value(lo, w, p, b, j);
            hi = PanelQ6Value(hi, w, p, b, j + 4);
          } else {
            lo = PanelMapValues<kType>(PanelAddHighBits<kType>(lo, w, p, b, j));
            hi = PanelMapValues<kType>(PanelAddHighBits<kType>(hi, w, p, b, j + 4));
          }
          _mm512_storeu_si512(unpacked.data() + b * 512 + 64 * j, lo);
          _mm512_storeu_si512(unpacked.data() + b * 512 + 64 * (j + 4), hi);
        }
      }
      bsrc = unpacked.data();
    }
    auto bsrc_of = [&](int64_t b) -> const uint8_t* {
      if constexpr (kType == DType::kQ8_0) {
        return w.Qs(p, b);
      } else {
        return bsrc + b * 512;
      }
    };
    const __mmask16 mask = PanelRowMask(p, r0, r1);
    for (int64_t c = 0; c < full_chunks + (tail > 0 ? 1 : 0); ++c) {
      const int64_t t0 = c * 16;
      const int64_t nt = std::min<int64_t>(16, n_tokens - t0);
      const int8_t* arows = c < full_chunks ? a.qs + t0 * act_stride : pad.data();
      const float* xds = a.ds + t0 * 2 * nb;
      const int32_t* xsum = a.sums != nullptr ? a.sums + t0 * nb : nullptr;
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      // Q4_K: the super-block's scaled block dots (matmul_panels.h).
      __m512i ksumi[16];
      auto epilogue = [&](int64_t b, const int32_t (*isums)[16]) {
        if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
          if (b % 8 == 0) {
            for (int t = 0; t < 16; ++t) ksumi[t] = _mm512_setzero_si512();
          }
          const __m512i sc = PanelKScales(w, p, b, false);
          for (int t = 0; t < nt; ++t) {
            ksumi[t] = _mm512_add_epi32(ksumi[t],
                                        _mm512_mullo_epi32(_mm512_load_si512(isums[t]), sc));
          }
          if (b % 8 == 7) {
            const int64_t s = b / 8;
            for (int t = 0; t < nt; ++t) {
              acc[t] = PanelQ4KSuperEpilogue(acc[t], ksumi[t], w, p, s,
                                             a.bsums + (t0 + t) * nb * 2 + 16 * s,
                                             xds[t * 2 * nb + 2 * 8 * s]);
            }
          }
          return;
        }
        if constexpr (kType == DType::kIQ4_XS) {
          if (b % 8 == 0) {
            for (int t = 0; t < 16; ++t) ksumi[t] = _mm512_setzero_si512();
          }
          for (int t = 0; t < nt; ++t) {
            const int16_t* xbs = a.bsums + (t0 + t) * nb * 2;
            const int32_t xs = int32_t{xbs[2 * b]} + int32_t{xbs[2 * b + 1]};
            ksumi[t] = _mm512_add_epi32(
                ksumi[t], PanelIq4XsSubBlock(_mm512_load_si512(isums[t]), w, p, b, xs));
          }
          if (b % 8 == 7) {
            for (int t = 0; t < nt; ++t) {
              acc[t] = PanelIq4XsSuperEpilogue(acc[t], ksumi[t], w, p, b / 8,
                                               xds[t * 2 * nb + 2 * 8 * (b / 8)]);
            }
          }
          return;
        }
        if constexpr (kType == DType::kQ6_K) {
          // The tile gives one sum per 32 values; Q6_K scales per 16, so
          // its two halves come from the unpacked bytes instead.
          if (b % 8 == 0) {
            for (int t = 0; t < 16; ++t) ksumi[t] = _mm512_setzero_si512();
          }
          const uint8_t* wb = bsrc_of(b);
          for (int t = 0; t < nt; ++t) {
            const int8_t* x = (c < full_chunks ? a.qs + (t0 + t) * act_stride
                                               : pad.data() + t * act_stride) +
                              b * kQK;
            for (int half = 0; half < 2; ++half) {
              __m512i isum = _mm512_setzero_si512();
              for (int g = 0; g < 4; ++g) {
                int32_t xv;
                std::memcpy(&xv, x + 16 * half + 4 * g, 4);
                isum = _mm512_dpbusd_epi32(isum, _mm512_loadu_si512(wb + 64 * (4 * half + g)),
                                           _mm512_set1_epi32(xv));
              }
              const int16_t* xbs = a.bsums + (t0 + t) * nb * 2;
              ksumi[t] = _mm512_add_epi32(
                  ksumi[t], PanelQ6SubBlock(isum, w, p, b, half, xbs[2 * b + half]));
            }
          }
          if (b % 8 == 7) {
            for (int t = 0; t < nt; ++t) {
              acc[t] = PanelQ6SuperEpilogue(acc[t], ksumi[t], w, p, b / 8,
                                            xds[t * 2 * nb + 2 * 8 * (b / 8)]);
            }
          }
          return;
        }
        __m512 dw;
        __m512 mw;
        PanelScales<kType>(w, p, b, &dw, &mw);
        for (int t = 0; t < 16; ++t) {
          if (t >= nt) break;
          const __m512i isum = _mm512_load_si512(isums[t]);
          acc[t] = PanelBlockEpilogue<kType>(acc[t], isum, dw, mw, xds[t * 2 * nb + 2 * b],
                                             xds[t * 2 * nb + 2 * b + 1],
                                             PanelUsesSum(kType) ? xsum[t * nb + b] : 0);
        }
      };
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        Tiles::template LoadA<0>(arows + b * kQK, act_stride);
        Tiles::template LoadB<0>(bsrc_of(b), 64);
        Tiles::template ZeroC<0>();
        Tiles::template DotC<0>();
        Tiles::template LoadA<1>(arows + (b + 1) * kQK, act_stride);
        Tiles::template LoadB<1>(bsrc_of(b + 1), 64);
        Tiles::template ZeroC<1>();
        Tiles::template DotC<1>();
        Tiles::template StoreC<0>(cbuf[0], 64);
        epilogue(b, cbuf[0]);
        Tiles::template StoreC<1>(cbuf[1], 64);
        epilogue(b + 1, cbuf[1]);
      }
      if (b < nb) {
        Tiles::template LoadA<0>(arows + b * kQK, act_stride);
        Tiles::template LoadB<0>(bsrc_of(b), 64);
        Tiles::template ZeroC<0>();
        Tiles::template DotC<0>();
        Tiles::template StoreC<0>(cbuf[0], 64);
        epilogue(b, cbuf[0]);
      }
      for (int t = 0; t < nt; ++t) {
        _mm512_mask_storeu_ps(y + (t0 + t) * y_stride + p * kPanelRows, mask, acc[t]);
      }
    }
  }
  Tiles::Release();
}

template <class Tiles>
void AmxPanelsDispatch(const PackedWeight& w, const QuantizedActs& a, int64_t n_tokens,
                       int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  VisitPanelType(w.type, [&]<DType kType>() {
    if constexpr (kType == DType::kQ2_K || kType == DType::kQ3_K) {
      // 16-value scales and 2-3 bit planes, no tile layout; the VNNI kernel
      // computes the same expression.
      MatMulPanelsVnni(w, a, n_tokens, r0, r1, y, y_stride);
    } else {
      AmxPanels<Tiles, kType>(w, a, n_tokens, r0, r1, y, y_stride);
    }
  });
}

}  // namespace
}  // namespace kvserve::kernels::internal
