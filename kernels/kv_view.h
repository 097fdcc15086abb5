// PagedKvView: the plain-data view through which kernels read and append K/V.
// The cache fills it; kernels never see cache objects. Same idea as
// FlashInfer's paged_kv_t: a pool of fixed-size blocks and a CSR block table.
//
// Block layout (DESIGN.md): block b starts at pool + b * block_bytes and holds
// every layer; layer l starts layer_bytes further per layer; within a layer K
// comes first and V starts at layer_bytes / 2. K and V are each laid out
// [kv_head][slot][head_dim] so one head's keys of a block are contiguous.
//
// Quantized codecs keep that data layout with narrower rows and add a scale
// area after the data of each half (K or V) of a layer: [kv_head][slot]
// metadata rows (scales, zero points) of KvRowMetaBytes each. Scales thus
// live in the same block as their data, so CopyBlock, prefix sharing and
// tier copies move them without knowing the codec. f32/f16 have no scale
// area and their layout is unchanged.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvserve::kernels {

// f32/f16/bf16: plain floats. int8: symmetric, one f32 scale per (token, KV
// head). fp8-e4m3/e5m2: OCP fp8 of x / scale with one f32 scale per (token,
// KV head) mapping the row's max |x| to the format's largest finite value
// (so no row saturates and small rows keep their precision). int4:
// asymmetric per group of 32 channels, f16 scale + f16 minimum per group,
// two values per byte (low nibble = even channel). int4-g64: int4 with groups
// of 64 channels (4.5 bits a value instead of 5: the capacity variant).
// int4-kivi: keys per channel (KIVI), values as int4; see kKiviKeyMetaBytes
// below. int4-kivi-g64: int4-kivi with values in groups of 64 channels (the
// capacity variant of int4-kivi: 4.5 bits a value at --block-size 32).
enum class KvDType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kFp8E4M3,
  kFp8E5M2,
  kInt8,
  kInt4,
  kInt4G64,
  kInt4Kivi,
  kInt4KiviG64
};

// Bytes of one element for the float codecs (f32/f16/bf16). Quantized codecs
// have no meaningful per-element size: use KvRowBytes/KvRowMetaBytes.
inline int64_t KvElemBytes(KvDType t) { return t == KvDType::kF32 ? 4 : 2; }

// Channels per int4 quantization group (int4 and int4-kivi's values; int4-g64
// uses kInt4G64Group).
inline constexpr int32_t kInt4Group = 32;
inline constexpr int32_t kInt4G64Group = 64;

// Channels per group of a per-token int4 row codec.
inline int32_t KvInt4GroupOf(KvDType t) {
  return t == KvDType::kInt4G64 || t == KvDType::kInt4KiviG64 ? kInt4G64Group : kInt4Group;
}
// Codecs whose keys are per channel over a block (values: int4 rows).
inline bool KvIsKivi(KvDType t) {
  return t == KvDType::kInt4Kivi || t == KvDType::kInt4KiviG64;
}
inline bool KvIsInt4Rows(KvDType t) {
  return t == KvDType::kInt4 || t == KvDType::kInt4G64 || KvIsKivi(t);
}

// int4-kivi keys: one (block, KV head, channel) shares a step and a zero
// point over the block's tokens, two bytes per channel in the head's scale
// area: [0] step exponent e, step = 2^((e - 128) / 8); [1] int8 zero z; a
// code q in [0, 15] stands for (q + z) * step. Why this and not f16 scale +
// f16 minimum: 4 bytes per channel over a 16-token block is 2 bits a value
// (int4-kivi would hold fewer tokens than int4); 2 bytes is 1 bit, which at
// head_dim 64 and block 16 is exactly the 8 bytes per row the values' f16
// scale and minimum take, so K and V halves stay equal and int4-kivi costs
// what int4 costs. The 1/8-octave step ladder wastes at most 9% of a step
// (4.4% on average); the integer zero point lets a channel whose values sit
// far from 0 relative to their spread keep 8 bits of relative precision
// (|x| / 256) instead of failing.
inline constexpr int32_t kKiviKeyMetaBytes = 2;
inline constexpr int32_t kKiviStepBias = 128;
inline constexpr int32_t kKiviStepsPerOctave = 8;

// Data bytes of one (token, KV head) row of head_dim values.
inline int64_t KvRowBytes(KvDType t, int32_t head_dim) {
  switch (t) {
    case KvDType::kF32:
      return 4 * int64_t{head_dim};
    case KvDType::kF16:
    case KvDType::kBF16:
      return 2 * int64_t{head_dim};
    case KvDType::kFp8E4M3:
    case KvDType::kFp8E5M2:
    case KvDType::kInt8:
      return head_dim;
    case KvDType::kInt4:
    case KvDType::kInt4G64:
    case KvDType::kInt4Kivi:
    case KvDType::kInt4KiviG64:
      return (int64_t{head_dim} + 1) / 2;
  }
  return 0;
}

// Scale-area bytes of one (token, KV head) row.
inline int64_t KvRowMetaBytes(KvDType t, int32_t head_dim) {
  switch (t) {
    case KvDType::kFp8E4M3:
    case KvDType::kFp8E5M2:
    case KvDType::kInt8:
      return 4;
    case KvDType::kInt4:
    case KvDType::kInt4Kivi:  // a value row; keys keep per-channel metadata
      return 4 * ((int64_t{head_dim} + kInt4Group - 1) / kInt4Group);
    case KvDType::kInt4G64:
    case KvDType::kInt4KiviG64:
      return 4 * ((int64_t{head_dim} + kInt4G64Group - 1) / kInt4G64Group);
    default:
      return 0;
  }
}

// Scale-area bytes of one KV head of one block, for K and for V alike (the
// halves are equal-sized). Per-row codecs: block_size rows of
// KvRowMetaBytes. int4-kivi*: the larger of the keys' per-channel bytes and
// the values' per-row bytes; they are equal at head_dim 64 for int4-kivi at
// block 16 and int4-kivi-g64 at block 32, and the smaller half pads
// otherwise.
inline int64_t KvHeadMetaBytes(KvDType t, int32_t block_size, int32_t head_dim) {
  const int64_t rows = int64_t{block_size} * KvRowMetaBytes(t, head_dim);
  if (!KvIsKivi(t)) return rows;
  const int64_t channels = int64_t{kKiviKeyMetaBytes} * head_dim;
  return rows > channels ? rows : channels;
}

// True for codecs the attention kernel dequantizes row by row.
inline bool KvIsQuantized(KvDType t) { return t != KvDType::kF32 && t != KvDType::kF16; }

// Flag spelling: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4, int4-g64,
// int4-kivi, int4-kivi-g64.
std::string_view KvDTypeName(KvDType t);
// False when name is not one of KvDTypeName's spellings.
bool ParseKvDType(std::string_view name, KvDType* out);
// Every codec, in KvDTypeName order, and their spellings joined by ", ".
inline constexpr KvDType kAllKvDTypes[] = {
    KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,    KvDType::kFp8E4M3, KvDType::kFp8E5M2,
    KvDType::kInt8, KvDType::kInt4, KvDType::kInt4G64, KvDType::kInt4Kivi,
    KvDType::kInt4KiviG64};
std::string_view KvDTypeList();

struct PagedKvView {
  uint8_t* pool = nullptr;
  int64_t block_bytes = 0;
  int64_t layer_bytes = 0;
  int32_t block_size = 16;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  KvDType dtype = KvDType::kF32;
  // CSR block table: sequence s owns block_ids[seq_block_offsets[s] ..
  // seq_block_offsets[s + 1]) in position order.
  const int32_t* block_ids = nullptr;
  const int32_t* seq_block_offsets = nullptr;
  int32_t n_seqs = 0;

  // Bytes of K (or V) of one layer of one block.
  static int64_t HalfLayerBytes(int32_t block_size, int32_t n_kv_heads, int32_t head_dim,
                                KvDType dtype) {
    return int64_t{n_kv_heads} * (int64_t{block_size} * KvRowBytes(dtype, head_dim) +
                                  KvHeadMetaBytes(dtype, block_size, head_dim));
  }

  int64_t RowBytes() const { return KvRowBytes(dtype, head_dim); }
  int64_t RowMetaBytes() const { return KvRowMetaBytes(dtype, head_dim); }
  int64_t HeadMetaBytes() const { return KvHeadMetaBytes(dtype, block_size, head_dim); }

  // REQUIRES: pos lies inside the blocks the table gives sequence seq.
  uint8_t* KeyAt(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    return Slot(layer, seq, pos, head);
  }
  uint8_t* ValueAt(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    return Slot(layer, seq, pos, head) + layer_bytes / 2;
  }
  // Start of one head's keys (values: + layer_bytes / 2) in a given block.
  uint8_t* BlockHead(int32_t layer, int32_t block, int32_t head) const {
    return pool + static_cast<int64_t>(block) * block_bytes +
           static_cast<int64_t>(layer) * layer_bytes +
           static_cast<int64_t>(head) * block_size * RowBytes();
  }
  // Start of one head's key scale area (values: + layer_bytes / 2) in a
  // block: block_size rows of RowMetaBytes, or int4-kivi keys' per-channel
  // bytes (kKiviKeyMetaBytes * head_dim).
  uint8_t* BlockHeadMeta(int32_t layer, int32_t block, int32_t head) const {
    return pool + static_cast<int64_t>(block) * block_bytes +
           static_cast<int64_t>(layer) * layer_bytes +
           static_cast<int64_t>(block_size) * n_kv_heads * RowBytes() +
           static_cast<int64_t>(head) * HeadMetaBytes();
  }
  // Per-row scales; not meaningful for int4-kivi* keys (see BlockHeadMeta).
  uint8_t* KeyMetaAt(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    const int32_t block = block_ids[seq_block_offsets[seq] + pos / block_size];
    return BlockHeadMeta(layer, block, head) +
           static_cast<int64_t>(pos % block_size) * RowMetaBytes();
  }
  uint8_t* ValueMetaAt(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    return KeyMetaAt(layer, seq, pos, head) + layer_bytes / 2;
  }

 private:
  uint8_t* Slot(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    const int32_t block = block_ids[seq_block_offsets[seq] + pos / block_size];
    return BlockHead(layer, block, head) +
           static_cast<int64_t>(pos % block_size) * RowBytes();
  }
};

}  // namespace kvserve::kernels
