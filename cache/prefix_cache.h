// PrefixCache: a radix tree over the paged KV cache, at block granularity.
// Each node is one full block of block_size tokens; a path from a namespace
// root spells a cached token prefix, and each node holds one reference on the
// pool block that stores that prefix's K/V. Namespaces separate what must
// never be shared: the model identity and the request's cache_salt both seed
// the root, so two salts never match each other's blocks.
//
// Pinning is the pool's reference count: Match hands back blocks with one
// reference each, owned by the caller (a sequence's BlockTable). A cached
// block is evictable only while the cache holds its sole reference and no
// child hangs below it, so a pinned block can never be evicted, by
// construction. Eviction takes evictable leaves in the order of an
// EvictionPolicy (LRU by default, over an injectable clock).
//
// Every node also carries a stable 64-bit hash chained over its parent's hash
// and its tokens (XXH3), which is what the KV event stream publishes, so a
// router can keep an exact replica of the index.
//
// Not thread-safe: owned by the engine thread, like the pool.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "cache/kv_pool.h"

namespace kvserve {

// Monotonic time for LRU ordering; tests inject a manual clock.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowNanos() = 0;
};
// std::chrono::steady_clock.
Clock* SteadyClock();

// What an eviction policy may look at for one evictable block.
struct CachedBlockInfo {
  int64_t last_access_ns = 0;  // Match or Insert that touched the block last
  int64_t hits = 0;            // Matches that used the block
  int32_t depth = 0;           // 1 for a block directly under a namespace root
  uint64_t hash = 0;
  double access_base = 0;      // the policy's AccessBase() when last touched
};

// Chooses eviction order among evictable leaves: smaller Key goes first.
// Ties go to the block inserted earlier. Called on the engine thread only.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;
  virtual double Key(const CachedBlockInfo& b) const = 0;
  // Recorded with a block whenever it is touched (access_base); a
  // GreedyDual policy's inflation value. LRU: unused.
  virtual double AccessBase() const { return 0; }
  // The key of each block Evict removed, in eviction order.
  virtual void OnEvicted(double key) { (void)key; }
};
std::unique_ptr<EvictionPolicy> MakeLruPolicy();

// What a cost-aware policy asks about a block before it may evict it.
class EvictionCosts {
 public:
  virtual ~EvictionCosts() = default;
  // Seconds to compute the block's tokens again (its prefix still cached).
  virtual double RecomputeSeconds(const CachedBlockInfo& b) const = 0;
  // Seconds to load it back from the tier evicting it now would demote it
  // to; negative when no tier would take it (it would be dropped).
  virtual double ReloadSeconds(const CachedBlockInfo& b) const = 0;
};

// GreedyDual-Size-Frequency over what losing a block costs: the key of a
// block is L + min(hits + 1, 8) * restore, where restore is the cheaper of
// recomputing it and reloading it from the tier below (recompute when no
// tier would take it), and L (the inflation) is the key of the last block
// evicted, recorded with a block each time it is touched. So a block that
// is cheap to bring back (a tier holds it) goes before one that must be
// recomputed, a block hit often outlives one used once, and every block
// ages: L rises past an untouched block's key. With equal costs and no
// hits it is LRU. `costs` must outlive the policy.
std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(const EvictionCosts* costs);

// The tiers a block's K/V can live in below the primary pool (cache/host_tier.h,
// cache/disk_tier.h). kNone: nowhere (dropped).
enum class KvTier : int8_t { kNone = 0, kHost = 1, kDisk = 2 };
const char* KvTierName(KvTier t);  // "none", "host", "disk"

// One change to the index, as the KV event stream publishes it.
struct KvCacheEvent {
  enum class Kind { kBlockStored, kBlockRemoved, kAllCleared };
  Kind kind = Kind::kBlockStored;
  uint64_t block_hash = 0;          // stored / removed
  uint64_t parent_hash = 0;         // stored: 0 for a block under a namespace root
  std::vector<int32_t> token_ids;   // stored: the block's tokens (block_size of them)
  // stored, a first block (parent_hash 0) only: the cache namespace it lives
  // in (the request's cache_salt, tenant-scoped: TenantCacheScope) when not
  // the default one, so a consumer can key blocks the way the engine does.
  std::string scope;
  // removed: the tier the evicted block's K/V moved to (kNone: dropped), so
  // a router knows the block is still a (slower) hit on this node.
  KvTier moved_to = KvTier::kNone;
  // Where the block is (stored) or was (removed): kNone for the primary
  // pool's radix index, kHost / kDisk for a page of that tier (KvTiers
  // publishes those: a demoted block is stored there, a page leaving the
  // tier is removed from it, moved_to saying where it went). A tier event
  // may leave parent_hash, token_ids and scope empty; the event log fills
  // them from the block it knew under the same hash (KvEventLog).
  KvTier tier = KvTier::kNone;
  // KV cache groups (a hybrid-attention model): the group whose radix index
  // the event is about (0: the full group, or a model with one group). The
  // groups cache the same token chains under the same hashes, so a
  // consumer keys blocks by (group, hash) or keeps group 0 only. Set by the
  // group's sink (KvCacheManager); the index itself publishes 0.
  int32_t group = 0;
};

// A full block leaving the primary pool (PrefixCache::Evict), offered to the
// tiers below it before its pool block is released.
struct EvictedBlock {
  uint64_t hash = 0;           // the chained hash (names the whole prefix)
  int32_t depth = 0;
  int64_t hits = 0;            // Matches that used the block while cached
  bool lossy = false;          // the node was marked lossy (Insert's `lossy`)
  // The block's bytes, valid during the call: host memory, or device
  // memory when on_device (the pool's; the sink copies it on a stream).
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
  bool on_device = false;
};

// Takes evicted blocks into a lower tier (write-back on eviction). Called on
// the engine thread; must copy what it keeps before returning and must not
// block on I/O. Returns the tier that took the block (kNone: dropped).
class BlockDemotionSink {
 public:
  virtual ~BlockDemotionSink() = default;
  virtual KvTier Demote(const EvictedBlock& block) = 0;
};

// Receives index changes, in order, on the engine thread; must not block.
// A sink given to KvTiers also receives the tiers' events from their worker
// threads, so it must be thread-safe (KvEventLog is).
class KvEventSink {
 public:
  virtual ~KvEventSink() = default;
  virtual void Publish(std::vector<KvCacheEvent> events) = 0;
};

struct PrefixCacheOptions {
  std::string model_identity;        // seeds every namespace root hash
  Clock* clock = nullptr;            // nullptr: SteadyClock()
  std::unique_ptr<EvictionPolicy> policy;  // nullptr: LRU
  KvEventSink* events = nullptr;     // optional
  // With a window (SetWindow) and events: a node going hollow is published
  // as BlockRemoved (its K/V left the pool), a node hollow from the start is
  // not published, and a refilled one is published as BlockStored again.
  // Set for a hybrid model's window groups (KvCacheManager), whose events
  // carry their group; off, hollow nodes stay published as stored (a
  // router's replica keeps them, as for a Mistral-style window).
  bool publish_hollow = false;
  // Optional: evicted full blocks are offered here first (host memory pools
  // only; a partly filled tail block is never offered).
  BlockDemotionSink* demotion = nullptr;
  // Optional: told about every block Evict removes (its chained hash and
  // the tier it moved to), on the engine thread; the cache-miss explainer
  // keeps a bounded history of these (scheduler/cache_control.h).
  std::function<void(uint64_t hash, KvTier moved_to)> on_evict;
  // The namespace of public prefixes (MarkPublic): every other salt reuses
  // the public-marked blocks of a prompt's leading tokens, and caches what
  // follows them in a namespace of its own derived from (salt, the public
  // prefix), so only the public part is shared.
  std::string public_salt = std::string("\0public", 7);
};

// What the index knows about a prompt beyond its longest match (Probe).
struct PrefixProbe {
  int32_t matched_tokens = 0;     // what MatchLength returns
  int32_t public_tokens = 0;      // of those, served from public-marked blocks
  // A cached path continues past the match with other tokens: the prompt
  // diverged from it at matched_tokens; cached_next holds up to 8 of the
  // cached path's tokens from there.
  bool diverged = false;
  std::vector<int32_t> cached_next;
  // Chained hashes of the prompt's full blocks past the matched full blocks
  // (what a lower tier or the eviction history would know them by), and the
  // token index the first of them starts at.
  std::vector<uint64_t> next_block_hashes;
  int32_t next_block_start = 0;
  // Sliding window: tokens the tree still spells past matched_tokens whose
  // K/V the window dropped (hollow blocks inside the window of a longer
  // match), so they cannot be reused.
  int32_t window_dropped_tokens = 0;
};

struct PrefixMatch {
  std::vector<BlockHandle> blocks;  // one reference each, owned by the caller
  int32_t num_tokens = 0;           // tokens covered; the last block may be partly used
  // Of num_tokens, those in nodes marked lossy (K/V decoded from a lossy
  // tier re-encoding, or computed on top of it): not what an exact
  // recompute would give.
  int32_t lossy_tokens = 0;
};

struct PrefixCacheStats {
  int64_t queries = 0;         // Match calls
  int64_t query_tokens = 0;    // tokens offered to Match (after the max_tokens cap)
  int64_t hit_tokens = 0;      // tokens Match returned
  int64_t inserted_blocks = 0;
  int64_t evicted_blocks = 0;
  int64_t demoted_blocks = 0;  // of the evicted, taken by a lower tier
  int32_t cached_blocks = 0;   // nodes in the tree now holding a block (not hollow)
  // Sliding window: tokens Match could not return because the window had
  // dropped K/V they need, and blocks HollowBlock gave back to the pool.
  int64_t window_dropped_tokens = 0;
  int64_t hollowed_blocks = 0;
};

class PrefixCache {
 public:
  // REQUIRES: pool outlives the cache.
  PrefixCache(KvPool* pool, PrefixCacheOptions options);
  ~PrefixCache();  // releases the cache's references (no events)
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // The longest cached prefix of tokens[0, max_tokens), pinned for the
  // caller. Full blocks match whole; past them, the child block sharing the
  // most leading tokens with the rest is returned too and num_tokens counts
  // only the shared tokens (the caller's BlockTable copies that block before
  // writing into it). Touches every matched block for the policy.
  // Equally good partial candidates: the block cached first wins.
  // max_tokens <= 0 matches nothing.
  PrefixMatch Match(std::string_view salt, absl::Span<const int32_t> tokens, int32_t max_tokens);
  // Match for a retention lease: the full blocks of the longest cached
  // prefix of tokens[0, max_tokens), one reference each for the caller, with
  // their chained hashes in *hashes; neither counted in stats nor touched.
  PrefixMatch Pin(std::string_view salt, absl::Span<const int32_t> tokens, int32_t max_tokens,
                  std::vector<uint64_t>* hashes);
  // The token count Match would return, without pinning or touching.
  int32_t MatchLength(std::string_view salt, absl::Span<const int32_t> tokens,
                      int32_t max_tokens) const;
  // How far the tree spells tokens[0, max_tokens), hollow blocks included
  // (whether an Insert below that point can attach).
  int32_t PathLength(std::string_view salt, absl::Span<const int32_t> tokens,
                     int32_t max_tokens) const;

  // Sliding window (every layer attends to the last `window` slots only):
  // a node can go hollow (HollowBlock) - it keeps its tokens, so longer
  // prefixes stay reachable through it, but gives its block back to the
  // pool. Match, Pin, MatchLength and Probe then end a match only where the
  // last `window` tokens before its end all have their K/V, and hand out
  // `stand_in` (one reference each, like any block) for hollow blocks before
  // that window; the caller must never read it. Insert refills a hollow
  // node from a caller's real block, and caches a stand_in it meets where
  // no node is as a hollow node (a load from the KV tiers leaves the blocks
  // before its window's end as stand-ins), so the path goes on. Hollow nodes are not published as removed (a router's replica
  // keeps them; its matches may then be shorter here than it predicts).
  // REQUIRES: called once, before anything is cached; stand_in stays live.
  void SetWindow(int32_t window, BlockHandle stand_in);
  // Drops the K/V of the node holding `block` (its reference goes back to
  // the pool). False, with nothing changed, without a window, when no node
  // holds it, or when the node is public or keeps a boundary's window.
  bool HollowBlock(BlockHandle block);
  // The cached blocks of tokens from block first_block on (as far as the
  // tree spells them, a finished tail included) lie in the window of a
  // cached prefix boundary - a prompt's end, a finished sequence's end -
  // and are never hollowed. Returns the nodes marked.
  int32_t KeepWindow(std::string_view salt, absl::Span<const int32_t> tokens,
                     int32_t first_block);
  int32_t num_hollow_blocks() const;

  // Caches the full blocks of a sequence: blocks[i] holds tokens
  // [i * block_size, (i + 1) * block_size); only floor(tokens.size() /
  // block_size) blocks are considered. A prefix block already cached under
  // another pool block keeps the cached one (the caller's copy is not taken);
  // a new node takes a reference on the caller's block. Returns the number of
  // new nodes. Blocks past the full ones (the partial last) are ignored; with
  // fewer blocks than full token blocks, only those are cached. Existing nodes
  // on the path are touched. A (2^-64) hash collision with another prefix
  // stops the walk there: that suffix stays uncached.
  // REQUIRES: every considered block live. lossy: the new nodes are marked
  // lossy (the sequence's K/V is not exact: see PrefixMatch::lossy_tokens);
  // nodes already cached keep their mark.
  int32_t Insert(std::string_view salt, absl::Span<const int32_t> tokens,
                 absl::Span<const BlockHandle> blocks, bool lossy = false);

  // Insert, plus the partly filled last block of a sequence that will not
  // write it again (finished or preempted): blocks[floor(tokens.size() /
  // block_size)] holding the remaining tokens becomes a leaf that never has
  // children; later prompts reuse its leading tokens through copy-on-write
  // (the next turn of a chat starts with the previous reply's last tokens).
  // Skipped when a cached sibling already starts with those tokens. Returns
  // the new nodes. REQUIRES: nobody writes the partial block while it is
  // cached without first copying it (every holder sees a shared block and
  // copies on write).
  int32_t InsertFinished(std::string_view salt, absl::Span<const int32_t> tokens,
                         absl::Span<const BlockHandle> blocks, bool lossy = false);

  // Frees up to n evictable blocks back to the pool, in policy order (a
  // parent becomes a candidate once its last child is gone). Returns how
  // many were freed. Scans every node: O(N log N) per call.
  int32_t Evict(int32_t n);
  // Forgets every node and drops the cache's references (pinned blocks stay
  // with their holders). Publishes AllCleared (even when already empty).
  // Returns the nodes dropped.
  int32_t Clear();

  int32_t num_cached_blocks() const;
  // Blocks Evict could free now (leaves and chains with no outside reference).
  // O(1): kept up to date from the pool's refcount callbacks (KvPoolObserver),
  // which also see the releases sequences make without the cache.
  int32_t num_evictable_blocks() const;
  // The same count recomputed from every node's pool reference count: O(N),
  // for tests that check the incremental count.
  int32_t CountEvictableBlocksSlow() const;
  PrefixCacheStats stats() const;
  const EvictionPolicy& policy() const;

  // Probe: Match's walk without pinning or touching, plus what the index
  // knows past the match (the cache-miss explainer).
  PrefixProbe Probe(std::string_view salt, absl::Span<const int32_t> tokens) const;
  // The salts (namespaces) that have cached blocks now.
  std::vector<std::string> Salts() const;
  // Marks the cached full blocks of tokens under public_salt public (from
  // the first block on, as far as they are cached). Returns the blocks
  // marked (0 when nothing of it is cached there).
  int32_t MarkPublic(absl::Span<const int32_t> tokens);
  // Unmarks them again; returns the blocks unmarked.
  int32_t UnmarkPublic(absl::Span<const int32_t> tokens);
  int32_t num_public_blocks() const;
  const std::string& public_salt() const;

  // Calls fn for every cached full block (data in device memory for a
  // device pool), parents first, without changing anything: what a
  // shutdown persists.
  void ForEachFullBlock(const std::function<void(const EvictedBlock&)>& fn) const;

  // Every node as a BlockStored event, parents before children (the snapshot
  // a new subscriber starts from, and what tests compare replicas with).
  std::vector<KvCacheEvent> Dump() const;

  // The root hash of a namespace (model identity + salt); the parent hash
  // published for depth-1 blocks is 0, this is what their own hash chains on.
  // Root: XXH3_64bits(u64 length of model_identity, model_identity, salt).
  // Block: XXH3_64bits(parent's hash as 8 bytes, then its int32 tokens), all
  // in host byte order (little-endian on every machine we run on).
  uint64_t RootHash(std::string_view salt) const;
  // The chained hashes of tokens' first n_blocks full blocks (appended to
  // *out) as the index names them for salt: leading public-marked blocks
  // (marked, whether the pool still holds them or not) chain from the
  // public root, the rest from the namespace derived from them, or from
  // salt's root. What a lower tier keys a block by (KvTiers), so a public
  // prefix and the private parts after it are found there as in the pool.
  void ChainHashes(std::string_view salt, absl::Span<const int32_t> tokens, int32_t n_blocks,
                   std::vector<uint64_t>* out) const;
  // The chained hash of a block of `tokens` under a parent (or root) hash.
  static uint64_t BlockHash(uint64_t parent_hash, absl::Span<const int32_t> tokens);

 private:
  struct Node;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
