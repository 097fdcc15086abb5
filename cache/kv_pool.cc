#include "cache/kv_pool.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve {
namespace {

// A stale or foreign handle means some table kept a block after releasing
// it; continuing would let two sequences read and write the same K/V, so we
// stop loudly instead (death tests match this text).
[[noreturn]] void DieOnBadHandle(const char* op, BlockHandle h, const char* why) {
  std::fprintf(stderr, "KvPool::%s: block %d (generation %u) %s\n", op, h.id, h.generation, why);
  std::abort();
}

}  // namespace

int64_t KvPool::BlockBytes(const KvPoolOptions& o) {
  return 2 * kernels::PagedKvView::HalfLayerBytes(o.block_size, o.n_kv_heads, o.head_dim, o.dtype) *
         o.n_layers;
}

KvPool::KvPool(const KvPoolOptions& o) : options_(o) {}

KvPool::~KvPool() {
  // Device storage returns to its pool with device_storage_.
  if (!on_device() && storage_ != nullptr) munmap(storage_, host_mapped_bytes_);
}

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
  if (o.device_memory != nullptr) {
    absl::StatusOr<cuda::DeviceBuffer> device =
        o.device_memory->Allocate(static_cast<size_t>(total));
    if (!device.ok()) {
      return absl::Status(device.status().code(),
                          absl::StrCat("cannot allocate ", total, " bytes of KV cache on the GPU: ",
                                       device.status().message()));
    }
    pool->device_storage_ = std::move(device).value();
    pool->storage_ = pool->device_storage_.as<uint8_t>();
  } else {
    // An anonymous mapping rounded to 2 MiB, offered to transparent huge
    // pages, then touched once here. Untouched, every first write to a block
    // (a prefill's store, or a P/D pull landing in a decode node's pool)
    // took a page fault and a kernel page clear on the request's critical
    // path: on this machine that was most of a 10 MB pull's time. Huge pages
    // also cut the TLB misses of attention walking blocks across the pool.
    // The mapping is page-aligned, so every block stays cache-line aligned.
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t mapped = (static_cast<size_t>(total) + kHuge - 1) / kHuge * kHuge;
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", total, " bytes of KV cache: ", std::strerror(errno)));
    }
    // Advice only: a kernel without THP (or with it off) keeps 4 KiB pages.
    (void)madvise(p, mapped, MADV_HUGEPAGE);
    pool->storage_ = static_cast<uint8_t*>(p);
    pool->host_mapped_bytes_ = mapped;
    // Zero-fill commits the memory now (and gives never-written blocks a
    // defined value: zero K/V and zero scales).
    std::memset(p, 0, mapped);
  }
  pool->free_.reserve(o.n_blocks);
  // Hand out low ids first: pop_back from a descending list.
  for (int32_t i = o.n_blocks - 1; i >= 0; --i) pool->free_.push_back(i);
  pool->refs_.assign(o.n_blocks, 0);
  pool->generation_.assign(o.n_blocks, 0);
  return pool;
}

absl::Status KvPool::Allocate(int32_t n, std::vector<BlockHandle>* out) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("negative block count ", n));
  // Checked before taking anything so a failed request leaves the pool as it was.
  if (n > num_free_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache has ", num_free_blocks(), " free blocks, ", n, " needed"));
  }
  out->reserve(out->size() + n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = free_.back();
    free_.pop_back();
    refs_[id] = 1;
    out->push_back(BlockHandle{id, generation_[id]});
  }
  return absl::OkStatus();
}

bool KvPool::IsLive(BlockHandle h) const {
  return h.id >= 0 && h.id < options_.n_blocks && refs_[h.id] > 0 &&
         generation_[h.id] == h.generation;
}

int32_t KvPool::ref_count(BlockHandle h) const { return IsLive(h) ? refs_[h.id] : 0; }

void KvPool::AddRef(BlockHandle h) {
  if (!IsLive(h)) DieOnBadHandle("AddRef", h, "is not live (stale or foreign handle)");
  if (++refs_[h.id] == 2) {
    for (KvPoolObserver* o : observers_) o->OnSharedChanged(h.id, true);
  }
}

void KvPool::Release(BlockHandle h) {
  if (!IsLive(h)) {
    DieOnBadHandle("Release", h, "is not live (double release, stale or foreign handle)");
  }
  const int32_t left = --refs_[h.id];
  if (left == 1) {
    for (KvPoolObserver* o : observers_) o->OnSharedChanged(h.id, false);
  } else if (left == 0) {
    // The new generation invalidates every handle still naming this block.
    ++generation_[h.id];
    free_.push_back(h.id);
  }
}

void KvPool::Release(absl::Span<const BlockHandle> hs) {
  for (const BlockHandle& h : hs) Release(h);
}

void KvPool::AddObserver(KvPoolObserver* o) { observers_.push_back(o); }

void KvPool::RemoveObserver(KvPoolObserver* o) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), o), observers_.end());
}

void KvPool::CopyBlock(BlockHandle src, BlockHandle dst) {
  if (!IsLive(src)) DieOnBadHandle("CopyBlock", src, "(source) is not live");
  if (!IsLive(dst)) DieOnBadHandle("CopyBlock", dst, "(destination) is not live");
  if (src.id == dst.id) DieOnBadHandle("CopyBlock", src, "is both source and destination");
  // Every layer of a block is contiguous (DESIGN.md), so one memcpy moves all
  // layers' K and V with their scales.
  if (on_device()) {
    // One contiguous device-to-device copy on the forward's stream: ordered
    // before the next forward writes dst. A launch failure here means the
    // device is gone; the step cannot go on with a half-made copy.
    const absl::Status s = cuda::CopyDeviceToDeviceAsync(
        storage_ + static_cast<int64_t>(dst.id) * block_bytes_,
        storage_ + static_cast<int64_t>(src.id) * block_bytes_,
        static_cast<size_t>(block_bytes_), options_.device_stream);
    if (!s.ok()) {
      std::fprintf(stderr, "KvPool::CopyBlock: device copy %d -> %d failed: %s\n", src.id, dst.id,
                   s.ToString().c_str());
      std::abort();
    }
    return;
  }
  std::memcpy(storage_ + static_cast<int64_t>(dst.id) * block_bytes_,
              storage_ + static_cast<int64_t>(src.id) * block_bytes_,
              static_cast<size_t>(block_bytes_));
}

void KvPool::MoveRows(absl::Span<const int32_t> block_ids, absl::Span<const int32_t> from,
                      absl::Span<const int32_t> to) {
  if (from.size() != to.size()) {
    std::fprintf(stderr, "KvPool::MoveRows: %zu sources, %zu destinations\n", from.size(), to.size());
    std::abort();
  }
  if (from.empty()) return;
  const int32_t n = static_cast<int32_t>(from.size());
  const int32_t n_ids = static_cast<int32_t>(block_ids.size());
  if (!on_device()) {
    const int32_t offsets[2] = {0, n_ids};
    kernels::MoveKvRows(View(block_ids.data(), offsets, 1), options_.n_layers, 0, from.data(),
                        to.data(), n);
    return;
  }
  // [block_ids][offsets][from][to] in one device array.
  std::vector<int32_t> ints(block_ids.begin(), block_ids.end());
  ints.push_back(0);
  ints.push_back(n_ids);
  ints.insert(ints.end(), from.begin(), from.end());
  ints.insert(ints.end(), to.begin(), to.end());
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(cuda::DeviceBuffer d, options_.device_memory->Allocate(sizeof(int32_t) * ints.size()));
    const int32_t* di = d.as<int32_t>();
    RETURN_IF_ERROR(cuda::CopyToDeviceAsync(d.data(), ints.data(), sizeof(int32_t) * ints.size(),
                                            options_.device_stream));
    RETURN_IF_ERROR(cuda::MoveKvRows(View(di, di + n_ids, 1), options_.n_layers, 0,
                                     di + n_ids + 2, di + n_ids + 2 + n, n,
                                     options_.device_stream));
    // d and ints must outlive the copy and the kernel.
    return cuda::DeviceSynchronize();
  }();
  if (!s.ok()) {
    // As CopyBlock: the device is gone; a half-compacted sequence cannot go on.
    std::fprintf(stderr, "KvPool::MoveRows: device compaction failed: %s\n", s.ToString().c_str());
    std::abort();
  }
}

const uint8_t* KvPool::HostBlockData(BlockHandle h) const {
  if (!IsLive(h)) DieOnBadHandle("HostBlockData", h, "is not live");
  if (on_device()) DieOnBadHandle("HostBlockData", h, "lives in device memory");
  return storage_ + static_cast<int64_t>(h.id) * block_bytes_;
}

const uint8_t* KvPool::BlockData(BlockHandle h) const {
  if (!IsLive(h)) DieOnBadHandle("BlockData", h, "is not live");
  return storage_ + static_cast<int64_t>(h.id) * block_bytes_;
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
