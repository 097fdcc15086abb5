#include "cache/kv_pool.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvserve {

int64_t KvPool::BlockBytes(const KvPoolOptions& o) {
  return 2 * kernels::PagedKvView::HalfLayerBytes(o.block_size, o.n_kv_heads, o.head_dim,
                                                   o.dtype) *
         o.n_layers;
}

KvPool::KvPool(const KvPoolOptions& o) : options_(o) {}

KvPool::~KvPool() { std::free(storage_); }

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const KvPoolOptions& o) {
  if (o.n_layers <= 0 || o.n_kv_heads <= 0 || o.head_dim <= 0 || o.block_size <= 0 ||
      o.n_blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool needs positive layers, heads, head_dim, block_size and blocks (got ", o.n_layers,
        ", ", o.n_kv_heads, ", ", o.head_dim, ", ", o.block_size, ", ", o.n_blocks, ")"));
  }
  std::unique_ptr<KvPool> pool(new KvPool(o));
  pool->block_bytes_ = BlockBytes(o);
  pool->layer_bytes_ = pool->block_bytes_ / o.n_layers;
  const int64_t total = pool->block_bytes_ * o.n_blocks;
  // 64-byte alignment keeps every block cache-line aligned for SIMD loads.
  const int64_t rounded = (total + 63) / 64 * 64;
  pool->storage_ = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
  if (pool->storage_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", total, " bytes of KV cache"));
  }
  pool->free_.reserve(o.n_blocks);
  // Hand out low ids first: pop_back from a descending list.
  for (int32_t i = o.n_blocks - 1; i >= 0; --i) pool->free_.push_back(i);
  pool->allocated_.assign(o.n_blocks, 0);
  return pool;
}

absl::Status KvPool::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0) return absl::InvalidArgumentError("negative block count");
  if (n > num_free_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache has ", num_free_blocks(), " free blocks, ", n, " needed"));
  }
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = free_.back();
    free_.pop_back();
    allocated_[id] = 1;
    out->push_back(id);
  }
  return absl::OkStatus();
}

void KvPool::Free(absl::Span<const int32_t> ids) {
  for (int32_t id : ids) {
    if (id < 0 || id >= options_.n_blocks || !allocated_[id]) {
      std::fprintf(stderr, "KvPool::Free: block %d is not allocated\n", id);
      std::abort();  // programmer error: double free or foreign id
    }
    allocated_[id] = 0;
    free_.push_back(id);
  }
}

kernels::PagedKvView KvPool::View(const int32_t* block_ids, const int32_t* seq_block_offsets,
                                  int32_t n_seqs) const {
  kernels::PagedKvView v;
  v.pool = storage_;
  v.block_bytes = block_bytes_;
  v.layer_bytes = layer_bytes_;
  v.block_size = options_.block_size;
  v.n_kv_heads = options_.n_kv_heads;
  v.head_dim = options_.head_dim;
  v.dtype = options_.dtype;
  v.block_ids = block_ids;
  v.seq_block_offsets = seq_block_offsets;
  v.n_seqs = n_seqs;
  return v;
}

}  // namespace kvserve
