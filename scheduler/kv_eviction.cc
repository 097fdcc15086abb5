#include "scheduler/kv_eviction.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>

namespace kvserve {

std::vector<int32_t> ChooseKeptSlots(const KvPolicy& policy, int32_t n_slots, int32_t protect_end,
                                     const float* score) {
  std::vector<int32_t> keep;
  if (policy.kind == KvPolicy::Kind::kNone || n_slots <= policy.capacity()) {
    keep.resize(static_cast<size_t>(n_slots));
    std::iota(keep.begin(), keep.end(), 0);
    return keep;
  }
  const int32_t sinks = policy.kind == KvPolicy::Kind::kWindow ? 0 : policy.sinks;
  // Kept in place: the shared prefix and the sinks.
  const int32_t head = std::min(n_slots, std::max(protect_end, sinks));
  // The recent window (never reaching into the head).
  const int32_t tail_from = std::max(head, n_slots - policy.window);
  // Heavy hitters fill what the budget leaves between them.
  int32_t heavy = 0;
  if (policy.kind == KvPolicy::Kind::kH2O) {
    heavy = std::max(0, policy.budget - head - (n_slots - tail_from));
    heavy = std::min(heavy, tail_from - head);
  }
  for (int32_t i = 0; i < head; ++i) keep.push_back(i);
  if (heavy > 0) {
    std::vector<int32_t> cand(static_cast<size_t>(tail_from - head));
    std::iota(cand.begin(), cand.end(), head);
    std::stable_sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
      const float sa = score ? score[a] : 0, sb = score ? score[b] : 0;
      return sa > sb;
    });
    cand.resize(static_cast<size_t>(heavy));
    std::sort(cand.begin(), cand.end());
    keep.insert(keep.end(), cand.begin(), cand.end());
  }
  for (int32_t i = tail_from; i < n_slots; ++i) keep.push_back(i);
  return keep;
}

void KvEvictor::AddAttention(std::vector<float>* score, std::vector<int32_t>* age,
                             const float* mass, int32_t n_kv_heads, int64_t stride, int32_t first,
                             int32_t n) {
  const int32_t slots = first + n;
  if (static_cast<int32_t>(score->size()) < slots) {
    score->resize(static_cast<size_t>(slots), 0.0f);
    age->resize(static_cast<size_t>(slots), 0);
  }
  for (int32_t j = 0; j < slots; ++j) {
    float m = 0;
    for (int32_t h = 0; h < n_kv_heads; ++h) m += mass[h * stride + j];
    (*score)[static_cast<size_t>(j)] += m;
    // Query q (slot first + i) attends slots [0, q].
    (*age)[static_cast<size_t>(j)] += j < first ? n : first + n - j;
  }
}

int32_t KvEvictor::MaybeCompact(const KvPolicy& policy, SeqKv* kv, std::vector<float>* score,
                                std::vector<int32_t>* age) {
  if (policy.kind == KvPolicy::Kind::kNone) return 0;
  // A sliding-window model's window already bounds its KV, and the blocks
  // it left are parked: token eviction has nothing to move.
  if (kv_->sliding_window() > 0) return 0;
  const int32_t n = kv->num_computed;
  if (n - policy.capacity() < kv_->block_size()) return 0;  // a block at a time
  if (kv->num_committed != n) return 0;                     // drafts in flight: after they settle
  std::vector<float> mean;
  const float* ranked = nullptr;
  if (policy.kind == KvPolicy::Kind::kH2O) {
    mean.assign(static_cast<size_t>(n), 0.0f);
    for (int32_t i = 0; i < n && i < static_cast<int32_t>(score->size()); ++i) {
      const int32_t a = (*age)[static_cast<size_t>(i)];
      mean[static_cast<size_t>(i)] = a > 0 ? (*score)[static_cast<size_t>(i)] / a : 0;
    }
    ranked = mean.data();
  }
  // Shared blocks may be dropped too (DropSlots never writes them; the
  // sequence only lets go of its reference), so nothing is protected here.
  const std::vector<int32_t> keep = ChooseKeptSlots(policy, n, /*protect_end=*/0, ranked);
  const int32_t dropped = n - static_cast<int32_t>(keep.size());
  if (dropped < kv_->block_size()) return 0;
  // No block for a copy-on-write: try again after the next step.
  const int32_t old_shift = kv->position_shift;
  const bool was_cache_positions = kv->cache_positions;
  if (!kv_->DropSlots(kv, keep)) return 0;
  if (policy.kind == KvPolicy::Kind::kSinks || policy.kind == KvPolicy::Kind::kWindow) {
    Reposition(policy, kv, keep, old_shift, was_cache_positions);
  }
  if (!score->empty()) {
    std::vector<float> sc;
    std::vector<int32_t> ag;
    for (int32_t k : keep) {
      const size_t i = static_cast<size_t>(k);
      sc.push_back(i < score->size() ? (*score)[i] : 0);
      ag.push_back(i < age->size() ? (*age)[i] : 0);
    }
    *score = std::move(sc);
    *age = std::move(ag);
  }
  evicted_tokens_ += dropped;
  ++compactions_;
  return dropped;
}

void KvEvictor::Reposition(const KvPolicy& policy, SeqKv* kv, const std::vector<int32_t>& keep,
                           int32_t old_shift, bool was_cache_positions) {
  if (!options_.can_rotate || options_.context_length <= 0) return;
  const int32_t n = static_cast<int32_t>(keep.size());
  if (!was_cache_positions &&
      n + kv->position_shift + options_.switch_margin < options_.context_length) {
    return;  // original positions still fit
  }
  // The kept row now at slot i was written at position: its old slot in
  // cache positions, else (sinks and window: the sinks never move, the rest
  // is one contiguous run) its old slot, plus the old shift past the sinks.
  const int32_t sinks = policy.kind == KvPolicy::Kind::kWindow ? 0 : policy.sinks;
  std::vector<int32_t> slots, deltas;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t from = keep[static_cast<size_t>(i)];
    const int32_t old_pos = was_cache_positions || from < sinks ? from : from + old_shift;
    if (old_pos == i) continue;
    slots.push_back(i);
    deltas.push_back(i - old_pos);
  }
  // A shared block among them needs a copy; without a free block the
  // sequence keeps its positions (mode unchanged) until a later compaction.
  if (!kv_->RotateKeys(kv, slots, deltas, options_.rope)) {
    if (was_cache_positions) {
      // Rows already moved; their keys must match their slots. No block for
      // a copy cannot happen here: moved rows sit in blocks DropSlots made
      // private.
      std::fprintf(stderr, "KvEvictor: re-rotation of moved rows found a shared block\n");
      std::abort();
    }
    return;
  }
  kv->cache_positions = true;
  rotated_keys_ += static_cast<int64_t>(slots.size());
}

}  // namespace kvserve
