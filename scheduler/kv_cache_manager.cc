#include "scheduler/kv_cache_manager.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/kv_codec.h"

namespace kvserve {

namespace {

// A broken KV invariant means the kernels could read or write the wrong
// slots: stop rather than serve wrong output.
[[noreturn]] void Die(const char* what, int32_t a, int32_t b) {
  std::fprintf(stderr, "KvCacheManager: %s (%d, %d)\n", what, a, b);
  std::abort();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(
    KvCacheManagerOptions options) {
  std::unique_ptr<KvCacheManager> m(new KvCacheManager());
  if (options.sliding_window < 0) return absl::InvalidArgumentError("sliding_window < 0");
  const std::vector<int32_t> group_windows = options.group_windows;
  if (group_windows.size() == 1) {
    options.sliding_window = group_windows[0];
  } else if (group_windows.size() > 1) {
    if (group_windows[0] != 0 || options.sliding_window != 0) {
      return absl::InvalidArgumentError("KV cache groups: group 0 must be a full-attention group");
    }
    for (int32_t w : group_windows) {
      if (w < 0) return absl::InvalidArgumentError("KV cache groups: a window < 0");
    }
    if (options.layer_group.size() != options.layer_index.size()) {
      return absl::InvalidArgumentError("KV cache groups: layer maps differ in length");
    }
    for (size_t l = 0; l < options.layer_group.size(); ++l) {
      if (options.layer_group[l] < 0 ||
          options.layer_group[l] >= static_cast<int32_t>(group_windows.size()) ||
          options.layer_index[l] < 0 || options.layer_index[l] >= options.pool.n_layers) {
        return absl::InvalidArgumentError("KV cache groups: a layer outside the groups");
      }
    }
    m->layer_group_ = options.layer_group;
    m->layer_index_ = options.layer_index;
  }
  if (options.shared_pool != nullptr) {
    m->pool_ = options.shared_pool;
  } else {
    ASSIGN_OR_RETURN(m->owned_pool_, KvPool::Create(options.pool));
    m->pool_ = m->owned_pool_.get();
  }
  // Group managers (before group 0's index takes options.prefix).
  for (size_t g = 1; g < group_windows.size(); ++g) {
    KvCacheManagerOptions go;
    go.pool = options.pool;
    go.shared_pool = m->pool_;
    go.prefix_cache = options.prefix_cache;
    go.sliding_window = group_windows[g];
    go.prefix.model_identity = options.prefix.model_identity;
    go.prefix.clock = options.prefix.clock;
    go.prefix.on_evict = options.prefix.on_evict;
    go.prefix.public_salt = options.prefix.public_salt;
    if (options.group_policy) go.prefix.policy = options.group_policy();
    // Tier demotion: each group its own sink (its pages keyed by group).
    // KV events: each group publishes its own index, every event tagged
    // with the group (KvCacheEvent::group), into the same sink.
    if (g < options.group_demotion.size()) go.prefix.demotion = options.group_demotion[g];
    std::unique_ptr<GroupEventSink> tagged;
    if (options.prefix.events != nullptr) {
      tagged = std::make_unique<GroupEventSink>(options.prefix.events, static_cast<int32_t>(g));
      go.prefix.events = tagged.get();
      go.prefix.publish_hollow = true;  // a window's hollowing frees the block
    }
    ASSIGN_OR_RETURN(std::unique_ptr<KvCacheManager> gm, Create(std::move(go)));
    gm->group_events_ = std::move(tagged);
    m->groups_.push_back(std::move(gm));
  }
  if (options.prefix_cache) {
    m->prefix_cache_ = std::make_unique<PrefixCache>(m->pool_, std::move(options.prefix));
  }
  if (options.sliding_window > 0) {
    std::vector<BlockHandle> one;
    RETURN_IF_ERROR(m->pool_->Allocate(1, &one));
    m->placeholder_ = one[0];
    m->window_ = options.sliding_window;
    if (m->prefix_cache_ != nullptr) m->prefix_cache_->SetWindow(m->window_, m->placeholder_);
  }
  return m;
}

KvCacheManager::~KvCacheManager() {
  // The index holds pool references: it goes before the pool, and so do the
  // group managers drawing from it.
  groups_.clear();
  prefix_cache_.reset();
  if (window_ > 0) pool_->Release(placeholder_);
}

void KvCacheManager::ReleaseOutOfWindow(SeqKv* kv) {
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->ReleaseOutOfWindow(&kv->groups[g]);
  }
  if (window_ <= 0) return;
  // The earliest slot a future token (at a slot >= num_committed: computed
  // but uncommitted slots may still be rolled back) attends to.
  const int32_t first_needed = std::max(0, kv->num_committed - window_ + 1);
  const int32_t upto = std::min(first_needed / block_size(), kv->table.num_blocks());
  for (int32_t b = kv->num_window_released; b < upto; ++b) {
    const BlockHandle h = kv->table.blocks()[b];
    if (h == placeholder_) continue;  // a hollow block a prefix match handed over
    if (pool_->ref_count(h) > 1 && prefix_cache_ != nullptr && !InBoundaryWindow(*kv, b) &&
        prefix_cache_->HollowBlock(h)) {
      ++window_stats_.blocks_hollowed;
    }
    if (pool_->ref_count(h) > 1) ++window_stats_.blocks_kept_cached;
    kv->table.ReplaceBlock(b, placeholder_);
    ++window_stats_.blocks_released;
  }
  kv->num_window_released = std::max(kv->num_window_released, upto);
}

bool KvCacheManager::WindowPrefixCached(const SeqKv& kv, std::string_view salt,
                                        absl::Span<const int32_t> tokens) const {
  if (kv.num_window_released == 0) return true;
  const int32_t need = kv.num_window_released * block_size();
  // Hollow nodes count: they keep the path to what follows.
  return prefix_cache_->PathLength(salt, tokens, need) >= need;
}

bool KvCacheManager::InBoundaryWindow(const SeqKv& kv, int32_t b) const {
  // A later prompt that repeats this one matches up to window_boundary - 1
  // or window_boundary tokens; either end needs the blocks of its last
  // window - 1 slots.
  const int32_t p = kv.window_boundary;
  if (p <= 0) return false;
  return b >= std::max(0, p - window_) / block_size() && b <= (p - 1) / block_size();
}

int32_t KvCacheManager::MatchPrefix(SeqKv* kv, std::string_view salt,
                                    absl::Span<const int32_t> tokens, int32_t max_tokens) {
  if (kv->table.num_blocks() > 0) Die("MatchPrefix on a sequence with blocks", kv->table.num_blocks(), 0);
  kv->window_boundary = static_cast<int32_t>(tokens.size());
  if (hybrid()) {
    EnsureGroups(kv);
    if (prefix_cache_ == nullptr) {
      for (size_t g = 0; g < groups_.size(); ++g) {
        groups_[g]->MatchPrefix(&kv->groups[g], salt, tokens, max_tokens);
      }
      return 0;
    }
    // The longest prefix every group serves: the full group's blocks for
    // all of it, each window group's for its last window of tokens.
    const int32_t full = prefix_cache_->MatchLength(salt, tokens, max_tokens);
    max_tokens = GroupMatchLength(salt, tokens, max_tokens);
    group_window_dropped_ += full - max_tokens;
    if (max_tokens == 0) {
      for (size_t g = 0; g < groups_.size(); ++g) {
        groups_[g]->MatchPrefix(&kv->groups[g], salt, tokens, 0);
      }
      return 0;
    }
    bool same = true;
    for (size_t g = 0; g < groups_.size(); ++g) {
      same &= groups_[g]->MatchPrefix(&kv->groups[g], salt, tokens, max_tokens) == max_tokens;
    }
    if (!same) {  // cannot happen (the lengths were just checked): match nothing
      for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->Discard(&kv->groups[g]);
      for (size_t g = 0; g < groups_.size(); ++g) {
        groups_[g]->MatchPrefix(&kv->groups[g], salt, tokens, 0);
      }
      return 0;
    }
  }
  if (prefix_cache_ == nullptr) return 0;
  PrefixMatch m = prefix_cache_->Match(salt, tokens, max_tokens);
  if (hybrid() && m.num_tokens != max_tokens) {
    Die("KV groups: the full group's match differs from the window groups'", m.num_tokens,
        max_tokens);
  }
  if (m.num_tokens == 0) return 0;  // no blocks either
  kv->table.Adopt(std::move(m.blocks), m.num_tokens);
  kv->num_computed = m.num_tokens;
  kv->num_committed = m.num_tokens;
  kv->num_offered_blocks = m.num_tokens / block_size();
  kv->num_lossy_matched = m.lossy_tokens;
  if (m.lossy_tokens > 0) kv->reencoded = true;
  ReleaseOutOfWindow(kv);
  return m.num_tokens;
}

int32_t KvCacheManager::GroupMatchLength(std::string_view salt, absl::Span<const int32_t> tokens,
                                         int32_t max_tokens) const {
  if (prefix_cache_ == nullptr) return 0;
  // Shortening a match can only shorten what a window group serves (its
  // window must end where the match ends), so iterate to the fixed point.
  int32_t len = std::min<int32_t>(max_tokens, static_cast<int32_t>(tokens.size()));
  for (;;) {
    int32_t next = prefix_cache_->MatchLength(salt, tokens, len);
    for (const auto& g : groups_) next = std::min(next, g->PeekPrefix(salt, tokens, next));
    if (next == len || next <= 0) return std::max(next, 0);
    len = next;
  }
}

std::vector<int32_t> KvCacheManager::PrepareGroupLoad(SeqKv* kv, int32_t from, int32_t end) {
  std::vector<int32_t> first(groups_.size(), from);
  const int32_t bs = block_size();
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    KvCacheManager& gm = *groups_[g];
    if (gm.window_ <= 0) continue;
    SeqKv& k = kv->groups[g];
    const int32_t upto =
        std::min(std::max(0, end - gm.window_ + 1) / bs, k.table.num_blocks());
    for (int32_t b = from / bs; b < upto; ++b) {
      if (!(k.table.blocks()[b] == gm.placeholder_)) k.table.ReplaceBlock(b, gm.placeholder_);
    }
    first[g] = std::max(from, upto * bs);
  }
  return first;
}

void KvCacheManager::EnsureGroups(SeqKv* kv) const {
  while (kv->groups.size() < groups_.size()) {
    kv->groups.emplace_back(pool_);
    kv->groups.back().lossy = kv->lossy;
    kv->groups.back().reencoded = kv->reencoded;
  }
}

const KvWindowStats& KvCacheManager::window_stats() const {
  if (groups_.empty()) return window_stats_;
  group_window_stats_ = window_stats_;
  for (const auto& g : groups_) {
    const KvWindowStats& w = g->window_stats();
    group_window_stats_.blocks_released += w.blocks_released;
    group_window_stats_.blocks_kept_cached += w.blocks_kept_cached;
    group_window_stats_.blocks_hollowed += w.blocks_hollowed;
    group_window_stats_.prefix_blocks_lost += w.prefix_blocks_lost;
  }
  return group_window_stats_;
}

void KvCacheManager::DropPartialMatch(SeqKv* kv) {
  if (kv->num_computed != kv->num_committed || kv->num_computed != kv->table.num_tokens()) {
    Die("DropPartialMatch on a sequence past its match", kv->num_computed, kv->table.num_tokens());
  }
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->DropPartialMatch(&kv->groups[g]);
  }
  const int32_t aligned = kv->num_computed - kv->num_computed % block_size();
  if (aligned == kv->num_computed) return;
  kv->table.Truncate(aligned);
  kv->num_computed = aligned;
  kv->num_committed = aligned;
  kv->num_offered_blocks = std::min(kv->num_offered_blocks, aligned / block_size());
  // Lossy tokens are counted per matched block; the dropped one may have
  // been lossy or not, so the count stays an upper bound.
  kv->num_lossy_matched = std::min(kv->num_lossy_matched, aligned);
}

int32_t KvCacheManager::PeekPrefix(std::string_view salt, absl::Span<const int32_t> tokens,
                                   int32_t max_tokens) const {
  if (hybrid()) return GroupMatchLength(salt, tokens, max_tokens);
  return prefix_cache_ ? prefix_cache_->MatchLength(salt, tokens, max_tokens) : 0;
}

int32_t KvCacheManager::BlocksNeeded(const SeqKv& kv, int32_t num_new, int32_t num_lookahead,
                                     int32_t num_external) const {
  const int32_t want = kv.num_computed + num_new + num_lookahead + num_external;
  int32_t n = kv.table.BlocksNeeded(std::max(0, want - kv.table.num_tokens()));
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (g < kv.groups.size()) {
      n += groups_[g]->BlocksNeeded(kv.groups[g], num_new, num_lookahead, num_external);
    } else {  // a sequence not seen yet: its tables start empty
      n += kv.table.BlocksNeeded(std::max(0, want));
    }
  }
  return n;
}

int32_t KvCacheManager::WindowGroupPeakBlocks(int32_t max_chunk) const {
  int32_t w = 0;
  for (const auto& g : groups_) w = std::max(w, g->window_);
  if (w <= 0) return 0;
  // Slots [p - w + 1, p + c) are live while the chunk [p, p + c) is
  // allocated: w - 1 + c slots, which touch at most (w + c - 3) / bs + 2
  // blocks (a run of n slots spans at most (n - 2) / bs + 2 blocks).
  const int32_t span = w - 1 + std::max(1, max_chunk);
  return (span - 2 + block_size()) / block_size() + 1;
}

int32_t KvCacheManager::PeakBlocksNeeded(const SeqKv& kv, int32_t num_new,
                                         int32_t max_chunk) const {
  if (!hybrid()) return BlocksNeeded(kv, num_new);
  const int32_t want = kv.num_computed + num_new;
  int32_t n = kv.table.BlocksNeeded(std::max(0, want - kv.table.num_tokens()));  // group 0: full
  const int32_t span = std::max(1, max_chunk);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int32_t all = g < kv.groups.size()
                            ? groups_[g]->BlocksNeeded(kv.groups[g], num_new)
                            : kv.table.BlocksNeeded(std::max(0, want));
    if (groups_[g]->window_ <= 0) {
      n += all;
    } else {
      const int32_t slots = groups_[g]->window_ - 1 + span;
      n += std::min(all, (slots - 2 + block_size()) / block_size() + 1);
    }
  }
  return n;
}

absl::Status KvCacheManager::AllocateSlots(SeqKv* kv, int32_t num_new, int32_t num_lookahead,
                                           int32_t num_external) {
  if (num_new < 0 || num_lookahead < 0 || num_external < 0) {
    return absl::InvalidArgumentError("negative slot count");
  }
  const int32_t want = kv->num_computed + num_new + num_lookahead + num_external;
  if (hybrid()) {
    // All groups or none: the pool is one, so the sum decides.
    EnsureGroups(kv);
    const int32_t need = BlocksNeeded(*kv, num_new, num_lookahead, num_external);
    if (need > pool_->num_free_blocks()) {
      return absl::ResourceExhaustedError(absl::StrCat("KV pool: ", need, " blocks needed over ",
                                                       num_groups(), " groups, ",
                                                       pool_->num_free_blocks(), " free"));
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      absl::Status st =
          groups_[g]->AllocateSlots(&kv->groups[g], num_new, num_lookahead, num_external);
      if (!st.ok()) Die("KV groups: allocation failed after the pool had room", need, 0);
    }
  }
  return kv->table.Reserve(std::max(0, want - kv->table.num_tokens()));
}

void KvCacheManager::MarkComputed(SeqKv* kv, int32_t m) {
  if (m < 0 || kv->num_computed + m > kv->table.num_tokens()) {
    Die("MarkComputed past the reserved slots", kv->num_computed + m, kv->table.num_tokens());
  }
  kv->num_computed += m;
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->MarkComputed(&kv->groups[g], m);
  }
}

void KvCacheManager::Commit(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens,
                            int32_t m) {
  if (m < 0 || kv->num_committed + m > kv->num_computed) {
    Die("Commit past the computed slots", kv->num_committed + m, kv->num_computed);
  }
  kv->num_committed += m;
  Offer(kv, salt, tokens);
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->Commit(&kv->groups[g], salt, tokens, m);  // offers and releases its window
  }
  ReleaseOutOfWindow(kv);
}

void KvCacheManager::Offer(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens) {
  if (prefix_cache_ == nullptr || kv->lossy) return;
  const int32_t bs = block_size();
  const int32_t full = kv->num_committed / bs;
  if (full <= kv->num_offered_blocks) return;
  if (static_cast<int64_t>(tokens.size()) < static_cast<int64_t>(full) * bs) {
    Die("Commit without the committed tokens", static_cast<int32_t>(tokens.size()), full * bs);
  }
  if (!WindowPrefixCached(*kv, salt, tokens)) {
    // The window let go of an earlier block and the index evicted it: the
    // path to these blocks is gone, so they cannot be cached (or matched).
    window_stats_.prefix_blocks_lost += full - kv->num_offered_blocks;
    kv->num_offered_blocks = full;
    return;
  }
  // Blocks become shareable as soon as they are full and final, so a request
  // with the same prefix arriving now reuses them while this one still runs.
  prefix_cache_->Insert(salt, tokens.first(static_cast<size_t>(full) * bs),
                        absl::MakeConstSpan(kv->table.blocks()).first(full), kv->reencoded);
  if (window_ > 0 && kv->window_boundary > 0) {
    // The prompt's end is a cached prefix boundary: its window's blocks
    // stay cached when this sequence's window leaves them.
    const int32_t lo = std::max(0, kv->window_boundary - window_) / bs;
    const int32_t hi = (kv->window_boundary - 1) / bs;
    if (full > lo && kv->num_offered_blocks <= hi) {
      prefix_cache_->KeepWindow(salt, tokens.first(static_cast<size_t>(std::min(full, hi + 1)) * bs),
                                lo);
    }
  }
  kv->num_offered_blocks = full;
}

void KvCacheManager::Truncate(SeqKv* kv, int32_t num_slots) {
  if (num_slots < kv->num_committed) Die("Truncate below the committed tokens", num_slots, kv->num_committed);
  kv->num_computed = std::min(kv->num_computed, num_slots);
  if (num_slots < kv->table.num_tokens()) kv->table.Truncate(num_slots);
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->Truncate(&kv->groups[g], num_slots);
  }
}

void KvCacheManager::Free(SeqKv* kv, std::string_view salt, absl::Span<const int32_t> tokens) {
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->Free(&kv->groups[g], salt, tokens);
  }
  if (prefix_cache_ != nullptr && !kv->lossy && kv->num_committed > 0 &&
      WindowPrefixCached(*kv, salt, tokens)) {
    // The sequence writes no more: its partly filled last block can be
    // shared too (copied by whoever writes into it next).
    prefix_cache_->InsertFinished(salt, tokens.first(static_cast<size_t>(kv->num_committed)),
                                  kv->table.blocks(), kv->reencoded);
    if (window_ > 0) {
      // Its end is a cached prefix boundary too (the next turn of a chat
      // starts from it): the last window's blocks stay.
      prefix_cache_->KeepWindow(salt, tokens.first(static_cast<size_t>(kv->num_committed)),
                                std::max(0, kv->num_committed - window_) / block_size());
    }
  }
  Discard(kv);
}

void KvCacheManager::Discard(SeqKv* kv) {
  for (size_t g = 0; g < groups_.size() && g < kv->groups.size(); ++g) {
    groups_[g]->Discard(&kv->groups[g]);
  }
  kv->table.Release();  // blocks the index also holds stay cached
  kv->num_computed = 0;
  kv->num_committed = 0;
  kv->num_offered_blocks = 0;
  kv->position_shift = 0;
  kv->num_window_released = 0;
  kv->window_boundary = 0;
  kv->cache_positions = false;
  kv->lossy = false;
  kv->reencoded = false;
  kv->num_lossy_matched = 0;
}

SeqKv KvCacheManager::Fork(const SeqKv& kv) const {
  SeqKv f(pool_);
  f.table = kv.table.Fork();
  f.num_computed = kv.num_computed;
  f.num_committed = kv.num_committed;
  f.num_offered_blocks = kv.num_offered_blocks;
  f.position_shift = kv.position_shift;
  f.num_window_released = kv.num_window_released;
  f.window_boundary = kv.window_boundary;
  f.cache_positions = kv.cache_positions;
  f.lossy = kv.lossy;
  f.reencoded = kv.reencoded;
  f.num_lossy_matched = kv.num_lossy_matched;
  for (size_t g = 0; g < groups_.size() && g < kv.groups.size(); ++g) {
    f.groups.push_back(groups_[g]->Fork(kv.groups[g]));
  }
  return f;
}

int32_t KvCacheManager::FirstPrivateSlot(const SeqKv& kv) const {
  const std::vector<BlockHandle>& blocks = kv.table.blocks();
  size_t i = blocks.size();
  while (i > 0 && pool_->ref_count(blocks[i - 1]) == 1) --i;
  int32_t slot = std::min(static_cast<int32_t>(i) * block_size(), kv.table.num_tokens());
  for (size_t g = 0; g < groups_.size() && g < kv.groups.size(); ++g) {
    slot = std::max(slot, groups_[g]->FirstPrivateSlot(kv.groups[g]));
  }
  return slot;
}

bool KvCacheManager::DropSlots(SeqKv* kv, absl::Span<const int32_t> keep) {
  if (hybrid()) Die("DropSlots (token eviction) with KV cache groups", num_groups(), 0);
  if (kv->num_committed != kv->num_computed) {
    Die("DropSlots with uncommitted slots", kv->num_committed, kv->num_computed);
  }
  const int32_t n = static_cast<int32_t>(keep.size());
  const int32_t bs = block_size();
  std::vector<int32_t> from, to;
  std::vector<int32_t> written;  // destination blocks, ascending
  for (int32_t i = 0; i < n; ++i) {
    if (keep[i] < i || keep[i] >= kv->num_computed || (i > 0 && keep[i] <= keep[i - 1])) {
      Die("DropSlots: kept slots must ascend within the computed ones", i, keep[i]);
    }
    if (keep[i] == i) continue;
    from.push_back(keep[i]);
    to.push_back(i);
    if (written.empty() || written.back() != i / bs) written.push_back(i / bs);
  }
  // Copy-on-write for every shared block that receives rows, all or nothing.
  int32_t copies = 0;
  for (int32_t b : written) copies += pool_->ref_count(kv->table.blocks()[b]) > 1 ? 1 : 0;
  if (!EnsureFree(copies)) return false;
  for (int32_t b : written) {
    if (!kv->table.MakePrivate(b).ok()) Die("DropSlots: copy-on-write failed at block", b, copies);
  }
  if (!from.empty()) {
    std::vector<int32_t> ids;
    kv->table.AppendIds(&ids);
    pool_->MoveRows(ids, from, to);
  }
  const int32_t dropped = kv->num_computed - n;
  kv->table.Truncate(n);
  kv->num_computed = n;
  kv->num_committed = n;
  kv->num_offered_blocks = std::min(kv->num_offered_blocks, n / bs);
  kv->position_shift += dropped;
  kv->lossy = true;
  return true;
}

bool KvCacheManager::RotateKeys(SeqKv* kv, absl::Span<const int32_t> slots,
                                absl::Span<const int32_t> deltas,
                                const kernels::RopeParams& rope) {
  if (slots.size() != deltas.size()) Die("RotateKeys: slots and deltas differ", 0, 0);
  if (hybrid()) Die("RotateKeys (token eviction) with KV cache groups", num_groups(), 0);
  if (pool_->on_device()) Die("RotateKeys on device memory", 0, 0);
  const int32_t bs = block_size();
  std::vector<int32_t> written;  // blocks receiving rotated keys, ascending
  for (size_t i = 0; i < slots.size(); ++i) {
    if (deltas[i] == 0) continue;
    if (slots[i] < 0 || slots[i] >= kv->num_computed) Die("RotateKeys: slot", slots[i], 0);
    if (written.empty() || written.back() != slots[i] / bs) written.push_back(slots[i] / bs);
  }
  if (written.empty()) return true;
  int32_t copies = 0;
  for (int32_t b : written) copies += pool_->ref_count(kv->table.blocks()[b]) > 1 ? 1 : 0;
  if (!EnsureFree(copies)) return false;
  for (int32_t b : written) {
    if (!kv->table.MakePrivate(b).ok()) Die("RotateKeys: copy-on-write failed at block", b, copies);
  }
  std::vector<int32_t> ids;
  kv->table.AppendIds(&ids);
  const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
  kernels::RotateKvKeys(pool_->View(ids.data(), offsets, 1), pool_->options().n_layers, 0,
                        slots.data(), deltas.data(), static_cast<int32_t>(slots.size()), rope);
  return true;
}

bool KvCacheManager::EnsureFree(int32_t blocks) {
  const int32_t short_by = blocks - pool_->num_free_blocks();
  if (short_by <= 0) return true;
  if (prefix_cache_ == nullptr) return false;
  if (hybrid()) {
    // A cached prefix needs every group: evict a share from each index (the
    // same LRU order in each, as the groups cache the same prefixes), until
    // enough are free or nothing more goes.
    for (;;) {
      const int32_t missing = blocks - pool_->num_free_blocks();
      if (missing <= 0) return true;
      const int32_t share = (missing + num_groups() - 1) / num_groups();
      int32_t freed = prefix_cache_->Evict(share);
      for (const auto& g : groups_) freed += g->prefix_cache_->Evict(share);
      if (freed == 0) return false;
    }
  }
  prefix_cache_->Evict(short_by);
  return pool_->num_free_blocks() >= blocks;
}

int32_t KvCacheManager::ClearPrefixCache() {
  if (prefix_cache_ == nullptr) return -1;
  int32_t n = prefix_cache_->Clear();
  for (const auto& g : groups_) n += g->prefix_cache_->Clear();
  return n;
}

int32_t KvCacheManager::num_evictable_blocks() const {
  int32_t n = prefix_cache_ ? prefix_cache_->num_evictable_blocks() : 0;
  for (const auto& g : groups_) n += g->num_evictable_blocks();
  return n;
}

void KvCacheManager::CheckInvariants(const SeqKv& kv) const {
  if (kv.num_committed < 0 || kv.num_committed > kv.num_computed) {
    Die("committed outside [0, computed]", kv.num_committed, kv.num_computed);
  }
  if (kv.num_computed > kv.table.num_tokens()) {
    Die("computed past the reserved slots", kv.num_computed, kv.table.num_tokens());
  }
  if (kv.position_shift < 0) Die("negative position shift", kv.position_shift, 0);
  const int32_t bs = block_size();
  if (kv.table.num_blocks() != (kv.table.num_tokens() + bs - 1) / bs) {
    Die("block count does not cover the slots", kv.table.num_blocks(), kv.table.num_tokens());
  }
  for (size_t g = 0; g < kv.groups.size(); ++g) {
    const SeqKv& k = kv.groups[g];
    if (g >= groups_.size() || k.num_computed != kv.num_computed ||
        k.num_committed != kv.num_committed || k.table.num_tokens() != kv.table.num_tokens()) {
      Die("a KV group out of step with group 0", static_cast<int32_t>(g) + 1, k.num_computed);
    }
    groups_[g]->CheckInvariants(k);
  }
}

}  // namespace kvserve
