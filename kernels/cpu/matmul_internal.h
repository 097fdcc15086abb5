// Internals shared by the portable and the AVX2 matmul translation units.
// Not part of the kernels' public contract: only kernels/cpu/*.cc and the
// kernel tests include this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/matmul.h"

namespace kvserve::kernels::internal {

// Activations quantized once per MatMul call: 8-bit values per 32-element
// block with a float scale, plus d * sum(qs) per block so that a weight
// format with an offset (Q4_1's min, Q4_0's implicit -8) costs one
// multiply-add per block instead of a second integer dot product -- the role
// of ggml's Q8_1. Values of one token are contiguous so a wide load can span
// several blocks; (d, s) pairs are interleaved so one 128-bit load brings
// both for two blocks, next to the weights' interleaved (d, m).
struct QuantizedActs {
  int64_t n_blocks = 0;        // blocks per token
  const int8_t* qs = nullptr;  // token t: qs + t * n_blocks * kQK
  const float* ds = nullptr;   // token t: ds + t * 2 * n_blocks; block b: d, s
  // Exact sum(qs) per block (token t: sums + t * n_blocks), for the panel
  // kernels' signed Q8_0/Q4_0 block dots; null where no panel kernel runs.
  const int32_t* sums = nullptr;
  // Q8_K-style activations only (QuantizeActsQ8K*): the int16 sum of each
  // 16 values, 16 per 256-value super-block (token t: bsums + t * n_blocks
  // * 2). Null for the 32-value blocks above.
  const int16_t* bsums = nullptr;
};

// Quantizes n floats (n % kQK == 0) of one token: qs[n], ds[2 * n / kQK].
//
// Rounded like ggml's AVX2 quantize_row_q8_0/q8_1 so the engine's logits
// track llama.cpp's (the greedy tests compare token by token): q =
// round-half-even(x * 127 / amax), d stored through fp16. The sum term
// depends on the weight format:
//   kExact: s = d * sum(q) with the fp16-rounded d, what the offset tricks
//     for Q4_0 and Q8_0 need to cancel exactly (ggml uses no sum there).
//   kQ8_1: s = fp16(d * sum(q)) with the unrounded d, ggml's Q8_1 value,
//     whose `m * s` is Q4_1's min term.
enum class ActSum : uint8_t { kExact, kQ8_1 };
// sums, when not null, gets the exact sum(q) of each block.
void QuantizeActsScalar(const float* x, int64_t n, ActSum sum_mode, int8_t* qs, float* ds,
                        int32_t* sums = nullptr);
void QuantizeActsAvx2(const float* x, int64_t n, ActSum sum_mode, int8_t* qs, float* ds,
                      int32_t* sums = nullptr);

// The weight formats whose llama.cpp dot product runs on Q8_K activations
// (ggml-cpu's type traits: vec_dot_type GGML_TYPE_Q8_K): the K-quants and
// IQ4_XS. Every other quantized format meets 32-value blocks (Q8_0 / Q8_1).
constexpr bool UsesQ8K(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K ||
         t == DType::kQ6_K || t == DType::kIQ4_XS;
}

// Quantizes n floats (n % 256 == 0) of one token as ggml's Q8_K does
// (quantize_row_q8_K_ref): one scale per 256 values, q = round-half-even(x *
// iscale) with iscale = 127 / amax in float, and d = 1 / iscale kept in float
// (no fp16 rounding). ggml takes iscale = -127 / (the signed value of largest
// magnitude) and d = 1 / iscale, which negates q and d together when that
// value is positive; d * q, and so every dot product, is bit-identical.
// The output uses the QuantizedActs layout so the extended kernels read it as
// they read 32-value blocks: qs[n]; ds[2 * n / 32] with, per 32 values, the
// super-block's d and d * sum(q of those 32); bsums[n / 16] = sum(q) per 16.
void QuantizeActsQ8KScalar(const float* x, int64_t n, int8_t* qs, float* ds, int16_t* bsums);
void QuantizeActsQ8KAvx2(const float* x, int64_t n, int8_t* qs, float* ds, int16_t* bsums);

// Computes y[t][r] for rows [r0, r1) and all n_tokens tokens. Quantized weight
// types read `acts`; float weight types read x directly.
void MatMulRowsScalar(const WeightView& w, const float* x, int64_t x_stride,
                      const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1, float* y,
                      int64_t y_stride);
void MatMulRowsAvx2(const WeightView& w, const float* x, int64_t x_stride,
                    const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1, float* y,
                    int64_t y_stride);
// Quantized types only; float types forward to MatMulRowsAvx2.
void MatMulRowsAvx512Vnni(const WeightView& w, const float* x, int64_t x_stride,
                          const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1,
                          float* y, int64_t y_stride);

// Weight types whose products run on quantized activations (every type but
// the float ones).
// Asks for transparent huge pages over the 2 MB-aligned interior of
// [data, data + bytes) before its first touch (the weight panels, the
// PanelArena's chunks, the read-bandwidth probe); a no-op off Linux.
void AdviseHugePages(void* data, size_t bytes);

constexpr bool IsQuantized(DType t) {
  return t != DType::kF32 && t != DType::kF16 && t != DType::kBF16;
}
// The types with their own row kernels (matmul_avx2/avx512) besides the
// 16-row panels; PackWeight also packs most extended types (CanPackPanels).
constexpr bool IsPanelType(DType t) {
  return t == DType::kQ8_0 || t == DType::kQ4_0 || t == DType::kQ4_1;
}
// Q5_0, Q5_1, IQ4_NL and the 256-element formats (quants.cc and the
// matmul_quants_* kernels).
constexpr bool IsExtendedType(DType t) { return IsQuantized(t) && !IsPanelType(t); }
// The types PackWeight packs into 16-row panels (VNNI panels, AMX): Q5_0's
// values are 5-bit integers with one scale, like Q4_0's 4-bit ones, so its
// panels are Q4_0's plus a bit plane (matmul_panels.h). Unpacked, Q5_0
// stays an extended type.
// Q4_K's 32-value sub-blocks are Q4_1 blocks with a scale d * sc and a
// min -dmin * m, so its panels are Q4_1's with those computed per block.
// Q6_K's 16-value sub-blocks are signed 6-bit integers with an int8 scale.
// Q5_1 is Q5_0's bits with Q4_1's scale and min; IQ4_NL is Q4_0's nibbles
// mapped through its 16-entry table (one byte shuffle); IQ4_XS is IQ4_NL's
// values in Q4_K's super-blocks, a signed scale per 32 values. Q2_K and
// Q3_K are Q6_K's 16-value sub-blocks with 2- and 3-bit values (Q2_K: and a
// min per sub-block, as Q4_K's per 32).
constexpr bool CanPackPanels(DType t) {
  return IsPanelType(t) || t == DType::kQ5_0 || t == DType::kQ5_1 || t == DType::kIQ4_NL ||
         t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K ||
         t == DType::kQ6_K || t == DType::kIQ4_XS;
}
// The packed types whose scales come per 16 values, finer than an AMX
// tile's 32-value sums: the VNNI panel kernel serves them at every batch
// size (the AMX entry points hand them to it).
constexpr bool PanelScalesPer16(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ6_K;
}
// The 6-bit value q (0..63; the weight is d * sc[e / 16] * (q - 32)) of
// element e (0..255) of a Q6_K super-block, as ggml lays them out.
inline int Q6KValue(const BlockQ6_K& b, int e) {
  const int half = e / 128;
  const int r = e % 128;
  const int l = r % 32;
  const int quarter = r / 32;  // 0..3: ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high
  const uint8_t ql = b.ql[64 * half + l + 32 * (quarter % 2)];
  const int low = quarter < 2 ? ql & 0x0F : ql >> 4;
  const int high = (b.qh[32 * half + l] >> (2 * quarter)) & 3;
  return low | (high << 4);
}

// Reference dequantizer of an extended type (quants.cc); false for others.
bool DequantizeRowExtended(DType type, const void* src, float* dst, int64_t n);

// The 6-bit scale and min of sub-block j (0..7) of Q4_K/Q5_K.
inline void KQuantScaleMin(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// The 6-bit scale (offset by 32) of sub-block j (0..7) of IQ4_XS.
inline int IQ4XSScale(const BlockIQ4_XS& b, int j) {
  return ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((b.scales_h >> (2 * j)) & 3) << 4);
}

// Portable version: on Q8_K activations (acts.bsums set; UsesQ8K types),
// the plain-loop reference of llama.cpp's Q8_K dot (MatMulRowsQ8KReference);
// Q5_0 / Q5_1 / IQ4_NL: MatMulRowsBlock32Reference; a UsesQ8K type on
// 32-value blocks: dequantized weights with float sums per block (what the
// CUDA kernels compute for every extended type, as llama.cpp's CUDA backend
// quantizes all activations to 32-value Q8_1 blocks).
void MatMulRowsExtendedScalar(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                              int64_t r0, int64_t r1, float* y, int64_t y_stride);
// The plain-loop reference of a UsesQ8K format against Q8_K activations,
// computed as llama.cpp's generic vec_dot_*_q8_K is: per super-block the
// exact integer sums isum = sum_i sc_i * sum(q_w * q_a) over the 16-value
// sub-blocks i and msum = sum_i m_i * bsums_i, then d_a * d * isum -
// d_a * dmin * msum in float (quants.cc).
void MatMulRowsQ8KReference(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride);
// The plain-loop form of ggml's Q5_0 / Q5_1 / IQ4_NL dots on 32-value
// activation blocks: per block the exact integer sum of the weights'
// integers (Q5_0: q - 16, Q5_1: q, IQ4_NL: the table value) times the
// activations' q, then isum * (d * d_a) plus, for Q5_1, m * s_a (s_a as
// QuantizeActs* wrote it: ggml's Q8_1 s in kQ8_1 mode).
void MatMulRowsBlock32Reference(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                                int64_t r0, int64_t r1, float* y, int64_t y_stride);
// One super-block of a UsesQ8K format as integers: value i = d * sc[i / 16] *
// q[i] - dmin * mn[i / 16] (exactly what the dequantizer computes, up to
// float rounding). False for other types.
struct KSuperBlockInts {
  int8_t q[256];
  int sc[16];
  int mn[16];
  float d;
  float dmin;
};
bool DecodeKSuperBlock(DType type, const void* block, KSuperBlockInts* out);

// Extended types on quantized activations: rows [r0, r1), every token
// (matmul_quants_avx2.cc / matmul_quants_avx512.cc).
void MatMulRowsExtendedAvx2(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride);
void MatMulRowsExtendedVnni(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride);

}  // namespace kvserve::kernels::internal
