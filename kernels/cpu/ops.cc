#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/ops_internal.h"

namespace kvserve::kernels {
namespace {

// Angle of rotary pair i at position pos: pos * base^(-2i / rot_dim). Double
// keeps the angle exact enough at long positions (pos * 1e-7 rad in float
// would already be visible at a few thousand tokens).
double RopeAngle(int32_t pos, int32_t i, const RopeParams& p) {
  const double factor = p.freq_factors != nullptr ? p.freq_factors[i] : 1.0;
  return pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.rot_dim) / factor;
}

// Rotates one head given cos/sin per pair. kNorm pairs (2i, 2i+1); kNeox
// pairs (i, i + rot_dim/2).
void RotateHead(float* h, const float* cs, const float* sn, int32_t half, RopeStyle style) {
  if (style == RopeStyle::kNorm) {
    for (int32_t i = 0; i < half; ++i) {
      const float a = h[2 * i];
      const float b = h[2 * i + 1];
      // The fused forms ggml's compiled rotation uses: bit-equal to llama.cpp.
      h[2 * i] = std::fma(a, cs[i], -(b * sn[i]));
      h[2 * i + 1] = std::fma(a, sn[i], b * cs[i]);
    }
  } else {
    float* lo = h;
    float* hi = h + half;
    for (int32_t i = 0; i < half; ++i) {
      const float a = lo[i];
      const float b = hi[i];
      lo[i] = std::fma(a, cs[i], -(b * sn[i]));
      hi[i] = std::fma(a, sn[i], b * cs[i]);
    }
  }
}

}  // namespace

void RmsNormReference(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                      float* out) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = xr[i] * inv * weight[i];
  }
}

void RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
             float* out) {
  if (UseAvx2()) return internal::RmsNormAvx2(x, weight, n_rows, n, eps, out);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i] * xr[i]);
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = (xr[i] * inv) * weight[i];
  }
}

void RopeReference(float* x, int32_t n_heads, int32_t pos, const RopeParams& p) {
  const int32_t half = p.rot_dim / 2;
  for (int32_t h = 0; h < n_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * p.head_dim;
    for (int32_t i = 0; i < half; ++i) {
      const double theta = RopeAngle(pos, i, p);
      const double c = std::cos(theta);
      const double s = std::sin(theta);
      const int32_t i0 = p.style == RopeStyle::kNorm ? 2 * i : i;
      const int32_t i1 = p.style == RopeStyle::kNorm ? 2 * i + 1 : i + half;
      const double a = head[i0];
      const double b = head[i1];
      head[i0] = static_cast<float>(a * c - b * s);
      head[i1] = static_cast<float>(a * s + b * c);
    }
  }
}

namespace {

// cos/sin tables of recent positions. The forward rotates q and k of every
// layer at the same positions, so a small direct-mapped cache turns 60 table
// computations per token (double sin/cos: ~0.7 us each) into one.
class RopeTableCache {
 public:
  bool Matches(const RopeParams& p) const {
    return p.rot_dim / 2 == half_ && p.freq_base == base_ && p.freq_factors == factors_;
  }
  // Returns cos (first half) and sin (second half) for pos.
  const float* Get(int32_t pos, const RopeParams& p) {
    const int32_t half = p.rot_dim / 2;
    if (half != half_ || p.freq_base != base_ || p.freq_factors != factors_) {
      half_ = half;
      base_ = p.freq_base;
      factors_ = p.freq_factors;
      tables_.assign(static_cast<size_t>(kSlots) * 2 * half, 0.0f);
      std::fill(std::begin(pos_), std::end(pos_), -1);
    }
    const int slot = static_cast<int>(static_cast<uint32_t>(pos) % kSlots);
    float* t = tables_.data() + static_cast<size_t>(slot) * 2 * half;
    if (pos_[slot] != pos) {
      // ggml's float recurrence (theta *= base^(-2/rot_dim), cosf/sinf) rather
      // than the exact angle of RopeReference: it is what GGUF models are run
      // with everywhere, and it keeps our logits bit-equal to llama.cpp's.
      const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.rot_dim));
      float theta = static_cast<float>(pos);
      for (int32_t i = 0; i < half; ++i) {
        const float angle = p.freq_factors != nullptr ? theta / p.freq_factors[i] : theta;
        t[i] = std::cos(angle);
        t[half + i] = std::sin(angle);
        theta *= theta_scale;
      }
      pos_[slot] = pos;
    }
    return t;
  }

 private:
  static constexpr int kSlots = 64;
  int32_t half_ = -1;
  float base_ = 0.0f;
  const float* factors_ = nullptr;
  int32_t pos_[kSlots];
  std::vector<float> tables_;
};

}  // namespace

void Rope(float* x, int32_t n_heads, int32_t pos, const RopeParams& p) {
  // Two caches, so models whose layers alternate two RoPE bases (Gemma 3's
  // local and global layers) do not rebuild the tables at every switch.
  thread_local RopeTableCache caches[2];
  thread_local int next_victim = 0;
  RopeTableCache* cache = nullptr;
  for (RopeTableCache& c : caches) {
    if (c.Matches(p)) cache = &c;
  }
  if (cache == nullptr) {
    cache = &caches[next_victim];
    next_victim ^= 1;
  }
  const int32_t half = p.rot_dim / 2;
  const float* table = cache->Get(pos, p);
  if (UseAvx2()) {
    return internal::RotateHeadsAvx2(x, n_heads, p.head_dim, table, table + half, half,
                                     p.style == RopeStyle::kNeox);
  }
  for (int32_t h = 0; h < n_heads; ++h) {
    RotateHead(x + static_cast<int64_t>(h) * p.head_dim, table, table + half, half, p.style);
  }
}

void SiluMulReference(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

namespace {

// GELU as ggml's CPU backend computes it (GGML_GELU_FP16, what llama.cpp
// runs Gemma with): the input rounded to f16, the tanh-GELU of that value
// (in float) rounded to f16; inputs <= -10 give 0 and >= 10 pass through.
// The tanh GELU of an f16 value, rounded to f16: ggml's table entry (built
// without the cut-offs, so a gate just above -10 that rounds to -10 gets
// the formula's -0, as in ggml).
float GeluOfHalf(float x) {
  constexpr float kSqrt2OverPi = 0.79788456080286535588f;
  const float gelu = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + 0.044715f * x * x)));
  return Fp16ToFp32(Fp32ToFp16(gelu));
}

float GgmlGeluTanh(float g) {
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g;
  return GeluOfHalf(Fp16ToFp32(Fp32ToFp16(g)));
}

}  // namespace

void GeluTanhMulReference(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = GgmlGeluTanh(gate[i]) * up[i];
}

namespace internal {
const float* GeluTanhTable() {
  // Every f16 input's GELU, once (256 KiB).
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    for (uint32_t h = 0; h < (1u << 16); ++h) {
      t[h] = GeluOfHalf(Fp16ToFp32(static_cast<uint16_t>(h)));
    }
    return t;
  }();
  return table.data();
}
}  // namespace internal

void GeluTanhMul(const float* gate, const float* up, int64_t n, float* out) {
  const float* table = internal::GeluTanhTable();
  if (UseAvx2()) return internal::GeluTanhMulAvx2(table, gate, up, n, out);
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float gelu = g <= -10.0f ? 0.0f : g >= 10.0f ? g : table[Fp32ToFp16(g)];
    out[i] = gelu * up[i];
  }
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  if (UseAvx2()) return internal::SiluMulAvx2(gate, up, n, out);
  SiluMulReference(gate, up, n, out);
}

void AddInPlace(float* x, const float* y, int64_t n) {
  if (UseAvx2()) return internal::AddInPlaceAvx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

int64_t ArgMaxReference(const float* x, int64_t n) {
  int64_t best = 0;
  float best_value = x[0];
  for (int64_t i = 1; i < n; ++i) {
    if (x[i] > best_value) {
      best_value = x[i];
      best = i;
    }
  }
  return best;
}

int64_t ArgMax(const float* x, int64_t n) {
  if (UseAvx2()) return internal::ArgMaxAvx2(x, n);
  return ArgMaxReference(x, n);
}

float SoftmaxInPlace(float* x, int64_t n) {
  if (n <= 0) return -INFINITY;
  if (UseAvx2()) return internal::SoftmaxInPlaceAvx2(x, n);
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::fmax(mx, x[i]);
  if (std::isinf(mx) && mx < 0) {
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0f / static_cast<float>(n);
    return mx;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  return static_cast<float>(std::log(sum)) + mx;
}

}  // namespace kvserve::kernels
