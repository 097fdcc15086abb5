// Perplexity of a model over a token stream: the yardstick later issues use
// to judge KV quantization and eviction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "kernels/kv_view.h"
#include "model/llama.h"

namespace kvserve {

struct PerplexityOptions {
  int32_t context = 512;  // tokens per window
  // 0: llama.cpp's method -- consecutive non-overlapping windows, the first
  //    token of each replaced by BOS when bos_id >= 0, and only the second
  //    half of each window scored (every scored token sees >= context/2 of
  //    history).
  // >0: sliding windows starting every `stride` tokens; each window scores the
  //    tokens no earlier window scored (Hugging Face's method).
  int32_t stride = 0;
  int32_t bos_id = -1;
  int32_t max_windows = 0;  // 0 = all
  int32_t batch_tokens = 256;  // tokens per forward call inside a window
  // Storage of the window's KV: quantized codecs measure what KV compression
  // costs in perplexity.
  kernels::KvDType kv_dtype = kernels::KvDType::kF32;
  // Tokens per KV block: int4-kivi* keys share per-channel ranges over one.
  int32_t block_size = 16;
  // When set, every window also runs with a cache of this dtype (twice the
  // work), and the result compares the two next-token distributions.
  bool compare = false;
  kernels::KvDType compare_dtype = kernels::KvDType::kF16;
};

struct PerplexityResult {
  double perplexity = 0;
  double mean_nll = 0;
  int64_t scored_tokens = 0;
  int32_t windows = 0;
  std::vector<double> window_perplexity;  // running perplexity after each window
  // With PerplexityOptions::compare: the fraction of scored positions where
  // both caches give the same most likely next token (what greedy decoding
  // picks, teacher-forced on the text, so one near-tie does not decide the
  // rest of a sequence), and the mean KL(compare || kv_dtype) in nats.
  double same_top1 = 0;
  double mean_kl = 0;
  // The most likely next token (first index on ties) at every scored
  // position, in scoring order: teacher-forced top-1 for comparisons with
  // another engine's logits on the same windows.
  std::vector<int32_t> top1;
  // The negative log-likelihood of the text's next token at the same
  // positions.
  std::vector<float> nll;
};

[[nodiscard]] absl::StatusOr<PerplexityResult> ComputePerplexity(
    LlamaModel& model, const std::vector<int32_t>& tokens, const PerplexityOptions& options,
    ThreadPool* pool);

// Error of KV codecs on real K/V: one forward pass over tokens[0, context)
// with an f32 cache, then every captured K and V row of every layer and KV
// head is encoded and decoded by each codec and granularity.
struct KvErrorRow {
  std::string codec;        // e.g. "int8"
  std::string granularity;  // "per-token-head", "per-tensor", "per-channel keys (32 tokens)", ...
  double k_mse = 0, k_max_abs = 0, k_cosine = 0;  // cosine: mean over rows
  double v_mse = 0, v_max_abs = 0, v_cosine = 0;
};

[[nodiscard]] absl::StatusOr<std::vector<KvErrorRow>> ComputeKvError(
    LlamaModel& model, const std::vector<int32_t>& tokens, int32_t context, ThreadPool* pool);

}  // namespace kvserve
