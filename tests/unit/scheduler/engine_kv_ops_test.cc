// The Engine's named KV operations (scheduler/engine_kv_ops.cc) as a P/D
// prefill lease uses them, on a tiny written model: a prefix pinned with
// PinPrefix outlives an eviction of every cached block, and Unpin gives it
// back, after which the same eviction frees it and the pool is whole again.
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "tests/testing/generate.h"

namespace kvserve {
namespace {

constexpr int32_t kBlock = 16;
constexpr int32_t kBlocks = 64;

class EngineKvOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const testing::WrittenModel& m = testing::TinyWrittenModel("engine-kv-ops", 256);
    EngineOptions o;
    o.block_size = kBlock;
    o.num_blocks = kBlocks;
    o.max_batched_tokens = 256;
    o.prefix_cache = true;
    engine_ = Engine::Create(m.model.get(), m.tokenizer.get(), testing::TestPool(), o).value();
    // 40 tokens: two whole blocks (and a partial one) reach the prefix cache.
    for (int32_t i = 0; i < 40; ++i) prompt_.push_back(3 + (i * 7) % 50);
    EngineRequest r;
    r.prompt = prompt_;
    r.params.temperature = 0;
    r.params.max_tokens = 1;
    r.params.ignore_eos = true;
    ASSERT_TRUE(engine_->Submit(r, [](const SeqEvent&) {}).ok());
    while (engine_->Step()) {
    }
  }

  // PinPrefix waits for the engine thread: this test's thread steps it.
  PinnedPrefix Pin() {
    auto f = std::async(std::launch::async, [this] {
      return engine_->PinPrefix("", prompt_, static_cast<int32_t>(prompt_.size()));
    });
    while (f.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) engine_->Step();
    absl::StatusOr<PinnedPrefix> p = f.get();
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : PinnedPrefix{};
  }

  // Evicts every cached block nobody holds, as pool pressure would.
  void EvictAll() {
    std::future<void> done = engine_->EvictAllCachedForTest();
    engine_->Step();
    done.wait();
  }

  int64_t Cached() const { return engine_->kv_manager().prefix_cache()->num_cached_blocks(); }
  int32_t Free() const { return engine_->kv_pool().num_free_blocks(); }

  std::unique_ptr<Engine> engine_;
  std::vector<int32_t> prompt_;
};

TEST_F(EngineKvOpsTest, UnpinGivesAPinnedPrefixBackToEviction) {
  ASSERT_GE(Cached(), 2);
  PinnedPrefix pin = Pin();
  ASSERT_EQ(pin.blocks.size(), 2u);  // the whole blocks; the pin may hold a partial third
  const int32_t held = pin.held_blocks;
  ASSERT_GE(held, 2);

  // Pinned: an eviction of everything leaves the pinned blocks cached and used.
  EvictAll();
  EXPECT_EQ(Cached(), held);
  EXPECT_EQ(Free(), kBlocks - held);

  // Given back: the same eviction now frees them, and a new pin finds nothing.
  engine_->Unpin(std::move(pin.pin));
  EvictAll();
  EXPECT_EQ(Cached(), 0);
  EXPECT_EQ(Free(), kBlocks);
  PinnedPrefix again = Pin();
  EXPECT_TRUE(again.blocks.empty());
  engine_->Unpin(std::move(again.pin));
  engine_->Step();
  EXPECT_EQ(Free(), kBlocks);
}

TEST_F(EngineKvOpsTest, UnpinOfNothingIsHarmless) {
  engine_->Unpin(nullptr);
  engine_->Step();
  EvictAll();
  EXPECT_EQ(Cached(), 0);
  EXPECT_EQ(Free(), kBlocks);
}

}  // namespace
}  // namespace kvserve
