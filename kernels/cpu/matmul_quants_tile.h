// Dot-product kernels of the extended weight formats (Q5_0, Q5_1, IQ4_NL,
// Q2_K..Q6_K, IQ4_XS) on 8-bit activations, written once for two
// translation units: matmul_quants_avx2.cc (AVX2/FMA) and
// matmul_quants_avx512.cc (adds AVX-512 VNNI: vpdpbusd replaces
// maddubs + madd where no 16-element sub-scale is involved). Each includes
// this header inside its own ISA flags; everything here has internal
// linkage, so no wide instruction leaks into portable code.
//
// Activations come in 32-element blocks (QuantizedActs: q, d_a, s_a = d_a *
// sum(q)). Every format is decoded 32 elements (a "chunk") at a time into
// bytes -- unsigned (Q5_0, Q5_1, Q2_K, Q4_K, Q5_K) or signed (Q3_K, Q6_K,
// IQ4_NL, IQ4_XS; the u8 x s8 multiply then takes |w| and x carrying w's
// sign) -- and one chunk against one activation block is
//   acc += float(idot) * (cd * d_a) + cm * s_a
// with idot the exact integer dot, cd the chunk's float scale and cm its
// offset: Q5_0 cm = -16 d, Q5_1 cm = m, Q4_K/Q5_K cd = d * sc, cm = -dmin *
// m. The 16-element sub-blocks of Q2_K, Q3_K and Q6_K carry their integer
// scales in the madd multiplier (lanes 0-7 of the 16-bit pairs are elements
// 0-15, lanes 8-15 elements 16-31), so cd = d; Q2_K's mins are a second
// integer dot of the sub-block mins against the activations, scaled by
// -dmin * d_a.
//
// Ranges: |w| <= 63 (Q6_K unsigned part; signed |q - 32| <= 32), |x| <= 127,
// so maddubs pairs stay below 2^15 except IQ4 (|w| <= 127: 2 * 127 * 127 =
// 32258 < 32767); sub-scales |sc| <= 63 keep madd in int32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/matmul_internal.h"

#ifndef KVSERVE_QUANTS_VNNI
#define KVSERVE_QUANTS_VNNI 0
#endif

namespace kvserve::kernels::internal {
namespace {

constexpr int64_t kQuantsPrefetchAhead = 6144;  // as matmul_avx2.cc

inline float QHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

inline __m256i Load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 packed bytes -> 32 bytes: low nibbles (elements 0-15), high (16-31).
inline __m256i Nibbles32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Bit j of a 32-bit mask -> byte j = 0x10 or 0.
inline __m256i Bits32ToBit4(uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                        2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline __m256i Iq4Table() {
  return _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
}

// Two int16 sub-scales as the madd multiplier of a 32-element chunk.
inline __m256i Sub16Scales(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)),
                          _mm_set1_epi16(static_cast<int16_t>(lo)));
}

// ---- Formats. Each: kElems (32 or 256), kBlockBytes, kSigned, kSub16,
// kHasMin (cm != 0), kIntMin (Q2_K), and a State built from one block that
// gives Chunk(j), Cd(j), Cm(j), Sc16(j) (kSub16), Min16(j) (kIntMin).

struct FmtQ5_0 {
  static constexpr int kElems = 32;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ5_0);
  static constexpr bool kSigned = false, kSub16 = false, kHasMin = true, kIntMin = false;
  struct State {
    float d;
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk)), b(blk) {}
    __m256i Chunk(int) const {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      return _mm256_or_si256(Nibbles32(b + 6), Bits32ToBit4(qh));
    }
    float Cd(int) const { return d; }
    float Cm(int) const { return -16.0f * d; }
  };
};

struct FmtQ5_1 {
  static constexpr int kElems = 32;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ5_1);
  static constexpr bool kSigned = false, kSub16 = false, kHasMin = true, kIntMin = false;
  struct State {
    float d, m;
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk)), m(QHalf(blk + 2)), b(blk) {}
    __m256i Chunk(int) const {
      uint32_t qh;
      std::memcpy(&qh, b + 4, 4);
      return _mm256_or_si256(Nibbles32(b + 8), Bits32ToBit4(qh));
    }
    float Cd(int) const { return d; }
    float Cm(int) const { return m; }
  };
};

struct FmtIQ4_NL {
  static constexpr int kElems = 32;
  static constexpr int64_t kBlockBytes = sizeof(BlockIQ4_NL);
  static constexpr bool kSigned = true, kSub16 = false, kHasMin = false, kIntMin = false;
  struct State {
    float d;
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk)), b(blk) {}
    __m256i Chunk(int) const { return _mm256_shuffle_epi8(Iq4Table(), Nibbles32(b + 2)); }
    float Cd(int) const { return d; }
    float Cm(int) const { return 0.0f; }
  };
};

struct FmtIQ4_XS {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockIQ4_XS);
  static constexpr bool kSigned = true, kSub16 = false, kHasMin = false, kIntMin = false;
  struct State {
    float cd[8];
    const uint8_t* b;
    explicit State(const uint8_t* blk) : b(blk) {
      const auto* x = reinterpret_cast<const BlockIQ4_XS*>(blk);
      const float d = QHalf(blk);
      for (int j = 0; j < 8; ++j) {
        const int ls =
            ((x->scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((x->scales_h >> (2 * j)) & 3) << 4);
        cd[j] = d * static_cast<float>(ls - 32);
      }
    }
    __m256i Chunk(int j) const {
      return _mm256_shuffle_epi8(Iq4Table(), Nibbles32(b + 8 + 16 * j));
    }
    float Cd(int j) const { return cd[j]; }
    float Cm(int) const { return 0.0f; }
  };
};

inline void ScaleMin6(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct FmtQ4_K {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ4_K);
  static constexpr bool kSigned = false, kSub16 = false, kHasMin = true, kIntMin = false;
  struct State {
    float cd[8], cm[8];
    const uint8_t* b;
    explicit State(const uint8_t* blk) : b(blk) {
      const float d = QHalf(blk);
      const float dmin = QHalf(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc;
        int m;
        ScaleMin6(blk + 4, j, &sc, &m);
        cd[j] = d * static_cast<float>(sc);
        cm[j] = -dmin * static_cast<float>(m);
      }
    }
    __m256i Chunk(int j) const {
      const __m256i q = Load256(b + 16 + 32 * (j / 2));
      return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    }
    float Cd(int j) const { return cd[j]; }
    float Cm(int j) const { return cm[j]; }
  };
};

struct FmtQ5_K {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ5_K);
  static constexpr bool kSigned = false, kSub16 = false, kHasMin = true, kIntMin = false;
  struct State {
    float cd[8], cm[8];
    const uint8_t* b;
    explicit State(const uint8_t* blk) : b(blk) {
      const float d = QHalf(blk);
      const float dmin = QHalf(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc;
        int m;
        ScaleMin6(blk + 4, j, &sc, &m);
        cd[j] = d * static_cast<float>(sc);
        cm[j] = -dmin * static_cast<float>(m);
      }
    }
    __m256i Chunk(int j) const {
      const __m256i q = Load256(b + 48 + 32 * (j / 2));
      const __m256i lo =
          _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
      const __m256i qh = Load256(b + 16);
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
      return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    }
    float Cd(int j) const { return cd[j]; }
    float Cm(int j) const { return cm[j]; }
  };
};

struct FmtQ6_K {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ6_K);
  static constexpr bool kSigned = true, kSub16 = true, kHasMin = false, kIntMin = false;
  struct State {
    float d;
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk + 208)), b(blk) {}
    __m256i Chunk(int j) const {
      const int half = j / 4;
      const int k = j % 4;
      const __m256i ql = Load256(b + 64 * half + 32 * (k % 2));
      const __m256i lo =
          _mm256_and_si256(k / 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
      const __m256i qh = Load256(b + 128 + 32 * half);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
      return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    __m256i Sc16(int j) const {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      return Sub16Scales(sc[2 * j], sc[2 * j + 1]);
    }
    float Cd(int) const { return d; }
    float Cm(int) const { return 0.0f; }
  };
};

struct FmtQ3_K {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ3_K);
  static constexpr bool kSigned = true, kSub16 = true, kHasMin = false, kIntMin = false;
  struct State {
    float d;
    int sc[16];
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk + 108)), b(blk) {
      const uint8_t* s = blk + 96;
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
        const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (low | (high << 4)) - 32;
      }
    }
    __m256i Chunk(int j) const {
      const int half = j / 4;
      const int k = j % 4;
      const __m256i q = Load256(b + 32 + 32 * half);
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), _mm256_set1_epi8(3));
      const __m256i hm = Load256(b);
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * half + k), _mm256_set1_epi8(1));
      // lo - (hbit ? 0 : 4) = (lo | hbit << 2) - 4
      return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
    }
    __m256i Sc16(int j) const { return Sub16Scales(sc[2 * j], sc[2 * j + 1]); }
    float Cd(int) const { return d; }
    float Cm(int) const { return 0.0f; }
  };
};

struct FmtQ2_K {
  static constexpr int kElems = 256;
  static constexpr int64_t kBlockBytes = sizeof(BlockQ2_K);
  static constexpr bool kSigned = false, kSub16 = true, kHasMin = false, kIntMin = true;
  struct State {
    float d, dmin;
    const uint8_t* b;
    explicit State(const uint8_t* blk) : d(QHalf(blk + 80)), dmin(QHalf(blk + 82)), b(blk) {}
    __m256i Chunk(int j) const {
      const __m256i q = Load256(b + 16 + 32 * (j / 4));
      return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (j % 4)), _mm256_set1_epi8(3));
    }
    __m256i Sc16(int j) const { return Sub16Scales(b[2 * j] & 0x0F, b[2 * j + 1] & 0x0F); }
    __m256i Min16(int j) const { return Sub16Scales(b[2 * j] >> 4, b[2 * j + 1] >> 4); }
    float Cd(int) const { return d; }
    float Cm(int) const { return 0.0f; }
    float MinScale() const { return -dmin; }
  };
};

// The exact integer dot of a decoded chunk and an activation block, with
// the 16-element sub-scales applied for kSub16 formats.
template <class F>
inline __m256i ChunkDot(const __m256i q, const __m256i x, const __m256i sc16) {
  __m256i wu = q;
  __m256i xs = x;
  if constexpr (F::kSigned) {
    wu = _mm256_sign_epi8(q, q);
    xs = _mm256_sign_epi8(x, q);
  }
  if constexpr (F::kSub16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), sc16);
  } else {
#if KVSERVE_QUANTS_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, xs);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), _mm256_set1_epi16(1));
#endif
  }
}

inline float QHsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows x T tokens over the whole row.
template <class F, int R, int T>
void ExtTile(const uint8_t* w, int64_t row_bytes, const QuantizedActs& a, int64_t t0, float* y,
             int64_t y_stride) {
  constexpr int kChunks = F::kElems / kQK;
  const int64_t nb = a.n_blocks;
  const int64_t n_super = nb / kChunks;
  __m256 acc[R][T];
  float macc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      macc[r][t] = 0.0f;
    }
  }
  const int8_t* xq[T];
  const float* xds[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qs + (t0 + t) * nb * kQK;
    xds[t] = a.ds + (t0 + t) * 2 * nb;
  }
  const uint8_t* pf = w + kQuantsPrefetchAhead;
  for (int64_t s = 0; s < n_super; ++s) {
    for (int64_t off = 0; off < R * F::kBlockBytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + s * R * F::kBlockBytes + off), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + s * F::kBlockBytes;
      const typename F::State st(blk);
      for (int j = 0; j < kChunks; ++j) {
        const int64_t b = s * kChunks + j;
        const __m256i q = st.Chunk(j);
        __m256i sc16 = _mm256_setzero_si256();
        if constexpr (F::kSub16) sc16 = st.Sc16(j);
        const float cd = st.Cd(j);
        for (int t = 0; t < T; ++t) {
          const __m256i x = Load256(reinterpret_cast<const uint8_t*>(xq[t] + b * kQK));
          const __m256i p = ChunkDot<F>(q, x, sc16);
          const float xd = xds[t][2 * b];
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(cd * xd), acc[r][t]);
          if constexpr (F::kHasMin) macc[r][t] += st.Cm(j) * xds[t][2 * b + 1];
          if constexpr (F::kIntMin) {
            const __m256i pm =
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), st.Min16(j));
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(st.MinScale() * xd),
                                        acc[r][t]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = QHsum(acc[r][t]) + macc[r][t];
  }
}

template <class F, int R, int T>
void ExtRows(const uint8_t* base, int64_t row_bytes, const QuantizedActs& a, int64_t t0, int64_t r0,
             int64_t r1, float* y, int64_t y_stride) {
  int64_t r = r0;
  for (; r + R <= r1; r += R)
    ExtTile<F, R, T>(base + r * row_bytes, row_bytes, a, t0, y + r, y_stride);
  for (; r < r1; ++r) ExtTile<F, 1, T>(base + r * row_bytes, row_bytes, a, t0, y + r, y_stride);
}

template <class F>
void ExtRowsForType(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens, int64_t r0,
                    int64_t r1, float* y, int64_t y_stride) {
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = w.cols / F::kElems * F::kBlockBytes;
  const uint8_t* start = base + r0 * row_bytes;
  const int64_t lead = std::min(kQuantsPrefetchAhead, (r1 - r0) * row_bytes);
  for (int64_t off = 0; off < lead; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(start + off), _MM_HINT_T0);
  }
  if (n_tokens == 1) {
    ExtRows<F, 4, 1>(base, row_bytes, acts, 0, r0, r1, y, y_stride);
    return;
  }
  // Row tiles small enough to stay in L1 while every token passes over them.
  constexpr int64_t kTileBytes = 24 * 1024;
  const int64_t tile_rows = std::max<int64_t>(4, kTileBytes / row_bytes);
  for (int64_t tr0 = r0; tr0 < r1; tr0 += tile_rows) {
    const int64_t tr1 = std::min(r1, tr0 + tile_rows);
    int64_t t = 0;
    for (; t + 4 <= n_tokens; t += 4) {
      ExtRows<F, 1, 4>(base, row_bytes, acts, t, tr0, tr1, y + t * y_stride, y_stride);
    }
    float* yt = y + t * y_stride;
    switch (n_tokens - t) {
      case 3:
        ExtRows<F, 1, 3>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      case 2:
        ExtRows<F, 2, 2>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      case 1:
        ExtRows<F, 4, 1>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      default:
        break;
    }
  }
}

void ExtDispatch(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens, int64_t r0,
                 int64_t r1, float* y, int64_t y_stride) {
  switch (w.type) {
    case DType::kQ5_0:
      return ExtRowsForType<FmtQ5_0>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ5_1:
      return ExtRowsForType<FmtQ5_1>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kIQ4_NL:
      return ExtRowsForType<FmtIQ4_NL>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kIQ4_XS:
      return ExtRowsForType<FmtIQ4_XS>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ2_K:
      return ExtRowsForType<FmtQ2_K>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ3_K:
      return ExtRowsForType<FmtQ3_K>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ4_K:
      return ExtRowsForType<FmtQ4_K>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ5_K:
      return ExtRowsForType<FmtQ5_K>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ6_K:
      return ExtRowsForType<FmtQ6_K>(w, acts, n_tokens, r0, r1, y, y_stride);
    default:
      return;
  }
}

}  // namespace
}  // namespace kvserve::kernels::internal
