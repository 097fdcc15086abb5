// Element and block formats the kernels compute on. Kernels know formats,
// not files: model/ maps GGUF tensor types onto these.
#pragma once

#include <cstdint>

namespace kvserve::kernels {

// The formats after kQ4_1 are ggml's 5-bit, K-quant (256-element
// super-blocks) and non-linear 4-bit formats, as GGUF files store them.
enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ8_0,
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kIQ4_NL,
  kIQ4_XS,
};

const char* DTypeName(DType t);
// Elements per block: 1 for float types, 32 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/
// IQ4_NL, 256 for the K-quants and IQ4_XS.
int64_t BlockElems(DType t);
// Bytes per block: 4/2/2 for float types, sizeof the block struct below for
// the others.
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
struct BlockQ5_0 {
  uint16_t d;           // fp16 scale; value = (q - 16) * d
  uint8_t qh[4];        // bit j (little-endian u32) is bit 4 of element j
  uint8_t qs[kQK / 2];  // low 4 bits: element j low nibble, j+16 high nibble
};
struct BlockQ5_1 {
  uint16_t d;  // fp16 scale; value = q * d + m
  uint16_t m;  // fp16 min
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
// IQ4_NL: 4-bit indices into a fixed non-linear table (kIq4nlValues).
struct BlockIQ4_NL {
  uint16_t d;  // value = d * kIq4nlValues[index]
  uint8_t qs[kQK / 2];
};
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// K-quants: 256-element super-blocks.
constexpr int kQK_K = 256;
// 16 sub-blocks of 16: value = d * (scales[i] & 15) * q - dmin * (scales[i] >> 4),
// q 2-bit; qs byte 32n + l holds elements 128n + 32k + l (k = 0..3, bits 2k).
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  uint16_t d;
  uint16_t dmin;
};
// 16 sub-blocks of 16: value = d * (s6 - 32) * (q2 - (hmask bit ? 0 : 4)).
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[12];  // 16 6-bit scales
  uint16_t d;
};
// 8 sub-blocks of 32: value = d * sc * q - dmin * m, with (sc, m) 6-bit each
// packed in `scales`; qs byte 32k + l: element 64k + l (low nibble) and
// 64k + 32 + l (high nibble).
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[kQK_K / 2];
};
// Q4_K plus a fifth bit per element in qh (bit 2k / 2k+1 of qh[l] for the
// low / high nibble of qs[32k + l]).
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
// 16 sub-blocks of 16: value = d * scales[i] * (q6 - 32).
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  uint16_t d;
};
// IQ4_NL's table with a 6-bit scale per 32 elements: value = d * (ls - 32) *
// kIq4nlValues[index].
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;  // 2 high bits of the 8 scales
  uint8_t scales_l[kQK_K / 64];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);

}  // namespace kvserve::kernels
