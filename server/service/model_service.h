// ModelService: what the gRPC and the HTTP front ends share. It validates a
// request (the same rules and messages for both protocols: the protocol's own
// fields here, the engine request through scheduler/request.h's
// ValidateEngineRequest, the rules' one home), turns text or chat messages
// into tokens, submits to the engine with back-pressure, times each stream
// for the metrics, and answers tokenize/model-info/stats calls.
// Only server/ knows it; it speaks absl::Status, and each front end maps
// codes to its protocol (gRPC status / HTTP code).
//
// Thread-safety: every method may be called from any thread. Event sinks run
// on the engine thread and must not block.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/kv_event_log.h"
#include "grammar/structured_output.h"
#include "model/chat_template.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "scheduler/engine.h"
#include "server/service/kv_policy.h"
#include "server/observe/metrics.h"
#include "server/service/request_board.h"
#include "server/service/response_cache.h"
#include "server/service/semantic_cache.h"
#include "server/service/template_drift.h"

namespace kvserve {

// Cache control on a request (docs/cache-control.md): the OpenAI extension
// field cache_control.retain and the gRPC field retain.
struct RetainAsk {
  double ttl_s = 300;
  int32_t tokens = 0;  // retain the prompt's first `tokens` tokens; 0: the whole prompt
};

// What cache control adds to a reply, filled before the reply's last event
// (the retention answer) or before its first (the cache report), as JSON
// text; the front ends add it to the body (kvserve_cache_control).
struct CacheNotes {
  std::mutex mu;
  std::string retention_json;  // guarded by mu
  std::string report_json;     // guarded by mu
};

struct ServiceLimits {
  // Samples per request; the engine's own max_n applies too (the tighter
  // wins). Stop strings are limited by ValidateSamplingParams.
  int32_t max_n = 8;
  int32_t max_queued = 1024;         // waiting requests before RESOURCE_EXHAUSTED
  int32_t default_max_tokens = 256;  // when a request names none
  KvPolicyDefaults kv_policy;        // what a request's kv_policy leaves unset
};

// A request as both protocols express it. Exactly one of prompt_text,
// prompt_ids, messages is used.
struct CompletionParams {
  std::string model;  // empty: the served model
  std::optional<std::string> prompt_text;
  std::optional<std::vector<int32_t>> prompt_ids;
  std::optional<std::vector<ChatMessage>> messages;
  // Chat tool definitions (a JSON array of OpenAI tool objects; "" for
  // none), rendered by server/service/tool_calls.h.
  std::string tools_json;
  std::optional<int32_t> max_tokens;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<int64_t> seed;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  int32_t n = 1;
  bool logprobs = false;
  bool ignore_eos = false;
  int32_t priority = 0;
  bool add_special_tokens = true;  // BOS for text prompts, as the model asks
  std::string cache_salt;          // prefix-cache namespace (tenant isolation)
  // Token eviction; unset (or any field of it unset): ServiceLimits::kv_policy.
  std::optional<KvPolicyParams> kv_policy;
  // Speculative decoding mode name (off, ngram, suffix, default); unset: the
  // server's --speculative.
  std::optional<std::string> speculative;
  // The response cache: the request's own say (bypass, no-store, semantic).
  ResponseCacheControl response_cache;
  // The authenticated tenant (TenantFromApiKey), set by the front end from
  // the credentials it checked, never from the request body: it scopes the
  // response cache, so one tenant never reads another's entries.
  std::string tenant;
  // With tenant keys (--api-keys-file): the tenant the key names, set by the
  // front end; the prefix-cache scope is derived from it (server/service/tenants.h)
  // and cache_salt only narrows it.
  std::string cache_tenant;
  std::optional<RetainAsk> retain;
  bool cache_report = false;  // the reply carries a cache report
  // Grammar-constrained decoding (structured outputs, a forced tool call),
  // and the request field that asked for it, which errors name.
  GrammarSpec grammar;
  std::string grammar_field;
};

struct PreparedRequest {
  EngineRequest engine;
  int32_t prompt_tokens = 0;
  ResponseCacheControl cache;
  std::string tenant;
  // Semantic lookups: the text embedded (a completion's prompt, a chat's last
  // user message) and everything else the answer depends on that the
  // embedding does not see (the other messages), which scopes the index.
  std::string semantic_text;
  std::string semantic_context;
  // Cache control (server/service/cache_control_service.h).
  std::string cache_tenant;
  std::optional<RetainAsk> retain;
  bool cache_report = false;
  std::optional<std::vector<ChatMessage>> messages;  // chat: what was rendered
  std::string rendered;                               // chat: the prompt text
  DriftCheck drift;                                   // chat: the template-drift check
  std::shared_ptr<CacheNotes> notes;                  // set when retain or cache_report
};

// One stream event as the front ends see it (an engine event plus timing).
using StreamSink = std::function<void(const SeqEvent&)>;

struct ModelInfo {
  std::string name;  // the id clients use
  LlamaConfig config;
  int32_t block_size = 0;
  int64_t kv_blocks = 0;
  std::string kv_dtype;
};

class ReplayThread;

class ModelService {
 public:
  ModelService(std::string model_name, LlamaModel* model, const Tokenizer* tokenizer,
               std::optional<ChatTemplate> chat_template, Engine* engine, ServiceLimits limits,
               Metrics* metrics);
  ~ModelService();

  // InvalidArgument naming the field (NotFound for an unknown model): the
  // request as the engine's Submit would judge it, with max_n the tighter of
  // the engine's and ServiceLimits'. Whether the KV pool can hold it is left
  // to Start.
  [[nodiscard]] absl::StatusOr<PreparedRequest> Prepare(const CompletionParams& params) const;

  // Submits; events arrive on `sink` (the last per sample has a finish
  // reason). ResourceExhausted past max_queued waiting requests; Unavailable
  // while draining. With the response cache on, a hit is replayed (from
  // another thread, like the engine's events) instead of computed, and a
  // completed deterministic reply is stored; `outcome`, when given, says
  // which (before the first event can arrive).
  [[nodiscard]] absl::StatusOr<uint64_t> Start(PreparedRequest request, StreamSink sink,
                                               CacheOutcome* outcome = nullptr);
  void Cancel(uint64_t request_id);

  // Turns the response cache on (`cache` outlives the service). Call before
  // serving.
  void EnableResponseCache(ResponseCache* cache, CacheIdentity identity);
  ResponseCache* response_cache() const { return response_cache_; }
  // Turns the semantic layer on (after EnableResponseCache; both pointers
  // outlive the service): requests whose mode (their own, else
  // `default_mode`) is verified or approximate look up and index replies by
  // their query's embedding.
  void EnableSemanticCache(SemanticIndex* index, const TextEmbedder* embedder,
                           float default_threshold, SemanticMode default_mode);
  // Admin purge: every entry (`tenant` unset), or the entries of `tenant`
  // (every salt, or only `cache_salt` when set). Returns the entries dropped;
  // FailedPrecondition when the cache is off.
  [[nodiscard]] absl::StatusOr<int64_t> PurgeResponseCache(
      const std::optional<std::string>& tenant, const std::optional<std::string>& cache_salt);

  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text,
                                                              bool add_special,
                                                              bool parse_special) const;
  [[nodiscard]] absl::StatusOr<std::string> Detokenize(const std::vector<int32_t>& ids) const;
  ModelInfo Info() const;
  EngineStats Stats() const { return engine_->Stats(); }
  // Empties the prefix cache; returns the cached blocks dropped.
  // FailedPrecondition when the prefix cache is off, DeadlineExceeded when
  // the engine does not answer within `timeout`.
  [[nodiscard]] absl::StatusOr<int32_t> ClearPrefixCache(
      std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // The KV event stream, or nullptr when the daemon publishes none.
  KvEventLog* kv_events() const { return kv_events_; }
  void set_kv_events(KvEventLog* log) { kv_events_ = log; }
  const std::string& model_name() const { return model_name_; }

  // Draining: new requests get Unavailable; in-flight ones continue.
  void BeginDrain() { draining_.store(true); }
  // Cancels every request still in flight (end of a drain).
  void CancelAll();
  bool draining() const { return draining_.load(); }
  int64_t in_flight() const { return in_flight_.load(); }

  Metrics* metrics() { return metrics_; }
  // The requests in flight on the engine, for the dashboard.
  RequestBoard* board() { return &board_; }

  // Cache control (retention on requests, template-drift guard); both
  // outlive the service. Call before serving.
  void EnableCacheControl(std::shared_ptr<CacheControl> control, TemplateDriftGuard* drift);
  CacheControl* cache_control() const { return cache_control_.get(); }
  Engine* engine() const { return engine_; }

 private:
  // Hands a cache hit to the replay thread; returns its request id.
  uint64_t Replay(std::shared_ptr<const CachedReply> hit, StreamSink sink);
  // Start with retain: the sink that retains before the last event.
  StreamSink RetainingSink(const PreparedRequest& request, StreamSink sink);
  // The engine path of Start (admission, timing, metrics).
  absl::StatusOr<uint64_t> Submit(PreparedRequest request, StreamSink sink);
  // The grammar compiler over the served vocabulary, made on first use.
  absl::StatusOr<GrammarCompiler*> Grammars() const;

  std::string model_name_;
  LlamaModel* model_;
  const Tokenizer* tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  Engine* engine_;
  ServiceLimits limits_;
  Metrics* metrics_;
  KvEventLog* kv_events_ = nullptr;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  RequestBoard board_;
  ResponseCache* response_cache_ = nullptr;
  CacheIdentity cache_identity_;
  SemanticIndex* semantic_ = nullptr;
  const TextEmbedder* embedder_ = nullptr;
  std::string embedder_fingerprint_;
  float semantic_threshold_ = 0.92f;
  SemanticMode semantic_default_ = SemanticMode::kOff;
  // Replays cache hits off the caller's thread (front ends register a
  // request after Start returns, as with the engine).
  std::unique_ptr<ReplayThread> replay_;
  std::shared_ptr<CacheControl> cache_control_;
  TemplateDriftGuard* drift_ = nullptr;
  std::atomic<uint64_t> next_replay_id_{uint64_t{1} << 62};
  mutable std::mutex grammar_mu_;
  mutable std::unique_ptr<GrammarCompiler> grammars_;  // guarded by grammar_mu_
};

}  // namespace kvserve
