// KvTiers: the host and disk tiers under the primary KV pool, joined to the
// engine through its two seams. As the prefix cache's BlockDemotionSink it
// takes every evicted full block (write-back): the engine thread copies the
// block into a host page, a writer thread checksums and publishes it; pages
// the host tier evicts go on to the disk tier when they proved useful (hit
// at least disk_min_hits times, Dynamo's rule), or blocks go there straight
// from the pool when there is no host tier. As the scheduler's KvLoader it
// answers, for a request whose radix match stops short, how many following
// blocks the tiers hold (by the same chained hash the radix index uses), and
// loads them into the request's fresh primary blocks on a loader thread,
// verifying each block's checksum in place; on completion the scheduler
// commits them, which publishes them to the radix index. A mismatch fails
// the load (the tokens are recomputed), counts, logs and drops the page.
//
// With a host dtype (--kv-host-dtype int8|fp8-e4m3|int4-kivi) other than
// the pool's, a demoted block is copied into a staging buffer on the engine
// thread and re-encoded into it (kernels/cpu/kv_transcode.h) on the writer
// before its checksum, so host and disk
// pages are smaller and the same budget holds more blocks; a load checks
// the page's checksum and decodes it into the pool's codec. Such K/V is
// lossy: every load from these tiers reports its tokens as lossy
// (KvLoadSources::lossy_tokens) and the scheduler marks the radix nodes
// they enter lossy. The default (the pool's own dtype) moves the bytes
// unchanged: bit-identical.
//
// A device pool (--device cuda): blocks move on a copy stream of the tiers'
// own. A demotion's device-to-host copy is enqueued after what the forward's
// stream has enqueued so far (the block's last writes) and the forward's
// stream waits for it before its next work (the pool hands the block out
// again as soon as Demote returns), without the engine thread waiting; the
// writer waits for the copy's event before it checksums. Host pages are
// pinned memory (a PageArena over cudaHostAlloc), so copies both ways run
// asynchronously. A load verifies each page's checksum in host memory
// before its host-to-device copy (disk pages and re-encoded pages pass
// through a pinned staging block), waits for the copies' event, and only
// then unpins the host pages and completes.
//
// Pages being written or read are pinned in their tier and never evicted;
// a full tier refuses new pages instead of waiting, so nothing here blocks
// the engine thread on another thread's progress.
//
// Thread-safety: Demote, Lookup and Start run on the engine thread; the
// workers synchronize with it through the tiers' own mutexes and the loads'
// completion flags; stats() may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/disk_tier.h"
#include "cache/host_tier.h"
#include "cache/kv_pool.h"
#include "cache/prefix_cache.h"
#include "kernels/cpu/kv_transcode.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"
#include "scheduler/kv_loader.h"

namespace kvserve {

struct KvTiersOptions {
  int64_t host_bytes = 0;     // --kv-host-memory; 0: no host tier
  std::string disk_dir;       // --kv-disk-dir; empty: no disk tier
  int64_t disk_bytes = 0;     // --kv-disk-bytes
  // The model's identity for the disk tier (weights content hash and
  // tokenizer; server/ computes it); the pool's dtype, block size and shape
  // are mixed in at Attach.
  std::string model_fingerprint;
  int32_t disk_min_hits = 2;
  // The load cost model's starting point (seconds to load one block from
  // each tier) until loads have been timed; 0: estimated from the page size
  // (host 4 GB/s, disk 400 MB/s). Each timed block load then updates the
  // tier's estimate (moving average).
  double host_block_load_s = 0;
  double disk_block_load_s = 0;
  DiskFileLayer* disk_files = nullptr;  // tests: an injected file layer
  // --kv-host-dtype: the codec of host and disk pages; unset ("same"): the
  // pool's own bytes. Another codec than the pool's must make pages
  // smaller (Attach refuses it otherwise) and is lossy.
  std::optional<kernels::KvDType> host_dtype;
  // Demoted bytes queued for the disk writer at most; past it demotions to
  // disk are dropped (counted) rather than queued without bound.
  int64_t max_pending_disk_bytes = int64_t{256} << 20;
};

// Upper bounds (seconds) of the load-latency histogram's buckets.
inline constexpr double kTierLoadLatencyBounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                    0.05,   0.1,   0.25,   0.5,   1,    2.5};
inline constexpr int kTierLoadLatencyBuckets =
    sizeof(kTierLoadLatencyBounds) / sizeof(kTierLoadLatencyBounds[0]);

struct KvTiersStats {
  bool host_enabled = false, disk_enabled = false;
  int64_t host_blocks = 0, host_capacity_blocks = 0;
  int64_t disk_blocks = 0, disk_capacity_blocks = 0;
  int64_t demotions_host = 0, demotions_disk = 0;    // blocks written into each tier
  int64_t promotions_host = 0, promotions_disk = 0;  // blocks loaded from each tier
  int64_t bytes_to_host = 0, bytes_from_host = 0;
  int64_t bytes_to_disk = 0, bytes_from_disk = 0;
  int64_t hit_tokens_host = 0, hit_tokens_disk = 0;  // prompt tokens loaded instead of computed
  int64_t checksum_failures = 0;
  int64_t disk_write_failures = 0;
  int64_t dropped_demotions = 0;  // evicted blocks no tier could take
  int64_t disk_recovered = 0;     // blocks found on disk at start
  int64_t loads = 0;
  // Load latency (Start to completion): per bucket (not cumulative), sum, count.
  int64_t load_latency_buckets[kTierLoadLatencyBuckets + 1] = {};
  double load_latency_sum_s = 0;
  // The load-vs-recompute cost model: the current estimate of one block's
  // load from each tier, the predicted seconds of the loads started (their
  // sum, next to load_latency_sum_s for predicted vs actual), and the blocks
  // the tiers held but left to be recomputed because recomputing was cheaper.
  double host_block_load_s = 0, disk_block_load_s = 0;
  double load_predicted_sum_s = 0;
  int64_t recompute_chosen_blocks = 0;
  // --kv-host-dtype lossier than the pool's: blocks re-encoded on the way
  // down, and the tokens loads brought back decoded from them.
  bool lossy = false;
  int64_t page_bytes = 0;  // one block as a tier page (after re-encoding)
  int64_t lossy_reencoded_blocks = 0;
  int64_t lossy_hit_tokens = 0;
};

class KvTiers final : public KvLoader, public BlockDemotionSink {
 public:
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<KvTiers>> Create(KvTiersOptions options);
  ~KvTiers() override;  // finishes queued writes and loads

  // Engine::Create, once: the primary pool (page size, shape) and the radix
  // index (root hashes). Opens the disk tier and indexes what it holds.
  // REQUIRES: both outlive every later call.
  [[nodiscard]] absl::Status Attach(const KvPool& pool, const PrefixCache* cache);

  // BlockDemotionSink (engine thread).
  KvTier Demote(const EvictedBlock& block) override;
  // KvLoader (engine thread). Lookup supplies whole blocks from a block
  // boundary only.
  int32_t Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                 int32_t limit) override;
  // Lookup under the cost model: stops at the first block whose tier's
  // estimated load time exceeds recomputing its tokens (a prefix chain: the
  // blocks after it are recomputed too). Counts what it leaves.
  int32_t LookupWorthLoading(std::string_view salt, absl::Span<const int32_t> tokens,
                             int32_t from, int32_t limit,
                             double recompute_seconds_per_token) override;
  // Seconds to load one block back that is evicted now with `hits` radix
  // hits: the host tier's estimate when there is one, else the disk's when
  // the block qualifies for it (disk_min_hits); negative when no tier would
  // take it. The cost-aware eviction policy's price (any thread).
  double PredictReloadSeconds(int64_t hits) const;
  // A match that ends inside a resident block (prompts sharing a BOS or a
  // template header) is re-matched at the block boundary when the tiers
  // hold more from there.
  bool RematchWholeBlocks() const override { return true; }
  std::shared_ptr<KvLoad> Start(const KvLoadTarget& target) override;

  // Retention (scheduler/cache_control.h): a block this says is or was
  // retained counts as proven useful (disk_min_hits) wherever it goes, so a
  // retained prefix leaving the pool (its lease lapsed, or the shutdown
  // persisting it) is demoted to the host or disk tier and spilled on from
  // the host to the disk, never dropped while a tier can take it. Engine
  // thread; set before the engine runs.
  void SetRetainedPredicate(std::function<bool(uint64_t hash)> retained) {
    retained_ = std::move(retained);
  }

  // KV cache groups (a hybrid-attention model): per group its window (0:
  // full attention; group 0 is full and uses this object as its demotion
  // sink). Every group's pool blocks are pages here, group g's keyed by
  // GroupKey(chained hash, g) and demoted through group_demotion(g). A
  // lookup then supplies a run of blocks only when every group can: the
  // full group's pages for each block, each window group's for the blocks
  // its window reaches at the run's end (the prefix cache's hit rule);
  // Start loads exactly those (KvLoadTarget::groups). Engine thread, before
  // the engine runs.
  void SetGroups(std::vector<int32_t> windows);
  int32_t num_groups() const { return static_cast<int32_t>(group_windows_.size()); }
  // Group g's demotion sink (g >= 1; group 0: this object).
  BlockDemotionSink* group_demotion(int32_t g) const;
  // The key of group g's page of the block with chained hash `hash`: the
  // hash itself for group 0, a hash of (hash, g) for the others (stable
  // across restarts, so the disk tier finds them again).
  static uint64_t GroupKey(uint64_t hash, int32_t group);

  // KV events (cache/kv_event_log.h): every block this stores in a tier is
  // published as stored there (KvCacheEvent::tier), every page leaving a
  // tier as removed from it (moved_to: the disk for a spilled host page).
  // Published from the engine thread and from the writer and loader
  // threads, so the sink must be thread-safe. Set before Attach; null: none.
  void SetEventSink(KvEventSink* sink) { events_ = sink; }

  // Waits until every queued write and load has finished (tests; shutdown).
  void Flush();
  // Shutdown with a disk tier: writes every block that qualifies for the
  // disk (hit at least disk_min_hits times) from the radix index and the
  // host tier to disk, so a restart finds the hot prefixes, not only those
  // that happened to be evicted. Blocking; engine thread (or engine
  // stopped). Returns the blocks written. group: the KV cache group whose
  // index `cache` is (its pages are keyed GroupKey(hash, group)); the host
  // tier's pages (every group's) go with group 0's call.
  int64_t PersistForRestart(const PrefixCache& cache, int32_t group = 0);
  KvTiersStats stats() const;
  // From the options (before Attach).
  bool disk_enabled_requested() const { return !options_.disk_dir.empty(); }
  const std::string& model_fingerprint() const { return options_.model_fingerprint; }
  int64_t host_bytes() const { return options_.host_bytes; }
  // After Attach: the pool is in device memory (copies run on a copy stream
  // and host pages are pinned).
  bool on_device() const { return device_; }
  // After Attach: pages are re-encoded into another codec than the pool's
  // (lossy), and that codec.
  bool lossy() const { return reencode_; }
  kernels::KvDType page_dtype() const { return page_dtype_; }
  int64_t page_bytes() const { return page_bytes_; }
  bool host_enabled() const { return host_ != nullptr; }
  bool disk_enabled() const { return disk_ != nullptr; }
  // The disk tier's directory (dir/fingerprint), empty without one.
  std::string disk_directory() const { return disk_ ? disk_->directory() : std::string(); }
  // Tests: the tiers themselves.
  HostTier* host() { return host_.get(); }
  DiskTier* disk() { return disk_.get(); }

 private:
  explicit KvTiers(KvTiersOptions options);
  class Worker;
  class TierLoad;
  struct LoadItem;
  // The chained hashes of blocks [0, n) of tokens under salt's root.
  void HashChain(std::string_view salt, absl::Span<const int32_t> tokens, int32_t n,
                 std::vector<uint64_t>* out) const;
  // Queues a page the host tier evicted for the disk; false when it does
  // not go there (no disk tier, not proven useful, too much queued).
  bool SpillToDisk(EvictedPage page);
  // The writer's half of a disk demotion: stores the page, counts.
  void StoreOnDisk(const EvictedPage& page);
  // One tier event to events_ (nothing without a sink).
  void PublishTier(bool stored, KvTier tier, uint64_t hash,
                   KvTier moved_to = KvTier::kNone) const;
  // A pool block into a page (re-encoded, or copied when the codecs agree),
  // and back.
  void EncodePage(const uint8_t* block, uint8_t* page) const;
  void DecodePage(const uint8_t* page, uint8_t* block) const;
  // Hits of a block that left every tier without qualifying for the disk,
  // plus one: seeing the hash again means it was recomputed, i.e. reused
  // (ARC's ghost list, bounded). Engine thread only.
  int64_t TakeGhostHits(uint64_t hash);
  void RememberGhost(uint64_t hash, int64_t hits);
  // The device path's ordering token: the event on the forward's stream a
  // copy waits for, and the copy's own event (null: a host pool, whose
  // copies are done when they return). Both live until the copy was waited
  // for.
  struct DeviceFence;
  using Fence = std::shared_ptr<DeviceFence>;
  // Engine thread: a pool block's bytes into host memory `dst`: a memcpy for
  // a host pool; for a device pool an asynchronous copy on the copy stream,
  // after the forward's stream's work so far and before its next (see the
  // file comment). The bytes are there once WaitFence(fence) returned true.
  absl::StatusOr<Fence> CopyBlockOut(const uint8_t* block, uint8_t* dst, int64_t bytes);
  // An event recorded on the forward's stream now (a load's copies follow
  // the work already enqueued on the blocks it writes); null on the host.
  absl::StatusOr<Fence> MarkComputeStream();
  static bool WaitFence(const Fence& fence);
  // The writer stores a page on disk once its bytes are there (fence), after
  // re-encoding `raw` into it when set; the checksum is taken on the writer.
  void PostDiskStore(uint64_t hash, int64_t hits, PageBuffer page, std::shared_ptr<uint8_t> raw,
                     Fence fence);
  void RunLoad(const std::shared_ptr<TierLoad>& load, std::vector<LoadItem> items, Fence after);
  // RunLoad's halves. Host: each page copied (or read) into its block and
  // verified there. Device: every page verified, then copied on the copy
  // stream, then one wait.
  absl::Status LoadToHost(const std::vector<LoadItem>& items, KvLoadSources* src,
                          int64_t* from_host, int64_t* from_disk);
  absl::Status LoadToDevice(const std::vector<LoadItem>& items, const Fence& after,
                            KvLoadSources* src, int64_t* from_host, int64_t* from_disk);
  // A block loaded: its tokens counted by tier (and as lossy when re-encoded).
  void CountLoaded(const LoadItem& it, KvLoadSources* src, int64_t* from_host,
                   int64_t* from_disk) const;
  // A page that failed its checksum: counted, logged, dropped from its tier;
  // returns the load's error.
  absl::Status ChecksumFailed(const LoadItem& it);
  // The cost model's estimate for one block from `tier` (stats_mu_).
  double BlockLoadSecondsLocked(KvTier tier) const;
  void RecordBlockLoadLocked(KvTier tier, double seconds);

  KvTiersOptions options_;
  const PrefixCache* cache_ = nullptr;
  int32_t block_size_ = 0;
  int64_t block_bytes_ = 0;  // a pool block
  int64_t page_bytes_ = 0;   // a tier page (block_bytes_ unless re-encoded)
  kernels::KvBlockShape shape_;
  kernels::KvDType pool_dtype_ = kernels::KvDType::kF16;
  kernels::KvDType page_dtype_ = kernels::KvDType::kF16;
  bool reencode_ = false;
  PageBuffer load_scratch_;  // loader thread: a disk page before decoding
  // A device pool: the forward's stream, the tiers' copy stream, pinned
  // memory for host pages (the chunks outlive the arena, which outlives the
  // host tier) and the loader's pinned staging block.
  bool device_ = false;
  cuda::StreamHandle compute_stream_ = nullptr;
  cuda::CudaStream copy_stream_;
  std::vector<cuda::PinnedHostBuffer> pinned_chunks_;
  std::unique_ptr<PageArena> pinned_pages_;
  cuda::PinnedHostBuffer device_staging_;
  std::unique_ptr<HostTier> host_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<Worker> writer_;  // host checksums, disk stores
  std::unique_ptr<Worker> loader_;  // loads into the pool
  std::atomic<int64_t> pending_disk_bytes_{0};
  absl::flat_hash_map<uint64_t, int64_t> ghost_hits_;  // engine thread
  std::function<bool(uint64_t)> retained_;             // engine thread
  KvEventSink* events_ = nullptr;
  class GroupSink;
  std::vector<int32_t> group_windows_;                 // empty: one group
  std::vector<std::unique_ptr<GroupSink>> group_sinks_;  // groups 1..
  // The first block of [first, last) group g must load for a run ending at
  // token `end` (a window group: the blocks its window reaches).
  int32_t GroupFirstBlock(int32_t g, int32_t first, int32_t end) const;
  std::deque<uint64_t> ghost_order_;                   // oldest first

  mutable std::mutex stats_mu_;
  KvTiersStats stats_;  // guarded by stats_mu_ (tier occupancy filled in by stats())
};

// XXH3-128 of a file's content, as 32 hex digits: the weights part of a
// model fingerprint (the name plays no part).
[[nodiscard]] absl::StatusOr<std::string> FileContentHash(const std::string& path);

}  // namespace kvserve
