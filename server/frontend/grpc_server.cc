// The implementation of GrpcServer. What it owns and how it is used: the
// opening paragraph of server/frontend/grpc_server.h.

#include "server/frontend/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/kvserve.grpc.pb.h"
#include "common/status.h"
#include "server/service/auth.h"
#include "server/frontend/status_map.h"
#include "server/service/admission.h"
#include "server/service/completed_response.h"
#include "spdlog/spdlog.h"

namespace kvserve {

absl::Status RefuseUnknownProtoFields(const google::protobuf::Message& m, const std::string& where) {
  const google::protobuf::Reflection* refl = m.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown = refl->GetUnknownFields(m);
  if (unknown.field_count() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": field number ", unknown.field(0).number(),
        " is unknown to this server (a newer client's field?); refused rather than ignored"));
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  refl->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_repeated()) {
      for (int i = 0; i < refl->FieldSize(m, f); ++i) {
        RETURN_IF_ERROR(RefuseUnknownProtoFields(refl->GetRepeatedMessage(m, f, i),
                                                 absl::StrCat(where, ".", f->name(), "[", i, "]")));
      }
    } else {
      RETURN_IF_ERROR(
          RefuseUnknownProtoFields(refl->GetMessage(m, f), absl::StrCat(where, ".", f->name())));
    }
  }
  return absl::OkStatus();
}

namespace {

namespace pb = ::kvserve::v1;

constexpr char kServiceName[] = "kvserve.v1.Kvserve";

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(std::string(what) + ": cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void ApplySampling(const pb::SamplingParams& s, CompletionParams* p) {
  if (s.has_max_tokens()) p->max_tokens = s.max_tokens();
  if (s.has_temperature()) p->temperature = s.temperature();
  if (s.has_top_p()) p->top_p = s.top_p();
  p->top_k = s.top_k();
  p->min_p = s.min_p();
  if (s.has_repetition_penalty()) p->repetition_penalty = s.repetition_penalty();
  p->presence_penalty = s.presence_penalty();
  p->frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) p->seed = s.seed();
  p->stop.assign(s.stop().begin(), s.stop().end());
  p->stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  if (s.has_n()) p->n = s.n();
  p->logprobs = s.logprobs();
  p->ignore_eos = s.ignore_eos();
  p->priority = s.priority();
  if (s.has_structured_output()) {
    const pb::StructuredOutput& so = s.structured_output();
    GrammarSpec& g = p->grammar;
    switch (so.kind_case()) {
      case pb::StructuredOutput::kJsonSchema:
        g.kind = GrammarSpec::Kind::kJsonSchema;
        g.text = so.json_schema();
        break;
      case pb::StructuredOutput::kJsonObject:
        if (so.json_object()) g.kind = GrammarSpec::Kind::kJsonObject;
        break;
      case pb::StructuredOutput::kRegex:
        g.kind = GrammarSpec::Kind::kRegex;
        g.text = so.regex();
        break;
      case pb::StructuredOutput::kGrammar:
        g.kind = GrammarSpec::Kind::kEbnf;
        g.text = so.grammar();
        break;
      case pb::StructuredOutput::kChoice:
        g.kind = GrammarSpec::Kind::kChoice;
        g.choices.assign(so.choice().values().begin(), so.choice().values().end());
        break;
      case pb::StructuredOutput::KIND_NOT_SET:
        break;
    }
    g.strict = !so.has_strict() || so.strict();
    p->grammar_field = "structured_output";
  }
}

// Unset fields stay unset, so the server's defaults fill them (Prepare).
std::optional<KvPolicyParams> ToKvPolicy(bool has, const pb::KvPolicy& k) {
  if (!has) return std::nullopt;
  KvPolicyParams p;
  if (!k.policy().empty()) p.policy = k.policy();
  if (k.has_sinks()) p.sinks = k.sinks();
  if (k.has_window()) p.window = k.window();
  if (k.has_budget()) p.budget = k.budget();
  return p;
}

absl::Status ApplyResponseCache(const pb::ResponseCacheOptions& o, ResponseCacheControl* c) {
  if (o.has_lookup()) c->lookup = o.lookup();
  if (o.has_store()) c->store = o.store();
  if (!o.semantic().empty()) {
    absl::StatusOr<SemanticMode> mode = ParseSemanticMode(o.semantic());
    if (!mode.ok()) return mode.status();
    c->semantic = *mode;
  }
  if (o.has_min_similarity()) c->min_similarity = o.min_similarity();
  return absl::OkStatus();
}

// The fields Generate and Chat requests share (cache control, token
// eviction, speculation, sampling, the response cache), read one way.
template <typename Request>
absl::StatusOr<CompletionParams> ApplyShared(const Request& r, CompletionParams p) {
  p.cache_salt = r.cache_salt();
  if (r.has_retain()) p.retain = RetainAsk{r.retain().ttl_s(), r.retain().tokens()};
  p.cache_report = r.cache_report();
  p.kv_policy = ToKvPolicy(r.has_kv_policy(), r.kv_policy());
  if (r.has_speculative()) p.speculative = r.speculative();
  ApplySampling(r.sampling(), &p);
  if (absl::Status st = ApplyResponseCache(r.response_cache(), &p.response_cache); !st.ok()) {
    return st;
  }
  return p;
}

absl::StatusOr<CompletionParams> ToParams(const pb::GenerateRequest& r) {
  RETURN_IF_ERROR(RefuseUnknownProtoFields(r, "GenerateRequest"));
  CompletionParams p;
  p.model = r.model();
  if (!r.prompt().empty() && r.prompt_ids_size() > 0) {
    return absl::InvalidArgumentError("prompt, prompt_ids: set only one of them");
  }
  if (r.prompt_ids_size() > 0) {
    p.prompt_ids.emplace(r.prompt_ids().begin(), r.prompt_ids().end());
  } else {
    p.prompt_text = r.prompt();  // empty is rejected by Prepare, naming the field
  }
  if (r.has_add_special_tokens()) p.add_special_tokens = r.add_special_tokens();
  return ApplyShared(r, std::move(p));
}

absl::StatusOr<CompletionParams> ToParams(const pb::ChatRequest& r) {
  RETURN_IF_ERROR(RefuseUnknownProtoFields(r, "ChatRequest"));
  CompletionParams p;
  p.model = r.model();
  std::vector<ChatMessage> messages;
  messages.reserve(r.messages_size());
  for (const pb::ChatMessage& m : r.messages()) messages.push_back({m.role(), m.content()});
  p.messages = std::move(messages);
  return ApplyShared(r, std::move(p));
}

// The engine enforces deadlines itself too, so a request whose client has
// gone quiet stops computing even before gRPC notices the expiry.
std::chrono::steady_clock::time_point SteadyDeadline(std::chrono::system_clock::time_point d) {
  const auto now = std::chrono::system_clock::now();
  if (d >= now + std::chrono::hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(d - now);
}

// One Generate or Chat stream. The engine thread produces chunks through the
// sink; gRPC threads drive writes and cancellation. At most one write is in
// flight (gRPC allows no more); chunks produced meanwhile wait in `pending`.
//
// Lifetime: gRPC deletes the reactor in OnDone, which follows Finish. The
// sink may outlive it (the engine can deliver events after a cancel), so it
// holds only `shared_` and never touches the reactor once finishing began.
// Reactor methods (StartWrite, Finish) are called outside the mutex because
// gRPC may run reactions such as OnWriteDone inline on the calling thread.
class CompletionStream final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  CompletionStream(const Admission* admission, grpc::CallbackServerContext* ctx,
                   absl::StatusOr<CompletionParams> params, const CallerAuth& auth)
      : service_(admission->service()), shared_(std::make_shared<Shared>()) {
    shared_->stream = this;
    // Scope, validate, report: server/service/admission.h.
    absl::StatusOr<PreparedRequest> prepared =
        params.ok() ? admission->Prepare(*std::move(params), auth, SteadyDeadline(ctx->deadline()))
                    : absl::StatusOr<PreparedRequest>(params.status());
    if (!prepared.ok()) {
      FinishNow(ToGrpc(prepared.status()));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->response.emplace(prepared->engine.n, prepared->prompt_tokens);
      shared_->notes = prepared->notes;
    }
    std::shared_ptr<Shared> shared = shared_;
    absl::StatusOr<uint64_t> id = admission->Start(
        std::move(prepared).value(), [shared](const SeqEvent& ev) { Shared::OnEvent(shared, ev); },
        &shared->cache);
    if (!id.ok()) {
      FinishNow(ToGrpc(id.status()));
      return;
    }
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->request_id = *id;
    shared_->started = true;
  }

  void OnWriteDone(bool ok) override {
    const pb::GenerateResponse* next = nullptr;
    bool finish = false;
    bool cancel_engine = false;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->writing = false;
      if (!ok || shared_->client_cancelled) {
        // The stream is broken or the client left: nothing more can reach it.
        cancel_engine = shared_->started && !shared_->engine_done;
        finish = true;
        status = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
      } else if ((next = shared_->NextWriteLocked()) == nullptr && shared_->engine_done) {
        finish = true;
        status = shared_->FinalStatusLocked();
      }
      if (finish) shared_->finishing = true;
    }
    if (cancel_engine) service_->Cancel(RequestId());
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(status);
  }

  // Client cancel, deadline, or server shutdown past its deadline.
  void OnCancel() override {
    bool cancel_engine = false;
    bool finish = false;
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->client_cancelled = true;
      cancel_engine = shared_->started && !shared_->engine_done;
      id = shared_->request_id;
      // With a write in flight, its OnWriteDone finishes the stream.
      if (!shared_->writing && !shared_->finishing) finish = shared_->finishing = true;
    }
    if (cancel_engine) service_->Cancel(id);
    if (finish) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
  }

  void OnDone() override { delete this; }

 private:
  struct Shared {
    std::mutex mu;
    CompletionStream* stream = nullptr;  // valid until `finishing` is set
    uint64_t request_id = 0;
    bool started = false;      // the engine has the request
    bool engine_done = false;  // every sample has its finish event
    bool writing = false;      // a StartWrite awaits OnWriteDone
    bool finishing = false;    // Finish called (or about to be)
    bool client_cancelled = false;
    // The reply as a whole (made before the request starts): its usage
    // closes the stream, and a cancelled/deadline sample decides the status.
    std::optional<ResponseAccumulator> response;
    CacheOutcome cache;                        // written by Start before any event
    std::shared_ptr<CacheNotes> notes;         // cache control's, when asked
    FinishReason worst = FinishReason::kNone;  // cancelled/deadline outrank stop/length
    std::deque<pb::GenerateResponse> pending;
    // gRPC keeps a pointer to the message until OnWriteDone.
    pb::GenerateResponse in_flight;

    // REQUIRES: mu held. Moves the next chunk in flight, or returns null.
    const pb::GenerateResponse* NextWriteLocked() {
      if (writing || finishing || pending.empty()) return nullptr;
      in_flight = std::move(pending.front());
      pending.pop_front();
      writing = true;
      return &in_flight;
    }

    grpc::Status FinalStatusLocked() const {
      if (worst == FinishReason::kCancelled) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled by the server");
      }
      if (worst == FinishReason::kDeadline) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "request deadline exceeded");
      }
      return grpc::Status::OK;
    }

    // Runs on the engine thread: must not block beyond the short lock.
    static void OnEvent(const std::shared_ptr<Shared>& self, const SeqEvent& ev) {
      pb::GenerateResponse chunk;
      chunk.set_index(ev.index);
      chunk.mutable_token_ids()->Add(ev.token_ids.begin(), ev.token_ids.end());
      chunk.mutable_logprobs()->Add(ev.logprobs.begin(), ev.logprobs.end());
      chunk.set_text(ev.text);
      if (ev.finish != FinishReason::kNone) chunk.set_finish_reason(FinishReasonName(ev.finish));
      CompletionStream* stream = nullptr;
      const pb::GenerateResponse* next = nullptr;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        if (self->finishing) return;  // cancelled: late events go nowhere
        if (self->response->Add(ev) && self->response->done()) {
          self->engine_done = true;
          const CompletedResponse done = self->response->Take();
          self->worst = done.abort_reason;
          pb::Usage* usage = chunk.mutable_usage();
          usage->set_prompt_tokens(done.prompt_tokens);
          usage->set_cached_prompt_tokens(std::min(done.cached_tokens, done.prompt_tokens));
          usage->set_cached_host_tokens(done.cached_host_tokens);
          usage->set_cached_disk_tokens(done.cached_disk_tokens);
          usage->set_cached_lossy_tokens(done.cached_lossy_tokens);
          usage->set_completion_tokens(static_cast<int32_t>(done.completion_tokens));
          usage->set_dropped_tokens(static_cast<int32_t>(
              std::min<int64_t>(done.dropped_tokens, std::numeric_limits<int32_t>::max())));
          if (self->notes != nullptr) {
            std::lock_guard<std::mutex> nl(self->notes->mu);
            std::string j = "{";
            if (!self->notes->retention_json.empty()) {
              j += "\"retention\":" + self->notes->retention_json;
            }
            if (!self->notes->report_json.empty()) {
              if (j.size() > 1) j += ",";
              j += "\"report\":" + self->notes->report_json;
            }
            chunk.set_cache_control_json(j + "}");
          }
          if (self->cache.kind != CacheHitKind::kOff) {
            pb::CacheInfo* info = chunk.mutable_cache();
            info->set_kind(CacheHitKindName(self->cache.kind));
            info->set_similarity(self->cache.similarity);
            info->set_draft_tokens(self->cache.draft_tokens);
            info->set_accepted_tokens(done.draft_accepted);
          }
        }
        self->pending.push_back(std::move(chunk));
        next = self->NextWriteLocked();
        stream = self->stream;
      }
      if (next != nullptr) stream->StartWrite(next);
    }
  };

  uint64_t RequestId() {
    std::lock_guard<std::mutex> lock(shared_->mu);
    return shared_->request_id;
  }

  void FinishNow(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->finishing = true;
    }
    Finish(status);
  }

  ModelService* service_;
  std::shared_ptr<Shared> shared_;
};

// A stream answered at once (authentication failure, no event log).
template <typename Response>
class RejectedStream final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit RejectedStream(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

// Threads that do blocking work for RPCs (event subscribers, cache clears)
// so that gRPC's callback threads never wait. A thread hands its own handle
// to the next Spawn (or JoinAll) to join when it ends.
class BackgroundThreads {
 public:
  ~BackgroundThreads() { JoinAll(); }

  // Runs `fn` on a new thread; false once JoinAll has begun.
  bool Spawn(std::function<void()> fn) {
    std::vector<std::thread> ended;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return false;
      ended.swap(ended_);
      const uint64_t id = next_id_++;
      // Created under the lock, so the thread's exit (which takes it) always
      // finds its own entry.
      running_.emplace(id, std::thread([this, id, fn = std::move(fn)] {
                         fn();
                         std::lock_guard<std::mutex> lock(mu_);
                         auto self = running_.find(id);
                         if (self == running_.end()) return;  // JoinAll holds the handle
                         ended_.push_back(std::move(self->second));
                         running_.erase(self);
                       }));
    }
    for (std::thread& t : ended) t.join();
    return true;
  }

  // REQUIRES: the caller has made every running `fn` return soon.
  void JoinAll() {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (auto& [id, t] : running_) threads.push_back(std::move(t));
      running_.clear();
      for (std::thread& t : ended_) threads.push_back(std::move(t));
      ended_.clear();
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  std::mutex mu_;
  std::map<uint64_t, std::thread> running_;  // guarded by mu_
  std::vector<std::thread> ended_;           // guarded by mu_; returned from fn
  uint64_t next_id_ = 0;                     // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
};

// Messages stay far below gRPC's default 4 MB limit.
constexpr size_t kMaxKvMessageBytes = 1 << 20;
constexpr size_t kMaxKvEventsPerRead = 512;
// How long a subscriber thread waits in one Read before it looks at its
// stream again (a cancel or shutdown is noticed within this).
constexpr auto kKvReadWait = std::chrono::milliseconds(200);

void ToProto(const KvCacheEvent& e, pb::KvBlockStored* out) {
  out->set_block_hash(e.block_hash);
  out->set_parent_hash(e.parent_hash);
  out->mutable_token_ids()->Add(e.token_ids.begin(), e.token_ids.end());
  out->set_token_count(static_cast<int32_t>(e.token_ids.size()));
  out->set_tier(static_cast<pb::KvTier>(e.tier));
  out->set_group_idx(e.group);
}

void ToProto(const SequencedKvEvent& e, pb::KvEvent* out) {
  out->set_sequence(e.sequence);
  switch (e.event.kind) {
    case KvCacheEvent::Kind::kBlockStored:
      ToProto(e.event, out->mutable_block_stored());
      break;
    case KvCacheEvent::Kind::kBlockRemoved:
      out->mutable_block_removed()->set_block_hash(e.event.block_hash);
      out->mutable_block_removed()->set_moved_to(static_cast<pb::KvTier>(e.event.moved_to));
      out->mutable_block_removed()->set_tier(static_cast<pb::KvTier>(e.event.tier));
      out->mutable_block_removed()->set_group_idx(e.event.group);
      break;
    case KvCacheEvent::Kind::kAllCleared:
      out->mutable_all_cleared()->set_group_idx(e.event.group);
      break;
  }
}

// The messages of one KvEventLog::Read: snapshot chunks, then events in
// batches, each under kMaxKvMessageBytes. Advances *position to the last
// sequence delivered.
std::vector<pb::KvEventsResponse> ToMessages(const KvEventRead& r, uint64_t epoch,
                                            uint64_t* position) {
  std::vector<pb::KvEventsResponse> out;
  if (r.is_snapshot) {
    pb::KvEventsResponse msg;
    size_t bytes = 0;
    auto start_chunk = [&] {
      msg.Clear();
      msg.set_epoch(epoch);
      msg.set_sequence(r.snapshot_sequence);
      msg.mutable_snapshot()->set_as_of_sequence(r.snapshot_sequence);
      msg.mutable_snapshot()->set_index(static_cast<uint32_t>(out.size()));
      bytes = 0;
    };
    start_chunk();
    for (const KvCacheEvent& e : r.snapshot) {
      pb::KvBlockStored block;
      ToProto(e, &block);
      const size_t size = block.ByteSizeLong() + 8;  // tag and length prefix
      if (bytes > 0 && bytes + size > kMaxKvMessageBytes) {
        out.push_back(std::move(msg));
        start_chunk();
      }
      *msg.mutable_snapshot()->add_blocks() = std::move(block);
      bytes += size;
    }
    msg.mutable_snapshot()->set_last(true);
    out.push_back(std::move(msg));
    *position = r.snapshot_sequence;
  }
  pb::KvEventsResponse msg;
  size_t bytes = 0;
  for (const SequencedKvEvent& e : r.events) {
    pb::KvEvent event;
    ToProto(e, &event);
    const size_t size = event.ByteSizeLong() + 8;
    if (bytes > 0 && bytes + size > kMaxKvMessageBytes) {
      out.push_back(std::move(msg));
      msg.Clear();
      bytes = 0;
    }
    *msg.add_events() = std::move(event);
    msg.set_sequence(e.sequence);
    msg.set_epoch(epoch);
    bytes += size;
    *position = e.sequence;
  }
  if (msg.events_size() > 0) out.push_back(std::move(msg));
  return out;
}

// One SubscribeKvEvents stream. A background thread reads the event log
// (which blocks, so not on a gRPC thread) and queues messages; gRPC threads
// drive the writes. The thread reads again only once its last messages are
// written, so a slow subscriber holds at most one read's worth in memory;
// the log keeps the rest, or hands the laggard a snapshot.
//
// Lifetime: gRPC deletes the reactor after OnDone; `Shared` lives on with
// the thread, which never touches the reactor once `finishing` is set.
// Reactor methods are called outside the mutex (gRPC may run reactions
// inline), as in CompletionStream.
class KvEventStream final : public grpc::ServerWriteReactor<pb::KvEventsResponse> {
 public:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    KvEventStream* stream = nullptr;  // valid until `finishing` is set
    std::deque<pb::KvEventsResponse> pending;
    pb::KvEventsResponse in_flight;  // gRPC reads it until OnWriteDone
    bool writing = false;
    bool finish_requested = false;  // the stream is over; Finish once no write is in flight
    bool finishing = false;         // Finish called (or about to be)
    bool server_stopping = false;
    grpc::Status final_status;

    // REQUIRES: mu held.
    const pb::KvEventsResponse* NextWriteLocked() {
      if (writing || finish_requested || pending.empty()) return nullptr;
      in_flight = std::move(pending.front());
      pending.pop_front();
      writing = true;
      return &in_flight;
    }

    // Any thread: ends the stream with `status` (the first request wins).
    void RequestFinish(const grpc::Status& status) {
      KvEventStream* s = nullptr;
      grpc::Status final;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!finish_requested) {
          finish_requested = true;
          final_status = status;
          pending.clear();
        }
        // With a write in flight, its OnWriteDone finishes.
        if (!writing && !finishing) {
          finishing = true;
          s = stream;
          final = final_status;
        }
      }
      cv.notify_all();
      if (s != nullptr) s->Finish(final);
    }

    void Enqueue(std::vector<pb::KvEventsResponse> messages) {
      const pb::KvEventsResponse* next = nullptr;
      KvEventStream* s = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (finish_requested) return;
        for (pb::KvEventsResponse& m : messages) pending.push_back(std::move(m));
        next = NextWriteLocked();
        s = stream;
      }
      if (next != nullptr) s->StartWrite(next);
    }

    // Blocks until everything queued is written. False when the stream is
    // ending (cancelled, failed, or the server stops).
    bool WaitDrained() {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock,
              [&] { return finish_requested || server_stopping || (pending.empty() && !writing); });
      return !finish_requested && !server_stopping;
    }
  };

  KvEventStream() : shared_(std::make_shared<Shared>()) { shared_->stream = this; }

  std::shared_ptr<Shared> shared() const { return shared_; }

  // The subscriber thread's body.
  static void Serve(const std::shared_ptr<Shared>& shared, KvEventLog* log, uint64_t after) {
    while (shared->WaitDrained()) {
      KvEventRead r = log->Read(after, kMaxKvEventsPerRead, kKvReadWait);
      if (r.closed) break;
      std::vector<pb::KvEventsResponse> messages = ToMessages(r, log->epoch(), &after);
      if (!messages.empty()) shared->Enqueue(std::move(messages));
    }
    // No-op when the client is gone already.
    shared->RequestFinish(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down"));
  }

  void OnWriteDone(bool ok) override {
    const pb::KvEventsResponse* next = nullptr;
    bool finish = false;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->writing = false;
      if (!ok && !shared_->finish_requested) {
        shared_->finish_requested = true;
        shared_->final_status = grpc::Status(grpc::StatusCode::CANCELLED, "stream broken");
        shared_->pending.clear();
      }
      if (shared_->finish_requested) {
        if (!shared_->finishing) finish = shared_->finishing = true;
        status = shared_->final_status;
      } else {
        next = shared_->NextWriteLocked();
      }
    }
    shared_->cv.notify_all();
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(status);
  }

  void OnCancel() override {
    shared_->RequestFinish(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
  }

  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Shared> shared_;
};

class KvserveService final : public pb::Kvserve::CallbackService {
 public:
  KvserveService(ModelService* service, std::string api_key,
                 std::shared_ptr<const TenantKeys> tenant_keys = nullptr,
                 CacheControlService* cache_control = nullptr)
      : service_(service),
        admission_(service, api_key, cache_control),
        auth_(std::move(api_key), std::move(tenant_keys)),
        cache_control_(cache_control) {}

  grpc::ServerWriteReactor<pb::GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const pb::GenerateRequest* request) override {
    CallerAuth who;
    if (grpc::Status auth = Authorize(ctx, &who, /*admin_only=*/false); !auth.ok()) {
      return new RejectedStream<pb::GenerateResponse>(auth);
    }
    return new CompletionStream(&admission_, ctx, ToParams(*request), who);
  }

  grpc::ServerWriteReactor<pb::GenerateResponse>* Chat(grpc::CallbackServerContext* ctx,
                                                       const pb::ChatRequest* request) override {
    CallerAuth who;
    if (grpc::Status auth = Authorize(ctx, &who, /*admin_only=*/false); !auth.ok()) {
      return new RejectedStream<pb::GenerateResponse>(auth);
    }
    return new CompletionStream(&admission_, ctx, ToParams(*request), who);
  }

  grpc::ServerUnaryReactor* CacheControl(grpc::CallbackServerContext* ctx,
                                         const pb::CacheControlRequest* request,
                                         pb::CacheControlResponse* response) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    CallerAuth who;
    if (grpc::Status auth = Authorize(ctx, &who, /*admin_only=*/false); !auth.ok()) {
      reactor->Finish(auth);
      return reactor;
    }
    if (cache_control_ == nullptr) {
      reactor->Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                   "cache control needs the prefix cache (drop --no-prefix-cache)"));
      return reactor;
    }
    // Waits for the engine (and may warm a prompt): off the gRPC thread.
    CacheControlService* cc = cache_control_;
    const bool spawned = threads_.Spawn([cc, reactor, response, who, op = request->op(),
                                         body = request->body_json()] {
      JsonReply r = cc->Handle(op, body, who);
      if (r.body.contains("error")) {
        grpc::StatusCode code = grpc::StatusCode::INTERNAL;
        switch (r.status) {
          case 400: code = grpc::StatusCode::INVALID_ARGUMENT; break;
          case 403: code = grpc::StatusCode::PERMISSION_DENIED; break;
          case 404: code = grpc::StatusCode::NOT_FOUND; break;
          case 409: code = grpc::StatusCode::FAILED_PRECONDITION; break;
          case 503: code = grpc::StatusCode::UNAVAILABLE; break;
          case 504: code = grpc::StatusCode::DEADLINE_EXCEEDED; break;
          default: break;
        }
        reactor->Finish(grpc::Status(code, r.body["error"].value("message", std::string("error"))));
        return;
      }
      response->set_body_json(r.body.dump());
      reactor->Finish(grpc::Status::OK);
    });
    if (!spawned) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down"));
    }
    return reactor;
  }

  grpc::ServerWriteReactor<pb::KvEventsResponse>* SubscribeKvEvents(
      grpc::CallbackServerContext* ctx, const pb::SubscribeKvEventsRequest* request) override {
    using Rejected = RejectedStream<pb::KvEventsResponse>;
    if (grpc::Status auth = Authorize(ctx); !auth.ok()) return new Rejected(auth);
    KvEventLog* log = service_->kv_events();
    if (log == nullptr) {
      return new Rejected(grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          "the daemon publishes no KV events: the prefix cache is off (serve --prefix-cache)"));
    }
    auto* stream = new KvEventStream();
    std::shared_ptr<KvEventStream::Shared> shared = stream->shared();
    {
      std::lock_guard<std::mutex> lock(subscribers_mu_);
      std::erase_if(subscribers_, [](const auto& w) { return w.expired(); });
      subscribers_.push_back(shared);
    }
    // Past every sequence the log has published: Read answers with a snapshot.
    // Sequence numbers of another epoch (a restarted daemon) mean nothing here.
    const bool other_epoch = request->epoch() != 0 && request->epoch() != log->epoch();
    const uint64_t after = request->snapshot() || other_epoch
                               ? std::numeric_limits<uint64_t>::max()
                               : request->after_sequence();
    if (!threads_.Spawn([shared, log, after] { KvEventStream::Serve(shared, log, after); })) {
      shared->RequestFinish(
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down"));
    }
    return stream;
  }

  grpc::ServerUnaryReactor* ClearPrefixCache(grpc::CallbackServerContext* ctx,
                                             const pb::ClearPrefixCacheRequest* /*request*/,
                                             pb::ClearPrefixCacheResponse* response) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (grpc::Status auth = Authorize(ctx); !auth.ok()) {
      reactor->Finish(auth);
      return reactor;
    }
    // The engine clears at its next step; wait for it off the gRPC thread.
    ModelService* service = service_;
    const bool spawned = threads_.Spawn([service, reactor, response] {
      absl::StatusOr<int32_t> cleared = service->ClearPrefixCache();
      if (!cleared.ok()) {
        reactor->Finish(ToGrpc(cleared.status()));
        return;
      }
      response->set_blocks_cleared(*cleared);
      reactor->Finish(grpc::Status::OK);
    });
    if (!spawned) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down"));
    }
    return reactor;
  }

  // Ends every event stream (UNAVAILABLE) and waits for the background
  // threads, so that a server shutdown need not wait for subscribers, who
  // never leave by themselves.
  void StopBackgroundWork() {
    std::vector<std::shared_ptr<KvEventStream::Shared>> live;
    {
      std::lock_guard<std::mutex> lock(subscribers_mu_);
      for (const auto& w : subscribers_) {
        if (auto s = w.lock()) live.push_back(std::move(s));
      }
      subscribers_.clear();
    }
    for (const auto& s : live) {
      {
        std::lock_guard<std::mutex> lock(s->mu);
        s->server_stopping = true;
      }
      s->cv.notify_all();
    }
    // Wakes subscriber threads blocked in Read at once.
    if (KvEventLog* log = service_->kv_events()) log->Close();
    threads_.JoinAll();
  }

  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx,
                                     const pb::TokenizeRequest* request,
                                     pb::TokenizeResponse* response) override {
    return Unary(ctx, [&]() -> grpc::Status {
      if (grpc::Status s = CheckModel(request->model()); !s.ok()) return s;
      absl::StatusOr<std::vector<int32_t>> ids = service_->Tokenize(
          request->text(), request->has_add_special_tokens() ? request->add_special_tokens() : true,
          request->parse_special());
      if (!ids.ok()) return ToGrpc(ids.status());
      response->mutable_token_ids()->Add(ids->begin(), ids->end());
      return grpc::Status::OK;
    });
  }

  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* ctx,
                                       const pb::DetokenizeRequest* request,
                                       pb::DetokenizeResponse* response) override {
    return Unary(ctx, [&]() -> grpc::Status {
      if (grpc::Status s = CheckModel(request->model()); !s.ok()) return s;
      absl::StatusOr<std::string> text = service_->Detokenize(
          std::vector<int32_t>(request->token_ids().begin(), request->token_ids().end()));
      if (!text.ok()) return ToGrpc(text.status());
      response->set_text(*std::move(text));
      return grpc::Status::OK;
    });
  }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const pb::GetModelInfoRequest* /*request*/,
                                         pb::ModelInfo* response) override {
    return Unary(ctx, [&]() -> grpc::Status {
      const ModelInfo info = service_->Info();
      const LlamaConfig& c = info.config;
      response->set_name(info.name);
      response->set_architecture(c.architecture);
      response->set_n_layers(c.n_layers);
      response->set_dim(c.dim);
      response->set_n_heads(c.n_heads);
      response->set_n_kv_heads(c.n_kv_heads);
      response->set_head_dim(c.head_dim);
      response->set_vocab_size(c.vocab_size);
      response->set_context_length(c.context_length);
      response->set_block_size(info.block_size);
      response->set_kv_blocks(info.kv_blocks);
      response->set_kv_dtype(info.kv_dtype);
      return grpc::Status::OK;
    });
  }

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const pb::GetStatsRequest* /*request*/,
                                     pb::Stats* response) override {
    return Unary(ctx, [&]() -> grpc::Status {
      const EngineStats s = service_->Stats();
      response->set_blocks_total(s.blocks_total);
      response->set_blocks_used(s.blocks_used);
      response->set_blocks_free(s.blocks_free);
      response->set_kv_utilization(s.kv_utilization);
      response->set_slot_efficiency(s.slot_efficiency);
      response->set_mean_slot_efficiency(s.mean_slot_efficiency);
      response->set_mean_contiguous_request_efficiency(s.mean_contiguous_request_efficiency);
      response->set_mean_contiguous_context_efficiency(s.mean_contiguous_context_efficiency);
      response->set_preemptions(s.preemptions);
      response->set_running(s.running);
      response->set_waiting(s.waiting);
      response->set_steps(s.steps);
      response->set_last_batch_seqs(s.last_batch_seqs);
      response->set_last_batch_tokens(s.last_batch_tokens);
      response->set_mean_batch_seqs(s.mean_batch_seqs);
      response->set_mean_batch_tokens(s.mean_batch_tokens);
      response->set_prompt_tokens_total(s.prompt_tokens_total);
      response->set_generation_tokens_total(s.generation_tokens_total);
      response->set_requests_finished(s.requests_finished);
      response->set_requests_cancelled(s.requests_cancelled);
      response->set_prefix_cache_enabled(s.prefix_cache_enabled);
      response->set_prefix_queries(s.prefix_queries);
      response->set_prefix_query_tokens(s.prefix_query_tokens);
      response->set_prefix_hit_tokens(s.prefix_hit_tokens);
      response->set_prefix_inserted_blocks(s.prefix_inserted_blocks);
      response->set_prefix_evicted_blocks(s.prefix_evicted_blocks);
      response->set_prefix_cached_blocks(s.prefix_cached_blocks);
      response->set_prefix_evictable_blocks(s.prefix_evictable_blocks);
      response->set_last_batch_prefill_tokens(s.last_batch_prefill_tokens);
      response->set_last_token_budget(s.last_token_budget);
      response->set_step_fixed_ms(s.step_fixed_ms);
      response->set_step_decode_ms_per_token(s.step_decode_ms_per_token);
      response->set_step_prefill_ms_per_token(s.step_prefill_ms_per_token);
      response->set_kv_arriving(s.kv_arriving);
      response->set_kv_loads(s.kv_loads);
      response->set_kv_load_failures(s.kv_load_failures);
      const KvTiersStats& t = s.tiers;
      response->set_host_tier_blocks(t.host_blocks);
      response->set_host_tier_capacity_blocks(t.host_capacity_blocks);
      response->set_disk_tier_blocks(t.disk_blocks);
      response->set_disk_tier_capacity_blocks(t.disk_capacity_blocks);
      response->set_host_tier_demotions(t.demotions_host);
      response->set_disk_tier_demotions(t.demotions_disk);
      response->set_host_tier_promotions(t.promotions_host);
      response->set_disk_tier_promotions(t.promotions_disk);
      response->set_tier_bytes_written(t.bytes_to_host + t.bytes_to_disk);
      response->set_tier_bytes_read(t.bytes_from_host + t.bytes_from_disk);
      response->set_host_tier_hit_tokens(t.hit_tokens_host);
      response->set_disk_tier_hit_tokens(t.hit_tokens_disk);
      response->set_tier_checksum_failures(t.checksum_failures);
      response->set_disk_tier_write_failures(t.disk_write_failures);
      response->set_tier_dropped_demotions(t.dropped_demotions);
      response->set_tier_loads(t.loads);
      response->set_tier_load_mean_ms(t.loads > 0 ? t.load_latency_sum_s * 1e3 / t.loads : 0);
      response->set_tier_lossy_reencoded_blocks(t.lossy_reencoded_blocks);
      response->set_tier_lossy_hit_tokens(t.lossy_hit_tokens);
      if (const ResponseCache* cache = service_->response_cache()) {
        const ResponseCacheStats c = cache->Stats();
        response->set_response_cache_lookups(c.lookups);
        response->set_response_cache_hits_exact(c.hits_exact);
        response->set_response_cache_hits_semantic_verified(c.hits_semantic_verified);
        response->set_response_cache_hits_approximate(c.hits_approximate);
        response->set_response_cache_misses(c.misses);
        response->set_response_cache_stores(c.stores);
        response->set_response_cache_evictions(c.evictions);
        response->set_response_cache_entries(c.entries);
        response->set_response_cache_bytes(c.bytes);
        response->set_response_cache_bypassed(c.bypassed);
        response->set_response_cache_expirations(c.expirations);
        response->set_response_cache_verify_draft_tokens(c.verify_draft_tokens);
        response->set_response_cache_verify_accepted_tokens(c.verify_accepted_tokens);
      }
      return grpc::Status::OK;
    });
  }

  grpc::ServerUnaryReactor* PurgeResponseCache(grpc::CallbackServerContext* ctx,
                                               const pb::PurgeResponseCacheRequest* request,
                                               pb::PurgeResponseCacheResponse* response) override {
    return Unary(ctx, [&]() -> grpc::Status {
      if (request->all() && request->has_cache_salt()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "all, cache_salt: give one of them, not both");
      }
      absl::StatusOr<int64_t> purged = service_->PurgeResponseCache(
          request->all() ? std::nullopt : std::optional<std::string>(admission_.operator_scope()),
          request->has_cache_salt() ? std::optional<std::string>(request->cache_salt())
                                    : std::nullopt);
      if (!purged.ok()) return ToGrpc(purged.status());
      response->set_purged(*purged);
      return grpc::Status::OK;
    }, /*admin_only=*/true);
  }

 private:
  // Unary calls are quick (no model forward), so they run on the gRPC
  // thread that received them and finish before returning.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, Fn&& handle,
                                  bool admin_only = false) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    grpc::Status status = Authorize(ctx, nullptr, admin_only);
    if (status.ok()) status = handle();
    reactor->Finish(status);
    return reactor;
  }

  // With tenant keys, a tenant's key passes for its tenant (*who) and the
  // operator's (--api-key) for everything; admin_only calls refuse tenants
  // (the rule is Authenticator's, server/service/auth.h).
  grpc::Status Authorize(const grpc::CallbackServerContext* ctx, CallerAuth* who = nullptr,
                         bool admin_only = true) const {
    absl::StatusOr<CallerAuth> caller = AuthorizeGrpc(auth_, *ctx, admin_only);
    if (!caller.ok()) return ToGrpc(caller.status());
    if (who != nullptr) *who = *std::move(caller);
    return grpc::Status::OK;
  }

  grpc::Status CheckModel(const std::string& model) const {
    if (model.empty() || model == service_->model_name()) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::NOT_FOUND,
        "model: unknown model '" + model + "' (serving '" + service_->model_name() + "')");
  }

  ModelService* service_;
  Admission admission_;  // the request path (server/service/admission.h)
  Authenticator auth_;
  CacheControlService* cache_control_ = nullptr;
  BackgroundThreads threads_;
  std::mutex subscribers_mu_;
  std::vector<std::weak_ptr<KvEventStream::Shared>> subscribers_;  // guarded by subscribers_mu_
};

}  // namespace

struct GrpcServer::Impl {
  std::unique_ptr<KvserveService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::once_flag shutdown_once;
};

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(ModelService* service,
                                                              const GrpcServerOptions& options) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!options.tls_cert.empty() || !options.tls_key.empty()) {
    if (options.tls_cert.empty() || options.tls_key.empty()) {
      return absl::InvalidArgumentError("tls_cert, tls_key: TLS needs both files");
    }
    absl::StatusOr<std::string> cert = ReadFile(options.tls_cert, "tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile(options.tls_key, "tls_key");
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    creds = grpc::SslServerCredentials(ssl);
  } else {
    creds = grpc::InsecureServerCredentials();
  }

  // Both are process-wide switches read when a server is built.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  auto impl = std::make_unique<Impl>();
  impl->service = std::make_unique<KvserveService>(service, options.api_key, options.tenant_keys,
                                                   options.cache_control);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, creds, &impl->port);
  builder.RegisterService(impl->service.get());
  for (grpc::Service* extra : options.extra_services) builder.RegisterService(extra);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError("grpc: cannot listen on " + options.address);
  }
  if (grpc::HealthCheckServiceInterface* health = impl->server->GetHealthCheckService()) {
    health->SetServingStatus(kServiceName, true);
  }
  spdlog::info("gRPC listening on {} (port {}, {}{})", options.address, impl->port,
               options.tls_cert.empty() ? "plaintext" : "TLS",
               options.api_key.empty() ? "" : ", API key required");
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

absl::StatusOr<CompletionParams> GenerateRequestToParams(const v1::GenerateRequest& request) {
  return ToParams(request);
}

absl::StatusOr<CompletionParams> ChatRequestToParams(const v1::ChatRequest& request) {
  return ToParams(request);
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcServer::~GrpcServer() { Shutdown(std::chrono::system_clock::now()); }

int GrpcServer::port() const { return impl_->port; }

void GrpcServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  std::call_once(impl_->shutdown_once, [&] {
    // Tell health checkers first, so balancers stop routing here.
    if (grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
    // Event subscribers stay forever; end their streams now rather than at
    // the deadline.
    impl_->service->StopBackgroundWork();
    // Waits for in-flight RPCs until `deadline`, then cancels them; each
    // stream's OnCancel cancels its engine request.
    impl_->server->Shutdown(deadline);
    impl_->server->Wait();
  });
}

}  // namespace kvserve
