// Attention over the paged KV cache for a ragged batch: each query token
// belongs to a sequence and sits at a position; it attends causally to
// positions [0, pos] of its own sequence, reading K/V through the block
// table. Prefill chunks and single decode tokens are the same case.
#pragma once

#include <cstdint>

#include "common/thread_pool.h"
#include "kernels/kv_view.h"

namespace kvserve::kernels {

struct AttentionBatch {
  int32_t n_tokens = 0;
  const int32_t* token_seq = nullptr;  // sequence index (into the view) per token
  const int32_t* token_pos = nullptr;  // position per token
  int32_t n_heads = 0;                 // query heads; n_heads % n_kv_heads == 0 (GQA)
  float scale = 1.0f;                  // usually 1/sqrt(head_dim)
  // Sliding-window attention: > 0, a token at slot p attends only to slots
  // [p - window + 1, p] (slots before are never read, so their blocks may be
  // gone). 0: all of [0, p].
  int32_t window = 0;
};

// Encodes (for int8/fp8/int4 caches: quantizes, scales included) and writes
// K and V of n_tokens new tokens (token t of sequence token_seq[t] at
// position token_pos[t]) into their slots. k/v rows hold n_kv_heads*head_dim
// floats, k_stride/v_stride floats apart. int4-kivi keys share per-channel
// ranges over a block, so their appends may re-encode earlier keys of the
// same block. REQUIRES (int4-kivi): each block is filled in position order.
void AppendKv(const PagedKvView& kv, int32_t layer, int32_t n_tokens, const int32_t* token_seq,
              const int32_t* token_pos, const float* k, int64_t k_stride, const float* v,
              int64_t v_stride);

// q rows: n_heads*head_dim floats, q_stride apart; out rows likewise.
// REQUIRES: K/V for every attended position have been appended.
// With batch.window > 0 every path (f16 two-pass and its split, the
// flash-decoding chunks, the quantized tiles) starts at each token's window;
// nothing before it is read.
void PagedAttention(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                    const float* q, int64_t q_stride, float* out, int64_t out_stride,
                    ThreadPool* pool);

// Testing: while alive, an f16 cache with a pool of more than one thread
// takes the split path (each pair's steps spread over the threads) when
// `split`, and one thread per pair otherwise, whatever the batch. The two
// must agree bit for bit. Not thread-safe with concurrent PagedAttention.
class ScopedF16SplitForTesting {
 public:
  explicit ScopedF16SplitForTesting(bool split);
  ~ScopedF16SplitForTesting();
  ScopedF16SplitForTesting(const ScopedF16SplitForTesting&) = delete;
  ScopedF16SplitForTesting& operator=(const ScopedF16SplitForTesting&) = delete;

 private:
  int previous_;
};

// Plain loops, single-threaded, two-pass softmax: the reference. With an f16
// cache the query and the normalized probabilities are rounded to f16, as the
// fast path does (f16 operands, wider accumulation). Quantized caches are
// read through the plain-loop ReadKvRow (kernels/cpu/kv_codec.h).
void PagedAttentionReference(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                             const float* q, int64_t q_stride, float* out, int64_t out_stride);

// Heavy-hitter statistics (H2O): for every query token and query head, adds
// the softmax weight each attended slot [0, token_pos] receives to
// mass[(token_seq * n_kv_heads + kv_head) * mass_stride + slot], query heads
// summed into their KV head. Plain loops over the same scores as the
// reference; it runs beside PagedAttention only when a caller asks for the
// mass, so attention without it costs nothing extra. With `seq_wanted` (one
// flag per view sequence), only the flagged sequences' tokens are scored.
// REQUIRES: K/V appended as for PagedAttention; mass_stride > every token_pos.
void AccumulateAttentionMass(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                             const float* q, int64_t q_stride, float* mass, int64_t mass_stride,
                             const uint8_t* seq_wanted = nullptr);

}  // namespace kvserve::kernels
