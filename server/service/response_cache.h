// ResponseCache: the exact response cache at kvserve's front door. It maps a
// SHA-256 key over everything that determines a reply (ResponseCacheKey:
// model fingerprint, numerics profile, tenant scope, the templated prompt's
// token ids, every sampling parameter, max_tokens, stop strings and ids, n,
// logprobs, ignore_eos, kv_policy) to a completed reply and the shape of the
// stream that produced it (CachedReply), so that a hit replays the same
// events: the same chunk texts, token ids, log-probabilities and finish
// reasons. Only completed, successful replies of deterministic requests are
// stored (CacheableRequest, StorableResponse): never an error, a
// cancellation or a deadline cut, never a sampled request without a seed.
//
// Bounded by bytes (LRU), with an optional TTL measured on an injectable
// clock. ModelService (server/service/model_service.h) is its only user on the
// serving path, so the gRPC and HTTP front ends share it.
//
// Thread-safety: ResponseCache is thread-safe (one absl::Mutex); a
// CachedReply handed out is immutable and shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache/prefix_cache.h"  // Clock
#include "scheduler/request.h"
#include "server/service/completed_response.h"

namespace kvserve {

class GgufFile;

// What a reply says about the cache. kBypass: the request asked not to
// look up, or cannot be cached (sampled without a seed).
enum class CacheHitKind { kOff, kBypass, kMiss, kExact, kSemanticVerified, kApproximate };
// "off", "bypass", "miss", "exact", "semantic-verified", "approximate".
const char* CacheHitKindName(CacheHitKind k);

// Semantic lookups a request opts into (server/service/semantic_cache.h).
enum class SemanticMode { kOff, kVerified, kApproximate };
// "off", "verified", "approximate"; InvalidArgument naming them otherwise.
[[nodiscard]] absl::StatusOr<SemanticMode> ParseSemanticMode(std::string_view name);

// A request's say over the cache (HTTP `response_cache`, gRPC
// `response_cache`).
struct ResponseCacheControl {
  bool lookup = true;                    // false: never served from the cache
  bool store = true;                     // false: the reply is not stored
  std::optional<SemanticMode> semantic;  // unset: the server's default
  std::optional<float> min_similarity;   // semantic threshold; unset: the server's
};

// What the front end reports with a reply.
struct CacheOutcome {
  CacheHitKind kind = CacheHitKind::kOff;
  float similarity = 0;      // semantic hits: the candidate's cosine similarity
  int32_t draft_tokens = 0;  // semantic-verified: the cached answer's tokens offered
  // semantic-verified: of those, the ones the model kept — known only at the
  // end: front ends read CompletedResponse::draft_accepted.
  int32_t accepted_tokens = 0;
};

// The served model and the numerics it runs with: part of every key, so a
// reply computed by other weights, another tokenizer or chat template, or
// another KV codec is never served.
struct CacheIdentity {
  std::string model_fingerprint;  // ModelFingerprint()
  std::string numerics;           // e.g. "kv=f16;block=16;device=cpu"
};

// SHA-256 (hex) over the GGUF file's bytes: weights, tokenizer and chat
// template all live in it. Files over `full_hash_limit` bytes are digested
// from their size, their first 64 MiB (every header and tokenizer) and 1 MiB
// at 256 evenly spaced offsets, which any re-quantisation or re-export
// changes; an edit of a single weight deep in such a file may go unseen.
[[nodiscard]] absl::StatusOr<std::string> ModelFingerprint(const std::string& path,
                                                           int64_t full_hash_limit = int64_t{4}
                                                                                     << 30);

// The tenant scope of a request authenticated with `api_key` ("" when the
// server has no keys): a digest, so the key itself never sits in memory twice.
std::string TenantFromApiKey(const std::string& api_key);

// Hex SHA-256 of `bytes`.
std::string Sha256Hex(std::string_view bytes);

// The exact key: hex SHA-256 over a length-prefixed, tagged serialisation of
// the identity, the tenant, the client's cache_salt and every output-relevant
// field of the engine request (deadline and priority are not: they change
// when, not what). Fields are length-prefixed, so the salt can never forge
// another tenant's scope.
std::string ResponseCacheKey(const CacheIdentity& identity, std::string_view tenant,
                             const EngineRequest& request);
// The scope an entry belongs to (purges by tenant): identity x tenant x salt.
std::string ResponseCacheScope(const CacheIdentity& identity, std::string_view tenant,
                               std::string_view cache_salt);

// Deterministic: greedy, or sampled from a fixed seed.
bool CacheableRequest(const EngineRequest& request);
// Every sample finished by the model (stop or length), none cut short.
bool StorableResponse(const CompletedResponse& response);

// A stored reply: the response and, per sample, the events that streamed it
// (tokens and text bytes of each), so a replay reproduces the chunks.
struct CachedReply {
  struct Chunk {
    int32_t tokens = 0;
    int32_t text_bytes = 0;
  };
  CompletedResponse response;
  std::vector<std::vector<Chunk>> chunks;  // [sample][event]
  std::string scope;                       // ResponseCacheScope of the request
  std::string tenant;                      // the request's tenant ("" without API keys)

  size_t ApproximateBytes() const;
  // The events to send, in order, for request `request_id` (sample by
  // sample, each closed by its finish event).
  std::vector<SeqEvent> Replay(uint64_t request_id) const;
};

// Builds a CachedReply from a request's events as they stream.
// Thread-safety: Add and Take may be called from different threads (the
// accumulator locks).
class ReplyRecorder {
 public:
  ReplyRecorder(int32_t n, int32_t prompt_tokens);
  // Returns true when the event completed the request.
  bool Add(const SeqEvent& event);
  // REQUIRES: Add returned true, Take not called before.
  CachedReply Take();

 private:
  ResponseAccumulator acc_;
  absl::Mutex mu_;
  std::vector<std::vector<CachedReply::Chunk>> chunks_ ABSL_GUARDED_BY(mu_);
};

struct ResponseCacheOptions {
  int64_t max_bytes = 0;   // 0: the cache stores nothing
  int64_t ttl_ns = 0;      // 0: entries never expire (LRU only)
  Clock* clock = nullptr;  // null: SteadyClock()
};

struct ResponseCacheStats {
  int64_t lookups = 0;
  int64_t hits_exact = 0;
  int64_t hits_semantic_verified = 0;
  int64_t hits_approximate = 0;
  int64_t misses = 0;
  int64_t bypassed = 0;
  int64_t stores = 0;
  int64_t store_rejected = 0;  // not storable (aborted, error, too large, no-store)
  int64_t evictions = 0;       // LRU, for room
  int64_t expirations = 0;     // TTL
  int64_t purged = 0;
  int64_t entries = 0;
  int64_t bytes = 0;
  int64_t max_bytes = 0;
  // Semantic verification: draft tokens offered and accepted.
  int64_t verify_draft_tokens = 0;
  int64_t verify_accepted_tokens = 0;
  int64_t semantic_lookups = 0;
  int64_t semantic_candidates = 0;  // above the threshold
};

class ResponseCache {
 public:
  explicit ResponseCache(ResponseCacheOptions options);

  bool enabled() const { return options_.max_bytes > 0; }

  // The live entry for `key`, or null (counted as a miss). A hit moves the
  // entry to the LRU front; an expired one is dropped.
  std::shared_ptr<const CachedReply> Lookup(const std::string& key);
  // Peeks without counting or touching the LRU (semantic candidates).
  std::shared_ptr<const CachedReply> Peek(const std::string& key);
  // Stores (replacing any entry of the key), evicting least recently used
  // entries for room. A reply larger than an eighth of max_bytes is refused
  // (one answer must not flush the cache). Returns whether it was stored.
  bool Insert(const std::string& key, std::shared_ptr<const CachedReply> reply);
  // Drops the entries of `tenant` (every salt) when set, or of one `scope`
  // when set, or every entry when neither is; returns how many.
  int64_t Purge(const std::optional<std::string>& tenant = std::nullopt,
                const std::optional<std::string>& scope = std::nullopt);

  // Counters the serving path reports into.
  void CountBypass();
  void CountStoreRejected();
  void CountSemanticHit(CacheHitKind kind, int32_t draft_tokens, int32_t accepted_tokens);
  void CountSemanticLookup(bool candidate);

  ResponseCacheStats Stats() const;
  // Prometheus text (kvserve:response_cache_*), labelled with `labels`.
  void RenderMetrics(const std::string& labels, std::string* out) const;

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const CachedReply> reply;
    int64_t bytes = 0;
    int64_t stored_ns = 0;
  };
  using List = std::list<Entry>;

  bool ExpiredLocked(const Entry& e, int64_t now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(List::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ResponseCacheOptions options_;
  Clock* const clock_;
  mutable absl::Mutex mu_;
  List lru_ ABSL_GUARDED_BY(mu_);  // front: most recently used
  absl::flat_hash_map<std::string, List::iterator> index_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  ResponseCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvserve
