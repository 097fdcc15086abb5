// SentenceEncoder: kvserve's own sentence-transformers pipeline for a
// BERT-family model directory as sentence-transformers saves it
// (all-MiniLM-L6-v2: config.json, model.safetensors, tokenizer.json,
// sentence_bert_config.json, 1_Pooling/config.json): WordPiece tokens,
// truncated to max_seq_length, through the BERT encoder, mean-pooled and
// L2-normalised. Implements TextEmbedder for the response cache's semantic
// index.
//
// Thread-safety: immutable after loading; Embed may be called from any
// number of threads at once (each call runs single-threaded on its own
// scratch).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "embed/bert_encoder.h"
#include "embed/bert_tokenizer.h"
#include "embed/embedder.h"

namespace kvserve::embed {

struct SentenceEncoderOptions {
  // Layer weights in F32 (as stored, matches sentence-transformers to
  // ~1e-12 in cosine) or F16 (half the weight traffic; see
  // docs/semantic-cache-encoder.md for its measured accuracy and speed).
  kernels::DType weight_type = kernels::DType::kF32;
};

class SentenceEncoder final : public TextEmbedder {
 public:
  // Loads `dir`. NotFound naming the missing file when the directory or one
  // of its files is absent; InvalidArgument for files that do not parse or
  // a model this encoder does not run (not BERT, pooling other than mean).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SentenceEncoder>> Load(
      const std::string& dir, const SentenceEncoderOptions& options = {});

  int32_t dim() const override { return encoder_.config().hidden; }
  // "kvserve-bert-mean-v1:<xxh3-128 of the model files>:seq<N>:<f32|f16>".
  std::string fingerprint() const override { return fingerprint_; }
  absl::StatusOr<std::vector<float>> Embed(std::string_view text) const override;

  // The ids Embed runs on ([CLS] ... [SEP], truncated to max_seq_length()).
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Tokenize(std::string_view text) const;
  int max_seq_length() const { return max_seq_length_; }
  int32_t max_tokens() const override { return max_seq_length_; }
  absl::StatusOr<int32_t> CountTokens(std::string_view text) const override;

 private:
  SentenceEncoder(BertTokenizer tokenizer, BertEncoder encoder, int max_seq_length,
                  std::string fingerprint)
      : tokenizer_(std::move(tokenizer)),
        encoder_(std::move(encoder)),
        max_seq_length_(max_seq_length),
        fingerprint_(std::move(fingerprint)) {}

  BertTokenizer tokenizer_;
  BertEncoder encoder_;
  int max_seq_length_;
  std::string fingerprint_;
};

// The factory the daemon's --semantic-cache-model flag uses.
[[nodiscard]] absl::StatusOr<std::unique_ptr<TextEmbedder>> LoadSentenceEncoder(
    const std::string& dir, const SentenceEncoderOptions& options = {});

}  // namespace kvserve::embed
