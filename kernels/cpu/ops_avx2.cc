// AVX2/FMA element-wise kernels; compiled with -mavx2 -mfma -mf16c and only
// called after UseAvx2().

#include <immintrin.h>

#include <climits>
#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_internal.h"
#include "kernels/cpu/simd_avx2.h"

namespace kvserve::kernels::internal {

namespace {

// Sums of squares of R rows of n floats, each as RmsNorm's plain loop forms
// it (squares in float, added in double in element order): R independent
// chains that the FP adders overlap, where one row alone waits on each
// add's latency. Bit for bit the one-row loop.
template <int R>
inline void SumSquaresRows(const float* x, int64_t n, double* ss) {
  double s[R];
  for (int r = 0; r < R; ++r) s[r] = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < R; ++r) {
      const float v = x[r * n + i];
      s[r] += static_cast<double>(v * v);
    }
  }
  for (int r = 0; r < R; ++r) ss[r] = s[r];
}

}  // namespace

void RmsNormAvx2(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                 float* out) {
  constexpr int64_t kRows = 4;
  for (int64_t row0 = 0; row0 < n_rows; row0 += kRows) {
    const int64_t rows = n_rows - row0 < kRows ? n_rows - row0 : kRows;
    // Squares in float, summed in double in order, then 1/sqrtf of the float
    // mean: ggml's arithmetic, so a model's logits match llama.cpp's (the sum
    // is 2 flops per element; the row is read again below anyway).
    double ss[kRows];
    const float* xb = x + row0 * n;
    switch (rows) {
      case 4:
        SumSquaresRows<4>(xb, n, ss);
        break;
      case 3:
        SumSquaresRows<3>(xb, n, ss);
        break;
      case 2:
        SumSquaresRows<2>(xb, n, ss);
        break;
      default:
        SumSquaresRows<1>(xb, n, ss);
        break;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xb + r * n;
      float* o = out + (row0 + r) * n;
      const float mean = static_cast<float>(ss[r] / static_cast<double>(n));
      const float inv = 1.0f / std::sqrt(mean + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
      }
      for (; i < n; ++i) o[i] = xr[i] * inv * weight[i];
    }
  }
}

void RotateHeadsAvx2(float* x, int32_t n_heads, int32_t head_dim, const float* cs,
                     const float* sn, int32_t half, bool neox) {
  for (int32_t h = 0; h < n_heads; ++h) {
    float* hd = x + static_cast<int64_t>(h) * head_dim;
    int32_t i = 0;
    if (neox) {
      float* lo = hd;
      float* hi = hd + half;
      for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(lo + i);
        const __m256 b = _mm256_loadu_ps(hi + i);
        const __m256 c = _mm256_loadu_ps(cs + i);
        const __m256 s = _mm256_loadu_ps(sn + i);
        // fma(a, c, -(b s)) and fma(a, s, b c): the portable loop's roundings.
        _mm256_storeu_ps(lo + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
        _mm256_storeu_ps(hi + i, _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c)));
      }
      for (; i < half; ++i) {
        const float a = lo[i];
        const float b = hi[i];
        lo[i] = std::fma(a, cs[i], -(b * sn[i]));
        hi[i] = std::fma(a, sn[i], b * cs[i]);
      }
    } else {
      // Pairs (2i, 2i + 1): v = [a0 b0 a1 b1 ...], w = v with each pair
      // swapped, cos/sin doubled per pair; even lanes take fma(a, c, -(b s)),
      // odd lanes fma(a, s, b c).
      for (; i + 4 <= half; i += 4) {
        const __m256 v = _mm256_loadu_ps(hd + 2 * i);
        const __m256 w = _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1));
        const __m128 c4 = _mm_loadu_ps(cs + i);
        const __m128 s4 = _mm_loadu_ps(sn + i);
        const __m256 c = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
        const __m256 s = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
        const __m256 even = _mm256_fmsub_ps(v, c, _mm256_mul_ps(w, s));
        const __m256 odd = _mm256_fmadd_ps(w, s, _mm256_mul_ps(v, c));
        _mm256_storeu_ps(hd + 2 * i, _mm256_blend_ps(even, odd, 0xAA));
      }
      for (; i < half; ++i) {
        const float a = hd[2 * i];
        const float b = hd[2 * i + 1];
        hd[2 * i] = std::fma(a, cs[i], -(b * sn[i]));
        hd[2 * i + 1] = std::fma(a, sn[i], b * cs[i]);
      }
    }
  }
}

void GeluTanhMulAvx2(const float* table, const float* gate, const float* up, int64_t n,
                     float* out) {
  const __m256 lo = _mm256_set1_ps(-10.0f);
  const __m256 hi = _mm256_set1_ps(10.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
    __m256 gelu = _mm256_i32gather_ps(table, h, 4);
    gelu = _mm256_blendv_ps(gelu, g, _mm256_cmp_ps(g, hi, _CMP_GE_OQ));
    gelu = _mm256_blendv_ps(gelu, _mm256_setzero_ps(), _mm256_cmp_ps(g, lo, _CMP_LE_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    const float gelu = g <= -10.0f   ? 0.0f
                       : g >= 10.0f ? g
                                    : table[_cvtss_sh(g, _MM_FROUND_TO_NEAREST_INT)];
    out[i] = gelu * up[i];
  }
}

void SiluMulAvx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 neg = _mm256_set1_ps(-0.0f);
  auto eight = [&](const float* g8, const float* u8, float* o8) {
    const __m256 g = _mm256_loadu_ps(g8);
    const __m256 e = Exp(_mm256_xor_ps(g, neg));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(o8, _mm256_mul_ps(silu, _mm256_loadu_ps(u8)));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) eight(gate + i, up + i, out + i);
  // The tail goes through the same vector arithmetic, padded: each output
  // is a function of its own inputs alone, never of where it sits. Callers
  // pass a whole batch flattened (n_tokens * ffn_dim), so a scalar tail
  // made a token's activations depend on the batch's size whenever ffn_dim
  // is not a multiple of 8 (stories260K: 172), and a seeded sample could
  // change with the company its request kept.
  if (i < n) {
    alignas(32) float g8[8] = {}, u8[8] = {}, o8[8];
    const int64_t rest = n - i;
    for (int64_t j = 0; j < rest; ++j) {
      g8[j] = gate[i + j];
      u8[j] = up[i + j];
    }
    eight(g8, u8, o8);
    for (int64_t j = 0; j < rest; ++j) out[i + j] = o8[j];
  }
}

void AddInPlaceAvx2(float* x, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) x[i] += y[i];
}

float SoftmaxInPlaceAvx2(float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  float mx = Hmax(vmax);
  for (; i < n; ++i) mx = std::fmax(mx, x[i]);
  if (std::isinf(mx) && mx < 0) {
    // All -inf: no value carries mass. Fall back to uniform, a defined result.
    for (i = 0; i < n; ++i) x[i] = 1.0f / static_cast<float>(n);
    return mx;
  }
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmx));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = Hsum(vsum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const __m256 vinv = _mm256_set1_ps(1.0f / sum);
  i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
  const float inv = 1.0f / sum;
  for (; i < n; ++i) x[i] *= inv;
  return std::log(sum) + mx;
}

int64_t ArgMaxAvx2(const float* x, int64_t n) {
  // A NaN first value wins by the plain loop's rule (nothing compares
  // greater), and short rows are not worth the vectors.
  if (n < 64 || std::isnan(x[0]) || n > INT32_MAX) return ArgMaxReference(x, n);
  // Eight lanes, each the first index of its largest value (strict '>', so
  // NaN never enters and the earliest of equal values stays), from -inf.
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_i = _mm256_set1_epi32(INT32_MAX);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    best_i = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_i), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), best_i);
  float value = -INFINITY;
  int64_t at = INT32_MAX;
  for (int l = 0; l < 8; ++l) {
    if (bv[l] > value || (bv[l] == value && bi[l] < at)) {
      value = bv[l];
      at = bi[l];
    }
  }
  for (; i < n; ++i) {
    if (x[i] > value) {
      value = x[i];
      at = i;
    }
  }
  // Nothing above -inf: x[0] (not NaN) is -inf, and the plain loop keeps 0.
  return at == INT32_MAX ? 0 : at;
}

}  // namespace kvserve::kernels::internal
