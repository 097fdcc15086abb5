#include "model/tokenizer.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

struct Loaded {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tokenizer;
};

Loaded Load(const std::string& path) {
  Loaded l;
  auto file = GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return l;
  l.file = std::move(*file);
  auto tok = Tokenizer::FromGguf(*l.file);
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (tok.ok()) l.tokenizer = std::move(*tok);
  return l;
}

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// One line of tests/data/tokenizer_reference_*.jsonl (written by
// tests/data/make_tokenizer_reference.py from llama.cpp's tokenizer).
struct ReferenceCase {
  std::string text;
  bool add_bos;
  bool special;
  std::vector<int32_t> ids;
  std::string decoded;          // pieces without special tokens
  std::string decoded_special;  // special tokens rendered
};

std::vector<ReferenceCase> ReadReference(const std::string& name) {
  const std::string path = std::string(KVSERVE_SOURCE_DIR) + "/tests/data/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<ReferenceCase> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    cases.push_back({j.at("text").get<std::string>(), j.at("add_bos").get<bool>(),
                     j.at("special").get<bool>(), j.at("ids").get<std::vector<int32_t>>(),
                     FromHex(j.at("decoded_hex").get<std::string>()),
                     FromHex(j.at("decoded_special_hex").get<std::string>())});
  }
  return cases;
}

// Checks every reference case; returns how many were checked.
size_t ExpectMatchesReference(const Tokenizer& tok, const std::string& name) {
  const std::vector<ReferenceCase> cases = ReadReference(name);
  EXPECT_GE(cases.size(), 80u);
  for (const ReferenceCase& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "text=\"" << c.text << "\" add_bos=" << c.add_bos << " special=" << c.special);
    const std::vector<int32_t> ids = tok.Encode(c.text, c.add_bos, c.special);
    EXPECT_EQ(ids, c.ids);
    EXPECT_EQ(tok.Decode(c.ids), c.decoded);
    EXPECT_EQ(tok.Decode(c.ids, /*render_special=*/true), c.decoded_special);
  }
  return cases.size();
}

// ---------------------------------------------------------------------------
// stories260K: SentencePiece with byte fallback.

class Stories260KTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::Stories260KPath();
    KVSERVE_SKIP_IF_MISSING(path_, "stories260K.gguf");
    loaded_ = Load(path_);
    ASSERT_NE(loaded_.tokenizer, nullptr);
  }
  const Tokenizer& tok() const { return *loaded_.tokenizer; }

  std::string path_;
  Loaded loaded_;
};

TEST_F(Stories260KTokenizerTest, ReadsVocabularyAndSpecialIds) {
  EXPECT_EQ(tok().kind(), Tokenizer::Kind::kSentencePiece);
  EXPECT_EQ(tok().vocab_size(), 512);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_TRUE(tok().add_bos_default());
  EXPECT_TRUE(tok().IsEndOfGeneration(2));
  EXPECT_FALSE(tok().IsEndOfGeneration(1));
  EXPECT_FALSE(tok().IsEndOfGeneration(300));
  EXPECT_TRUE(tok().IsControl(1));
  EXPECT_FALSE(tok().IsControl(300));
  EXPECT_EQ(tok().PieceToId("<0x41>"), 68);
  EXPECT_EQ(tok().PieceToId("no such piece"), -1);
}

TEST_F(Stories260KTokenizerTest, MatchesGoldenPromptIds) {
  const std::string golden = testing::Stories260KGoldenPath();
  KVSERVE_SKIP_IF_MISSING(golden, "stories260K golden file");
  std::ifstream in(golden);
  std::string line;
  int checked = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string prompt = j.at("prompt").get<std::string>();
    EXPECT_EQ(tok().Encode(prompt, tok().add_bos_default(), /*parse_special=*/false),
              j.at("prompt_ids_with_bos").get<std::vector<int32_t>>())
        << prompt;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST_F(Stories260KTokenizerTest, MatchesLlamaCppReference) {
  const size_t n = ExpectMatchesReference(tok(), "tokenizer_reference_stories260K.jsonl");
  RecordProperty("reference_cases", static_cast<int>(n));
}

TEST_F(Stories260KTokenizerTest, DecodeRoundTripsWithSpacePrefix) {
  for (const std::string text : {"Once upon a time", "  spaced  out ", "日本語 😀", "a\nb\tc"}) {
    EXPECT_EQ(tok().Decode(tok().Encode(text, false, false)), " " + text);
  }
  EXPECT_EQ(tok().Decode(tok().Encode("", true, false)), "");
}

TEST_F(Stories260KTokenizerTest, UnknownCharactersFallBackToBytes) {
  // The 512-piece vocabulary has no "😀": it is spelled as its four bytes.
  const std::vector<int32_t> ids = tok().Encode("😀", false, false);
  ASSERT_GE(ids.size(), 4u);
  const std::vector<int32_t> tail(ids.end() - 4, ids.end());
  EXPECT_THAT(tail, ElementsAre(tok().PieceToId("<0xF0>"), tok().PieceToId("<0x9F>"),
                                tok().PieceToId("<0x98>"), tok().PieceToId("<0x80>")));
}

TEST_F(Stories260KTokenizerTest, SpecialTextOnlyBecomesTokensWhenParsed) {
  EXPECT_THAT(tok().Encode("<s>Hi", false, /*parse_special=*/true), Contains(1));
  EXPECT_THAT(tok().Encode("<s>Hi", false, /*parse_special=*/false), Not(Contains(1)));
}

TEST_F(Stories260KTokenizerTest, StreamingHoldsBackPartialCharacters) {
  StreamingDetokenizer stream(&tok());
  const std::vector<int32_t> bytes = {tok().PieceToId("<0xF0>"), tok().PieceToId("<0x9F>"),
                                      tok().PieceToId("<0x98>"), tok().PieceToId("<0x80>")};
  EXPECT_EQ(stream.Push(bytes[0]), "");
  EXPECT_EQ(stream.Push(bytes[1]), "");
  EXPECT_EQ(stream.Push(bytes[2]), "");
  EXPECT_EQ(stream.Push(bytes[3]), "😀");
  EXPECT_EQ(stream.Flush(), "");
}

TEST_F(Stories260KTokenizerTest, StreamingFlushReplacesTruncatedCharacter) {
  StreamingDetokenizer stream(&tok());
  EXPECT_EQ(stream.Push(tok().PieceToId("<0x41>")), "A");
  EXPECT_EQ(stream.Push(tok().PieceToId("<0xE6>")), "");
  EXPECT_EQ(stream.Push(tok().PieceToId("<0x97>")), "");
  EXPECT_EQ(stream.Flush(), "\xEF\xBF\xBD");
  // A stray continuation byte is replaced at once rather than stalling.
  EXPECT_EQ(stream.Push(tok().PieceToId("<0x80>")), "\xEF\xBF\xBD");
}

TEST_F(Stories260KTokenizerTest, LongInputEncodesAndRoundTrips) {
  std::string text;
  while (text.size() < 200000) text += "Once upon a time, there was a little girl named Lily. ";
  const std::vector<int32_t> ids = tok().Encode(text, false, false);
  EXPECT_LT(ids.size(), text.size() / 2);
  EXPECT_EQ(tok().Decode(ids), " " + text);
}

// ---------------------------------------------------------------------------
// SmolLM2: byte-level BPE with the smollm pre-tokenizer.

class SmolLM2TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::SmolLM2Path();
    KVSERVE_SKIP_IF_MISSING(path_, "SmolLM2 GGUF");
    loaded_ = Load(path_);
    ASSERT_NE(loaded_.tokenizer, nullptr);
  }
  const Tokenizer& tok() const { return *loaded_.tokenizer; }

  std::string path_;
  Loaded loaded_;
};

TEST_F(SmolLM2TokenizerTest, ReadsVocabularyAndSpecialIds) {
  EXPECT_EQ(tok().kind(), Tokenizer::Kind::kBytePairEncoding);
  EXPECT_EQ(tok().vocab_size(), 49152);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_FALSE(tok().add_bos_default());
  EXPECT_EQ(tok().PieceToId("<|im_end|>"), 2);
  EXPECT_TRUE(tok().IsEndOfGeneration(2));  // <|im_end|>
  EXPECT_TRUE(tok().IsEndOfGeneration(0));  // <|endoftext|>
  EXPECT_FALSE(tok().IsEndOfGeneration(1));
  EXPECT_FALSE(tok().IsEndOfGeneration(tok().PieceToId("Hello")));
  EXPECT_TRUE(tok().IsControl(1));
}

TEST_F(SmolLM2TokenizerTest, MatchesLlamaCppReference) {
  const size_t n = ExpectMatchesReference(tok(), "tokenizer_reference_smollm2.jsonl");
  RecordProperty("reference_cases", static_cast<int>(n));
}

TEST_F(SmolLM2TokenizerTest, DecodeRoundTripsExactly) {
  for (const std::string text :
       {"", "Hello world", "  spaced\t\tout \n\n", "日本語 😀 👨‍👩‍👧",
        "x = 12345;\r\n", "<|im_start|> as text"}) {
    EXPECT_EQ(tok().Decode(tok().Encode(text, false, false)), text);
  }
}

TEST_F(SmolLM2TokenizerTest, DigitsAreSplitIndividually) {
  EXPECT_THAT(tok().Encode("2024", false, false),
              ElementsAre(tok().PieceToId("2"), tok().PieceToId("0"), tok().PieceToId("2"),
                          tok().PieceToId("4")));
}

TEST_F(SmolLM2TokenizerTest, ChatMarkersAreControlTokensOnlyWhenParsed) {
  const std::string text = "<|im_start|>user\nHi<|im_end|>\n";
  const std::vector<int32_t> parsed = tok().Encode(text, false, true);
  ASSERT_GE(parsed.size(), 3u);
  EXPECT_EQ(parsed.front(), 1);
  EXPECT_THAT(parsed, Contains(2));
  EXPECT_THAT(tok().Encode(text, false, false), Not(Contains(1)));
  EXPECT_EQ(tok().Decode(parsed), "user\nHi\n");
  EXPECT_EQ(tok().Decode(parsed, /*render_special=*/true), text);
}

TEST_F(SmolLM2TokenizerTest, InvalidUtf8IsEncodedByteForByte) {
  // A truncated sequence is still spelled with its byte's token.
  const std::string text = "ok \xC3 bad \xE6\x97";
  EXPECT_EQ(tok().Decode(tok().Encode(text, false, false)), text);
  // Bytes that never occur in UTF-8 (0xFF) have no token in this vocabulary;
  // like llama.cpp, they are dropped rather than failing the request.
  EXPECT_EQ(tok().Decode(tok().Encode(std::string("a\xFF") + "b", false, false)), "ab");
}

TEST_F(SmolLM2TokenizerTest, StreamingNeverSplitsCharacters) {
  // Many CJK and emoji characters are split across several byte-level
  // tokens; every delta must still be whole UTF-8.
  const std::string text =
      "中文字符测试，你好！😀🎉👍🏽 naïve Привет 𝔘𝔫𝔦";
  const std::vector<int32_t> ids = tok().Encode(text, false, false);
  ASSERT_GT(ids.size(), 10u);
  StreamingDetokenizer stream(&tok());
  std::string joined;
  bool saw_held_back = false;
  for (int32_t id : ids) {
    const std::string delta = stream.Push(id);
    if (delta.empty()) saw_held_back = true;
    // Whole characters: the delta decodes without a trailing partial char
    // and never starts with a continuation byte.
    if (!delta.empty()) {
      EXPECT_NE(static_cast<uint8_t>(delta[0]) & 0xC0, 0x80) << "delta starts mid-character";
    }
    EXPECT_EQ(delta.find("\xEF\xBF\xBD"), std::string::npos);
    joined += delta;
  }
  joined += stream.Flush();
  EXPECT_EQ(joined, text);
  EXPECT_TRUE(saw_held_back) << "expected at least one token ending mid-character";
}

TEST_F(SmolLM2TokenizerTest, LongInputEncodesAndRoundTrips) {
  std::string text;
  while (text.size() < 200000) text += "The quick brown fox, 1234 jumps! 日本語\n\t";
  const std::vector<int32_t> ids = tok().Encode(text, false, false);
  EXPECT_EQ(tok().Decode(ids), text);
  // One enormous "word" exercises the merge queue on a single long run.
  const std::string word(100000, 'a');
  EXPECT_EQ(tok().Decode(tok().Encode(word, false, false)), word);
}

// ---------------------------------------------------------------------------
// Synthetic vocabularies (no model files needed).

std::vector<std::string> GptByteChars() {
  // Same construction as the tokenizer: printable Latin-1 stands for itself.
  std::vector<std::string> chars(256);
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? b : 256 + next++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    chars[b] = s;
  }
  return chars;
}

TEST(SyntheticTokenizerTest, BpeAppliesMergesByRank) {
  testing::GgufWriter w;
  std::vector<std::string> tokens = {"<|endoftext|>"};
  std::vector<int32_t> types = {3};
  for (const std::string& c : GptByteChars()) {
    tokens.push_back(c);
    types.push_back(1);
  }
  // "ab" outranks "bc", so "abc" -> "ab" + "c" even though "bc" exists.
  for (const char* t : {"ab", "bc", "Ġa"}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "gpt2");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetStringArray("tokenizer.ggml.merges", {"a b", "b c", "Ġ a"});
  w.SetU32("tokenizer.ggml.eos_token_id", 0);
  const std::string bytes = w.Serialize();
  auto file = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(file.ok()) << file.status();
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const int32_t ab = (*tok)->PieceToId("ab");
  const int32_t c = (*tok)->PieceToId("c");
  const int32_t space = (*tok)->PieceToId("Ġ");
  EXPECT_THAT((*tok)->Encode("abc", false, false), ElementsAre(ab, c));
  // "a b" (rank 0) wins over "Ġ a" (rank 2), leaving no merge for "Ġ".
  EXPECT_THAT((*tok)->Encode(" abc", false, false), ElementsAre(space, ab, c));
  EXPECT_THAT((*tok)->Encode(" a", false, false), ElementsAre((*tok)->PieceToId("Ġa")));
  EXPECT_THAT((*tok)->Encode(" bc", false, false), ElementsAre(space, (*tok)->PieceToId("bc")));
  EXPECT_THAT((*tok)->Encode("abc<|endoftext|>", false, true), ElementsAre(ab, c, 0));
  EXPECT_EQ((*tok)->Decode((*tok)->Encode(" abc", false, false)), " abc");
  EXPECT_TRUE((*tok)->IsEndOfGeneration(0));
  EXPECT_FALSE((*tok)->add_bos_default());
}

TEST(SyntheticTokenizerTest, RejectsUnknownModelAndPreTokenizer) {
  {
    testing::GgufWriter w;
    w.SetString("tokenizer.ggml.model", "bert");
    w.SetStringArray("tokenizer.ggml.tokens", {"a"});
    const std::string bytes = w.Serialize();
    auto file = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    ASSERT_TRUE(file.ok()) << file.status();
    auto tok = Tokenizer::FromGguf(**file);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("bert"));
  }
  {
    testing::GgufWriter w;
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetString("tokenizer.ggml.pre", "martian");
    w.SetStringArray("tokenizer.ggml.tokens", {"a"});
    w.SetStringArray("tokenizer.ggml.merges", {});
    const std::string bytes = w.Serialize();
    auto file = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    ASSERT_TRUE(file.ok()) << file.status();
    auto tok = Tokenizer::FromGguf(**file);
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("martian"));
  }
}

TEST(SyntheticTokenizerTest, TinyLlamaVocabularyLoads) {
  const std::string bytes = testing::MakeTinyLlamaGguf({});
  auto file = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(file.ok()) << file.status();
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "hello, tiny world! ✓";
  EXPECT_EQ((*tok)->Decode((*tok)->Encode(text, true, false)), " " + text);
}

// ---------------------------------------------------------------------------
// Gemma 3 (262k SentencePiece vocabulary, no space prefix, user-defined
// whitespace tokens) on the real file deploy/setup.sh --models all fetches,
// against llama.cpp's llama-tokenize (tests/data/tokenizer_reference_gemma3.jsonl,
// written by tests/data/make_gemma3_reference.py).

class Gemma3TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf");
    KVSERVE_SKIP_IF_MISSING(path_, "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
    loaded_ = Load(path_);
    ASSERT_NE(loaded_.tokenizer, nullptr);
  }
  const Tokenizer& tok() const { return *loaded_.tokenizer; }

  std::string path_;
  Loaded loaded_;
};

TEST_F(Gemma3TokenizerTest, MatchesLlamaCppIds) {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/tokenizer_reference_gemma3.jsonl");
  ASSERT_TRUE(in.good());
  EXPECT_EQ(tok().kind(), Tokenizer::Kind::kSentencePiece);
  EXPECT_EQ(tok().vocab_size(), 262144);
  EXPECT_EQ(tok().bos_id(), 2);
  EXPECT_TRUE(tok().add_bos_default());
  std::string line;
  size_t checked = 0;
  std::set<std::string> texts;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string text = j.at("text").get<std::string>();
    const bool add_bos = j.at("add_bos").get<bool>();
    const bool special = j.at("special").get<bool>();
    const std::vector<int32_t> want = j.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok().Encode(text, add_bos, special), want)
        << "text=\"" << text << "\" add_bos=" << add_bos << " special=" << special;
    // Without a space prefix, plain text decodes back to itself.
    if (!add_bos && !special) EXPECT_EQ(tok().Decode(want), text);
    texts.insert(text);
    ++checked;
  }
  EXPECT_GE(texts.size(), 60u);
  RecordProperty("reference_cases", static_cast<int>(checked));
}

}  // namespace
}  // namespace kvserve
