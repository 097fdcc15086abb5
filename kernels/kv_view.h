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
// two values per byte (low nibble = even channel).
enum class KvDType : uint8_t { kF32, kF16, kBF16, kFp8E4M3, kFp8E5M2, kInt8, kInt4 };

// Bytes of one element for the float codecs (f32/f16/bf16). Quantized codecs
// have no meaningful per-element size: use KvRowBytes/KvRowMetaBytes.
inline int64_t KvElemBytes(KvDType t) { return t == KvDType::kF32 ? 4 : 2; }

// Channels per int4 quantization group.
inline constexpr int32_t kInt4Group = 32;

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
      return 4 * ((int64_t{head_dim} + kInt4Group - 1) / kInt4Group);
    default:
      return 0;
  }
}

// True for codecs the attention kernel dequantizes row by row.
inline bool KvIsQuantized(KvDType t) { return t != KvDType::kF32 && t != KvDType::kF16; }

// Flag spelling: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
std::string_view KvDTypeName(KvDType t);
// False when name is not one of KvDTypeName's spellings.
bool ParseKvDType(std::string_view name, KvDType* out);

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
    return static_cast<int64_t>(block_size) * n_kv_heads *
           (KvRowBytes(dtype, head_dim) + KvRowMetaBytes(dtype, head_dim));
  }

  int64_t RowBytes() const { return KvRowBytes(dtype, head_dim); }
  int64_t RowMetaBytes() const { return KvRowMetaBytes(dtype, head_dim); }

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
  // Start of one head's key scale rows (values: + layer_bytes / 2) in a block.
  uint8_t* BlockHeadMeta(int32_t layer, int32_t block, int32_t head) const {
    return pool + static_cast<int64_t>(block) * block_bytes +
           static_cast<int64_t>(layer) * layer_bytes +
           static_cast<int64_t>(block_size) * n_kv_heads * RowBytes() +
           static_cast<int64_t>(head) * block_size * RowMetaBytes();
  }
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
