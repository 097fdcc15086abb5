// KvLoader: the seam through which KV computed elsewhere (a host or disk
// tier, a prefill node over UCX) reaches a sequence instead of being
// recomputed. At admission, after the radix match, the scheduler asks the
// loader how many of the following tokens it can supply; if any, it
// allocates their slots, starts the load into the sequence's blocks and
// parks the sequence in SeqState::kKvArriving. The batch builder skips
// parked sequences; each step polls their loads, and a finished load's
// tokens count as computed and committed (a failed one is rolled back and
// the tokens are recomputed). The engine has no loader unless one is given
// (EngineOptions::kv_loader); later features plug theirs in here.
//
// Thread-safety: Lookup and Start run on the engine thread. KvLoad::Done and
// status are polled on the engine thread but may be completed by another
// (a copy thread): implementations synchronize internally.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kv_view.h"

namespace kvserve {

// Where a load writes: slots [first_slot, first_slot + num_tokens) of one
// sequence, whose blocks (in slot order) are view.block_ids[0, n) with
// view.n_seqs == 1. The load holds tokens[first_slot, first_slot +
// num_tokens) of the sequence's prompt.
struct KvLoadTarget {
  std::string_view salt;
  absl::Span<const int32_t> tokens;  // the whole sequence, valid during Start only
  int32_t first_slot = 0;
  int32_t num_tokens = 0;
  kernels::PagedKvView view;  // valid until the load is Done (blocks stay pinned)
  // KV cache groups (a hybrid-attention model): groups 1.. of the same
  // sequence, each its own table's blocks (view as above, over the same
  // slots) and the first slot that group needs written: a window group's
  // blocks wholly before the window of the load's end are the manager's
  // placeholder (KvCacheManager::PrepareGroupLoad) and must never be
  // written. Empty for a model with one group; a loader that does not know
  // groups refuses a target that has them (Start returns null).
  struct Group {
    kernels::PagedKvView view;
    int32_t first_slot = 0;
  };
  std::vector<Group> groups;
};

// A finished load's tokens by the tier they came from (zeros for a loader
// that is not a tier, e.g. a prefill node).
struct KvLoadSources {
  int32_t host_tokens = 0;
  int32_t disk_tokens = 0;
  // Of the tokens, K/V a tier re-encoded lossily (--kv-host-dtype): decoded
  // back, not the bytes that were computed.
  int32_t lossy_tokens = 0;
};

class KvLoad {
 public:
  virtual ~KvLoad() = default;
  // True once the load has finished, successfully or not.
  virtual bool Done() = 0;
  // After Done: OK when every slot was written.
  virtual absl::Status status() = 0;
  // After a successful Done: where the tokens came from.
  virtual KvLoadSources sources() { return {}; }
};

class KvLoader {
 public:
  virtual ~KvLoader() = default;
  // How many tokens of tokens[from, limit) — from the first — this loader can
  // supply for this salt (0: none).
  virtual int32_t Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                         int32_t limit) = 0;
  // Of what Lookup would supply, the tokens worth loading when recomputing
  // costs recompute_seconds_per_token each (0: not measured yet; everything
  // is worth loading). A loader that knows its own load cost stops where
  // loading a block would take longer than computing it; the scheduler
  // recomputes the rest. Default: Lookup.
  virtual int32_t LookupWorthLoading(std::string_view salt, absl::Span<const int32_t> tokens,
                                     int32_t from, int32_t limit,
                                     double recompute_seconds_per_token) {
    (void)recompute_seconds_per_token;
    return Lookup(salt, tokens, from, limit);
  }
  // True when the scheduler may give up a radix match that ends inside a
  // block (a shared, partly matched block) and re-match whole blocks only,
  // so this loader supplies from the block boundary below (its loads write
  // whole blocks, never a shared one). A decode node's loader and the KV
  // tiers want this.
  virtual bool RematchWholeBlocks() const { return false; }
  // Starts writing the target's slots. The returned load is polled until
  // Done; the blocks stay pinned until then even if the request is cancelled.
  virtual std::shared_ptr<KvLoad> Start(const KvLoadTarget& target) = 0;
  // The caller will not load tokens[from, limit) from this loader (another
  // supplied them): what it holds only for them can go now rather than
  // when it lapses (a decode node releases such a prefill lease). Engine
  // thread; must not block. Default: nothing.
  virtual void Forgo(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                     int32_t limit) {
    (void)salt, (void)tokens, (void)from, (void)limit;
  }
};

// Two loaders in order: `first` (the KV tiers: local memory and disk)
// supplies what it can from the front of a match and `second` (a decode
// node's pulls from a prefill node) the rest, in one load; either alone
// when the other has nothing. A load whose second half could not be started
// fails once its first half has finished (the scheduler then recomputes),
// since a started load cannot be withdrawn. Both must outlive the chain.
// Engine thread, like the loaders.
class ChainedKvLoader final : public KvLoader {
 public:
  ChainedKvLoader(KvLoader* first, KvLoader* second) : first_(first), second_(second) {}

  int32_t Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                 int32_t limit) override;
  int32_t LookupWorthLoading(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                             int32_t limit, double recompute_seconds_per_token) override;
  bool RematchWholeBlocks() const override {
    return first_->RematchWholeBlocks() || second_->RematchWholeBlocks();
  }
  std::shared_ptr<KvLoad> Start(const KvLoadTarget& target) override;

 private:
  int32_t Split(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                int32_t limit, double recompute_seconds_per_token);
  KvLoader* first_;
  KvLoader* second_;
  // The first loader's share of the last lookup (Start splits the same way).
  int32_t last_from_ = -1, last_first_ = 0;
};

}  // namespace kvserve
