// Tokenizer built from GGUF metadata: SentencePiece-style (`llama`: scores,
// byte fallback) and byte-level BPE (`gpt2`: merges, with the pre-tokenizer
// split named by tokenizer.ggml.pre). Special/control tokens (BOS/EOS, ChatML
// markers) are matched as whole pieces when parse_special is set.
//
// Thread-safety: immutable after construction; Encode/Decode are const and
// safe to call concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/gguf.h"

namespace kvserve {

class Tokenizer {
 public:
  enum class Kind { kSentencePiece, kBytePairEncoding };

  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);
  virtual ~Tokenizer() = default;

  // add_bos: prepend BOS (callers usually pass add_bos_default()).
  // parse_special: text like "<|im_start|>" becomes its control token;
  // otherwise it is tokenized as plain text.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                                      bool parse_special) const = 0;

  // The bytes a token contributes to the output text (byte tokens give one
  // raw byte; SentencePiece "▁" becomes a space; control tokens give "" unless
  // render_special). Pieces may be partial UTF-8.
  virtual std::string TokenToBytes(int32_t id, bool render_special = false) const = 0;

  // Concatenated TokenToBytes (no space is stripped: a SentencePiece
  // encoding of "hi" decodes to " hi", as llama.cpp's token_to_piece gives).
  std::string Decode(absl::Span<const int32_t> ids, bool render_special = false) const;

  Kind kind() const { return kind_; }
  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos_default() const { return add_bos_default_; }
  // End-of-generation: EOS, and control tokens such as <|im_end|> /
  // <|endoftext|> that end a turn.
  bool IsEndOfGeneration(int32_t id) const;
  bool IsControl(int32_t id) const;
  const std::string& Piece(int32_t id) const { return pieces_.at(id); }
  // Token id of an exact piece (e.g. "<|im_end|>"), or -1.
  int32_t PieceToId(std::string_view piece) const;

 protected:
  // GGUF token_type values.
  static constexpr int32_t kTypeNormal = 1;
  static constexpr int32_t kTypeUnknown = 2;
  static constexpr int32_t kTypeControl = 3;
  static constexpr int32_t kTypeUserDefined = 4;
  static constexpr int32_t kTypeUnused = 5;
  static constexpr int32_t kTypeByte = 6;

  // A stretch of the input: plain text, or one special token (id >= 0).
  struct Fragment {
    std::string_view text;
    int32_t special_id = -1;
  };
  // Hash that lets the piece map be probed with a string_view, so the merge
  // loops look up substrings of the input without allocating.
  struct PieceHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  Tokenizer() = default;
  // Reads what both kinds share: pieces, token types, BOS/EOS, EOG set, and
  // builds piece_to_id_ and special_ids_.
  [[nodiscard]] absl::Status LoadCommon(const GgufFile& file);
  // Cuts special-token pieces out of `text`, longest piece first (as
  // llama.cpp does). Control and unknown tokens are only cut with
  // parse_special; user-defined tokens always are.
  std::vector<Fragment> SplitOnSpecialTokens(std::string_view text, bool parse_special) const;
  int32_t TokenType(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < token_types_.size() ? token_types_[id]
                                                                    : kTypeNormal;
  }

  Kind kind_ = Kind::kSentencePiece;
  std::vector<std::string> pieces_;
  std::vector<int32_t> token_types_;  // GGUF token_type (1 normal, 3 control, 6 byte, ...)
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_default_ = false;
  std::vector<int32_t> eog_ids_;
  std::unordered_map<std::string, int32_t, PieceHash, std::equal_to<>> piece_to_id_;
  // Control / user-defined / unknown tokens, longest piece first.
  std::vector<int32_t> special_ids_;
};

// Turns a stream of token ids into text deltas that are always whole UTF-8
// characters: bytes of an incomplete character are held back until the
// character completes (or Flush is called at the end of the stream).
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  // Returns the complete UTF-8 text this token finishes (may be empty).
  std::string Push(int32_t id);
  // Remaining held-back bytes, with invalid sequences replaced by U+FFFD.
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

}  // namespace kvserve
