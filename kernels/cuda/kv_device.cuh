// Internal to kernels/cuda: the paged KV layout of kernels/kv_view.h as seen
// from device code (PagedKvView's member functions are host-only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/kv_view.h"

namespace kvserve::cuda::internal {

struct KvLayout {
  uint8_t* pool;
  int64_t block_bytes;
  int64_t layer_offset;  // layer * layer_bytes
  int64_t v_offset;      // layer_bytes / 2: V after K inside a layer
  int64_t row_bytes;     // one (token, head) row
  int32_t block_size;
  int32_t block_shift;   // log2(block_size)
  const int32_t* block_ids;
  const int32_t* seq_block_offsets;
  // Quantized codecs (kv_codec.cuh): the scale area of a layer's K half
  // starts meta_offset after the layer (values: + v_offset), one head's is
  // head_meta_bytes, one row's row_meta_bytes. codec_variant: int8/fp8
  // 0 int8, 1 e4m3, 2 e5m2; int4: log2 of the group size.
  int64_t meta_offset;
  int64_t head_meta_bytes;
  int64_t row_meta_bytes;
  int32_t codec_variant;

  // Start of head `head`'s keys in block `block` (values: + v_offset).
  __device__ __forceinline__ const uint8_t* HeadKeys(int32_t block, int32_t head) const {
    return pool + static_cast<int64_t>(block) * block_bytes + layer_offset +
           static_cast<int64_t>(head) * block_size * row_bytes;
  }
  __device__ __forceinline__ int32_t BlockOf(int32_t seq, int32_t pos) const {
    return block_ids[seq_block_offsets[seq] + (pos >> block_shift)];
  }
  // Key row of (seq, pos, head); the value row is at + v_offset.
  __device__ __forceinline__ uint8_t* KeyRow(int32_t seq, int32_t pos, int32_t head) const {
    return const_cast<uint8_t*>(HeadKeys(BlockOf(seq, pos), head)) +
           static_cast<int64_t>(pos & (block_size - 1)) * row_bytes;
  }
};

// Validates the view for the CUDA kernels and builds the device layout.
inline absl::Status MakeKvLayout(const kernels::PagedKvView& kv, int32_t layer, KvLayout* out) {
  if (kernels::KvIsKivi(kv.dtype)) {
    return absl::UnimplementedError(absl::StrCat(
        "CUDA kernels: KV dtype ", std::string(kernels::KvDTypeName(kv.dtype)),
        " (per-channel keys re-encoded on append) is not supported yet; use int4 or int4-g64"));
  }
  if (kv.block_size <= 0 || (kv.block_size & (kv.block_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA kernels: block size ", kv.block_size, " is not a power of two"));
  }
  if (kv.pool == nullptr || kv.block_ids == nullptr || kv.seq_block_offsets == nullptr ||
      kv.n_kv_heads <= 0 || kv.head_dim <= 0 || layer < 0 ||
      (static_cast<int64_t>(layer) + 1) * kv.layer_bytes > kv.block_bytes) {
    return absl::InvalidArgumentError("CUDA kernels: incomplete KV view or layer out of range");
  }
  int32_t shift = 0;
  while ((1 << shift) < kv.block_size) ++shift;
  *out = KvLayout{kv.pool,
                  kv.block_bytes,
                  static_cast<int64_t>(layer) * kv.layer_bytes,
                  kv.layer_bytes / 2,
                  kv.RowBytes(),
                  kv.block_size,
                  shift,
                  kv.block_ids,
                  kv.seq_block_offsets,
                  int64_t{kv.block_size} * kv.n_kv_heads * kv.RowBytes(),
                  kv.HeadMetaBytes(),
                  kv.RowMetaBytes(),
                  0};
  switch (kv.dtype) {
    case kernels::KvDType::kFp8E4M3:
      out->codec_variant = 1;
      break;
    case kernels::KvDType::kFp8E5M2:
      out->codec_variant = 2;
      break;
    case kernels::KvDType::kInt4:
      out->codec_variant = 5;  // groups of 32
      break;
    case kernels::KvDType::kInt4G64:
      out->codec_variant = 6;  // groups of 64
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace kvserve::cuda::internal
