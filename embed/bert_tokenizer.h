// BertTokenizer: the WordPiece tokenizer of BERT-family sentence encoders,
// read from a Hugging Face tokenizer.json (normalizer "BertNormalizer",
// pre_tokenizer "BertPreTokenizer", model "WordPiece"), producing the ids
// that Hugging Face's `tokenizers` produces for one sequence:
//
//   1. special tokens written in the text ("[SEP]", ...) are matched first,
//      on the raw text, and kept as their ids;
//   2. BertNormalizer: drop control / unassigned / U+FFFD characters and map
//      whitespace to ' ' (clean_text), put spaces around CJK ideographs,
//      strip accents (NFD, then drop nonspacing marks), lowercase;
//   3. BertPreTokenizer: split on whitespace and isolate each punctuation
//      character;
//   4. WordPiece: greedy longest match with "##" continuations; a word with
//      no full cover, or longer than max_input_chars_per_word, is [UNK];
//   5. truncation to max_length - 2 pieces, then [CLS] ... [SEP].
//
// The Unicode data (embed/bert_unicode_tables.inc) is generated from the
// `tokenizers` library itself, so character classes follow its Unicode
// version rather than ours. Known difference: NFD's canonical reordering of
// combining marks is not done; with strip_accents on (all-MiniLM-L6-v2) it
// matters only for spacing marks with a nonzero combining class (a few
// musical-notation symbols), which no test text has.
//
// Thread-safety: immutable after construction; Encode may be called
// concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace kvserve::embed {

class BertTokenizer {
 public:
  [[nodiscard]] static absl::StatusOr<BertTokenizer> FromFile(const std::string& path);
  // `origin` names the source in errors.
  [[nodiscard]] static absl::StatusOr<BertTokenizer> FromJson(std::string_view json,
                                                              const std::string& origin);

  // [CLS] pieces... [SEP], at most max_length ids (REQUIRES: max_length >= 2).
  // InvalidArgument when `text` is not valid UTF-8.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                            int max_length) const;

  // The normalized, pre-tokenized words of `text` (no special-token
  // matching, no WordPiece): for tests and debugging.
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> Words(std::string_view text) const;

  int32_t vocab_size() const { return vocab_size_; }
  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t unk_id() const { return unk_id_; }

 private:
  BertTokenizer() = default;

  // Steps 2-4 on a stretch of text without special tokens.
  void EncodeSegment(const std::vector<uint32_t>& cps, std::vector<int32_t>* out) const;
  std::vector<std::vector<uint32_t>> NormalizeAndSplit(const std::vector<uint32_t>& cps) const;
  void WordPiece(const std::vector<uint32_t>& word, std::vector<int32_t>* out) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  // Special tokens matched in raw text, longest first: (content, id).
  std::vector<std::pair<std::string, int32_t>> specials_;
  int32_t vocab_size_ = 0;
  int32_t cls_id_ = -1;
  int32_t sep_id_ = -1;
  int32_t unk_id_ = -1;
  std::string continuing_prefix_ = "##";
  int max_input_chars_per_word_ = 100;
  bool clean_text_ = true;
  bool handle_chinese_chars_ = true;
  bool strip_accents_ = true;
  bool lowercase_ = true;
};

}  // namespace kvserve::embed
