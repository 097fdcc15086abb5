// Paged decode attention (cuda_kernels.h): flash-decoding over the paged KV
// cache.
//
// One CTA per (token, KV head, query-head tile, context split). Decode is
// bound by reading K and V, so the CTA reads each K/V row of its split exactly
// once for every query head of its GQA group (up to kMaxGroup at a time):
// a row of head_dim elements is split over LPR lanes, each issuing one 16-byte
// load, and kUnroll rows per thread group are loaded before any is used so
// enough bytes are in flight to cover HBM latency. Positions are processed
// in tiles of kTile: scores of the tile go to shared memory, the tile's
// softmax is folded into a running (max, sum, accumulator) state (online
// softmax), and V is accumulated in registers. Splits of a long context run
// in separate CTAs and a second kernel merges their states with the same
// rescaling.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/kv_codec.cuh"
#include "kernels/cuda/kv_device.cuh"

namespace kvserve::cuda {
namespace {

using internal::KvLayout;
using internal::RowMeta;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxGroup = 8;  // query heads per CTA
constexpr int kTile = 256;    // positions per softmax tile
constexpr int kUnroll = 4;    // rows in flight per thread group
// A split covers at least this many positions: shorter ones cost more in the
// merge than they gain in parallelism.
constexpr int kMinSplit = 256;
constexpr int kMaxSplits = 256;

struct DecodeArgs {
  KvLayout kv;
  const int32_t* token_seq;
  const int32_t* token_pos;
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  int32_t group;  // query heads per KV head
  int32_t head_tiles;
  int32_t n_heads;
  int32_t split_len;  // positions per split
  int32_t n_splits;
  int32_t window;  // > 0: each token attends to its last `window` positions
  float scale;
  float* ws_acc;  // [token][head][split][HD]
  float* ws_ml;   // [token][head][split][2]: max, sum
};

// C: the KV codec (kv_codec.cuh): a lane loads C::kRawBytes of a row (and
// the row's scale for quantized codecs) and dequantizes them in registers.
template <typename C, int HD>
__global__ void __launch_bounds__(kThreads) DecodeKernel(DecodeArgs a) {
  constexpr int E = C::kElems;  // elements per lane load
  constexpr int LPR = HD / E;          // lanes per row
  constexpr int RPW = 32 / LPR;        // rows per warp per step
  static_assert(LPR >= 1 && LPR <= 32 && 32 % LPR == 0, "a row must fit one warp");
  constexpr int RPI = kWarps * RPW;    // rows per CTA per step
  constexpr int kStep = RPI * kUnroll;

  __shared__ float s_scores[kMaxGroup][kTile];
  __shared__ float s_m[kMaxGroup], s_l[kMaxGroup], s_factor[kMaxGroup];
  __shared__ float s_red[kWarps][kMaxGroup][HD];

  const int kv_head = blockIdx.x / a.head_tiles;
  const int tile = blockIdx.x % a.head_tiles;
  const int t = blockIdx.y;
  const int split = blockIdx.z;
  const int g0 = tile * kMaxGroup;
  const int n_g = min(kMaxGroup, a.group - g0);
  const int h0 = kv_head * a.group + g0;  // first query head of this CTA

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row_group = warp * RPW + lane / LPR;  // 0..RPI-1
  const int li = lane % LPR;                      // which 16-byte slice of the row

  const int32_t seq = a.token_seq[t];
  const int32_t len = a.token_pos[t] + 1;
  // Splits cover the token's window (all of [0, len) without one); slots
  // before the window are never read.
  const int32_t first = a.window > 0 && len > a.window ? len - a.window : 0;
  const int32_t begin = first + split * a.split_len;
  const int32_t end = min(len, begin + a.split_len);

  float q[kMaxGroup][E];
  float acc[kMaxGroup][E];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[g][e] = 0.f;
      q[g][e] = g < n_g ? C::Query(
                              a.q[t * a.q_stride + static_cast<int64_t>(h0 + g) * HD + li * E + e])
                        : 0.f;
    }
  }
  if (threadIdx.x < kMaxGroup) {
    s_m[threadIdx.x] = -INFINITY;
    s_l[threadIdx.x] = 0.f;
  }

  const int32_t* blocks = a.kv.block_ids + a.kv.seq_block_offsets[seq];
  const int32_t mask = a.kv.block_size - 1;
  // Loads this lane's slice of the key (value: + v_offset) row at pos, and
  // the row's scale when the codec has one.
  auto load = [&](int32_t pos, int64_t half, typename C::Raw* raw, RowMeta* meta) {
    const int32_t block = blocks[pos >> a.kv.block_shift];
    const int32_t slot = pos & mask;
    *raw = C::Load(a.kv.HeadKeys(block, kv_head) + half +
                   static_cast<int64_t>(slot) * a.kv.row_bytes + li * C::kRawBytes);
    if constexpr (C::kHasMeta) {
      *meta = C::LoadMeta(a.kv,
                          internal::HeadMeta(a.kv, block, kv_head) + half +
                              static_cast<int64_t>(slot) * a.kv.row_meta_bytes,
                          li);
    }
  };

  for (int32_t tile_begin = begin; tile_begin < end; tile_begin += kTile) {
    const int32_t tile_n = min(kTile, end - tile_begin);
    // Phase 1: scores of the tile.
    for (int32_t base = 0; base < tile_n; base += kStep) {
      typename C::Raw kraw[kUnroll];
      RowMeta kmeta[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t j = base + u * RPI + row_group;
        kraw[u] = C::Zero();
        kmeta[u] = RowMeta{0.f, 0.f};
        if (j < tile_n) load(tile_begin + j, 0, &kraw[u], &kmeta[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float kf[E];
        C::ToFloat(kraw[u], kmeta[u], a.kv, kf);
        const int32_t j = base + u * RPI + row_group;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= n_g) break;  // uniform over the CTA: the shuffles stay converged
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) dot = fmaf(q[g][e], kf[e], dot);
#pragma unroll
          for (int o = LPR / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          if (li == 0 && j < tile_n) s_scores[g][j] = dot * a.scale;
        }
      }
    }
    __syncthreads();
    // Phase 2: fold the tile into the running softmax state, one warp per head.
    for (int g = warp; g < n_g; g += kWarps) {
      float mx = -INFINITY;
      for (int j = lane; j < tile_n; j += 32) mx = fmaxf(mx, s_scores[g][j]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = s_m[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < tile_n; j += 32) {
        const float p = __expf(s_scores[g][j] - m_new);
        s_scores[g][j] = p;
        sum += p;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) {
        const float factor = __expf(m_old - m_new);  // 0 on the first tile
        s_factor[g] = factor;
        s_l[g] = s_l[g] * factor + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();
    // Phase 3: rescale and accumulate V.
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float f = g < n_g ? s_factor[g] : 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= f;
    }
    for (int32_t base = 0; base < tile_n; base += kStep) {
      typename C::Raw vraw[kUnroll];
      RowMeta vmeta[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t j = base + u * RPI + row_group;
        vraw[u] = C::Zero();
        vmeta[u] = RowMeta{0.f, 0.f};
        if (j < tile_n) load(tile_begin + j, a.kv.v_offset, &vraw[u], &vmeta[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t j = base + u * RPI + row_group;
        if (j >= tile_n) continue;
        float vf[E];
        C::ToFloat(vraw[u], vmeta[u], a.kv, vf);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= n_g) break;
          const float p = s_scores[g][j];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
        }
      }
    }
    __syncthreads();  // s_scores is rewritten by the next tile
  }

  // Reduce the accumulators of the row groups: inside the warp by shuffles
  // (lanes li, li + LPR, ... hold the same channels), then across warps in
  // shared memory in a fixed order (deterministic).
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
#pragma unroll
      for (int o = LPR; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  if (lane < LPR) {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
      for (int e = 0; e < E; ++e) s_red[warp][g][li * E + e] = acc[g][e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < n_g * HD; idx += kThreads) {
    const int g = idx / HD;
    const int d = idx % HD;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_red[w][g][d];
    const int h = h0 + g;
    if (a.n_splits == 1) {
      const float l = s_l[g];
      a.out[t * a.out_stride + static_cast<int64_t>(h) * HD + d] = l > 0.f ? o / l : 0.f;
    } else {
      const int64_t part = (static_cast<int64_t>(t) * a.n_heads + h) * a.n_splits + split;
      a.ws_acc[part * HD + d] = o;
      if (d == 0) {
        a.ws_ml[part * 2] = s_m[g];
        a.ws_ml[part * 2 + 1] = s_l[g];
      }
    }
  }
}

// Merges the split states of one (token, head): one block of HD threads.
template <int HD>
__global__ void MergeSplitsKernel(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                  int32_t n_heads, int32_t n_splits, float* out,
                                  int64_t out_stride) {
  const int t = blockIdx.x / n_heads;
  const int h = blockIdx.x % n_heads;
  const int64_t part0 = static_cast<int64_t>(blockIdx.x) * n_splits;
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) {
    if (ws_ml[(part0 + s) * 2 + 1] > 0.f) m = fmaxf(m, ws_ml[(part0 + s) * 2]);
  }
  const int d = threadIdx.x;
  float l = 0.f, o = 0.f;
  for (int s = 0; s < n_splits; ++s) {
    const float ls = ws_ml[(part0 + s) * 2 + 1];
    if (ls <= 0.f) continue;  // empty split (beyond this token's context)
    const float w = __expf(ws_ml[(part0 + s) * 2] - m);
    l += ls * w;
    o += ws_acc[(part0 + s) * HD + d] * w;
  }
  out[t * out_stride + static_cast<int64_t>(h) * HD + d] = l > 0.f ? o / l : 0.f;
}

struct SplitPlan {
  int32_t head_tiles = 1;
  int32_t n_splits = 1;
  int32_t split_len = 0;
};

SplitPlan PlanSplits(const kernels::PagedKvView& kv, const DecodeAttentionBatch& b) {
  SplitPlan p;
  const int32_t group = kv.n_kv_heads > 0 ? b.n_heads / kv.n_kv_heads : 1;
  p.head_tiles = (group + kMaxGroup - 1) / kMaxGroup;
  // Positions one token attends to at most (its window, when set).
  const int32_t max_ctx =
      std::max(1, b.window > 0 ? std::min(b.max_context, b.window) : b.max_context);
  const int64_t work = static_cast<int64_t>(b.n_tokens) * kv.n_kv_heads * p.head_tiles;
  // About four CTAs per SM keeps every SM streaming; beyond that splitting
  // only adds merge traffic.
  const int64_t target = 4 * static_cast<int64_t>(std::max(1, MultiprocessorCount()));
  int64_t splits = work > 0 ? (target + work - 1) / work : 1;
  splits = std::min<int64_t>(splits, (max_ctx + kMinSplit - 1) / kMinSplit);
  splits = std::clamp<int64_t>(splits, 1, kMaxSplits);
  p.n_splits = static_cast<int32_t>(splits);
  p.split_len = (max_ctx + p.n_splits - 1) / p.n_splits;
  // Whole tiles per split except the last.
  p.split_len = (p.split_len + kTile - 1) / kTile * kTile;
  p.n_splits = (max_ctx + p.split_len - 1) / p.split_len;
  return p;
}

template <typename C, int HD>
absl::Status LaunchDecode(const kernels::PagedKvView& kv, const DecodeArgs& a,
                          const SplitPlan& plan, int32_t n_tokens, int32_t n_heads, float* out,
                          int64_t out_stride, StreamHandle stream) {
  if (absl::Status s = internal::CheckKvAlignment(kv, C::kRawBytes, "PagedDecodeAttention");
      !s.ok()) {
    return s;
  }
  const dim3 grid(static_cast<unsigned>(kv.n_kv_heads * plan.head_tiles),
                  static_cast<unsigned>(n_tokens), static_cast<unsigned>(plan.n_splits));
  KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, DecodeKernel<C, HD>)(a);
  if (plan.n_splits > 1) {
    KVSERVE_CUDA_LAUNCH(static_cast<unsigned>(n_tokens * n_heads), HD, 0, stream,
                        MergeSplitsKernel<HD>)(a.ws_acc, a.ws_ml, n_heads, plan.n_splits, out,
                                               out_stride);
  }
  return internal::LaunchStatus("PagedDecodeAttention");
}

}  // namespace

size_t PagedDecodeAttentionWorkspaceBytes(const kernels::PagedKvView& kv,
                                          const DecodeAttentionBatch& batch) {
  const SplitPlan p = PlanSplits(kv, batch);
  if (p.n_splits <= 1) return 0;
  return static_cast<size_t>(batch.n_tokens) * batch.n_heads * p.n_splits *
         (kv.head_dim + 2) * sizeof(float);
}

absl::Status PagedDecodeAttention(const kernels::PagedKvView& kv, int32_t layer,
                                  const DecodeAttentionBatch& batch, const float* q,
                                  int64_t q_stride, float* out, int64_t out_stride,
                                  void* workspace, size_t workspace_bytes, StreamHandle stream) {
  if (batch.n_tokens <= 0) return absl::OkStatus();
  KvLayout L;
  if (absl::Status s = internal::MakeKvLayout(kv, layer, &L); !s.ok()) return s;
  if (batch.n_heads <= 0 || batch.n_heads % kv.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedDecodeAttention: ", batch.n_heads,
                                                   " query heads for ", kv.n_kv_heads,
                                                   " KV heads"));
  }
  if (batch.max_context <= 0) {
    return absl::InvalidArgumentError("PagedDecodeAttention: max_context must be set");
  }
  if (batch.window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedDecodeAttention: window ", batch.window, " is negative"));
  }
  if (batch.n_tokens > 65535) {
    return absl::InvalidArgumentError("PagedDecodeAttention: more than 65535 tokens");
  }
  const SplitPlan plan = PlanSplits(kv, batch);
  const size_t need = PagedDecodeAttentionWorkspaceBytes(kv, batch);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("PagedDecodeAttention: workspace of ",
                                                   workspace_bytes, " bytes, ", need, " needed"));
  }
  DecodeArgs a;
  a.kv = L;
  a.token_seq = batch.token_seq;
  a.token_pos = batch.token_pos;
  a.q = q;
  a.q_stride = q_stride;
  a.out = out;
  a.out_stride = out_stride;
  a.group = batch.n_heads / kv.n_kv_heads;
  a.head_tiles = plan.head_tiles;
  a.n_heads = batch.n_heads;
  a.split_len = plan.split_len;
  a.n_splits = plan.n_splits;
  a.window = batch.window;
  a.scale = batch.scale;
  const int64_t parts = static_cast<int64_t>(batch.n_tokens) * batch.n_heads * plan.n_splits;
  a.ws_acc = static_cast<float*>(workspace);
  a.ws_ml = plan.n_splits > 1 ? a.ws_acc + parts * kv.head_dim : nullptr;
  // 256-wide heads (Gemma 3 270M-12B): a row is 32 lanes of 8 elements, so
  // every codec with 8-element loads runs here; f32 (4-element loads) would
  // need 64 lanes a row and stays on the generic kernel.
  if (kv.head_dim == 256) {
    using kernels::KvDType;
    switch (kv.dtype) {
      case KvDType::kF16:
        return LaunchDecode<internal::KvCodecF16, 256>(kv, a, plan, batch.n_tokens, batch.n_heads,
                                                       out, out_stride, stream);
      case KvDType::kBF16:
        return LaunchDecode<internal::KvCodecBF16, 256>(kv, a, plan, batch.n_tokens,
                                                        batch.n_heads, out, out_stride, stream);
      case KvDType::kInt8:
      case KvDType::kFp8E4M3:
      case KvDType::kFp8E5M2:
        return LaunchDecode<internal::KvCodecByte, 256>(kv, a, plan, batch.n_tokens,
                                                        batch.n_heads, out, out_stride, stream);
      case KvDType::kInt4:
      case KvDType::kInt4G64:
        return LaunchDecode<internal::KvCodecInt4, 256>(kv, a, plan, batch.n_tokens,
                                                        batch.n_heads, out, out_stride, stream);
      default:
        return absl::UnimplementedError(absl::StrCat(
            "PagedDecodeAttention: head_dim 256 runs f16, bf16, int8, fp8 and int4 K/V, not ",
            std::string(kernels::KvDTypeName(kv.dtype))));
    }
  }
  return KVSERVE_DISPATCH_KV(kv.dtype, kv.head_dim, {
    return LaunchDecode<C, HD>(kv, a, plan, batch.n_tokens, batch.n_heads, out, out_stride,
                               stream);
  });
}

}  // namespace kvserve::cuda
