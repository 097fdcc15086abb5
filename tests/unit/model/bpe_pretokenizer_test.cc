// The llama-bpe (Llama 3) and qwen2 pre-tokenizers against an independent
// implementation: tests/data/make_bpe_reference.py (the models' regexes in
// Python's `regex` module plus textbook BPE, itself checked against
// llama.cpp's test vectors for these vocabularies) wrote the expected ids.
// The vocabularies are llama.cpp's vocab-only GGUFs, which deploy/setup.sh
// --models all fetches; without them the tests skip.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

class BpePreTokenizerTest : public ::testing::TestWithParam<const char*> {};

TEST_P(BpePreTokenizerTest, MatchesIndependentReference) {
  const std::string name = GetParam();
  const std::string path = testing::ModelDirFile("ggml-vocab-" + name + ".gguf");
  KVSERVE_SKIP_IF_MISSING(path, "ggml-vocab-" + name + ".gguf");
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/tokenizer_reference_" + name +
                   ".jsonl");
  ASSERT_TRUE(in.good());
  std::string line;
  size_t n = 0, mismatches = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string text = j.at("text").get<std::string>();
    const std::vector<int32_t> want = j.at("ids").get<std::vector<int32_t>>();
    const std::vector<int32_t> got = (*tok)->Encode(text, /*add_bos=*/false, /*parse_special=*/false);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << name << ": \"" << text << "\"\n  got  " << ::testing::PrintToString(got)
                    << "\n  want " << ::testing::PrintToString(want);
    }
    // Byte-level BPE is lossless.
    EXPECT_EQ((*tok)->Decode(got), text);
    ++n;
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GE(n, 60u);
}

INSTANTIATE_TEST_SUITE_P(Families, BpePreTokenizerTest, ::testing::Values("llama-bpe", "qwen2"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (c == '-') c = '_';
                           }
                           return s;
                         });

// An unknown pre-tokenizer is refused by name, not tokenized wrongly.
TEST(BpePreTokenizerTest, UnknownPreTokenizerIsRefusedByName) {
  testing::GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "tekken");
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "ab"});
  w.SetStringArray("tokenizer.ggml.merges", {"a b"});
  const std::string path = testing::TempDir() + "/tekken.gguf";
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()), ::testing::HasSubstr("\"tekken\""));
}

}  // namespace
}  // namespace kvserve
