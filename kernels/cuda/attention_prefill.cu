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
#include <type_traits>

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

// Loads channels [chunk * HC, chunk * HC + HC) of the tile's keys k0 ..
// k0 + kK - 1 into dst[j][0, HC) (values instead of keys with `values`;
// both at once with a non-null dst_v), dequantized; positions outside
// [first_pos, last_pos] are zeros.
template <typename Codec, int HC, int KStride, int VStride>
__device__ __forceinline__ void LoadTile(const PrefillArgs& a, const int32_t* blocks, int kv_head,
                                         int32_t k0, int32_t first_pos, int32_t last_pos,
                                         int chunk, bool values, float (*dst)[KStride],
                                         float (*dst_v)[VStride]) {
  constexpr int E = Codec::kElems;
  constexpr int kVecsPerChunk = HC / E;
  const int32_t mask = a.kv.block_size - 1;
  for (int idx = threadIdx.x; idx < kK * kVecsPerChunk; idx += kThreads) {
    const int j = idx / kVecsPerChunk, cl = idx % kVecsPerChunk;
    const int c = chunk * kVecsPerChunk + cl;  // vector index in the row
    const int32_t pos = k0 + j;
    float kf[E], vf[E];
    if (pos <= last_pos && pos >= first_pos) {
      const int32_t block = blocks[pos >> a.kv.block_shift];
      const uint8_t* row = a.kv.HeadKeys(block, kv_head) +
                           static_cast<int64_t>(pos & mask) * a.kv.row_bytes + c * Codec::kRawBytes;
      const uint8_t* meta = nullptr;
      if constexpr (Codec::kHasMeta) {
        meta = internal::HeadMeta(a.kv, block, kv_head) +
               static_cast<int64_t>(pos & mask) * a.kv.row_meta_bytes;
      }
      auto load = [&](int64_t v_off, int64_t meta_off, float* f) {
        RowMeta m{1.f, 0.f};
        if constexpr (Codec::kHasMeta) m = Codec::LoadMeta(a.kv, meta + meta_off, c);
        Codec::ToFloat(Codec::LoadPlain(row + v_off), m, a.kv, f);
      };
      if (dst_v != nullptr) {
        load(0, 0, kf);
        load(a.kv.v_offset, a.kv.v_offset, vf);
      } else if (values) {
        load(a.kv.v_offset, a.kv.v_offset, kf);
      } else {
        load(0, 0, kf);
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) kf[e] = vf[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) dst[j][cl * E + e] = kf[e];
    if (dst_v != nullptr) {
#pragma unroll
      for (int e = 0; e < E; ++e) dst_v[j][cl * E + e] = vf[e];
    }
  }
}

// Codec: the KV codec (kv_codec.cuh); K/V tiles are dequantized into shared
// memory as they are loaded. Rows of up to 128 channels stage a tile's K and
// V together (64/128: s_q 8 KB, s_k + s_v 32.5 KB); wider rows (Gemma 3's
// 256) would need 81 KB, above the 48 KB a CTA gets without opting in, so
// they stage 128 channels at a time through one buffer: every K chunk
// (scores summed across chunks in channel order, the same order as one
// pass), the softmax, then every V chunk (32.5 KB in all). The arithmetic
// per row is the same either way.
template <typename Codec, int HD>
__global__ void __launch_bounds__(kThreads) PrefillKernel(PrefillArgs a) {
  constexpr int HC = HD < 128 ? HD : 128;  // channels staged at once
  constexpr int kChunks = HD / HC;
  constexpr int C = HD / 32;   // output channels per lane
  constexpr int CC = HC / 32;  // of them in one chunk
  static_assert(HD % HC == 0 && HC % 32 == 0, "head dim must be a multiple of 32");

  __shared__ float s_q[kQ][HD];
  __shared__ float s_k[kK][HC + 1];
  // V's own tile when one chunk holds the row; otherwise V reuses s_k.
  __shared__ float s_v[kChunks == 1 ? kK : 1][HC];

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
  for (int32_t k0 = first_pos / kK * kK; k0 <= last_pos; k0 += kK) {
    // Which of the warp's rows fold this tile (warp-uniform): a row whose
    // future holds the whole tile, or whose window (qpos - window, qpos]
    // starts after it, skips it, so every tile a row folds holds one
    // visible key (m_new is finite).
    bool live[kRowsPerWarp];
    bool visible[kRowsPerWarp];
    float dot[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      const int32_t qpos = pos0 + tile * kQ + r;
      const int32_t qfirst = a.window > 0 ? qpos - a.window + 1 : 0;
      live[i] = r < rows && k0 <= qpos && k0 + kK > qfirst;
      const int32_t kpos = k0 + lane;
      visible[i] = live[i] && kpos <= qpos && kpos >= qfirst;
      dot[i] = 0.f;
    }
    // Scores: lane j scores key j, chunk by chunk.
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      __syncthreads();  // the previous readers of s_k/s_v are done (and s_q is written)
      LoadTile<Codec, HC, HC + 1, HC>(a, blocks, kv_head, k0, first_pos, last_pos, ch, false, s_k,
                                      kChunks == 1 ? s_v : nullptr);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        if (!visible[i]) continue;
        const int r = warp * kRowsPerWarp + i;
#pragma unroll 16
        for (int d = 0; d < HC; ++d) dot[i] = fmaf(s_q[r][ch * HC + d], s_k[lane][d], dot[i]);
      }
    }
    // Online softmax per row.
    float p[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      p[i] = 0.f;
      if (!live[i]) continue;
      const float s = visible[i] ? dot[i] * a.scale : -INFINITY;
      float mx = s;
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[i], mx);  // finite: the tile holds a visible key
      p[i] = visible[i] ? __expf(s - m_new) : 0.f;
      float sum = p[i];
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float factor = __expf(m[i] - m_new);
      l[i] = l[i] * factor + sum;
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[i][c] *= factor;
    }
    // Values, chunk by chunk (one chunk: already in s_v).
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      if constexpr (kChunks > 1) {
        __syncthreads();
        LoadTile<Codec, HC, HC + 1, HC>(a, blocks, kv_head, k0, first_pos, last_pos, ch, true,
                                        s_k, nullptr);
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        if (!live[i]) continue;
        const int32_t qpos = pos0 + tile * kQ + warp * kRowsPerWarp + i;
        const int jn = min(kK, qpos - k0 + 1);
        for (int j = 0; j < jn; ++j) {
          const float pj = __shfl_sync(0xffffffffu, p[i], j);
#pragma unroll
          for (int c = 0; c < CC; ++c) {
            const float v = kChunks == 1 ? s_v[j][lane + 32 * c] : s_k[j][lane + 32 * c];
            acc[i][ch * CC + c] = fmaf(pj, v, acc[i][ch * CC + c]);
          }
        }
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
  auto launch = [&](auto codec, auto head_dim) -> absl::Status {
    using C = decltype(codec);
    constexpr int HD = decltype(head_dim)::value;
    if (absl::Status s = internal::CheckKvAlignment(kv, C::kRawBytes, "PagedPrefillAttention");
        !s.ok()) {
      return s;
    }
    KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, PrefillKernel<C, HD>)(a);
    return internal::LaunchStatus("PagedPrefillAttention");
  };
  // 256-wide heads (Gemma 3 270M-12B), every codec: the kernel stages them
  // in 128-channel chunks.
  if (kv.head_dim == 256) {
    using kernels::KvDType;
    using HD256 = std::integral_constant<int, 256>;
    switch (kv.dtype) {
      case KvDType::kF32: return launch(internal::KvCodecF32{}, HD256{});
      case KvDType::kF16: return launch(internal::KvCodecF16{}, HD256{});
      case KvDType::kBF16: return launch(internal::KvCodecBF16{}, HD256{});
      case KvDType::kInt8:
      case KvDType::kFp8E4M3:
      case KvDType::kFp8E5M2: return launch(internal::KvCodecByte{}, HD256{});
      case KvDType::kInt4:
      case KvDType::kInt4G64: return launch(internal::KvCodecInt4{}, HD256{});
      default:
        return absl::UnimplementedError(
            absl::StrCat("PagedPrefillAttention: KV dtype ",
                         std::string(kernels::KvDTypeName(kv.dtype)), " is not supported"));
    }
  }
  return KVSERVE_DISPATCH_KV(kv.dtype, kv.head_dim, {
    if (absl::Status s = launch(C{}, std::integral_constant<int, HD>{}); !s.ok()) return s;
  });
}

}  // namespace kvserve::cuda
