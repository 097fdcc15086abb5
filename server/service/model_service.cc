// The implementation of ModelService. What it owns and how it is used: the
// opening paragraph of server/service/model_service.h.

#include "server/service/model_service.h"
#include "server/service/tool_calls.h"

#include "server/service/cache_control_service.h"
#include "server/service/tenants.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvserve {

// One thread that runs cache replays in order. Stop runs what is queued
// first, so no accepted request loses its events.
class ReplayThread {
 public:
  ReplayThread() : thread_([this] { Run(); }) {}
  ~ReplayThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::thread thread_;
};

ModelService::~ModelService() = default;

ModelService::ModelService(std::string model_name, LlamaModel* model, const Tokenizer* tokenizer,
                           std::optional<ChatTemplate> chat_template, Engine* engine,
                           ServiceLimits limits, Metrics* metrics)
    : model_name_(std::move(model_name)),
      model_(model),
      tokenizer_(tokenizer),
      chat_template_(std::move(chat_template)),
      engine_(engine),
      limits_(limits),
      metrics_(metrics) {}

// Prepare owns only what the protocols add: the model name, the choice of
// input, chat rendering, the default max_tokens and the kv_policy defaults
// (with the policy's name parsed). Every rule on the engine request itself
// (prompt ids, n, sampling parameters, stop strings, context length,
// cache_salt, kv_policy's numbers) is ValidateEngineRequest's, with the same
// messages the engine would give.
absl::StatusOr<PreparedRequest> ModelService::Prepare(const CompletionParams& p) const {
  if (!p.model.empty() && p.model != model_name_) {
    return absl::NotFoundError(
        absl::StrCat("model '", p.model, "' does not exist; this server serves '", model_name_, "'"));
  }
  const int inputs = p.prompt_text.has_value() + p.prompt_ids.has_value() + p.messages.has_value();
  if (inputs != 1) {
    return absl::InvalidArgumentError("exactly one of prompt or messages must be given");
  }
  const LlamaConfig& c = model_->config();
  PreparedRequest out;
  EngineRequest& r = out.engine;
  out.cache = p.response_cache;
  out.tenant = p.tenant;
  if (p.response_cache.min_similarity &&
      !(*p.response_cache.min_similarity >= -1.0f && *p.response_cache.min_similarity <= 1.0f)) {
    return absl::InvalidArgumentError("response_cache.min_similarity must be in [-1, 1]");
  }
  if (p.prompt_text) {
    // Checked before tokenizing: BOS alone would make an empty text a prompt.
    if (p.prompt_text->empty()) return absl::InvalidArgumentError("prompt is empty");
    out.semantic_text = *p.prompt_text;
    r.prompt = tokenizer_->Encode(*p.prompt_text, p.add_special_tokens && tokenizer_->add_bos_default(),
                                  /*parse_special=*/false);
  } else if (p.prompt_ids) {
    r.prompt = *p.prompt_ids;
  } else {
    if (p.messages->empty()) return absl::InvalidArgumentError("messages is empty");
    if (!chat_template_) {
      // Base models' files (Gemma 3 270M's among them) carry no template.
      return absl::InvalidArgumentError(
          "messages: this model has no usable chat template (the daemon's start-up log says "
          "why); send a plain prompt instead (/v1/completions, gRPC Generate) or restart the "
          "daemon with --chat-template FILE");
    }
    for (const ChatMessage& m : *p.messages) {
      if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool" &&
          m.role != "developer") {
        return absl::InvalidArgumentError(absl::StrCat(
            "messages: role must be system, developer, user, assistant or tool (got '", m.role,
            "')"));
      }
    }
    // The last user message is what a semantic lookup embeds; every other
    // message (the system prompt, earlier turns) must match exactly.
    size_t last_user = p.messages->size();
    for (size_t i = p.messages->size(); i-- > 0;) {
      if ((*p.messages)[i].role == "user") {
        last_user = i;
        break;
      }
    }
    for (size_t i = 0; i < p.messages->size(); ++i) {
      const ChatMessage& m = (*p.messages)[i];
      if (i == last_user) {
        out.semantic_text = m.content;
        absl::StrAppend(&out.semantic_context, "<query>\n");
        continue;
      }
      absl::StrAppend(&out.semantic_context, m.role.size(), ":", m.role, m.content.size(), ":",
                      m.content, "\n");
      if (!m.tool_calls_json.empty() || !m.tool_call_id.empty()) {
        absl::StrAppend(&out.semantic_context, "calls:", m.tool_calls_json.size(), ":",
                        m.tool_calls_json, m.tool_call_id.size(), ":", m.tool_call_id, "\n");
      }
    }
    // The tools shape the answer as much as the messages do.
    if (!p.tools_json.empty()) {
      absl::StrAppend(&out.semantic_context, "tools:", p.tools_json.size(), ":", p.tools_json, "\n");
    }
    const bool tool_rendering = NeedsToolRendering(*p.messages, p.tools_json);
    ASSIGN_OR_RETURN(std::string text,
                     tool_rendering
                         ? RenderChatWithTools(*chat_template_, *p.messages, p.tools_json)
                         : chat_template_->Render(*p.messages, true));
    // The drift guard finds a turn by its reply's content, which a turn
    // that only called tools lacks: tool conversations are not checked.
    if (drift_ != nullptr && !tool_rendering) {
      // The scope keys the remembered renderings like the prefix cache.
      out.drift = drift_->Check(TenantCacheScope(p.cache_tenant, p.cache_salt), *p.messages, text);
      if (out.drift.drift && drift_->canonicalize()) text = out.drift.canonical;
    }
    out.messages = *p.messages;
    out.rendered = text;
    r.prompt = tokenizer_->Encode(text, /*add_bos=*/false, /*parse_special=*/true);
  }

  SamplingParams& s = r.params;
  s.temperature = p.temperature;
  s.top_p = p.top_p;
  s.top_k = p.top_k;
  s.min_p = p.min_p;
  s.repetition_penalty = p.repetition_penalty;
  s.presence_penalty = p.presence_penalty;
  s.frequency_penalty = p.frequency_penalty;
  if (p.seed) {
    s.has_seed = true;
    s.seed = static_cast<uint64_t>(*p.seed);
  }
  s.stop = p.stop;
  s.stop_token_ids = p.stop_token_ids;
  s.ignore_eos = p.ignore_eos;
  s.logprobs = p.logprobs;
  if (p.max_tokens) {
    s.max_tokens = *p.max_tokens;
  } else if (!r.prompt.empty()) {
    // The default fills the context at most; only a prompt that fills it
    // already leaves no room.
    const int64_t room =
        static_cast<int64_t>(c.context_length) - static_cast<int64_t>(r.prompt.size());
    if (room < 1) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: ", r.prompt.size(),
                                                     " tokens leave no room in the context length ",
                                                     c.context_length));
    }
    s.max_tokens = static_cast<int32_t>(std::min<int64_t>(limits_.default_max_tokens, room));
  }
  r.n = p.n;
  r.priority = p.priority;
  r.cache_salt = TenantCacheScope(p.cache_tenant, p.cache_salt);
  out.cache_tenant = p.cache_tenant;
  out.retain = p.retain;
  out.cache_report = p.cache_report;
  if (out.retain) {
    if (!(out.retain->ttl_s > 0)) {
      return absl::InvalidArgumentError("cache_control.retain.ttl_s must be > 0 seconds");
    }
    if (out.retain->tokens < 0) {
      return absl::InvalidArgumentError("cache_control.retain.tokens must be >= 0");
    }
    if (cache_control_ == nullptr) {
      return absl::FailedPreconditionError(
          "cache_control.retain: this server has no prefix cache to retain in");
    }
  }
  if (out.retain || out.cache_report) out.notes = std::make_shared<CacheNotes>();
  ASSIGN_OR_RETURN(r.kv_policy, ResolveKvPolicy(p.kv_policy, limits_.kv_policy));
  if (!p.grammar.empty()) {
    const std::string field = p.grammar_field.empty() ? "structured_outputs" : p.grammar_field;
    if (!GrammarCompiler::Available()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is not supported: ", GrammarCompiler::UnavailableReason()));
    }
    ASSIGN_OR_RETURN(GrammarCompiler * grammars, Grammars());
    absl::StatusOr<std::shared_ptr<const CompiledGrammar>> compiled = grammars->Compile(p.grammar);
    if (!compiled.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", compiled.status().message()));
    }
    r.grammar = *std::move(compiled);
    // A semantic answer must have been made under the same grammar.
    absl::StrAppend(&out.semantic_context, "grammar:", r.grammar->key().size(), ":",
                    r.grammar->key(), "\n");
  }
  if (p.speculative) {
    RETURN_IF_ERROR(ParseSpecMode(*p.speculative, "speculative", &r.speculative,
                                  /*allow_default=*/true));
  }

  RequestLimits limits = engine_->limits();
  limits.max_n = std::min(limits.max_n, limits_.max_n);
  // Whether the KV pool could ever hold the request is admission's call
  // (Start: ResourceExhausted, counted as rejected), not a malformed request.
  limits.num_blocks = 0;
  RETURN_IF_ERROR(ValidateEngineRequest(r, limits));
  out.prompt_tokens = static_cast<int32_t>(r.prompt.size());
  return out;
}

absl::StatusOr<GrammarCompiler*> ModelService::Grammars() const {
  std::lock_guard<std::mutex> lock(grammar_mu_);
  if (grammars_ == nullptr) {
    ASSIGN_OR_RETURN(grammars_, GrammarCompiler::Create(*tokenizer_, model_->config().vocab_size));
  }
  return grammars_.get();
}

namespace {

// Per-request timing for the latency histograms; shared by the sink copies.
struct StreamTiming {
  std::mutex mu;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last;
  bool first = true;
  int32_t open_samples = 0;
};

}  // namespace

StreamSink ModelService::RetainingSink(const PreparedRequest& request, StreamSink sink) {
  // The last sample's final event waits for the retention answer: by then
  // the engine has cached the sequence's blocks (Free precedes the event),
  // and the answer rides in the reply.
  RetainRequest rr;
  rr.tenant = request.cache_tenant;
  rr.salt = request.engine.cache_salt;
  rr.tokens = request.engine.prompt;
  rr.max_tokens = request.retain->tokens;
  rr.ttl_s = request.retain->ttl_s;
  auto remaining = std::make_shared<std::atomic<int32_t>>(request.engine.n);
  std::shared_ptr<CacheNotes> notes = request.notes;
  Engine* engine = engine_;
  return [sink = std::move(sink), rr = std::move(rr), remaining, notes,
          engine](const SeqEvent& ev) {
    if (ev.finish == FinishReason::kNone || remaining->fetch_sub(1) != 1) return sink(ev);
    engine->RetainThen(rr, [sink, notes, ev](absl::StatusOr<RetainAnswer> a) {
      if (notes != nullptr && a.ok()) {
        std::lock_guard<std::mutex> lock(notes->mu);
        notes->retention_json = RetainAnswerJson(*a);
      }
      sink(ev);
    });
  };
}

void ModelService::EnableResponseCache(ResponseCache* cache, CacheIdentity identity) {
  response_cache_ = cache;
  cache_identity_ = std::move(identity);
  if (replay_ == nullptr) replay_ = std::make_unique<ReplayThread>();
  metrics_->AddSection(
      [cache](const std::string& labels, std::string* out) { cache->RenderMetrics(labels, out); });
}

void ModelService::EnableSemanticCache(SemanticIndex* index, const TextEmbedder* embedder,
                                       float default_threshold, SemanticMode default_mode) {
  semantic_ = index;
  embedder_ = embedder;
  embedder_fingerprint_ = embedder->fingerprint();
  semantic_threshold_ = default_threshold;
  semantic_default_ = default_mode;
}

absl::StatusOr<int64_t> ModelService::PurgeResponseCache(
    const std::optional<std::string>& tenant, const std::optional<std::string>& cache_salt) {
  if (response_cache_ == nullptr || !response_cache_->enabled()) {
    return absl::FailedPreconditionError(
        "the response cache is off (start the server with --response-cache-bytes > 0)");
  }
  if (!tenant) return response_cache_->Purge();
  if (cache_salt) {
    return response_cache_->Purge(std::nullopt,
                                  ResponseCacheScope(cache_identity_, *tenant, *cache_salt));
  }
  return response_cache_->Purge(*tenant);
}

void ModelService::EnableCacheControl(std::shared_ptr<CacheControl> control,
                                      TemplateDriftGuard* drift) {
  cache_control_ = std::move(control);
  drift_ = drift;
}

absl::StatusOr<uint64_t> ModelService::Start(PreparedRequest request, StreamSink sink,
                                             CacheOutcome* outcome) {
  if (draining()) {
    metrics_->RequestFinished("rejected");
    return absl::UnavailableError("the server is shutting down");
  }
  if (drift_ != nullptr && request.messages) {
    // The next turn compares its rendering of this history with this one.
    drift_->Remember(request.engine.cache_salt, *request.messages, request.rendered);
  }
  if (request.retain && cache_control_ != nullptr) {
    sink = RetainingSink(request, std::move(sink));
  }
  // The exact cache, before the engine and before admission: a hit costs no
  // KV and no queue slot.
  CacheOutcome local;
  CacheOutcome& oc = outcome != nullptr ? *outcome : local;
  oc = CacheOutcome{};
  const bool cache_on = response_cache_ != nullptr && response_cache_->enabled();
  if (!cache_on) return Submit(std::move(request), std::move(sink));
  const bool cacheable = CacheableRequest(request.engine);
  std::string cache_key;
  if (cacheable) cache_key = ResponseCacheKey(cache_identity_, request.tenant, request.engine);
  if (!request.cache.lookup || !cacheable) {
    oc.kind = CacheHitKind::kBypass;
    response_cache_->CountBypass();
  } else if (std::shared_ptr<const CachedReply> hit = response_cache_->Lookup(cache_key)) {
    oc.kind = CacheHitKind::kExact;
    return Replay(std::move(hit), std::move(sink));
  } else {
    oc.kind = CacheHitKind::kMiss;
  }

  // The semantic layer, for requests that opt in (or whose server does).
  // Sampled requests without a seed may only take `approximate` answers.
  const SemanticMode mode = request.cache.semantic.value_or(semantic_default_);
  std::vector<float> embedding;
  std::string semantic_scope;
  // Embedded to look up (lookup on), or to index the reply (store on).
  const bool semantic_lookup =
      request.cache.lookup && (cacheable || mode == SemanticMode::kApproximate);
  const bool semantic_store = request.cache.store && cacheable;
  if (semantic_ != nullptr && mode != SemanticMode::kOff && !request.semantic_text.empty() &&
      (semantic_lookup || semantic_store)) {
    absl::StatusOr<std::vector<float>> e = embedder_->Embed(request.semantic_text);
    if (e.ok() && static_cast<int32_t>(e->size()) == semantic_->dim()) {
      embedding = std::move(e).value();
      semantic_scope = SemanticScope(cache_identity_, request.tenant, request.engine,
                                     request.semantic_context, embedder_fingerprint_);
    }
  }
  if (!embedding.empty() && semantic_lookup) {
    const float threshold = request.cache.min_similarity.value_or(semantic_threshold_);
    std::optional<SemanticCandidate> c = semantic_->Find(semantic_scope, embedding, threshold);
    response_cache_->CountSemanticLookup(c.has_value());
    const EngineRequest& r = request.engine;
    if (c && mode == SemanticMode::kApproximate &&
        static_cast<int32_t>(c->reply->response.samples.size()) == r.n &&
        c->reply->response.completion_tokens <= static_cast<int64_t>(r.n) * r.params.max_tokens) {
      // Served as is: the client asked for it and is told so.
      oc.kind = CacheHitKind::kApproximate;
      oc.similarity = c->similarity;
      response_cache_->CountSemanticHit(oc.kind, 0, 0);
      return Replay(c->reply, std::move(sink));
    }
    if (c && mode == SemanticMode::kVerified && r.params.temperature == 0.0f && r.n == 1 &&
        r.kv_policy.kind == KvPolicy::Kind::kNone && c->reply->response.samples.size() == 1) {
      // Verified: the cached answer is only a draft the model checks
      // (EngineRequest::draft_tokens); the reply is the model's own.
      std::vector<int32_t> draft = c->reply->response.samples[0].token_ids;
      if (static_cast<int32_t>(draft.size()) > r.params.max_tokens) {
        draft.resize(static_cast<size_t>(r.params.max_tokens));
      }
      if (!draft.empty()) {
        oc.kind = CacheHitKind::kSemanticVerified;
        oc.similarity = c->similarity;
        oc.draft_tokens = static_cast<int32_t>(draft.size());
        request.engine.draft_tokens = std::move(draft);
      }
    }
  }

  const bool store = cacheable && request.cache.store;
  if (!store) response_cache_->CountStoreRejected();
  if (store || oc.kind == CacheHitKind::kSemanticVerified) {
    // Records the stream beside the front end's sink and, once every sample
    // finished by the model, stores the reply (and indexes its query when
    // the request used the semantic layer).
    auto recorder = std::make_shared<ReplyRecorder>(request.engine.n, request.prompt_tokens);
    std::string scope =
        ResponseCacheScope(cache_identity_, request.tenant, request.engine.cache_salt);
    ResponseCache* cache = response_cache_;
    SemanticIndex* semantic = embedding.empty() ? nullptr : semantic_;
    const CacheHitKind kind = oc.kind;
    const int32_t draft_tokens = oc.draft_tokens;
    sink = [recorder, cache, semantic, kind, draft_tokens, store, key = std::move(cache_key),
            scope = std::move(scope), tenant = request.tenant,
            semantic_scope = std::move(semantic_scope), embedding = std::move(embedding),
            inner = std::move(sink)](const SeqEvent& ev) {
      if (recorder->Add(ev)) {
        auto reply = std::make_shared<CachedReply>(recorder->Take());
        if (kind == CacheHitKind::kSemanticVerified) {
          cache->CountSemanticHit(kind, draft_tokens, reply->response.draft_accepted);
        }
        if (!store) {
          // Counted at Start.
        } else if (StorableResponse(reply->response)) {
          reply->scope = scope;
          reply->tenant = tenant;
          if (cache->Insert(key, std::move(reply)) && semantic != nullptr) {
            semantic->Insert(semantic_scope, embedding, key);
          }
        } else {
          cache->CountStoreRejected();
        }
      }
      inner(ev);
    };
  }
  return Submit(std::move(request), std::move(sink));
}

uint64_t ModelService::Replay(std::shared_ptr<const CachedReply> hit, StreamSink sink) {
  const uint64_t id = next_replay_id_.fetch_add(1);
  in_flight_.fetch_add(1);
  replay_->Post([this, hit = std::move(hit), id, sink = std::move(sink)] {
    for (const SeqEvent& ev : hit->Replay(id)) {
      if (ev.finish != FinishReason::kNone) metrics_->RequestFinished(FinishReasonName(ev.finish));
      sink(ev);
    }
    in_flight_.fetch_sub(1);
  });
  return id;
}

absl::StatusOr<uint64_t> ModelService::Submit(PreparedRequest request, StreamSink sink) {
  // Requests accepted but not yet running, counted from our own in-flight
  // number (exact under a burst) minus the engine's last published running
  // count (which lags by at most one step).
  const int64_t queued = in_flight_.load() - engine_->Stats().running;
  if (queued >= limits_.max_queued) {
    metrics_->RequestFinished("rejected");
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many queued requests (", limits_.max_queued, "); retry later"));
  }
  auto timing = std::make_shared<StreamTiming>();
  timing->open_samples = request.engine.n;
  const int32_t prompt_tokens = request.prompt_tokens;
  in_flight_.fetch_add(1);
  std::shared_ptr<RequestBoard::Entry> entry =
      board_.Add(request.engine.prompt, request.engine.cache_salt,
                 request.engine.params.max_tokens, request.engine.n);
  auto wrapped = [this, timing, prompt_tokens, entry,
                  sink = std::move(sink)](const SeqEvent& ev) {
    const auto now = std::chrono::steady_clock::now();
    RequestBoard::OnEvent(entry.get(), static_cast<int32_t>(ev.token_ids.size()),
                          ev.cached_tokens);
    bool request_done = false;
    {
      std::lock_guard<std::mutex> lock(timing->mu);
      if (!ev.token_ids.empty()) {
        if (timing->first) {
          metrics_->ObserveTimeToFirstToken(std::chrono::duration<double>(now - timing->start).count());
          metrics_->AddPromptTokens(prompt_tokens);
          timing->first = false;
        } else {
          metrics_->ObserveInterTokenLatency(std::chrono::duration<double>(now - timing->last).count());
        }
        timing->last = now;
        metrics_->AddGenerationTokens(static_cast<int64_t>(ev.token_ids.size()));
      }
      if (ev.finish != FinishReason::kNone) {
        metrics_->RequestFinished(FinishReasonName(ev.finish));
        request_done = --timing->open_samples == 0;
        if (request_done) {
          metrics_->ObserveEndToEndLatency(std::chrono::duration<double>(now - timing->start).count());
        }
      }
    }
    sink(ev);
    if (request_done) {
      board_.Remove(entry);
      in_flight_.fetch_sub(1);
    }
  };
  auto id = engine_->Submit(std::move(request.engine), std::move(wrapped));
  if (!id.ok()) {
    board_.Remove(entry);
    in_flight_.fetch_sub(1);
    metrics_->RequestFinished("rejected");
    return id.status();
  }
  entry->request_id.store(*id, std::memory_order_relaxed);
  return *id;
}

void ModelService::Cancel(uint64_t request_id) { engine_->Cancel(request_id); }

void ModelService::CancelAll() { engine_->CancelAll(); }

absl::StatusOr<std::vector<int32_t>> ModelService::Tokenize(const std::string& text,
                                                            bool add_special,
                                                            bool parse_special) const {
  return tokenizer_->Encode(text, add_special && tokenizer_->add_bos_default(), parse_special);
}

absl::StatusOr<std::string> ModelService::Detokenize(const std::vector<int32_t>& ids) const {
  for (int32_t t : ids) {
    if (t < 0 || t >= tokenizer_->vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", t, " is outside the vocabulary"));
    }
  }
  return tokenizer_->Decode(ids);
}

absl::StatusOr<int32_t> ModelService::ClearPrefixCache(std::chrono::milliseconds timeout) {
  std::future<int32_t> done = engine_->ClearPrefixCache();
  if (done.wait_for(timeout) != std::future_status::ready) {
    return absl::DeadlineExceededError("the engine did not clear the prefix cache in time");
  }
  const int32_t dropped = done.get();
  if (dropped < 0) return absl::FailedPreconditionError("the prefix cache is disabled");
  return dropped;
}

ModelInfo ModelService::Info() const {
  ModelInfo info;
  info.name = model_name_;
  info.config = model_->config();
  info.block_size = engine_->options().block_size;
  info.kv_blocks = engine_->options().num_blocks;
  info.kv_dtype = std::string(kernels::KvDTypeName(engine_->options().kv_dtype));
  return info;
}

}  // namespace kvserve
