// See attention_generic.h. One CTA per (token, query head): three passes over
// the context (max, sum of exponentials, weighted values), recomputing the
// scores instead of storing them, so any context length fits. Self-contained
// layout math (kernels/kv_view.h) for the float codecs.
#include "kernels/cuda/attention_generic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"

namespace kvserve::cuda {
namespace {

constexpr int kThreads = 256;

struct GenericArgs {
  const uint8_t* pool;
  int64_t block_bytes;
  int64_t layer_offset;
  int64_t v_offset;
  int64_t row_bytes;
  int32_t block_size;
  const int32_t* block_ids;
  const int32_t* seq_block_offsets;
  const int32_t* token_seq;
  const int32_t* token_pos;
  int32_t head_dim;
  int32_t group;
  int32_t window;  // > 0: only the last `window` positions
  float scale;
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
};

template <kernels::KvDType D>
__device__ __forceinline__ float LoadElem(const uint8_t* row, int32_t i) {
  if constexpr (D == kernels::KvDType::kF32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (D == kernels::KvDType::kF16) {
    return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(row)[i]));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(reinterpret_cast<const unsigned short*>(row)[i]));
  }
}

__device__ __forceinline__ float RoundF16(float x) { return __half2float(__float2half_rn(x)); }

__device__ __forceinline__ const uint8_t* KeyRow(const GenericArgs& a, int32_t seq, int32_t pos,
                                                 int32_t kvh) {
  const int32_t block = a.block_ids[a.seq_block_offsets[seq] + pos / a.block_size];
  return a.pool + static_cast<int64_t>(block) * a.block_bytes + a.layer_offset +
         (static_cast<int64_t>(kvh) * a.block_size + pos % a.block_size) * a.row_bytes;
}

template <kernels::KvDType D>
__global__ void __launch_bounds__(kThreads) GenericAttentionKernel(GenericArgs a) {
  __shared__ float qs[kGenericMaxHeadDim];
  __shared__ float ws[kThreads];
  __shared__ float red[kThreads];
  const int32_t t = blockIdx.x;
  const int32_t h = blockIdx.y;
  const int32_t hd = a.head_dim;
  const int32_t kvh = h / a.group;
  const int32_t seq = a.token_seq[t];
  const int32_t len = a.token_pos[t] + 1;
  const int32_t begin = a.window > 0 && len > a.window ? len - a.window : 0;
  const float* qh = a.q + t * a.q_stride + static_cast<int64_t>(h) * hd;
  for (int32_t i = threadIdx.x; i < hd; i += kThreads) {
    qs[i] = D == kernels::KvDType::kF16 ? RoundF16(qh[i]) : qh[i];
  }
  __syncthreads();

  auto score = [&](int32_t p) {
    const uint8_t* k = KeyRow(a, seq, p, kvh);
    float s = 0.0f;
    for (int32_t i = 0; i < hd; ++i) s += qs[i] * LoadElem<D>(k, i);
    return s * a.scale;
  };

  float mx = -FLT_MAX;
  for (int32_t p = begin + threadIdx.x; p < len; p += kThreads) mx = fmaxf(mx, score(p));
  mx = internal::BlockReduce<kThreads, true>(mx, red);
  float sum = 0.0f;
  for (int32_t p = begin + threadIdx.x; p < len; p += kThreads) sum += expf(score(p) - mx);
  sum = internal::BlockReduce<kThreads, false>(sum, red);
  const float inv = 1.0f / sum;

  // Weighted values: tiles of kThreads positions; thread (lane, channel)
  // accumulates its channel over the tile's positions lane, lane + lanes, ...
  const int32_t lanes = kThreads / hd;
  const int32_t c = threadIdx.x % hd;
  const int32_t lane = threadIdx.x / hd;
  float acc = 0.0f;
  for (int32_t base = begin; base < len; base += kThreads) {
    const int32_t p = base + threadIdx.x;
    float w = 0.0f;
    if (p < len) {
      w = expf(score(p) - mx) * inv;
      if (D == kernels::KvDType::kF16) w = RoundF16(w);
    }
    __syncthreads();
    ws[threadIdx.x] = w;
    __syncthreads();
    const int32_t n = min(kThreads, len - base);
    if (lane < lanes) {
      for (int32_t j = lane; j < n; j += lanes) {
        const uint8_t* v = KeyRow(a, seq, base + j, kvh) + a.v_offset;
        acc += ws[j] * LoadElem<D>(v, c);
      }
    }
  }
  __syncthreads();
  red[threadIdx.x] = lane < lanes ? acc : 0.0f;
  __syncthreads();
  if (lane == 0) {
    float o = 0.0f;
    for (int32_t l = 0; l < lanes; ++l) o += red[l * hd + c];
    a.out[t * a.out_stride + static_cast<int64_t>(h) * hd + c] = o;
  }
}

}  // namespace

absl::Status PagedAttentionGeneric(const kernels::PagedKvView& kv, int32_t layer, int32_t n_tokens,
                                   const int32_t* token_seq, const int32_t* token_pos,
                                   int32_t n_heads, float scale, const float* q, int64_t q_stride,
                                   float* out, int64_t out_stride, int32_t window,
                                   StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedAttentionGeneric: window ", window, " is negative"));
  }
  if (kv.head_dim <= 0 || kv.head_dim > kGenericMaxHeadDim || kv.n_kv_heads <= 0 || n_heads <= 0 ||
      n_heads % kv.n_kv_heads != 0 || n_heads > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttentionGeneric: head_dim ", kv.head_dim,
                                                   ", ", n_heads, " query heads for ",
                                                   kv.n_kv_heads, " KV heads"));
  }
  if (kv.pool == nullptr || kv.block_ids == nullptr || kv.seq_block_offsets == nullptr ||
      kv.block_size <= 0 || layer < 0 ||
      (static_cast<int64_t>(layer) + 1) * kv.layer_bytes > kv.block_bytes) {
    return absl::InvalidArgumentError(
        "PagedAttentionGeneric: incomplete KV view or layer out of range");
  }
  GenericArgs a{kv.pool,
                kv.block_bytes,
                static_cast<int64_t>(layer) * kv.layer_bytes,
                kv.layer_bytes / 2,
                kv.RowBytes(),
                kv.block_size,
                kv.block_ids,
                kv.seq_block_offsets,
                token_seq,
                token_pos,
                kv.head_dim,
                n_heads / kv.n_kv_heads,
                window,
                scale,
                q,
                q_stride,
                out,
                out_stride};
  const dim3 grid(static_cast<unsigned>(n_tokens), static_cast<unsigned>(n_heads));
  switch (kv.dtype) {
    case kernels::KvDType::kF32:
      KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, GenericAttentionKernel<kernels::KvDType::kF32>)(a);
      break;
    case kernels::KvDType::kF16:
      KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, GenericAttentionKernel<kernels::KvDType::kF16>)(a);
      break;
    case kernels::KvDType::kBF16:
      KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, GenericAttentionKernel<kernels::KvDType::kBF16>)(a);
      break;
    default:
      return absl::UnimplementedError(absl::StrCat("PagedAttentionGeneric: KV dtype ",
                                                   std::string(kernels::KvDTypeName(kv.dtype)),
                                                   " (f32, f16, bf16 only)"));
  }
  return internal::LaunchStatus("PagedAttentionGeneric");
}

}  // namespace kvserve::cuda
