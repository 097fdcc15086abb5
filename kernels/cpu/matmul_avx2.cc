// AVX2/FMA/F16C matmul kernels. This translation unit is compiled with
// -mavx2 -mfma -mf16c and is entered only after UseAvx2() said yes, so
// everything here stays in an anonymous namespace (no inline function of a
// shared header is emitted from here with AVX2 code in it).
//
// Quantized weights: activations were quantized once per call to 8-bit
// blocks (matmul_internal.h); a block dot product is maddubs (u8 x s8 ->
// s16 pairs) + madd (-> s32) + one float FMA with the product of the scales.
// 4-bit weights are used unsigned (0..15): the -8 of Q4_0 and the min of
// Q4_1 both become `min * sum(x)`, one scalar FMA per block, which is cheaper
// than the sign juggling a signed nibble would need.

#include <immintrin.h>

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

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Through fp16 and back, round-to-nearest-even as ggml's F16C conversion.
inline float RoundToHalf(float v) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT)));
}

inline float LoadHalf(const void* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// Decode streams the weights once from DRAM. An R-row tile reads R short
// interleaved streams (a 576-column Q4_1 row is under six cache lines), too
// short for the hardware prefetcher to lock on, so the tile prefetches the
// bytes a few tiles ahead, moving linearly at the rate it consumes them.
// 6 KiB ahead measured best on Zen 5 (3-8 KiB within noise); it more than
// halved single-thread decode time of the SmolLM2 matmuls.
constexpr int64_t kPrefetchAhead = 6144;
template <int64_t kBytesPerStep>
inline void PrefetchStep(const uint8_t* p) {
  for (int64_t off = 0; off < kBytesPerStep; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
  }
}

// Unpacks the 16 bytes of a 4-bit block into 32 unsigned bytes in element
// order: low nibbles are elements 0..15, high nibbles 16..31.
inline __m256i UnpackNibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// R weight rows x T tokens of 4-bit weights. Q4_1 when kHasMin, else Q4_0.
// Small R x T tiles keep all accumulators in registers: R = 4, T = 1 gives
// decode four independent FMA chains; T = 4 shares one nibble unpack across
// four tokens for prefill.
template <bool kHasMin, int R, int T>
void Q4Tile(const uint8_t* w, int64_t row_bytes, const QuantizedActs& a, int64_t t0, float* y,
            int64_t y_stride) {
  constexpr int64_t kBlockBytes = kHasMin ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
  constexpr int64_t kQsOffset = kHasMin ? 4 : 2;
  const int64_t nb = a.n_blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  float mins[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      mins[r][t] = 0.0f;
    }
  }
  const int8_t* xq[T];
  const float* xds[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qs + (t0 + t) * nb * kQK;
    xds[t] = a.ds + (t0 + t) * 2 * nb;
  }
  const uint8_t* pf = w + kPrefetchAhead;
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchStep<R * kBlockBytes>(pf + b * R * kBlockBytes);
    __m256i xv[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + b * kQK));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
      float d;
      float m;
      if constexpr (kHasMin) {
        // d and m are adjacent halves: convert both with one instruction.
        int32_t dm_bits;
        std::memcpy(&dm_bits, blk, sizeof(dm_bits));
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
        d = _mm_cvtss_f32(dm);
        m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      } else {
        d = LoadHalf(blk);
        m = -8.0f * d;
      }
      const __m256i q = UnpackNibbles(blk + kQsOffset);
      for (int t = 0; t < T; ++t) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv[t]), ones);
        const __m256 scale = _mm256_set1_ps(d * xds[t][2 * b]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][t]);
        mins[r][t] += m * xds[t][2 * b + 1];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = HorizontalSum(acc[r][t]) + mins[r][t];
  }
}

// Q8_0 weights: maddubs needs one unsigned operand, so multiply |w| by x
// carrying w's sign (|w| <= 128 and |x| <= 127 keep the pair sums in s16).
template <int R, int T>
void Q8Tile(const uint8_t* w, int64_t row_bytes, const QuantizedActs& a, int64_t t0, float* y,
            int64_t y_stride) {
  const int64_t nb = a.n_blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const int8_t* xq[T];
  const float* xds[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qs + (t0 + t) * nb * kQK;
    xds[t] = a.ds + (t0 + t) * 2 * nb;
  }
  const uint8_t* pf = w + kPrefetchAhead;
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchStep<R * 34>(pf + b * R * 34);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * static_cast<int64_t>(sizeof(BlockQ8_0));
      const float d = LoadHalf(blk);
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i wabs = _mm256_sign_epi8(wq, wq);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + b * kQK));
        const __m256i p =
            _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wq)), ones);
        const __m256 scale = _mm256_set1_ps(d * xds[t][2 * b]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = HorizontalSum(acc[r][t]);
  }
}

template <DType kType>
inline __m256 Load8(const uint8_t* row, int64_t i) {
  if constexpr (kType == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (kType == DType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  } else {
    // bf16 is the top half of an f32: widen and shift into place.
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <DType kType>
inline float Load1(const uint8_t* row, int64_t i) {
  if constexpr (kType == DType::kF32) {
    float v;
    std::memcpy(&v, row + 4 * i, sizeof(v));
    return v;
  } else if constexpr (kType == DType::kF16) {
    return LoadHalf(row + 2 * i);
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, sizeof(h));
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
}

template <DType kType, int R, int T>
void FloatTile(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t x_stride,
               int64_t t0, float* y, int64_t y_stride) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const float* xt[T];
  for (int t = 0; t < T; ++t) xt[t] = x + (t0 + t) * x_stride;
  const int64_t cols8 = cols & ~int64_t{7};
  constexpr int64_t kElemBytes = kType == DType::kF32 ? 4 : 2;
  const uint8_t* pf = w + kPrefetchAhead;
  for (int64_t i = 0; i < cols8; i += 8) {
    PrefetchStep<R * 8 * kElemBytes>(pf + i * R * kElemBytes);
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(xt[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = Load8<kType>(w + r * row_bytes, i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float sum = HorizontalSum(acc[r][t]);
      for (int64_t i = cols8; i < cols; ++i) sum += Load1<kType>(w + r * row_bytes, i) * xt[t][i];
      y[t * y_stride + r] = sum;
    }
  }
}

// Tile signature shared by all weight types so one driver does the blocking.
struct TileArgs {
  const uint8_t* w;  // first row of the tile
  int64_t row_bytes;
  int64_t cols;
  const float* x;
  int64_t x_stride;
  const QuantizedActs* acts;
  int64_t t0;
  float* y;  // y + r (first row of the tile); token t at y + t * y_stride
  int64_t y_stride;
};

template <DType kType, int R, int T>
void RunTile(const TileArgs& a) {
  if constexpr (kType == DType::kQ4_0) {
    Q4Tile<false, R, T>(a.w, a.row_bytes, *a.acts, a.t0, a.y, a.y_stride);
  } else if constexpr (kType == DType::kQ4_1) {
    Q4Tile<true, R, T>(a.w, a.row_bytes, *a.acts, a.t0, a.y, a.y_stride);
  } else if constexpr (kType == DType::kQ8_0) {
    Q8Tile<R, T>(a.w, a.row_bytes, *a.acts, a.t0, a.y, a.y_stride);
  } else {
    FloatTile<kType, R, T>(a.w, a.row_bytes, a.cols, a.x, a.x_stride, a.t0, a.y, a.y_stride);
  }
}

// Rows [r0, r1) of tokens [t0, t0 + T) in groups of R rows.
template <DType kType, int R, int T>
void RunRows(TileArgs a, int64_t r0, int64_t r1) {
  const uint8_t* base = a.w;
  float* ybase = a.y;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    a.w = base + r * a.row_bytes;
    a.y = ybase + r;
    RunTile<kType, R, T>(a);
  }
  for (; r < r1; ++r) {
    a.w = base + r * a.row_bytes;
    a.y = ybase + r;
    RunTile<kType, 1, T>(a);
  }
}

template <DType kType>
void RowsForType(const WeightView& w, const float* x, int64_t x_stride, const QuantizedActs& acts,
                 int64_t n_tokens, int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  TileArgs a{static_cast<const uint8_t*>(w.data),
             RowBytesOf<kType>(w.cols),
             w.cols,
             x,
             x_stride,
             &acts,
             0,
             y,
             y_stride};
  // The tiles prefetch ahead of themselves; start the stream for the first
  // kPrefetchAhead bytes of this thread's rows here.
  const uint8_t* start = a.w + r0 * a.row_bytes;
  const int64_t lead = std::min(kPrefetchAhead, (r1 - r0) * a.row_bytes);
  for (int64_t off = 0; off < lead; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(start + off), _MM_HINT_T0);
  }
  if (n_tokens == 1) {
    RunRows<kType, 4, 1>(a, r0, r1);
    return;
  }
  // Several tokens: walk the thread's rows in tiles small enough to stay in
  // L1 while every token passes over them, so weights come from memory once.
  constexpr int64_t kTileBytes = 24 * 1024;
  const int64_t tile_rows = std::max<int64_t>(4, kTileBytes / a.row_bytes);
  for (int64_t tr0 = r0; tr0 < r1; tr0 += tile_rows) {
    const int64_t tr1 = std::min(r1, tr0 + tile_rows);
    int64_t t = 0;
    for (; t + 4 <= n_tokens; t += 4) {
      a.t0 = t;
      a.y = y + t * y_stride;
      if constexpr (IsQuantized(kType)) {
        RunRows<kType, 1, 4>(a, tr0, tr1);
      } else {
        RunRows<kType, 2, 4>(a, tr0, tr1);
      }
    }
    a.t0 = t;
    a.y = y + t * y_stride;
    switch (n_tokens - t) {
      case 3:
        RunRows<kType, 1, 3>(a, tr0, tr1);
        break;
      case 2:
        RunRows<kType, 2, 2>(a, tr0, tr1);
        break;
      case 1:
        RunRows<kType, 4, 1>(a, tr0, tr1);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void QuantizeActsAvx2(const float* x, int64_t n, ActSum sum_mode, int8_t* qs, float* ds,
                      int32_t* sums) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* xb = x + b * kQK;
    __m256 v0 = _mm256_loadu_ps(xb);
    __m256 v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16);
    __m256 v3 = _mm256_loadu_ps(xb + 24);
    __m256 amax = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign_mask, v0), _mm256_andnot_ps(sign_mask, v1)),
        _mm256_max_ps(_mm256_andnot_ps(sign_mask, v2), _mm256_andnot_ps(sign_mask, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float max_abs = _mm_cvtss_f32(m4);
    const float scale = max_abs / 127.0f;
    const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), kRound));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), kRound));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), kRound));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), kRound));
    // Sum of the 32 quantized values, for the offset term of 4-bit weights.
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    // Packing works per 128-bit lane; the final permute restores order.
    const __m256i p16a = _mm256_packs_epi32(i0, i1);
    const __m256i p16b = _mm256_packs_epi32(i2, i3);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * kQK), p8);
    if (sums != nullptr) sums[b] = _mm_cvtsi128_si32(s4);
    const float sum = static_cast<float>(_mm_cvtsi128_si32(s4));
    const float d16 = RoundToHalf(scale);
    ds[2 * b] = d16;
    ds[2 * b + 1] = sum_mode == ActSum::kQ8_1 ? RoundToHalf(scale * sum) : d16 * sum;
  }
}

void QuantizeActsQ8KAvx2(const float* x, int64_t n, int8_t* qs, float* ds, int16_t* bsums) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t sb = 0; sb < n / kQK_K; ++sb) {
    const float* xb = x + sb * kQK_K;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < kQK_K / 8; ++i) {
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(xb + 8 * i)));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float max_abs = _mm_cvtss_f32(m4);
    // As the scalar quantizer: iscale = 127 / amax, d = 1 / iscale, both float.
    const float iscale = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
    const float d = max_abs > 0.0f ? 1.0f / iscale : 0.0f;
    const __m256 vis = _mm256_set1_ps(iscale);
    for (int c = 0; c < kQK_K / kQK; ++c) {
      const float* xc = xb + c * kQK;
      __m256i i[4];
      for (int k = 0; k < 4; ++k) {
        i[k] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xc + 8 * k), vis), kRound));
      }
      // Sums of values 0-15 and 16-31 of the chunk.
      const __m256i s01 = _mm256_add_epi32(i[0], i[1]);
      const __m256i s23 = _mm256_add_epi32(i[2], i[3]);
      __m256i h = _mm256_hadd_epi32(s01, s23);  // lanes: a0+a1 a2+a3 b0+b1 b2+b3 | a4.. b4..
      h = _mm256_hadd_epi32(h, h);              // a0123 b0123 a0123 b0123 | a4567 b4567 ..
      const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      const int lo = _mm_cvtsi128_si32(s);
      const int hi = _mm_extract_epi32(s, 1);
      const __m256i p16a = _mm256_packs_epi32(i[0], i[1]);
      const __m256i p16b = _mm256_packs_epi32(i[2], i[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + sb * kQK_K + c * kQK), p8);
      bsums[sb * 16 + 2 * c] = static_cast<int16_t>(lo);
      bsums[sb * 16 + 2 * c + 1] = static_cast<int16_t>(hi);
      const int64_t b = sb * (kQK_K / kQK) + c;
      ds[2 * b] = d;
      ds[2 * b + 1] = d * static_cast<float>(lo + hi);
    }
  }
}

void MatMulRowsAvx2(const WeightView& w, const float* x, int64_t x_stride,
                    const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1, float* y,
                    int64_t y_stride) {
  switch (w.type) {
    case DType::kF32:
      return RowsForType<DType::kF32>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kF16:
      return RowsForType<DType::kF16>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kBF16:
      return RowsForType<DType::kBF16>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ8_0:
      return RowsForType<DType::kQ8_0>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ4_0:
      return RowsForType<DType::kQ4_0>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    case DType::kQ4_1:
      return RowsForType<DType::kQ4_1>(w, x, x_stride, acts, n_tokens, r0, r1, y, y_stride);
    default:
      break;  // extended types: MatMulRowsExtendedAvx2
  }
}

}  // namespace kvserve::kernels::internal
