// PagedKvView: the plain-data view through which kernels read and append K/V.
// The cache fills it; kernels never see cache objects. Same idea as
// FlashInfer's paged_kv_t: a pool of fixed-size blocks and a CSR block table.
//
// Block layout (DESIGN.md): block b starts at pool + b * block_bytes and holds
// every layer; layer l starts layer_bytes further per layer; within a layer K
// comes first and V starts at layer_bytes / 2. K and V are each laid out
// [kv_head][slot][head_dim] so one head's keys of a block are contiguous.
#pragma once

#include <cstdint>

namespace kvserve::kernels {

enum class KvDType : uint8_t { kF32, kF16 };
inline int64_t KvElemBytes(KvDType t) { return t == KvDType::kF32 ? 4 : 2; }

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
    return static_cast<int64_t>(block_size) * n_kv_heads * head_dim * KvElemBytes(dtype);
  }

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
           static_cast<int64_t>(head) * block_size * head_dim * KvElemBytes(dtype);
  }

 private:
  uint8_t* Slot(int32_t layer, int32_t seq, int32_t pos, int32_t head) const {
    const int32_t block = block_ids[seq_block_offsets[seq] + pos / block_size];
    return BlockHead(layer, block, head) +
           static_cast<int64_t>(pos % block_size) * head_dim * KvElemBytes(dtype);
  }
};

}  // namespace kvserve::kernels
