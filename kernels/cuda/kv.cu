// KV-cache kernels (cuda_kernels.h): append into paged blocks, copy-on-write
// block copies, and block gather/scatter to pinned host memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_codec.cuh"
#include "kernels/cuda/kv_device.cuh"

namespace kvserve::cuda {
namespace {

using internal::KvLayout;
using internal::LaunchStatus;

template <typename T>
__device__ __forceinline__ T FromFloat(float f);
template <>
__device__ __forceinline__ float FromFloat<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float f) {
  return __float2half_rn(f);  // round to nearest even, as kernels::Fp32ToFp16
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}

// One block per token; threads over (kv head, channel) of K and V.
template <typename T>
__global__ void AppendKvKernel(KvLayout kv, int32_t n_kv_heads, int32_t head_dim,
                               const int32_t* __restrict__ token_seq,
                               const int32_t* __restrict__ token_pos, const float* __restrict__ k,
                               int64_t k_stride, const float* __restrict__ v, int64_t v_stride) {
  const int32_t t = blockIdx.x;
  const int32_t seq = token_seq[t];
  const int32_t pos = token_pos[t];
  const int32_t width = n_kv_heads * head_dim;
  for (int32_t e = threadIdx.x; e < width; e += blockDim.x) {
    const int32_t h = e / head_dim;
    const int32_t i = e - h * head_dim;
    uint8_t* krow = kv.KeyRow(seq, pos, h);
    reinterpret_cast<T*>(krow)[i] = FromFloat<T>(k[t * k_stride + e]);
    reinterpret_cast<T*>(krow + kv.v_offset)[i] = FromFloat<T>(v[t * v_stride + e]);
  }
}

// Quantized codecs: one block per token, one warp per (kv head, K or V) row
// at a time; internal::QuantizeRowWarp writes kernels::QuantizeRow's bytes.
__global__ void AppendKvQuantKernel(KvLayout kv, kernels::KvDType dtype, int32_t n_kv_heads,
                                    int32_t head_dim, const int32_t* __restrict__ token_seq,
                                    const int32_t* __restrict__ token_pos,
                                    const float* __restrict__ k, int64_t k_stride,
                                    const float* __restrict__ v, int64_t v_stride) {
  const int32_t t = blockIdx.x;
  const int32_t seq = token_seq[t];
  const int32_t pos = token_pos[t];
  const int32_t block = kv.BlockOf(seq, pos);
  const int32_t slot = pos & (kv.block_size - 1);
  const int warps = static_cast<int>(blockDim.x / 32);
  for (int32_t r = static_cast<int32_t>(threadIdx.x / 32); r < 2 * n_kv_heads; r += warps) {
    const int32_t h = r >> 1;
    const bool value = (r & 1) != 0;
    const int64_t half = value ? kv.v_offset : 0;
    const float* src = value ? v + t * v_stride + static_cast<int64_t>(h) * head_dim
                             : k + t * k_stride + static_cast<int64_t>(h) * head_dim;
    uint8_t* data = const_cast<uint8_t*>(kv.HeadKeys(block, h)) + half +
                    static_cast<int64_t>(slot) * kv.row_bytes;
    uint8_t* meta = const_cast<uint8_t*>(internal::HeadMeta(kv, block, h)) + half +
                    static_cast<int64_t>(slot) * kv.row_meta_bytes;
    internal::QuantizeRowWarp(dtype, src, head_dim, data, meta);
  }
}

template <typename Word>
__global__ void CopyBlocksKernel(uint8_t* pool, int64_t block_bytes,
                                 const int32_t* __restrict__ src_ids,
                                 const int32_t* __restrict__ dst_ids) {
  const int64_t words = block_bytes / static_cast<int64_t>(sizeof(Word));
  const Word* src = reinterpret_cast<const Word*>(pool + src_ids[blockIdx.y] * block_bytes);
  Word* dst = reinterpret_cast<Word*>(pool + dst_ids[blockIdx.y] * block_bytes);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// Token eviction's compaction: CTA (layer, K/V half, KV head) moves that
// region's rows (data and scale-area metadata) from slot from[i] to slot
// to[i] of the sequence, in order i = 0, 1, ...: a compaction moves rows
// down, and a later move may read a row an earlier one has not yet
// overwritten only because the moves run in order, so each CTA finishes a
// move before it starts the next. Different CTAs touch disjoint bytes.
__global__ void MoveKvRowsKernel(KvLayout L, int64_t layer_bytes, int32_t seq,
                                 const int32_t* __restrict__ from, const int32_t* __restrict__ to,
                                 int32_t n) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * layer_bytes + blockIdx.y * L.v_offset;
  const int32_t head = blockIdx.z;
  const int32_t mask = L.block_size - 1;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t f = from[i], t = to[i];
    if (f == t) continue;  // uniform across the CTA
    const int32_t fb = L.BlockOf(seq, f), tb = L.BlockOf(seq, t);
    const uint8_t* src = L.pool + fb * L.block_bytes + base +
                         (static_cast<int64_t>(head) * L.block_size + (f & mask)) * L.row_bytes;
    uint8_t* dst = L.pool + tb * L.block_bytes + base +
                   (static_cast<int64_t>(head) * L.block_size + (t & mask)) * L.row_bytes;
    for (int64_t b = threadIdx.x; b < L.row_bytes; b += blockDim.x) dst[b] = src[b];
    if (L.row_meta_bytes > 0) {
      const uint8_t* ms = L.pool + fb * L.block_bytes + base + L.meta_offset +
                          head * L.head_meta_bytes + (f & mask) * L.row_meta_bytes;
      uint8_t* md = L.pool + tb * L.block_bytes + base + L.meta_offset +
                    head * L.head_meta_bytes + (t & mask) * L.row_meta_bytes;
      for (int64_t b = threadIdx.x; b < L.row_meta_bytes; b += blockDim.x) md[b] = ms[b];
    }
    __syncthreads();  // this move is complete before the next reads
  }
}

// Copies runs of consecutive block ids as one cudaMemcpyAsync each.
template <typename CopyRun>
absl::Status ForEachRun(const int32_t* block_ids, int32_t n_blocks, CopyRun copy_run) {
  int32_t i = 0;
  while (i < n_blocks) {
    int32_t j = i + 1;
    while (j < n_blocks && block_ids[j] == block_ids[j - 1] + 1) ++j;
    if (absl::Status s = copy_run(i, block_ids[i], j - i); !s.ok()) return s;
    i = j;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AppendKv(const kernels::PagedKvView& kv, int32_t layer, int32_t n_tokens,
                      const int32_t* token_seq, const int32_t* token_pos, const float* k,
                      int64_t k_stride, const float* v, int64_t v_stride, StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  KvLayout L;
  if (absl::Status s = internal::MakeKvLayout(kv, layer, &L); !s.ok()) return s;
  const int threads = kv.n_kv_heads * kv.head_dim >= 256 ? 256 : 128;
  switch (kv.dtype) {
    case kernels::KvDType::kF32:
      KVSERVE_CUDA_LAUNCH(n_tokens, threads, 0, stream, AppendKvKernel<float>)(
          L, kv.n_kv_heads, kv.head_dim, token_seq, token_pos, k, k_stride, v, v_stride);
      break;
    case kernels::KvDType::kF16:
      KVSERVE_CUDA_LAUNCH(n_tokens, threads, 0, stream, AppendKvKernel<__half>)(
          L, kv.n_kv_heads, kv.head_dim, token_seq, token_pos, k, k_stride, v, v_stride);
      break;
    case kernels::KvDType::kBF16:
      KVSERVE_CUDA_LAUNCH(n_tokens, threads, 0, stream, AppendKvKernel<__nv_bfloat16>)(
          L, kv.n_kv_heads, kv.head_dim, token_seq, token_pos, k, k_stride, v, v_stride);
      break;
    case kernels::KvDType::kInt8:
    case kernels::KvDType::kFp8E4M3:
    case kernels::KvDType::kFp8E5M2:
    case kernels::KvDType::kInt4:
    case kernels::KvDType::kInt4G64:
      KVSERVE_CUDA_LAUNCH(n_tokens, 128, 0, stream, AppendKvQuantKernel)(L, kv.dtype, kv.n_kv_heads, kv.head_dim,
                                                        token_seq, token_pos, k, k_stride, v,
                                                        v_stride);
      break;
    default:  // MakeKvLayout turned the int4-kivi codecs away
      return absl::UnimplementedError(absl::StrCat(
          "CUDA AppendKv: KV dtype ", std::string(kernels::KvDTypeName(kv.dtype)),
          " is not supported"));
  }
  return LaunchStatus("AppendKv");
}

absl::Status CopyBlocks(uint8_t* pool, int64_t block_bytes, const int32_t* src_ids,
                        const int32_t* dst_ids, int32_t n_pairs, StreamHandle stream) {
  if (n_pairs <= 0) return absl::OkStatus();
  if (n_pairs > 65535) return absl::InvalidArgumentError("CopyBlocks: more than 65535 pairs");
  const bool wide =
      block_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(pool) & 15) == 0;
  const int64_t words = wide ? block_bytes / 16 : block_bytes;
  const unsigned chunks =
      static_cast<unsigned>(std::min<int64_t>(64, std::max<int64_t>(1, words / (256 * 4))));
  const dim3 grid(chunks, static_cast<unsigned>(n_pairs));
  if (wide) {
    KVSERVE_CUDA_LAUNCH(grid, 256, 0, stream, CopyBlocksKernel<uint4>)(pool, block_bytes, src_ids, dst_ids);
  } else {
    KVSERVE_CUDA_LAUNCH(grid, 256, 0, stream, CopyBlocksKernel<uint8_t>)(pool, block_bytes, src_ids, dst_ids);
  }
  return LaunchStatus("CopyBlocks");
}

absl::Status MoveKvRows(const kernels::PagedKvView& kv, int32_t n_layers, int32_t seq,
                        const int32_t* from, const int32_t* to, int32_t n, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KvLayout L;
  if (absl::Status s = internal::MakeKvLayout(kv, 0, &L); !s.ok()) return s;
  if (n_layers <= 0 || static_cast<int64_t>(n_layers) * kv.layer_bytes > kv.block_bytes ||
      seq < 0 || seq >= kv.n_seqs || kv.n_kv_heads > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("MoveKvRows: ", n_layers, " layers, sequence ",
                                                   seq, " of ", kv.n_seqs));
  }
  const dim3 grid(static_cast<unsigned>(n_layers), 2u, static_cast<unsigned>(kv.n_kv_heads));
  KVSERVE_CUDA_LAUNCH(grid, 64, 0, stream, MoveKvRowsKernel)(L, kv.layer_bytes, seq, from, to, n);
  return LaunchStatus("MoveKvRows");
}

absl::Status GatherBlocksToHost(const uint8_t* pool, int64_t block_bytes,
                                const int32_t* block_ids, int32_t n_blocks, void* host,
                                StreamHandle stream) {
  auto* dst = static_cast<uint8_t*>(host);
  return ForEachRun(block_ids, n_blocks, [&](int32_t at, int32_t first, int32_t count) {
    return internal::FromCuda(
        cudaMemcpyAsync(dst + at * block_bytes, pool + first * block_bytes, count * block_bytes,
                        cudaMemcpyDeviceToHost, stream),
        "GatherBlocksToHost");
  });
}

absl::Status ScatterBlocksFromHost(const void* host, int64_t block_bytes,
                                   const int32_t* block_ids, int32_t n_blocks, uint8_t* pool,
                                   StreamHandle stream) {
  const auto* src = static_cast<const uint8_t*>(host);
  return ForEachRun(block_ids, n_blocks, [&](int32_t at, int32_t first, int32_t count) {
    return internal::FromCuda(
        cudaMemcpyAsync(pool + first * block_bytes, src + at * block_bytes, count * block_bytes,
                        cudaMemcpyHostToDevice, stream),
        "ScatterBlocksFromHost");
  });
}

}  // namespace kvserve::cuda
