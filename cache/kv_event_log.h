// KvEventLog: the prefix cache's changes as a replayable stream. The engine
// thread publishes (KvEventSink); any number of subscriber threads read. Each
// event gets a strictly increasing sequence number (the first is 1). The log
// retains the last `retain` events and keeps its own replica of the index
// (applied event by event), so a subscriber that reconnects with the last
// sequence number it saw either gets exactly the events it missed or, when
// those have left the window, a snapshot of the whole index as of some
// sequence number followed by the events after it.
//
// The KV tiers' events (KvCacheEvent::tier: a block demoted to the host or
// disk tier, a page leaving it) go through the same log, so every stream
// built on it agrees on them. The log keeps a replica per tier beside the
// index's: a tier's stored event gets the parent, tokens and scope of the
// block it knew under that hash (the index's block being demoted, or the
// host page being spilled to disk), and is dropped (never numbered) when it
// knows none (a KV cache group's page: the log describes the full group
// only) or the tier holds the hash already; a tier's removed event is
// dropped unless that tier's replica holds the hash. Snapshots list the
// index's blocks, then the host tier's, then the disk tier's, then each
// other KV cache group's index blocks (KvCacheEvent::group, a hybrid
// model: kept apart from group 0's, since the groups share hashes).
//
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cache/prefix_cache.h"

namespace kvserve {

struct SequencedKvEvent {
  uint64_t sequence = 0;
  KvCacheEvent event;
};

// What one Read returns.
struct KvEventRead {
  // True when the events after `after` are gone: `snapshot` then holds every
  // cached block (BlockStored, parents first) as of `snapshot_sequence`, and
  // `events` continue from snapshot_sequence + 1.
  bool is_snapshot = false;
  uint64_t snapshot_sequence = 0;
  std::vector<KvCacheEvent> snapshot;
  std::vector<SequencedKvEvent> events;  // consecutive sequence numbers
  bool closed = false;                   // the log was closed; no more events
};

class KvEventLog : public KvEventSink {
 public:
  explicit KvEventLog(size_t retain = 65536);
  ~KvEventLog() override;

  void Publish(std::vector<KvCacheEvent> events) override;

  // Events with sequence > after, at most max_events, waiting up to `wait`
  // for the first one (an empty result after the wait is not an error). When
  // event after + 1 has left the window, or `after` is beyond the last
  // published number (the caller's state is not ours), the result is a
  // snapshot instead. A new subscriber passes after = 0. max_events = 0 means
  // no limit.
  KvEventRead Read(uint64_t after, size_t max_events, std::chrono::milliseconds wait);

  // Wakes every reader; later Reads return closed = true at once.
  void Close();

  // Random and nonzero, fixed for the log's lifetime: sequence numbers are
  // only comparable within one epoch (a restarted daemon starts over at 1).
  uint64_t epoch() const { return epoch_; }
  uint64_t last_sequence() const;
  uint64_t oldest_retained() const;  // 0 when nothing is retained
  size_t replica_size() const;       // blocks in the replica
  size_t tier_replica_size(KvTier tier) const;  // pages of the host or disk tier

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t retain_;
  uint64_t epoch_;
  std::deque<SequencedKvEvent> window_;
  uint64_t last_ = 0;
  bool closed_ = false;
  struct ReplicaBlock {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    std::string scope;  // first blocks: their cache namespace (KvCacheEvent::scope)
    size_t order = 0;  // index of this block's live entry in replica_order_
  };
  std::unordered_map<uint64_t, ReplicaBlock> replica_;
  std::vector<uint64_t> replica_order_;  // insertion order, for parents-first snapshots (lazily compacted)
  // The host [0] and disk [1] tiers' pages (order: unused).
  std::unordered_map<uint64_t, ReplicaBlock> tier_replica_[2];
  std::vector<uint64_t> tier_order_[2];  // insertion order (lazily compacted)
  // KV cache groups 1.. (a hybrid model; KvCacheEvent::group): each
  // group's index apart, since the groups cache the same chains under the
  // same hashes. replica_ and replica_size() are group 0's.
  struct GroupReplica {
    std::unordered_map<uint64_t, ReplicaBlock> blocks;
    std::vector<uint64_t> order;
  };
  std::map<int32_t, GroupReplica> group_replicas_;

  // REQUIRES: mu_ held. False: the event is dropped (a tier event the log
  // cannot describe or that changes nothing); e may be completed.
  bool ApplyLocked(KvCacheEvent& e);
  void CompactOrderLocked();
  std::vector<KvCacheEvent> SnapshotLocked() const;
};

}  // namespace kvserve
