// Runs a set of requests through the engine on the calling thread and
// collects each one's output: the one-call form tests want.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/engine.h"

namespace kvserve::testing {

// A tiny Llama written by gguf_writer (default TinyLlamaOptions, the given
// context length) into TempDir() under `name` and loaded once per process;
// no ../shared needed. Never freed (tests share it).
struct WrittenModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
const WrittenModel& TinyWrittenModel(const std::string& name, int32_t context_length);
// A process-wide 2-thread pool for engine tests.
ThreadPool* TestPool();

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
