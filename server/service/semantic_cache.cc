// The implementation of SemanticIndex. What it owns and how it is used: the
// opening paragraph of server/service/semantic_cache.h.

#include "server/service/semantic_cache.h"

#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvserve {

namespace {

absl::Mutex factory_mu;
EmbedderFactory& Factory() {
  static EmbedderFactory* f = new EmbedderFactory();
  return *f;
}

}  // namespace

void SetEmbedderFactory(EmbedderFactory factory) {
  absl::MutexLock lock(&factory_mu);
  Factory() = std::move(factory);
}

absl::StatusOr<std::unique_ptr<TextEmbedder>> MakeEmbedder(const std::string& model_dir) {
  EmbedderFactory f;
  {
    absl::MutexLock lock(&factory_mu);
    f = Factory();
  }
  if (!f) {
    return absl::UnimplementedError(
        "this binary has no sentence encoder linked in (SetEmbedderFactory was never called)");
  }
  return f(model_dir);
}

std::string SemanticScope(const CacheIdentity& identity, std::string_view tenant,
                          const EngineRequest& request, std::string_view context,
                          std::string_view embedder_fingerprint) {
  EngineRequest profile = request;
  profile.prompt.clear();
  profile.draft_tokens.clear();
  // What `approximate` may cross: the sampler's randomness. Penalties,
  // limits and stops stay in (they change what any answer looks like).
  profile.params.temperature = 0;
  profile.params.top_k = 0;
  profile.params.top_p = 1;
  profile.params.min_p = 0;
  profile.params.has_seed = false;
  profile.params.seed = 0;
  return Sha256Hex(absl::StrCat(ResponseCacheKey(identity, tenant, profile), "|", context.size(),
                                ":", std::string(context), "|", std::string(embedder_fingerprint)));
}

struct SemanticIndex::Scope {
  Scope(int32_t dim, size_t capacity, const SemanticIndexOptions& o)
      : space(static_cast<size_t>(dim)),
        index(&space, capacity, static_cast<size_t>(o.hnsw_m),
              static_cast<size_t>(o.ef_construction)) {
    index.setEf(static_cast<size_t>(o.ef_search));
  }
  hnswlib::InnerProductSpace space;
  hnswlib::HierarchicalNSW<float> index;
  absl::flat_hash_map<hnswlib::labeltype, std::string> keys;            // label -> exact key
  absl::flat_hash_map<hnswlib::labeltype, std::vector<float>> vectors;  // for the exact scan
  absl::flat_hash_map<std::string, hnswlib::labeltype> labels;
  hnswlib::labeltype next_label = 0;
  size_t live = 0;
};

SemanticIndex::SemanticIndex(int32_t dim, ResponseCache* cache, SemanticIndexOptions options)
    : dim_(dim), cache_(cache), options_(options) {}

SemanticIndex::~SemanticIndex() = default;

int64_t SemanticIndex::size() const {
  absl::MutexLock lock(&mu_);
  return entries_;
}

std::optional<SemanticCandidate> SemanticIndex::Find(const std::string& scope,
                                                     const std::vector<float>& embedding,
                                                     float min_similarity) {
  if (static_cast<int32_t>(embedding.size()) != dim_) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = scopes_.find(scope);
  if (it == scopes_.end() || it->second->live == 0) return std::nullopt;
  Scope& s = *it->second;
  // A few neighbours: the nearest may be a reply the exact cache has
  // dropped since (then its point goes too).
  std::vector<std::pair<float, hnswlib::labeltype>> nearest;
  if (static_cast<int64_t>(s.live) <= options_.exact_scan_limit) {
    for (const auto& [label, v] : s.vectors) {
      float dot = 0;
      for (int32_t i = 0; i < dim_; ++i)
        dot += v[static_cast<size_t>(i)] * embedding[static_cast<size_t>(i)];
      nearest.push_back({1.0f - dot, label});
    }
  } else {
    auto result = s.index.searchKnn(embedding.data(), std::min<size_t>(4, s.live));
    while (!result.empty()) {
      nearest.push_back(result.top());
      result.pop();
    }
  }
  std::sort(nearest.begin(), nearest.end());  // smallest distance (1 - cosine) first
  for (const auto& [distance, label] : nearest) {
    const float similarity = 1.0f - distance;
    if (similarity < min_similarity) break;
    auto key = s.keys.find(label);
    if (key == s.keys.end()) continue;
    std::shared_ptr<const CachedReply> reply = cache_->Peek(key->second);
    if (reply == nullptr) {
      s.index.markDelete(label);
      s.vectors.erase(label);
      s.labels.erase(key->second);
      s.keys.erase(key);
      --s.live;
      --entries_;
      continue;
    }
    return SemanticCandidate{key->second, std::move(reply), similarity};
  }
  return std::nullopt;
}

bool SemanticIndex::Insert(const std::string& scope, const std::vector<float>& embedding,
                           const std::string& key) {
  if (static_cast<int32_t>(embedding.size()) != dim_) return false;
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Scope>& s = scopes_[scope];
  if (s == nullptr) s = std::make_unique<Scope>(dim_, 64, options_);
  if (auto existing = s->labels.find(key); existing != s->labels.end()) {
    s->index.addPoint(embedding.data(), existing->second);  // hnswlib updates in place
    s->vectors[existing->second] = embedding;
    return true;
  }
  if (entries_ >= options_.max_entries) return false;
  if (s->index.cur_element_count >= s->index.max_elements_) {
    s->index.resizeIndex(s->index.max_elements_ * 2);
  }
  const hnswlib::labeltype label = s->next_label++;
  s->index.addPoint(embedding.data(), label);
  s->keys[label] = key;
  s->vectors[label] = embedding;
  s->labels[key] = label;
  ++s->live;
  ++entries_;
  return true;
}

}  // namespace kvserve
