#include "scheduler/kv_tiers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "kernels/kv_view.h"
#include "spdlog/spdlog.h"

namespace kvserve {

// One thread running posted jobs in order. Flush waits for the queue to
// drain and the running job to end.
class KvTiers::Worker {
 public:
  explicit Worker(const char* name) : thread_([this] { Loop(); }) { (void)name; }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  void Flush() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_, and every queued job ran
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      if (jobs_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is built
};

// A load in flight: completed once by the loader thread, polled by the
// engine thread.
class KvTiers::TierLoad final : public KvLoad {
 public:
  bool Done() override { return done_.load(std::memory_order_acquire); }
  absl::Status status() override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  KvLoadSources sources() override {
    std::lock_guard<std::mutex> lock(mu_);
    return sources_;
  }
  void Finish(absl::Status s, KvLoadSources src) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      sources_ = src;
    }
    done_.store(true, std::memory_order_release);
  }

 private:
  std::mutex mu_;
  absl::Status status_;
  KvLoadSources sources_;
  std::atomic<bool> done_{false};
};

struct KvTiers::DeviceFence {
  cuda::CudaEvent after;  // on the forward's stream
  cuda::CudaEvent done;   // on the copy stream, after the copy (demotions)
};

struct KvTiers::LoadItem {
  uint64_t hash = 0;
  KvTier tier = KvTier::kNone;
  const uint8_t* host_page = nullptr;  // pinned, when tier == kHost
  uint64_t checksum = 0;
  uint8_t* dest = nullptr;             // the primary block's bytes
  int32_t tokens = 0;                  // of the load's tokens this block carries
  bool counted = true;                 // counts its tokens (group 0's pages only)
};

// A KV cache group's demotions: its blocks become pages under their group
// key.
class KvTiers::GroupSink final : public BlockDemotionSink {
 public:
  GroupSink(KvTiers* tiers, int32_t group) : tiers_(tiers), group_(group) {}
  KvTier Demote(const EvictedBlock& block) override {
    EvictedBlock b = block;
    b.hash = GroupKey(block.hash, group_);
    return tiers_->Demote(b);
  }

 private:
  KvTiers* tiers_;
  int32_t group_;
};

uint64_t KvTiers::GroupKey(uint64_t hash, int32_t group) {
  if (group == 0) return hash;
  const uint64_t in[2] = {hash, static_cast<uint64_t>(group)};
  return XXH3_64bits_withSeed(in, sizeof in, 0x6b76677270ULL);  // "kvgrp"
}

void KvTiers::SetGroups(std::vector<int32_t> windows) {
  group_windows_ = std::move(windows);
  group_sinks_.clear();
  for (size_t g = 1; g < group_windows_.size(); ++g) {
    group_sinks_.push_back(std::make_unique<GroupSink>(this, static_cast<int32_t>(g)));
  }
}

BlockDemotionSink* KvTiers::group_demotion(int32_t g) const { return group_sinks_[g - 1].get(); }

int32_t KvTiers::GroupFirstBlock(int32_t g, int32_t first, int32_t end) const {
  const int32_t w = group_windows_[g];
  if (w <= 0) return first;
  // After the run, the sequence's next token attends to slots from
  // end - w + 1 on (KvCacheManager::ReleaseOutOfWindow).
  return std::max(first, std::max(0, end - w + 1) / block_size_);
}

KvTiers::KvTiers(KvTiersOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::shared_ptr<KvTiers>> KvTiers::Create(KvTiersOptions options) {
  if (options.host_bytes < 0) return absl::InvalidArgumentError("--kv-host-memory must be >= 0");
  if (!options.disk_dir.empty() && options.disk_bytes <= 0) {
    return absl::InvalidArgumentError("--kv-disk-bytes must be > 0 with --kv-disk-dir");
  }
  if (!options.disk_dir.empty() && options.model_fingerprint.empty()) {
    return absl::InvalidArgumentError("the disk tier needs a model fingerprint");
  }
  if (options.disk_min_hits < 0) return absl::InvalidArgumentError("disk_min_hits must be >= 0");
  return std::shared_ptr<KvTiers>(new KvTiers(std::move(options)));
}

KvTiers::~KvTiers() {
  // Workers finish what is queued (a queued host checksum or disk store
  // still names tier memory) before the tiers go.
  loader_.reset();
  writer_.reset();
}

absl::Status KvTiers::Attach(const KvPool& pool, const PrefixCache* cache) {
  if (cache_ != nullptr) return absl::FailedPreconditionError("KvTiers attached twice");
  if (cache == nullptr) {
    return absl::InvalidArgumentError("KV tiers (--kv-host-memory, --kv-disk-dir) need the prefix cache");
  }
  if (pool.on_device()) {
    device_ = true;
    compute_stream_ = pool.options().device_stream;
    auto stream = cuda::CudaStream::Create();
    if (!stream.ok()) {
      return absl::UnavailableError(absl::StrCat("KV tiers: no copy stream for the device pool: ",
                                                 stream.status().message()));
    }
    copy_stream_ = std::move(stream).value();
  }
  cache_ = cache;
  block_size_ = pool.block_size();
  block_bytes_ = pool.block_bytes();
  {
    const KvPoolOptions& po = pool.options();
    shape_ = kernels::KvBlockShape{po.n_layers, po.n_kv_heads, po.head_dim, po.block_size};
    pool_dtype_ = po.dtype;
  }
  page_dtype_ = options_.host_dtype.value_or(pool_dtype_);
  reencode_ = page_dtype_ != pool_dtype_;
  page_bytes_ = reencode_ ? kernels::KvBlockBytes(page_dtype_, shape_) : block_bytes_;
  if (reencode_ && page_bytes_ >= block_bytes_) {
    // Never lossier for nothing: re-encoding must buy capacity.
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-host-dtype ", std::string(kernels::KvDTypeName(page_dtype_)),
        " does not make --kv-cache-dtype ", std::string(kernels::KvDTypeName(pool_dtype_)),
        " blocks smaller (", block_bytes_, " -> ", page_bytes_,
        " bytes) and would only lose precision: use --kv-host-dtype same or a narrower codec"));
  }
  if (reencode_) {
    load_scratch_ = AllocatePage(page_bytes_);
    if (load_scratch_ == nullptr) return absl::ResourceExhaustedError("no memory for a KV page");
    spdlog::info(
        "KV tiers: blocks re-encoded {} -> {} on demotion ({} -> {} bytes a block; lossy: "
        "loaded tokens are reported as such)",
        kernels::KvDTypeName(pool_dtype_), kernels::KvDTypeName(page_dtype_), block_bytes_,
        page_bytes_);
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.host_block_load_s = options_.host_block_load_s > 0
                                   ? options_.host_block_load_s
                                   : static_cast<double>(page_bytes_) / 4e9;
    stats_.disk_block_load_s = options_.disk_block_load_s > 0
                                   ? options_.disk_block_load_s
                                   : static_cast<double>(page_bytes_) / 4e8;
  }
  if (device_) {
    auto staging = cuda::PinnedHostBuffer::Allocate(static_cast<size_t>(block_bytes_));
    if (!staging.ok()) return staging.status();
    device_staging_ = std::move(staging).value();
    if (options_.host_bytes > 0) {
      // Host pages in pinned memory, pinned a chunk (~32 MiB) at a time as
      // the tier fills; room for the tier's pages and for pages on their way
      // to disk (at most max_pending_disk_bytes).
      const int64_t pages =
          options_.host_bytes / page_bytes_ + options_.max_pending_disk_bytes / page_bytes_ + 4;
      const int64_t per_chunk = std::max<int64_t>(1, (int64_t{32} << 20) / page_bytes_);
      pinned_pages_ = std::make_unique<PageArena>(
          page_bytes_, pages, per_chunk,
          [this](size_t bytes) -> void* {
            auto b = cuda::PinnedHostBuffer::Allocate(bytes);
            if (!b.ok()) {
              spdlog::warn("KV host tier: no pinned memory for more pages: {}",
                           std::string(b.status().message()));
              return nullptr;
            }
            void* p = b->data();
            pinned_chunks_.push_back(std::move(b).value());
            return p;
          },
          [](void*) {});  // pinned_chunks_ frees them, after the arena
    }
  }
  if (options_.host_bytes > 0) {
    host_ = std::make_unique<HostTier>(options_.host_bytes, page_bytes_, pinned_pages_.get());
    if (host_->capacity_pages() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-host-memory ", options_.host_bytes,
                                                     " bytes holds no block (one is ", page_bytes_,
                                                     " bytes)"));
    }
  }
  if (!options_.disk_dir.empty()) {
    // The directory name: everything that makes a block's bytes mean what
    // they mean (the model's content and tokenizer, the KV codec, block
    // size and shape), never the model's file name.
    const KvPoolOptions& po = pool.options();
    std::string key = absl::StrCat(
        options_.model_fingerprint, "/", std::string(kernels::KvDTypeName(po.dtype)), "/bs",
        po.block_size, "/", po.n_layers, "x", po.n_kv_heads, "x", po.head_dim, "/", page_bytes_);
    // The pages' own codec when it is not the pool's (a directory written
    // under `same` keeps its name).
    if (reencode_) absl::StrAppend(&key, "/host-", std::string(kernels::KvDTypeName(page_dtype_)));
    DiskTierOptions d;
    d.dir = options_.disk_dir;
    d.capacity_bytes = options_.disk_bytes;
    d.fingerprint = absl::StrFormat("%016x", XXH3_64bits(key.data(), key.size()));
    d.page_bytes = page_bytes_;
    d.files = options_.disk_files;
    DiskTierRecovery rec;
    auto disk = DiskTier::Open(std::move(d), &rec);
    if (!disk.ok()) return disk.status();
    disk_ = std::move(disk).value();
    stats_.disk_recovered = rec.recovered;
    spdlog::info("KV disk tier {}: {} blocks found from an earlier run, {} files discarded",
                 disk_->directory(), rec.recovered, rec.discarded);
    if (rec.other_fingerprints > 0) {
      spdlog::info(
          "KV disk tier: ignoring {} directories under {} written for another model, tokenizer, "
          "KV dtype, --kv-host-dtype or block size",
          rec.other_fingerprints, options_.disk_dir);
    }
  }
  if (host_ || disk_) {
    writer_ = std::make_unique<Worker>("kv-tier-writer");
    loader_ = std::make_unique<Worker>("kv-tier-loader");
  }
  return absl::OkStatus();
}

int64_t KvTiers::TakeGhostHits(uint64_t hash) {
  auto it = ghost_hits_.find(hash);
  if (it == ghost_hits_.end()) return 0;
  const int64_t hits = it->second;
  ghost_hits_.erase(it);  // its ghost_order_ entry goes stale; skipped when trimmed
  return hits;
}

void KvTiers::RememberGhost(uint64_t hash, int64_t hits) {
  constexpr size_t kMaxGhosts = 1 << 16;
  ghost_hits_[hash] = hits + 1;
  ghost_order_.push_back(hash);
  while (ghost_order_.size() > 2 * kMaxGhosts || ghost_hits_.size() > kMaxGhosts) {
    if (ghost_order_.empty()) break;
    if (ghost_hits_.size() > kMaxGhosts) ghost_hits_.erase(ghost_order_.front());
    ghost_order_.pop_front();
  }
}

void KvTiers::PublishTier(bool stored, KvTier tier, uint64_t hash, KvTier moved_to) const {
  if (events_ == nullptr) return;
  std::vector<KvCacheEvent> one(1);
  one[0].kind = stored ? KvCacheEvent::Kind::kBlockStored : KvCacheEvent::Kind::kBlockRemoved;
  one[0].tier = tier;
  one[0].block_hash = hash;
  one[0].moved_to = moved_to;
  events_->Publish(std::move(one));
}

bool KvTiers::SpillToDisk(EvictedPage page) {
  if (disk_ == nullptr) return false;
  if (page.hits < options_.disk_min_hits) {
    RememberGhost(page.hash, page.hits);
    return false;
  }
  if (pending_disk_bytes_.load() + page_bytes_ > options_.max_pending_disk_bytes) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.dropped_demotions;
    return false;
  }
  pending_disk_bytes_ += page_bytes_;
  auto shared = std::make_shared<EvictedPage>(std::move(page));
  writer_->Post([this, shared] { StoreOnDisk(*shared); });
  return true;
}

void KvTiers::StoreOnDisk(const EvictedPage& page) {
  std::vector<uint64_t> evicted;
  const absl::Status s =
      disk_->Store(page.hash, page.data.get(), page.checksum, page.hits, &evicted);
  pending_disk_bytes_ -= page_bytes_;
  for (uint64_t h : evicted) PublishTier(false, KvTier::kDisk, h);
  // Published as stored when it was queued: a write that failed takes it back.
  if (!s.ok()) PublishTier(false, KvTier::kDisk, page.hash);
  std::lock_guard<std::mutex> lock(stats_mu_);
  if (s.ok()) {
    ++stats_.demotions_disk;
    stats_.bytes_to_disk += page_bytes_;
  } else if (!absl::IsResourceExhausted(s)) {
    // Never visible: the tier removed the partial file.
    if (stats_.disk_write_failures++ % 100 == 0) {
      spdlog::warn("KV disk tier: block {:016x} not stored ({} failures so far): {}", page.hash,
                   stats_.disk_write_failures, s.ToString());
    }
  } else {
    ++stats_.dropped_demotions;
  }
}

void KvTiers::EncodePage(const uint8_t* block, uint8_t* page) const {
  if (!reencode_) {
    std::memcpy(page, block, static_cast<size_t>(page_bytes_));
    return;
  }
  kernels::TranscodeKvBlock(shape_, pool_dtype_, block, page_dtype_, page);
}

void KvTiers::DecodePage(const uint8_t* page, uint8_t* block) const {
  if (!reencode_) {
    std::memcpy(block, page, static_cast<size_t>(page_bytes_));
    return;
  }
  kernels::TranscodeKvBlock(shape_, page_dtype_, page, pool_dtype_, block);
}

absl::StatusOr<KvTiers::Fence> KvTiers::CopyBlockOut(const uint8_t* block, uint8_t* dst,
                                                     int64_t bytes) {
  if (!device_) {
    std::memcpy(dst, block, static_cast<size_t>(bytes));
    return Fence();
  }
  // After the forward's work so far (the block's last writes)...
  ASSIGN_OR_RETURN(Fence fence, MarkComputeStream());
  RETURN_IF_ERROR(fence->after.BlockStream(copy_stream_.get()));
  absl::Status s =
      cuda::CopyToHostAsync(dst, block, static_cast<size_t>(bytes), copy_stream_.get());
  if (s.ok()) {
    auto e = cuda::CudaEvent::Create();
    s = e.status();
    if (e.ok()) fence->done = std::move(e).value();
  }
  if (s.ok()) s = fence->done.Record(copy_stream_.get());
  // ... and before the forward's next work: the pool lends the block out
  // again as soon as Demote returns.
  if (s.ok()) s = fence->done.BlockStream(compute_stream_);
  if (!s.ok()) {
    // A copy may be in flight into dst, which the caller frees: let it land.
    (void)copy_stream_.Synchronize();
    return s;
  }
  return fence;
}

absl::StatusOr<KvTiers::Fence> KvTiers::MarkComputeStream() {
  if (!device_) return Fence();
  auto fence = std::make_shared<DeviceFence>();
  ASSIGN_OR_RETURN(fence->after, cuda::CudaEvent::Create());
  RETURN_IF_ERROR(fence->after.Record(compute_stream_));
  return fence;
}

bool KvTiers::WaitFence(const Fence& fence) {
  if (fence == nullptr) return true;
  const absl::Status s = fence->done.Synchronize();
  if (!s.ok()) spdlog::warn("KV tiers: a device copy failed: {}", std::string(s.message()));
  return s.ok();
}

void KvTiers::PostDiskStore(uint64_t hash, int64_t hits, PageBuffer page,
                            std::shared_ptr<uint8_t> raw, Fence fence) {
  pending_disk_bytes_ += page_bytes_;
  auto shared = std::make_shared<EvictedPage>(EvictedPage{hash, 0, hits, std::move(page)});
  writer_->Post([this, shared, raw = std::move(raw), fence = std::move(fence)] {
    if (!WaitFence(fence)) {
      pending_disk_bytes_ -= page_bytes_;
      PublishTier(false, KvTier::kDisk, shared->hash);
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.dropped_demotions;
      return;
    }
    if (raw != nullptr) EncodePage(raw.get(), shared->data.get());
    shared->checksum = XXH3_64bits(shared->data.get(), static_cast<size_t>(page_bytes_));
    StoreOnDisk(*shared);
  });
}

KvTier KvTiers::Demote(const EvictedBlock& evicted) {
  if (evicted.bytes != block_bytes_ || evicted.data == nullptr || evicted.on_device != device_) {
    return KvTier::kNone;
  }
  EvictedBlock b = evicted;
  b.hits += TakeGhostHits(b.hash);
  if (retained_ && retained_(b.hash)) b.hits = std::max<int64_t>(b.hits, options_.disk_min_hits);
  // With a re-encoding (--kv-host-dtype) the block is first copied as it is
  // into a staging buffer and re-encoded on the writer (a block's transcode
  // takes hundreds of microseconds, the copy tens).
  auto staging = [&]() -> std::shared_ptr<uint8_t> {
    if (!reencode_) return nullptr;
    return std::shared_ptr<uint8_t>(AllocatePage(block_bytes_).release(), PageDeleter());
  };
  if (host_ != nullptr) {
    uint8_t* page = nullptr;
    std::vector<EvictedPage> evicted;
    const HostTier::ReserveResult r = host_->Reserve(b.hash, b.hits, &page, &evicted);
    for (EvictedPage& p : evicted) {
      const uint64_t h = p.hash;
      // Stored on disk before it leaves the host, so the event log still
      // knows the block's tokens when it describes the disk page.
      const bool spilled = SpillToDisk(std::move(p));
      if (spilled) PublishTier(true, KvTier::kDisk, h);
      PublishTier(false, KvTier::kHost, h, spilled ? KvTier::kDisk : KvTier::kNone);
    }
    if (r == HostTier::ReserveResult::kPresent) return KvTier::kHost;  // a second eviction is free
    if (r == HostTier::ReserveResult::kReserved) {
      // The pool block is released when we return: the copy starts now, on
      // the engine thread (a memcpy; on a device an async copy); checksum and
      // publication happen on the writer, and until then the page is
      // invisible and pinned.
      const uint64_t hash = b.hash;
      std::shared_ptr<uint8_t> raw = staging();
      absl::StatusOr<Fence> fence =
          reencode_ && raw == nullptr
              ? absl::ResourceExhaustedError("no memory for a staging block")
              : CopyBlockOut(b.data, reencode_ ? raw.get() : page,
                             reencode_ ? block_bytes_ : page_bytes_);
      if (!fence.ok()) {
        host_->Abort(hash);
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.dropped_demotions;
        return KvTier::kNone;
      }
      // In the host tier from now on (visible to loads once written).
      PublishTier(true, KvTier::kHost, hash);
      writer_->Post([this, hash, page, raw, fence = *std::move(fence)] {
        if (!WaitFence(fence)) {
          host_->Abort(hash);
          PublishTier(false, KvTier::kHost, hash);
          std::lock_guard<std::mutex> lock(stats_mu_);
          ++stats_.dropped_demotions;
          return;
        }
        if (raw != nullptr) EncodePage(raw.get(), page);
        host_->Publish(hash, XXH3_64bits(page, static_cast<size_t>(page_bytes_)));
      });
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.demotions_host;
      stats_.bytes_to_host += page_bytes_;
      if (reencode_) ++stats_.lossy_reencoded_blocks;
      return KvTier::kHost;
    }
    // kFull: every page is pinned. Fall through to the disk tier.
  }
  if (disk_ != nullptr && b.hits >= options_.disk_min_hits) {
    if (pending_disk_bytes_.load() + page_bytes_ <= options_.max_pending_disk_bytes) {
      PageBuffer copy = AllocatePage(page_bytes_);
      std::shared_ptr<uint8_t> raw = staging();
      if (copy != nullptr && (!reencode_ || raw != nullptr)) {
        absl::StatusOr<Fence> fence = CopyBlockOut(b.data, reencode_ ? raw.get() : copy.get(),
                                                   reencode_ ? block_bytes_ : page_bytes_);
        if (fence.ok()) {
          PublishTier(true, KvTier::kDisk, b.hash);
          PostDiskStore(b.hash, b.hits, std::move(copy), std::move(raw), *std::move(fence));
          if (reencode_) {
            std::lock_guard<std::mutex> lock(stats_mu_);
            ++stats_.lossy_reencoded_blocks;
          }
          return KvTier::kDisk;
        }
      }
    }
  } else if (disk_ != nullptr) {
    RememberGhost(b.hash, b.hits);
  }
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.dropped_demotions;
  return KvTier::kNone;
}

void KvTiers::HashChain(std::string_view salt, absl::Span<const int32_t> tokens, int32_t n,
                        std::vector<uint64_t>* out) const {
  // As the radix index names them (public prefixes chain from the public
  // root), so a demoted public block is every scope's hit.
  cache_->ChainHashes(salt, tokens, n, out);
}

int32_t KvTiers::Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                        int32_t limit) {
  // Without a recompute cost every held block is worth loading.
  return LookupWorthLoading(salt, tokens, from, limit, 0);
}

double KvTiers::PredictReloadSeconds(int64_t hits) const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  if (host_ != nullptr) return BlockLoadSecondsLocked(KvTier::kHost);
  if (disk_ != nullptr && hits >= options_.disk_min_hits) return BlockLoadSecondsLocked(KvTier::kDisk);
  return -1;
}

double KvTiers::BlockLoadSecondsLocked(KvTier tier) const {
  return tier == KvTier::kHost ? stats_.host_block_load_s : stats_.disk_block_load_s;
}

void KvTiers::RecordBlockLoadLocked(KvTier tier, double seconds) {
  // A moving average: a fifth of each new timing, so a page-cache hit or a
  // cold read moves the estimate without one outlier owning it.
  double& e = tier == KvTier::kHost ? stats_.host_block_load_s : stats_.disk_block_load_s;
  e = 0.8 * e + 0.2 * seconds;
}

int32_t KvTiers::LookupWorthLoading(std::string_view salt, absl::Span<const int32_t> tokens,
                                    int32_t from, int32_t limit,
                                    double recompute_seconds_per_token) {
  if (cache_ == nullptr || (host_ == nullptr && disk_ == nullptr)) return 0;
  if (from % block_size_ != 0 || from >= limit) return 0;
  const int32_t bs = block_size_;
  const int32_t full = static_cast<int32_t>(tokens.size()) / bs;
  std::vector<uint64_t> chain;
  HashChain(salt, tokens, full, &chain);
  double host_s = 0, disk_s = 0;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    host_s = BlockLoadSecondsLocked(KvTier::kHost);
    disk_s = BlockLoadSecondsLocked(KvTier::kDisk);
  }
  // A load runs on the loader thread while the engine keeps stepping other
  // requests; a recompute takes engine steps everyone shares. So a load is
  // given up only when it is predicted several times slower than the
  // recompute, not merely slower (tiny models sit near the line, where
  // timing noise alone would flip the choice).
  constexpr double kLoadOverlapFactor = 4;
  const double recompute_block_s = recompute_seconds_per_token * bs * kLoadOverlapFactor;
  int32_t n = 0;
  int64_t left = 0;  // held by a tier, but cheaper to recompute
  bool worth = true;
  for (int32_t b = from / bs; b < full && b * bs < limit; ++b) {
    const uint64_t h = chain[b];
    // The tier Start would load it from: the host tier first.
    KvTier tier = KvTier::kNone;
    if (host_ && host_->Contains(h)) {
      tier = KvTier::kHost;
    } else if (disk_ && disk_->Contains(h)) {
      tier = KvTier::kDisk;
    } else {
      break;
    }
    if (worth && recompute_seconds_per_token > 0 &&
        (tier == KvTier::kHost ? host_s : disk_s) > recompute_block_s) {
      worth = false;  // the rest of the chain is recomputed with this block
    }
    if (worth) {
      n += bs;
    } else {
      ++left;
    }
  }
  if (left > 0) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.recompute_chosen_blocks += left;
  }
  // KV cache groups: the longest run every group can serve. A shorter run
  // moves the window earlier, so each length is checked on its own.
  auto held = [&](uint64_t key) {
    return (host_ && host_->Contains(key)) || (disk_ && disk_->Contains(key));
  };
  for (; n > 0 && num_groups() > 1; n -= bs) {
    const int32_t end = std::min(from + n, limit);
    const int32_t last = (end + bs - 1) / bs;
    bool all = true;
    for (int32_t g = 1; g < num_groups() && all; ++g) {
      for (int32_t b = GroupFirstBlock(g, from / bs, end); b < last && all; ++b) {
        all = held(GroupKey(chain[b], g));
      }
    }
    if (all) break;
  }
  return std::max(n, 0);
}

std::shared_ptr<KvLoad> KvTiers::Start(const KvLoadTarget& t) {
  if (cache_ == nullptr || t.num_tokens <= 0 || t.first_slot % block_size_ != 0) return nullptr;
  const int32_t bs = block_size_;
  const int32_t first = t.first_slot / bs;
  const int32_t end = t.first_slot + t.num_tokens;
  const int32_t last = (end + bs - 1) / bs;  // exclusive
  if (static_cast<int64_t>(t.tokens.size()) < static_cast<int64_t>(last) * bs) return nullptr;
  if (t.view.n_seqs != 1 || t.view.seq_block_offsets[1] < last) return nullptr;
  std::vector<uint64_t> chain;
  HashChain(t.salt, t.tokens, last, &chain);
  std::vector<LoadItem> items;
  auto unpin = [&] {
    for (const LoadItem& it : items) {
      if (it.tier == KvTier::kHost) host_->Unpin(it.hash);
      if (it.tier == KvTier::kDisk) disk_->Unpin(it.hash);
    }
  };
  // KV cache groups: one target per group (KvLoadTarget::groups), each
  // loading what its window needs (GroupFirstBlock).
  const int32_t n_groups = std::max(1, num_groups());
  if (n_groups > 1 && static_cast<int32_t>(t.groups.size()) != n_groups - 1) return nullptr;
  for (int32_t g = 0; g < n_groups; ++g) {
    const kernels::PagedKvView& view = g == 0 ? t.view : t.groups[g - 1].view;
    if (g > 0 && (view.n_seqs != 1 || view.seq_block_offsets[1] < last)) {
      unpin();
      return nullptr;
    }
    const int32_t from_block =
        g == 0 ? first
               : std::max(GroupFirstBlock(g, first, end), t.groups[g - 1].first_slot / bs);
    for (int32_t b = from_block; b < last; ++b) {
      LoadItem it;
      it.hash = GroupKey(chain[b], g);
      it.counted = g == 0;
      it.dest = view.pool + static_cast<int64_t>(view.block_ids[b]) * view.block_bytes;
      it.tokens = std::min(end, (b + 1) * bs) - b * bs;
      if (host_ && (it.host_page = host_->Pin(it.hash, &it.checksum)) != nullptr) {
        it.tier = KvTier::kHost;
      } else if (disk_ && disk_->Pin(it.hash, &it.checksum)) {
        it.tier = KvTier::kDisk;
      } else {
        unpin();  // evicted since Lookup: the caller recomputes instead
        return nullptr;
      }
      items.push_back(it);
    }
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    for (const LoadItem& it : items) stats_.load_predicted_sum_s += BlockLoadSecondsLocked(it.tier);
  }
  // A device pool: the copies into the blocks follow what the forward has
  // enqueued so far (a block's previous owner's last reads).
  absl::StatusOr<Fence> after = MarkComputeStream();
  if (!after.ok()) {
    spdlog::warn("KV tiers: load not started: {}", std::string(after.status().message()));
    unpin();
    return nullptr;
  }
  auto load = std::make_shared<TierLoad>();
  loader_->Post([this, load, items = std::move(items), after = *std::move(after)]() mutable {
    RunLoad(load, std::move(items), std::move(after));
  });
  return load;
}

absl::Status KvTiers::ChecksumFailed(const LoadItem& it) {
  absl::Status s = absl::DataLossError(
      absl::StrFormat("KV %s tier block %016x failed its checksum", KvTierName(it.tier), it.hash));
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.checksum_failures;
  }
  spdlog::warn("{}; recomputing its tokens", std::string(s.message()));
  if (it.tier == KvTier::kHost) host_->Remove(it.hash);
  if (it.tier == KvTier::kDisk) disk_->Remove(it.hash);
  PublishTier(false, it.tier, it.hash);
  return s;
}

void KvTiers::CountLoaded(const LoadItem& it, KvLoadSources* src, int64_t* from_host,
                          int64_t* from_disk) const {
  // Pages are counted by tier; tokens once per block (group 0's page).
  const int32_t tokens = it.counted ? it.tokens : 0;
  if (it.tier == KvTier::kHost) {
    src->host_tokens += tokens;
    ++*from_host;
  } else {
    src->disk_tokens += tokens;
    ++*from_disk;
  }
  if (reencode_) src->lossy_tokens += tokens;
}

absl::Status KvTiers::LoadToDevice(const std::vector<LoadItem>& items, const Fence& after,
                                   KvLoadSources* src, int64_t* from_host, int64_t* from_disk) {
  const auto t0 = std::chrono::steady_clock::now();
  cuda::StreamHandle stream = copy_stream_.get();
  absl::Status status = after != nullptr ? after->after.BlockStream(stream) : absl::OkStatus();
  uint8_t* staging = device_staging_.as<uint8_t>();
  bool staging_in_flight = false;  // a copy out of `staging` may not have run yet
  auto free_staging = [&]() -> absl::Status {
    if (!staging_in_flight) return absl::OkStatus();
    staging_in_flight = false;
    return copy_stream_.Synchronize();
  };
  int64_t loaded = 0;
  for (const LoadItem& it : items) {
    if (!status.ok()) break;
    absl::Status s;
    // The page in host memory: a pinned host-tier page, or a disk page read
    // into the pinned staging block (the pageable scratch when it is decoded).
    const uint8_t* page = it.host_page;
    if (it.tier == KvTier::kDisk) {
      uint8_t* into = reencode_ ? load_scratch_.get() : staging;
      if (!reencode_) s = free_staging();
      if (s.ok()) s = disk_->Read(it.hash, into);
      page = into;
    }
    // Verified before the upload: device memory is not hashed here.
    if (s.ok() && XXH3_64bits(page, static_cast<size_t>(page_bytes_)) != it.checksum) {
      s = ChecksumFailed(it);
    }
    const uint8_t* upload = page;
    if (s.ok() && reencode_) {
      s = free_staging();
      if (s.ok()) DecodePage(page, staging);
      upload = staging;
    }
    if (s.ok()) {
      s = cuda::CopyToDeviceAsync(it.dest, upload, static_cast<size_t>(block_bytes_), stream);
    }
    if (upload == staging) staging_in_flight = true;
    if (!s.ok()) {
      status = s;
      break;
    }
    ++loaded;
    CountLoaded(it, src, from_host, from_disk);
  }
  // One wait for every copy; the host pages stay pinned until it.
  const absl::Status synced = copy_stream_.Synchronize();
  if (status.ok()) status = synced;
  for (const LoadItem& it : items) {
    if (it.tier == KvTier::kHost) host_->Unpin(it.hash);
    if (it.tier == KvTier::kDisk) disk_->Unpin(it.hash);
  }
  if (status.ok() && loaded > 0) {
    // The copies overlap: each block is charged its share of the whole.
    const double block_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
        static_cast<double>(loaded);
    std::lock_guard<std::mutex> lock(stats_mu_);
    if (*from_host > 0) RecordBlockLoadLocked(KvTier::kHost, block_s);
    if (*from_disk > 0) RecordBlockLoadLocked(KvTier::kDisk, block_s);
  }
  return status;
}

absl::Status KvTiers::LoadToHost(const std::vector<LoadItem>& items, KvLoadSources* src,
                                 int64_t* from_host, int64_t* from_disk) {
  absl::Status status;
  for (const LoadItem& it : items) {
    if (status.ok()) {
      const auto b0 = std::chrono::steady_clock::now();
      absl::Status s;
      bool verified = false;
      if (!reencode_) {
        if (it.tier == KvTier::kHost) {
          std::memcpy(it.dest, it.host_page, static_cast<size_t>(page_bytes_));
        } else {
          s = disk_->Read(it.hash, it.dest);
        }
        // Verified where the bytes landed: this covers the tier's memory or
        // file and the copy itself.
        verified = s.ok() && XXH3_64bits(it.dest, static_cast<size_t>(page_bytes_)) == it.checksum;
      } else {
        // Re-encoded pages: the encoded bytes are verified (in the pinned
        // host page, or read into scratch), then decoded into the block.
        const uint8_t* page = it.host_page;
        if (it.tier == KvTier::kDisk) {
          s = disk_->Read(it.hash, load_scratch_.get());
          page = load_scratch_.get();
        }
        verified = s.ok() && XXH3_64bits(page, static_cast<size_t>(page_bytes_)) == it.checksum;
        if (verified) DecodePage(page, it.dest);
      }
      if (s.ok() && !verified) s = ChecksumFailed(it);
      if (s.ok()) {
        const double block_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - b0).count();
        {
          std::lock_guard<std::mutex> lock(stats_mu_);
          RecordBlockLoadLocked(it.tier, block_s);
        }
        CountLoaded(it, src, from_host, from_disk);
      } else {
        status = s;
      }
    }
    if (it.tier == KvTier::kHost) host_->Unpin(it.hash);
    if (it.tier == KvTier::kDisk) disk_->Unpin(it.hash);
  }
  return status;
}

void KvTiers::RunLoad(const std::shared_ptr<TierLoad>& load, std::vector<LoadItem> items,
                      Fence after) {
  const auto t0 = std::chrono::steady_clock::now();
  KvLoadSources src;
  int64_t from_host = 0, from_disk = 0;
  const absl::Status status = device_ ? LoadToDevice(items, after, &src, &from_host, &from_disk)
                                      : LoadToHost(items, &src, &from_host, &from_disk);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.loads;
    int bucket = 0;
    while (bucket < kTierLoadLatencyBuckets && seconds > kTierLoadLatencyBounds[bucket]) ++bucket;
    ++stats_.load_latency_buckets[bucket];
    stats_.load_latency_sum_s += seconds;
    if (status.ok()) {
      stats_.promotions_host += from_host;
      stats_.promotions_disk += from_disk;
      stats_.bytes_from_host += from_host * page_bytes_;
      stats_.bytes_from_disk += from_disk * page_bytes_;
      stats_.hit_tokens_host += src.host_tokens;
      stats_.hit_tokens_disk += src.disk_tokens;
      stats_.lossy_hit_tokens += src.lossy_tokens;
    }
  }
  load->Finish(status, status.ok() ? src : KvLoadSources{});
}

void KvTiers::Flush() {
  // A load never posts writes and a write never posts loads, so one pass
  // over each settles both.
  if (loader_) loader_->Flush();
  if (writer_) writer_->Flush();
}

int64_t KvTiers::PersistForRestart(const PrefixCache& cache, int32_t group) {
  if (disk_ == nullptr) return 0;
  Flush();
  int64_t written = 0;
  PageBuffer encoded = reencode_ ? AllocatePage(page_bytes_) : nullptr;
  // A device pool's blocks come to host memory first, one at a time.
  PageBuffer host_copy = device_ ? AllocatePage(block_bytes_) : nullptr;
  auto store = [&](uint64_t hash, const uint8_t* data, int64_t hits) {
    auto ghost = ghost_hits_.find(hash);
    int64_t all = hits + (ghost == ghost_hits_.end() ? 0 : ghost->second);
    if (retained_ && retained_(hash)) all = std::max<int64_t>(all, options_.disk_min_hits);
    if (all < options_.disk_min_hits || disk_->Contains(hash)) return;
    const uint64_t checksum = XXH3_64bits(data, static_cast<size_t>(page_bytes_));
    std::vector<uint64_t> evicted;
    // Stored first (the event log still knows the block), taken back when
    // the write fails.
    PublishTier(true, KvTier::kDisk, hash);
    const absl::Status st = disk_->Store(hash, data, checksum, all, &evicted);
    for (uint64_t h : evicted) PublishTier(false, KvTier::kDisk, h);
    if (!st.ok()) PublishTier(false, KvTier::kDisk, hash);
    if (st.ok()) {
      ++written;
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.demotions_disk;
      stats_.bytes_to_disk += page_bytes_;
    }
  };
  // Radix blocks first: a prefix's first blocks are what every later block
  // of it needs to be found.
  // (The pool's blocks are re-encoded into the pages' codec first.)
  cache.ForEachFullBlock([&](const EvictedBlock& b) {
    const uint8_t* data = b.data;
    if (b.on_device) {
      if (host_copy == nullptr) return;
      absl::StatusOr<Fence> fence = CopyBlockOut(b.data, host_copy.get(), block_bytes_);
      if (!fence.ok() || !WaitFence(*fence)) return;
      data = host_copy.get();
    }
    const uint64_t key = GroupKey(b.hash, group);
    if (!reencode_) return store(key, data, b.hits);
    if (encoded == nullptr) return;
    EncodePage(data, encoded.get());
    store(key, encoded.get(), b.hits);
  });
  if (host_ != nullptr && group == 0) {
    for (const auto& [hash, hits] : host_->ReadyPages()) {
      uint64_t checksum = 0;
      const uint8_t* page = host_->Pin(hash, &checksum);
      if (page == nullptr) continue;
      store(hash, page, hits);
      host_->Unpin(hash);
    }
  }
  spdlog::info("KV disk tier: {} blocks written at shutdown for the next start", written);
  return written;
}

KvTiersStats KvTiers::stats() const {
  KvTiersStats s;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    s = stats_;
  }
  s.host_enabled = host_ != nullptr;
  s.disk_enabled = disk_ != nullptr;
  s.lossy = reencode_;
  s.page_bytes = page_bytes_;
  if (host_) {
    const HostTierStats h = host_->stats();
    s.host_blocks = h.pages;
    s.host_capacity_blocks = h.capacity_pages;
  }
  if (disk_) {
    const DiskTierStats d = disk_->stats();
    s.disk_blocks = d.files;
    s.disk_capacity_blocks = d.capacity_files;
  }
  return s;
}

absl::StatusOr<std::string> FileContentHash(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path));
  }
  XXH128_hash_t h = XXH3_128bits(nullptr, 0);
  if (st.st_size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot map ", path));
    }
    h = XXH3_128bits(p, static_cast<size_t>(st.st_size));
    ::munmap(p, static_cast<size_t>(st.st_size));
  }
  ::close(fd);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

}  // namespace kvserve
