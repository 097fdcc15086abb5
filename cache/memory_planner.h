// Memory planner: turns a KV memory budget into a number of blocks and the
// capacity figures operators plan deployments with. Works from the model's
// hyper-parameters only (no weights), so `kvserve plan` can answer for any
// GGUF file before it is deployed.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/kv_view.h"

namespace kvserve {

struct KvShape {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t context_length = 0;
  // > 0: every layer attends to the last sliding_window tokens only, so a
  // sequence holds at most WindowBlocks() blocks however long it runs.
  int32_t sliding_window = 0;
  int32_t windowed_layers = 0;  // for the report: how many layers have a window
  // KV cache groups (hybrid attention, LlamaConfig::KvGroups): a block
  // (page) holds layers_per_block layers; full_groups groups keep every
  // block, window_groups groups only their window's. 0: one group of every
  // layer (the classic layout).
  int32_t layers_per_block = 0;
  int32_t full_groups = 0;
  int32_t window_groups = 0;
};

struct MemoryPlan {
  int64_t budget_bytes = 0;         // what the budget resolved to
  int64_t kv_bytes_per_token = 0;   // K and V, all layers
  int64_t block_bytes = 0;
  int32_t block_size = 0;
  int64_t num_blocks = 0;
  int64_t token_capacity = 0;       // num_blocks * block_size
  int64_t full_context_sequences = 0;  // sequences of context_length that fit
  // Sliding-window models (0 otherwise): the window, the most blocks one
  // sequence holds, and how many sequences of 32k tokens fit with the
  // window freeing blocks versus full attention on the same budget.
  int32_t sliding_window = 0;
  int32_t windowed_layers = 0;
  int32_t n_layers = 0;
  int64_t window_blocks_per_sequence = 0;
  int64_t sequences_at_32k_windowed = 0;
  int64_t sequences_at_32k_full_attention = 0;
  // KV cache groups (0 without): pages one sequence of context_length
  // holds (every group together), and how many such sequences the same
  // budget holds in the all-layers layout (blocks of every layer).
  int32_t kv_groups = 0;
  int32_t layers_per_block = 0;
  int32_t full_groups = 0;
  int32_t window_groups = 0;
  int64_t group_pages_per_sequence = 0;
  int64_t full_context_sequences_all_layers = 0;
  std::string ToString() const;     // one human-readable line per figure
};

// Parses a budget: bytes with an optional unit ("512MiB", "2GiB", "1.5GB",
// "1000000") or a fraction of currently available memory in (0, 1] ("0.5").
// InvalidArgument naming the text on anything else.
[[nodiscard]] absl::StatusOr<int64_t> ParseMemoryBudget(const std::string& text);

// Bytes of memory the system reports available (MemAvailable), 0 if unknown.
int64_t AvailableMemoryBytes();

// Blocks a sliding-window sequence holds at most: the window's slots
// (window - 1 earlier tokens and the newest) rounded out to whole blocks on
// both ends, plus the block the next token opens.
int64_t WindowBlocks(int32_t window, int32_t block_size);

// Bytes one sequence of `tokens` tokens holds in `plan`'s layout: with KV
// cache groups, every full group's pages for all its tokens and every window
// group's for at most its window; with a window on every layer (one group),
// the window's blocks; otherwise a block per block_size tokens.
int64_t SequenceKvBytes(const MemoryPlan& plan, int64_t tokens);

[[nodiscard]] absl::StatusOr<MemoryPlan> PlanKvMemory(const KvShape& shape, int32_t block_size,
                                                      kernels::KvDType dtype, int64_t budget_bytes);

}  // namespace kvserve
