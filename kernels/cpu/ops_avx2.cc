// AVX2/FMA element-wise kernels; compiled with -mavx2 -mfma -mf16c and only
// called after UseAvx2().

#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/ops_internal.h"
#include "kernels/cpu/simd_avx2.h"

namespace kvserve::kernels::internal {

void RmsNormAvx2(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                 float* out) {
  for (int64_t row = 0; row < n_rows; ++row) {
    const float* xr = x + row * n;
    float* o = out + row * n;
    // Squares in float, summed in double in order, then 1/sqrtf of the float
    // mean: ggml's arithmetic, so a model's logits match llama.cpp's (the sum
    // is 2 flops per element; the row is read again below anyway).
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i] * xr[i]);
    const float mean = static_cast<float>(ss / static_cast<double>(n));
    const float inv = 1.0f / std::sqrt(mean + eps);
    int64_t i = 0;
    const __m256 vinv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
    }
    for (; i < n; ++i) o[i] = xr[i] * inv * weight[i];
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

}  // namespace kvserve::kernels::internal
