// KvPool owns preallocated KV memory as fixed-size blocks in the layout of
// DESIGN.md (every layer of a block contiguous, so one block is one region to
// copy or transfer) and hands block ids out from a free list. Running out is
// ResourceExhausted, never a crash.
//
// Not thread-safe: owned by the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_view.h"

namespace kvserve {

struct KvPoolOptions {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;
  int32_t n_blocks = 0;
  kernels::KvDType dtype = kernels::KvDType::kF32;
};

class KvPool {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvPool>> Create(const KvPoolOptions& options);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // Bytes of one block (K and V, every layer) for the given shape.
  static int64_t BlockBytes(const KvPoolOptions& o);

  // Appends n block ids to *out, or returns ResourceExhausted and allocates
  // nothing.
  [[nodiscard]] absl::Status Allocate(int32_t n, std::vector<int32_t>* out);
  // REQUIRES: every id was allocated and not yet freed.
  void Free(absl::Span<const int32_t> ids);

  int32_t num_blocks() const { return options_.n_blocks; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_.size()); }
  int32_t block_size() const { return options_.block_size; }
  int64_t block_bytes() const { return block_bytes_; }
  const KvPoolOptions& options() const { return options_; }

  // A kernel view over this pool with the given CSR block table (the arrays
  // must outlive the view).
  kernels::PagedKvView View(const int32_t* block_ids, const int32_t* seq_block_offsets,
                            int32_t n_seqs) const;

 private:
  explicit KvPool(const KvPoolOptions& o);
  KvPoolOptions options_;
  int64_t block_bytes_ = 0;
  int64_t layer_bytes_ = 0;
  uint8_t* storage_ = nullptr;
  std::vector<int32_t> free_;
  std::vector<uint8_t> allocated_;  // 1 while a block is handed out (catches double free)
};

}  // namespace kvserve
