// Paged attention for head dims the tuned kernels (attention_decode.cu,
// attention_prefill.cu: 64 and 128) do not cover, e.g. stories260K's 8:
// correct for any even head_dim up to kGenericMaxHeadDim and any ragged
// batch, built for small models and tests, not for speed. Plain C++ header.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"

namespace kvserve::cuda {

inline constexpr int32_t kGenericMaxHeadDim = 256;

// Token t (of n_tokens; token_seq/token_pos are device arrays) attends
// causally to positions [0, token_pos[t]] of sequence token_seq[t] (with
// window > 0, only to the last `window` of them: [token_pos[t] - window + 1,
// token_pos[t]], as kernels::AttentionBatch::window; earlier slots are never
// read, so their blocks may be gone) for each
// of n_heads query heads (GQA: n_heads % kv.n_kv_heads == 0). The view is
// device memory (pool, block_ids, seq_block_offsets); codecs f32, f16, bf16.
// With an f16 cache the query and the normalized probabilities are rounded to
// f16 before they meet K and V, as kernels::PagedAttentionReference does.
// CPU twin: kernels::PagedAttention.
absl::Status PagedAttentionGeneric(const kernels::PagedKvView& kv, int32_t layer, int32_t n_tokens,
                                   const int32_t* token_seq, const int32_t* token_pos,
                                   int32_t n_heads, float scale, const float* q, int64_t q_stride,
                                   float* out, int64_t out_stride, int32_t window,
                                   StreamHandle stream);

}  // namespace kvserve::cuda
