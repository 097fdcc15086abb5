// ModelRunner: executes a BatchPlan. It turns the plan into the model's
// ragged batch (tokens, sequence index, RoPE position and KV slot of every
// token, logit rows) and the CSR block table of the batch's sequences, and
// runs one forward through the ForwardBackend — the CPU backend as well as
// CUDA, so there is one forward path. It decides nothing and changes no
// sequence: the output processor applies the results.
//
// Not thread-safe: the engine thread owns it (the backend reuses scratch).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "model/backend.h"
#include "scheduler/batch_plan.h"
#include "scheduler/kv_cache_manager.h"

namespace kvserve {

// What one forward produced, for the output processor.
struct StepResult {
  // Rows of vocab_size logits in plan order: one per chunk with `sample`
  // set, and for a sequence with a draft one per position from its last
  // token on (the positions whose next token verification checks). Chunk
  // i's rows are [row_offsets[i], row_offsets[i + 1]), the first at position
  // row_positions[i].
  absl::Span<const float> logits;
  absl::Span<const int32_t> row_offsets;
  absl::Span<const int32_t> row_positions;
  int32_t vocab_size = 0;
  // Heavy-hitter statistics (only when a chunk's sequence has an h2o
  // policy): chunk i's attention mass per (KV head, slot) starts at
  // attention_mass + i * n_kv_heads * mass_stride. Null otherwise.
  const float* attention_mass = nullptr;
  int64_t mass_stride = 0;
  int32_t n_kv_heads = 0;
};

class ModelRunner {
 public:
  // REQUIRES: backend, kv and pool outlive the runner.
  ModelRunner(std::shared_ptr<ForwardBackend> backend, KvCacheManager* kv, ThreadPool* pool);

  // Runs the plan's forward. On success the K/V of every scheduled token is
  // written (the caller marks them computed) and the result points into the
  // runner's buffers until the next Run. On error nothing may be treated as
  // computed.
  [[nodiscard]] absl::StatusOr<StepResult> Run(const BatchPlan& plan);

  int32_t vocab_size() const { return backend_->config().vocab_size; }
  ForwardBackend* backend() const { return backend_.get(); }

 private:
  std::shared_ptr<ForwardBackend> backend_;
  KvCacheManager* kv_;
  ThreadPool* pool_;
  // Reused across steps.
  std::vector<int32_t> tokens_, token_seq_, positions_, slots_, logit_rows_;
  std::vector<int32_t> row_offsets_, row_positions_;
  std::vector<int32_t> block_ids_, block_offsets_;
  // KV cache groups (hybrid attention): one CSR block table per group.
  std::vector<std::vector<int32_t>> group_ids_, group_offsets_;
  std::vector<kernels::PagedKvView> group_views_;
  std::vector<float> logits_, mass_;
  std::vector<uint8_t> mass_wanted_;  // per chunk: an h2o sequence
};

}  // namespace kvserve
