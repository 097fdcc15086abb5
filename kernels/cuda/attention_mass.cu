// See attention_mass.h. One CTA per (sequence, KV head): it walks the batch's
// tokens of its sequence in order and, per query head of the KV head's group,
// makes three passes over the context (max, sum of exponentials, then each
// slot's weight added to the mass row), recomputing the scores instead of
// storing them, so any context length fits. Thread i owns slots i, i + T, ...
// of the row for the whole launch, so no atomics are needed and the sums do
// not depend on scheduling. Not built for speed: H2O sequences only.
#include "kernels/cuda/attention_mass.h"

#include <cfloat>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_codec.cuh"
#include "kernels/cuda/launch.cuh"

namespace kvserve::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 256;

struct MassArgs {
  internal::KvLayout kv;
  int32_t head_dim;
  int32_t n_kv_heads;
  int32_t group;
  int32_t n_tokens;
  const int32_t* token_seq;
  const int32_t* token_pos;
  const int32_t* seq_wanted;
  float scale;
  const float* q;
  int64_t q_stride;
  float* mass;
  int64_t mass_stride;
};

template <typename C>
__global__ void __launch_bounds__(kThreads) AttentionMassKernel(MassArgs a) {
  __shared__ float qs[kMaxHeadDim];
  __shared__ float red[kThreads / 32];
  const int32_t seq = blockIdx.x;
  const int32_t kvh = blockIdx.y;
  if (a.seq_wanted != nullptr && a.seq_wanted[seq] == 0) return;
  const int32_t hd = a.head_dim;
  const int32_t slices = hd / C::kElems;
  const int32_t mask = a.kv.block_size - 1;
  float* m = a.mass + (static_cast<int64_t>(seq) * a.n_kv_heads + kvh) * a.mass_stride;

  // q (in qs) against the key row of slot p, dequantized as it is read.
  auto score = [&](int32_t p) {
    const int32_t block = a.kv.BlockOf(seq, p);
    const int32_t slot = p & mask;
    const uint8_t* row = a.kv.HeadKeys(block, kvh) + static_cast<int64_t>(slot) * a.kv.row_bytes;
    float s = 0.0f;
    for (int32_t li = 0; li < slices; ++li) {
      const typename C::Raw raw = C::LoadPlain(row + li * C::kRawBytes);
      internal::RowMeta meta{1.0f, 0.0f};
      if constexpr (C::kHasMeta) {
        meta = C::LoadMeta(
            a.kv,
            internal::HeadMeta(a.kv, block, kvh) + static_cast<int64_t>(slot) * a.kv.row_meta_bytes,
            li);
      }
      float f[C::kElems];
      C::ToFloat(raw, meta, a.kv, f);
      for (int e = 0; e < C::kElems; ++e) s += qs[li * C::kElems + e] * f[e];
    }
    return s * a.scale;
  };

  for (int32_t t = 0; t < a.n_tokens; ++t) {
    if (a.token_seq[t] != seq) continue;
    const int32_t len = a.token_pos[t] + 1;
    for (int32_t g = 0; g < a.group; ++g) {
      const float* qh = a.q + t * a.q_stride + static_cast<int64_t>(kvh * a.group + g) * hd;
      __syncthreads();  // qs of the previous head is no longer read
      for (int32_t i = threadIdx.x; i < hd; i += kThreads) qs[i] = C::Query(qh[i]);
      __syncthreads();
      float mx = -FLT_MAX;
      for (int32_t p = threadIdx.x; p < len; p += kThreads) mx = fmaxf(mx, score(p));
      mx = internal::BlockReduce<kThreads, true>(mx, red);
      float sum = 0.0f;
      for (int32_t p = threadIdx.x; p < len; p += kThreads) sum += expf(score(p) - mx);
      sum = internal::BlockReduce<kThreads, false>(sum, red);
      const float inv = 1.0f / sum;
      for (int32_t p = threadIdx.x; p < len; p += kThreads) m[p] += expf(score(p) - mx) * inv;
    }
  }
}

}  // namespace

absl::Status AccumulateAttentionMass(const kernels::PagedKvView& kv, int32_t layer,
                                     int32_t n_tokens, const int32_t* token_seq,
                                     const int32_t* token_pos, int32_t n_heads, float scale,
                                     const float* q, int64_t q_stride, const int32_t* seq_wanted,
                                     float* mass, int64_t mass_stride, StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (kv.head_dim <= 0 || kv.head_dim > kMaxHeadDim || kv.head_dim % 8 != 0 || kv.n_kv_heads <= 0 ||
      kv.n_kv_heads > 65535 || n_heads <= 0 || n_heads % kv.n_kv_heads != 0 || kv.n_seqs <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AccumulateAttentionMass: head_dim ", kv.head_dim, " (a multiple of 8 up to ",
                     kMaxHeadDim, "), ", n_heads, " query heads for ", kv.n_kv_heads, " KV heads, ",
                     kv.n_seqs, " sequences"));
  }
  if (mass == nullptr || mass_stride <= 0) {
    return absl::InvalidArgumentError("AccumulateAttentionMass: no mass rows");
  }
  internal::KvLayout layout;
  RETURN_IF_ERROR(internal::MakeKvLayout(kv, layer, &layout));
  MassArgs a{layout,     kv.head_dim, kv.n_kv_heads, n_heads / kv.n_kv_heads,
             n_tokens,   token_seq,   token_pos,     seq_wanted,
             scale,      q,           q_stride,      mass,
             mass_stride};
  const dim3 grid(static_cast<unsigned>(kv.n_seqs), static_cast<unsigned>(kv.n_kv_heads));
  auto launch = [&](auto codec) -> absl::Status {
    using C = decltype(codec);
    RETURN_IF_ERROR(internal::CheckKvAlignment(kv, C::kRawBytes, "AccumulateAttentionMass"));
    KVSERVE_CUDA_LAUNCH(grid, kThreads, 0, stream, AttentionMassKernel<C>)(a);
    return absl::OkStatus();
  };
  switch (kv.dtype) {
    case kernels::KvDType::kF32:
      RETURN_IF_ERROR(launch(internal::KvCodecF32{}));
      break;
    case kernels::KvDType::kF16:
      RETURN_IF_ERROR(launch(internal::KvCodecF16{}));
      break;
    case kernels::KvDType::kBF16:
      RETURN_IF_ERROR(launch(internal::KvCodecBF16{}));
      break;
    case kernels::KvDType::kInt8:
    case kernels::KvDType::kFp8E4M3:
    case kernels::KvDType::kFp8E5M2:
      RETURN_IF_ERROR(launch(internal::KvCodecByte{}));
      break;
    case kernels::KvDType::kInt4:
    case kernels::KvDType::kInt4G64:
      RETURN_IF_ERROR(launch(internal::KvCodecInt4{}));
      break;
    default:
      return absl::UnimplementedError(absl::StrCat("AccumulateAttentionMass: KV dtype ",
                                                   std::string(kernels::KvDTypeName(kv.dtype)),
                                                   " is not supported"));
  }
  return internal::LaunchStatus("AccumulateAttentionMass");
}

}  // namespace kvserve::cuda
