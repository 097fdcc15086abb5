// Host launchers of the CUDA kernels of the Llama forward. Plain C++ header
// (no CUDA types) so callers compile with g++; builds without CUDA link
// cuda_stub.cc and get Unavailable from every launcher.
//
// Conventions:
// - Every pointer argument is device memory unless its comment says "host".
// - Launchers enqueue on `stream` and return without synchronizing; the
//   Status reports bad arguments and launch errors, not faults of the kernel
//   itself (those surface at the next synchronization).
// - Each launcher has the same contract as its CPU twin in kernels/cpu/ (named
//   in its comment); tests compare them with normalized error thresholds.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/dtype.h"
#include "kernels/kv_view.h"

namespace kvserve::cuda {

// ---- Element-wise and normalization ----

// out[t] = dequantized row tokens[t] of a [vocab][dim] table, for t <
// n_tokens. Table types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (dim a multiple of
// 32 for the block types). Token ids outside [0, vocab) produce zero rows
// (the caller validates ids on the host; the kernel must not read out of
// bounds). CPU twin: kernels::DequantizeRow per token.
absl::Status EmbeddingGather(kernels::DType table_type, const void* table, int64_t vocab,
                             int64_t dim, const int32_t* tokens, int64_t n_tokens, float* out,
                             StreamHandle stream);

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for n_rows rows of n
// (row-contiguous). out may alias x. CPU twin: kernels::RmsNorm.
absl::Status RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                     float* out, StreamHandle stream);

// Rotary embedding in place over n_tokens rows (stride floats apart) of
// n_heads heads of p.head_dim; token t sits at positions[t]. Both layouts of
// kernels::RopeStyle (kNorm: adjacent pairs, GGUF llama; kNeox: halves).
// Angles follow ggml's float recurrence as kernels::Rope does, divided by
// p.freq_factors[i] (Llama 3's rope scaling) when set: here a DEVICE array
// of rot_dim / 2 floats (the CPU twin takes a host one).
absl::Status Rope(float* x, int64_t n_tokens, int64_t stride, int32_t n_heads,
                  const int32_t* positions, const kernels::RopeParams& p, StreamHandle stream);

// out[i] = silu(gate[i]) * up[i]; out may alias gate. CPU twin: kernels::SiluMul.
absl::Status SiluMul(const float* gate, const float* up, int64_t n, float* out,
                     StreamHandle stream);

// out[i] = gelu(gate[i]) * up[i], GELU's tanh form with ggml's CPU rounding
// points (gate and GELU rounded to f16; <= -10 -> 0, >= 10 -> gate), Gemma's
// GEGLU; out may alias gate. CPU twin: kernels::GeluTanhMul.
absl::Status GeluTanhMul(const float* gate, const float* up, int64_t n, float* out,
                         StreamHandle stream);

// x[r * n + i] += bias[i] for r < n_rows (Qwen2's Q/K/V biases). CPU twin:
// kernels::AddInPlace per row.
absl::Status AddRowBias(float* x, const float* bias, int64_t n_rows, int64_t n,
                        StreamHandle stream);

// x[i] *= s (Gemma's embedding scale).
absl::Status ScaleInPlace(float* x, float s, int64_t n, StreamHandle stream);

// x[i] = cap * tanh(x[i] / cap), cap > 0 (final logit soft-capping).
absl::Status SoftcapInPlace(float* x, float cap, int64_t n, StreamHandle stream);

// x[i] += y[i] (the residual add). CPU twin: kernels::AddInPlace.
absl::Status AddInPlace(float* x, const float* y, int64_t n, StreamHandle stream);

// out_ids[r] = argmax over logits[r * stride .. + vocab) (lowest index on
// ties; NaN never wins) for r < n_rows: greedy sampling without copying the
// logits back.
absl::Status ArgmaxRows(const float* logits, int64_t n_rows, int64_t vocab, int64_t stride,
                        int32_t* out_ids, StreamHandle stream);

// Converts n floats to IEEE half / bfloat16 (round to nearest even), as the
// matmul does with activations.
absl::Status ConvertF32ToF16(const float* in, int64_t n, uint16_t* out, StreamHandle stream);
absl::Status ConvertF32ToBF16(const float* in, int64_t n, uint16_t* out, StreamHandle stream);

// ---- Paged KV cache ----
//
// The view is kernels::PagedKvView with device pointers: kv.pool is the
// device pool (same block layout as cache/KvPool, so a block copies
// byte-identically between tiers), kv.block_ids / kv.seq_block_offsets are
// device arrays. CUDA supports f32, f16, bf16, int8, fp8-e4m3, fp8-e5m2, int4
// and int4-g64 (kv_codec.cuh: AppendKv quantizes byte-identically to
// kernels::QuantizeRow, attention dequantizes as it reads); int4-kivi and
// int4-kivi-g64 return Unimplemented. Block size: any power of two.

// Writes K and V of n_tokens new tokens (token t of sequence token_seq[t] at
// position token_pos[t]). CPU twin: kernels::AppendKv.
absl::Status AppendKv(const kernels::PagedKvView& kv, int32_t layer, int32_t n_tokens,
                      const int32_t* token_seq, const int32_t* token_pos, const float* k,
                      int64_t k_stride, const float* v, int64_t v_stride, StreamHandle stream);

// A ragged batch of query tokens, each attending causally to positions
// [0, token_pos[t]] of sequence token_seq[t] (device arrays).
struct DecodeAttentionBatch {
  int32_t n_tokens = 0;
  const int32_t* token_seq = nullptr;
  const int32_t* token_pos = nullptr;
  int32_t n_heads = 0;      // query heads; n_heads % kv.n_kv_heads == 0
  float scale = 1.0f;       // usually 1/sqrt(head_dim)
  int32_t max_context = 0;  // host-side bound on token_pos[t] + 1; sizes the split
  // Sliding window (kernels::AttentionBatch::window): > 0, token t attends
  // only to [token_pos[t] - window + 1, token_pos[t]]; earlier slots are
  // never read. 0: all of them.
  int32_t window = 0;
};

// Device scratch (bytes) PagedDecodeAttention needs for this batch: the
// partial softmax states of a split context (0 when it will not split).
size_t PagedDecodeAttentionWorkspaceBytes(const kernels::PagedKvView& kv,
                                          const DecodeAttentionBatch& batch);

// Decode-shaped attention (any ragged batch works; built for one query token
// per sequence): one CTA per (token, KV head, context split) reads the keys
// and values of its split once for every query head of the group (GQA) with
// 16-byte loads, keeps an online softmax over tiles of positions, and a
// second kernel merges the splits (flash-decoding). Head dims 64 and 128,
// and 256 (Gemma 3) for every codec but f32. workspace: at least PagedDecodeAttentionWorkspaceBytes (may be null when
// that is 0). q/out rows: n_heads*head_dim floats, q_stride/out_stride apart.
// CPU twin: kernels::PagedAttention.
absl::Status PagedDecodeAttention(const kernels::PagedKvView& kv, int32_t layer,
                                  const DecodeAttentionBatch& batch, const float* q,
                                  int64_t q_stride, float* out, int64_t out_stride,
                                  void* workspace, size_t workspace_bytes, StreamHandle stream);

// Prefill chunks: sequence s (of kv.n_seqs) contributes query rows
// [q_seq_offsets[s], q_seq_offsets[s+1]) (device CSR) at consecutive positions
// ending at seq_lens[s] - 1 (device; the KV length after this chunk's
// append). Causal. Tiled flash attention: each CTA takes a tile of query rows
// of one head, streams K/V tiles of its sequence through shared memory and
// keeps an online softmax. max_q_per_seq: host bound on any sequence's query
// rows (sizes the grid). Head dims 64, 128 and 256 (staged 128 channels at
// a time). CPU twin: kernels::PagedAttention.
struct PrefillAttentionBatch {
  const int32_t* q_seq_offsets = nullptr;
  const int32_t* seq_lens = nullptr;
  int32_t max_q_per_seq = 0;
  int32_t n_heads = 0;
  float scale = 1.0f;
  int32_t window = 0;  // as DecodeAttentionBatch::window, per query row
};
absl::Status PagedPrefillAttention(const kernels::PagedKvView& kv, int32_t layer,
                                   const PrefillAttentionBatch& batch, const float* q,
                                   int64_t q_stride, float* out, int64_t out_stride,
                                   StreamHandle stream);

// Copy-on-write: copies whole blocks (every layer, K, V and scales) of the
// device pool, pairs (src_ids[i], dst_ids[i]) (device arrays), in one launch.
// REQUIRES: no dst is also a src. CPU twin: KvPool::CopyBlock.
absl::Status CopyBlocks(uint8_t* pool, int64_t block_bytes, const int32_t* src_ids,
                        const int32_t* dst_ids, int32_t n_pairs, StreamHandle stream);

// Token eviction's compaction on the device: for every layer, K and V and
// KV head, copies the row (data and metadata) of slot from[i] of sequence
// `seq` to slot to[i], in order (from/to are device arrays). The view is
// device memory. REQUIRES: as kernels::MoveKvRows (its CPU twin): a per-row
// codec, to[i] <= from[i], both ascending.
absl::Status MoveKvRows(const kernels::PagedKvView& kv, int32_t n_layers, int32_t seq,
                        const int32_t* from, const int32_t* to, int32_t n, StreamHandle stream);

// Tier copies between the device pool and pinned host staging memory.
// block_ids are HOST arrays (the tier manager knows them); host holds n_blocks
// blocks back to back. Runs of consecutive ids become one copy.
absl::Status GatherBlocksToHost(const uint8_t* pool, int64_t block_bytes,
                                const int32_t* block_ids, int32_t n_blocks, void* host,
                                StreamHandle stream);
absl::Status ScatterBlocksFromHost(const void* host, int64_t block_bytes,
                                   const int32_t* block_ids, int32_t n_blocks, uint8_t* pool,
                                   StreamHandle stream);

}  // namespace kvserve::cuda
