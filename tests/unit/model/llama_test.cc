// The Llama forward end to end: golden greedy outputs of stories260K (from
// llama.cpp), ragged batches equal to one-at-a-time runs, and tiny fixture
// models written by the tests themselves (run with no ../shared at all).
#include "model/llama.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_pool.h"
#include "kernels/cpu/dispatch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/generate.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

using testing::Golden;
using testing::ReadGolden;

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  return p;
}

struct Engine {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Engine LoadEngine(const std::string& path) {
  Engine e;
  auto m = LlamaModel::Load(path);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return e;
  e.model = std::move(m).value();
  auto t = Tokenizer::FromGguf(e.model->file());
  EXPECT_TRUE(t.ok()) << t.status();
  if (t.ok()) e.tokenizer = std::move(t).value();
  return e;
}

TEST(LlamaGoldenTest, Stories260KReproducesLlamaCppGreedyOutputs) {
  const std::string model_path = testing::Stories260KPath();
  const std::string golden_path = testing::Stories260KGoldenPath();
  KVSERVE_SKIP_IF_MISSING(model_path, "stories260K.gguf");
  KVSERVE_SKIP_IF_MISSING(golden_path, "stories260K golden file");
  Engine e = LoadEngine(model_path);
  ASSERT_TRUE(e.model && e.tokenizer);
  ThreadPool pool(2);
  const std::vector<Golden> golden = ReadGolden(golden_path);
  ASSERT_EQ(golden.size(), 5u);
  for (const Golden& g : golden) {
    std::vector<int32_t> ids = e.tokenizer->Encode(g.prompt, /*add_bos=*/true, false);
    EXPECT_EQ(ids, g.ids) << g.prompt;
    auto out = testing::GenerateAll(e.model.get(), e.tokenizer.get(), &pool, {EngineRequest{g.ids, Greedy(g.max_tokens)}});
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<int32_t> prompt_no_bos(g.ids.begin() + 1, g.ids.end());
    EXPECT_EQ(e.tokenizer->Decode(prompt_no_bos) + (*out)[0].text, g.text) << g.prompt;
    EXPECT_EQ((*out)[0].tokens.size(), static_cast<size_t>(g.max_tokens));
    EXPECT_EQ((*out)[0].finish_reason, "length");
  }
}

// Prompts outside the golden file, with greedy continuations computed by
// llama.cpp (tests/data/make_greedy_reference.py): tokenization and every
// generated id must agree, including stopping at end-of-generation.
TEST(LlamaGoldenTest, GreedyMatchesLlamaCppReferenceOnOtherPrompts) {
  // A top-2 margin below this in llama.cpp's logits is a near-tie. SmolLM2's
  // quantized weights re-quantize activations to 8 bits before every
  // matmul, so rounding-order differences grow through the 30 layers: the
  // panel kernels' per-block expression (shared by VNNI and AMX, closer to
  // exact arithmetic than ggml's order, PanelAccuracyTest) parts from
  // llama.cpp at margins of 0.057, 0.06 and 0.08 on three prompts here.
  // Without the panels (AVX2-only CPUs, or KVSERVE_DISABLE_SIMD: those two
  // give the same tokens here) the per-block order is the plain loop's, which
  // parts from llama.cpp on "def fibonacci(n):" at generated token 13, a
  // margin of 0.334; those paths get a wider band. The AVX2 attention's V
  // accumulation (one FMA chain per output element and block run since
  // 2026-12-04, instead of four position streams) parts on "Here is a list
  // of fruits:" at generated token 2, a margin of 0.197, with perplexity
  // 18.3836 against the four streams' 18.3672 (llama.cpp: 18.3914).
  const float kNearTie = kernels::UseAvx512Vnni() ? 0.2f : 0.35f;
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/greedy_reference.jsonl");
  ASSERT_TRUE(in.good());
  std::map<std::string, Engine> engines;
  const std::map<std::string, std::string> paths = {
      {"stories260K", testing::Stories260KPath()},
      {"SmolLM2-135M-Instruct.Q4_1", testing::SmolLM2Path()}};
  ThreadPool pool(2);
  int checked = 0;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    const std::string model = j["model"];
    if (paths.at(model).empty()) continue;  // that model is absent here
    if (!engines.count(model)) engines[model] = LoadEngine(paths.at(model));
    const Engine& e = engines[model];
    ASSERT_TRUE(e.model && e.tokenizer);
    const auto want_prompt = j["prompt_ids"].get<std::vector<int32_t>>();
    const auto want_out = j["output_ids"].get<std::vector<int32_t>>();
    const std::string prompt = j["prompt"];
    EXPECT_EQ(e.tokenizer->Encode(prompt, j["add_bos"].get<bool>(), true), want_prompt) << prompt;
    auto out = testing::GenerateAll(e.model.get(), e.tokenizer.get(), &pool, {EngineRequest{want_prompt, Greedy(32)}});
    ASSERT_TRUE(out.ok()) << out.status();
    // Compare up to the first near-tie in llama.cpp's own logits: there two
    // correct implementations may legitimately pick differently (llama.cpp
    // itself does between batched and one-token evaluation).
    const auto margins = j["top2_margins"].get<std::vector<float>>();
    size_t sure = 0;
    while (sure < margins.size() && margins[sure] >= kNearTie) ++sure;
    const std::vector<int32_t>& got = (*out)[0].tokens;
    if (sure == want_out.size()) {
      EXPECT_EQ(got, want_out) << model << ": " << prompt;
    } else {
      ASSERT_GE(got.size(), sure) << model << ": " << prompt;
      EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + sure),
                std::vector<int32_t>(want_out.begin(), want_out.begin() + sure))
          << model << ": " << prompt << " (compared " << sure << " tokens before a near-tie)";
    }
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no reference model present";
}

// Runs every request alone, then all together in one ragged batch with a
// small token budget (so prefill is chunked and mixed with decode tokens),
// and expects identical greedy tokens.
void ExpectBatchedEqualsSequential(const Engine& e, const std::vector<std::string>& prompts,
                                   int max_tokens, int32_t budget, int32_t block_size) {
  ThreadPool pool(2);
  std::vector<EngineRequest> reqs;
  for (const auto& p : prompts) {
    reqs.push_back({e.tokenizer->Encode(p, e.tokenizer->add_bos_default(), false),
                    Greedy(max_tokens)});
  }
  std::vector<std::vector<int32_t>> alone;
  for (const auto& r : reqs) {
    auto out = testing::GenerateAll(e.model.get(), e.tokenizer.get(), &pool, {r});
    ASSERT_TRUE(out.ok()) << out.status();
    alone.push_back((*out)[0].tokens);
  }
  testing::GenOptions opts;
  opts.max_batched_tokens = budget;
  opts.block_size = block_size;
  auto together = testing::GenerateAll(e.model.get(), e.tokenizer.get(), &pool, reqs, opts);
  ASSERT_TRUE(together.ok()) << together.status();
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*together)[i].tokens, alone[i]) << "prompt " << i << ": " << prompts[i];
  }
}

const std::vector<std::string>& StoryPrompts() {
  static const std::vector<std::string> p = {
      "Once upon a time", "The little dog", "Lily and Ben went to the park to play with a ball",
      "Sam", "One day, a cat saw a bird in the tree and wanted to catch it but",
      "Tom had a red ball"};
  return p;
}

TEST(LlamaBatchTest, Stories260KRaggedBatchEqualsOneAtATime) {
  const std::string model_path = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model_path, "stories260K.gguf");
  Engine e = LoadEngine(model_path);
  ASSERT_TRUE(e.model);
  ExpectBatchedEqualsSequential(e, StoryPrompts(), 24, /*budget=*/7, /*block_size=*/4);
  ExpectBatchedEqualsSequential(e, StoryPrompts(), 24, /*budget=*/512, /*block_size=*/16);
}

TEST(LlamaBatchTest, SmolLM2RaggedBatchEqualsOneAtATime) {
  const std::string model_path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model_path, "SmolLM2 (run deploy/setup.sh)");
  Engine e = LoadEngine(model_path);
  ASSERT_TRUE(e.model);
  ExpectBatchedEqualsSequential(
      e, {"The capital of France is", "def fibonacci(n):", "Water boils at",
          "A short poem about the sea:\n"},
      12, /*budget=*/5, /*block_size=*/16);
}

TEST(LlamaChatTest, SmolLM2AnswersInEnglish) {
  const std::string model_path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model_path, "SmolLM2 (run deploy/setup.sh)");
  Engine e = LoadEngine(model_path);
  ASSERT_TRUE(e.model);
  auto tmpl = ChatTemplate::FromGguf(e.model->file());
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  auto prompt = tmpl->Render({{"user", "What is the capital of France? Answer in one sentence."}},
                             /*add_generation_prompt=*/true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  ThreadPool pool(2);
  auto out = testing::GenerateAll(e.model.get(), e.tokenizer.get(), &pool, {EngineRequest{e.tokenizer->Encode(*prompt, false, true), Greedy(40)}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT((*out)[0].text, HasSubstr("Paris"));
  EXPECT_EQ((*out)[0].finish_reason, "stop");  // ends its turn with <|im_end|>
}

// --- Tiny fixture models: no ../shared needed. ---------------------------

std::string WriteTiny(const testing::TinyLlamaOptions& o, const std::string& name) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  return path;
}

class TinyModelTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(TinyModelTest, RaggedBatchEqualsOneAtATime) {
  testing::TinyLlamaOptions o;
  o.weight_type = GetParam();
  o.tied_output = GetParam() == GgmlType::kQ8_0;
  Engine e = LoadEngine(WriteTiny(o, std::string("tiny-") + GgmlTypeName(GetParam()) + ".gguf"));
  ASSERT_TRUE(e.model && e.tokenizer);
  ExpectBatchedEqualsSequential(e, {"hello world", "a", "the quick brown fox jumps", "zz top"}, 10,
                                /*budget=*/6, /*block_size=*/4);
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, TinyModelTest,
                         ::testing::Values(GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16,
                                           GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1),
                         [](const auto& info) { return std::string(GgmlTypeName(info.param)); });

TEST(LlamaForwardTest, ChunkedPrefillGivesTheSameLogitsAsOnePass) {
  testing::TinyLlamaOptions o;
  Engine e = LoadEngine(WriteTiny(o, "tiny-chunk.gguf"));
  ASSERT_TRUE(e.model);
  const LlamaConfig& c = e.model->config();
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, 4, 8, kernels::KvDType::kF32};
  auto pool_a = KvPool::Create(po).value();
  auto pool_b = KvPool::Create(po).value();
  std::vector<BlockHandle> blocks_a, blocks_b;
  ASSERT_TRUE(pool_a->Allocate(8, &blocks_a).ok());
  ASSERT_TRUE(pool_b->Allocate(8, &blocks_b).ok());
  std::vector<int32_t> ids_a, ids_b;
  for (const BlockHandle& h : blocks_a) ids_a.push_back(h.id);
  for (const BlockHandle& h : blocks_b) ids_b.push_back(h.id);
  const int32_t offsets[2] = {0, 8};
  const std::vector<int32_t> tokens = {1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49};
  const int n = static_cast<int>(tokens.size());
  ThreadPool tp(2);
  std::vector<float> one(c.vocab_size), chunked(c.vocab_size);
  {
    std::vector<int32_t> seq(n, 0), pos(n), rows = {n - 1};
    for (int i = 0; i < n; ++i) pos[i] = i;
    ASSERT_TRUE(e.model->Forward({tokens, seq, pos, rows}, pool_a->View(ids_a.data(), offsets, 1),
                                 one.data(), &tp).ok());
  }
  for (int start = 0; start < n; start += 3) {
    const int len = std::min(3, n - start);
    std::vector<int32_t> t(tokens.begin() + start, tokens.begin() + start + len), seq(len, 0),
        pos(len), rows;
    for (int i = 0; i < len; ++i) pos[i] = start + i;
    if (start + len == n) rows = {len - 1};
    ASSERT_TRUE(e.model->Forward({t, seq, pos, rows}, pool_b->View(ids_b.data(), offsets, 1),
                                 chunked.data(), &tp).ok());
  }
  for (int v = 0; v < c.vocab_size; ++v) EXPECT_NEAR(one[v], chunked[v], 1e-4f) << v;
}

// Batch invariance, bit for bit: a row's logits are the same whatever else
// shares its forward pass. Seeded sampling (and speculation, which changes
// who batches with whom) relies on it: a last-bit difference can move a
// draw across a token boundary. ffn_dim 103 is not a multiple of 8, so a
// flattened element-wise op with a scalar tail would break it.
TEST(LlamaForwardTest, ARowsLogitsDoNotDependOnWhatItIsBatchedWith) {
  testing::TinyLlamaOptions o;
  o.ffn_dim = 103;
  Engine e = LoadEngine(WriteTiny(o, "tiny-ffn103.gguf"));
  ASSERT_TRUE(e.model);
  const LlamaConfig& c = e.model->config();
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, 4, 32, kernels::KvDType::kF32};
  const std::vector<int32_t> prompt = {1, 40, 41, 42, 43, 44, 45};
  const int n = static_cast<int>(prompt.size());
  ThreadPool tp(3);
  // Sequence 0 is the one watched; 1..k run alongside it (k = 0 alone).
  auto logits_of_seq0 = [&](int k) {
    auto pool = KvPool::Create(po).value();
    std::vector<BlockHandle> blocks;
    EXPECT_TRUE(pool->Allocate(4 * (k + 1), &blocks).ok());
    std::vector<int32_t> ids, offsets;
    for (const BlockHandle& h : blocks) ids.push_back(h.id);
    for (int s = 0; s <= k + 1; ++s) offsets.push_back(4 * s);  // k + 2 bounds
    std::vector<float> out(static_cast<size_t>(c.vocab_size) * (k + 1));
    // Prefill: every sequence's prompt (the others' shifted by one token).
    std::vector<int32_t> t, seq, pos, rows;
    for (int s = k; s >= 0; --s) {
      for (int i = 0; i < n; ++i) {
        t.push_back(prompt[i] + (s > 0 ? 1 + s : 0));
        seq.push_back(s);
        pos.push_back(i);
      }
      rows.push_back(static_cast<int32_t>(t.size()) - 1);
    }
    auto kv = pool->View(ids.data(), offsets.data(), k + 1);
    absl::Status st = e.model->Forward({t, seq, pos, rows}, kv, out.data(), &tp);
    EXPECT_TRUE(st.ok()) << st;
    // Then decode steps, sequence 0 last in the batch; its logits of
    // every step are kept.
    std::vector<float> kept;
    for (int step = 0; step < 8; ++step) {
      t.clear(), seq.clear(), pos.clear(), rows.clear();
      for (int s = k; s >= 0; --s) {
        t.push_back(50 + step);
        seq.push_back(s);
        pos.push_back(n + step);
        rows.push_back(static_cast<int32_t>(t.size()) - 1);
      }
      st = e.model->Forward({t, seq, pos, rows}, kv, out.data(), &tp);
      EXPECT_TRUE(st.ok()) << st;
      kept.insert(kept.end(), out.begin() + static_cast<int64_t>(k) * c.vocab_size,
                  out.begin() + static_cast<int64_t>(k + 1) * c.vocab_size);
    }
    return kept;
  };
  const std::vector<float> alone = logits_of_seq0(0);
  for (int k : {1, 2, 4, 5}) {
    const std::vector<float> batched = logits_of_seq0(k);
    ASSERT_EQ(batched.size(), alone.size());
    EXPECT_EQ(std::memcmp(batched.data(), alone.data(), alone.size() * sizeof(float)), 0)
        << "logits changed when batched with " << k << " other sequences";
  }
}

TEST(LlamaForwardTest, BadBatchesAreRejectedWithAMessage) {
  testing::TinyLlamaOptions o;
  Engine e = LoadEngine(WriteTiny(o, "tiny-bad.gguf"));
  ASSERT_TRUE(e.model);
  const LlamaConfig& c = e.model->config();
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, 4, 2, kernels::KvDType::kF32};
  auto pool = KvPool::Create(po).value();
  std::vector<BlockHandle> blocks;
  ASSERT_TRUE(pool->Allocate(2, &blocks).ok());
  const int32_t ids[2] = {blocks[0].id, blocks[1].id};
  const int32_t offsets[2] = {0, 2};
  auto view = pool->View(ids, offsets, 1);
  std::vector<float> logits(c.vocab_size);
  ThreadPool tp(1);
  std::vector<int32_t> seq = {0}, pos = {0}, rows = {0};
  std::vector<int32_t> bad_token = {c.vocab_size};
  absl::Status s = e.model->Forward({bad_token, seq, pos, rows}, view, logits.data(), &tp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("outside the vocabulary"));
  std::vector<int32_t> tok = {5}, far = {8};  // capacity is 2 blocks x 4 = 8 slots
  s = e.model->Forward({tok, seq, far, rows}, view, logits.data(), &tp);
  EXPECT_THAT(std::string(s.message()), HasSubstr("has no KV slot"));
  std::vector<int32_t> other_seq = {1};
  s = e.model->Forward({tok, other_seq, pos, rows}, view, logits.data(), &tp);
  EXPECT_THAT(std::string(s.message()), HasSubstr("outside the KV view"));
}

TEST(LlamaLoadTest, MissingTensorIsNamed) {
  testing::GgufWriter w;
  testing::TinyLlamaOptions o;
  // Re-serialize a tiny model without blk.1.ffn_up.weight.
  const std::string full = testing::MakeTinyLlamaGguf(o);
  auto parsed = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(full.data()), full.size());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (const std::string& key : (*parsed)->Keys()) {
    auto type = (*parsed)->TypeOf(key);
    if (*type == GgufValueType::kString) w.SetString(key, *(*parsed)->GetString(key));
    else if (*type == GgufValueType::kFloat32) w.SetF32(key, *(*parsed)->GetF32(key));
    else if (*type == GgufValueType::kBool) w.SetBool(key, *(*parsed)->GetBool(key));
    else if (*type == GgufValueType::kArray) {
      if (auto s = (*parsed)->GetStringArray(key); s.ok()) w.SetStringArray(key, *s);
      else if (auto f = (*parsed)->GetF32Array(key); f.ok()) w.SetF32Array(key, *f);
      else if (auto i = (*parsed)->GetI32Array(key); i.ok()) w.SetI32Array(key, *i);
    } else {
      w.SetU32(key, static_cast<uint32_t>(*(*parsed)->GetI64(key)));
    }
  }
  for (const auto& t : (*parsed)->tensors()) {
    if (t.name == "blk.1.ffn_up.weight") continue;
    w.AddTensor(t.name, t.type, t.shape,
                std::string(reinterpret_cast<const char*>(t.data), t.n_bytes));
  }
  const std::string path = testing::TempDir() + "/tiny-missing.gguf";
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto m = LlamaModel::Load(path);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("blk.1.ffn_up.weight"));
}

TEST(LlamaLoadTest, UnsupportedArchitectureIsNamed) {
  testing::GgufWriter w;
  w.SetString("general.architecture", "qwen2");
  const std::string path = testing::TempDir() + "/qwen.gguf";
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto m = LlamaModel::Load(path);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("qwen2"));
}

TEST(LlamaLoadTest, NonexistentFileIsAnError) {
  auto m = LlamaModel::Load("/nonexistent/model.gguf");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("/nonexistent/model.gguf"));
}

}  // namespace
}  // namespace kvserve
