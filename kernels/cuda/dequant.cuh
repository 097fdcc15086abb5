// Device-side dequantization of the GGUF block formats that have no integer
// kernel of their own: Q5_0, Q5_1, IQ4_NL (32-element blocks) and Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (256-element super-blocks), read straight
// from their GGUF bytes (layouts in kernels/dtype.h). Shared by the
// quantized matmul (matmul_q.cu), the weight dequantizer and the embedding
// gather (ops.cu).
//
// Each value is computed with the expression of the CPU's plain-loop
// reference (kernels::DequantizeRow, after ggml's dequantize_row_*): the
// same float operations in the same order, each a single rounding
// (__fmul_rn and friends, so nvcc contracts nothing), hence bit-identical.
// Blocks are addressed byte-wise: their sizes (22, 84, 110, 210 ... bytes)
// leave no alignment to rely on.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/dtype.h"

// The extended weight types these kernels read, once for every switch over
// them (X is applied to each DType value).
#define KVSERVE_FOR_EACH_EXT_DTYPE(X)                                                  \
  X(DType::kQ5_0) X(DType::kQ5_1) X(DType::kIQ4_NL) X(DType::kQ2_K) X(DType::kQ3_K) \
      X(DType::kQ4_K) X(DType::kQ5_K) X(DType::kQ6_K) X(DType::kIQ4_XS)

namespace kvserve::cuda::internal {

using kernels::DType;

// The extended (dequantize-then-multiply) formats.
__host__ __device__ constexpr bool IsExtendedType(DType t) {
  return t == DType::kQ5_0 || t == DType::kQ5_1 || t == DType::kIQ4_NL || t == DType::kQ2_K ||
         t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K ||
         t == DType::kIQ4_XS;
}

template <DType kType>
struct ExtFormat;
template <>
struct ExtFormat<DType::kQ5_0> {
  static constexpr int kElems = 32, kBytes = 22;
};
template <>
struct ExtFormat<DType::kQ5_1> {
  static constexpr int kElems = 32, kBytes = 24;
};
template <>
struct ExtFormat<DType::kIQ4_NL> {
  static constexpr int kElems = 32, kBytes = 18;
};
template <>
struct ExtFormat<DType::kQ2_K> {
  static constexpr int kElems = 256, kBytes = 84;
};
template <>
struct ExtFormat<DType::kQ3_K> {
  static constexpr int kElems = 256, kBytes = 110;
};
template <>
struct ExtFormat<DType::kQ4_K> {
  static constexpr int kElems = 256, kBytes = 144;
};
template <>
struct ExtFormat<DType::kQ5_K> {
  static constexpr int kElems = 256, kBytes = 176;
};
template <>
struct ExtFormat<DType::kQ6_K> {
  static constexpr int kElems = 256, kBytes = 210;
};
template <>
struct ExtFormat<DType::kIQ4_XS> {
  static constexpr int kElems = 256, kBytes = 136;
};

__device__ __forceinline__ float LoadHalf(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(p[0] | (p[1] << 8))));
}

// IQ4_NL's non-linear levels (ggml's kvalues_iq4nl), packed as two words of
// eight signed bytes so that no table lives in device memory.
__device__ __forceinline__ int Iq4nlLevel(int idx) {
  // -127, -104, -83, -65, -49, -35, -22, -10 | 1, 13, 25, 38, 53, 69, 89, 113
  constexpr uint64_t kLo = 0xF6EADDCFBFAD9881ull;
  constexpr uint64_t kHi = 0x7159453526190D01ull;
  const uint64_t w = idx < 8 ? kLo : kHi;
  return static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * (idx & 7))));
}

// Q4_K/Q5_K: the 6-bit scale and min of 32-element sub-block j (0..7).
__device__ __forceinline__ void ScaleMinK4(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Value e (0 <= e < ExtFormat<kType>::kElems) of the block at `b`.
template <DType kType>
__device__ __forceinline__ float DequantElem(const uint8_t* b, int e) {
  if constexpr (kType == DType::kQ5_0 || kType == DType::kQ5_1) {
    constexpr int qh_at = kType == DType::kQ5_0 ? 2 : 4;
    const uint8_t* qs = b + qh_at + 4;
    const uint32_t qh = static_cast<uint32_t>(b[qh_at]) | (static_cast<uint32_t>(b[qh_at + 1]) << 8) |
                        (static_cast<uint32_t>(b[qh_at + 2]) << 16) |
                        (static_cast<uint32_t>(b[qh_at + 3]) << 24);
    const int nib = e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4);
    const int q = nib | static_cast<int>(((qh >> e) & 1u) << 4);
    const float d = LoadHalf(b);
    if constexpr (kType == DType::kQ5_0) {
      return __fmul_rn(static_cast<float>(q - 16), d);
    } else {
      return __fadd_rn(__fmul_rn(static_cast<float>(q), d), LoadHalf(b + 2));
    }
  } else if constexpr (kType == DType::kIQ4_NL) {
    const uint8_t* qs = b + 2;
    const int nib = e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4);
    return __fmul_rn(LoadHalf(b), static_cast<float>(Iq4nlLevel(nib)));
  } else if constexpr (kType == DType::kQ2_K || kType == DType::kQ3_K) {
    // 128-element halves n; in each, four 32-element rows j of 2-bit fields
    // (bits 2j of qs[32n + l]); one scale per 16 elements.
    const int n = e / 128, j = (e % 128) / 32, l = e % 32;
    const int is = 8 * n + 2 * j + l / 16;
    if constexpr (kType == DType::kQ2_K) {
      const uint8_t* qs = b + 16;
      const int q = (qs[32 * n + l] >> (2 * j)) & 3;
      const int sc = b[is];
      const float dl = __fmul_rn(LoadHalf(b + 80), static_cast<float>(sc & 0x0F));
      const float ml = __fmul_rn(LoadHalf(b + 82), static_cast<float>(sc >> 4));
      return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
    } else {
      const uint8_t* hmask = b;
      const uint8_t* qs = b + 32;
      const uint8_t* s = b + 96;
      const int lo = is < 8 ? (s[is] & 0x0F) : (s[is - 8] >> 4);
      const int hi = (s[8 + is % 4] >> (2 * (is / 4))) & 3;
      const int sc = (lo | (hi << 4)) - 32;
      const int q = ((qs[32 * n + l] >> (2 * j)) & 3) - ((hmask[l] >> (4 * n + j)) & 1 ? 0 : 4);
      const float dl = __fmul_rn(LoadHalf(b + 108), static_cast<float>(sc));
      return __fmul_rn(dl, static_cast<float>(q));
    }
  } else if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
    // 32-element sub-blocks c: qs[32 (c / 2) + l], low nibble for even c.
    const int c = e / 32, l = e % 32;
    constexpr int qs_at = kType == DType::kQ4_K ? 16 : 48;
    const uint8_t byte = b[qs_at + 32 * (c / 2) + l];
    int q = (c & 1) ? (byte >> 4) : (byte & 0x0F);
    if constexpr (kType == DType::kQ5_K) q += ((b[16 + l] >> c) & 1) << 4;
    int sc, m;
    ScaleMinK4(b + 4, c, &sc, &m);
    const float d1 = __fmul_rn(LoadHalf(b), static_cast<float>(sc));
    const float m1 = __fmul_rn(LoadHalf(b + 2), static_cast<float>(m));
    return __fsub_rn(__fmul_rn(d1, static_cast<float>(q)), m1);
  } else if constexpr (kType == DType::kQ6_K) {
    // 128-element halves n; four 32-element rows k: low 4 bits from
    // ql[64n + 32 (k & 1) + l] (nibble k / 2), high 2 from qh[32n + l]
    // (bits 2k); scale per 16 elements.
    const int n = e / 128, k = (e % 128) / 32, l = e % 32;
    const int lo = (b[64 * n + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0x0F;
    const int hi = (b[128 + 32 * n + l] >> (2 * k)) & 3;
    const int q = (lo | (hi << 4)) - 32;
    const int sc = static_cast<int8_t>(b[192 + 8 * n + l / 16 + 2 * k]);
    return __fmul_rn(__fmul_rn(LoadHalf(b + 208), static_cast<float>(sc)), static_cast<float>(q));
  } else {
    static_assert(kType == DType::kIQ4_XS, "not an extended format");
    const int ib = e / 32, l = e % 32;
    const int scales_h = b[2] | (b[3] << 8);
    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
    const uint8_t* qs = b + 8 + 16 * ib;
    const int nib = l < 16 ? (qs[l] & 0x0F) : (qs[l - 16] >> 4);
    const float dl = __fmul_rn(LoadHalf(b), static_cast<float>(ls - 32));
    return __fmul_rn(dl, static_cast<float>(Iq4nlLevel(nib)));
  }
}

// Element i of a row of extended type `type` (runtime dispatch; for the
// embedding gather). Returns 0 for a type that is not extended.
__device__ __forceinline__ float DequantRowElem(DType type, const uint8_t* row, int64_t i) {
  switch (type) {
#define KVSERVE_EXT_CASE(T)                                                            \
  case T:                                                                             \
    return DequantElem<T>(row + (i / ExtFormat<T>::kElems) * ExtFormat<T>::kBytes,     \
                          static_cast<int>(i % ExtFormat<T>::kElems));
    KVSERVE_FOR_EACH_EXT_DTYPE(KVSERVE_EXT_CASE)
#undef KVSERVE_EXT_CASE
    default:
      return 0.0f;
  }
}

}  // namespace kvserve::cuda::internal
