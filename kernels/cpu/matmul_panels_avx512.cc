// AVX-512 VNNI kernel over 16-row weight panels (matmul_panels.h): lanes are
// the panel's 16 rows, so one vpdpbusd multiplies a 4-byte group of 16 rows
// by one broadcast activation group, and a block's 8 (Q8_0) or 4 x 2 (Q4)
// dot products leave the exact int32 block sum of 16 rows in one register,
// with no horizontal reduction. The float epilogue is PanelBlockEpilogue,
// shared with the AMX kernel. Compiled with the AVX-512 flags; entered only
// after UseAvx512Vnni().

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/cpu/matmul_panels.h"

namespace kvserve::kernels::internal {
namespace {

// One token: one panel at a time. Its blocks' dot chains are independent
// (each starts from zero), so out-of-order execution overlaps them, and the
// weights stream from one place; 4 panels at a time measured 2-3x slower on
// L2-resident matrices.
constexpr int kOneTokenPanels = 1;

// One token also prefetches (non-temporal hint) the bytes 4 KB ahead of
// each block it reads: the hardware prefetchers stop at 4 KB boundaries,
// so without it every page of the stream starts with demand misses. On a
// Zen 4 EPYC VM, alternating token by token in one process (so the VM's
// bandwidth swings cancel), decode time per token with/without: Gemma 3
// 270M Q4_K_M 0.951, 0.980, 0.945 (2 KB ahead: 0.961-0.982; 8 KB: 0.952),
// SmolLM2 Q4_0 0.990, 0.959, Q4_K_M 0.990, 0.926. (An earlier try 6 KB
// ahead, measured across runs, had looked slower for SmolLM2.) Prefetches
// never fault, so running past the end of a matrix is harmless.
constexpr int64_t kOneTokenPrefetchAhead = 4096;

// Prefetches `bytes` (a block's share of the stream, rounded up to lines)
// kOneTokenPrefetchAhead past p.
inline void PrefetchAhead(const uint8_t* p, int bytes) {
  const char* base = reinterpret_cast<const char*>(p) + kOneTokenPrefetchAhead;
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(base + l, _MM_HINT_NTA);
}

inline __m512i Bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// The T tokens' activations a tile reads: int8 values, (d, s) pairs, and
// the integer block sums (32-value formats) or the Q8_K 16-value sums.
template <int T>
struct TileActs {
  const int8_t* xq[T];
  const float* xds[T];
  const int32_t* xsum[T];
  const int16_t* xbs[T];
  __attribute__((always_inline)) TileActs(const QuantizedActs& a, int64_t t0, int64_t nb) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      xq[t] = a.qs + (t0 + t) * nb * kQK;
      xds[t] = a.ds + (t0 + t) * 2 * nb;
      xsum[t] = a.sums != nullptr ? a.sums + (t0 + t) * nb : nullptr;
      xbs[t] = a.bsums != nullptr ? a.bsums + (t0 + t) * nb * 2 : nullptr;
    }
  }
};

template <int P, int T>
__attribute__((always_inline)) inline void ZeroTile(__m512 (&acc)[P][T]) {
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[p][t] = _mm512_setzero_ps();
  }
}

// Writes the tile's rows of [r0, r1) for its T tokens.
template <int P, int T>
__attribute__((always_inline)) inline void StoreTile(const __m512 (&acc)[P][T], int64_t p0,
                                                     int64_t t0, int64_t r0, int64_t r1, float* y,
                                                     int64_t y_stride) {
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    const __mmask16 mask = PanelRowMask(p0 + p, r0, r1);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      _mm512_mask_storeu_ps(y + (t0 + t) * y_stride + (p0 + p) * kPanelRows, mask, acc[p][t]);
    }
  }
}

// P panels (p0..p0+P-1) x T tokens (t0..t0+T-1), all blocks. Every loop
// over panels, tokens and a block's groups is unrolled in full
// (`#pragma GCC unroll`), so acc, isum and the unpacked weights live in
// registers: GCC 12 at -O2 left some tile sizes rolled, their arrays on the
// stack, and a 4-token tile cost 2.6x a 1-token one (kvserve_kernels_bench
// SmolLM2DecodeMatMuls/fused/panels/threads:1 on a Zen EPYC: 1, 2, 3, 4, 8,
// 16, 64 tokens 3.43, 3.83, 5.31, 8.86, 13.0, 26.0, 96.7 ms rolled; 3.18,
// 3.21, 3.18, 3.56, 5.90, 12.6, 39.6 ms unrolled).
template <DType kType, int P, int T>
void PanelTile(const PackedWeight& w, int64_t p0, const QuantizedActs& a, int64_t t0, int64_t r0,
               int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.n_blocks;
  __m512 acc[P][T];
  ZeroTile(acc);
  const TileActs<T> x(a, t0, nb);
  const auto& xq = x.xq;
  const auto& xds = x.xds;
  const auto& xsum = x.xsum;
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (P == 1 && T == 1) PrefetchAhead(w.Qs(p0, b), 576);
    __m512i isum[P][T];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
    }
    if constexpr (kType == DType::kQ8_0) {
#pragma GCC unroll 16
      for (int g = 0; g < 8; ++g) {
        __m512i wv[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) wv[p] = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * g);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m512i xv = Bcast32(xq[t] + b * kQK + 4 * g);
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], wv[p], xv);
        }
      }
    } else {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j) {
        __m512i lo[P];
        __m512i hi[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          const __m512i v = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * j);
          lo[p] = PanelMapValues<kType>(
              PanelAddHighBits<kType>(_mm512_and_si512(v, low4), w, p0 + p, b, j));
          hi[p] = PanelMapValues<kType>(PanelAddHighBits<kType>(
              _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), w, p0 + p, b, j + 4));
        }
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m512i xlo = Bcast32(xq[t] + b * kQK + 4 * j);
          const __m512i xhi = Bcast32(xq[t] + b * kQK + 16 + 4 * j);
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) {
            isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], lo[p], xlo);
            isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], hi[p], xhi);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      __m512 dw;
      __m512 mw;
      PanelScales<kType>(w, p0 + p, b, &dw, &mw);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        acc[p][t] =
            PanelBlockEpilogue<kType>(acc[p][t], isum[p][t], dw, mw, xds[t][2 * b],
                                      xds[t][2 * b + 1], PanelUsesSum(kType) ? xsum[t][b] : 0);
      }
    }
  }
  StoreTile(acc, p0, t0, r0, r1, y, y_stride);
}

// Q4_K panels (matmul_panels.h): per super-block, each sub-block's exact
// dot times its scale summed as integers (sumi, in registers), then
// PanelQ4KSuperEpilogue adds the mins and the two float steps. Q5_K adds
// fifth bits; IQ4_XS maps its nibbles through the table and scales each
// sub-block's offset-corrected dot by its signed scale (no mins).
template <DType kType, int P, int T>
void PanelTileQ4K(const PackedWeight& w, int64_t p0, const QuantizedActs& a, int64_t t0, int64_t r0,
                  int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.n_blocks;
  __m512 acc[P][T];
  ZeroTile(acc);
  const TileActs<T> x(a, t0, nb);
  const auto& xq = x.xq;
  const auto& xds = x.xds;
  const auto& xbs = x.xbs;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < nb / 8; ++s) {
    __m512i sumi[P][T];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) sumi[p][t] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      if constexpr (P == 1 && T == 1) PrefetchAhead(w.Qs(p0, b), 320);
      __m512i isum[P][T];
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
      }
#pragma GCC unroll 16
      for (int g = 0; g < 4; ++g) {
        __m512i lo[P];
        __m512i hi[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          const __m512i v = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * g);
          lo[p] = PanelMapValues<kType>(
              PanelAddHighBits<kType>(_mm512_and_si512(v, low4), w, p0 + p, b, g));
          hi[p] = PanelMapValues<kType>(PanelAddHighBits<kType>(
              _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), w, p0 + p, b, g + 4));
        }
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m512i xlo = Bcast32(xq[t] + b * kQK + 4 * g);
          const __m512i xhi = Bcast32(xq[t] + b * kQK + 16 + 4 * g);
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) {
            isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], lo[p], xlo);
            isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], hi[p], xhi);
          }
        }
      }
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        if constexpr (kType == DType::kIQ4_XS) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const int32_t xs = int32_t{xbs[t][2 * b]} + int32_t{xbs[t][2 * b + 1]};
            sumi[p][t] =
                _mm512_add_epi32(sumi[p][t], PanelIq4XsSubBlock(isum[p][t], w, p0 + p, b, xs));
          }
        } else {
          const __m512i sc = PanelKScales(w, p0 + p, b, false);
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            sumi[p][t] = _mm512_add_epi32(sumi[p][t], _mm512_mullo_epi32(isum[p][t], sc));
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        if constexpr (kType == DType::kIQ4_XS) {
          acc[p][t] =
              PanelIq4XsSuperEpilogue(acc[p][t], sumi[p][t], w, p0 + p, s, xds[t][2 * 8 * s]);
        } else {
          acc[p][t] = PanelQ4KSuperEpilogue(acc[p][t], sumi[p][t], w, p0 + p, s, xbs[t] + 16 * s,
                                            xds[t][2 * 8 * s]);
        }
      }
    }
  }
  StoreTile(acc, p0, t0, r0, r1, y, y_stride);
}

// Q6_K panels (matmul_panels.h): per sub-block of 16 values, the exact
// unsigned dot, corrected by 32 * bsum and scaled, summed as int32 over the
// super-block; then one float step. Each 32-value block is read in two
// passes (its first and second 16 values), so sumi, the pass's block sums
// and acc fit in registers.
template <int P, int T>
void PanelTileQ6K(const PackedWeight& w, int64_t p0, const QuantizedActs& a, int64_t t0, int64_t r0,
                  int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.n_blocks;
  __m512 acc[P][T];
  ZeroTile(acc);
  const TileActs<T> x(a, t0, nb);
  const auto& xq = x.xq;
  const auto& xds = x.xds;
  const auto& xbs = x.xbs;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < nb / 8; ++s) {
    __m512i sumi[P][T];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) sumi[p][t] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      if constexpr (P == 1 && T == 1) PrefetchAhead(w.Qs(p0, b), 448);
      if constexpr (T <= 4) {
        // Both halves in one pass: each group's bytes unpacked once.
        __m512i isum[2][P][T];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            isum[0][p][t] = _mm512_setzero_si512();
            isum[1][p][t] = _mm512_setzero_si512();
          }
        }
        __m512i top[2][P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          top[0][p] = _mm512_load_si512(w.Q6High(p0 + p, b, 0));
          top[1][p] = _mm512_load_si512(w.Q6High(p0 + p, b, 1));
        }
#pragma GCC unroll 16
        for (int g = 0; g < 4; ++g) {
          __m512i lo[P];
          __m512i hi[P];
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) {
            const __m512i v = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * g);
            lo[p] = _mm512_or_si512(_mm512_and_si512(v, low4), PanelQ6Top(top[0][p], g));
            hi[p] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                    PanelQ6Top(top[1][p], g));
          }
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const __m512i xlo = Bcast32(xq[t] + b * kQK + 4 * g);
            const __m512i xhi = Bcast32(xq[t] + b * kQK + 16 + 4 * g);
#pragma GCC unroll 16
            for (int p = 0; p < P; ++p) {
              isum[0][p][t] = _mm512_dpbusd_epi32(isum[0][p][t], lo[p], xlo);
              isum[1][p][t] = _mm512_dpbusd_epi32(isum[1][p][t], hi[p], xhi);
            }
          }
        }
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            sumi[p][t] = _mm512_add_epi32(
                sumi[p][t], PanelQ6SubBlock(isum[0][p][t], w, p0 + p, b, 0, xbs[t][2 * b]));
            sumi[p][t] = _mm512_add_epi32(
                sumi[p][t], PanelQ6SubBlock(isum[1][p][t], w, p0 + p, b, 1, xbs[t][2 * b + 1]));
          }
        }
        continue;
      }
      // Many tokens: one half at a time, so sumi, the half's sums and acc
      // stay in registers.
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512i isum[P][T];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
        }
        __m512i top[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) top[p] = _mm512_load_si512(w.Q6High(p0 + p, b, half));
#pragma GCC unroll 16
        for (int g = 0; g < 4; ++g) {
          __m512i q[P];
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) {
            const __m512i v = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * g);
            const __m512i nib = half == 0 ? _mm512_and_si512(v, low4)
                                          : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            q[p] = _mm512_or_si512(nib, PanelQ6Top(top[p], g));
          }
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const __m512i xv = Bcast32(xq[t] + b * kQK + 16 * half + 4 * g);
#pragma GCC unroll 16
            for (int p = 0; p < P; ++p) isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], q[p], xv);
          }
        }
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            sumi[p][t] = _mm512_add_epi32(
                sumi[p][t], PanelQ6SubBlock(isum[p][t], w, p0 + p, b, half, xbs[t][2 * b + half]));
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        acc[p][t] = PanelQ6SuperEpilogue(acc[p][t], sumi[p][t], w, p0 + p, s, xds[t][2 * 8 * s]);
      }
    }
  }
  StoreTile(acc, p0, t0, r0, r1, y, y_stride);
}

// Q2_K and Q3_K panels (matmul_panels.h): per 16-value sub-block (a half of
// a 32-value block, one 2-bit plane), the exact unsigned dot, corrected by
// the offset, scaled and summed as int32 over the super-block (Q2_K: its
// mins against the activations' sums beside it); then the float steps.
template <DType kType, int P, int T>
void PanelTileK16(const PackedWeight& w, int64_t p0, const QuantizedActs& a, int64_t t0, int64_t r0,
                  int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.n_blocks;
  __m512 acc[P][T];
  ZeroTile(acc);
  const TileActs<T> x(a, t0, nb);
  const auto& xq = x.xq;
  const auto& xds = x.xds;
  const auto& xbs = x.xbs;
  for (int64_t s = 0; s < nb / 8; ++s) {
    __m512i sumi[P][T];
    __m512i summ[P][T];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        sumi[p][t] = _mm512_setzero_si512();
        summ[p][t] = _mm512_setzero_si512();
      }
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512i isum[P][T];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) isum[p][t] = _mm512_setzero_si512();
        }
        __m512i plane[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) plane[p] = _mm512_load_si512(w.Qs(p0 + p, b) + 64 * half);
#pragma GCC unroll 16
        for (int g = 0; g < 4; ++g) {
          __m512i q[P];
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) q[p] = PanelK16Value<kType>(plane[p], w, p0 + p, b, half, g);
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const __m512i xv = Bcast32(xq[t] + b * kQK + 16 * half + 4 * g);
#pragma GCC unroll 16
            for (int p = 0; p < P; ++p) isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], q[p], xv);
          }
        }
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            PanelK16SubBlock<kType>(&sumi[p][t], &summ[p][t], isum[p][t], w, p0 + p, b, half,
                                    xbs[t][2 * b + half]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        acc[p][t] = PanelK16SuperEpilogue<kType>(acc[p][t], sumi[p][t], summ[p][t], w, p0 + p, s,
                                                 xds[t][2 * 8 * s]);
      }
    }
  }
  StoreTile(acc, p0, t0, r0, r1, y, y_stride);
}

template <DType kType, int P, int T>
void RunPanels(const PackedWeight& w, int64_t pb, int64_t pe, const QuantizedActs& a, int64_t t0,
               int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  int64_t p = pb;
  if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K || kType == DType::kIQ4_XS) {
    for (; p + P <= pe; p += P) PanelTileQ4K<kType, P, T>(w, p, a, t0, r0, r1, y, y_stride);
    for (; p < pe; ++p) PanelTileQ4K<kType, 1, T>(w, p, a, t0, r0, r1, y, y_stride);
  } else if constexpr (kType == DType::kQ2_K || kType == DType::kQ3_K) {
    for (; p + P <= pe; p += P) PanelTileK16<kType, P, T>(w, p, a, t0, r0, r1, y, y_stride);
    for (; p < pe; ++p) PanelTileK16<kType, 1, T>(w, p, a, t0, r0, r1, y, y_stride);
  } else if constexpr (kType == DType::kQ6_K) {
    for (; p + P <= pe; p += P) PanelTileQ6K<P, T>(w, p, a, t0, r0, r1, y, y_stride);
    for (; p < pe; ++p) PanelTileQ6K<1, T>(w, p, a, t0, r0, r1, y, y_stride);
  } else {
    for (; p + P <= pe; p += P) PanelTile<kType, P, T>(w, p, a, t0, r0, r1, y, y_stride);
    for (; p < pe; ++p) PanelTile<kType, 1, T>(w, p, a, t0, r0, r1, y, y_stride);
  }
}

// RunPanels<kType, 1, T> for the 1 to 7 tokens left after the tiles of 8.
using PanelsFn = void (*)(const PackedWeight&, int64_t, int64_t, const QuantizedActs&, int64_t,
                          int64_t, int64_t, float*, int64_t);
template <DType kType, int... T>
PanelsFn RemainderTileOf(int64_t left, std::integer_sequence<int, T...>) {
  static constexpr PanelsFn kTiles[] = {&RunPanels<kType, 1, T + 1>...};
  return kTiles[left - 1];
}
template <DType kType>
PanelsFn RemainderTile(int64_t left) {
  return RemainderTileOf<kType>(left, std::make_integer_sequence<int, 7>{});
}

template <DType kType>
void PanelsForType(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens, int64_t r0,
                   int64_t r1, float* y, int64_t y_stride) {
  const int64_t pb = r0 / kPanelRows;
  const int64_t pe = (r1 + kPanelRows - 1) / kPanelRows;
  if (n_tokens == 1) {
    RunPanels<kType, kOneTokenPanels, 1>(w, pb, pe, acts, 0, r0, r1, y, y_stride);
    return;
  }
  // One panel at a time for every token count, up to 8 tokens over it (8
  // accumulators, 8 block sums and the unpacked weights stay in the 32
  // registers): one weight stream, as for one token. Two panels x 4 tokens
  // made 2 to 4 tokens cost 2.1-2.6x what they cost this way on a Zen
  // EPYC (kvserve_kernels_bench SmolLM2DecodeMatMuls/fused/panels: 2 tokens
  // 8.1 -> 3.2 ms, 4 tokens 10.2 -> 6.2 ms, 16 and 64 the same), which is
  // what a speculative verify chunk or a small decode batch pays.
  // Panel groups that stay in L1 while all tokens pass over them.
  constexpr int64_t kGroupBytes = 24 * 1024;
  const int64_t group = std::max<int64_t>(2, kGroupBytes / w.panel_bytes);
  for (int64_t g0 = pb; g0 < pe; g0 += group) {
    const int64_t g1 = std::min(pe, g0 + group);
    int64_t t = 0;
    for (; t + 8 <= n_tokens; t += 8)
      RunPanels<kType, 1, 8>(w, g0, g1, acts, t, r0, r1, y, y_stride);
    if (t < n_tokens) RemainderTile<kType>(n_tokens - t)(w, g0, g1, acts, t, r0, r1, y, y_stride);
  }
}

}  // namespace

void MatMulPanelsVnni(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                      int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  VisitPanelType(
      w.type, [&]<DType kType>() { PanelsForType<kType>(w, acts, n_tokens, r0, r1, y, y_stride); });
}

}  // namespace kvserve::kernels::internal
