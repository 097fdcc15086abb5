// Randomized property test of KvPool + BlockTable against a reference model:
// thousands of operations (new sequence, fork, reserve, write, free, cancel
// mid-way, exhaust the pool), with every invariant checked after each one.
// The content check reads each sequence back through its own blocks, so a
// copy-on-write bug (a fork's write showing up in its sibling) fails here.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/block_table.h"
#include "cache/kv_pool.h"
#include "gtest/gtest.h"
#include "tests/unit/cache/kv_pattern.h"

namespace kvserve {
namespace {

// One live sequence: its table, plus what the reference model says it holds.
struct Sequence {
  explicit Sequence(KvPool* pool) : table(pool) {}
  BlockTable table;
  std::vector<uint32_t> written;  // value of each written token, by position
  int32_t pending = 0;            // reserved, not yet written (slots follow `written`)
};

struct PropertyParam {
  int32_t block_size;
  int32_t n_blocks;
  uint32_t seed;
};

class CachePropertyTest : public ::testing::TestWithParam<PropertyParam> {
 protected:
  void SetUp() override {
    const PropertyParam p = GetParam();
    KvPoolOptions o;
    o.n_layers = 2;
    o.n_kv_heads = 2;
    o.head_dim = 2;
    o.block_size = p.block_size;
    o.n_blocks = p.n_blocks;
    pool_ = KvPool::Create(o).value();
    rng_.seed(p.seed);
    max_tokens_ =
        6 * p.block_size + 3;  // long enough to span blocks, short enough to cycle the pool
  }

  int32_t Uniform(int32_t lo, int32_t hi) {  // inclusive
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng_);
  }

  // Reserve through the table and, on success, check BlocksNeeded was exact;
  // on failure, check nothing moved.
  void Reserve(Sequence& s, int32_t n) {
    const int32_t predicted = s.table.BlocksNeeded(n);
    const int32_t free_before = pool_->num_free_blocks();
    const std::vector<BlockHandle> blocks_before = s.table.blocks();
    const int32_t tokens_before = s.table.num_tokens();
    const absl::Status st = s.table.Reserve(n);
    if (st.ok()) {
      ASSERT_EQ(free_before - pool_->num_free_blocks(), predicted) << "Reserve(" << n << ")";
      // More blocks taken than new ones appended means the shared last block was copied.
      if (predicted > s.table.num_blocks() - static_cast<int32_t>(blocks_before.size())) ++copies_;
      s.pending += n;
      return;
    }
    ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    ASSERT_GT(predicted, free_before);
    ASSERT_EQ(pool_->num_free_blocks(), free_before);
    ASSERT_EQ(s.table.blocks(), blocks_before);
    ASSERT_EQ(s.table.num_tokens(), tokens_before);
    ++exhausted_;
  }

  // Writes the pending slots, as the model would after Reserve.
  void Write(Sequence& s) {
    for (; s.pending > 0; --s.pending) {
      const int32_t pos = static_cast<int32_t>(s.written.size());
      testing_kv::WriteToken(*pool_, s.table, pos, next_value_);
      s.written.push_back(next_value_++);
    }
  }

  void Free(size_t i) {
    seqs_[i]->table.Release();
    seqs_[i] = std::move(seqs_.back());
    seqs_.pop_back();
  }

  void Step(int op_index) {
    const int kind = Uniform(0, 99);
    if (seqs_.empty() || kind < 10) {  // admit a new sequence
      if (seqs_.size() < kMaxSequences) seqs_.push_back(std::make_unique<Sequence>(pool_.get()));
      return;
    }
    const size_t i = static_cast<size_t>(Uniform(0, static_cast<int32_t>(seqs_.size()) - 1));
    Sequence& s = *seqs_[i];
    if (kind < 22) {  // fork (n > 1 samples); pending slots are written first, as the engine forks
                      // after a step
      if (seqs_.size() >= kMaxSequences) return;
      Write(s);
      auto child = std::make_unique<Sequence>(pool_.get());
      child->table = s.table.Fork();
      child->written = s.written;
      seqs_.push_back(std::move(child));
    } else if (kind < 62) {  // reserve (and usually write) a few tokens
      const int32_t room = max_tokens_ - s.table.num_tokens();
      if (room <= 0) return Free(i);  // finished: length reached
      const int32_t n = std::min(
          room, Uniform(0, 3) == 0 ? Uniform(1, 3 * GetParam().block_size) : Uniform(1, 2));
      Reserve(s, n);
      if (Uniform(0, 3) != 0) Write(s);
    } else if (kind < 80) {  // write whatever is reserved
      Write(s);
    } else if (kind < 88) {  // finish normally
      Write(s);
      Free(i);
    } else if (kind < 95) {  // cancel mid-way, reserved slots unwritten
      Free(i);
    } else {  // exhaust: ask for more than the whole pool holds
      Reserve(s, (pool_->num_blocks() + 1) * GetParam().block_size);
    }
    (void)op_index;
  }

  void CheckInvariants(int op_index) {
    SCOPED_TRACE(absl::StrCat("after operation ", op_index));
    std::map<int32_t, int32_t> holders;  // block id -> live tables holding it
    for (const auto& s : seqs_) {
      std::set<int32_t> own;
      for (const BlockHandle& h : s->table.blocks()) {
        ASSERT_TRUE(pool_->IsLive(h)) << "table holds dead block " << h.id;
        ASSERT_TRUE(own.insert(h.id).second) << "table holds block " << h.id << " twice";
        ++holders[h.id];
      }
      const int32_t bs = pool_->block_size();
      const int32_t tokens = static_cast<int32_t>(s->written.size()) + s->pending;
      ASSERT_EQ(s->table.num_tokens(), tokens);
      ASSERT_EQ(s->table.num_blocks(), (tokens + bs - 1) / bs);
    }
    for (const auto& s : seqs_) {
      for (const BlockHandle& h : s->table.blocks()) {
        ASSERT_EQ(pool_->ref_count(h), holders[h.id]) << "block " << h.id;
      }
    }
    ASSERT_EQ(pool_->num_free_blocks(), pool_->num_blocks() - static_cast<int32_t>(holders.size()));
    for (size_t i = 0; i < seqs_.size(); ++i) {
      const Sequence& s = *seqs_[i];
      for (size_t pos = 0; pos < s.written.size(); ++pos) {
        ASSERT_TRUE(
            testing_kv::TokenHolds(*pool_, s.table, static_cast<int32_t>(pos), s.written[pos]))
            << "sequence " << i << " token " << pos << " lost value " << s.written[pos];
      }
    }
  }

  static constexpr size_t kMaxSequences = 12;
  std::unique_ptr<KvPool> pool_;
  std::mt19937 rng_;
  int32_t max_tokens_ = 0;
  uint32_t next_value_ = 1;
  int exhausted_ = 0;
  int copies_ = 0;
  std::vector<std::unique_ptr<Sequence>> seqs_;
};

TEST_P(CachePropertyTest, RandomOperationsKeepCountsAndContentsExact) {
  constexpr int kOps = 5000;
  std::vector<BlockHandle> every_handle_seen;
  for (int op = 0; op < kOps; ++op) {
    ASSERT_NO_FATAL_FAILURE(Step(op));
    ASSERT_NO_FATAL_FAILURE(CheckInvariants(op));
    for (const auto& s : seqs_) {
      if (!s->table.blocks().empty()) every_handle_seen.push_back(s->table.blocks().back());
    }
  }
  // The run must actually have hit the interesting paths.
  EXPECT_GT(exhausted_, 0);
  // With blocks of one token no block is ever partial, so nothing is copied.
  if (GetParam().block_size > 1) {
    EXPECT_GT(copies_, 0);
  }
  while (!seqs_.empty()) Free(seqs_.size() - 1);
  EXPECT_EQ(pool_->num_free_blocks(), pool_->num_blocks());
  for (const BlockHandle& h : every_handle_seen) ASSERT_FALSE(pool_->IsLive(h));
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, CachePropertyTest,
                         ::testing::Values(PropertyParam{1, 48, 1}, PropertyParam{4, 24, 2},
                                           PropertyParam{16, 16, 3}, PropertyParam{4, 24, 4}),
                         [](const auto& info) {
                           return absl::StrCat("BlockSize", info.param.block_size, "Seed",
                                               info.param.seed);
                         });

}  // namespace
}  // namespace kvserve
