// KvCacheManager: the scheduler's only door to KV memory. It owns the block
// pool and the radix prefix cache and keeps each sequence's SeqKv (its block
// table and KV token counters) consistent with them. Everything that touches
// blocks goes through one of these operations, in the spirit of vLLM v1's
// KVCacheManager:
//
//   MatchPrefix    start an empty sequence from its longest cached prefix
//   DropPartialMatch  keep only the match's whole blocks (a loader goes on)
//   AllocateSlots  slots for n new tokens + k lookahead (draft) tokens + e
//                  external tokens (KV arriving from a tier or a peer)
//   MarkComputed   the forward (or a load) wrote K/V into m more slots
//   Commit         m computed tokens are final; newly full committed blocks
//                  are offered to the radix index (never drafts, never a
//                  lossy sequence's blocks)
//   Truncate       roll back uncommitted slots (rejected drafts, failed load)
//   Free           finished or preempted: cache what is committed, release
//   Fork           a new SeqKv sharing every block (copy-on-write)
//   EnsureFree     evict cached blocks until n are free (before preempting)
//   DropSlots      token eviction: keep only some slots, compacted to the
//                  front; whole blocks past them return to the pool
//
// SeqKv (below) is the interface type between the scheduler and this class:
// the scheduler reads it, only the manager changes it. The manager sees salts,
// token ids and blocks, never requests (DESIGN.md: cache/ never sees one, and
// neither does this facade).
//
// Not thread-safe: owned by the engine thread, like the pool and the index.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/block_table.h"
#include "cache/kv_pool.h"
#include "kernels/cpu/ops.h"
#include "cache/prefix_cache.h"

namespace kvserve {

// One sequence's KV. Invariants (KvCacheManager::CheckInvariants):
//   0 <= num_committed <= num_computed <= table.num_tokens()
//   num_offered_blocks * block_size <= num_committed, unless the blocks came
//     from a prefix match (then they are cached already)
//   lossy => nothing more is offered to the radix index
//   position_shift >= 0: the RoPE position of the token in slot i is
//     i + position_shift for every slot written after the shift was taken
//     (0 for a sequence that never dropped tokens: slot == position)
struct SeqKv {
  explicit SeqKv(KvPool* pool) : table(pool) {}
  BlockTable table;
  int32_t num_computed = 0;        // slots whose K/V are written
  int32_t num_committed = 0;       // of those, slots holding final tokens
  int32_t num_offered_blocks = 0;  // leading full blocks the radix index holds
  int32_t position_shift = 0;      // tokens dropped from the slots (token eviction)
  bool lossy = false;              // dropped tokens: never feeds the radix index
  // Holds K/V decoded from a lossy KV tier re-encoding (--kv-host-dtype), by
  // a load or a match of lossy radix nodes: every token computed on top of
  // it is inexact too. Still cached, but the radix nodes it offers are
  // marked lossy (PrefixMatch::lossy_tokens).
  bool reencoded = false;
  int32_t num_lossy_matched = 0;   // of the prefix match's tokens, from lossy nodes
  // Sliding window: leading blocks no future token attends to, parked on
  // the manager's placeholder block (their KV lives on in the radix index
  // when it holds them, else it went back to the pool).
  int32_t num_window_released = 0;
  // Sliding window: the prompt length MatchPrefix saw, a cached prefix
  // boundary whose last `window` tokens the prefix cache keeps (the blocks
  // before it go hollow in the index as the window leaves them).
  int32_t window_boundary = 0;
  // StreamingLLM past the trained context (sinks policy): every slot's key
  // was re-rotated to the slot's own index, and new tokens take their slot
  // as RoPE position (KvEvictor switches a sequence over once).
  bool cache_positions = false;
  // KV cache groups (KvCacheManagerOptions::group_windows): the tables of
  // groups 1.. with their own counters, which the manager keeps in step with
  // this one's (group 0: `table` and the fields above). Empty for a model
  // with one group.
  std::vector<SeqKv> groups;

  // The RoPE position a token written now at `slot` takes.
  int32_t rope_position(int32_t slot) const {
    return cache_positions ? slot : slot + position_shift;
  }
};

struct KvCacheManagerOptions {
  KvPoolOptions pool;
  bool prefix_cache = true;
  PrefixCacheOptions prefix;  // used when prefix_cache
  // > 0: every layer attends only to the last sliding_window slots (a
  // Mistral-style model), so a sequence keeps only the blocks its window
  // reaches: once committed tokens leave a block behind, the sequence's
  // reference goes. The radix index keeps such a block only when a cached
  // prefix boundary needs it (within the last sliding_window tokens of a
  // prompt's end or of a finished sequence's end), so a repeated prompt
  // still matches in full; otherwise its node goes hollow (tokens kept, K/V
  // dropped) and the block returns to the pool. 0: full attention.
  int32_t sliding_window = 0;
  // KV cache groups for hybrid attention (LlamaConfig::KvGroups), two or
  // more: per group its window (0: full attention). Group 0 must be a full
  // group; it is this manager's own table and radix index, and every other
  // group is a manager of its own (window groups release and hollow blocks
  // as sliding_window above) over the SAME pool, whose blocks hold
  // pool.n_layers = the layers of one group. Every operation is applied to
  // every group; a prefix match is the longest every group can serve.
  // Empty: one group (sliding_window says whether it is windowed).
  std::vector<int32_t> group_windows;
  // With group_windows: per model layer its group and its layer in the
  // group's page (for the forward's per-group views).
  std::vector<int32_t> layer_group;
  std::vector<int32_t> layer_index;
  // With group_windows and the prefix cache: the eviction policy of each
  // group > 0's index (null: LRU).
  std::function<std::unique_ptr<EvictionPolicy>()> group_policy;
  // With group_windows: group g's demotion sink at [g] (the KV tiers'
  // KvTiers::group_demotion; [0] is unused: group 0 takes prefix.demotion).
  // Empty: groups > 0 demote nothing.
  std::vector<BlockDemotionSink*> group_demotion;
  // Internal: a group manager draws from this pool instead of its own.
  KvPool* shared_pool = nullptr;
};

// Sliding-window accounting (engine thread; read through the manager).
struct KvWindowStats {
  int64_t blocks_released = 0;   // sequence references the window let go
  int64_t blocks_kept_cached = 0;  // of those, blocks the radix index still held
  // Of the released blocks the index held, those it let go too (hollow: no
  // cached prefix boundary needs their K/V), so they went back to the pool.
  int64_t blocks_hollowed = 0;
  // Prefix blocks that could not be offered to the radix index because an
  // earlier block of the same prefix had left both the window and the index
  // (evicted): that prefix cannot be matched past that point any more.
  int64_t prefix_blocks_lost = 0;
};

class KvCacheManager {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(
      KvCacheManagerOptions options);
  ~KvCacheManager();  // drops the index's blocks; every SeqKv must be gone

  // Starts an empty sequence (no blocks) from the longest cached prefix of
  // tokens[0, max_tokens): the matched blocks become its table, pinned, and
  // count as computed and committed. Returns the tokens matched (0 with the
  // prefix cache off).
  // REQUIRES: kv has no blocks.
  int32_t MatchPrefix(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens,
                      int32_t max_tokens);
  // Gives up the part of a fresh match that ends inside a block (a resident
  // block sharing only its first tokens): the table keeps the whole blocks
  // below num_computed. A loader that supplies whole blocks continues from
  // there. Not a second lookup, so the index's hit counts stay as they are.
  // REQUIRES: only MatchPrefix has touched kv (computed == committed ==
  // the table's tokens).
  void DropPartialMatch(SeqKv* kv);
  // What MatchPrefix would match, without pinning (LPM ordering).
  int32_t PeekPrefix(std::string_view salt, absl::Span<const int32_t> tokens,
                     int32_t max_tokens) const;

  // Blocks AllocateSlots(kv, n, k, e) would take from the pool.
  int32_t BlocksNeeded(const SeqKv& kv, int32_t num_new, int32_t num_lookahead = 0,
                       int32_t num_external = 0) const;
  // The most blocks the pool must supply at once while kv computes num_new
  // more tokens in chunks of at most max_chunk, each committed before the
  // next is allocated (how the scheduler prefills; admission and "will it
  // ever fit" count this). One group: exactly BlocksNeeded(kv, num_new). A
  // window group counts at most WindowGroupPeakBlocks(max_chunk): when a
  // chunk is allocated the group holds only the blocks of its last
  // window - 1 committed slots and of that chunk, since each commit's window
  // release let the earlier ones go (to the pool, or to the radix index,
  // where they are evictable).
  int32_t PeakBlocksNeeded(const SeqKv& kv, int32_t num_new, int32_t max_chunk) const;
  // The blocks one window group's table holds at most while a chunk of
  // max_chunk tokens is allocated on top of committed slots: its
  // window - 1 + max_chunk slots span at most (window + max_chunk - 3) /
  // block_size + 2 blocks. 0 for a model with no window group.
  int32_t WindowGroupPeakBlocks(int32_t max_chunk) const;
  // Makes the table cover num_computed + num_new + num_lookahead +
  // num_external slots (it never shrinks here). ResourceExhausted when the
  // pool lacks blocks; then nothing changes (call EnsureFree, or preempt).
  [[nodiscard]] absl::Status AllocateSlots(SeqKv* kv, int32_t num_new, int32_t num_lookahead = 0,
                                           int32_t num_external = 0);
  // K/V of m more slots were written. REQUIRES: num_computed + m <= slots.
  void MarkComputed(SeqKv* kv, int32_t m);
  // The first m uncommitted computed tokens are final; `tokens` holds the
  // sequence's tokens, slot i holding tokens[i] (a non-lossy sequence).
  // Offers the full blocks this completes to the radix index.
  // REQUIRES: num_committed + m <= num_computed; tokens covers them.
  void Commit(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens, int32_t m);
  // Rolls the sequence back to its first num_slots slots: computed and
  // reserved slots past them are dropped and whole blocks past them return
  // to the pool. REQUIRES: num_committed <= num_slots.
  void Truncate(SeqKv* kv, int32_t num_slots);
  // The sequence dropped tokens (or will): it never offers blocks again.
  void MarkLossy(SeqKv* kv) {
    kv->lossy = true;
    for (SeqKv& g : kv->groups) g.lossy = true;
  }
  // A load brought K/V a tier re-encoded lossily (SeqKv::reencoded).
  void MarkReencoded(SeqKv* kv) {
    kv->reencoded = true;
    for (SeqKv& g : kv->groups) g.reencoded = true;
  }
  // Finished or preempted: its committed full blocks and the partly filled
  // last one go to the radix index (unless lossy), then every reference is
  // released; kv is empty afterwards.
  void Free(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens);
  // Releases without caching anything (the KV may be wrong).
  void Discard(SeqKv* kv);
  // Sliding window: parks the leading blocks no future token of kv attends
  // to (all slots < num_committed - window + 1). Commit and MatchPrefix call
  // it; a no-op without a window.
  void ReleaseOutOfWindow(SeqKv* kv);
  int32_t sliding_window() const { return window_; }
  // Summed over the window groups for a hybrid model.
  const KvWindowStats& window_stats() const;

  // KV cache groups: 1 for a model with one attention kind (the classic
  // layout), else the groups of KvCacheManagerOptions::group_windows.
  int32_t num_groups() const { return 1 + static_cast<int32_t>(groups_.size()); }
  bool hybrid() const { return !groups_.empty(); }
  int32_t group_window(int32_t g) const { return g == 0 ? window_ : groups_[g - 1]->window_; }
  // Group g's table of kv (group 0: kv.table). REQUIRES: g < num_groups()
  // and kv touched by the manager (MatchPrefix or AllocateSlots).
  const BlockTable& group_table(const SeqKv& kv, int32_t g) const {
    return g == 0 ? kv.table : kv.groups[g - 1].table;
  }
  // Whether h is group g's placeholder block (a window group's table entry
  // for a block its window no longer reaches: no K/V there).
  bool IsGroupPlaceholder(int32_t g, const BlockHandle& h) const {
    const KvCacheManager& m = group_manager(g);
    return m.window_ > 0 && h == m.placeholder_;
  }
  // Group g's manager (0: this one), for its index and statistics.
  const KvCacheManager& group_manager(int32_t g) const { return g == 0 ? *this : *groups_[g - 1]; }
  // The same, to pin and mark blocks in its index (retention leases).
  KvCacheManager* mutable_group_manager(int32_t g) { return g == 0 ? this : groups_[g - 1].get(); }
  const std::vector<int32_t>& layer_group() const { return layer_group_; }
  const std::vector<int32_t>& layer_index() const { return layer_index_; }
  // Hybrid prefix matches the window groups cut shorter than the full
  // group's (tokens the window groups had dropped K/V for).
  int64_t group_window_dropped_tokens() const { return group_window_dropped_; }
  // A load of slots [from, end) into kv from the KV tiers, after
  // AllocateSlots(kv, 0, 0, end - from) and before the load starts: in each
  // window group the blocks wholly before the window of `end` (slots <
  // end - window + 1), which no later token reads, go back to the pool now
  // and their table entries become the placeholder (the load never writes
  // them; the group's radix index keeps their place as hollow nodes when
  // the sequence is offered, so the loaded blocks after them are cached).
  // Returns per group g >= 1 (at [g - 1]) the first slot the load must
  // write there. Truncate undoes it with the load.
  std::vector<int32_t> PrepareGroupLoad(SeqKv* kv, int32_t from, int32_t end);
  // A new SeqKv sharing every block of kv (the fork of an n > 1 request).
  SeqKv Fork(const SeqKv& kv) const;
  // The first slot from which every block is the sequence's own (reference
  // count 1): slots before it live in blocks shared with the radix index or
  // a fork and must never be moved or overwritten.
  int32_t FirstPrivateSlot(const SeqKv& kv) const;
  // Token eviction: the sequence keeps only the slots `keep` (ascending,
  // every computed slot committed); kept slot keep[i] moves to slot i, the
  // table shrinks to keep.size() slots (whole blocks past it are released),
  // position_shift grows by the slots dropped, and the sequence becomes
  // lossy. A shared block (the prefix cache's, a fork's) is never written: a
  // block that receives moved rows is first made the sequence's own copy,
  // and a shared block the sequence no longer needs only loses this
  // sequence's reference (the index keeps its exact, full-attention copy).
  // False when those copies find no free block; then nothing changed.
  [[nodiscard]] bool DropSlots(SeqKv* kv, absl::Span<const int32_t> keep);
  // Rotates the stored keys at slots[i] by deltas[i] RoPE positions
  // (kernels::RotateKvKeys), first making any shared block among them the
  // sequence's own copy. False when those copies find no free block (nothing
  // changed). REQUIRES: a host pool with a per-row codec.
  [[nodiscard]] bool RotateKeys(SeqKv* kv, absl::Span<const int32_t> slots,
                                absl::Span<const int32_t> deltas, const kernels::RopeParams& rope);

  // Evicts cached blocks nobody holds until `blocks` are free; false when
  // even that is not enough (the caller preempts or waits).
  bool EnsureFree(int32_t blocks);
  // Empties the radix index (blocks sequences hold stay with them). Returns
  // the blocks dropped; -1 when the prefix cache is off.
  int32_t ClearPrefixCache();

  // The plain-data view of the given sequences' tables for the kernels.
  kernels::PagedKvView View(const int32_t* block_ids, const int32_t* seq_block_offsets,
                            int32_t n_seqs) const {
    return pool_->View(block_ids, seq_block_offsets, n_seqs);
  }
  void CheckInvariants(const SeqKv& kv) const;

  int32_t block_size() const { return pool_->block_size(); }
  int32_t num_blocks() const { return pool_->num_blocks(); }
  int32_t num_free_blocks() const { return pool_->num_free_blocks(); }
  // Cached blocks no sequence holds: free to admission at the cost of an
  // eviction.
  int32_t num_evictable_blocks() const;
  bool prefix_cache_enabled() const { return prefix_cache_ != nullptr; }
  const KvPool& pool() const { return *pool_; }
  KvPool* mutable_pool() { return pool_; }
  // nullptr when the prefix cache is off.
  const PrefixCache* prefix_cache() const { return prefix_cache_.get(); }
  // Retention leases pin through it (scheduler/cache_control.h).
  PrefixCache* mutable_prefix_cache() { return prefix_cache_.get(); }

 private:
  KvCacheManager() = default;
  void Offer(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens);
  // Whether the radix index can take kv's blocks: its window-released
  // leading blocks must still be cached (the index keeps its own blocks for
  // them and never sees the placeholder).
  bool WindowPrefixCached(const SeqKv& kv, std::string_view salt,
                          absl::Span<const int32_t> tokens) const;
  // Whether block b of kv lies in the window of kv's prompt boundary.
  bool InBoundaryWindow(const SeqKv& kv, int32_t b) const;

  // The longest prefix of tokens[0, max_tokens) every group's index serves.
  int32_t GroupMatchLength(std::string_view salt, absl::Span<const int32_t> tokens,
                           int32_t max_tokens) const;
  // Creates kv's group tables (a sequence the manager sees first).
  void EnsureGroups(SeqKv* kv) const;

  std::unique_ptr<KvPool> owned_pool_;
  KvPool* pool_ = nullptr;  // owned_pool_, or a group manager's shared pool
  std::unique_ptr<PrefixCache> prefix_cache_;
  std::vector<std::unique_ptr<KvCacheManager>> groups_;  // groups 1..
  std::vector<int32_t> layer_group_, layer_index_;
  int64_t group_window_dropped_ = 0;
  mutable KvWindowStats group_window_stats_;
  int32_t window_ = 0;
  BlockHandle placeholder_{};  // held while window_ > 0; never written or read
  // A group manager's KV event sink: stamps its group on each event and
  // passes it on to the engine's (outlives prefix_cache_, which the
  // destructor resets first).
  class GroupEventSink final : public KvEventSink {
   public:
    GroupEventSink(KvEventSink* inner, int32_t group) : inner_(inner), group_(group) {}
    void Publish(std::vector<KvCacheEvent> events) override {
      for (KvCacheEvent& e : events) e.group = group_;
      inner_->Publish(std::move(events));
    }

   private:
    KvEventSink* inner_;
    int32_t group_;
  };
  std::unique_ptr<GroupEventSink> group_events_;
  KvWindowStats window_stats_;
};

}  // namespace kvserve
