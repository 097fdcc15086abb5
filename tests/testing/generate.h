// Runs a set of requests through the engine on the calling thread and
// collects each one's output: the one-call form tests want.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/engine.h"

namespace kvserve::testing {

struct GenOutput {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
};

struct GenOptions {
  int32_t max_batched_tokens = 512;
  int32_t block_size = 16;
  int32_t num_blocks = 4096;
};

// Submits every request (all n = 1) to one engine, steps it until idle, and
// returns the outputs in request order.
absl::StatusOr<std::vector<GenOutput>> GenerateAll(LlamaModel* model, const Tokenizer* tokenizer,
                                                   ThreadPool* pool,
                                                   const std::vector<EngineRequest>& requests,
                                                   const GenOptions& options = {});

}  // namespace kvserve::testing
