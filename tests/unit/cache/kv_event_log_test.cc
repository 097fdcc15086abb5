// KvEventLog: sequence numbers, replay inside the window, snapshots outside
// it, and that a replica rebuilt from what Read returns (events alone)
// always equals the index, including one driven by a real PrefixCache
// through random inserts, evictions and clears with a reader that drops
// out and comes back.
#include "cache/kv_event_log.h"

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache/kv_pool.h"
#include "cache/prefix_cache.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using namespace std::chrono_literals;
using Kind = KvCacheEvent::Kind;

constexpr uint64_t kBeyondAnything = std::numeric_limits<uint64_t>::max();

KvCacheEvent Stored(uint64_t hash, uint64_t parent, std::vector<int32_t> tokens = {1, 2}) {
  KvCacheEvent e;
  e.kind = Kind::kBlockStored;
  e.block_hash = hash;
  e.parent_hash = parent;
  e.token_ids = std::move(tokens);
  return e;
}

KvCacheEvent Removed(uint64_t hash) {
  KvCacheEvent e;
  e.kind = Kind::kBlockRemoved;
  e.block_hash = hash;
  return e;
}

KvCacheEvent Cleared() {
  KvCacheEvent e;
  e.kind = Kind::kAllCleared;
  return e;
}

struct Block {
  uint64_t parent = 0;
  std::vector<int32_t> tokens;
  friend bool operator==(const Block& a, const Block& b) {
    return a.parent == b.parent && a.tokens == b.tokens;
  }
};
using Index = std::map<uint64_t, Block>;

// What a router keeps: the index rebuilt from Read results alone. Checks the
// stream's promises as it applies them (consecutive sequence numbers,
// parents before children, no removal of an unknown block).
struct Replica {
  Index blocks;
  uint64_t position = 0;
  int snapshots = 0;

  void Apply(const KvCacheEvent& e) {
    switch (e.kind) {
      case Kind::kBlockStored:
        if (e.parent_hash != 0) {
          ASSERT_EQ(blocks.count(e.parent_hash), 1u) << "parent " << e.parent_hash << " unknown";
        }
        blocks[e.block_hash] = Block{e.parent_hash, e.token_ids};
        break;
      case Kind::kBlockRemoved:
        ASSERT_EQ(blocks.erase(e.block_hash), 1u) << "removed unknown " << e.block_hash;
        break;
      case Kind::kAllCleared:
        blocks.clear();
        break;
    }
  }

  void Apply(const KvEventRead& r) {
    if (r.is_snapshot) {
      ++snapshots;
      blocks.clear();
      for (const KvCacheEvent& e : r.snapshot) {
        ASSERT_EQ(e.kind, Kind::kBlockStored);
        Apply(e);
      }
      position = r.snapshot_sequence;
    }
    for (const SequencedKvEvent& e : r.events) {
      ASSERT_EQ(e.sequence, position + 1);
      Apply(e.event);
      position = e.sequence;
    }
  }

  // Reads until caught up with the log's last sequence.
  void CatchUp(KvEventLog& log, size_t max_events = 0) {
    while (position != log.last_sequence()) {
      KvEventRead r = log.Read(position, max_events, 0ms);
      ASSERT_FALSE(r.closed);
      Apply(r);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
};

Index ToIndex(const std::vector<KvCacheEvent>& dump) {
  Index out;
  for (const KvCacheEvent& e : dump) out[e.block_hash] = Block{e.parent_hash, e.token_ids};
  return out;
}

// The log's own view, through a forced snapshot.
Index SnapshotOf(KvEventLog& log) {
  KvEventRead r = log.Read(kBeyondAnything, 0, 0ms);
  EXPECT_TRUE(r.is_snapshot);
  return ToIndex(r.snapshot);
}

TEST(KvEventLogTest, SequenceNumbersStartAtOneAndIncreaseByOne) {
  KvEventLog log(100);
  EXPECT_EQ(log.last_sequence(), 0u);
  EXPECT_EQ(log.oldest_retained(), 0u);
  log.Publish({Stored(10, 0), Stored(11, 10)});
  log.Publish({});
  log.Publish({Removed(11)});
  EXPECT_EQ(log.last_sequence(), 3u);
  EXPECT_EQ(log.oldest_retained(), 1u);
  KvEventRead r = log.Read(0, 0, 0ms);
  EXPECT_FALSE(r.is_snapshot);
  ASSERT_EQ(r.events.size(), 3u);
  for (size_t i = 0; i < r.events.size(); ++i) EXPECT_EQ(r.events[i].sequence, i + 1);
  EXPECT_EQ(r.events[0].event.block_hash, 10u);
  EXPECT_EQ(r.events[2].event.kind, Kind::kBlockRemoved);
  EXPECT_EQ(log.replica_size(), 1u);
}

TEST(KvEventLogTest, EachLogHasItsOwnNonzeroEpoch) {
  KvEventLog a, b;
  EXPECT_NE(a.epoch(), 0u);
  EXPECT_NE(a.epoch(), b.epoch()) << "a restarted daemon must be told apart";
  const uint64_t before = a.epoch();
  a.Publish({KvCacheEvent{KvCacheEvent::Kind::kAllCleared, 0, 0, {}}});
  EXPECT_EQ(a.epoch(), before);
}

TEST(KvEventLogTest, ReplaysExactlyTheMissedEventsInsideTheWindow) {
  KvEventLog log(8);
  for (uint64_t h = 1; h <= 12; ++h) log.Publish({Stored(h, h == 1 ? 0 : h - 1)});
  EXPECT_EQ(log.oldest_retained(), 5u);  // 12 published, 8 kept
  KvEventRead r = log.Read(6, 0, 0ms);
  EXPECT_FALSE(r.is_snapshot);
  ASSERT_EQ(r.events.size(), 6u);
  EXPECT_EQ(r.events.front().sequence, 7u);
  EXPECT_EQ(r.events.back().sequence, 12u);
  // The oldest retained event is the first the window can still replay.
  r = log.Read(4, 0, 0ms);
  EXPECT_FALSE(r.is_snapshot);
  EXPECT_EQ(r.events.front().sequence, 5u);
}

TEST(KvEventLogTest, MaxEventsBoundsOneRead) {
  KvEventLog log(100);
  for (uint64_t h = 1; h <= 10; ++h) log.Publish({Stored(h, 0)});
  KvEventRead r = log.Read(2, 3, 0ms);
  ASSERT_EQ(r.events.size(), 3u);
  EXPECT_EQ(r.events.front().sequence, 3u);
  EXPECT_EQ(r.events.back().sequence, 5u);
}

TEST(KvEventLogTest, SnapshotWhenTheGapLeftTheWindow) {
  KvEventLog log(4);
  log.Publish({Stored(1, 0), Stored(2, 1), Stored(3, 2), Stored(4, 0)});
  log.Publish({Removed(3), Stored(5, 2)});
  Replica replica;
  replica.position = 1;  // it saw event 1; events 2 and 3 are gone
  KvEventRead r = log.Read(replica.position, 0, 0ms);
  ASSERT_TRUE(r.is_snapshot);
  EXPECT_EQ(r.snapshot_sequence, 6u);
  EXPECT_TRUE(r.events.empty());
  replica.Apply(r);
  Index want = {{1, {0, {1, 2}}}, {2, {1, {1, 2}}}, {4, {0, {1, 2}}}, {5, {2, {1, 2}}}};
  EXPECT_EQ(replica.blocks, want);
  EXPECT_EQ(replica.position, 6u);
  // And live events continue from the snapshot's sequence.
  log.Publish({Removed(5)});
  r = log.Read(replica.position, 0, 0ms);
  ASSERT_FALSE(r.is_snapshot);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].sequence, 7u);
}

TEST(KvEventLogTest, SnapshotWhenTheReaderIsAheadOfTheLog) {
  // A subscriber that followed a previous daemon run: its state is not ours.
  KvEventLog log(100);
  log.Publish({Stored(1, 0)});
  KvEventRead r = log.Read(50, 0, 0ms);
  ASSERT_TRUE(r.is_snapshot);
  EXPECT_EQ(r.snapshot_sequence, 1u);
  ASSERT_EQ(r.snapshot.size(), 1u);
}

TEST(KvEventLogTest, NothingRetainedStillServesSnapshots) {
  KvEventLog log(0);
  log.Publish({Stored(1, 0), Stored(2, 1)});
  EXPECT_EQ(log.oldest_retained(), 0u);
  Replica replica;
  replica.CatchUp(log);
  EXPECT_EQ(replica.snapshots, 1);
  EXPECT_EQ(replica.blocks.size(), 2u);
}

TEST(KvEventLogTest, SnapshotListsParentsFirstEvenAfterReinsertion) {
  KvEventLog log(1);
  // 20 is stored first under 10, then both leave, and 20 comes back under
  // a 10 stored after 20's first appearance: insertion order alone would
  // list the child first.
  log.Publish({Stored(10, 0), Stored(20, 10), Stored(30, 0)});
  log.Publish({Removed(20), Removed(10)});
  log.Publish({Stored(10, 0), Stored(20, 10), Stored(40, 20)});
  KvEventRead r = log.Read(kBeyondAnything, 0, 0ms);
  ASSERT_TRUE(r.is_snapshot);
  std::set<uint64_t> seen;
  for (const KvCacheEvent& e : r.snapshot) {
    if (e.parent_hash != 0) {
      EXPECT_TRUE(seen.count(e.parent_hash)) << e.block_hash;
    }
    EXPECT_TRUE(seen.insert(e.block_hash).second) << "listed twice: " << e.block_hash;
  }
  EXPECT_EQ(seen, (std::set<uint64_t>{10, 20, 30, 40}));
}

TEST(KvEventLogTest, SnapshotsStayParentsFirstThroughCompaction) {
  // Many removals trigger the lazy compaction of the insertion order.
  KvEventLog log(16);
  std::mt19937 rng(7);
  Index model;
  uint64_t next = 1;
  constexpr int kSteps = 12000;
  for (int step = 0; step < kSteps; ++step) {
    // Store a child of a random block (or a root), or remove a random leaf;
    // the index grows and shrinks in phases, so removals pile up.
    const bool growing = (step / 1500) % 2 == 0;
    if (model.empty() || rng() % 10 < (growing ? 8u : 2u)) {
      uint64_t parent = 0;
      if (!model.empty() && rng() % 4 != 0) {
        auto it = model.begin();
        std::advance(it, rng() % model.size());
        parent = it->first;
      }
      const uint64_t h = next++;
      model[h] = Block{parent, {static_cast<int32_t>(h)}};
      log.Publish({Stored(h, parent, {static_cast<int32_t>(h)})});
    } else {
      std::set<uint64_t> parents;
      for (const auto& [h, b] : model) parents.insert(b.parent);
      std::vector<uint64_t> leaves;
      for (const auto& [h, b] : model) {
        if (!parents.count(h)) leaves.push_back(h);
      }
      const uint64_t victim = leaves[rng() % leaves.size()];
      model.erase(victim);
      log.Publish({Removed(victim)});
    }
    if (step % 997 == 0 || step == kSteps - 1) {
      Replica fresh;
      fresh.Apply(log.Read(kBeyondAnything, 0, 0ms));  // asserts parents first
      ASSERT_FALSE(HasFatalFailure());
      ASSERT_EQ(fresh.blocks, model) << "step " << step;
    }
  }
  EXPECT_EQ(log.replica_size(), model.size());
}

TEST(KvEventLogTest, AllClearedEmptiesTheReplica) {
  KvEventLog log(100);
  Replica replica;
  log.Publish({Stored(1, 0), Stored(2, 1), Stored(3, 0)});
  replica.CatchUp(log);
  EXPECT_EQ(replica.blocks.size(), 3u);
  log.Publish({Cleared()});
  replica.CatchUp(log);
  EXPECT_TRUE(replica.blocks.empty());
  EXPECT_EQ(log.replica_size(), 0u);
  EXPECT_TRUE(SnapshotOf(log).empty());
  // The index fills again after a clear.
  log.Publish({Stored(1, 0)});
  replica.CatchUp(log);
  EXPECT_EQ(replica.blocks.size(), 1u);
  EXPECT_EQ(replica.snapshots, 0);
}

// KV cache groups (a hybrid model): a window group's index caches the same
// chains under the same hashes as the full group's. Its events keep their
// group through the log and its snapshot, and its removals and clears touch
// its own replica only: group 0's blocks (replica_size) stay as they were.
TEST(KvEventLogTest, OtherGroupsBlocksAreKeptApartFromGroupZerosUnderTheSameHashes) {
  auto in_group = [](KvCacheEvent e, int32_t g) {
    e.group = g;
    return e;
  };
  KvEventLog log(100);
  log.Publish({Stored(1, 0), Stored(2, 1), in_group(Stored(1, 0), 2), in_group(Stored(2, 1), 2)});
  EXPECT_EQ(log.last_sequence(), 4u);  // every event numbered
  EXPECT_EQ(log.replica_size(), 2u);   // group 0's index only
  log.Publish({in_group(Removed(2), 2)});
  EXPECT_EQ(log.replica_size(), 2u) << "group 2's removal must not remove group 0's block";
  KvEventRead r = log.Read(kBeyondAnything, 0, 0ms);
  ASSERT_TRUE(r.is_snapshot);
  std::vector<std::pair<int32_t, uint64_t>> listed;
  for (const KvCacheEvent& e : r.snapshot) listed.emplace_back(e.group, e.block_hash);
  EXPECT_EQ(listed, (std::vector<std::pair<int32_t, uint64_t>>{{0, 1}, {0, 2}, {2, 1}}));
  log.Publish({in_group(Cleared(), 2)});
  r = log.Read(kBeyondAnything, 0, 0ms);
  EXPECT_EQ(r.snapshot.size(), 2u) << "group 2's clear empties group 2 only";
  EXPECT_EQ(log.replica_size(), 2u);
  // A live reader sees the group on every event.
  r = log.Read(0, 0, 0ms);
  ASSERT_FALSE(r.is_snapshot);
  ASSERT_EQ(r.events.size(), 6u);
  EXPECT_EQ(r.events[0].event.group, 0);
  EXPECT_EQ(r.events[2].event.group, 2);
  EXPECT_EQ(r.events[5].event.group, 2);
}

TEST(KvEventLogTest, ReadWaitsForTheNextEventAndTimesOutEmpty) {
  KvEventLog log(100);
  const auto start = std::chrono::steady_clock::now();
  KvEventRead r = log.Read(0, 0, 30ms);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 25ms);
  EXPECT_FALSE(r.closed);
  EXPECT_FALSE(r.is_snapshot);
  EXPECT_TRUE(r.events.empty());

  std::thread writer([&] {
    std::this_thread::sleep_for(20ms);
    log.Publish({Stored(1, 0)});
  });
  r = log.Read(0, 0, 10s);
  writer.join();
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].sequence, 1u);
}

TEST(KvEventLogTest, CloseWakesBlockedReaders) {
  KvEventLog log(100);
  log.Publish({Stored(1, 0)});
  std::vector<std::thread> readers;
  std::atomic<int> closed{0};
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&] {
      if (log.Read(1, 0, 60s).closed) ++closed;
    });
  }
  std::this_thread::sleep_for(20ms);
  const auto start = std::chrono::steady_clock::now();
  log.Close();
  for (std::thread& t : readers) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_EQ(closed.load(), 4);
  // Later reads return at once, closed.
  EXPECT_TRUE(log.Read(0, 0, 60s).closed);
}

TEST(KvEventLogTest, ConcurrentReadersRebuildTheIndexWhileAWriterPublishes) {
  // A small window, so readers that pause fall behind and take snapshots.
  KvEventLog log(32);
  constexpr int kSteps = 20000;
  std::atomic<bool> writer_done{false};
  Index final_model;
  std::thread writer([&] {
    std::mt19937 rng(11);
    Index model;
    uint64_t next = 1;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<KvCacheEvent> batch;
      const int r = static_cast<int>(rng() % 100);
      if (r == 0) {
        model.clear();
        batch.push_back(Cleared());
      } else if (model.empty() || r < 65) {
        uint64_t parent = 0;
        if (!model.empty() && rng() % 3 != 0) parent = std::prev(model.end())->first;
        const uint64_t h = next++;
        model[h] = Block{parent, {static_cast<int32_t>(h % 97), 5}};
        batch.push_back(Stored(h, parent, model[h].tokens));
      } else {
        std::set<uint64_t> parents;
        for (const auto& [h, b] : model) parents.insert(b.parent);
        for (const auto& [h, b] : model) {
          if (!parents.count(h)) {
            batch.push_back(Removed(h));
            model.erase(h);
            break;
          }
        }
      }
      log.Publish(std::move(batch));
      if (step % 500 == 0) std::this_thread::yield();
    }
    final_model = model;
    writer_done = true;
  });

  constexpr int kReaders = 4;
  std::vector<Replica> replicas(kReaders);
  std::vector<std::thread> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.emplace_back([&, i] {
      std::mt19937 rng(100 + i);
      Replica& replica = replicas[i];
      for (;;) {
        const bool done = writer_done.load();
        KvEventRead r = log.Read(replica.position, 1 + rng() % 64, 5ms);
        replica.Apply(r);
        if (::testing::Test::HasFatalFailure()) return;
        // A reader that drops out for a while comes back with a gap.
        if (rng() % 200 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 5));
        if (done && replica.position == log.last_sequence()) return;
      }
    });
  }
  writer.join();
  for (std::thread& t : readers) t.join();
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(SnapshotOf(log), final_model);
  for (int i = 0; i < kReaders; ++i) {
    EXPECT_EQ(replicas[i].position, log.last_sequence()) << "reader " << i;
    EXPECT_EQ(replicas[i].blocks, final_model) << "reader " << i;
  }
}

// A real PrefixCache publishing into the log: random inserts (over a tiny
// vocabulary, so prefixes are shared), matches, evictions and clears, in two
// salts. A reader follows by events alone; now and then it disconnects for
// longer than the window holds and must come back through a snapshot. Each
// time it catches up, its replica must equal PrefixCache::Dump().
TEST(KvEventLogTest, ReplicaOfARealPrefixCacheMatchesItsDump) {
  constexpr int32_t kBlockSize = 4;
  KvPoolOptions po;
  po.n_layers = 1;
  po.n_kv_heads = 1;
  po.head_dim = 4;
  po.block_size = kBlockSize;
  po.n_blocks = 96;
  auto pool = KvPool::Create(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  KvEventLog log(24);
  PrefixCacheOptions co;
  co.model_identity = "test-model";
  co.events = &log;
  PrefixCache cache(pool->get(), std::move(co));

  std::mt19937 rng(2024);
  const std::string salts[] = {"", "tenant-b"};
  Replica replica;
  int gaps = 0, catch_ups = 0;
  bool disconnected = false;
  int reconnect_at = 0;
  for (int step = 0; step < 6000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    const std::string& salt = salts[rng() % 2];
    if (op < 60) {
      const int32_t n_blocks = 1 + static_cast<int32_t>(rng() % 5);
      std::vector<int32_t> tokens(n_blocks * kBlockSize + rng() % kBlockSize);
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 3);
      if ((*pool)->num_free_blocks() < n_blocks) cache.Evict(n_blocks);
      std::vector<BlockHandle> blocks;
      if (!(*pool)->Allocate(n_blocks, &blocks).ok()) continue;
      cache.Insert(salt, tokens, blocks);
      (*pool)->Release(blocks);  // the cache keeps its own references
    } else if (op < 80) {
      std::vector<int32_t> tokens(1 + rng() % (4 * kBlockSize));
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 3);
      PrefixMatch m = cache.Match(salt, tokens, static_cast<int32_t>(tokens.size()));
      (*pool)->Release(m.blocks);
    } else if (op < 98) {
      cache.Evict(1 + static_cast<int32_t>(rng() % 4));
    } else if (op == 98) {
      cache.Clear();
    }

    // Connected, the reader keeps up (a step publishes fewer events than
    // the window holds); away, it misses whatever happens meanwhile.
    if (!disconnected && rng() % 150 == 0) {
      disconnected = true;
      reconnect_at = step + 10 + static_cast<int>(rng() % 200);
    }
    if (disconnected && step < reconnect_at) continue;
    if (disconnected) {
      disconnected = false;
      if (log.oldest_retained() == 0 || replica.position + 1 < log.oldest_retained()) ++gaps;
    }
    replica.CatchUp(log, 1 + rng() % 16);
    ASSERT_FALSE(HasFatalFailure()) << "step " << step;
    ++catch_ups;
    ASSERT_EQ(replica.blocks, ToIndex(cache.Dump())) << "step " << step;
    ASSERT_EQ(log.replica_size(), static_cast<size_t>(cache.num_cached_blocks()));
  }
  replica.CatchUp(log);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(replica.blocks, ToIndex(cache.Dump()));
  EXPECT_EQ(SnapshotOf(log), ToIndex(cache.Dump()));
  // The run exercised what it means to.
  EXPECT_GT(gaps, 3);
  EXPECT_EQ(replica.snapshots, gaps);
  EXPECT_GT(catch_ups, 100);
  EXPECT_GT(cache.stats().evicted_blocks, 0);
}

// The KV tiers' events: a demoted block is described as the index knew it,
// a page the log cannot describe (a KV cache group's, a block never in the
// index) and a removal of a page the tier does not hold are dropped, a
// spill carries the host page's description to the disk, and snapshots
// list the tiers' pages after the index with their tier. A clear of the
// index leaves the tiers' pages.
TEST(KvEventLogTest, TierEventsAreDescribedFromTheIndexAndListedInSnapshots) {
  KvEventLog log(100);
  auto tier_event = [](Kind kind, KvTier tier, uint64_t hash, KvTier moved_to = KvTier::kNone) {
    KvCacheEvent e;
    e.kind = kind;
    e.tier = tier;
    e.block_hash = hash;
    e.moved_to = moved_to;
    return e;
  };
  log.Publish({Stored(1, 0, {5, 6}), Stored(2, 1, {7, 8})});
  // Demotion of block 2: stored in the host tier first, then the index's removal.
  log.Publish({tier_event(Kind::kBlockStored, KvTier::kHost, 2)});
  KvCacheEvent gone = Removed(2);
  gone.moved_to = KvTier::kHost;
  log.Publish({gone});
  // Unknown page (another group's key) and a second store: dropped.
  log.Publish({tier_event(Kind::kBlockStored, KvTier::kHost, 99),
               tier_event(Kind::kBlockStored, KvTier::kHost, 2),
               tier_event(Kind::kBlockRemoved, KvTier::kDisk, 2)});
  EXPECT_EQ(log.last_sequence(), 4u);
  KvEventRead r = log.Read(0, 0, 0ms);
  ASSERT_EQ(r.events.size(), 4u);
  const KvCacheEvent& host = r.events[2].event;
  EXPECT_EQ(host.tier, KvTier::kHost);
  EXPECT_EQ(host.parent_hash, 1u);
  EXPECT_THAT(host.token_ids, ::testing::ElementsAre(7, 8));
  EXPECT_EQ(log.tier_replica_size(KvTier::kHost), 1u);
  EXPECT_EQ(log.replica_size(), 1u);
  // Spill: the disk page is described as the host page was.
  log.Publish({tier_event(Kind::kBlockStored, KvTier::kDisk, 2),
               tier_event(Kind::kBlockRemoved, KvTier::kHost, 2, KvTier::kDisk)});
  EXPECT_EQ(log.last_sequence(), 6u);
  r = log.Read(4, 0, 0ms);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0].event.tier, KvTier::kDisk);
  EXPECT_THAT(r.events[0].event.token_ids, ::testing::ElementsAre(7, 8));
  EXPECT_EQ(r.events[1].event.moved_to, KvTier::kDisk);
  // A clear of the index keeps the tiers' pages; the snapshot lists them.
  log.Publish({Cleared()});
  EXPECT_EQ(log.tier_replica_size(KvTier::kDisk), 1u);
  log.Publish({Stored(1, 0, {5, 6})});
  const std::vector<KvCacheEvent> snap = log.Read(kBeyondAnything, 0, 0ms).snapshot;
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap[0].tier, KvTier::kNone);
  EXPECT_EQ(snap[1].tier, KvTier::kDisk);
  EXPECT_EQ(snap[1].block_hash, 2u);
  EXPECT_EQ(snap[1].parent_hash, 1u);
}

}  // namespace
}  // namespace kvserve
