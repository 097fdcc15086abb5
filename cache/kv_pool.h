// KvPool owns preallocated KV memory as fixed-size blocks in the layout of
// DESIGN.md (every layer of a block contiguous, so one block is one region to
// copy or transfer) and hands blocks out from a free list with reference
// counts. Handles carry a generation that advances each time a block returns
// to the free list, so a stale handle is detected, not silently read.
// Running out is ResourceExhausted, never a crash.
//
// The blocks live in host memory (the CPU forward's) or, with
// KvPoolOptions::device_memory, in device memory from the CUDA backend's
// pool: the same layout, so a block copies byte-identically between tiers.
//
// Not thread-safe: owned by the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"

namespace kvserve {

struct KvPoolOptions {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;
  int32_t n_blocks = 0;
  kernels::KvDType dtype = kernels::KvDType::kF32;
  // Storage: host memory when null (the default), else device memory from
  // this pool, which must outlive the KvPool. Copy-on-write copies of device
  // blocks are enqueued on device_stream (the stream the forward runs on, so
  // they are ordered before it); no host code reads device blocks.
  cuda::DeviceMemoryPool* device_memory = nullptr;
  cuda::StreamHandle device_stream = nullptr;
};

// A reference to one block. Plain data; the pool checks the generation.
struct BlockHandle {
  int32_t id = -1;
  uint32_t generation = 0;
  friend bool operator==(const BlockHandle& a, const BlockHandle& b) {
    return a.id == b.id && a.generation == b.generation;
  }
};

// Told when a live block's reference count crosses between 1 and 2 (its
// holder becomes shared or sole again), synchronously on the engine thread
// from AddRef and Release. The prefix cache counts its evictable blocks from
// this: releases by sequences never go through the cache. Must not call back
// into AddRef or Release.
class KvPoolObserver {
 public:
  virtual ~KvPoolObserver() = default;
  // ref_count(block id) just went 1 -> 2 (shared) or 2 -> 1 (!shared).
  virtual void OnSharedChanged(int32_t id, bool shared) = 0;
};

class KvPool {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvPool>> Create(const KvPoolOptions& options);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // Bytes of one block (K and V, every layer) for the given shape.
  static int64_t BlockBytes(const KvPoolOptions& o);

  // Appends n fresh blocks (reference count 1 each) to *out, or returns
  // ResourceExhausted and allocates nothing.
  [[nodiscard]] absl::Status Allocate(int32_t n, std::vector<BlockHandle>* out);
  // REQUIRES: h is live (IsLive). Stale or foreign handles abort: they are
  // programmer errors that would otherwise read another sequence's K/V.
  void AddRef(BlockHandle h);
  // Drops one reference; at zero the block returns to the free list and its
  // generation advances. REQUIRES: h is live.
  void Release(BlockHandle h);
  void Release(absl::Span<const BlockHandle> hs);
  bool IsLive(BlockHandle h) const;
  int32_t ref_count(BlockHandle h) const;  // 0 for a stale handle
  // Copies every layer's K and V of src into dst (copy-on-write).
  // REQUIRES: both live, src != dst.
  void CopyBlock(BlockHandle src, BlockHandle dst);
  // Token eviction's compaction over one sequence's blocks (block_ids, in
  // table order): moves the rows of slots from[i] to slots to[i], in order,
  // in every layer (kernels::MoveKvRows; on the device its CUDA twin on
  // device_stream, waited for, since compaction is rare and the host arrays
  // are the caller's). REQUIRES: as kernels::MoveKvRows.
  void MoveRows(absl::Span<const int32_t> block_ids, absl::Span<const int32_t> from,
                absl::Span<const int32_t> to);
  // The bytes of a live block in host memory (every layer, block_bytes()
  // long), for copies to the tiers below. REQUIRES: live, !on_device().
  const uint8_t* HostBlockData(BlockHandle h) const;
  // The same block wherever it lives: a device pointer when on_device()
  // (for copies on a stream; host code must not read it). REQUIRES: live.
  const uint8_t* BlockData(BlockHandle h) const;

  // Prefill/decode disaggregation registers these with the transport: the
  // host storage (block i at host_storage() + i * block_bytes()) and the
  // per-block generation table (num_blocks() entries, stable address for the
  // pool's lifetime; a peer reads it remotely to fence its reads).
  // REQUIRES: !on_device() for host_storage().
  uint8_t* host_storage() const { return storage_; }
  // The blocks wherever they live (block i at storage() + i * block_bytes()):
  // a device pointer when on_device(), which host code must not dereference.
  uint8_t* storage() const { return storage_; }
  const uint32_t* generation_table() const { return generation_.data(); }

  // Registers or removes an observer. REQUIRES: a registered observer stays
  // alive until removed.
  void AddObserver(KvPoolObserver* o);
  void RemoveObserver(KvPoolObserver* o);

  int32_t num_blocks() const { return options_.n_blocks; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_.size()); }
  int32_t block_size() const { return options_.block_size; }
  int64_t block_bytes() const { return block_bytes_; }
  const KvPoolOptions& options() const { return options_; }
  // True when the blocks are device memory (View().pool is a device pointer).
  bool on_device() const { return !device_storage_.empty(); }

  // A kernel view over this pool with the given CSR block table (the arrays
  // must outlive the view).
  kernels::PagedKvView View(const int32_t* block_ids, const int32_t* seq_block_offsets,
                            int32_t n_seqs) const;

 private:
  explicit KvPool(const KvPoolOptions& o);
  KvPoolOptions options_;
  int64_t block_bytes_ = 0;
  int64_t layer_bytes_ = 0;
  uint8_t* storage_ = nullptr;          // host memory, or device_storage_'s
  size_t host_mapped_bytes_ = 0;        // length of the host mapping (munmap)
  cuda::DeviceBuffer device_storage_;  // set when options_.device_memory is
  std::vector<int32_t> free_;
  std::vector<int32_t> refs_;         // per block; 0 when free
  std::vector<uint32_t> generation_;  // per block; advances on each return to the free list
  std::vector<KvPoolObserver*> observers_;
};

}  // namespace kvserve
