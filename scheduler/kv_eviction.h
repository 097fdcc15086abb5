// Token eviction: which cached tokens a sequence keeps under its request's
// KvPolicy (scheduler/request.h), and the compaction that drops the rest.
// After every step the output processor hands each sequence with a policy to
// MaybeCompact: when at least a block's worth of slots could go, the kept
// slots (sinks, heavy hitters, the recent window) move to the front of the
// sequence's blocks through KvCacheManager::DropSlots, the emptied blocks are
// released, and the sequence becomes lossy (never cached again). Blocks
// shared with the prefix cache or a fork are immutable: DropSlots copies a
// shared block before moving rows into it and otherwise only drops the
// sequence's reference, so a sibling sharing the prefix sees no change.
// Compacting a block at a time bounds the copying: a sequence holds between
// capacity() and capacity() + block_size - 1 slots once it has filled them.
//
// Heavy hitters (h2o): the runner asks the forward for each sequence's
// attention mass per slot (ForwardBatch::attention_mass); AddAttention adds it
// to the sequence's scores, with the number of query tokens that could attend
// each slot, so the score is the mean attention a slot received since it was
// written (age-normalised: a young token is not evicted for being young).
//
// Positions (sinks and window): kept tokens keep their original RoPE positions
// while the sequence stays within the trained context. At the first
// compaction after which the next tokens could reach it (the kept slots +
// the shift + a step's worth of tokens >= the context length), the sequence
// switches to positions within the cache, as StreamingLLM does: every kept
// key is re-rotated to its slot (a delta rotation) and new tokens take their
// slot as position; from then on each compaction rotates the rows it moves
// by the distance they moved. A window is the same without sinks (the
// StreamingLLM paper's failing baseline once the first tokens are gone).
// H2O keeps original positions always (its kept tokens are not one run)
// and so stays within the context. Re-rotation needs a host pool
// (KvEvictorOptions::can_rotate).
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/kv_cache_manager.h"
#include "scheduler/request.h"
#include "scheduler/sequence.h"

namespace kvserve {

// The slots a sequence of n_slots keeps under `policy` when slots before
// `protect_end` (shared blocks) must stay; ascending. `score` (h2o, n_slots
// values; may be null otherwise) ranks the heavy-hitter candidates, higher
// kept first, earlier slot on ties.
std::vector<int32_t> ChooseKeptSlots(const KvPolicy& policy, int32_t n_slots, int32_t protect_end,
                                     const float* score);

struct KvEvictorOptions {
  kernels::RopeParams rope{};
  int32_t context_length = 0;  // 0: never switch to positions within the cache
  // The most tokens a sequence may gain between two compactions (a step's
  // tokens plus a block): the switch happens this far ahead of the context.
  int32_t switch_margin = 0;
  bool can_rotate = false;     // a host pool with a per-row codec
};

class KvEvictor {
 public:
  explicit KvEvictor(KvCacheManager* kv, KvEvictorOptions options = {})
      : kv_(kv), options_(options) {}

  // Adds one step's attention mass for s: `mass` holds n_kv_heads rows of
  // `stride` slots; the chunk's query tokens were slots [first, first + n).
  void AddAttention(Sequence* s, const float* mass, int32_t n_kv_heads, int64_t stride,
                    int32_t first, int32_t n) const {
    AddAttention(&s->attention_score, &s->attention_age, mass, n_kv_heads, stride, first, n);
  }
  static void AddAttention(std::vector<float>* score, std::vector<int32_t>* age,
                           const float* mass, int32_t n_kv_heads, int64_t stride, int32_t first,
                           int32_t n);
  // Compacts s when its policy lets at least a block's worth of slots go.
  // Returns the slots dropped (0: nothing done).
  int32_t MaybeCompact(Sequence* s) {
    return MaybeCompact(s->group()->request.kv_policy, &s->kv, &s->attention_score,
                        &s->attention_age);
  }
  // The same on bare KV state (the policy evaluator drives it directly).
  int32_t MaybeCompact(const KvPolicy& policy, SeqKv* kv, std::vector<float>* score,
                       std::vector<int32_t>* age);

  int64_t evicted_tokens() const { return evicted_tokens_; }
  int64_t compactions() const { return compactions_; }
  int64_t rotated_keys() const { return rotated_keys_; }  // slots re-rotated

 private:
  // Sinks policy after a compaction from `keep` with the sequence's earlier
  // shift and positions mode: re-rotates what needs it (see the header).
  void Reposition(const KvPolicy& policy, SeqKv* kv, const std::vector<int32_t>& keep,
                  int32_t old_shift, bool was_cache_positions);

  KvCacheManager* kv_;
  KvEvictorOptions options_;
  int64_t rotated_keys_ = 0;
  int64_t evicted_tokens_ = 0;
  int64_t compactions_ = 0;
};

}  // namespace kvserve
