#include "model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/utf8.h"

namespace kvserve {

namespace {

struct CodepointRange {
  uint32_t first;
  uint32_t last;
};

#include "model/unicode_tables.inc"

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581 "▁"
constexpr uint32_t kInvalidCodepoint = 0xFFFFFFFF;

bool InRanges(const CodepointRange* begin, const CodepointRange* end, uint32_t cp) {
  const CodepointRange* it = std::upper_bound(
      begin, end, cp, [](uint32_t c, const CodepointRange& r) { return c < r.first; });
  return it != begin && cp <= (it - 1)->last;
}

// The classes the pre-tokenizer regexes distinguish. Whitespace is the
// Unicode White_Space property (what llama.cpp's \s means), not Python's
// isspace, which also counts U+001C..U+001F.
enum class CharClass : uint8_t { kLetter, kNumber, kWhitespace, kOther };

CharClass ClassOf(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kWhitespace;
    return CharClass::kOther;
  }
  if (cp == kInvalidCodepoint) return CharClass::kOther;
  if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
      cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000) {
    return CharClass::kWhitespace;
  }
  if (InRanges(std::begin(kLetterRanges), std::end(kLetterRanges), cp)) return CharClass::kLetter;
  if (InRanges(std::begin(kNumberRanges), std::end(kNumberRanges), cp)) return CharClass::kNumber;
  return CharClass::kOther;
}

// Length of the UTF-8 sequence a lead byte announces, clamped to what is
// left; continuation or invalid lead bytes count as one byte so that any
// input, valid UTF-8 or not, is consumed.
size_t Utf8Length(std::string_view s, size_t pos) {
  const uint8_t b = static_cast<uint8_t>(s[pos]);
  size_t n = 1;
  if (b >= 0xF0 && b < 0xF8) {
    n = 4;
  } else if (b >= 0xE0) {
    n = b < 0xF0 ? 3 : 1;
  } else if (b >= 0xC0) {
    n = 2;
  }
  return std::min(n, s.size() - pos);
}

// One decoded codepoint and where it sits in the input. Invalid sequences
// decode to kInvalidCodepoint, one byte each.
struct Codepoint {
  uint32_t cp;
  uint32_t offset;
  uint32_t length;
};

std::vector<Codepoint> DecodeUtf8(std::string_view s) {
  std::vector<Codepoint> out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[pos]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      n = 1;
      cp = b;
    } else if (b >= 0xC2 && b < 0xE0) {
      n = 2;
      cp = b & 0x1F;
    } else if (b >= 0xE0 && b < 0xF0) {
      n = 3;
      cp = b & 0x0F;
    } else if (b >= 0xF0 && b < 0xF5) {
      n = 4;
      cp = b & 0x07;
    }
    bool ok = n > 0 && pos + n <= s.size();
    for (size_t i = 1; ok && i < n; ++i) {
      const uint8_t c = static_cast<uint8_t>(s[pos + i]);
      ok = (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3F);
    }
    if (!ok) {
      n = 1;
      cp = kInvalidCodepoint;
    }
    out.push_back({cp, static_cast<uint32_t>(pos), static_cast<uint32_t>(n)});
    pos += n;
  }
  return out;
}


// A node of the doubly linked symbol list both merge loops work on. A symbol
// is a byte range of the (escaped) input; merged-away symbols get length 0.
struct Symbol {
  int32_t prev;
  int32_t next;
  uint32_t offset;
  uint32_t length;
  int32_t id;  // BPE only: the token this symbol currently is, or -1
};

// ---------------------------------------------------------------------------
// SentencePiece (tokenizer.ggml.model == "llama").

class SentencePieceTokenizer final : public Tokenizer {
 public:
  absl::Status Load(const GgufFile& file) {
    kind_ = Kind::kSentencePiece;
    RETURN_IF_ERROR(LoadCommon(file));
    ASSIGN_OR_RETURN(scores_, file.GetF32Array("tokenizer.ggml.scores"));
    if (scores_.size() != pieces_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.scores has ", scores_.size(),
                                                     " entries, tokens has ", pieces_.size()));
    }
    add_space_prefix_ = true;
    if (file.Has("tokenizer.ggml.add_space_prefix")) {
      ASSIGN_OR_RETURN(add_space_prefix_, file.GetBool("tokenizer.ggml.add_space_prefix"));
    }
    add_bos_default_ = true;
    if (file.Has("tokenizer.ggml.add_bos_token")) {
      ASSIGN_OR_RETURN(add_bos_default_, file.GetBool("tokenizer.ggml.add_bos_token"));
    }
    unk_id_ = -1;
    if (file.Has("tokenizer.ggml.unknown_token_id")) {
      ASSIGN_OR_RETURN(int64_t unk, file.GetI64("tokenizer.ggml.unknown_token_id"));
      if (unk >= 0 && unk < vocab_size()) unk_id_ = static_cast<int32_t>(unk);
    }
    for (int b = 0; b < 256; ++b) {
      static constexpr char kHex[] = "0123456789ABCDEF";
      const char name[] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>', '\0'};
      byte_ids_[b] = PieceToId(name);
    }
    IndexByteTokens();
    return absl::OkStatus();
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
    // SentencePiece treats the start of every text run that follows a
    // special token (or the start of input) as a word start, hence the
    // prefix after each special token too, as llama.cpp does.
    bool prev_special = true;
    std::string escaped;
    for (const Fragment& f : SplitOnSpecialTokens(text, parse_special)) {
      if (f.special_id >= 0) {
        out.push_back(f.special_id);
        prev_special = true;
        continue;
      }
      escaped.clear();
      if (add_space_prefix_ && prev_special) escaped.append(kSpmSpace);
      for (char c : f.text) {
        if (c == ' ') {
          escaped.append(kSpmSpace);
        } else {
          escaped.push_back(c);
        }
      }
      EncodeEscaped(escaped, &out);
      prev_special = false;
    }
    return out;
  }

  std::string TokenToBytes(int32_t id, bool render_special) const override {
    if (id < 0 || id >= vocab_size()) return "";
    const int32_t type = TokenType(id);
    const std::string& piece = pieces_[id];
    switch (type) {
      case kTypeControl:
      case kTypeUnknown:
        return render_special ? piece : std::string();
      case kTypeUserDefined:
        return piece;
      case kTypeByte:
        return std::string(1, static_cast<char>(byte_of_token_.at(id)));
      case kTypeNormal: {
        std::string out;
        out.reserve(piece.size());
        for (size_t i = 0; i < piece.size();) {
          if (piece.compare(i, kSpmSpace.size(), kSpmSpace) == 0) {
            out.push_back(' ');
            i += kSpmSpace.size();
          } else {
            out.push_back(piece[i++]);
          }
        }
        return out;
      }
      default:  // unused tokens render as nothing, like control tokens
        return "";
    }
  }

 private:
  void IndexByteTokens() {
    for (int32_t id = 0; id < vocab_size(); ++id) {
      if (TokenType(id) != kTypeByte) continue;
      const std::string& p = pieces_[id];
      unsigned value = 0;
      if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
          std::sscanf(p.c_str() + 3, "%2x", &value) == 1) {
        byte_of_token_[id] = static_cast<uint8_t>(value);
      } else {
        byte_of_token_[id] = 0;
      }
    }
  }

  struct Bigram {
    float score;
    int32_t left;
    int32_t right;
    uint32_t length;
  };
  // Highest score first; on ties the leftmost pair, so results do not depend
  // on heap order.
  struct BigramLess {
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
  };

  void EncodeEscaped(std::string_view text, std::vector<int32_t>* out) const {
    std::vector<Symbol> symbols;
    symbols.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const size_t n = Utf8Length(text, pos);
      const int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back({index - 1, pos + n == text.size() ? -1 : index + 1,
                         static_cast<uint32_t>(pos), static_cast<uint32_t>(n), -1});
      pos += n;
    }
    std::priority_queue<Bigram, std::vector<Bigram>, BigramLess> queue;
    auto try_add = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0) return;
      const uint32_t length = symbols[left].length + symbols[right].length;
      auto it = piece_to_id_.find(text.substr(symbols[left].offset, length));
      if (it == piece_to_id_.end()) return;
      queue.push({scores_[it->second], left, right, length});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);

    while (!queue.empty()) {
      const Bigram top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.left];
      Symbol& right = symbols[top.right];
      // Stale entry: one side has merged since this pair was queued.
      if (left.length == 0 || right.length == 0 || left.length + right.length != top.length) {
        continue;
      }
      left.length += right.length;
      right.length = 0;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.left;
      try_add(left.prev, top.left);
      try_add(top.left, left.next);
    }

    if (symbols.empty()) return;
    for (int32_t i = 0; i != -1; i = symbols[i].next) {
      const std::string_view piece = text.substr(symbols[i].offset, symbols[i].length);
      auto it = piece_to_id_.find(piece);
      if (it != piece_to_id_.end()) {
        out->push_back(it->second);
        continue;
      }
      // Only single characters can be unknown here (merges always produce
      // vocab pieces): spell them as byte tokens.
      for (char c : piece) {
        const int32_t byte_id = byte_ids_[static_cast<uint8_t>(c)];
        if (byte_id >= 0) {
          out->push_back(byte_id);
        } else if (unk_id_ >= 0) {
          out->push_back(unk_id_);
        }
      }
    }
  }

  std::vector<float> scores_;
  bool add_space_prefix_ = true;
  int32_t unk_id_ = -1;
  std::array<int32_t, 256> byte_ids_{};
  std::unordered_map<int32_t, uint8_t> byte_of_token_;
};

// ---------------------------------------------------------------------------
// Byte-level BPE (tokenizer.ggml.model == "gpt2").

// How tokenizer.ggml.pre splits text into words before merging.
enum class PreSplit {
  kGpt2,        // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2Digits,  // every \p{N} isolated first, then the GPT-2 split (smollm, starcoder)
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+   (Llama 3's tokenizer.json)
  kLlama3,
  kQwen2,  // as kLlama3 with \p{N} one at a time (Qwen2's tokenizer.json)
};

absl::StatusOr<PreSplit> PreSplitFor(const std::string& pre) {
  if (pre.empty() || pre == "default" || pre == "gpt2" || pre == "gpt-2" || pre == "mpt" ||
      pre == "olmo" || pre == "jais") {
    return PreSplit::kGpt2;
  }
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r" ||
      pre == "codeshell" || pre == "exaone" || pre == "minerva-7b") {
    return PreSplit::kGpt2Digits;
  }
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") return PreSplit::kLlama3;
  if (pre == "qwen2" || pre == "deepseek-r1-qwen") return PreSplit::kQwen2;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported tokenizer.ggml.pre \"", pre,
                   "\" (supported: default, gpt2, smollm, starcoder, llama-bpe, qwen2 and their "
                   "aliases)"));
}

// Appends the end offsets of the Llama 3 / Qwen2 regex matches within
// cps[begin, end) (see PreSplit::kLlama3). max_digits: 3 (Llama 3) or 1
// (Qwen2).
void SplitLlama3(const std::vector<Codepoint>& cps, size_t begin, size_t end, size_t max_digits,
                 std::vector<size_t>* ends) {
  auto cls = [&](size_t i) { return ClassOf(cps[i].cp); };
  auto lower = [&](size_t i) {
    const uint32_t c = cps[i].cp;
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
  };
  auto newline = [&](size_t i) { return cps[i].cp == '\r' || cps[i].cp == '\n'; };
  size_t pos = begin;
  while (pos < end) {
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (cps[pos].cp == '\'' && pos + 1 < end) {
      const uint32_t c1 = lower(pos + 1);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        pos += 2;
        ends->push_back(pos);
        continue;
      }
      if (pos + 2 < end) {
        const uint32_t c2 = lower(pos + 2);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          pos += 3;
          ends->push_back(pos);
          continue;
        }
      }
    }
    const CharClass c = cls(pos);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    {
      size_t p = pos;
      if (c != CharClass::kLetter && c != CharClass::kNumber && !newline(pos) && pos + 1 < end &&
          cls(pos + 1) == CharClass::kLetter) {
        ++p;
      }
      if (cls(p) == CharClass::kLetter) {
        while (p < end && cls(p) == CharClass::kLetter) ++p;
        ends->push_back(p);
        pos = p;
        continue;
      }
    }
    // \p{N}{1,max_digits}
    if (c == CharClass::kNumber) {
      size_t p = pos;
      while (p < end && p - pos < max_digits && cls(p) == CharClass::kNumber) ++p;
      ends->push_back(p);
      pos = p;
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    {
      const size_t start = (cps[pos].cp == ' ' && pos + 1 < end) ? pos + 1 : pos;
      if (cls(start) == CharClass::kOther) {
        size_t p = start;
        while (p < end && cls(p) == CharClass::kOther) ++p;
        while (p < end && newline(p)) ++p;
        ends->push_back(p);
        pos = p;
        continue;
      }
    }
    // Whitespace: \s*[\r\n]+ ends after the run's last newline; else
    // \s+(?!\S) leaves the run's last character to the next word; else \s+.
    size_t run_end = pos;
    while (run_end < end && cls(run_end) == CharClass::kWhitespace) ++run_end;
    size_t last_nl = run_end;
    for (size_t p = run_end; p > pos; --p) {
      if (newline(p - 1)) {
        last_nl = p - 1;
        break;
      }
    }
    if (last_nl < run_end) {
      pos = last_nl + 1;
    } else if (run_end - pos > 1 && run_end < end) {
      pos = run_end - 1;
    } else {
      pos = std::max(run_end, pos + 1);
    }
    ends->push_back(pos);
  }
}

// Appends the end offsets (in codepoints) of the GPT-2 regex matches within
// cps[begin, end). Lookahead never sees past `end`, as each chunk is matched
// on its own.
void SplitGpt2(const std::vector<Codepoint>& cps, size_t begin, size_t end,
               std::vector<size_t>* ends) {
  auto cls = [&](size_t i) { return ClassOf(cps[i].cp); };
  size_t pos = begin;
  while (pos < end) {
    const uint32_t cp = cps[pos].cp;
    if (cp == '\'' && pos + 1 < end) {
      const uint32_t c1 = cps[pos + 1].cp;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        pos += 2;
        ends->push_back(pos);
        continue;
      }
      if (pos + 2 < end) {
        const uint32_t c2 = cps[pos + 2].cp;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          pos += 3;
          ends->push_back(pos);
          continue;
        }
      }
    }
    // " ?X+" for X in letters, numbers, and everything that is neither
    // those nor whitespace.
    const size_t run_start = (cp == ' ' && pos + 1 < end) ? pos + 1 : pos;
    const CharClass c = cls(run_start);
    if (c != CharClass::kWhitespace) {
      size_t p = run_start + 1;
      while (p < end && cls(p) == c) ++p;
      ends->push_back(p);
      pos = p;
      continue;
    }
    size_t n = 0;
    while (pos + n < end && cls(pos + n) == CharClass::kWhitespace) ++n;
    if (n > 1 && pos + n < end) {
      // \s+(?!\S): leave the last space to prefix the following word.
      pos += n - 1;
    } else {
      pos += std::max<size_t>(n, 1);
    }
    ends->push_back(pos);
  }
}

class BpeTokenizer final : public Tokenizer {
 public:
  absl::Status Load(const GgufFile& file) {
    kind_ = Kind::kBytePairEncoding;
    RETURN_IF_ERROR(LoadCommon(file));
    std::string pre;
    if (file.Has("tokenizer.ggml.pre")) {
      ASSIGN_OR_RETURN(pre, file.GetString("tokenizer.ggml.pre"));
    }
    ASSIGN_OR_RETURN(pre_split_, PreSplitFor(pre));
    // Llama 3's tokenizer.json sets ignore_merges: a word that is a token
    // as a whole is that token (llama.cpp does the same for llama-bpe).
    ignore_merges_ = pre_split_ == PreSplit::kLlama3;
    add_bos_default_ = false;
    if (file.Has("tokenizer.ggml.add_bos_token")) {
      ASSIGN_OR_RETURN(add_bos_default_, file.GetBool("tokenizer.ggml.add_bos_token"));
    }

    // GPT-2's byte-to-unicode map: printable Latin-1 bytes stand for
    // themselves, the rest are shifted to U+0100 onwards so every byte has a
    // visible, non-space character.
    int next = 0;
    cp_to_byte_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : 256 + next++;
      byte_chars_[b].clear();
      AppendUtf8(cp, &byte_chars_[b]);
      cp_to_byte_[cp] = static_cast<int16_t>(b);
      byte_ids_[b] = PieceToId(byte_chars_[b]);
    }

    ASSIGN_OR_RETURN(std::vector<std::string> merges, file.GetStringArray("tokenizer.ggml.merges"));
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const std::string& m = merges[rank];
      const size_t space = m.find(' ', 1);
      if (space == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.ggml.merges[", rank, "] has no space: \"", m, "\""));
      }
      const int32_t left = PieceToId(std::string_view(m).substr(0, space));
      const int32_t right = PieceToId(std::string_view(m).substr(space + 1));
      const int32_t merged = PieceToId(m.substr(0, space) + m.substr(space + 1));
      // A merge whose parts or result are not tokens can never apply to
      // token-valued symbols; skipping it keeps the loop id-based.
      if (left < 0 || right < 0 || merged < 0) continue;
      merges_.emplace(PairKey(left, right), Merge{static_cast<int32_t>(rank), merged});
    }
    return absl::OkStatus();
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
    for (const Fragment& f : SplitOnSpecialTokens(text, parse_special)) {
      if (f.special_id >= 0) {
        out.push_back(f.special_id);
        continue;
      }
      const std::vector<Codepoint> cps = DecodeUtf8(f.text);
      std::vector<size_t> ends;
      PreTokenize(cps, &ends);
      size_t begin = 0;
      for (size_t end : ends) {
        const uint32_t from = cps[begin].offset;
        const uint32_t to = cps[end - 1].offset + cps[end - 1].length;
        EncodeWord(f.text.substr(from, to - from), &out);
        begin = end;
      }
    }
    return out;
  }

  std::string TokenToBytes(int32_t id, bool render_special) const override {
    if (id < 0 || id >= vocab_size()) return "";
    const std::string& piece = pieces_[id];
    switch (TokenType(id)) {
      case kTypeControl:
      case kTypeUnknown:
        return render_special ? piece : std::string();
      case kTypeUserDefined:
        return piece;
      case kTypeNormal: {
        std::string out;
        out.reserve(piece.size());
        for (const Codepoint& c : DecodeUtf8(piece)) {
          if (c.cp < cp_to_byte_.size() && cp_to_byte_[c.cp] >= 0) {
            out.push_back(static_cast<char>(cp_to_byte_[c.cp]));
          } else {
            // Not a byte-level character: pass the text through unchanged.
            out.append(piece, c.offset, c.length);
          }
        }
        return out;
      }
      case kTypeByte: {
        unsigned value = 0;
        if (piece.size() == 6 && std::sscanf(piece.c_str(), "<0x%2x>", &value) == 1) {
          return std::string(1, static_cast<char>(value));
        }
        return "";
      }
      default:
        return "";
    }
  }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  struct Bigram {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;
    int32_t right_id;
  };
  // Lowest rank first; on ties the leftmost pair.
  struct BigramGreater {
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
  };

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  void PreTokenize(const std::vector<Codepoint>& cps, std::vector<size_t>* ends) const {
    if (pre_split_ == PreSplit::kGpt2) {
      SplitGpt2(cps, 0, cps.size(), ends);
      return;
    }
    if (pre_split_ == PreSplit::kLlama3 || pre_split_ == PreSplit::kQwen2) {
      SplitLlama3(cps, 0, cps.size(), pre_split_ == PreSplit::kLlama3 ? 3 : 1, ends);
      return;
    }
    // kGpt2Digits: each number character is a chunk of its own; the text
    // between is split by the GPT-2 rules, which cannot look across a digit.
    size_t begin = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (i < cps.size() && ClassOf(cps[i].cp) != CharClass::kNumber) continue;
      SplitGpt2(cps, begin, i, ends);
      if (i < cps.size()) ends->push_back(i + 1);
      begin = i + 1;
    }
  }

  // Merges the bytes of one pre-tokenized word, lowest merge rank first.
  void EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
    if (word.size() == 1) {  // common (punctuation, single letters): no merging
      const int32_t id = byte_ids_[static_cast<uint8_t>(word[0])];
      if (id >= 0) out->push_back(id);
      return;
    }
    if (ignore_merges_) {
      std::string chars;
      for (char b : word) chars += byte_chars_[static_cast<uint8_t>(b)];
      const int32_t id = PieceToId(chars);
      if (id >= 0) {
        out->push_back(id);
        return;
      }
    }
    std::vector<Symbol> symbols(word.size());
    const int32_t n = static_cast<int32_t>(word.size());
    for (int32_t i = 0; i < n; ++i) {
      symbols[i] = {i - 1, i + 1 == n ? -1 : i + 1, static_cast<uint32_t>(i), 1,
                    byte_ids_[static_cast<uint8_t>(word[i])]};
    }
    std::priority_queue<Bigram, std::vector<Bigram>, BigramGreater> queue;
    auto try_add = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0 || symbols[left].id < 0 || symbols[right].id < 0) return;
      auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
      if (it == merges_.end()) return;
      queue.push({it->second.rank, left, right, symbols[left].id, symbols[right].id});
    };
    for (int32_t i = 1; i < n; ++i) try_add(i - 1, i);

    while (!queue.empty()) {
      const Bigram top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.left];
      Symbol& right = symbols[top.right];
      // Stale entry: a side merged since (its token changed or it is gone).
      if (left.length == 0 || right.length == 0 || left.id != top.left_id ||
          right.id != top.right_id) {
        continue;
      }
      left.id = merges_.at(PairKey(top.left_id, top.right_id)).merged_id;
      left.length += right.length;
      right.length = 0;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.left;
      try_add(left.prev, top.left);
      try_add(top.left, left.next);
    }
    for (int32_t i = 0; i != -1; i = symbols[i].next) {
      // A byte whose character is not in the vocabulary is dropped, as
      // llama.cpp does; GPT-2 vocabularies hold all 256.
      if (symbols[i].id >= 0) out->push_back(symbols[i].id);
    }
  }

  PreSplit pre_split_ = PreSplit::kGpt2;
  bool ignore_merges_ = false;
  std::array<std::string, 256> byte_chars_;
  std::array<int32_t, 256> byte_ids_{};
  std::array<int16_t, 512> cp_to_byte_{};
  std::unordered_map<uint64_t, Merge> merges_;
};

}  // namespace

// ---------------------------------------------------------------------------
// Tokenizer

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
  ASSIGN_OR_RETURN(std::string model, file.GetString("tokenizer.ggml.model"));
  if (model == "llama") {
    auto tok = std::make_unique<SentencePieceTokenizer>();
    RETURN_IF_ERROR(tok->Load(file));
    return tok;
  }
  if (model == "gpt2") {
    auto tok = std::make_unique<BpeTokenizer>();
    RETURN_IF_ERROR(tok->Load(file));
    return tok;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported tokenizer.ggml.model \"", model, "\" (supported: llama, gpt2)"));
}

absl::Status Tokenizer::LoadCommon(const GgufFile& file) {
  ASSIGN_OR_RETURN(pieces_, file.GetStringArray("tokenizer.ggml.tokens"));
  if (pieces_.empty()) return absl::InvalidArgumentError("tokenizer.ggml.tokens is empty");
  if (file.Has("tokenizer.ggml.token_type")) {
    ASSIGN_OR_RETURN(token_types_, file.GetI32Array("tokenizer.ggml.token_type"));
    if (token_types_.size() != pieces_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.token_type has ",
                                                     token_types_.size(), " entries, tokens has ",
                                                     pieces_.size()));
    }
  } else {
    token_types_.assign(pieces_.size(), kTypeNormal);
  }
  piece_to_id_.reserve(pieces_.size());
  for (int32_t id = 0; id < vocab_size(); ++id) {
    // First id wins for duplicate pieces, matching llama.cpp's text_to_token.
    piece_to_id_.emplace(pieces_[id], id);
  }

  auto optional_id = [&](const char* key, int32_t* out) -> absl::Status {
    *out = -1;
    if (!file.Has(key)) return absl::OkStatus();
    ASSIGN_OR_RETURN(int64_t v, file.GetI64(key));
    // Converters write UINT32_MAX for "none".
    if (v >= 0 && v < vocab_size()) *out = static_cast<int32_t>(v);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(optional_id("tokenizer.ggml.bos_token_id", &bos_id_));
  RETURN_IF_ERROR(optional_id("tokenizer.ggml.eos_token_id", &eos_id_));
  int32_t eot_id = -1;
  RETURN_IF_ERROR(optional_id("tokenizer.ggml.eot_token_id", &eot_id));

  eog_ids_.clear();
  if (eos_id_ >= 0) eog_ids_.push_back(eos_id_);
  if (eot_id >= 0) eog_ids_.push_back(eot_id);
  for (const char* p : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"}) {
    const int32_t id = PieceToId(p);
    if (id >= 0) eog_ids_.push_back(id);
  }
  std::sort(eog_ids_.begin(), eog_ids_.end());
  eog_ids_.erase(std::unique(eog_ids_.begin(), eog_ids_.end()), eog_ids_.end());

  special_ids_.clear();
  for (int32_t id = 0; id < vocab_size(); ++id) {
    const int32_t t = token_types_[id];
    if ((t == kTypeControl || t == kTypeUserDefined || t == kTypeUnknown) && !pieces_[id].empty()) {
      special_ids_.push_back(id);
    }
  }
  // Longest first so that a piece containing another wins; stable so equal
  // lengths keep id order and results are deterministic.
  std::stable_sort(special_ids_.begin(), special_ids_.end(),
                   [&](int32_t a, int32_t b) { return pieces_[a].size() > pieces_[b].size(); });
  return absl::OkStatus();
}

std::vector<Tokenizer::Fragment> Tokenizer::SplitOnSpecialTokens(std::string_view text,
                                                                 bool parse_special) const {
  std::vector<Fragment> fragments;
  if (text.empty()) return fragments;
  fragments.push_back({text, -1});
  std::vector<Fragment> next;
  for (int32_t id : special_ids_) {
    if (!parse_special && token_types_[id] != kTypeUserDefined) continue;
    const std::string& piece = pieces_[id];
    next.clear();
    bool changed = false;
    for (const Fragment& f : fragments) {
      if (f.special_id >= 0) {
        next.push_back(f);
        continue;
      }
      size_t start = 0;
      while (true) {
        const size_t hit = f.text.find(piece, start);
        if (hit == std::string_view::npos) break;
        changed = true;
        if (hit > start) next.push_back({f.text.substr(start, hit - start), -1});
        next.push_back({f.text.substr(hit, piece.size()), id});
        start = hit + piece.size();
      }
      if (start < f.text.size()) next.push_back({f.text.substr(start), -1});
    }
    if (changed) fragments.swap(next);
  }
  return fragments;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool render_special) const {
  std::string out;
  for (int32_t id : ids) out += TokenToBytes(id, render_special);
  return out;
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

bool Tokenizer::IsControl(int32_t id) const { return TokenType(id) == kTypeControl; }

int32_t Tokenizer::PieceToId(std::string_view piece) const {
  auto it = piece_to_id_.find(piece);
  return it == piece_to_id_.end() ? -1 : it->second;
}

// ---------------------------------------------------------------------------
// StreamingDetokenizer

namespace {

// Appends to `out` the complete UTF-8 characters at the front of `s` and
// returns how many bytes of `s` they used; an incomplete character at the
// end is left for more bytes to complete. Bytes that cannot be part of a
// valid character become U+FFFD at once: holding them back would stall the
// stream forever.
size_t CompletePrefix(std::string_view s, std::string* out) {
  size_t pos = 0;
  while (pos < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[pos]);
    size_t need = 0;
    if (b < 0x80) {
      need = 1;
    } else if (b >= 0xC2 && b < 0xE0) {
      need = 2;
    } else if (b >= 0xE0 && b < 0xF0) {
      need = 3;
    } else if (b >= 0xF0 && b < 0xF5) {
      need = 4;
    }
    if (need == 0) {  // stray continuation or invalid lead byte
      out->append("\xEF\xBF\xBD");
      ++pos;
      continue;
    }
    size_t have = 1;
    while (have < need && pos + have < s.size() &&
           (static_cast<uint8_t>(s[pos + have]) & 0xC0) == 0x80) {
      ++have;
    }
    if (have == need) {
      out->append(s.substr(pos, need));
      pos += need;
    } else if (pos + have == s.size()) {
      break;  // incomplete character at the end: wait for more bytes
    } else {
      out->append("\xEF\xBF\xBD");  // truncated by a non-continuation byte
      pos += have;
    }
  }
  return pos;
}

}  // namespace

std::string StreamingDetokenizer::Push(int32_t id) {
  pending_ += tokenizer_->TokenToBytes(id);
  std::string out;
  const size_t done = CompletePrefix(pending_, &out);
  pending_.erase(0, done);
  return out;
}

std::string StreamingDetokenizer::Flush() {
  std::string out;
  const size_t done = CompletePrefix(pending_, &out);
  if (done < pending_.size()) out.append("\xEF\xBF\xBD");
  pending_.clear();
  return out;
}

}  // namespace kvserve
