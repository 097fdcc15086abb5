// BatchGenerator runs a fixed set of generation requests to completion
// together: every step packs prefill chunks and decode tokens of all live
// sequences into one ragged batch under a token budget, runs the model, and
// samples. It is the engine's command-line path (generate, bench) and the
// seed of the continuous-batching scheduler (issue 3), which adds admission,
// preemption and a request queue on top of the same step.
//
// Not thread-safe: one Generate call at a time, on the caller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/kv_pool.h"
#include "common/thread_pool.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

namespace kvserve {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, BOS included when wanted
  SamplingParams params;
};

struct GenerationOutput {
  std::vector<int32_t> tokens;  // generated ids (a final end-of-generation token excluded)
  std::vector<float> logprobs;  // one per generated token
  std::string text;             // emitted text (stop string excluded)
  std::string finish_reason;    // "stop" or "length"
};

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t steps = 0;
  double prefill_seconds = 0;  // steps that carried prompt tokens
  double decode_seconds = 0;   // steps with decode tokens only
};

class BatchGenerator {
 public:
  struct Options {
    int32_t max_batched_tokens = 512;  // token budget of one step
    int32_t block_size = 16;
    // f16 by default, as llama.cpp and vLLM store KV: half the memory and the
    // same numerics as the reference outputs we test against.
    kernels::KvDType kv_dtype = kernels::KvDType::kF16;
  };
  // Called with (request index, text delta) as text becomes final.
  using DeltaCallback = std::function<void(size_t, std::string_view)>;

  BatchGenerator(LlamaModel* model, const Tokenizer* tokenizer, ThreadPool* pool,
                 const Options& options);

  // Validates every request first (InvalidArgument naming the request and
  // field; nothing runs), then generates.
  [[nodiscard]] absl::StatusOr<std::vector<GenerationOutput>> Generate(
      const std::vector<GenerationRequest>& requests, const DeltaCallback& on_delta = nullptr,
      GenerationStats* stats = nullptr);

 private:
  LlamaModel* model_;
  const Tokenizer* tokenizer_;
  ThreadPool* pool_;
  Options options_;
};

}  // namespace kvserve
