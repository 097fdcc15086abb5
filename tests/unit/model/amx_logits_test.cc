// Whole-model logits with the AMX matmul route against the VNNI route: every
// logit bit-identical, for a prefill of 1, 7 and 32 tokens and the decode
// step after it, on written Q8_0/Q4_0/Q4_1 models (no ../shared needed) and
// SmolLM2 Q4_1. The AMX route runs on the hardware tiles where the CPU has
// them, and always on their software model (matmul_amx_emu.cc), with the
// token threshold at 1 so every matmul of the forward takes it.
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_pool.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dispatch.h"
#include "model/llama.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using kernels::AmxKernel;

// Logits of every row of a `n`-token prefill, then of one decode token.
std::vector<float> PrefillAndStepLogits(LlamaModel* model, int32_t n, ThreadPool* tp) {
  const LlamaConfig& c = model->config();
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, /*block_size=*/16, /*n_blocks=*/4,
                  kernels::KvDType::kF16};
  std::unique_ptr<KvPool> pool = KvPool::Create(po).value();
  std::vector<BlockHandle> blocks;
  EXPECT_TRUE(pool->Allocate(3, &blocks).ok());  // 48 slots
  std::vector<int32_t> ids;
  for (const BlockHandle& h : blocks) ids.push_back(h.id);
  int32_t offsets[2] = {0, 3};
  const kernels::PagedKvView kv = pool->View(ids.data(), offsets, 1);

  std::vector<float> all;
  auto run = [&](const std::vector<int32_t>& tokens, int32_t first_pos) {
    const int32_t m = static_cast<int32_t>(tokens.size());
    std::vector<int32_t> seq(m, 0), pos(m), rows(m);
    for (int32_t i = 0; i < m; ++i) {
      pos[i] = first_pos + i;
      rows[i] = i;
    }
    std::vector<float> logits(static_cast<size_t>(m) * c.vocab_size);
    const ForwardBatch b{tokens, seq, pos, rows};
    const absl::Status st = model->Forward(b, kv, logits.data(), tp);
    EXPECT_TRUE(st.ok()) << st;
    all.insert(all.end(), logits.begin(), logits.end());
  };
  std::vector<int32_t> prompt(n);
  for (int32_t i = 0; i < n; ++i) prompt[i] = 1 + (i * 37 + 11) % (c.vocab_size - 1);
  run(prompt, 0);
  run({static_cast<int32_t>((n * 53) % c.vocab_size)}, n);
  return all;
}

void ExpectAmxLogitsEqualVnni(LlamaModel* model) {
  if (!kernels::UseAvx512Vnni()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU: no panel kernels";
  ThreadPool tp(2);
  for (int32_t n : {1, 7, 32}) {
    std::vector<float> vnni;
    {
      kernels::ScopedAmxForTesting off(AmxKernel::kOff, 1);
      vnni = PrefillAndStepLogits(model, n, &tp);
    }
    std::vector<AmxKernel> kinds = {AmxKernel::kEmulated};
    if (kernels::UseAmx()) kinds.push_back(AmxKernel::kHardware);
    for (AmxKernel k : kinds) {
      kernels::ScopedAmxForTesting on(k, 1);
      const std::vector<float> amx = PrefillAndStepLogits(model, n, &tp);
      ASSERT_EQ(amx.size(), vnni.size());
      size_t first = amx.size();
      for (size_t i = 0; i < amx.size() && first == amx.size(); ++i) {
        if (std::memcmp(&amx[i], &vnni[i], sizeof(float)) != 0) first = i;
      }
      EXPECT_EQ(first, amx.size())
          << (k == AmxKernel::kHardware ? "hardware" : "emulated") << " AMX, " << n
          << "-token prefill: logit " << first << " differs ("
          << (first < amx.size() ? amx[first] : 0.0f) << " vs "
          << (first < amx.size() ? vnni[first] : 0.0f) << ")";
    }
  }
  if (!kernels::UseAmx()) {
    std::cout << "[ NOTE     ] no usable AMX here: the AMX route ran on emulated tiles only\n";
  }
}

class AmxLogitsTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(AmxLogitsTest, WrittenModelLogitsBitIdentical) {
  testing::TinyLlamaOptions o;
  o.weight_type = GetParam();
  o.dim = 96;       // three blocks per row: an odd block count
  o.ffn_dim = 160;  // five blocks, and ten 16-row panels
  o.tied_output = GetParam() == GgmlType::kQ4_0;
  const std::string path =
      testing::TempDir() + "/amx-tiny-" + GgmlTypeName(GetParam()) + ".gguf";
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  auto model = LlamaModel::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  if (kernels::UseAvx512Vnni()) EXPECT_GT((*model)->packed_bytes(), 0);
  ExpectAmxLogitsEqualVnni(model->get());
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, AmxLogitsTest,
                         ::testing::Values(GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1),
                         [](const auto& info) { return std::string(GgmlTypeName(info.param)); });

TEST(AmxLogitsTest, SmolLM2LogitsBitIdentical) {
  const std::string path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(path, "SmolLM2 (run deploy/setup.sh)");
  auto model = LlamaModel::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectAmxLogitsEqualVnni(model->get());
}

}  // namespace
}  // namespace kvserve
