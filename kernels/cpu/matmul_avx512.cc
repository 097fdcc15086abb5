// AVX-512 VNNI kernels for the quantized weight types. Compiled with
// -mavx512f/bw/vl/vnni (plus the AVX2 flags) and entered only after
// UseAvx512Vnni(); float weight types stay on the AVX2 kernels.
//
// Why a second path: on cores with full-width 512-bit units (Zen 5, Intel
// server parts) one vpdpbusd does the u8 x s8 dot product of two 32-element
// blocks that takes four AVX2 instructions (maddubs + madd, twice), and the
// fp16 scales of two blocks convert in one instruction. Prefill becomes about
// twice as fast and decode leaves more headroom to memory bandwidth.
//
// Same algorithm as matmul_avx2.cc: weights unsigned (Q4 nibbles as 0..15,
// Q8_0 offset by +128), every format's offset folded into `min * sum(x)`
// with min = Q4_1's m, -8 d (Q4_0) or -128 d (Q8_0).

#include <immintrin.h>

#include <cmath>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/matmul_internal.h"

namespace kvserve::kernels::internal {
namespace {

// Row size computed here rather than by dtype.h's inline RowBytes: an
// out-of-line copy of a shared inline function emitted from this TU could
// be picked by the linker for portable code and carry wide instructions.
template <DType kType>
constexpr int64_t RowBytesOf(int64_t cols) {
  switch (kType) {
    case DType::kF32:
      return cols * 4;
    case DType::kF16:
    case DType::kBF16:
      return cols * 2;
    case DType::kQ8_0:
      return cols / kQK * static_cast<int64_t>(sizeof(BlockQ8_0));
    case DType::kQ4_0:
      return cols / kQK * static_cast<int64_t>(sizeof(BlockQ4_0));
    case DType::kQ4_1:
      return cols / kQK * static_cast<int64_t>(sizeof(BlockQ4_1));
    default:
      break;
  }
  return 0;
}

constexpr int64_t kPrefetchAhead = 6144;  // see matmul_avx2.cc

template <int64_t kBytes>
inline void PrefetchStep(const uint8_t* p) {
  for (int64_t off = 0; off < kBytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
  }
}

inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline uint32_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Horizontal sum. Avoids _mm512_reduce_add_ps, whose GCC 12 expansion trips
// -Wuninitialized inside the intrinsic headers.
inline float ReduceAdd(__m512 v) {
  const __m512 folded = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m256 h = _mm512_castps512_ps256(folded);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <DType kType>
struct Format;

// Each format gives: the block size, (d, min) of blocks b and b + 1 as
// [d0, m0, d1, m1] (Scales2), and their 64 unsigned weight bytes in element
// order (Weights2). The *1 variants handle an odd last block with zeros in
// the upper half.
template <>
struct Format<DType::kQ4_1> {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ4_1);
  static __m128 Scales2(const uint8_t* b0) {
    const __m128i bits =
        _mm_insert_epi32(_mm_cvtsi32_si128(Load32(b0)), Load32(b0 + kBlockBytes), 1);
    return _mm_cvtph_ps(bits);
  }
  static __m128 Scales1(const uint8_t* b0) { return _mm_cvtph_ps(_mm_cvtsi32_si128(Load32(b0))); }
  static __m512i Weights2(const uint8_t* b0) { return Nibbles2(b0 + 4, b0 + kBlockBytes + 4); }
  static __m512i Weights1(const uint8_t* b0) { return Nibbles1(b0 + 4); }

  // [lo0 | hi0 | lo1 | hi1] from the 16 packed bytes of two blocks.
  static __m512i Nibbles2(const uint8_t* q0, const uint8_t* q1) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)), 2);
    const __m512i hi = _mm512_srli_epi16(v, 4);
    const __m512i idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    return _mm512_and_si512(_mm512_permutex2var_epi64(v, idx, hi), _mm512_set1_epi8(0x0F));
  }
  static __m512i Nibbles1(const uint8_t* q0) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0));
    const __m256i both =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    return _mm512_zextsi256_si512(both);
  }
};

template <>
struct Format<DType::kQ4_0> {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ4_0);
  static __m128 Scales2(const uint8_t* b0) {
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(Load16(b0) | (Load16(b0 + kBlockBytes) << 16)));
    return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.0f, -8.0f, 1.0f, -8.0f));
  }
  static __m128 Scales1(const uint8_t* b0) {
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(Load16(b0)));
    return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f));
  }
  static __m512i Weights2(const uint8_t* b0) {
    return Format<DType::kQ4_1>::Nibbles2(b0 + 2, b0 + kBlockBytes + 2);
  }
  static __m512i Weights1(const uint8_t* b0) { return Format<DType::kQ4_1>::Nibbles1(b0 + 2); }
};

template <>
struct Format<DType::kQ8_0> {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ8_0);
  static __m128 Scales2(const uint8_t* b0) {
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(Load16(b0) | (Load16(b0 + kBlockBytes) << 16)));
    return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.0f, -128.0f, 1.0f, -128.0f));
  }
  static __m128 Scales1(const uint8_t* b0) {
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(Load16(b0)));
    return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.0f, -128.0f, 0.0f, 0.0f));
  }
  // s8 -> u8 by flipping the sign bit, i.e. w + 128.
  static __m512i Weights2(const uint8_t* b0) {
    __m512i v =
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2)));
    v = _mm512_inserti64x4(
        v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kBlockBytes + 2)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m512i Weights1(const uint8_t* b0) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    return _mm512_zextsi256_si512(_mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))));
  }
};

// R rows x T tokens, two blocks per step. acc lanes 0-7 carry block b and
// lanes 8-15 block b + 1, each scaled by its own d * xd; mins lanes 1 and 3
// collect m * s of the two blocks.
template <DType kType, int R, int T>
void Tile(const uint8_t* w, int64_t row_bytes, const QuantizedActs& a, int64_t t0, float* y,
          int64_t y_stride) {
  using F = Format<kType>;
  constexpr int64_t kBB = F::kBlockBytes;
  const int64_t nb = a.n_blocks;
  const __m512i scale_idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[R][T];
  __m128 mins[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm512_setzero_ps();
      mins[r][t] = _mm_setzero_ps();
    }
  }
  const int8_t* xq[T];
  const float* xds[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qs + (t0 + t) * nb * kQK;
    xds[t] = a.ds + (t0 + t) * 2 * nb;
  }
  const uint8_t* pf = w + kPrefetchAhead;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    PrefetchStep<R * 2 * kBB>(pf + b * R * kBB);
    __m512i xv[T];
    __m128 xs[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = _mm512_loadu_si512(xq[t] + b * kQK);
      xs[t] = _mm_loadu_ps(xds[t] + 2 * b);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBB;
      const __m128 dm = F::Scales2(blk);
      const __m512i wq = F::Weights2(blk);
      for (int t = 0; t < T; ++t) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xv[t]);
        const __m128 prod = _mm_mul_ps(dm, xs[t]);
        mins[r][t] = _mm_add_ps(mins[r][t], prod);
        const __m512 scale = _mm512_permutexvar_ps(scale_idx, _mm512_castps128_ps512(prod));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][t]);
      }
    }
  }
  if (b < nb) {
    // Odd block count: one block, upper halves zero (masked loads keep the
    // next token's data out).
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBB;
      const __m128 dm = F::Scales1(blk);
      const __m512i wq = F::Weights1(blk);
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq[t] + b * kQK);
        const __m128 xs = _mm_maskz_loadu_ps(0x3, xds[t] + 2 * b);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xv);
        const __m128 prod = _mm_mul_ps(dm, xs);
        mins[r][t] = _mm_add_ps(mins[r][t], prod);
        const __m512 scale = _mm512_permutexvar_ps(scale_idx, _mm512_castps128_ps512(prod));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      // Lanes 1 and 3 of mins hold the m * s sums.
      const __m128 m = _mm_movehdup_ps(mins[r][t]);
      const float min_sum = _mm_cvtss_f32(_mm_add_ss(m, _mm_movehl_ps(m, m)));
      y[t * y_stride + r] = ReduceAdd(acc[r][t]) + min_sum;
    }
  }
}

template <DType kType, int R, int T>
void RunRows(const uint8_t* w, int64_t row_bytes, const QuantizedActs& a, int64_t t0, int64_t r0,
             int64_t r1, float* y, int64_t y_stride) {
  int64_t r = r0;
  for (; r + R <= r1; r += R)
    Tile<kType, R, T>(w + r * row_bytes, row_bytes, a, t0, y + r, y_stride);
  for (; r < r1; ++r) Tile<kType, 1, T>(w + r * row_bytes, row_bytes, a, t0, y + r, y_stride);
}

template <DType kType>
void RowsForType(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens, int64_t r0,
                 int64_t r1, float* y, int64_t y_stride) {
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = RowBytesOf<kType>(w.cols);
  const uint8_t* start = base + r0 * row_bytes;
  const int64_t lead = std::min(kPrefetchAhead, (r1 - r0) * row_bytes);
  for (int64_t off = 0; off < lead; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(start + off), _MM_HINT_T0);
  }
  if (n_tokens == 1) {
    RunRows<kType, 4, 1>(base, row_bytes, acts, 0, r0, r1, y, y_stride);
    return;
  }
  // Row tiles that stay in L1 while all tokens pass over them.
  constexpr int64_t kTileBytes = 24 * 1024;
  const int64_t tile_rows = std::max<int64_t>(4, kTileBytes / row_bytes);
  for (int64_t tr0 = r0; tr0 < r1; tr0 += tile_rows) {
    const int64_t tr1 = std::min(r1, tr0 + tile_rows);
    int64_t t = 0;
    for (; t + 4 <= n_tokens; t += 4) {
      RunRows<kType, 2, 4>(base, row_bytes, acts, t, tr0, tr1, y + t * y_stride, y_stride);
    }
    float* yt = y + t * y_stride;
    switch (n_tokens - t) {
      case 3:
        RunRows<kType, 2, 3>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      case 2:
        RunRows<kType, 2, 2>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      case 1:
        RunRows<kType, 4, 1>(base, row_bytes, acts, t, tr0, tr1, yt, y_stride);
        break;
      default:
        break;
    }
  }
}

}  // namespace

namespace {

// F32 weights in the accumulation order of ggml's AVX-512 CPU kernels, so
// logits agree with llama.cpp on the same machine to the last bit and greedy
// near-ties (stories260K has one at 5e-4) break the same way:
// - cols % 16 == 0 (llamafile's tinyBLAS): one 16-lane FMA accumulator per
//   (row, token), reduced with _mm512_reduce_add_ps;
// - otherwise (ggml_vec_dot_f32): four accumulators over 64-element steps,
//   summed pairwise, reduced, then a fused multiply-add tail.
// The R x T accumulators must live in registers: GCC 12 at -O2 leaves
// these constant-trip loops rolled (accumulators spilled to memory) unless
// told to unroll; measured 2.1-2.3x on the sentence encoder, same bits.
template <int R, int T>
void F32Tile16(const float* w, int64_t cols, const float* x, int64_t x_stride, int64_t t0,
               float* y, int64_t y_stride) {
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < cols; i += 16) {
    __m512 xv[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x + (t0 + t) * x_stride + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + r * cols + i);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) y[(t0 + t) * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

float F32DotSteps64(const float* w, const float* x, int64_t cols) {
  const int64_t np = cols & ~int64_t{63};
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t i = 0; i < np; i += 64) {
    for (int j = 0; j < 4; ++j) {
      sum[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * j), _mm512_loadu_ps(w + i + 16 * j),
                               sum[j]);
    }
  }
  sum[0] = _mm512_add_ps(sum[0], sum[2]);
  sum[1] = _mm512_add_ps(sum[1], sum[3]);
  sum[0] = _mm512_add_ps(sum[0], sum[1]);
  float s = _mm512_reduce_add_ps(sum[0]);
  for (int64_t i = np; i < cols; ++i) s = std::fma(x[i], w[i], s);
  return s;
}

void F32Rows(const WeightView& w, const float* x, int64_t x_stride, int64_t n_tokens, int64_t r0,
             int64_t r1, float* y, int64_t y_stride) {
  const float* base = static_cast<const float*>(w.data);
  const int64_t cols = w.cols;
  if (cols % 16 != 0) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t t = 0; t < n_tokens; ++t) {
        y[t * y_stride + r] = F32DotSteps64(base + r * cols, x + t * x_stride, cols);
      }
    }
    return;
  }
  constexpr int kR = 4;
  constexpr int kT = 4;
  int64_t r = r0;
  for (; r + kR <= r1; r += kR) {
    int64_t t = 0;
    for (; t + kT <= n_tokens; t += kT) {
      F32Tile16<kR, kT>(base + r * cols, cols, x, x_stride, t, y + r, y_stride);
    }
    for (; t < n_tokens; ++t) F32Tile16<kR, 1>(base + r * cols, cols, x, x_stride, t, y + r, y_stride);
  }
  for (; r < r1; ++r) {
    for (int64_t t = 0; t < n_tokens; ++t) {
      F32Tile16<1, 1>(base + r * cols, cols, x, x_stride, t, y + r, y_stride);
    }
  }
}

}  // namespace

void MatMulRowsAvx512Vnni(const WeightView& w, const float* x, int64_t x_stride,
                          const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1,
                          float* y, int64_t y_stride) {
  switch (w.type) {
    case DType::kQ8_0:
      return RowsForType<DType::kQ8_0>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ4_0:
      return RowsForType<DType::kQ4_0>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ4_1:
      return RowsForType<DType::kQ4_1>(w, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kF32:
      return F32Rows(w, x, x_stride, n_tokens, r0, r1, y, y_stride);
    default:
      return MatMulRowsAvx2(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
  }
}

}  // namespace kvserve::kernels::internal
