// AVX2/FMA/F16C primitives for the attention loop in attention_internal.h.
// Compiled with -mavx2 -mfma -mf16c; entered only after UseAvx2().

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/kv_codec_internal.h"
#include "kernels/cpu/simd_avx2.h"

namespace kvserve::kernels::internal {
namespace {

template <typename Elem>
inline __m256 Load8(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <typename Elem>
inline float Load1(const Elem* p) {
  if constexpr (sizeof(Elem) == 4) {
    return *reinterpret_cast<const float*>(p);
  } else {
    return _cvtsh_ss(*p);
  }
}

template <typename Elem>
struct Avx2Ops {
  // J keys x H query heads per pass: each K chunk is loaded (and converted)
  // once for all H heads, the J*H accumulators are independent FMA chains,
  // and the J sums of a head are reduced together (Hsum4) instead of one
  // horizontal sum per dot product.
  // The loops over heads, rows and streams below are unrolled in full
  // (#pragma GCC unroll) so acc / o stay in registers: GCC 12 at -O2 left
  // them rolled with the arrays on the stack (kvserve_kernels_bench
  // AttentionDecode/f16/threads:1: 512 positions 74.5 -> 20.1 us, 2048
  // positions 270 -> 85 us; the same operations in the same order).
  template <int H, int J>
  static void ScoresHJ(const float* q, int32_t hd, const Elem* k, float scale, float* scores,
                       int32_t ld) {
    __m256 acc[H][J];
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      #pragma GCC unroll 16
      for (int j = 0; j < J; ++j) acc[h][j] = _mm256_setzero_ps();
    }
    int32_t i = 0;
    for (; i + 8 <= hd; i += 8) {
      #pragma GCC unroll 16
      for (int j = 0; j < J; ++j) {
        const __m256 kv = Load8(k + static_cast<int64_t>(j) * hd + i);
        #pragma GCC unroll 16
        for (int h = 0; h < H; ++h) {
          acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + i), kv, acc[h][j]);
        }
      }
    }
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      float sums[J];
      if constexpr (J == 4) {
        _mm_storeu_ps(sums, Hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
      } else {
        #pragma GCC unroll 16
        for (int j = 0; j < J; ++j) sums[j] = Hsum(acc[h][j]);
      }
      #pragma GCC unroll 16
      for (int j = 0; j < J; ++j) {
        float s = sums[j];
        for (int32_t t = i; t < hd; ++t)
          s += q[h * hd + t] * Load1(k + static_cast<int64_t>(j) * hd + t);
        scores[h * ld + j] = s * scale;
      }
    }
  }

  template <int H>
  static void ScoresH(const float* q, int32_t hd, const Elem* k_rows, int32_t n, float scale,
                      float* scores, int32_t ld) {
    // Up to 12 accumulators fit the 16 ymm registers with a K chunk beside.
    constexpr int kJ = H <= 3 ? 4 : 2;
    int32_t j = 0;
    for (; j + kJ <= n; j += kJ) {
      ScoresHJ<H, kJ>(q, hd, k_rows + static_cast<int64_t>(j) * hd, scale, scores + j, ld);
    }
    for (; j < n; ++j) {
      ScoresHJ<H, 1>(q, hd, k_rows + static_cast<int64_t>(j) * hd, scale, scores + j, ld);
    }
  }

  static void Scores(const float* q, int32_t group, int32_t hd, const Elem* k_rows, int32_t n,
                     float scale, float* scores, int32_t ld) {
    int32_t h = 0;
    for (; h + 4 <= group; h += 4)
      ScoresH<4>(q + h * hd, hd, k_rows, n, scale, scores + h * ld, ld);
    switch (group - h) {
      case 3:
        ScoresH<3>(q + h * hd, hd, k_rows, n, scale, scores + h * ld, ld);
        break;
      case 2:
        ScoresH<2>(q + h * hd, hd, k_rows, n, scale, scores + h * ld, ld);
        break;
      case 1:
        ScoresH<1>(q + h * hd, hd, k_rows, n, scale, scores + h * ld, ld);
        break;
      default:
        break;
    }
  }

  static float Max(const float* x, int32_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int32_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
    float r = Hmax(m);
    for (; j < n; ++j) r = std::fmax(r, x[j]);
    return r;
  }

  static float ExpShift(float* x, int32_t n, float shift) {
    const __m256 vs = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    int32_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + j), vs));
      _mm256_storeu_ps(x + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
      // Zero-filled lanes would contribute exp(0 - shift): mask them out.
      const int rest = n - j;
      const __m256 e = Exp(_mm256_sub_ps(LoadPartial(x + j, rest), vs));
      StorePartial(x + j, e, rest);
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, e);
      float tail = 0.0f;
      for (int t = 0; t < rest; ++t) tail += tmp[t];
      return Hsum(sum) + tail;
    }
    return Hsum(sum);
  }

  static void Scale(float* v, float c, int32_t n) {
    const __m256 vc = _mm256_set1_ps(c);
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(v + i), vc));
    for (; i < n; ++i) v[i] *= c;
  }

  // C groups of 8 channels of H heads stay in registers (H*C accumulators)
  // while the positions stream past: each V chunk is loaded (and converted)
  // once for all H heads, and each broadcast probability serves C chunks.
  // Positions in the inner loop, channels outside, reloaded the broadcasts
  // once per 8 channels and made this loop load-bound (4 loads for 3 FMAs;
  // now 2 for 3 at C = 3). One FMA chain per output element, positions in
  // order, so an element's result does not depend on how the channels are
  // split into calls or register groups (the split path relies on it).
  template <int H, int C>
  static void AccumulateVHC(float* acc, int32_t stride, const float* p, int32_t ld,
                            const Elem* v_rows, int32_t n) {
    // The call's positions (a block run) sum from zero and join acc once at
    // the end: a context of L positions costs each element about
    // run + L / run roundings at acc's magnitude, not L.
    __m256 o[H][C];
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c) o[h][c] = _mm256_setzero_ps();
    }
    for (int32_t j = 0; j < n; ++j) {
      const Elem* v_row = v_rows + static_cast<int64_t>(j) * stride;
      __m256 ph[H];
      #pragma GCC unroll 16
      for (int h = 0; h < H; ++h) ph[h] = _mm256_broadcast_ss(p + h * ld + j);
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const __m256 v = Load8(v_row + 8 * c);
        #pragma GCC unroll 16
        for (int h = 0; h < H; ++h) o[h][c] = _mm256_fmadd_ps(ph[h], v, o[h][c]);
      }
    }
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        float* a = acc + h * stride + 8 * c;
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), o[h][c]));
      }
    }
  }

  // AccumulateVHC<H, c> for a run-time c in [1, C].
  template <int H, int C>
  static void AccumulateVHUpTo(int32_t c, float* acc, int32_t stride, const float* p,
                               int32_t ld, const Elem* v_rows, int32_t n) {
    if constexpr (C > 1) {
      if (c < C) {
        AccumulateVHUpTo<H, C - 1>(c, acc, stride, p, ld, v_rows, n);
        return;
      }
    }
    AccumulateVHC<H, C>(acc, stride, p, ld, v_rows, n);
  }

  // Channels [0, width) of H heads, rows `stride` apart: whole groups of 8
  // in register blocks of at most kMaxC groups (H*C accumulators + H
  // broadcasts + one V chunk within the 16 ymm registers), then the tail
  // channels one by one.
  template <int H>
  static void AccumulateVH(float* acc, int32_t stride, int32_t width, const float* p, int32_t ld,
                           const Elem* v_rows, int32_t n) {
    constexpr int kMaxC = H == 1 ? 8 : H == 2 ? 5 : H == 3 ? 3 : 2;
    int32_t groups = width / 8;
    int32_t i = 0;
    while (groups > 0) {
      // Four groups of three heads as 2 + 2 (6 FMA chains each) rather
      // than 3 + 1 (3 chains in the second: latency-bound).
      const int32_t c = (kMaxC == 3 && groups == 4) ? 2 : std::min<int32_t>(groups, kMaxC);
      AccumulateVHUpTo<H, kMaxC>(c, acc + i, stride, p, ld, v_rows + i, n);
      groups -= c;
      i += 8 * c;
    }
    for (; i < width; ++i) {
      #pragma GCC unroll 16
      for (int h = 0; h < H; ++h) {
        float s = 0.0f;
        for (int32_t j = 0; j < n; ++j) {
          s += p[h * ld + j] * Load1(v_rows + static_cast<int64_t>(j) * stride + i);
        }
        acc[h * stride + i] += s;
      }
    }
  }

  static void AccumulateV(float* acc, int32_t group, int32_t stride, int32_t width, const float* p,
                          int32_t ld, const Elem* v_rows, int32_t n) {
    int32_t h = 0;
    for (; h + 4 <= group; h += 4) {
      AccumulateVH<4>(acc + h * stride, stride, width, p + h * ld, ld, v_rows, n);
    }
    switch (group - h) {
      case 3:
        AccumulateVH<3>(acc + h * stride, stride, width, p + h * ld, ld, v_rows, n);
        break;
      case 2:
        AccumulateVH<2>(acc + h * stride, stride, width, p + h * ld, ld, v_rows, n);
        break;
      case 1:
        AccumulateVH<1>(acc + h * stride, stride, width, p + h * ld, ld, v_rows, n);
        break;
      default:
        break;
    }
  }

  // F16C rounds exactly as Fp32ToFp16 (nearest even, overflow to inf) for
  // every non-NaN input; a group of 8 holding a NaN takes the scalar
  // conversion, whose NaN bits (payload dropped, quiet) F16C does not match.
  static void RoundF16x8(__m256 x, float* dst) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, x);
      for (int t = 0; t < 8; ++t) dst[t] = Fp16ToFp32(Fp32ToFp16(tmp[t]));
      return;
    }
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)));
  }

  static void RoundF16(const float* x, float* dst, int32_t n) {
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) RoundF16x8(_mm256_loadu_ps(x + i), dst + i);
    for (; i < n; ++i) dst[i] = Fp16ToFp32(Fp32ToFp16(x[i]));
  }

  static void ScaleRoundF16(float* x, int32_t n, float c) {
    const __m256 vc = _mm256_set1_ps(c);
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) RoundF16x8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vc), x + i);
    for (; i < n; ++i) x[i] = Fp16ToFp32(Fp32ToFp16(x[i] * c));
  }
};

// Sixteen packed bytes -> 32 codes in channel order (low nibble = even
// channel), as four vectors of 8 floats.
inline void UnpackInt4x32(const uint8_t* data, __m256 out[4]) {
  const __m128i low_mask = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data));
  const __m128i lo = _mm_and_si128(bytes, low_mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
  const __m128i c0 = _mm_unpacklo_epi8(lo, hi);  // channels 0..15
  const __m128i c1 = _mm_unpackhi_epi8(lo, hi);  // channels 16..31
  const __m128i parts[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
  for (int q = 0; q < 4; ++q) out[q] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[q]));
}

// a * b + c rounded twice, as the plain loops compute it: this unit is
// compiled with -mfma, and GCC would otherwise fuse the two into one FMA
// (one rounding), an ulp away from the plain loop. The empty asm hides the
// product from the optimizer.
inline __m256 MulAddUnfused(__m256 a, __m256 b, __m256 c) {
  __m256 p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return _mm256_add_ps(p, c);
}

// int4 rows: 32 channels at a time with SIMD (a group of 64 is two steps
// with one scale), a short last group with the plain loop.
void DequantizeInt4Avx2(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n,
                        float* dst) {
  const int32_t group = KvInt4GroupOf(t);
  int32_t g0 = 0;
  for (; g0 + group <= n; g0 += group) {
    const uint8_t* group_meta = meta + 4 * (g0 / group);  // f16 scale, f16 min
    uint16_t s16, m16;
    std::memcpy(&s16, group_meta, sizeof(s16));
    std::memcpy(&m16, group_meta + 2, sizeof(m16));
    const __m256 scale = _mm256_set1_ps(Fp16ToFp32(s16));
    const __m256 mn = _mm256_set1_ps(Fp16ToFp32(m16));
    for (int32_t c0 = g0; c0 < g0 + group; c0 += 32) {
      __m256 codes[4];
      UnpackInt4x32(data + c0 / 2, codes);
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_ps(dst + c0 + 8 * q, MulAddUnfused(codes[q], scale, mn));
      }
    }
  }
  if (g0 < n) {
    DequantizeRow(t, data + g0 / 2, meta + 4 * (g0 / group), n - g0, dst + g0);
  }
}

struct Avx2RowDecoder {
  static void Row(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n, float* dst) {
    DequantizeRowAvx2(t, data, meta, n, dst);
  }
  static void KiviKeyRow(const uint8_t* codes, const float* scale, const float* offset, int32_t n,
                         float* dst) {
    DequantizeKiviKeyRowAvx2(codes, scale, offset, n, dst);
  }
};

}  // namespace

void DequantizeKiviKeyRowAvx2(const uint8_t* codes, const float* scale, const float* offset,
                              int32_t n, float* dst) {
  int32_t c0 = 0;
  for (; c0 + 32 <= n; c0 += 32) {
    __m256 q[4];
    UnpackInt4x32(codes + c0 / 2, q);
    for (int i = 0; i < 4; ++i) {
      const int32_t c = c0 + 8 * i;
      _mm256_storeu_ps(
          dst + c, MulAddUnfused(q[i], _mm256_loadu_ps(scale + c), _mm256_loadu_ps(offset + c)));
    }
  }
  if (c0 < n) DequantizeKiviKeyRow(codes + c0 / 2, scale + c0, offset + c0, n - c0, dst + c0);
}

namespace {

// f16 rows with F16C. Widening is exact for every f16 but a signalling NaN
// (F16C quiets it; the plain loop keeps its bits), and narrowing matches
// Fp32ToFp16 for every non-NaN input: a group of 8 holding a NaN takes the
// plain conversion either way.
void F16ToF32RowAvx2(const uint8_t* data, int32_t n, float* dst) {
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 2 * i));
    const __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    if (_mm_movemask_epi8(_mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00))) != 0) {
      DequantizeRow(KvDType::kF16, data + 2 * i, nullptr, 8, dst + i);
      continue;
    }
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  if (i < n) DequantizeRow(KvDType::kF16, data + 2 * i, nullptr, n - i, dst + i);
}

void F32ToF16RowAvx2(const float* src, int32_t n, uint8_t* data) {
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      QuantizeRow(KvDType::kF16, src + i, 8, data + 2 * i, nullptr);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + 2 * i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  if (i < n) QuantizeRow(KvDType::kF16, src + i, n - i, data + 2 * i, nullptr);
}

// The largest |x| of a row, NaNs skipped as the plain loop's std::max skips
// them (max_ps returns its second operand when either is NaN).
float AbsMaxAvx2(const float* x, int32_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
  float r = Hmax(m);
  for (; i < n; ++i) r = std::max(r, std::fabs(x[i]));
  return r;
}

// x + 2^23 - 2^23: round to the nearest integer, ties to even, for x in [0, 2^22).
inline __m256 RoundSmall(__m256 x) {
  const __m256 k = _mm256_set1_ps(8388608.0f);
  return _mm256_sub_ps(_mm256_add_ps(x, k), k);
}

// The low byte of each of v's eight lanes, to out[0..7].
inline void StoreLowBytes(__m256i v, uint8_t* out) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  for (int t = 0; t < 8; ++t) out[t] = static_cast<uint8_t>(lanes[t]);
}

// Eight fp8 codes of x * inv, as the plain encoder (kv_codec.cc,
// Fp8Format::Encode) computes them, lane by lane.
struct Fp8Params {
  int man_bits, bias, max_code;
  float max_value, min_normal, subnormal_scale;
};
constexpr Fp8Params kE4M3Params{3, 7, 0x7e, kE4M3Max, 0x1p-6f, 0x1p9f};
constexpr Fp8Params kE5M2Params{2, 15, 0x7b, kE5M2Max, 0x1p-14f, 0x1p16f};

void EncodeFp8x8(const Fp8Params& f, __m256 x, uint8_t* out) {
  const __m256i xi = _mm256_castps_si256(x);
  const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(xi, _mm256_set1_epi32(0x7fffffff)));
  const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(xi, _mm256_set1_epi32(INT32_MIN)), 24);
  const __m256i ex =
      _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 23), _mm256_set1_epi32(127));
  // 2^(man_bits - ex); garbage in lanes that take another branch below.
  const __m256 p = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(f.man_bits + 127), ex), 23));
  const __m256i mant = _mm256_cvttps_epi32(RoundSmall(_mm256_mul_ps(a, p)));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_add_epi32(
          _mm256_slli_epi32(_mm256_add_epi32(ex, _mm256_set1_epi32(f.bias)), f.man_bits), mant),
      _mm256_set1_epi32(1 << f.man_bits));
  const __m256i sub =
      _mm256_cvttps_epi32(RoundSmall(_mm256_mul_ps(a, _mm256_set1_ps(f.subnormal_scale))));
  const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(f.min_normal), _CMP_LT_OQ);
  const __m256 is_sat = _mm256_cmp_ps(a, _mm256_set1_ps(f.max_value), _CMP_GE_OQ);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256i code = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), is_sub));
  code = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(code), _mm256_castsi256_ps(_mm256_set1_epi32(f.max_code)), is_sat));
  code = _mm256_or_si256(code, sign);
  code = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(code), _mm256_castsi256_ps(_mm256_set1_epi32(0x7f)), is_nan));
  StoreLowBytes(code, out);
}

// Eight codes (int32 lanes, 0..15) of channels c..c+7 -> the 4 bytes they
// pack into (low nibble = even channel).
inline void StoreNibbles8(__m256i codes, uint8_t* out) {
  // Each 64-bit lane holds an even code (low half) and an odd one (high).
  const __m256i packed = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), packed);
  for (int t = 0; t < 4; ++t) out[t] = static_cast<uint8_t>(lanes[t]);
}

// nearbyint(x) - zero_point clamped to [0, 15], as int32 lanes (NaN lanes
// give 0): the int4 rows' codes (zero_point 0) and int4-kivi keys' (KiviCode).
inline __m256i Code4(__m256 x, __m256 zero_point) {
  __m256 q = _mm256_sub_ps(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                           zero_point);
  q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
  return _mm256_cvtps_epi32(q);
}

// Lane-wise min and max of one group's values, in the plain loop's
// operand order (std::min(lo, x) keeps lo unless x < lo). The result is
// the plain loop's only where the order of comparisons cannot matter: no
// NaN and no zero extreme (+0 and -0 compare equal); false otherwise.
inline bool GroupRange(const float* x, int32_t n, float* lo, float* hi) {
  __m256 vlo = _mm256_loadu_ps(x), vhi = vlo;
  __m256 nan = _mm256_cmp_ps(vlo, vlo, _CMP_UNORD_Q);
  for (int32_t i = 8; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vlo = _mm256_min_ps(v, vlo);
    vhi = _mm256_max_ps(v, vhi);
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  *lo = -Hmax(_mm256_sub_ps(_mm256_setzero_ps(), vlo));
  *hi = Hmax(vhi);
  return *lo != 0.0f && *hi != 0.0f;
}

// int4 rows (QuantizeInt4 in kv_codec.cc): per group the f16 minimum and
// scale, the codes round((x - min) / scale) against the rounded values.
// Whole groups of a multiple of 8 channels only; any other row, and a row
// with a NaN or a zero extreme, takes the plain loop.
bool QuantizeInt4Avx2(KvDType t, const float* src, int32_t n, uint8_t* data, uint8_t* meta) {
  const int32_t group = KvInt4GroupOf(t);
  if (group % 8 != 0 || n % group != 0) return false;
  constexpr int32_t kMaxGroups = 64;
  float lo[kMaxGroups], hi[kMaxGroups];
  const int32_t groups = n / group;
  if (groups > kMaxGroups) return false;
  for (int32_t g = 0; g < groups; ++g) {
    if (!GroupRange(src + g * group, group, &lo[g], &hi[g])) return false;
  }
  for (int32_t g = 0; g < groups; ++g) {
    const int32_t g0 = g * group;
    const float min_h = Fp16ToFp32(Fp32ToFp16(lo[g]));
    const float scale_h = Fp16ToFp32(Fp32ToFp16((hi[g] - min_h) / 15.0f));
    const float inv = scale_h > 0.0f ? 1.0f / scale_h : 0.0f;
    const uint16_t s16 = Fp32ToFp16(scale_h), m16 = Fp32ToFp16(min_h);
    std::memcpy(meta + 4 * g, &s16, sizeof(s16));
    std::memcpy(meta + 4 * g + 2, &m16, sizeof(m16));
    const __m256 vmin = _mm256_set1_ps(min_h), vinv = _mm256_set1_ps(inv);
    for (int32_t i = 0; i < group; i += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(src + g0 + i), vmin), vinv);
      StoreNibbles8(Code4(x, _mm256_setzero_ps()), data + (g0 + i) / 2);
    }
  }
  return true;
}

}  // namespace

void QuantizeRowAvx2(KvDType t, const float* src, int32_t n, uint8_t* data, uint8_t* meta) {
  if (t == KvDType::kF16) {
    F32ToF16RowAvx2(src, n, data);
    return;
  }
  if (t == KvDType::kInt4 || t == KvDType::kInt4G64 || t == KvDType::kInt4Kivi ||
      t == KvDType::kInt4KiviG64) {
    if (!QuantizeInt4Avx2(t, src, n, data, meta)) QuantizeRow(t, src, n, data, meta);
    return;
  }
  const bool int8 = t == KvDType::kInt8;
  if (!int8 && t != KvDType::kFp8E4M3 && t != KvDType::kFp8E5M2) {
    QuantizeRow(t, src, n, data, meta);
    return;
  }
  // Scale and inverse exactly as the plain loop computes them.
  const float amax = AbsMaxAvx2(src, n);
  const Fp8Params& f = t == KvDType::kFp8E5M2 ? kE5M2Params : kE4M3Params;
  const float scale = int8 ? amax / 127.0f : (amax > 0.0f ? amax / f.max_value : 0.0f);
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  std::memcpy(meta, &scale, sizeof(scale));
  const __m256 vinv = _mm256_set1_ps(inv);
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + i), vinv);
    if (int8) {
      // nearbyint, then clamp to +-127 (NaN lanes: the plain loop's
      // clamp(NaN) is NaN and its cast undefined; rows are finite).
      __m256 q = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
      StoreLowBytes(_mm256_cvtps_epi32(q), data + i);  // two's complement int8
    } else {
      EncodeFp8x8(f, x, data + i);
    }
  }
  for (; i < n; ++i) {
    const float x = src[i] * inv;
    if (int8) {
      const float q = std::clamp(std::nearbyint(x), -127.0f, 127.0f);
      data[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    } else {
      data[i] = t == KvDType::kFp8E5M2 ? Fp32ToE5M2(x) : Fp32ToE4M3(x);
    }
  }
}

void AppendKiviKeysAvx2(const float* src, int64_t src_stride, int32_t n, int32_t first_slot,
                        int32_t head_dim, uint8_t* codes, uint8_t* meta) {
  if (first_slot != 0 || n < 1 || head_dim % 8 != 0) {
    AppendKiviKeys(src, src_stride, n, first_slot, head_dim, codes, meta);
    return;
  }
  const int64_t row_bytes = KvRowBytes(KvDType::kInt4Kivi, head_dim);
  std::memset(codes, 0, static_cast<size_t>(row_bytes * n));  // as the plain loop clears them
  const float* steps = KiviStepTable();
  for (int32_t c0 = 0; c0 < head_dim; c0 += 8) {
    // Per channel, min and max over the rows in the plain loop's order
    // (row by row, each lane one channel), so the result is its own.
    __m256 lo = _mm256_loadu_ps(src + c0), hi = lo;
    for (int32_t j = 1; j < n; ++j) {
      const __m256 v = _mm256_loadu_ps(src + j * src_stride + c0);
      lo = _mm256_min_ps(v, lo);
      hi = _mm256_max_ps(v, hi);
    }
    alignas(32) float lo8[8], hi8[8], s8[8], z8[8];
    _mm256_store_ps(lo8, lo);
    _mm256_store_ps(hi8, hi);
    for (int i = 0; i < 8; ++i) {
      uint8_t* m = meta + kKiviKeyMetaBytes * (c0 + i);
      int8_t z;
      ChooseKiviParams(lo8[i], hi8[i], &m[0], &z);
      m[1] = static_cast<uint8_t>(z);
      s8[i] = steps[m[0]];
      z8[i] = static_cast<float>(z);
    }
    const __m256 s = _mm256_load_ps(s8), zf = _mm256_load_ps(z8);
    for (int32_t j = 0; j < n; ++j) {
      // KiviCode: nearbyint(x / s) - z, clamped to [0, 15].
      const __m256 x = _mm256_loadu_ps(src + j * src_stride + c0);
      StoreNibbles8(Code4(_mm256_div_ps(x, s), zf), codes + j * row_bytes + c0 / 2);
    }
  }
}

void DequantizeRowAvx2(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n,
                       float* dst) {
  if (KvIsInt4Rows(t)) {
    DequantizeInt4Avx2(t, data, meta, n, dst);
    return;
  }
  if (t == KvDType::kF16) {
    F16ToF32RowAvx2(data, n, dst);
    return;
  }
  if (t == KvDType::kBF16) {
    // bf16 is the top half of an f32: widening is a shift, exact for every
    // input, NaNs included, as Bf16ToFp32.
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 2 * i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    for (; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, data + 2 * i, sizeof(b));
      dst[i] = Bf16ToFp32(b);
    }
    return;
  }
  const bool int8 = t == KvDType::kInt8;
  if (!int8 && t != KvDType::kFp8E4M3 && t != KvDType::kFp8E5M2) {
    DequantizeRow(t, data, meta, n, dst);
    return;
  }
  float scale;
  std::memcpy(&scale, meta, sizeof(scale));
  const bool e4m3 = t == KvDType::kFp8E4M3;
  // fp8 widens to f16 bits and converts with F16C, exactly (f16 subnormals
  // become normal f32, no denormal stalls): e5m2 is the top byte of an f16;
  // e4m3 placed in f16's fields reads as 2^-8 of its value, so its scale
  // carries the 2^8 (a power of two: the product rounds once, as the plain
  // loop's table[c] * scale does). Only the NaN code 0x7f differs, which the
  // encoder never writes for finite input.
  const __m256 vs = _mm256_set1_ps(e4m3 ? scale * 256.0f : scale);
  const float* table = int8 ? nullptr : Fp8DecodeTable(t);
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int64_t raw;
    std::memcpy(&raw, data + i, sizeof(raw));
    const __m128i bytes = _mm_cvtsi64_si128(raw);
    __m256 x;
    if (int8) {
      x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else {
      const __m128i w = _mm_cvtepu8_epi16(bytes);
      __m128i h;
      if (e4m3) {
        h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                         _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
      } else {
        h = _mm_slli_epi16(w, 8);
      }
      x = _mm256_cvtph_ps(h);
    }
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, vs));
  }
  for (; i < n; ++i) {
    dst[i] = (int8 ? static_cast<float>(static_cast<int8_t>(data[i])) : table[data[i]]) * scale;
  }
}

void AttendAvx2(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                float scale, AttnState st, float* scores, float* rows) {
  if (KvIsQuantized(kv.dtype)) {
    AttendRangeQuant<Avx2Ops<float>, Avx2RowDecoder>(kv, layer, item, group, scale, st, scores,
                                                     rows);
  } else if (kv.dtype == KvDType::kF32) {
    AttendRange<Avx2Ops<float>, float>(kv, layer, item, group, scale, st, scores);
  } else {
    AttendRange<Avx2Ops<uint16_t>, uint16_t>(kv, layer, item, group, scale, st, scores);
  }
}

void AttendTwoPassF16Avx2(const PagedKvView& kv, int32_t layer, const AttnItem& item,
                          int32_t group, float scale, float* scores, int32_t ld, float* q16,
                          float* out) {
  AttendTwoPassF16<Avx2Ops<uint16_t>>(kv, layer, item, group, scale, scores, ld, q16, out);
}

const F16Kernels& F16KernelsAvx2() {
  static constexpr F16Kernels kKernels = MakeF16Kernels<Avx2Ops<uint16_t>>();
  return kKernels;
}

}  // namespace kvserve::kernels::internal
