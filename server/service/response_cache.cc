// The implementation of ResponseCache. What it owns and how it is used: the
// opening paragraph of server/service/response_cache.h.

#include "server/service/response_cache.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "grammar/structured_output.h"
#include "server/observe/metrics.h"

namespace kvserve {

const char* CacheHitKindName(CacheHitKind k) {
  switch (k) {
    case CacheHitKind::kOff:
      return "off";
    case CacheHitKind::kBypass:
      return "bypass";
    case CacheHitKind::kMiss:
      return "miss";
    case CacheHitKind::kExact:
      return "exact";
    case CacheHitKind::kSemanticVerified:
      return "semantic-verified";
    case CacheHitKind::kApproximate:
      return "approximate";
  }
  return "off";
}


namespace {

// One SHA-256 through OpenSSL's EVP interface (libcrypto is linked for TLS
// already).
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t n) { EVP_DigestUpdate(ctx_, data, n); }
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  template <typename T>
  void Pod(const T& v) {
    Update(&v, sizeof(v));
  }
  // A tagged, length-prefixed field: no two different field lists serialise
  // to the same bytes.
  void Field(char tag, std::string_view bytes) {
    Pod(tag);
    Pod(static_cast<uint64_t>(bytes.size()));
    Update(bytes);
  }
  template <typename T>
  void FieldPod(char tag, const T& v) {
    Field(tag, std::string_view(reinterpret_cast<const char*>(&v), sizeof(v)));
  }
  template <typename T>
  void FieldVector(char tag, const std::vector<T>& v) {
    Field(tag, std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)));
  }
  std::string HexDigest() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(md), len));
  }

 private:
  EVP_MD_CTX* ctx_;
};

// Bumped whenever the serialisation below or the engine's output for the same
// inputs changes (a new sampler, a fixed detokenizer): old entries die.
constexpr char kKeyVersion[] = "kvserve-response-cache-v1";

}  // namespace

std::string Sha256Hex(std::string_view bytes) {
  Sha256 h;
  h.Update(bytes);
  return h.HexDigest();
}

absl::StatusOr<std::string> ModelFingerprint(const std::string& path, int64_t full_hash_limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("model fingerprint: cannot read ", path));
  in.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  Sha256 h;
  h.Pod(size);
  std::vector<char> buf(1 << 20);
  auto hash_range = [&](int64_t from, int64_t n) -> bool {
    in.clear();
    in.seekg(from);
    while (n > 0) {
      const int64_t want = std::min<int64_t>(n, static_cast<int64_t>(buf.size()));
      in.read(buf.data(), want);
      if (in.gcount() != want) return false;
      h.Update(buf.data(), static_cast<size_t>(want));
      n -= want;
    }
    return true;
  };
  bool ok;
  if (size <= full_hash_limit) {
    ok = hash_range(0, size);
  } else {
    constexpr int64_t kHead = int64_t{64} << 20, kSample = int64_t{1} << 20, kSamples = 256;
    ok = hash_range(0, std::min(size, kHead));
    for (int64_t i = 0; ok && i < kSamples; ++i) {
      const int64_t at = (size - kSample) / (kSamples - 1) * i;
      ok = hash_range(at, std::min(kSample, size - at));
    }
  }
  if (!ok) return absl::DataLossError(absl::StrCat("model fingerprint: short read of ", path));
  return h.HexDigest();
}

std::string TenantFromApiKey(const std::string& api_key) {
  if (api_key.empty()) return "";
  return absl::StrCat("key:", Sha256Hex(api_key).substr(0, 32));
}

std::string ResponseCacheScope(const CacheIdentity& identity, std::string_view tenant,
                               std::string_view cache_salt) {
  Sha256 h;
  h.Field('V', kKeyVersion);
  h.Field('M', identity.model_fingerprint);
  h.Field('N', identity.numerics);
  h.Field('T', tenant);
  h.Field('S', cache_salt);
  return h.HexDigest();
}

std::string ResponseCacheKey(const CacheIdentity& identity, std::string_view tenant,
                             const EngineRequest& r) {
  Sha256 h;
  h.Field('s', ResponseCacheScope(identity, tenant, r.cache_salt));
  h.FieldVector('p', r.prompt);
  const SamplingParams& s = r.params;
  h.FieldPod('t', s.temperature);
  h.FieldPod('k', s.top_k);
  h.FieldPod('P', s.top_p);
  h.FieldPod('m', s.min_p);
  h.FieldPod('r', s.repetition_penalty);
  h.FieldPod('e', s.presence_penalty);
  h.FieldPod('f', s.frequency_penalty);
  h.FieldPod('h', s.has_seed);
  h.FieldPod('d', s.has_seed ? s.seed : uint64_t{0});
  h.FieldPod('x', s.max_tokens);
  h.FieldVector('i', s.stop_token_ids);
  h.FieldPod('#', static_cast<uint64_t>(s.stop.size()));
  for (const std::string& stop : s.stop) h.Field('o', stop);
  h.FieldPod('E', s.ignore_eos);
  h.FieldPod('l', s.logprobs);
  h.FieldPod('n', r.n);
  h.FieldPod('K', static_cast<int32_t>(r.kv_policy.kind));
  if (r.kv_policy.kind != KvPolicy::Kind::kNone) {
    h.FieldPod('1', r.kv_policy.sinks);
    h.FieldPod('2', r.kv_policy.window);
    h.FieldPod('3', r.kv_policy.budget);
  }
  // The grammar shapes the reply as much as the prompt does.
  h.Field('g', r.grammar ? r.grammar->key() : std::string());
  return h.HexDigest();
}

bool CacheableRequest(const EngineRequest& r) {
  return r.params.temperature == 0.0f || r.params.has_seed;
}

bool StorableResponse(const CompletedResponse& response) {
  if (response.aborted() || response.samples.empty()) return false;
  // Computed on K/V a tier re-encoded lossily: not the exact answer its key
  // promises.
  if (response.lossy_kv || response.cached_lossy_tokens > 0) return false;
  for (const CompletedSample& s : response.samples) {
    if (s.finish != FinishReason::kStop && s.finish != FinishReason::kLength) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------

size_t CachedReply::ApproximateBytes() const {
  size_t bytes =
      sizeof(*this) + scope.size() + tenant.size() + 64 /* key */ + 128 /* list and map nodes */;
  for (const CompletedSample& s : response.samples) {
    bytes += sizeof(s) + s.text.size() + s.token_ids.size() * sizeof(int32_t) +
             s.logprobs.size() * sizeof(float);
  }
  for (const auto& c : chunks) bytes += sizeof(c) + c.size() * sizeof(Chunk);
  return bytes;
}

std::vector<SeqEvent> CachedReply::Replay(uint64_t request_id) const {
  std::vector<SeqEvent> events;
  for (size_t i = 0; i < response.samples.size(); ++i) {
    const CompletedSample& s = response.samples[i];
    size_t tok = 0, text = 0;
    int32_t generated = 0;
    auto base = [&] {
      SeqEvent ev;
      ev.request_id = request_id;
      ev.index = s.index;
      ev.prompt_tokens = response.prompt_tokens;
      ev.cached_tokens = response.prompt_tokens;  // nothing was computed
      ev.dropped_tokens = s.dropped_tokens;
      return ev;
    };
    const std::vector<Chunk> none;
    for (const Chunk& c : i < chunks.size() ? chunks[i] : none) {
      SeqEvent ev = base();
      const size_t nt = std::min<size_t>(c.tokens, s.token_ids.size() - tok);
      ev.token_ids.assign(s.token_ids.begin() + tok, s.token_ids.begin() + tok + nt);
      if (tok < s.logprobs.size()) {
        const size_t nl = std::min(nt, s.logprobs.size() - tok);
        ev.logprobs.assign(s.logprobs.begin() + tok, s.logprobs.begin() + tok + nl);
      }
      const size_t nb = std::min<size_t>(c.text_bytes, s.text.size() - text);
      ev.text = s.text.substr(text, nb);
      tok += nt;
      text += nb;
      generated += static_cast<int32_t>(nt);
      ev.completion_tokens = generated;
      events.push_back(std::move(ev));
    }
    SeqEvent last = base();
    // Whatever the chunk list did not cover (a reply stored without one).
    last.token_ids.assign(s.token_ids.begin() + tok, s.token_ids.end());
    if (tok < s.logprobs.size()) last.logprobs.assign(s.logprobs.begin() + tok, s.logprobs.end());
    last.text = s.text.substr(text);
    last.completion_tokens = s.completion_tokens;
    last.finish = s.finish;
    events.push_back(std::move(last));
  }
  return events;
}

ReplyRecorder::ReplyRecorder(int32_t n, int32_t prompt_tokens)
    : acc_(n, prompt_tokens), chunks_(static_cast<size_t>(std::max(1, n))) {}

bool ReplyRecorder::Add(const SeqEvent& ev) {
  {
    absl::MutexLock lock(&mu_);
    // The finish event carries no tokens; an event with text or tokens is a
    // chunk of the stream.
    if (ev.index >= 0 && ev.index < static_cast<int32_t>(chunks_.size()) &&
        ev.finish == FinishReason::kNone && (!ev.token_ids.empty() || !ev.text.empty())) {
      chunks_[ev.index].push_back(
          {static_cast<int32_t>(ev.token_ids.size()), static_cast<int32_t>(ev.text.size())});
    }
  }
  return acc_.Add(ev) && acc_.done();
}

CachedReply ReplyRecorder::Take() {
  CachedReply r;
  r.response = acc_.Take();
  absl::MutexLock lock(&mu_);
  r.chunks = std::move(chunks_);
  return r;
}

// ---------------------------------------------------------------------------

ResponseCache::ResponseCache(ResponseCacheOptions options)
    : options_(options), clock_(options.clock != nullptr ? options.clock : SteadyClock()) {
  stats_.max_bytes = options_.max_bytes;
}

bool ResponseCache::ExpiredLocked(const Entry& e, int64_t now) const {
  return options_.ttl_ns > 0 && now - e.stored_ns >= options_.ttl_ns;
}

void ResponseCache::EraseLocked(List::iterator it) {
  bytes_ -= it->bytes;
  index_.erase(it->key);
  lru_.erase(it);
}

std::shared_ptr<const CachedReply> ResponseCache::Lookup(const std::string& key) {
  absl::MutexLock lock(&mu_);
  ++stats_.lookups;
  auto found = index_.find(key);
  if (found == index_.end()) {
    ++stats_.misses;
    return nullptr;
  }
  List::iterator it = found->second;
  if (ExpiredLocked(*it, clock_->NowNanos())) {
    ++stats_.expirations;
    ++stats_.misses;
    EraseLocked(it);
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it);
  ++stats_.hits_exact;
  return it->reply;
}

std::shared_ptr<const CachedReply> ResponseCache::Peek(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto found = index_.find(key);
  if (found == index_.end()) return nullptr;
  if (ExpiredLocked(*found->second, clock_->NowNanos())) {
    ++stats_.expirations;
    EraseLocked(found->second);
    return nullptr;
  }
  return found->second->reply;
}

bool ResponseCache::Insert(const std::string& key, std::shared_ptr<const CachedReply> reply) {
  const int64_t bytes = static_cast<int64_t>(reply->ApproximateBytes() + key.size());
  absl::MutexLock lock(&mu_);
  if (!enabled() || bytes > options_.max_bytes / 8) {
    ++stats_.store_rejected;
    return false;
  }
  if (auto found = index_.find(key); found != index_.end()) EraseLocked(found->second);
  const int64_t now = clock_->NowNanos();
  // Expired entries go first, then the least recently used.
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (ExpiredLocked(*it, now)) {
      ++stats_.expirations;
      EraseLocked(it);
    }
    it = next;
  }
  while (!lru_.empty() && bytes_ + bytes > options_.max_bytes) {
    ++stats_.evictions;
    EraseLocked(std::prev(lru_.end()));
  }
  lru_.push_front(Entry{key, std::move(reply), bytes, now});
  index_[key] = lru_.begin();
  bytes_ += bytes;
  ++stats_.stores;
  return true;
}

int64_t ResponseCache::Purge(const std::optional<std::string>& tenant,
                             const std::optional<std::string>& scope) {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    const bool match =
        (!tenant || it->reply->tenant == *tenant) && (!scope || it->reply->scope == *scope);
    if (match) {
      EraseLocked(it);
      ++n;
    }
    it = next;
  }
  stats_.purged += n;
  return n;
}

void ResponseCache::CountBypass() {
  absl::MutexLock lock(&mu_);
  ++stats_.bypassed;
}

void ResponseCache::CountStoreRejected() {
  absl::MutexLock lock(&mu_);
  ++stats_.store_rejected;
}

void ResponseCache::CountSemanticHit(CacheHitKind kind, int32_t draft_tokens,
                                     int32_t accepted_tokens) {
  absl::MutexLock lock(&mu_);
  if (kind == CacheHitKind::kSemanticVerified) {
    ++stats_.hits_semantic_verified;
    stats_.verify_draft_tokens += draft_tokens;
    stats_.verify_accepted_tokens += accepted_tokens;
  } else if (kind == CacheHitKind::kApproximate) {
    ++stats_.hits_approximate;
  }
}

void ResponseCache::CountSemanticLookup(bool candidate) {
  absl::MutexLock lock(&mu_);
  ++stats_.semantic_lookups;
  if (candidate) ++stats_.semantic_candidates;
}

ResponseCacheStats ResponseCache::Stats() const {
  absl::MutexLock lock(&mu_);
  ResponseCacheStats s = stats_;
  s.entries = static_cast<int64_t>(lru_.size());
  s.bytes = bytes_;
  return s;
}

void ResponseCache::RenderMetrics(const std::string& labels, std::string* out) const {
  const ResponseCacheStats s = Stats();
  const std::string sep = labels.empty() ? "" : ",";
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, "{",
                    labels, "} ", FormatMetricValue(v), "\n");
  };
  metric("kvserve:response_cache_lookups_total", "counter",
         "Exact response-cache lookups (cacheable requests that did not bypass).",
         static_cast<double>(s.lookups));
  absl::StrAppend(out,
                  "# HELP kvserve:response_cache_hits_total Replies served from the response "
                  "cache, by kind.\n# TYPE kvserve:response_cache_hits_total counter\n");
  const std::pair<const char*, int64_t> kinds[] = {{"exact", s.hits_exact},
                                                   {"semantic-verified", s.hits_semantic_verified},
                                                   {"approximate", s.hits_approximate}};
  for (const auto& [kind, v] : kinds) {
    absl::StrAppend(out, "kvserve:response_cache_hits_total{", labels, sep, "kind=\"", kind, "\"} ",
                    v, "\n");
  }
  metric("kvserve:response_cache_misses_total", "counter", "Exact lookups that found no entry.",
         static_cast<double>(s.misses));
  metric("kvserve:response_cache_bypassed_total", "counter",
         "Requests that skipped the cache (asked to, or sampled without a seed).",
         static_cast<double>(s.bypassed));
  metric("kvserve:response_cache_stores_total", "counter", "Replies stored.",
         static_cast<double>(s.stores));
  metric("kvserve:response_cache_store_rejected_total", "counter",
         "Replies not stored (aborted, too large, or no-store).",
         static_cast<double>(s.store_rejected));
  metric("kvserve:response_cache_evictions_total", "counter",
         "Entries evicted for room (least recently used).", static_cast<double>(s.evictions));
  metric("kvserve:response_cache_expirations_total", "counter", "Entries dropped by the TTL.",
         static_cast<double>(s.expirations));
  metric("kvserve:response_cache_purged_total", "counter", "Entries removed by purges.",
         static_cast<double>(s.purged));
  metric("kvserve:response_cache_entries", "gauge", "Entries in the response cache.",
         static_cast<double>(s.entries));
  metric("kvserve:response_cache_bytes", "gauge", "Bytes the response cache holds.",
         static_cast<double>(s.bytes));
  metric("kvserve:response_cache_max_bytes", "gauge", "The response cache's byte bound.",
         static_cast<double>(s.max_bytes));
  metric("kvserve:response_cache_semantic_lookups_total", "counter",
         "Semantic lookups (requests that opted in and missed the exact cache).",
         static_cast<double>(s.semantic_lookups));
  metric("kvserve:response_cache_semantic_candidates_total", "counter",
         "Semantic lookups that found a candidate at or above the similarity threshold.",
         static_cast<double>(s.semantic_candidates));
  metric("kvserve:response_cache_verify_draft_tokens_total", "counter",
         "Cached-answer tokens offered to the model for verification.",
         static_cast<double>(s.verify_draft_tokens));
  metric("kvserve:response_cache_verify_accepted_tokens_total", "counter",
         "Of those, tokens the model's own greedy decoding kept.",
         static_cast<double>(s.verify_accepted_tokens));
}

}  // namespace kvserve
