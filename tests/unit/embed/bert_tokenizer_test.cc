// BertTokenizer on a small hand-written tokenizer.json: each normalizer,
// pre-tokenizer and WordPiece rule, truncation, special tokens, and the
// errors for invalid UTF-8 and malformed tokenizer files. The real model's
// vocabulary is checked id for id against Hugging Face in
// sentence_encoder_test.cc.
#include "embed/bert_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

using ::testing::ElementsAre;

nlohmann::json TinyTokenizerJson() {
  const std::vector<std::string> pieces = {
      "[PAD]", "[UNK]", "[CLS]", "[SEP]",    "[MASK]",  "un",     "##aff", "##able", "hello",
      "world", "!",     ",",     "cafe",     "i",       "a",      "##a",   "中",     "国",
      "x",     "##x",   "$",     "istanbul", "strasse", "straße", "σ",     "日本"};
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = i;
  nlohmann::json added = nlohmann::json::array();
  for (int id : {0, 1, 2, 3, 4}) {
    added.push_back({{"id", id},
                     {"content", pieces[id]},
                     {"special", true},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false}});
  }
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "BertNormalizer"},
        {"clean_text", true},
        {"handle_chinese_chars", true},
        {"strip_accents", nullptr},
        {"lowercase", true}}},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "[CLS]"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", "[SEP]"}, {"type_id", 0}}}}}}}},
      {"model",
       {{"type", "WordPiece"},
        {"unk_token", "[UNK]"},
        {"continuing_subword_prefix", "##"},
        {"max_input_chars_per_word", 10},
        {"vocab", vocab}}},
  };
}

class BertTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = BertTokenizer::FromJson(TinyTokenizerJson().dump(), "tiny.json");
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::make_unique<BertTokenizer>(*std::move(t));
  }
  std::vector<int32_t> Ids(std::string_view text, int max_length = 64) {
    auto ids = tok_->Encode(text, max_length);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  std::vector<std::string> Words(std::string_view text) {
    auto w = tok_->Words(text);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? *w : std::vector<std::string>{};
  }
  std::unique_ptr<BertTokenizer> tok_;
};

TEST_F(BertTokenizerTest, WrapsInClsSep) {
  EXPECT_THAT(Ids(""), ElementsAre(2, 3));
  EXPECT_THAT(Ids("hello world"), ElementsAre(2, 8, 9, 3));
}

TEST_F(BertTokenizerTest, WordPieceGreedyLongestMatchWithContinuations) {
  EXPECT_THAT(Ids("unaffable"), ElementsAre(2, 5, 6, 7, 3));
  EXPECT_THAT(Ids("xxx"), ElementsAre(2, 18, 19, 19, 3));
  // No full cover: the whole word is [UNK], not a partial match.
  EXPECT_THAT(Ids("unaffablez hello"), ElementsAre(2, 1, 8, 3));
}

TEST_F(BertTokenizerTest, WordsLongerThanMaxInputCharsAreUnk) {
  auto ten = Ids("xxxxxxxxxx");  // 10 chars: allowed
  ASSERT_EQ(ten.size(), 12u);
  EXPECT_EQ(ten[1], 18);
  EXPECT_EQ(ten[10], 19);
  EXPECT_THAT(Ids("xxxxxxxxxxx"), ElementsAre(2, 1, 3));  // 11 chars: [UNK]
}

TEST_F(BertTokenizerTest, LowercasesStripsAccentsAndSplitsPunctuation) {
  EXPECT_THAT(Words("HeLLo, World!"), ElementsAre("hello", ",", "world", "!"));
  EXPECT_THAT(Words("Café"), ElementsAre("cafe"));
  EXPECT_THAT(Words("Cafe\u0301"), ElementsAre("cafe"));  // combining accent dropped
  // Accents are stripped before lowercasing: U+0130 decomposes to I + U+0307,
  // the mark goes, then "I" lowercases (lowercasing first would keep U+0307).
  EXPECT_THAT(Words("\u0130stanbul"), ElementsAre("istanbul"));
  EXPECT_THAT(Words("Straße"), ElementsAre("straße"));
  EXPECT_THAT(Words("ΣΑ"), ElementsAre("σα"));
  // ASCII symbols such as '$' count as punctuation for BERT.
  EXPECT_THAT(Words("a$a"), ElementsAre("a", "$", "a"));
}

TEST_F(BertTokenizerTest, CleansControlsAndWhitespace) {
  EXPECT_THAT(Words("a\tb\nc\r\nd"), ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(Words(std::string("a\0b", 3)), ElementsAre("ab"));
  EXPECT_THAT(Words("a\u200bb\u00adc"), ElementsAre("abc"));          // format chars dropped
  EXPECT_THAT(Words("a\u00a0b\u3000c"), ElementsAre("a", "b", "c"));  // Unicode spaces split
  EXPECT_THAT(Words("a\ufffdb"), ElementsAre("ab"));
  EXPECT_THAT(Ids("   "), ElementsAre(2, 3));
}

TEST_F(BertTokenizerTest, SplitsCjkIdeographs) {
  EXPECT_THAT(Words("中国x"), ElementsAre("中", "国", "x"));
  EXPECT_THAT(Ids("中国"), ElementsAre(2, 16, 17, 3));
  EXPECT_THAT(Words("日本"), ElementsAre("日", "本"));
  // Kana is outside the padded blocks and stays one word.
  EXPECT_THAT(Words("カタカナ"), ElementsAre("カタカナ"));
}

TEST_F(BertTokenizerTest, SpecialTokensInTextAreMatchedRaw) {
  EXPECT_THAT(Ids("hello [SEP] world[MASK]"), ElementsAre(2, 8, 3, 9, 4, 3));
  // Not special when the case differs: normal text, split at the brackets.
  EXPECT_THAT(Words("[sep]"), ElementsAre("[", "sep", "]"));
}

TEST_F(BertTokenizerTest, TruncatesToMaxLengthIncludingSpecials) {
  EXPECT_THAT(Ids("hello world hello world", 4), ElementsAre(2, 8, 9, 3));
  EXPECT_THAT(Ids("hello world", 2), ElementsAre(2, 3));
  EXPECT_THAT(Ids("unaffable", 4), ElementsAre(2, 5, 6, 3));  // cuts inside a word, as HF does
}

TEST_F(BertTokenizerTest, InvalidUtf8IsInvalidArgument) {
  for (const std::string& bad : {std::string("abc\x80"), std::string("\xc3"),  // lone / truncated
                                 std::string("\xc0\xaf"), std::string("\xe0\x80\xaf"),  // overlong
                                 std::string("\xed\xa0\x80"),                           // surrogate
                                 std::string("\xf4\x90\x80\x80"),  // > U+10FFFF
                                 std::string("\xff"), std::string("ok [SEP] \xfe")}) {
    auto ids = tok_->Encode(bad, 64);
    ASSERT_FALSE(ids.ok()) << "accepted invalid UTF-8";
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(ids.status().message().find("not valid UTF-8"), std::string::npos) << ids.status();
  }
}

// Random byte strings (mostly invalid UTF-8) and random valid codepoints:
// never a crash; invalid text is InvalidArgument, valid text always encodes
// to [CLS] ... [SEP] with in-vocabulary ids.
TEST_F(BertTokenizerTest, RandomInputNeverCrashes) {
  std::mt19937 rng(19);
  int invalid = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) {
      if (iter % 2 == 0) {
        text.push_back(static_cast<char>(rng()));
      } else {
        uint32_t cp = rng() % 0x110000;
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'a';
        // UTF-8 encode.
        if (cp < 0x80) {
          text.push_back(static_cast<char>(cp));
        } else if (cp < 0x800) {
          text += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
        } else if (cp < 0x10000) {
          text +=
              {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
               static_cast<char>(0x80 | (cp & 0x3F))};
        } else {
          text +=
              {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
               static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
        }
      }
    }
    auto ids = tok_->Encode(text, 16);
    if (!ids.ok()) {
      EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(iter % 2, 0) << "valid UTF-8 rejected: " << ids.status();
      ++invalid;
      continue;
    }
    ASSERT_GE(ids->size(), 2u);
    ASSERT_LE(ids->size(), 16u);
    EXPECT_EQ(ids->front(), tok_->cls_id());
    EXPECT_EQ(ids->back(), tok_->sep_id());
    for (int32_t id : *ids) EXPECT_LT(id, tok_->vocab_size());
  }
  EXPECT_GT(invalid, 500);
}

TEST(BertTokenizerLoadTest, MalformedTokenizerJsonIsInvalidArgument) {
  auto expect_bad = [](const nlohmann::json& j, const std::string& needle) {
    auto t = BertTokenizer::FromJson(j.dump(), "bad.json");
    ASSERT_FALSE(t.ok()) << needle;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status();
  };
  EXPECT_EQ(BertTokenizer::FromJson("{oops", "bad.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  nlohmann::json j = TinyTokenizerJson();
  j["model"]["type"] = "BPE";
  expect_bad(j, "expected WordPiece");
  j = TinyTokenizerJson();
  j["normalizer"]["type"] = "NFC";
  expect_bad(j, "not BertNormalizer");
  j = TinyTokenizerJson();
  j["model"]["vocab"].erase("[CLS]");
  expect_bad(j, "lacks one of");
  j = TinyTokenizerJson();
  j.erase("pre_tokenizer");
  expect_bad(j, "unexpected tokenizer.json layout");
  EXPECT_EQ(BertTokenizer::FromFile("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvserve::embed
