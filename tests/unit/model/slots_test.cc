// KV slots apart from RoPE positions, and the optional attention mass.
// Slots equal to the positions give the same bits as no slots at all; a
// token's K/V land in its slot while RoPE uses its position; attention
// reaches only slots [0, slot]; and the attention mass is a distribution per
// query head that reporting does not perturb.
#include <cmath>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cache/kv_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "model/llama.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

class SlotsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::TinyLlamaOptions o;
    const std::string path = testing::TempDir() + "/slots-tiny.gguf";
    std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
    model_ = LlamaModel::Load(path).value();
    const LlamaConfig& c = model_->config();
    KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, 4, 16, kernels::KvDType::kF32};
    pool_ = KvPool::Create(po).value();
  }

  // A fresh 4-block sequence (16 slots), its view and the logits of `rows`.
  struct Run {
    std::vector<BlockHandle> blocks;
    std::vector<int32_t> ids;
    int32_t offsets[2] = {0, 4};
  };
  Run NewSeq() {
    Run r;
    EXPECT_TRUE(pool_->Allocate(4, &r.blocks).ok());
    for (const BlockHandle& h : r.blocks) r.ids.push_back(h.id);
    return r;
  }
  std::vector<float> Forward(Run& r, const std::vector<int32_t>& tokens,
                             const std::vector<int32_t>& pos, const std::vector<int32_t>& slots,
                             float* mass = nullptr, int64_t mass_stride = 0) {
    const int n = static_cast<int>(tokens.size());
    std::vector<int32_t> seq(n, 0), rows = {n - 1};
    std::vector<float> logits(model_->config().vocab_size);
    ForwardBatch b{tokens, seq, pos, rows};
    b.slots = slots;
    b.attention_mass = mass;
    b.attention_mass_stride = mass_stride;
    const absl::Status st = model_->Forward(b, pool_->View(r.ids.data(), r.offsets, 1),
                                            logits.data(), &tp_);
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<KvPool> pool_;
  ThreadPool tp_{2};
};

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

const std::vector<int32_t> kTokens = {1, 40, 41, 42, 43, 44, 45, 46};

std::vector<int32_t> Iota(int n, int first = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST_F(SlotsTest, SlotsEqualToPositionsAreTheDefault) {
  Run a = NewSeq(), b = NewSeq();
  const auto p = Iota(8);
  EXPECT_EQ(Forward(a, kTokens, p, {}), Forward(b, kTokens, p, p)) << "bit-identical";
}

TEST_F(SlotsTest, ASequenceThatDroppedTokensKeepsItsPositions) {
  // Reference: tokens 0..4 at positions 0..4, then token 7 at position 7,
  // attending to 0..4 and itself — as if tokens 5 and 6 had been evicted.
  // Built directly: the first five in slots 0..4, the last at position 7 in
  // slot 5.
  Run a = NewSeq();
  const std::vector<int32_t> head(kTokens.begin(), kTokens.begin() + 5);
  Forward(a, head, Iota(5), {});
  const std::vector<float> dropped = Forward(a, {kTokens[7]}, {7}, {5});
  // The same token at position 5 is a different query (RoPE), so the logits
  // must differ: the position is not taken from the slot.
  Run b = NewSeq();
  Forward(b, head, Iota(5), {});
  const std::vector<float> at5 = Forward(b, {kTokens[7]}, {5}, {});
  EXPECT_GT(MaxDiff(dropped, at5), 1e-3f);
  // And a sequence that computed 5 and 6 too attends to them: different
  // again. With their K/V written into slots 5 and 6 of `c` and then
  // "dropped" (token 7 written over slot 5), `c` equals the reference.
  Run c = NewSeq();
  Forward(c, std::vector<int32_t>(kTokens.begin(), kTokens.begin() + 7), Iota(7), {});
  const std::vector<float> full = Forward(c, {kTokens[7]}, {7}, {});
  EXPECT_GT(MaxDiff(full, dropped), 1e-3f);
  const std::vector<float> compacted = Forward(c, {kTokens[7]}, {7}, {5});
  // (Near, not equal: the shared prefix was computed in batches of 5 and 7.)
  EXPECT_LT(MaxDiff(compacted, dropped), 1e-4f) << "slot 6 is not attended; slot 5 holds token 7";
}

TEST_F(SlotsTest, AttentionMassIsADistributionAndChangesNothing) {
  const LlamaConfig& c = model_->config();
  Run a = NewSeq(), b = NewSeq();
  const int64_t stride = 16;
  std::vector<float> mass(static_cast<size_t>(c.n_kv_heads) * stride, 0.0f);
  const auto p = Iota(8);
  const std::vector<float> with = Forward(a, kTokens, p, {}, mass.data(), stride);
  EXPECT_EQ(with, Forward(b, kTokens, p, {})) << "reporting does not perturb the forward";
  // Every query token t attends slots [0, t] with weights summing to 1, per
  // query head and layer: each KV head collects 8 tokens x group x layers.
  const int group = c.n_heads / c.n_kv_heads;
  for (int h = 0; h < c.n_kv_heads; ++h) {
    double total = 0;
    for (int s = 0; s < stride; ++s) {
      const float m = mass[static_cast<size_t>(h) * stride + s];
      EXPECT_GE(m, 0.0f);
      if (s >= 8) {
        EXPECT_EQ(m, 0.0f) << "slot " << s << " was never attended";
      }
      total += m;
    }
    EXPECT_NEAR(total, 8.0 * group * c.n_layers, 1e-3) << "KV head " << h;
  }
  // Slot 0 is attended by all 8 query tokens, slot 7 only by the last.
  EXPECT_GT(mass[0], mass[7]);
}

TEST_F(SlotsTest, BadSlotsAreRejectedWithAMessage) {
  Run a = NewSeq();
  std::vector<int32_t> seq = {0}, rows = {0}, tok = {5}, pos = {3};
  std::vector<float> logits(model_->config().vocab_size);
  ForwardBatch b{tok, seq, pos, rows};
  std::vector<int32_t> far = {16};
  b.slots = far;
  absl::Status s = model_->Forward(b, pool_->View(a.ids.data(), a.offsets, 1), logits.data(), &tp_);
  EXPECT_THAT(std::string(s.message()), HasSubstr("has no KV slot"));
  std::vector<int32_t> two = {0, 1};
  b.slots = two;
  s = model_->Forward(b, pool_->View(a.ids.data(), a.offsets, 1), logits.data(), &tp_);
  EXPECT_THAT(std::string(s.message()), HasSubstr("differ in length"));
  std::vector<float> mass(4);
  std::vector<int32_t> ok = {3};
  b.slots = ok;
  b.attention_mass = mass.data();
  b.attention_mass_stride = 2;
  s = model_->Forward(b, pool_->View(a.ids.data(), a.offsets, 1), logits.data(), &tp_);
  EXPECT_THAT(std::string(s.message()), HasSubstr("attention-mass row"));
}

// The kernel alone: a key that matches the query far better than the rest
// takes almost all of the mass.
TEST(AttentionMassTest, AStrongKeyTakesTheMass) {
  KvPoolOptions po{1, 1, 4, 4, 1, kernels::KvDType::kF32};
  auto pool = KvPool::Create(po).value();
  std::vector<BlockHandle> blocks;
  ASSERT_TRUE(pool->Allocate(1, &blocks).ok());
  const int32_t ids[1] = {blocks[0].id};
  const int32_t offsets[2] = {0, 1};
  const kernels::PagedKvView kv = pool->View(ids, offsets, 1);
  const float k[4][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {10, 0, 0, 0}, {0, 0, 0, 0}};
  const float v[4][4] = {};
  const int32_t seq[4] = {0, 0, 0, 0}, pos[4] = {0, 1, 2, 3};
  kernels::AppendKv(kv, 0, 4, seq, pos, &k[0][0], 4, &v[0][0], 4);
  const float q[4] = {1, 0, 0, 0};
  kernels::AttentionBatch b;
  b.n_tokens = 1;
  const int32_t qseq[1] = {0}, qpos[1] = {3};
  b.token_seq = qseq;
  b.token_pos = qpos;
  b.n_heads = 1;
  b.scale = 1.0f;
  float mass[4] = {0, 0, 0, 0};
  kernels::AccumulateAttentionMass(kv, 0, b, q, 4, mass, 4);
  EXPECT_NEAR(mass[2], 1.0f, 1e-3f);
  EXPECT_NEAR(mass[0] + mass[1] + mass[2] + mass[3], 1.0f, 1e-6f);
  EXPECT_NEAR(mass[0], std::exp(-10.0f) / (3 * std::exp(-10.0f) + 1), 1e-6f);
}

}  // namespace
}  // namespace kvserve
