// TextEmbedder: turns a text into a fixed-size, L2-normalised vector whose
// dot product with another such vector is their cosine similarity. The
// response cache's semantic index (server/) speaks only this interface; the
// sentence encoder (embed/, a BERT model run on kvserve's own kernels) is one
// implementation, and tests may supply their own.
//
// Thread-safety: Embed may be called from any thread, concurrently;
// an implementation serialises internally where it must.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve {

class TextEmbedder {
 public:
  virtual ~TextEmbedder() = default;

  // The vector's length (384 for all-MiniLM-L6-v2).
  virtual int32_t dim() const = 0;

  // A name that identifies the model and its version (part of cache keys:
  // entries embedded by another model are never compared).
  virtual std::string fingerprint() const = 0;

  // The unit-length embedding of `text`. InvalidArgument for text the
  // embedder cannot take (e.g. not UTF-8); longer inputs are truncated to the
  // model's maximum sequence length, as sentence-transformers does.
  virtual absl::StatusOr<std::vector<float>> Embed(std::string_view text) const = 0;

  // The most tokens one input may take before Embed truncates it (0: not
  // known), and how many `text` takes untruncated (special tokens
  // included): /v1/embeddings refuses an input over the limit rather than
  // embed part of it. Unimplemented when the embedder cannot count.
  virtual int32_t max_tokens() const { return 0; }
  virtual absl::StatusOr<int32_t> CountTokens(std::string_view text) const {
    return absl::UnimplementedError("this embedder does not count tokens");
  }
};

}  // namespace kvserve
