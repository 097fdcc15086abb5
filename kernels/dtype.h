// Element and block formats the kernels compute on. Kernels know formats,
// not files: model/ maps GGUF tensor types onto these.
#pragma once

#include <cstdint>

namespace kvserve::kernels {

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1 };

const char* DTypeName(DType t);
// Elements per block: 1 for float types, 32 for Q8_0/Q4_0/Q4_1.
int64_t BlockElems(DType t);
// Bytes per block: 4/2/2 for float types, 34 (Q8_0), 18 (Q4_0), 20 (Q4_1).
int64_t BlockBytes(DType t);
// Bytes of a row of n elements. REQUIRES: n % BlockElems(t) == 0.
inline int64_t RowBytes(DType t, int64_t n) { return n / BlockElems(t) * BlockBytes(t); }

// ggml block layouts (bit-exact with GGUF files).
constexpr int kQK = 32;
struct BlockQ8_0 {
  uint16_t d;  // fp16 scale
  int8_t qs[kQK];
};
struct BlockQ4_0 {
  uint16_t d;           // fp16 scale; value = (q - 8) * d
  uint8_t qs[kQK / 2];  // element j in low nibble of qs[j], j+16 in high nibble
};
struct BlockQ4_1 {
  uint16_t d;  // fp16 scale; value = q * d + m
  uint16_t m;  // fp16 min
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);

}  // namespace kvserve::kernels
