// The 16-row panel layout of packed quantized weights and the one float
// expression every panel kernel (AVX-512 VNNI, AMX, AMX emulated, the scalar
// check) evaluates, so their outputs are bit-identical.
//
// Layout. Rows are grouped 16 at a time (panel p: rows 16p..16p+15, the last
// panel zero-padded). Within a panel, block b (32 elements) of the 16 rows is
// stored as 4-byte groups interleaved across rows -- byte (g, n, i) is
// element 4g + i of row n -- which is at once a zmm of 16 row-lanes for
// vpdpbusd against one broadcast 4-byte activation group, and the AMX B tile
// of TDPBSUD (K/4 rows of 16 columns x 4 bytes). Weights are unsigned:
//   Q8_0: 8 groups x 64 bytes = 512 bytes per block, each byte w + 128;
//   Q4_0/Q4_1: 4 x 64 = 256 bytes, byte (j, n, i) holds groups j (low
//     nibble) and j + 4 (high nibble), which is exactly the GGUF byte
//     qs[4j + i] of row n, so packing Q4 only interleaves;
//   Q5_0: the Q4 nibbles of its low 4 bits, then its fifth bits as 8 masks
//     of 64 bits, mask g's bit 4n + i the fifth bit of element 4g + i of
//     row n (one kmov + masked move per group puts 16 at those bytes).
// Q4_1's block is followed by its d then m as 16 fp16 each (320 bytes a
// block). Q8_0, Q4_0 and Q5_0 store blocks in pairs: the first block's
// weights, the first's d and the second's as 16 fp16 each (one 64-byte
// line), then the second block's weights. A pair is a whole number of
// 64-byte lines with no padding (1,088, 576 and 704 bytes: GGUF's own 34,
// 18 and 22 bytes a row-block, where one padded block each was 5.9%, 11%
// and 9% larger -- bytes a one-token product had to stream), and a block's
// d follows its weights, so a panel is still read front to back in one
// linear stream (the d line after the pair, where the kernel jumped ahead
// for the first d and back, measured slower). An odd last block leaves its
// pair's second half zero.
// Q4_K: a group of its 8 sub-blocks (one 256-value super-block) is 8 x 256
// bytes of nibbles laid out as Q4_0's (each sub-block's element e and e + 16
// share a byte), then per sub-block its 16 rows' 6-bit scales and mins as
// bytes (8 x 32), then the super-block's d and dmin as 16 fp16 each: 2,368
// bytes per 16 rows x 256 values (Q4_K itself: 2,304). Q5_K: the same with
// each sub-block's fifth bits after its nibbles as Q5_0's masks (320 bytes
// a sub-block): 2,880 bytes (Q5_K: 2,816).
// Q6_K: per super-block, 8 sub-blocks of 384 bytes: the low 4 bits of its
// 6-bit values as Q4_0's nibbles, then two 64-byte planes of their top two
// bits, plane h's byte (4n + i) holding those of element 16h + 4g + i of row
// n at bits 2g, 2g + 1 (g = 0..3: one shift and one mask put them at bits 4
// and 5 of group g's bytes); then the 16 scales (int8) of its 16-value
// sub-blocks for the 16 rows, and d as 16 fp16: 3,392 bytes per 16 rows x
// 256 values (Q6_K itself: 3,360).
// Q5_1: Q5_0's nibbles and masks, then d and m as Q4_1's (384 bytes).
// IQ4_NL: Q4_0's layout (the nibbles are table indices; the kernels map
// them through kIq4nlValues + 128, one byte shuffle, to unsigned bytes).
// IQ4_XS: per super-block, 8 sub-blocks of IQ4_NL nibbles (256 bytes each),
// then per sub-block its 16 rows' scales ls - 32 as int8 (8 x 16), then d as
// 16 fp16: 2,240 bytes per 16 rows x 256 values (IQ4_XS itself: 2,176).
// Q2_K and Q3_K: per super-block, 8 blocks of 32 values, each two 64-byte
// planes of 2-bit values -- plane h's byte (4n + i) holds element 16h + 4g
// + i of row n at bits 2g, 2g + 1 (g = 0..3; one shift and one mask give
// group g's bytes) -- and (Q3_K) 8 masks of the third bit as Q5_0's fifth
// bits; then the 16 rows' scales of the 16 sub-blocks of 16 values as int8
// (16 x 16), (Q2_K) their mins as bytes (16 x 16), then d and dmin as 16
// fp16 each: Q2_K 1,600 bytes per 16 rows x 256 values (Q2_K itself: 1,344),
// Q3_K 1,856 (1,760). The weights are unsigned: Q2_K's q (0..3), Q3_K's q +
// 4 (0..7).
//
// Expression. For row r, token t, blocks b = 0..nb-1 in order, from acc = +0:
//   Q8_0, Q4_0, Q5_0: isum = sum over the block of w * x with the signed
//     weights (q for Q8_0, q - 8 for Q4_0, q - 16 for Q5_0): an exact int32,
//     formed from the unsigned dot as isum_u - 128 * sum(x) (resp. 8, 16);
//     acc = fma(float(isum), d_w * d_a, acc);
//   Q4_1: isum = sum of q * x (q = 0..15), exact;
//     acc = fma(float(isum), d_w * d_a, acc);  acc = fma(m_w, s_a, acc);
//   Q4_K and Q5_K (q = 0..31), on Q8_K activations (d_a per super-block, bsums per 16 values),
//     per super-block as llama.cpp sums it: isum_j = sum of q * x over
//     sub-block j (q = 0..15), sumi = sum_j sc_j * isum_j and summ = sum_j
//     m_j * (bsum_2j + bsum_2j+1), both exact int32; then
//     acc = fma(float(sumi), d * d_a, acc);
//     acc = fma(float(summ), (-dmin) * d_a, acc);
//   Q5_1: as Q4_1 with q = 0..31 (the fifth bit added);
//   IQ4_NL: as Q8_0 with the table's value as the signed weight (offset 128);
//   IQ4_XS, on Q8_K activations: sumi = sum over the 8 sub-blocks j of
//     (ls_j - 32) * (sum of v * x over j), v the table's values, exact int32
//     (formed from the offset-128 bytes as isum_u - 128 * (bsum_2j +
//     bsum_2j+1)); acc = fma(float(sumi), d * d_a, acc);
//   Q2_K and Q3_K, on Q8_K activations: sumi = sum over the 16 sub-blocks k
//     of sc_k * (isum_k - o * bsum_k) (isum_k: the unsigned values times x,
//     o = 0 for Q2_K, 4 for Q3_K), summ = sum of m_k * bsum_k (Q2_K), exact
//     int32; acc = fma(float(sumi), d * d_a, acc); (Q2_K)
//     acc = fma(float(summ), (-dmin) * d_a, acc);
//   Q6_K, on Q8_K activations: sumi = sum over the 16 sub-blocks k of
//     sc_k * (isum_k - 32 * bsum_k) (isum_k: q * x over its 16 values, q =
//     0..63), exact int32; acc = fma(float(sumi), d * d_a, acc);
// with (d_a, s_a, sum(x)) the activation block's scale, ggml Q8_1 sum term and
// integer sum (QuantizedActs). Signed dots keep Q8_0/Q4_0 free of the large
// offset terms that cancel only in exact arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#include "kernels/cpu/matmul_internal.h"

namespace kvserve::kernels {

struct PackedWeight {
  DType type = DType::kQ8_0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t n_blocks = 0;     // cols / 32
  int64_t n_panels = 0;     // ceil(rows / 16)
  int64_t qs_bytes = 0;     // per block per panel: 512 (Q8_0), 256 (Q4), 320 (Q5_0)
  int64_t block_bytes = 0;  // a stored block: its blocks' qs, then d (and m) (Q4_K: a super-block)
  int64_t panel_bytes = 0;  // ceil(n_blocks / group_blocks) * block_bytes
  int64_t group_blocks = 1;  // 32-value blocks per stored block (Q8_0/Q4_0/Q5_0: 2, Q4_K: 8)
  int64_t scale_bytes = 32;  // per 32-value block: d (Q4_1: d, m)
  int64_t qs_stride = 0;     // from one block's qs to the next's in a stored block
  std::unique_ptr<uint8_t, void (*)(void*)> storage{nullptr, nullptr};
  // The PanelArena chunk that storage was cut from (storage then frees
  // nothing itself); null for a weight allocated on its own.
  std::shared_ptr<void> arena_chunk;

  const uint8_t* Panel(int64_t p) const { return storage.get() + p * panel_bytes; }
  const uint8_t* Qs(int64_t p, int64_t b) const {
    return Panel(p) + b / group_blocks * block_bytes + b % group_blocks * qs_stride;
  }
  // Q4_K only: the 16 scales then 16 mins (bytes) of sub-block b, and the
  // super-block's 16 d then 16 dmin (fp16).
  const uint8_t* KScaleMins(int64_t p, int64_t b) const {
    return Panel(p) + b / 8 * block_bytes + 8 * qs_bytes + b % 8 * 32;
  }
  const uint16_t* KD(int64_t p, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(Panel(p) + b / 8 * block_bytes + 8 * qs_bytes +
                                             8 * 32);
  }
  // Q6_K only: the top-bit plane of half h (0: values 0..15, 1: 16..31)
  // of block b; the 16 rows' int8 scales of the 16-value sub-block `half` of
  // block b; the super-block's 16 d (fp16).
  const uint8_t* Q6High(int64_t p, int64_t b, int h) const { return Qs(p, b) + 256 + 64 * h; }
  const int8_t* Q6Scales(int64_t p, int64_t b, int half) const {
    return reinterpret_cast<const int8_t*>(Panel(p) + b / 8 * block_bytes + 8 * 384 +
                                           (2 * (b % 8) + half) * 16);
  }
  const uint16_t* Q6D(int64_t p, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(Panel(p) + b / 8 * block_bytes + 8 * 384 + 256);
  }
  // Q8_0, Q4_0, Q4_1, Q5_0: the 16 rows' d of block b (fp16).
  const uint16_t* D(int64_t p, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(Panel(p) + b / group_blocks * block_bytes +
                                             qs_bytes + b % group_blocks * scale_bytes);
  }
  // IQ4_XS only: the 16 rows' int8 scales (ls - 32) of sub-block b, and
  // the super-block's 16 d (fp16).
  const int8_t* XsScales(int64_t p, int64_t b) const {
    return reinterpret_cast<const int8_t*>(Panel(p) + b / 8 * block_bytes + 8 * qs_bytes +
                                           b % 8 * 16);
  }
  const uint16_t* XsD(int64_t p, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(Panel(p) + b / 8 * block_bytes + 8 * qs_bytes +
                                             8 * 16);
  }
  // Q2_K and Q3_K only: the third-bit mask of group g (0..7) of block b
  // (Q3_K); the 16 rows' int8 scales and (Q2_K) byte mins of the 16-value
  // sub-block `half` of block b; the super-block's 16 d then 16 dmin (fp16).
  uint64_t K16HighBits(int64_t p, int64_t b, int g) const {
    uint64_t m;
    std::memcpy(&m, Qs(p, b) + 128 + 8 * g, sizeof(m));
    return m;
  }
  const int8_t* K16Scales(int64_t p, int64_t b, int half) const {
    return reinterpret_cast<const int8_t*>(Panel(p) + b / 8 * block_bytes + 8 * qs_bytes +
                                           (2 * (b % 8) + half) * 16);
  }
  const uint8_t* K16Mins(int64_t p, int64_t b, int half) const {
    return Panel(p) + b / 8 * block_bytes + 8 * qs_bytes + 256 + (2 * (b % 8) + half) * 16;
  }
  const uint16_t* K16D(int64_t p, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(Panel(p) + b / 8 * block_bytes + 8 * qs_bytes + 256 +
                                             (type == DType::kQ2_K ? 256 : 0));
  }
  // Q4_1 and Q5_1.
  const uint16_t* M(int64_t p, int64_t b) const { return D(p, b) + 16; }
  // Q5_0, Q5_1 and Q5_K: the fifth-bit mask of group g (0..7) of block b.
  uint64_t HighBits(int64_t p, int64_t b, int g) const {
    uint64_t m;
    std::memcpy(&m, Qs(p, b) + 256 + 8 * g, sizeof(m));
    return m;
  }
};

namespace internal {

constexpr int kPanelRows = 16;

// Whether a type's block epilogue takes the integer sum(x) (signed weights
// formed from unsigned ones); Q4_1 and Q4_K take s_a instead, and Q4_K's
// activations (Q8_K) carry no integer sums.
constexpr bool PanelUsesSum(DType t) {
  return t != DType::kQ4_1 && t != DType::kQ5_1 && !UsesQ8K(t);
}
// Q4_1 and Q5_1: the block epilogue adds m_w * s_a.
constexpr bool PanelHasMin(DType t) { return t == DType::kQ4_1 || t == DType::kQ5_1; }
// IQ4_NL and IQ4_XS: the nibbles index kIq4nlValues.
constexpr bool PanelIq4(DType t) { return t == DType::kIQ4_NL || t == DType::kIQ4_XS; }

// Calls fn.template operator()<kType>() with the packed type t as a
// template argument (every CanPackPanels type); nothing for another type.
// One list for every kernel's dispatch.
template <class Fn>
void VisitPanelType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kQ8_0:
      return fn.template operator()<DType::kQ8_0>();
    case DType::kQ4_0:
      return fn.template operator()<DType::kQ4_0>();
    case DType::kQ4_1:
      return fn.template operator()<DType::kQ4_1>();
    case DType::kQ5_0:
      return fn.template operator()<DType::kQ5_0>();
    case DType::kQ5_1:
      return fn.template operator()<DType::kQ5_1>();
    case DType::kIQ4_NL:
      return fn.template operator()<DType::kIQ4_NL>();
    case DType::kQ2_K:
      return fn.template operator()<DType::kQ2_K>();
    case DType::kQ3_K:
      return fn.template operator()<DType::kQ3_K>();
    case DType::kQ4_K:
      return fn.template operator()<DType::kQ4_K>();
    case DType::kQ5_K:
      return fn.template operator()<DType::kQ5_K>();
    case DType::kQ6_K:
      return fn.template operator()<DType::kQ6_K>();
    case DType::kIQ4_XS:
      return fn.template operator()<DType::kIQ4_XS>();
    default:
      return;
  }
}

// Rows [r0, r1) of y for all n_tokens tokens from a packed weight. The
// VNNI kernel serves any n_tokens; the AMX kernels are meant for many
// (MatMulMany routes by AmxMinTokens()).
void MatMulPanelsVnni(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                      int64_t r0, int64_t r1, float* y, int64_t y_stride);
void MatMulPanelsAmx(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                     int64_t r0, int64_t r1, float* y, int64_t y_stride);
// The AMX kernel's code over a software model of the tile registers, so its
// tiling, padding and epilogue are checked on CPUs without AMX. Tests only.
void MatMulPanelsAmxEmulated(const PackedWeight& w, const QuantizedActs& acts, int64_t n_tokens,
                             int64_t r0, int64_t r1, float* y, int64_t y_stride);
// The expression above in plain loops with std::fma: the tests' bit-exact
// yardstick for the vector kernels. Reads the unpacked GGUF rows of w.
void MatMulPanelsScalar(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                        int64_t r0, int64_t r1, float* y, int64_t y_stride);

}  // namespace internal
}  // namespace kvserve::kernels

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvserve::kernels::internal {
namespace {  // internal linkage: each ISA's translation unit keeps its own copy

// The block epilogue of the expression for 16 row-lanes of one token. isum_u:
// the unsigned-weight block dots; dw, mw: the block's d_w and (Q4_1) m_w of
// the 16 rows; da, sa, xsum: the token's d_a, s_a and integer sum(x).
template <DType kType>
inline __m512 PanelBlockEpilogue(__m512 acc, __m512i isum_u, __m512 dw, __m512 mw, float da,
                                 float sa, int32_t xsum) {
  if constexpr (PanelHasMin(kType)) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_u), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
    return _mm512_fmadd_ps(mw, _mm512_set1_ps(sa), acc);
  } else {
    constexpr int32_t kOffset = (kType == DType::kQ8_0 || kType == DType::kIQ4_NL)
                                    ? 128
                                    : (kType == DType::kQ5_0 ? 16 : 8);
    const __m512i isum = _mm512_sub_epi32(isum_u, _mm512_set1_epi32(kOffset * xsum));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
  }
}

// d_w and (Q4_1; else zero) m_w of block b of a panel, 16 floats each.
template <DType kType>
inline void PanelScales(const PackedWeight& w, int64_t p, int64_t b, __m512* dw, __m512* mw) {
  *dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.D(p, b))));
  if constexpr (PanelHasMin(kType)) {
    *mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.M(p, b))));
  } else {
    *mw = _mm512_setzero_ps();
  }
}

// Q5_0: v (16 rows' nibbles of group g, one per byte) with the group's
// fifth bits added as 16s; other types: v.
template <DType kType>
inline __m512i PanelAddHighBits(__m512i v, const PackedWeight& w, int64_t p, int64_t b, int g) {
  if constexpr (kType == DType::kQ5_0 || kType == DType::kQ5_1 || kType == DType::kQ5_K) {
    const __mmask64 hb = _cvtu64_mask64(w.HighBits(p, b, g));
    return _mm512_or_si512(v, _mm512_maskz_mov_epi8(hb, _mm512_set1_epi8(0x10)));
  } else {
    return v;
  }
}

// IQ4_NL / IQ4_XS: nibbles (one per byte) -> kIq4nlValues + 128, unsigned;
// other types: v.
struct Iq4UnsignedTable {
  alignas(16) uint8_t v[16];
};
constexpr Iq4UnsignedTable MakeIq4UnsignedTable() {
  Iq4UnsignedTable t{};
  for (int i = 0; i < 16; ++i) t.v[i] = static_cast<uint8_t>(kIq4nlValues[i] + 128);
  return t;
}
inline constexpr Iq4UnsignedTable kIq4Unsigned = MakeIq4UnsignedTable();

template <DType kType>
inline __m512i PanelMapValues(__m512i v) {
  if constexpr (PanelIq4(kType)) {
    const __m512i table =
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Unsigned.v)));
    return _mm512_shuffle_epi8(table, v);
  } else {
    return v;
  }
}

// IQ4_XS: the int32 contribution of sub-block b, (ls - 32) * (isum_u - 128 *
// xs) with xs the activations' sum over it, for 16 row-lanes.
inline __m512i PanelIq4XsSubBlock(__m512i isum_u, const PackedWeight& w, int64_t p, int64_t b,
                                  int32_t xs) {
  const __m512i sc =
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.XsScales(p, b))));
  return _mm512_mullo_epi32(_mm512_sub_epi32(isum_u, _mm512_set1_epi32(128 * xs)), sc);
}

// IQ4_XS: the super-block's float step for 16 row-lanes of one token.
inline __m512 PanelIq4XsSuperEpilogue(__m512 acc, __m512i sumi, const PackedWeight& w, int64_t p,
                                      int64_t s, float da) {
  const __m512 d =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.XsD(p, 8 * s))));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, _mm512_set1_ps(da)), acc);
}

// Q4_K: the 16 rows' 6-bit scales (mins when `mins`) of sub-block b.
inline __m512i PanelKScales(const PackedWeight& w, int64_t p, int64_t b, bool mins) {
  return _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.KScaleMins(p, b) + (mins ? 16 : 0))));
}

// Q4_K: the super-block epilogue of 16 row-lanes of one token: sumi (the
// scaled block dots) and the mins against the activations' block sums xbs
// (16 int16 of the super-block), at super-block s of panel p.
inline __m512 PanelQ4KSuperEpilogue(__m512 acc, __m512i sumi, const PackedWeight& w, int64_t p,
                                    int64_t s, const int16_t* xbs, float da) {
  __m512i summ = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {
    const int32_t xs = int32_t{xbs[2 * j]} + int32_t{xbs[2 * j + 1]};
    summ = _mm512_add_epi32(
        summ, _mm512_mullo_epi32(PanelKScales(w, p, 8 * s + j, true), _mm512_set1_epi32(xs)));
  }
  const uint16_t* dd = w.KD(p, 8 * s);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
  const __m512 dmin =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + 16)));
  const __m512 neg_dmin =  // exact negation
      _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin), _mm512_set1_epi32(INT32_MIN)));
  const __m512 vda = _mm512_set1_ps(da);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, vda), acc);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(neg_dmin, vda), acc);
}

// Q6_K: the top two bits of group g (0..3) of a half, from its plane h, at
// bits 4 and 5 of each byte. (Bits a 16-bit shift carries across a byte
// boundary land outside bits 4-5 and are masked off.)
inline __m512i PanelQ6Top(__m512i h, int g) {
  const __m512i m = _mm512_set1_epi8(0x30);
  switch (g) {
    case 0:
      return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    case 1:
      return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    case 2:
      return _mm512_and_si512(h, m);
    default:
      return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
  }
}

// Q6_K: v (16 rows' low 4 bits of group G of block b; G >= 4: the second
// half's group G - 4) with its top two bits: the 6-bit values.
inline __m512i PanelQ6Value(__m512i v, const PackedWeight& w, int64_t p, int64_t b, int G) {
  const __m512i h = _mm512_load_si512(w.Q6High(p, b, G / 4));
  return _mm512_or_si512(v, PanelQ6Top(h, G % 4));
}

// Q6_K: the int32 contribution of one 16-value sub-block: sc * (isum_u -
// 32 * bsum), for 16 row-lanes.
inline __m512i PanelQ6SubBlock(__m512i isum_u, const PackedWeight& w, int64_t p, int64_t b,
                               int half, int32_t bsum) {
  const __m512i sc = _mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.Q6Scales(p, b, half))));
  return _mm512_mullo_epi32(_mm512_sub_epi32(isum_u, _mm512_set1_epi32(32 * bsum)), sc);
}

// Q6_K: the super-block's float step for 16 row-lanes of one token.
inline __m512 PanelQ6SuperEpilogue(__m512 acc, __m512i sumi, const PackedWeight& w, int64_t p,
                                   int64_t s, float da) {
  const __m512 d = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Q6D(p, 8 * s))));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, _mm512_set1_ps(da)), acc);
}

// Q2_K / Q3_K: the unsigned values of group g (0..3) of half `half` of
// block b, from that half's 2-bit plane (Q3_K: with the third bit added as
// 4).
template <DType kType>
inline __m512i PanelK16Value(__m512i plane, const PackedWeight& w, int64_t p, int64_t b,
                             int half, int g) {
  const __m512i q = _mm512_and_si512(_mm512_srli_epi16(plane, 2 * g), _mm512_set1_epi8(0x03));
  if constexpr (kType == DType::kQ3_K) {
    const __mmask64 hb = _cvtu64_mask64(w.K16HighBits(p, b, 4 * half + g));
    return _mm512_or_si512(q, _mm512_maskz_mov_epi8(hb, _mm512_set1_epi8(0x04)));
  } else {
    return q;
  }
}

// Q2_K / Q3_K: one 16-value sub-block's int32 terms for 16 row-lanes:
// sumi += sc * (isum_u - o * bsum), and (Q2_K) summ += m * bsum.
template <DType kType>
inline void PanelK16SubBlock(__m512i* sumi, __m512i* summ, __m512i isum_u, const PackedWeight& w,
                             int64_t p, int64_t b, int half, int32_t bsum) {
  const __m512i sc = _mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.K16Scales(p, b, half))));
  if constexpr (kType == DType::kQ3_K) {
    *sumi = _mm512_add_epi32(
        *sumi, _mm512_mullo_epi32(_mm512_sub_epi32(isum_u, _mm512_set1_epi32(4 * bsum)), sc));
  } else {
    *sumi = _mm512_add_epi32(*sumi, _mm512_mullo_epi32(isum_u, sc));
    const __m512i mn = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.K16Mins(p, b, half))));
    *summ = _mm512_add_epi32(*summ, _mm512_mullo_epi32(mn, _mm512_set1_epi32(bsum)));
  }
}

// Q2_K / Q3_K: the super-block's float steps for 16 row-lanes of one token.
template <DType kType>
inline __m512 PanelK16SuperEpilogue(__m512 acc, __m512i sumi, __m512i summ,
                                    const PackedWeight& w, int64_t p, int64_t s, float da) {
  const uint16_t* dd = w.K16D(p, 8 * s);
  const __m512 vda = _mm512_set1_ps(da);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, vda), acc);
  if constexpr (kType == DType::kQ2_K) {
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + 16)));
    const __m512 neg_dmin =  // exact negation
        _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(dmin), _mm512_set1_epi32(INT32_MIN)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(neg_dmin, vda), acc);
  }
  return acc;
}

// Lanes of panel p that fall in [r0, r1).
inline __mmask16 PanelRowMask(int64_t p, int64_t r0, int64_t r1) {
  const int64_t base = p * kPanelRows;
  const int64_t lo = r0 > base ? r0 - base : 0;
  const int64_t hi = r1 - base < kPanelRows ? r1 - base : kPanelRows;
  if (hi <= lo) return 0;
  const uint32_t bits = ((1u << (hi - lo)) - 1u) << lo;
  return static_cast<__mmask16>(bits);
}

}  // namespace
}  // namespace kvserve::kernels::internal
#endif
