// Heavy-hitter statistics (H2O) on the device: the CUDA twin of
// kernels::AccumulateAttentionMass (kernels/cpu/attention.h), for every KV
// codec the CUDA kernels read. It runs beside the attention kernels only when
// a batch asks for the mass (ForwardBatch::attention_mass), so attention
// without it costs nothing. Plain C++ header.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"

namespace kvserve::cuda {

// For every token t (of n_tokens; token_seq/token_pos are device arrays)
// whose sequence is wanted (seq_wanted: one int per view sequence, nonzero
// = wanted; null = all), and every query head h, adds the softmax weight each
// slot [0, token_pos[t]] receives to
//   mass[(token_seq[t] * kv.n_kv_heads + h / group) * mass_stride + slot],
// query heads summed into their KV head (GQA: n_heads % kv.n_kv_heads == 0).
// mass is device memory; the sums are deterministic (one thread owns each
// slot of a (sequence, KV head) row, tokens and heads in batch order).
// The view is device memory; codecs f32, f16, bf16, int8, fp8, int4 with
// head_dim a multiple of 8 up to 256. With an f16 cache the query is rounded
// to f16, as the reference does.
// REQUIRES: K/V appended for every slot read; mass_stride > every token_pos.
absl::Status AccumulateAttentionMass(const kernels::PagedKvView& kv, int32_t layer,
                                     int32_t n_tokens, const int32_t* token_seq,
                                     const int32_t* token_pos, int32_t n_heads, float scale,
                                     const float* q, int64_t q_stride, const int32_t* seq_wanted,
                                     float* mass, int64_t mass_stride, StreamHandle stream);

}  // namespace kvserve::cuda
