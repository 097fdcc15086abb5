// AVX2/FMA/F16C primitives for the attention loop in attention_internal.h.
// Compiled with -mavx2 -mfma -mf16c; entered only after UseAvx2().

#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/attention_internal.h"
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
  template <int H, int J>
  static void ScoresHJ(const float* q, int32_t hd, const Elem* k, float scale, float* scores,
                       int32_t ld) {
    __m256 acc[H][J];
    for (int h = 0; h < H; ++h) {
      for (int j = 0; j < J; ++j) acc[h][j] = _mm256_setzero_ps();
    }
    int32_t i = 0;
    for (; i + 8 <= hd; i += 8) {
      for (int j = 0; j < J; ++j) {
        const __m256 kv = Load8(k + static_cast<int64_t>(j) * hd + i);
        for (int h = 0; h < H; ++h) {
          acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + i), kv, acc[h][j]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      float sums[J];
      if constexpr (J == 4) {
        _mm_storeu_ps(sums, Hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
      } else {
        for (int j = 0; j < J; ++j) sums[j] = Hsum(acc[h][j]);
      }
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

  // Each V chunk is loaded (and converted) once for all H heads. S position
  // streams per head give S*H independent FMA chains: with 4-cycle FMA
  // latency, two streams of three heads left the FMA units a quarter idle.
  template <int H>
  static void AccumulateVH(float* acc, int32_t hd, const float* p, int32_t ld, const Elem* v_rows,
                           int32_t n) {
    constexpr int S = H <= 3 ? 4 : 2;
    int32_t i = 0;
    for (; i + 8 <= hd; i += 8) {
      __m256 o[S][H];
      for (int h = 0; h < H; ++h) {
        o[0][h] = _mm256_loadu_ps(acc + h * hd + i);
        for (int st = 1; st < S; ++st) o[st][h] = _mm256_setzero_ps();
      }
      int32_t j = 0;
      for (; j + S <= n; j += S) {
        for (int st = 0; st < S; ++st) {
          const __m256 v = Load8(v_rows + static_cast<int64_t>(j + st) * hd + i);
          for (int h = 0; h < H; ++h) {
            o[st][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * ld + j + st), v, o[st][h]);
          }
        }
      }
      for (; j < n; ++j) {
        const __m256 v = Load8(v_rows + static_cast<int64_t>(j) * hd + i);
        for (int h = 0; h < H; ++h) {
          o[0][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * ld + j), v, o[0][h]);
        }
      }
      for (int h = 0; h < H; ++h) {
        __m256 sum = o[0][h];
        for (int st = 1; st < S; ++st) sum = _mm256_add_ps(sum, o[st][h]);
        _mm256_storeu_ps(acc + h * hd + i, sum);
      }
    }
    for (; i < hd; ++i) {
      for (int h = 0; h < H; ++h) {
        float s = acc[h * hd + i];
        for (int32_t j = 0; j < n; ++j) {
          s += p[h * ld + j] * Load1(v_rows + static_cast<int64_t>(j) * hd + i);
        }
        acc[h * hd + i] = s;
      }
    }
  }

  static void AccumulateV(float* acc, int32_t group, int32_t hd, const float* p, int32_t ld,
                          const Elem* v_rows, int32_t n) {
    int32_t h = 0;
    for (; h + 4 <= group; h += 4) AccumulateVH<4>(acc + h * hd, hd, p + h * ld, ld, v_rows, n);
    switch (group - h) {
      case 3:
        AccumulateVH<3>(acc + h * hd, hd, p + h * ld, ld, v_rows, n);
        break;
      case 2:
        AccumulateVH<2>(acc + h * hd, hd, p + h * ld, ld, v_rows, n);
        break;
      case 1:
        AccumulateVH<1>(acc + h * hd, hd, p + h * ld, ld, v_rows, n);
        break;
      default:
        break;
    }
  }
};

}  // namespace

void AttendAvx2(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                float scale, AttnState st, float* scores) {
  if (kv.dtype == KvDType::kF32) {
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

}  // namespace kvserve::kernels::internal
