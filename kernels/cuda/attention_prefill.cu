// Paged prefill attention (cuda_kernels.h): tiled flash attention on CUDA
// cores over the paged KV cache, causal.
//
// One CTA per (sequence, query head, tile of kQ query rows). K and V of the
// sequence stream through shared memory in tiles of kK positions (converted
// to f32 once per tile, 16-byte loads through the block table); each warp
// owns kQ / kWarps query rows and keeps their online-softmax state (max, sum)
// in registers and their output row spread over its lanes. Lane j scores key
// j of the tile, so a K tile row is padded by one float to keep the 32 lanes
// on 32 banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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
constexpr int kQ = 16;  // query rows per CTA
constexpr int kK = 32;  // key positions per tile (one per lane)
constexpr int kRowsPerWarp = kQ / kWarps;

struct PrefillArgs {
  KvLayout kv;
  const int32_t* q_seq_offsets;
  const int32_t* seq_lens;
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  int32_t group;
  int32_t window;  // > 0: a row at position p sees keys (p - window, p]
  float scale;
};

// Codec: the KV codec (kv_codec.cuh); K/V tiles are dequantized into shared
// memory as they are loaded.
template <typename Codec, int HD>
__global__ void __launch_bounds__(kThreads) PrefillKernel(PrefillArgs a) {
  constexpr int E = Codec::kElems;
  constexpr int kVecsPerRow = HD / E;
  constexpr int C = HD / 32;  // output channels per lane

  __shared__ float s_q[kQ][HD];
  __shared__ float s_k[kK][HD + 1];
  __shared__ float s_v[kK][HD];

  const int tile = blockIdx.x;
  const int h = blockIdx.y;
  const int seq = blockIdx.z;
  const int kv_head = h / a.group;
  const int32_t q_begin = a.q_seq_offsets[seq];
  const int32_t n_q = a.q_seq_offsets[seq + 1] - q_begin;
  if (tile * kQ >= n_q) return;
  const int32_t len = a.seq_lens[seq];
  const int32_t pos0 = len - n_q;  // position of query row 0
  const int32_t rows = min(kQ, n_q - tile * kQ);
  const int32_t last_pos = pos0 + tile * kQ + rows - 1;
  // The first key any row of the tile sees (its first row's window); keys
  // before it are never read (a window group's blocks there may be gone).
  const int32_t first_pos =
      a.window > 0 ? max(0, pos0 + tile * kQ - a.window + 1) : 0;

  for (int idx = threadIdx.x; idx < kQ * HD; idx += kThreads) {
    const int r = idx / HD, d = idx % HD;
    s_q[r][d] = r < rows ? Codec::Query(
                               a.q[static_cast<int64_t>(q_begin + tile * kQ + r) * a.q_stride +
                                   static_cast<int64_t>(h) * HD + d])
                         : 0.f;
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][C];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[i][c] = 0.f;
  }

  const int32_t* blocks = a.kv.block_ids + a.kv.seq_block_offsets[seq];
  const int32_t mask = a.kv.block_size - 1;
  for (int32_t k0 = first_pos / kK * kK; k0 <= last_pos; k0 += kK) {
    __syncthreads();  // the previous tile's readers are done (and s_q is written)
    for (int idx = threadIdx.x; idx < kK * kVecsPerRow; idx += kThreads) {
      const int j = idx / kVecsPerRow, c = idx % kVecsPerRow;
      const int32_t pos = k0 + j;
      float kf[E], vf[E];
      if (pos <= last_pos && pos >= first_pos) {
        const int32_t block = blocks[pos >> a.kv.block_shift];
        const uint8_t* row = a.kv.HeadKeys(block, kv_head) +
                             static_cast<int64_t>(pos & mask) * a.kv.row_bytes +
                             c * Codec::kRawBytes;
        RowMeta km{1.f, 0.f}, vm{1.f, 0.f};
        if constexpr (Codec::kHasMeta) {
          const uint8_t* meta = internal::HeadMeta(a.kv, block, kv_head) +
                                static_cast<int64_t>(pos & mask) * a.kv.row_meta_bytes;
          km = Codec::LoadMeta(a.kv, meta, c);
          vm = Codec::LoadMeta(a.kv, meta + a.kv.v_offset, c);
        }
        Codec::ToFloat(Codec::LoadPlain(row), km, a.kv, kf);
        Codec::ToFloat(Codec::LoadPlain(row + a.kv.v_offset), vm, a.kv, vf);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s_k[j][c * E + e] = kf[e];
        s_v[j][c * E + e] = vf[e];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      if (r >= rows) break;  // warp-uniform
      const int32_t qpos = pos0 + tile * kQ + r;
      if (k0 > qpos) continue;  // the whole tile is in this row's future
      // Keys this row sees: (qpos - window, qpos]; a tile wholly before them
      // is skipped, so every tile it folds holds one (m_new is finite).
      const int32_t qfirst = a.window > 0 ? qpos - a.window + 1 : 0;
      if (k0 + kK <= qfirst) continue;
      const int32_t kpos = k0 + lane;
      const bool visible = kpos <= qpos && kpos >= qfirst;
      float s = -INFINITY;
      if (visible) {
        float dot = 0.f;
#pragma unroll 16
        for (int d = 0; d < HD; ++d) dot = fmaf(s_q[r][d], s_k[lane][d], dot);
        s = dot * a.scale;
      }
      float mx = s;
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[i], mx);  // finite: key k0 <= qpos is visible
      const float p = visible ? __expf(s - m_new) : 0.f;
      float sum = p;
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float factor = __expf(m[i] - m_new);
      l[i] = l[i] * factor + sum;
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[i][c] *= factor;
      const int jn = min(kK, qpos - k0 + 1);
      for (int j = 0; j < jn; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
        for (int c = 0; c < C; ++c) acc[i][c] = fmaf(pj, s_v[j][lane + 32 * c], acc[i][c]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= rows) break;
    float* o = a.out + static_cast<int64_t>(q_begin + tile * kQ + r) * a.out_stride +
               static_cast<int64_t>(h) * HD;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) o[lane + 32 * c] = acc[i][c] * inv;
  }
}

}  // namespace

absl::Status PagedPrefillAttention(const kernels::PagedKvView& kv, int32_t layer,
                                   const PrefillAttentionBatch& batch, const float* q,
                                   int64_t q_stride, float* out, int64_t out_stride,
                                   StreamHandle stream) {
  if (kv.n_seqs <= 0 || batch.max_q_per_seq <= 0) return absl::OkStatus();
  KvLayout L;
  if (absl::Status s = internal::MakeKvLayout(kv, layer, &L); !s.ok()) return s;
  if (batch.n_heads <= 0 || batch.n_heads % kv.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedPrefillAttention: ", batch.n_heads,
                                                   " query heads for ", kv.n_kv_heads,
                                                   " KV heads"));
  }
  if (batch.q_seq_offsets == nullptr || batch.seq_lens == nullptr || kv.n_seqs > 65535 ||
      batch.n_heads > 65535) {
    return absl::InvalidArgumentError("PagedPrefillAttention: missing arrays or too many seqs");
  }
  if (batch.window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedPrefillAttention: window ", batch.window, " is negative"));
  }
  PrefillArgs a{L,
                batch.q_seq_offsets,
                batch.seq_lens,
                q,
                q_stride,
                out,
                out_stride,
                batch.n_heads / kv.n_kv_heads,
                batch.window,
                batch.scale};
  const dim3 grid(static_cast<unsigned>((batch.max_q_per_seq + kQ - 1) / kQ),
                  static_cast<unsigned>(batch.n_heads), static_cast<unsigned>(kv.n_seqs));
  return KVSERVE_DISPATCH_KV(kv.dtype, kv.head_dim, {
    if (absl::Status s = internal::CheckKvAlignment(kv, C::kRawBytes, "PagedPrefillAttention");
        !s.ok()) {
      return s;
    }
    KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, PrefillKernel<C, HD>)(a);
    if (absl::Status s = internal::LaunchStatus("PagedPrefillAttention"); !s.ok()) return s;
  });
}

}  // namespace kvserve::cuda
