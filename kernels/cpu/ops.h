// Element-wise and normalization kernels of the Llama forward. Each has a
// plain-loop *Reference twin used by tests.
#pragma once

#include <cstdint>

namespace kvserve::kernels {

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, for n_rows rows of n.
// out may alias x.
void RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps, float* out);
void RmsNormReference(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                      float* out);

// Rotary position embedding, in place, over one token's heads.
// kNorm: rotate adjacent pairs (x[2i], x[2i+1]) -- GGUF "llama" layout.
// kNeox: rotate (x[i], x[i + rot_dim/2]) -- GPT-NeoX / HF layout.
// Only the first rot_dim dimensions of each head rotate.
enum class RopeStyle : uint8_t { kNorm, kNeox };
struct RopeParams {
  int32_t head_dim;
  int32_t rot_dim;
  float freq_base;
  RopeStyle style;
  // Optional rot_dim/2 divisors of the pair frequencies (Llama 3's rope
  // scaling, GGUF tensor rope_freqs.weight): angle_i = pos * base^(-2i/rot_dim)
  // / freq_factors[i], as ggml applies them. Null: all 1.
  const float* freq_factors = nullptr;
};
void Rope(float* x, int32_t n_heads, int32_t pos, const RopeParams& p);
void RopeReference(float* x, int32_t n_heads, int32_t pos, const RopeParams& p);

// out[i] = silu(gate[i]) * up[i]. out may alias gate.
void SiluMul(const float* gate, const float* up, int64_t n, float* out);
void SiluMulReference(const float* gate, const float* up, int64_t n, float* out);

// out[i] = gelu(gate[i]) * up[i] with GELU's tanh approximation
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (Gemma's GEGLU), computed
// as ggml's CPU backend does (so logits follow llama.cpp's): g rounded to
// f16, the GELU rounded to f16, g <= -10 -> 0, g >= 10 -> g. The reference
// evaluates the formula per element; the kernel looks it up in a table of
// every f16 input. out may alias gate.
void GeluTanhMul(const float* gate, const float* up, int64_t n, float* out);
void GeluTanhMulReference(const float* gate, const float* up, int64_t n, float* out);

// x[i] += y[i].
void AddInPlace(float* x, const float* y, int64_t n);

// In-place softmax over n values; returns log(sum(exp(x - max))) + max, the
// log-normalizer (useful for log-probabilities).
float SoftmaxInPlace(float* x, int64_t n);

// Greedy decoding's argmax: the lowest index of the largest of x[0, n) with
// the plain loop's rule (best = x[0]; x[i] replaces it only when strictly
// greater, so NaN never wins and a NaN x[0] keeps index 0). n >= 1.
int64_t ArgMax(const float* x, int64_t n);
int64_t ArgMaxReference(const float* x, int64_t n);

}  // namespace kvserve::kernels
