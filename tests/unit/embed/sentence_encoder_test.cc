// SentenceEncoder on the real all-MiniLM-L6-v2 (fetched by deploy/setup.sh
// into models/all-MiniLM-L6-v2; tests that need it skip when absent):
// token ids equal Hugging Face's and embeddings match sentence-transformers
// (tests/data/embed_reference.jsonl, made by
// tests/data/make_embed_reference.py) within the stated cosine tolerance;
// concurrent calls agree with serial ones; bad model directories and bad
// text give clear errors.
#include "embed/sentence_encoder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

namespace fs = std::filesystem;

// Every reference sentence must reach this cosine similarity with
// sentence-transformers' float32 PyTorch embedding. Measured: 1 - 5e-13 at worst;
// 1e-6 still catches e.g. the tanh GELU approximation (1 - 6e-6).
constexpr double kMinCosine = 0.999999;
// With F16 layer weights (SentenceEncoderOptions::weight_type).
constexpr double kMinCosineF16 = 0.99999;  // measured 1 - 4.5e-7

std::string ModelDir() {
  const char* env = std::getenv("KVSERVE_MODEL_DIR");
  const std::string base = env != nullptr ? env : std::string(KVSERVE_SOURCE_DIR) + "/models";
  const std::string dir = base + "/all-MiniLM-L6-v2";
  return fs::exists(dir + "/model.safetensors") ? dir : "";
}

#define SKIP_WITHOUT_MODEL(dir)                                                             \
  do {                                                                                      \
    if ((dir).empty())                                                                      \
      GTEST_SKIP() << "models/all-MiniLM-L6-v2 not found; run deploy/setup.sh to fetch it"; \
  } while (0)

struct Reference {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<float> embedding;
};

std::vector<Reference> ReadReference(const std::string& name = "embed_reference.jsonl") {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/" + name);
  std::vector<Reference> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("meta")) continue;
    out.push_back({j.at("text").get<std::string>(), j.at("ids").get<std::vector<int32_t>>(),
                   j.value("embedding", std::vector<float>{})});
  }
  return out;
}

double Cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

class SentenceEncoderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = ModelDir();
    if (dir.empty()) return;
    auto e = SentenceEncoder::Load(dir);
    ASSERT_TRUE(e.ok()) << e.status();
    encoder_ = std::move(*e).release();
  }
  static void TearDownTestSuite() {
    delete encoder_;
    encoder_ = nullptr;
  }
  void SetUp() override { SKIP_WITHOUT_MODEL(ModelDir()); }
  static SentenceEncoder* encoder_;
};
SentenceEncoder* SentenceEncoderTest::encoder_ = nullptr;

TEST(EmbedReferenceTest, CoversEnoughSentences) {
  const auto ref = ReadReference();
  EXPECT_GE(ref.size(), 40u);
  size_t truncated = 0;
  for (const auto& r : ref) truncated += r.ids.size() == 256;
  EXPECT_GE(truncated, 3u) << "the reference must exercise truncation to max_seq_length";
}

TEST_F(SentenceEncoderTest, ShapeAndConfig) {
  EXPECT_EQ(encoder_->dim(), 384);
  EXPECT_EQ(encoder_->max_seq_length(), 256);
  EXPECT_EQ(encoder_->fingerprint().rfind("kvserve-bert-mean-v1:", 0), 0u)
      << encoder_->fingerprint();
}

TEST_F(SentenceEncoderTest, TokenIdsMatchHuggingFace) {
  for (const auto& r : ReadReference()) {
    auto ids = encoder_->Tokenize(r.text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, r.ids) << "text: " << r.text;
  }
}

// 400 random strings over many scripts, combining marks, controls, spaces,
// emoji, special-token text and arbitrary codepoints
// (tests/data/embed_tokenizer_fuzz.jsonl, same generator script).
TEST_F(SentenceEncoderTest, TokenIdsMatchHuggingFaceOnRandomText) {
  const auto fuzz = ReadReference("embed_tokenizer_fuzz.jsonl");
  ASSERT_GE(fuzz.size(), 400u);
  int mismatches = 0;
  for (const auto& r : fuzz) {
    auto ids = encoder_->Tokenize(r.text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (*ids != r.ids && ++mismatches <= 5) {
      ADD_FAILURE() << "ids differ from Hugging Face for text (JSON): "
                    << nlohmann::json(r.text).dump();
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(SentenceEncoderTest, EmbeddingsMatchSentenceTransformers) {
  double worst = 2.0;
  std::string worst_text;
  for (const auto& r : ReadReference()) {
    auto v = encoder_->Embed(r.text);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->size(), 384u);
    double norm = 0;
    for (float x : *v) norm += static_cast<double>(x) * x;
    EXPECT_NEAR(norm, 1.0, 1e-5) << r.text;
    const double c = Cosine(*v, r.embedding);
    EXPECT_GE(c, kMinCosine) << "text: " << r.text;
    if (c < worst) worst = c, worst_text = r.text;
  }
  std::printf("[ info ] lowest cosine vs sentence-transformers: 1 - %.3g (text: \"%.40s\")\n",
              1.0 - worst, worst_text.c_str());
}

TEST_F(SentenceEncoderTest, F16WeightsStayCloseToTheReference) {
  SentenceEncoderOptions options;
  options.weight_type = kernels::DType::kF16;
  auto f16 = SentenceEncoder::Load(ModelDir(), options);
  ASSERT_TRUE(f16.ok()) << f16.status();
  EXPECT_NE((*f16)->fingerprint(), encoder_->fingerprint());
  double worst = 2.0;
  for (const auto& r : ReadReference()) {
    auto v = (*f16)->Embed(r.text);
    ASSERT_TRUE(v.ok()) << v.status();
    const double c = Cosine(*v, r.embedding);
    EXPECT_GE(c, kMinCosineF16) << "text: " << r.text;
    worst = std::min(worst, c);
  }
  std::printf("[ info ] F16 weights: lowest cosine vs sentence-transformers: 1 - %.3g\n",
              1.0 - worst);
}

TEST_F(SentenceEncoderTest, SimilarSentencesScoreHigherThanUnrelated) {
  auto a = encoder_->Embed("What is the capital of France?");
  auto b = encoder_->Embed("Tell me the capital city of France.");
  auto c = encoder_->Embed("The quick brown fox jumps over the lazy dog.");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_GT(Cosine(*a, *b), Cosine(*a, *c) + 0.3);
}

TEST_F(SentenceEncoderTest, ConcurrentCallsAgreeWithSerial) {
  const auto ref = ReadReference();
  std::vector<std::vector<float>> serial;
  for (size_t i = 0; i < 12; ++i) serial.push_back(*encoder_->Embed(ref[i].text));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 2; ++round) {
        for (size_t i = 0; i < serial.size(); ++i) {
          auto v = encoder_->Embed(ref[i].text);
          if (!v.ok() || *v != serial[i]) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST_F(SentenceEncoderTest, InvalidUtf8IsInvalidArgument) {
  auto v = encoder_->Embed("caf\xc3");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("not valid UTF-8"), std::string::npos) << v.status();
  // The encoder is undisturbed.
  EXPECT_TRUE(encoder_->Embed("cafe").ok());
}

TEST(SentenceEncoderLoadTest, MissingDirectoryIsNotFound) {
  auto e = LoadSentenceEncoder("/nonexistent/all-MiniLM-L6-v2");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("/nonexistent/all-MiniLM-L6-v2"), std::string::npos);
  EXPECT_NE(e.status().message().find("does not exist"), std::string::npos) << e.status();
}

// A scratch copy of the model directory with one file replaced or removed.
class BrokenModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = ModelDir();
    SKIP_WITHOUT_MODEL(src_);
    dir_ = fs::temp_directory_path() / ("kvserve_embed_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "1_Pooling");
    for (const char* f :
         {"config.json", "tokenizer.json", "sentence_bert_config.json", "1_Pooling/config.json"}) {
      fs::copy_file(fs::path(src_) / f, dir_ / f);
    }
    fs::create_symlink(fs::path(src_) / "model.safetensors", dir_ / "model.safetensors");
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void Write(const std::string& name, const std::string& bytes) {
    fs::remove(dir_ / name);
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
  }
  std::string src_;
  fs::path dir_;
};

TEST_F(BrokenModelDirTest, IntactCopyLoads) {
  auto e = LoadSentenceEncoder(dir_.string());
  EXPECT_TRUE(e.ok()) << e.status();
}

TEST_F(BrokenModelDirTest, MissingWeightsNameTheFile) {
  fs::remove(dir_ / "model.safetensors");
  auto e = LoadSentenceEncoder(dir_.string());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("lacks model.safetensors"), std::string::npos) << e.status();
}

TEST_F(BrokenModelDirTest, TruncatedWeightsAreInvalidArgument) {
  std::ifstream in(fs::path(src_) / "model.safetensors", std::ios::binary);
  std::string head(1 << 20, '\0');
  in.read(head.data(), head.size());
  Write("model.safetensors", head);
  auto e = LoadSentenceEncoder(dir_.string());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("truncated?"), std::string::npos) << e.status();
}

TEST_F(BrokenModelDirTest, WrongShapesInConfigAreInvalidArgument) {
  Write("config.json", R"({"model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
    "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
    "max_position_embeddings": 512})");
  auto e = LoadSentenceEncoder(dir_.string());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("expected [30522, 768]"), std::string::npos) << e.status();
}

TEST_F(BrokenModelDirTest, UnsupportedPoolingIsInvalidArgument) {
  Write("1_Pooling/config.json",
        R"({"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false})");
  auto e = LoadSentenceEncoder(dir_.string());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("pooling_mode_cls_token"), std::string::npos) << e.status();
}

TEST_F(BrokenModelDirTest, FingerprintFollowsContent) {
  auto a = LoadSentenceEncoder(dir_.string());
  ASSERT_TRUE(a.ok()) << a.status();
  Write("sentence_bert_config.json", R"({"max_seq_length": 128, "do_lower_case": false})");
  auto b = LoadSentenceEncoder(dir_.string());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE((*a)->fingerprint(), (*b)->fingerprint());
}

}  // namespace
}  // namespace kvserve::embed
