// BertTokenizer: tokenizer.json parsing, strict UTF-8 decoding, the
// BertNormalizer / BertPreTokenizer / WordPiece steps.
//
// Hand-written rather than a library: Debian ships no WordPiece tokenizer
// for C++ (Hugging Face's `tokenizers` is Rust, sentencepiece does not read
// tokenizer.json), and the algorithm is small; its output is checked id for
// id against `tokenizers` (tests/data/embed_reference.jsonl).
#include "embed/bert_tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

// Character flags, from the `tokenizers` library's own behaviour (see
// embed/make_bert_unicode_tables.py).
enum BertCharFlag : uint8_t {
  kCleanDrop = 1,   // clean_text removes it (control, format, unassigned, U+0000, U+FFFD)
  kCleanSpace = 2,  // clean_text turns it into ' '
  kPunct = 4,       // BertPreTokenizer isolates it
  kSplitSpace = 8,  // BertPreTokenizer splits on it and drops it
  kMn = 16,         // strip_accents drops it after NFD
};
struct BertFlagRange {
  uint32_t first;
  uint32_t last;
  uint8_t flags;
};
struct CodepointMapping {
  uint32_t cp;
  uint32_t offset;
  uint32_t length;
};

#include "embed/bert_unicode_tables.inc"

uint8_t Flags(uint32_t cp) {
  const auto* end = std::end(kBertFlagRanges);
  const auto* it = std::upper_bound(std::begin(kBertFlagRanges), end, cp,
                                    [](uint32_t c, const BertFlagRange& r) { return c < r.first; });
  if (it == std::begin(kBertFlagRanges)) return 0;
  --it;
  return cp <= it->last ? it->flags : 0;
}

// Appends the mapping of cp from one of the generated tables, or cp itself.
template <size_t N, size_t M>
void AppendMapped(const CodepointMapping (&index)[N], const uint32_t (&data)[M], uint32_t cp,
                  std::vector<uint32_t>* out) {
  const auto* it = std::lower_bound(std::begin(index), std::end(index), cp,
                                    [](const CodepointMapping& m, uint32_t c) { return m.cp < c; });
  if (it != std::end(index) && it->cp == cp) {
    out->insert(out->end(), data + it->offset, data + it->offset + it->length);
  } else {
    out->push_back(cp);
  }
}

// Canonical decomposition; Hangul syllables algorithmically (Unicode 3.12).
void AppendNfd(uint32_t cp, std::vector<uint32_t>* out) {
  constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
  constexpr uint32_t kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = 11172;
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  AppendMapped(kNfdIndex, kNfdData, cp, out);
}

// The CJK ideograph blocks BertNormalizer pads with spaces (as `tokenizers`
// and the original BERT code define them).
bool IsChineseChar(uint32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// Strict UTF-8: no overlong forms, surrogates or codepoints past U+10FFFF.
absl::Status DecodeUtf8(std::string_view s, std::vector<uint32_t>* out) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    uint32_t cp;
    size_t n;
    uint32_t min;
    if (b < 0x80) {
      out->push_back(b);
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2, cp = b & 0x1F, min = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3, cp = b & 0x0F, min = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4, cp = b & 0x07, min = 0x10000;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("text is not valid UTF-8: byte 0x",
                                                     absl::Hex(b), " at offset ", i,
                                                     " cannot start a character"));
    }
    if (i + n > s.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("text is not valid UTF-8: truncated character at offset ", i));
    }
    for (size_t k = 1; k < n; ++k) {
      const uint8_t c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) {
        return absl::InvalidArgumentError(
            absl::StrCat("text is not valid UTF-8: bad continuation byte at offset ", i + k));
      }
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "text is not valid UTF-8: overlong, surrogate or out-of-range sequence at offset ", i));
    }
    out->push_back(cp);
    i += n;
  }
  return absl::OkStatus();
}


}  // namespace

absl::StatusOr<BertTokenizer> BertTokenizer::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open tokenizer file"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str(), path);
}

absl::StatusOr<BertTokenizer> BertTokenizer::FromJson(std::string_view json,
                                                      const std::string& origin) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("not JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return bad("not a JSON object");
  BertTokenizer t;
  try {
    const auto& model = j.at("model");
    if (model.value("type", "") != "WordPiece") {
      return bad(absl::StrCat("model type is '", model.value("type", ""), "', expected WordPiece"));
    }
    t.continuing_prefix_ = model.value("continuing_subword_prefix", "##");
    t.max_input_chars_per_word_ = model.value("max_input_chars_per_word", 100);
    const auto& vocab = model.at("vocab");
    if (!vocab.is_object() || vocab.empty()) return bad("model.vocab is not a non-empty object");
    for (const auto& [piece, id] : vocab.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (1 << 24)) {
        return bad(absl::StrCat("vocab id of '", piece, "' is not a small non-negative integer"));
      }
      const int32_t v = id.get<int32_t>();
      t.vocab_.emplace(piece, v);
      t.vocab_size_ = std::max(t.vocab_size_, v + 1);
    }
    const std::string unk = model.value("unk_token", "[UNK]");
    const auto find = [&](const std::string& piece) -> int32_t {
      const auto it = t.vocab_.find(piece);
      return it == t.vocab_.end() ? -1 : it->second;
    };
    t.unk_id_ = find(unk);
    t.cls_id_ = find("[CLS]");
    t.sep_id_ = find("[SEP]");
    if (t.unk_id_ < 0 || t.cls_id_ < 0 || t.sep_id_ < 0) {
      return bad("vocab lacks one of " + unk + ", [CLS], [SEP]");
    }

    const auto& norm = j.at("normalizer");
    if (!norm.is_object() || norm.value("type", "") != "BertNormalizer") {
      return bad("normalizer is not BertNormalizer");
    }
    t.clean_text_ = norm.value("clean_text", true);
    t.handle_chinese_chars_ = norm.value("handle_chinese_chars", true);
    t.lowercase_ = norm.value("lowercase", true);
    const auto sa = norm.find("strip_accents");
    t.strip_accents_ = (sa == norm.end() || sa->is_null()) ? t.lowercase_ : sa->get<bool>();

    const auto& pre = j.at("pre_tokenizer");
    if (!pre.is_object() || pre.value("type", "") != "BertPreTokenizer") {
      return bad("pre_tokenizer is not BertPreTokenizer");
    }
    // post_processor: [CLS] $A [SEP] is what BERT uses; accept that template
    // or none (the defaults are the same ids).
    const auto pp = j.find("post_processor");
    if (pp != j.end() && !pp->is_null()) {
      const std::string type = pp->value("type", "");
      if (type == "TemplateProcessing") {
        const auto& single = pp->at("single");
        if (single.size() != 3 || single[0].at("SpecialToken").at("id") != "[CLS]" ||
            single[2].at("SpecialToken").at("id") != "[SEP]") {
          return bad("post_processor template is not [CLS] $A [SEP]");
        }
      } else if (type != "BertProcessing") {
        return bad(absl::StrCat("post_processor '", type, "' is not supported"));
      }
    }
    const auto added = j.find("added_tokens");
    if (added != j.end() && added->is_array()) {
      for (const auto& a : *added) {
        const std::string content = a.at("content").get<std::string>();
        if (content.empty()) continue;
        if (!a.value("normalized", false) && !a.value("lstrip", false) &&
            !a.value("rstrip", false) && !a.value("single_word", false)) {
          t.specials_.emplace_back(content, a.at("id").get<int32_t>());
        } else {
          return bad(absl::StrCat("added token '", content,
                                  "' uses normalized/lstrip/rstrip/single_word, not supported"));
        }
      }
    }
    std::stable_sort(t.specials_.begin(), t.specials_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("unexpected tokenizer.json layout (", e.what(), ")"));
  }
  return t;
}

std::vector<std::vector<uint32_t>> BertTokenizer::NormalizeAndSplit(
    const std::vector<uint32_t>& cps) const {
  // BertNormalizer, one character at a time (each step maps one character
  // to zero or more, independently of its neighbours).
  std::vector<uint32_t> norm;
  norm.reserve(cps.size() + 8);
  std::vector<uint32_t> tmp;
  for (uint32_t c : cps) {
    const uint8_t f = Flags(c);
    if (clean_text_) {
      if (f & kCleanDrop) continue;
      if (f & kCleanSpace) c = ' ';
    }
    tmp.clear();
    if (strip_accents_) {
      AppendNfd(c, &tmp);
      tmp.erase(std::remove_if(tmp.begin(), tmp.end(), [](uint32_t d) { return Flags(d) & kMn; }),
                tmp.end());
    } else {
      tmp.push_back(c);
    }
    const bool pad = handle_chinese_chars_ && IsChineseChar(c);
    if (pad) norm.push_back(' ');
    for (uint32_t d : tmp) {
      if (lowercase_) {
        AppendMapped(kLowerIndex, kLowerData, d, &norm);
      } else {
        norm.push_back(d);
      }
    }
    if (pad) norm.push_back(' ');
  }
  // BertPreTokenizer.
  std::vector<std::vector<uint32_t>> words;
  std::vector<uint32_t> cur;
  for (uint32_t c : norm) {
    const uint8_t f = Flags(c);
    if (f & kSplitSpace) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
    } else if (f & kPunct) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
      words.push_back({c});
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

void BertTokenizer::WordPiece(const std::vector<uint32_t>& word, std::vector<int32_t>* out) const {
  if (static_cast<int>(word.size()) > max_input_chars_per_word_) {
    out->push_back(unk_id_);
    return;
  }
  std::string utf8;
  std::vector<size_t> bounds;  // byte offset of each character, plus the end
  for (uint32_t c : word) {
    bounds.push_back(utf8.size());
    AppendUtf8(c, &utf8);
  }
  bounds.push_back(utf8.size());
  const size_t first = out->size();
  std::string candidate;
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int32_t id = -1;
    for (; end > start; --end) {
      candidate.clear();
      if (start > 0) candidate = continuing_prefix_;
      candidate.append(utf8, bounds[start], bounds[end] - bounds[start]);
      const auto it = vocab_.find(candidate);
      if (it != vocab_.end()) {
        id = it->second;
        break;
      }
    }
    if (id < 0) {
      out->resize(first);
      out->push_back(unk_id_);
      return;
    }
    out->push_back(id);
    start = end;
  }
}

void BertTokenizer::EncodeSegment(const std::vector<uint32_t>& cps,
                                  std::vector<int32_t>* out) const {
  for (const auto& w : NormalizeAndSplit(cps)) WordPiece(w, out);
}

absl::StatusOr<std::vector<int32_t>> BertTokenizer::Encode(std::string_view text,
                                                           int max_length) const {
  std::vector<int32_t> pieces;
  std::vector<uint32_t> cps;
  // Special tokens are matched on the raw text, leftmost and longest first.
  size_t seg = 0, i = 0;
  while (i < text.size()) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    if (!specials_.empty()) {
      for (const auto& s : specials_) {
        if (text.compare(i, s.first.size(), s.first) == 0) {
          hit = &s;
          break;
        }
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    cps.clear();
    if (absl::Status st = DecodeUtf8(text.substr(seg, i - seg), &cps); !st.ok()) return st;
    EncodeSegment(cps, &pieces);
    pieces.push_back(hit->second);
    i += hit->first.size();
    seg = i;
  }
  cps.clear();
  if (absl::Status st = DecodeUtf8(text.substr(seg), &cps); !st.ok()) return st;
  EncodeSegment(cps, &pieces);

  const size_t keep = std::min(pieces.size(), static_cast<size_t>(std::max(max_length - 2, 0)));
  std::vector<int32_t> ids;
  ids.reserve(keep + 2);
  ids.push_back(cls_id_);
  ids.insert(ids.end(), pieces.begin(), pieces.begin() + keep);
  ids.push_back(sep_id_);
  return ids;
}

absl::StatusOr<std::vector<std::string>> BertTokenizer::Words(std::string_view text) const {
  std::vector<uint32_t> cps;
  if (absl::Status st = DecodeUtf8(text, &cps); !st.ok()) return st;
  std::vector<std::string> out;
  for (const auto& w : NormalizeAndSplit(cps)) {
    std::string s;
    for (uint32_t c : w) AppendUtf8(c, &s);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace kvserve::embed
