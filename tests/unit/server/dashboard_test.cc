// The dashboard's pure parts: the block map's arithmetic, the histogram read
// back from the metrics text, the radix-tree replica and its hit counts, and
// the request board.
#include "server/observe/dashboard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "server/observe/metrics.h"
#include "server/service/request_board.h"

namespace kvserve {
namespace {

KvCacheEvent Stored(uint64_t hash, uint64_t parent, std::vector<int32_t> tokens) {
  KvCacheEvent e;
  e.kind = KvCacheEvent::Kind::kBlockStored;
  e.block_hash = hash;
  e.parent_hash = parent;
  e.token_ids = std::move(tokens);
  return e;
}

KvCacheEvent Removed(uint64_t hash) {
  KvCacheEvent e;
  e.kind = KvCacheEvent::Kind::kBlockRemoved;
  e.block_hash = hash;
  return e;
}

KvEventRead Events(std::vector<KvCacheEvent> events, uint64_t first_sequence) {
  KvEventRead r;
  for (auto& e : events) r.events.push_back({first_sequence++, std::move(e)});
  return r;
}

TEST(BlockMapTest, FourStatesAddUpToThePool) {
  EngineStats s;
  s.blocks_total = 100;
  s.blocks_used = 30;  // running sequences, 10 of them on cached blocks
  s.blocks_free = 70;  // 50 free + 20 cached and evictable
  s.prefix_cached_blocks = 30;
  s.prefix_evictable_blocks = 20;
  const BlockMap m = BlockMapFromStats(s);
  EXPECT_EQ(m.total, 100);
  EXPECT_EQ(m.free, 50);
  EXPECT_EQ(m.cached_evictable, 20);
  EXPECT_EQ(m.pinned, 10);
  EXPECT_EQ(m.running, 20);
  EXPECT_EQ(m.free + m.cached_evictable + m.pinned + m.running, m.total);
}

TEST(BlockMapTest, WithoutPrefixCacheEverythingUsedIsRunning) {
  EngineStats s;
  s.blocks_total = 8;
  s.blocks_used = 3;
  s.blocks_free = 5;
  const BlockMap m = BlockMapFromStats(s);
  EXPECT_EQ(m.running, 3);
  EXPECT_EQ(m.free, 5);
  EXPECT_EQ(m.pinned + m.cached_evictable, 0);
}

TEST(ParseHistogramTest, ReadsBackWhatMetricsRendered) {
  Metrics metrics("m");
  metrics.ObserveTimeToFirstToken(0.003);   // <= 0.005
  metrics.ObserveTimeToFirstToken(0.004);   // <= 0.005
  metrics.ObserveTimeToFirstToken(0.3);     // <= 0.5
  metrics.ObserveTimeToFirstToken(5000.0);  // +Inf
  metrics.ObserveInterTokenLatency(0.02);
  const std::string text = metrics.Render(EngineStats{});
  const HistogramView h = ParseHistogram(text, "kvserve:time_to_first_token_seconds");
  const std::vector<double> bounds = Metrics::TimeToFirstTokenBuckets();
  ASSERT_EQ(h.upper.size(), bounds.size() + 1);
  ASSERT_EQ(h.counts.size(), bounds.size() + 1);
  EXPECT_TRUE(std::isinf(h.upper.back()));
  EXPECT_EQ(h.count, 4u);
  EXPECT_NEAR(h.sum, 5000.307, 1e-6);
  uint64_t total = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    EXPECT_DOUBLE_EQ(h.upper[i], bounds[i]);
    total += h.counts[i];
  }
  EXPECT_EQ(h.counts[1], 2u);  // 0.005
  EXPECT_EQ(h.counts.back(), 1u);
  EXPECT_EQ(total + h.counts.back(), 4u);
  // The other histogram is not mixed in.
  const HistogramView itl = ParseHistogram(text, "kvserve:inter_token_latency_seconds");
  EXPECT_EQ(itl.count, 1u);
}

TEST(DashboardStateTest, ReplicaFollowsEventsAndCountsHits) {
  DashboardState st;
  // Two prefixes of 2-token blocks: [1 2][3 4][5 6] and [1 2][3 4][7 8], and [9 9].
  st.Apply(Events({Stored(10, 0, {1, 2}), Stored(11, 10, {3, 4}), Stored(12, 11, {5, 6}),
                   Stored(13, 11, {7, 8}), Stored(20, 0, {9, 9})},
                  1));
  EXPECT_EQ(st.num_blocks(), 5u);
  EXPECT_EQ(st.last_sequence(), 5u);
  // Three requests used 4 cached tokens of the first prefix, one the second.
  std::vector<RequestBoard::Finished> f;
  for (int i = 0; i < 3; ++i) f.push_back({{1, 2, 3, 4, 5, 6, 42}, "", 4});
  f.push_back({{9, 9, 1}, "", 2});
  f.push_back({{7, 7, 7}, "", 2});  // nothing in the replica: not counted
  st.AccountHits(f, 2);
  EXPECT_EQ(st.hits_accounted(), 4);
  std::vector<PrefixRow> top = st.TopByHits(10, 96);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].hash, 10u);
  EXPECT_EQ(top[0].hits, 3);
  EXPECT_EQ(top[0].blocks, 4);
  EXPECT_EQ(top[0].depth, 2);     // [1 2][3 4], then it branches
  EXPECT_EQ(top[0].branches, 2);
  EXPECT_EQ(top[0].tokens, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(top[1].hash, 20u);
  EXPECT_EQ(top[1].hits, 1);
  EXPECT_EQ(st.TopBySize(1, 96)[0].hash, 10u);

  // Evicting leaves shrinks the subtree; removing the root drops the rest.
  st.Apply(Events({Removed(12), Removed(13)}, 6));
  EXPECT_EQ(st.TopBySize(1, 96)[0].blocks, 2);
  st.Apply(Events({Removed(10)}, 8));
  EXPECT_EQ(st.num_blocks(), 1u);
  ASSERT_EQ(st.TopBySize(10, 96).size(), 1u);
  EXPECT_EQ(st.TopBySize(10, 96)[0].hash, 20u);
}

TEST(DashboardStateTest, SnapshotResetKeepsSurvivingHits) {
  DashboardState st;
  st.Apply(Events({Stored(10, 0, {1, 2}), Stored(20, 0, {3, 4})}, 1));
  st.AccountHits({{{1, 2}, "", 2}, {{1, 2}, "", 2}}, 2);
  KvEventRead snap;
  snap.is_snapshot = true;
  snap.snapshot_sequence = 40;
  snap.snapshot = {Stored(10, 0, {1, 2}), Stored(30, 0, {5, 6})};
  st.Apply(snap);
  EXPECT_EQ(st.last_sequence(), 40u);
  EXPECT_EQ(st.num_blocks(), 2u);
  const auto top = st.TopByHits(10, 96);
  EXPECT_EQ(top[0].hash, 10u);
  EXPECT_EQ(top[0].hits, 2);
  KvCacheEvent clear;
  clear.kind = KvCacheEvent::Kind::kAllCleared;
  st.Apply(Events({clear}, 41));
  EXPECT_EQ(st.num_blocks(), 0u);
  EXPECT_TRUE(st.TopByHits(10, 96).empty());
}

// Random stores and leaf removals against a plain set of live hashes: the
// replica's block count and its subtree sizes always agree.
TEST(DashboardStateTest, RandomEventsKeepTheReplicaConsistent) {
  std::mt19937 rng(7);
  DashboardState st;
  std::map<uint64_t, uint64_t> parent;  // live hash -> parent
  uint64_t next = 1, seq = 1;
  for (int step = 0; step < 3000; ++step) {
    std::vector<KvCacheEvent> ev;
    if (parent.empty() || rng() % 3 != 0) {
      uint64_t p = 0;
      if (!parent.empty() && rng() % 2 == 0) {
        auto it = parent.begin();
        std::advance(it, rng() % parent.size());
        p = it->first;
      }
      const uint64_t h = next++;
      parent[h] = p;
      ev.push_back(Stored(h, p, {static_cast<int32_t>(h), 0}));
    } else {
      // A leaf (no live child).
      std::set<uint64_t> inner;
      for (auto& [h, p] : parent) inner.insert(p);
      for (auto& [h, p] : parent) {
        if (!inner.count(h)) {
          ev.push_back(Removed(h));
          parent.erase(h);
          break;
        }
      }
    }
    st.Apply(Events(std::move(ev), seq++));
    ASSERT_EQ(st.num_blocks(), parent.size()) << "step " << step;
  }
  int64_t roots_total = 0;
  for (const PrefixRow& r : st.TopBySize(1u << 20, 4)) roots_total += r.blocks;
  EXPECT_EQ(roots_total, static_cast<int64_t>(parent.size()));
}

TEST(RequestBoardTest, TracksRequestsAndRecordsFinishedHits) {
  RequestBoard board(2);
  auto a = board.Add({1, 2, 3}, "", 16, 1);
  auto b = board.Add({4, 5}, "s", 8, 2);
  a->request_id = 7;
  RequestBoard::OnEvent(a.get(), 1, 2);
  RequestBoard::OnEvent(a.get(), 1, 3);  // cached_tokens is the first event's
  size_t total = 0;
  auto rows = board.Snapshot(0, &total);
  ASSERT_EQ(total, 2u);
  EXPECT_EQ(rows[0].request_id, 7u);
  EXPECT_TRUE(rows[0].decoding);
  EXPECT_EQ(rows[0].generated, 2);
  EXPECT_EQ(rows[0].cached_tokens, 2);
  EXPECT_FALSE(rows[1].decoding);
  EXPECT_EQ(rows[1].cached_tokens, -1);
  EXPECT_EQ(board.Snapshot(1, &total).size(), 1u);
  board.Remove(a);
  board.Remove(b);  // never had a cached token: not recorded
  board.Remove(a);  // twice is harmless
  EXPECT_EQ(board.Snapshot(0, &total).size(), 0u);
  auto fin = board.TakeFinished();
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(fin[0].cached_tokens, 2);
  EXPECT_TRUE(board.TakeFinished().empty());
  // Bounded: the oldest go.
  for (int i = 0; i < 5; ++i) {
    auto e = board.Add({i}, "", 1, 1);
    RequestBoard::OnEvent(e.get(), 1, 1);
    board.Remove(e);
  }
  fin = board.TakeFinished();
  ASSERT_EQ(fin.size(), 2u);
  EXPECT_EQ(fin[0].prompt[0], 3);
  EXPECT_EQ(board.dropped_finished(), 3);
}

}  // namespace
}  // namespace kvserve
