#include "cache/kv_event_log.h"

#include <chrono>
#include <random>

#include <utility>

namespace kvserve {

namespace {

uint64_t NewEpoch() {
  std::random_device rd;
  uint64_t e = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return e == 0 ? 1 : e;
}

}  // namespace

KvEventLog::KvEventLog(size_t retain) : retain_(retain), epoch_(NewEpoch()) {}

KvEventLog::~KvEventLog() { Close(); }

void KvEventLog::Publish(std::vector<KvCacheEvent> events) {
  if (events.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (KvCacheEvent& e : events) {
      if (!ApplyLocked(e)) continue;
      if (retain_ == 0) {
        ++last_;
        continue;
      }
      window_.push_back(SequencedKvEvent{++last_, std::move(e)});
      if (window_.size() > retain_) window_.pop_front();
    }
  }
  cv_.notify_all();
}

bool KvEventLog::ApplyLocked(KvCacheEvent& e) {
  if (e.tier != KvTier::kNone && e.kind != KvCacheEvent::Kind::kAllCleared) {
    auto& pages = tier_replica_[e.tier == KvTier::kHost ? 0 : 1];
    auto& order = tier_order_[e.tier == KvTier::kHost ? 0 : 1];
    if (e.kind == KvCacheEvent::Kind::kBlockRemoved) return pages.erase(e.block_hash) > 0;
    if (pages.count(e.block_hash) > 0) return false;  // the tier holds it already
    if (e.token_ids.empty()) {
      // Describe it as the block the log knew under this hash: the index's
      // (a demotion), else the other tier's page (a spill, a promotion).
      const ReplicaBlock* known = nullptr;
      for (const auto* m : {&replica_, &tier_replica_[0], &tier_replica_[1]}) {
        auto it = m->find(e.block_hash);
        if (it != m->end()) {
          known = &it->second;
          break;
        }
      }
      if (known == nullptr) return false;
      e.parent_hash = known->parent;
      e.token_ids = known->tokens;
      e.scope = known->scope;
    }
    ReplicaBlock& b = pages[e.block_hash];
    b.parent = e.parent_hash;
    b.tokens = e.token_ids;
    b.scope = e.scope;
    b.order = order.size();
    order.push_back(e.block_hash);
    if (order.size() > 2 * pages.size() + 1024) {
      std::vector<uint64_t> live;
      for (size_t i = 0; i < order.size(); ++i) {
        auto it = pages.find(order[i]);
        if (it == pages.end() || it->second.order != i) continue;
        it->second.order = live.size();
        live.push_back(order[i]);
      }
      order = std::move(live);
    }
    return true;
  }
  if (e.group != 0) {
    // Another KV cache group's index: its own replica (same hashes as group
    // 0's for the same tokens).
    GroupReplica& r = group_replicas_[e.group];
    switch (e.kind) {
      case KvCacheEvent::Kind::kBlockStored: {
        auto [it, inserted] = r.blocks.try_emplace(e.block_hash);
        if (!inserted) return true;
        it->second.parent = e.parent_hash;
        it->second.tokens = e.token_ids;
        it->second.scope = e.scope;
        it->second.order = r.order.size();
        r.order.push_back(e.block_hash);
        return true;
      }
      case KvCacheEvent::Kind::kBlockRemoved:
        r.blocks.erase(e.block_hash);
        if (r.order.size() > 2 * r.blocks.size() + 1024) {
          std::vector<uint64_t> live;
          for (size_t i = 0; i < r.order.size(); ++i) {
            auto it = r.blocks.find(r.order[i]);
            if (it == r.blocks.end() || it->second.order != i) continue;
            it->second.order = live.size();
            live.push_back(r.order[i]);
          }
          r.order = std::move(live);
        }
        return true;
      case KvCacheEvent::Kind::kAllCleared:
        r.blocks.clear();
        r.order.clear();
        return true;
    }
    return true;
  }
  switch (e.kind) {
    case KvCacheEvent::Kind::kBlockStored: {
      // A hash already present keeps its place: its children, if any, were
      // stored after it, so the original position stays parents-first.
      auto [it, inserted] = replica_.try_emplace(e.block_hash);
      if (!inserted) return true;
      it->second.parent = e.parent_hash;
      it->second.tokens = e.token_ids;
      it->second.scope = e.scope;
      it->second.order = replica_order_.size();
      replica_order_.push_back(e.block_hash);
      return true;
    }
    case KvCacheEvent::Kind::kBlockRemoved:
      replica_.erase(e.block_hash);
      // Stale entries in replica_order_ are skipped by SnapshotLocked and
      // dropped here once they outnumber the live ones.
      if (replica_order_.size() > 2 * replica_.size() + 1024) CompactOrderLocked();
      return true;
    case KvCacheEvent::Kind::kAllCleared:
      // The index's blocks only: the tiers keep their pages.
      replica_.clear();
      replica_order_.clear();
      return true;
  }
  return true;
}

void KvEventLog::CompactOrderLocked() {
  std::vector<uint64_t> order;
  order.reserve(replica_.size());
  for (size_t i = 0; i < replica_order_.size(); ++i) {
    auto it = replica_.find(replica_order_[i]);
    // A hash removed and stored again appears twice; only the entry of its
    // latest store is live (the earlier one may precede its new parent).
    if (it == replica_.end() || it->second.order != i) continue;
    it->second.order = order.size();
    order.push_back(replica_order_[i]);
  }
  replica_order_ = std::move(order);
}

std::vector<KvCacheEvent> KvEventLog::SnapshotLocked() const {
  std::vector<KvCacheEvent> out;
  out.reserve(replica_.size());
  for (size_t i = 0; i < replica_order_.size(); ++i) {
    auto it = replica_.find(replica_order_[i]);
    if (it == replica_.end() || it->second.order != i) continue;
    KvCacheEvent e;
    e.kind = KvCacheEvent::Kind::kBlockStored;
    e.block_hash = it->first;
    e.parent_hash = it->second.parent;
    e.token_ids = it->second.tokens;
    e.scope = it->second.scope;
    out.push_back(std::move(e));
  }
  for (int t = 0; t < 2; ++t) {
    const auto& pages = tier_replica_[t];
    const auto& order = tier_order_[t];
    for (size_t i = 0; i < order.size(); ++i) {
      auto it = pages.find(order[i]);
      if (it == pages.end() || it->second.order != i) continue;
      KvCacheEvent e;
      e.kind = KvCacheEvent::Kind::kBlockStored;
      e.tier = t == 0 ? KvTier::kHost : KvTier::kDisk;
      e.block_hash = it->first;
      e.parent_hash = it->second.parent;
      e.token_ids = it->second.tokens;
      e.scope = it->second.scope;
      out.push_back(std::move(e));
    }
  }
  for (const auto& [g, r] : group_replicas_) {
    for (size_t i = 0; i < r.order.size(); ++i) {
      auto it = r.blocks.find(r.order[i]);
      if (it == r.blocks.end() || it->second.order != i) continue;
      KvCacheEvent e;
      e.kind = KvCacheEvent::Kind::kBlockStored;
      e.group = g;
      e.block_hash = it->first;
      e.parent_hash = it->second.parent;
      e.token_ids = it->second.tokens;
      e.scope = it->second.scope;
      out.push_back(std::move(e));
    }
  }
  return out;
}

KvEventRead KvEventLog::Read(uint64_t after, size_t max_events, std::chrono::milliseconds wait) {
  KvEventRead out;
  std::unique_lock<std::mutex> lock(mu_);
  if (after == last_ && !closed_ && wait.count() > 0) {
    cv_.wait_for(lock, wait, [&] { return closed_ || last_ != after; });
  }
  if (closed_) {
    out.closed = true;
    return out;
  }
  if (after == last_) return out;  // nothing new yet
  const uint64_t oldest = window_.empty() ? 0 : window_.front().sequence;
  if (after > last_ || oldest == 0 || after + 1 < oldest) {
    // The reader's position is gone from the window (or was never ours, as
    // after a daemon restart): start it over from the whole index.
    out.is_snapshot = true;
    out.snapshot_sequence = last_;
    out.snapshot = SnapshotLocked();
    return out;
  }
  const size_t begin = static_cast<size_t>(after + 1 - oldest);
  size_t end = window_.size();
  if (max_events > 0 && end - begin > max_events) end = begin + max_events;
  out.events.reserve(end - begin);
  for (size_t i = begin; i < end; ++i) out.events.push_back(window_[i]);
  return out;
}

void KvEventLog::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

uint64_t KvEventLog::last_sequence() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

uint64_t KvEventLog::oldest_retained() const {
  std::lock_guard<std::mutex> lock(mu_);
  return window_.empty() ? 0 : window_.front().sequence;
}

size_t KvEventLog::replica_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replica_.size();
}

size_t KvEventLog::tier_replica_size(KvTier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (tier == KvTier::kNone) return replica_.size();
  return tier_replica_[tier == KvTier::kHost ? 0 : 1].size();
}

}  // namespace kvserve
