// SemanticIndex: the response cache's semantic layer. Per scope (model x
// tenant x salt x sampling profile x everything of the request but the query
// text: the system prompt, earlier turns, max_tokens, stops, n, ...; see
// SemanticScope) it keeps an HNSW index (hnswlib, inner product over the
// TextEmbedder's unit vectors) from a stored reply's query embedding to its
// exact-cache key (small scopes are scanned exactly; HNSW's graph search
// misses some neighbours on near-tied data). A lookup returns the nearest stored reply of the scope
// whose cosine similarity reaches the threshold; the reply itself lives in
// the ResponseCache (an evicted or expired one is no candidate), so the
// exact cache's byte bound, TTL and purges govern both.
//
// What a candidate is used for is ModelService's decision: for a greedy
// request its tokens become the engine's draft (EngineRequest::draft_tokens,
// verified by the model: the answer cannot change), for an `approximate`
// request it is served as is and labelled so.
//
// Also here: the hook through which the daemon gets its sentence encoder
// (embed/ implements TextEmbedder; the binary that links it registers a
// factory with SetEmbedderFactory).
//
// Thread-safety: SemanticIndex is thread-safe (one absl::Mutex; embedding
// happens outside it, in the caller). The factory registry is set once at
// start-up, before any daemon starts.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "embed/embedder.h"
#include "scheduler/request.h"
#include "server/service/response_cache.h"

namespace kvserve {

// Builds the sentence encoder of --semantic-cache-model DIR.
using EmbedderFactory =
    std::function<absl::StatusOr<std::unique_ptr<TextEmbedder>>(const std::string& model_dir)>;
// Registers the encoder the daemon uses (the lead wires embed/'s here).
void SetEmbedderFactory(EmbedderFactory factory);
// The registered factory's embedder for `model_dir`; Unimplemented when the
// binary has none.
[[nodiscard]] absl::StatusOr<std::unique_ptr<TextEmbedder>> MakeEmbedder(
    const std::string& model_dir);

// The semantic scope of a request: the exact key's scope without the query
// text and without the sampler's randomness (temperature, top_k/p, min_p,
// seed), which `approximate` may cross; plus `context` (what the embedding
// does not see: PreparedRequest::semantic_context) and the embedder.
std::string SemanticScope(const CacheIdentity& identity, std::string_view tenant,
                          const EngineRequest& request, std::string_view context,
                          std::string_view embedder_fingerprint);

struct SemanticIndexOptions {
  int64_t max_entries = 65536;  // over every scope; inserts past it are refused
  // A scope this small is scanned exactly (a few hundred microseconds at
  // dim 384); HNSW answers for larger ones, where its recall is the price
  // of not scanning.
  int32_t exact_scan_limit = 2048;
  int32_t hnsw_m = 16;
  int32_t ef_construction = 100;
  int32_t ef_search = 64;
};

struct SemanticCandidate {
  std::string key;  // the exact-cache key of the stored reply
  std::shared_ptr<const CachedReply> reply;
  float similarity = 0;
};

class SemanticIndex {
 public:
  // `cache` holds the replies (and outlives the index).
  SemanticIndex(int32_t dim, ResponseCache* cache, SemanticIndexOptions options = {});
  ~SemanticIndex();

  int32_t dim() const { return dim_; }

  // The nearest live reply of `scope` with similarity >= min_similarity, or
  // nothing. REQUIRES: embedding.size() == dim(), unit length.
  std::optional<SemanticCandidate> Find(const std::string& scope,
                                        const std::vector<float>& embedding, float min_similarity);
  // Indexes the reply stored under `key`; false when the index is full.
  bool Insert(const std::string& scope, const std::vector<float>& embedding,
              const std::string& key);

  int64_t size() const;

 private:
  struct Scope;
  const int32_t dim_;
  ResponseCache* const cache_;
  const SemanticIndexOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Scope>> scopes_ ABSL_GUARDED_BY(mu_);
  int64_t entries_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvserve
