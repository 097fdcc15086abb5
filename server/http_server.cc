// The OpenAI-compatible HTTP front end on cpp-httplib.
//
// Threads: httplib runs each connection on a worker of our ElasticTaskQueue
// (a streaming response occupies its worker until the stream ends, so the
// pool grows with the number of open streams instead of capping them at
// httplib's default of 8). Engine events arrive on the engine thread, which
// must never block: each request owns a RequestState, the sink only appends
// to its queue and signals, and the connection's worker drains the queue,
// formats JSON and writes to the socket.
#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/completed_response.h"
#include "server/response_cache_api.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using SteadyTime = std::chrono::steady_clock;  // kvserve::Clock is the prefix cache's

// Upper bound on connection workers. Each open stream holds one; beyond the
// cap new connections wait in the queue rather than exhausting the process.
constexpr size_t kMaxHttpThreads = 4096;
// How often a waiting stream wakes to notice a stopping server, and how long
// a stream may stay silent before we write an SSE comment: a failed write is
// the only way httplib lets us notice a client that went away while the
// request sits in the queue or in a long prefill.
constexpr auto kStreamPoll = std::chrono::milliseconds(200);
constexpr auto kStreamHeartbeat = std::chrono::seconds(2);

// ---------------------------------------------------------------------------
// Worker pool

// A TaskQueue that starts a worker whenever every existing one is busy (up to
// a cap) and retires workers that idled for a while; httplib's fixed pool
// would queue the ninth concurrent stream behind the first eight.
class ElasticTaskQueue : public httplib::TaskQueue {
 public:
  explicit ElasticTaskQueue(size_t max_threads) : max_threads_(max_threads) {}
  ~ElasticTaskQueue() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::vector<std::thread> retired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      retired.swap(retired_);
      jobs_.push_back(std::move(fn));
      if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
        std::thread t([this] { Work(); });
        const std::thread::id id = t.get_id();
        threads_.emplace(id, std::move(t));
      } else {
        cv_.notify_one();
      }
    }
    for (std::thread& t : retired) t.join();  // they have left Work already
  }

  // Runs the queued jobs to completion, then joins every worker.
  void shutdown() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_ = true;
      for (auto& [id, t] : threads_) threads.push_back(std::move(t));
      threads_.clear();
      for (std::thread& t : retired_) threads.push_back(std::move(t));
      retired_.clear();
    }
    cv_.notify_all();
    for (std::thread& t : threads) t.join();
  }

 private:
  // Workers kept however long they idle; the rest leave after kIdleExit.
  static constexpr size_t kMinThreads = 8;
  static constexpr auto kIdleExit = std::chrono::seconds(30);

  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      const bool woken =
          cv_.wait_for(lock, kIdleExit, [this] { return shutdown_ || !jobs_.empty(); });
      --idle_;
      if (!woken) {
        if (threads_.size() <= kMinThreads) continue;
        // Hand our own handle to the next enqueue (or shutdown) to join.
        auto self = threads_.find(std::this_thread::get_id());
        if (self != threads_.end()) {
          retired_.push_back(std::move(self->second));
          threads_.erase(self);
        }
        return;
      }
      if (jobs_.empty()) return;  // shutting down with nothing left
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;              // guarded by mu_
  std::map<std::thread::id, std::thread> threads_;      // guarded by mu_
  std::vector<std::thread> retired_;                    // guarded by mu_; exited workers
  size_t idle_ = 0;                                     // guarded by mu_
  bool shutdown_ = false;                               // guarded by mu_
};

// ---------------------------------------------------------------------------
// Errors in OpenAI's shape

struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // empty: null
  std::string code;   // empty: null
};

std::string Dump(const json& j) {
  // Token pieces in logprobs may be partial UTF-8; never let that throw.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ErrorType(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    case 504: return "timeout";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

json ErrorJson(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", ErrorType(e.status)},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", std::move(err)}};
}

void SendError(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(Dump(ErrorJson(e)), "application/json");
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

// Request fields a validation message may start with; the first word of
// ModelService's messages names the field, and OpenAI clients show `param`.
const std::set<std::string>& KnownParams() {
  static const std::set<std::string> kParams = {
      "model",     "prompt",           "messages",          "max_tokens",
      "temperature", "top_p",          "top_k",             "min_p",
      "n",         "stop",             "seed",              "logprobs",
      "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
      "stop_token_ids", "ignore_eos",  "stream",            "stream_options",
      "echo",      "max_completion_tokens", "priority",     "tools",
      "cache_salt", "kv_policy"};
  return kParams;
}

std::string ParamOf(const std::string& message) {
  size_t end = 0;
  while (end < message.size() &&
         (absl::ascii_islower(static_cast<unsigned char>(message[end])) || message[end] == '_')) {
    ++end;
  }
  std::string word = message.substr(0, end);
  return KnownParams().count(word) ? word : "";
}

ApiError FromStatus(const absl::Status& s) {
  ApiError e;
  e.status = HttpStatusFor(s.code());
  e.message = std::string(s.message());
  if (e.status == 400) e.param = ParamOf(e.message);
  if (e.status == 404) {
    e.param = "model";
    e.code = "model_not_found";
  }
  if (e.status == 429) e.code = "rate_limit_exceeded";
  return e;
}

// ---------------------------------------------------------------------------
// Request parsing

// What the HTTP layer needs beyond CompletionParams.
struct HttpRequestOptions {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  bool logprobs = false;  // per-token log-probabilities in the response
  bool max_completion_tokens_alias = false;  // for naming the field in errors
};

// Reads typed optional fields; null counts as absent (OpenAI clients send
// explicit nulls). The first type error is kept and reading stops mattering.
class FieldReader {
 public:
  explicit FieldReader(const json& body) : body_(body) {}

  const json* Get(const char* key) const {
    auto it = body_.find(key);
    if (it == body_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  void Float(const char* key, float* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_number()) return Fail(key, absl::StrCat(key, " must be a number"));
    *out = v->get<float>();
  }

  template <typename Int>
  void Integer(const char* key, Int* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    std::optional<Int> i = AsInteger<Int>(*v);
    if (!i) return Fail(key, absl::StrCat(key, " must be an integer"));
    *out = *i;
  }

  template <typename Int>
  void Integer(const char* key, std::optional<Int>* out) {
    Int v{};
    if (Get(key) == nullptr) return;
    Integer(key, &v);
    if (!error) *out = v;
  }

  void Bool(const char* key, bool* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_boolean()) return Fail(key, absl::StrCat(key, " must be a boolean"));
    *out = v->get<bool>();
  }

  void Fail(const std::string& param, std::string message) {
    if (error) return;
    error = ApiError{400, std::move(message), param, "invalid_type"};
  }

  // A JSON integer in Int's range; 3.0 counts, 3.5 does not.
  template <typename Int>
  static std::optional<Int> AsInteger(const json& v) {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(std::numeric_limits<Int>::max())) return std::nullopt;
        return static_cast<Int>(u);
      }
      const int64_t i = v.get<int64_t>();
      if (i < static_cast<int64_t>(std::numeric_limits<Int>::min()) ||
          i > static_cast<int64_t>(std::numeric_limits<Int>::max())) {
        return std::nullopt;
      }
      return static_cast<Int>(i);
    }
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (d != static_cast<double>(static_cast<int64_t>(d))) return std::nullopt;
      if (d < static_cast<double>(std::numeric_limits<Int>::min()) ||
          d > static_cast<double>(std::numeric_limits<Int>::max())) {
        return std::nullopt;
      }
      return static_cast<Int>(d);
    }
    return std::nullopt;
  }

  std::optional<ApiError> error;

 private:
  const json& body_;
};

// Parses `prompt`: a string, an array of token ids, or a batch of one of
// those (batches of several prompts are refused rather than half-served).
void ReadPrompt(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("prompt");
  if (v == nullptr) return r.Fail("prompt", "prompt is required");
  if (v->is_string()) {
    p->prompt_text = v->get<std::string>();
    return;
  }
  if (!v->is_array()) {
    return r.Fail("prompt", "prompt must be a string or an array of token ids");
  }
  if (v->size() == 1 && ((*v)[0].is_string() || (*v)[0].is_array())) {
    if ((*v)[0].is_string()) {
      p->prompt_text = (*v)[0].get<std::string>();
      return;
    }
    v = &(*v)[0];
  } else if (!v->empty() && ((*v)[0].is_string() || (*v)[0].is_array())) {
    return r.Fail("prompt",
                  "prompt: a batch of several prompts is not supported; send one request each");
  }
  std::vector<int32_t> ids;
  ids.reserve(v->size());
  for (const json& t : *v) {
    std::optional<int32_t> id = FieldReader::AsInteger<int32_t>(t);
    if (!id) return r.Fail("prompt", "prompt must be a string or an array of token ids");
    ids.push_back(*id);
  }
  p->prompt_ids = std::move(ids);
}

// Parses `messages`: content is a string, null, or an array of text parts.
void ReadMessages(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("messages");
  if (v == nullptr) return r.Fail("messages", "messages is required");
  if (!v->is_array()) return r.Fail("messages", "messages must be an array");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return r.Fail("messages", at + " must be an object");
    ChatMessage out;
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return r.Fail("messages", at + ".role must be a string");
    }
    out.role = role->get<std::string>();
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      // An assistant turn that only called tools has no content.
    } else if (content->is_string()) {
      out.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const json& part : *content) {
        auto type = part.is_object() ? part.find("type") : part.end();
        auto text = part.is_object() ? part.find("text") : part.end();
        if (type == part.end() || *type != "text" || text == part.end() || !text->is_string()) {
          return r.Fail("messages", at + ".content: only text parts are supported");
        }
        out.content += text->get<std::string>();
      }
    } else {
      return r.Fail("messages", at + ".content must be a string or an array of text parts");
    }
    messages.push_back(std::move(out));
  }
  p->messages = std::move(messages);
}

void ReadStop(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("stop");
  if (v == nullptr) return;
  if (v->is_string()) {
    p->stop = {v->get<std::string>()};
    return;
  }
  if (!v->is_array()) return r.Fail("stop", "stop must be a string or an array of strings");
  for (const json& s : *v) {
    if (!s.is_string()) return r.Fail("stop", "stop must be a string or an array of strings");
    p->stop.push_back(s.get<std::string>());
  }
}

// Parses `kv_policy` (our extension): a policy name ("sinks"), or an object
// {"policy": "h2o", "sinks": 4, "window": 256, "budget": 1024} whose fields
// may each be left out (or null) for the server's default.
void ReadKvPolicy(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("kv_policy");
  if (v == nullptr) return;
  KvPolicyParams kv;
  if (v->is_string()) {
    kv.policy = v->get<std::string>();
  } else if (v->is_object()) {
    for (const auto& [key, value] : v->items()) {
      if (value.is_null()) continue;
      if (key == "policy") {
        if (!value.is_string()) return r.Fail("kv_policy", "kv_policy.policy must be a string");
        kv.policy = value.get<std::string>();
        continue;
      }
      std::optional<int32_t>* number = key == "sinks"    ? &kv.sinks
                                       : key == "window" ? &kv.window
                                       : key == "budget" ? &kv.budget
                                                         : nullptr;
      if (number == nullptr) {
        return r.Fail("kv_policy", absl::StrCat("kv_policy: unknown field '", key,
                                                "' (expected policy, sinks, window, budget)"));
      }
      *number = FieldReader::AsInteger<int32_t>(value);
      if (!*number) {
        return r.Fail("kv_policy", absl::StrCat("kv_policy.", key, " must be an integer"));
      }
    }
  } else {
    return r.Fail("kv_policy",
                  "kv_policy must be a policy name (none, window, sinks, h2o) or an object "
                  "{\"policy\", \"sinks\", \"window\", \"budget\"}");
  }
  p->kv_policy = std::move(kv);
}

// Parses an OpenAI completion or chat body into the shared parameters.
std::optional<ApiError> ParseBody(const json& body, bool chat, CompletionParams* p,
                                  HttpRequestOptions* o) {
  if (!body.is_object()) {
    return ApiError{400, "the request body must be a JSON object", "", "invalid_json"};
  }
  FieldReader r(body);
  o->chat = chat;
  if (const json* m = r.Get("model")) {
    if (!m->is_string()) {
      r.Fail("model", "model must be a string");
    } else {
      p->model = m->get<std::string>();
    }
  }
  if (chat) {
    ReadMessages(r, p);
    if (r.Get("max_completion_tokens") != nullptr) {
      r.Integer("max_completion_tokens", &p->max_tokens);
      o->max_completion_tokens_alias = true;
    } else {
      r.Integer("max_tokens", &p->max_tokens);
    }
    if (const json* tools = r.Get("tools"); tools != nullptr && !(tools->is_array() && tools->empty())) {
      r.Fail("tools", "tools: tool calling is not supported by this server");
    }
    if (const json* lp = r.Get("logprobs")) {
      if (!lp->is_boolean()) {
        r.Fail("logprobs", "logprobs must be a boolean");
      } else {
        o->logprobs = lp->get<bool>();
      }
    }
    int32_t top_logprobs = 0;
    r.Integer("top_logprobs", &top_logprobs);
    if (top_logprobs < 0 || top_logprobs > 20) {
      r.Fail("top_logprobs", "top_logprobs must be between 0 and 20");
    }
  } else {
    ReadPrompt(r, p);
    r.Integer("max_tokens", &p->max_tokens);
    if (const json* lp = r.Get("logprobs")) {
      // Completions take a count of alternatives; we return the sampled
      // token's log-probability whatever the count.
      std::optional<int32_t> k = FieldReader::AsInteger<int32_t>(*lp);
      if (lp->is_boolean()) {
        o->logprobs = lp->get<bool>();
      } else if (!k) {
        r.Fail("logprobs", "logprobs must be an integer");
      } else if (*k < 0 || *k > 20) {
        r.Fail("logprobs", "logprobs must be between 0 and 20");
      } else {
        o->logprobs = true;
      }
    }
    r.Bool("echo", &o->echo);
  }
  r.Float("temperature", &p->temperature);
  r.Float("top_p", &p->top_p);
  r.Integer("top_k", &p->top_k);
  r.Float("min_p", &p->min_p);
  r.Float("repetition_penalty", &p->repetition_penalty);
  r.Float("presence_penalty", &p->presence_penalty);
  r.Float("frequency_penalty", &p->frequency_penalty);
  r.Integer("seed", &p->seed);
  r.Integer("n", &p->n);
  r.Integer("priority", &p->priority);
  r.Bool("ignore_eos", &p->ignore_eos);
  if (const json* salt = r.Get("cache_salt")) {
    if (!salt->is_string()) {
      r.Fail("cache_salt", "cache_salt must be a string");
    } else {
      p->cache_salt = salt->get<std::string>();
    }
  }
  ReadKvPolicy(r, p);
  if (auto e = ParseResponseCacheJson(body, &p->response_cache)) r.Fail("response_cache", *e);
  r.Bool("stream", &o->stream);
  ReadStop(r, p);
  if (const json* ids = r.Get("stop_token_ids")) {
    if (!ids->is_array()) r.Fail("stop_token_ids", "stop_token_ids must be an array of integers");
    for (const json& t : ids->is_array() ? *ids : json::array()) {
      std::optional<int32_t> id = FieldReader::AsInteger<int32_t>(t);
      if (!id) {
        r.Fail("stop_token_ids", "stop_token_ids must be an array of integers");
        break;
      }
      p->stop_token_ids.push_back(*id);
    }
  }
  if (const json* so = r.Get("stream_options")) {
    if (!so->is_object()) {
      r.Fail("stream_options", "stream_options must be an object");
    } else if (auto iu = so->find("include_usage"); iu != so->end() && !iu->is_null()) {
      if (!iu->is_boolean()) {
        r.Fail("stream_options", "stream_options.include_usage must be a boolean");
      } else {
        o->include_usage = iu->get<bool>();
      }
    }
  }
  p->logprobs = o->logprobs;
  return r.error;
}

// ---------------------------------------------------------------------------
// One request in flight

// Shared by the engine-thread sink and the HTTP worker; outlives whichever of
// them finishes first (a cancelled request's last event may arrive after the
// worker has returned).
struct RequestState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<SeqEvent> events;  // guarded by mu
  bool stopping = false;        // guarded by mu; the server is shutting down
};

// OpenAI's finish_reason; null while a choice is still open. A cancelled or
// timed-out choice is "abort", as vLLM reports it.
json FinishName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled:
    case FinishReason::kDeadline: return "abort";
    case FinishReason::kNone: break;
  }
  return nullptr;
}

std::string RandomId(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  uint64_t a, b;
  {
    std::lock_guard<std::mutex> lock(mu);
    a = rng();
    b = rng();
  }
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%016llx%08llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b >> 32));
  return absl::StrCat(prefix, buf);
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Length is not secret; the bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

// ---------------------------------------------------------------------------

struct HttpServer::Impl {
  ModelService* service = nullptr;
  HttpServerOptions options;
  std::unique_ptr<httplib::Server> server;
  std::thread listener;
  int port = 0;
  int listen_fd = -1;  // the listening socket, seen through the socket-options hook
  int64_t created = UnixSeconds();

  // Requests in flight, so that Stop can wake and cancel them.
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<RequestState>> active;  // guarded by mu
  bool stopping = false;                                     // guarded by mu

  void Routes();
  bool Authorized(const httplib::Request& req) const;
  void HandleCompletion(const httplib::Request& req, httplib::Response& res, bool chat);
  void Untrack(uint64_t id);

  // Builds the JSON objects of a response.
  // kv_dropped_tokens joins OpenAI's fields only when `kv_policy` is on.
  json Usage(const CompletedResponse& done, bool kv_policy) const;
  json LogprobsJson(const HttpRequestOptions& o, const std::vector<int32_t>& tokens,
                    const std::vector<float>& logprobs, size_t text_offset) const;
};

void HttpServer::Impl::Untrack(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  active.erase(id);
}

bool HttpServer::Impl::Authorized(const httplib::Request& req) const {
  if (options.api_key.empty()) return true;
  const std::string auth = req.get_header_value("Authorization");
  constexpr absl::string_view kBearer = "Bearer ";  // the scheme is case-insensitive
  if (!absl::StartsWithIgnoreCase(auth, kBearer)) return false;
  return ConstantTimeEquals(auth.substr(kBearer.size()), options.api_key);
}

json HttpServer::Impl::Usage(const CompletedResponse& done, bool kv_policy) const {
  const int32_t prompt_tokens = done.prompt_tokens;
  const int64_t completion_tokens = done.completion_tokens;
  // cached_tokens: prompt tokens served from the prefix cache (OpenAI's field).
  json usage = {{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion_tokens},
                {"total_tokens", prompt_tokens + completion_tokens},
                {"prompt_tokens_details",
                 {{"cached_tokens", std::clamp(done.cached_tokens, 0, prompt_tokens)}}}};
  // Our extension, kept out of plain requests so their usage stays OpenAI's.
  if (kv_policy) usage["kv_dropped_tokens"] = done.dropped_tokens;
  return usage;
}

json HttpServer::Impl::LogprobsJson(const HttpRequestOptions& o,
                                    const std::vector<int32_t>& tokens,
                                    const std::vector<float>& logprobs,
                                    size_t text_offset) const {
  std::vector<std::string> pieces;
  pieces.reserve(tokens.size());
  for (int32_t t : tokens) {
    auto piece = service->Detokenize({t});
    pieces.push_back(piece.ok() ? *piece : "");
  }
  if (o.chat) {
    json content = json::array();
    for (size_t i = 0; i < tokens.size(); ++i) {
      json bytes = json::array();
      for (unsigned char c : pieces[i]) bytes.push_back(c);
      content.push_back({{"token", pieces[i]},
                         {"logprob", i < logprobs.size() ? logprobs[i] : 0.0f},
                         {"bytes", std::move(bytes)},
                         {"top_logprobs", json::array()}});
    }
    return json{{"content", std::move(content)}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t offset = text_offset;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float lp = i < logprobs.size() ? logprobs[i] : 0.0f;
    toks.push_back(pieces[i]);
    lps.push_back(lp);
    tops.push_back(json{{pieces[i], lp}});
    offsets.push_back(offset);
    offset += pieces[i].size();
  }
  return json{{"tokens", std::move(toks)},
              {"token_logprobs", std::move(lps)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

void HttpServer::Impl::HandleCompletion(const httplib::Request& req, httplib::Response& res,
                                        bool chat) {
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return SendError(res, {400, "the request body is not valid JSON", "", "invalid_json"});
  }
  CompletionParams params;
  HttpRequestOptions opts;
  if (auto err = ParseBody(body, chat, &params, &opts)) return SendError(res, *err);
  params.tenant = TenantFromApiKey(options.api_key);  // the key Authorized() checked
  absl::StatusOr<PreparedRequest> prepared = service->Prepare(params);
  if (!prepared.ok()) {
    ApiError e = FromStatus(prepared.status());
    if (e.param == "max_tokens" && opts.max_completion_tokens_alias) {
      e.param = "max_completion_tokens";
    }
    return SendError(res, e);
  }
  const int32_t prompt_tokens = prepared->prompt_tokens;
  const int32_t n = prepared->engine.n;
  // The policy the request runs with (its own or the server's default).
  const bool kv_policy = prepared->engine.kv_policy.kind != KvPolicy::Kind::kNone;
  std::string echo_text;
  if (opts.echo) {
    if (params.prompt_text) {
      echo_text = *params.prompt_text;
    } else if (params.prompt_ids) {
      echo_text = service->Detokenize(*params.prompt_ids).value_or("");
    }
  }

  auto state = std::make_shared<RequestState>();
  CacheOutcome cache;
  absl::StatusOr<uint64_t> started = service->Start(
      std::move(prepared).value(),
      [state](const SeqEvent& ev) {
        // Engine thread: hand over and return at once.
        {
          std::lock_guard<std::mutex> lock(state->mu);
          state->events.push_back(ev);
        }
        state->cv.notify_one();
      },
      &cache);
  if (!started.ok()) return SendError(res, FromStatus(started.status()));
  if (cache.kind != CacheHitKind::kOff) res.set_header(kCacheHeader, CacheHitKindName(cache.kind));
  const uint64_t request_id = *started;
  {
    // Registering and checking under one lock: either Stop sees this request
    // or we see Stop.
    std::lock_guard<std::mutex> lock(mu);
    active.emplace(request_id, state);
    if (stopping) service->Cancel(request_id);
  }

  const std::string id = RandomId(chat ? "chatcmpl-" : "cmpl-");
  const int64_t created_at = UnixSeconds();
  const std::string& model = service->model_name();

  if (!opts.stream) {
    ResponseAccumulator acc(n, prompt_tokens);
    while (!acc.done()) {
      std::deque<SeqEvent> events;
      {
        std::unique_lock<std::mutex> lock(state->mu);
        state->cv.wait(lock, [&] { return !state->events.empty(); });
        events.swap(state->events);
      }
      for (const SeqEvent& ev : events) acc.Add(ev);
    }
    Untrack(request_id);
    const CompletedResponse done = acc.Take();
    if (done.aborted()) {
      // Only the server cancels a non-streaming request (drain or Stop):
      // the client should retry elsewhere, which 503 says.
      return SendError(res, {503, "the request was cancelled: the server is shutting down", "",
                             ""});
    }
    json out_choices = json::array();
    for (const CompletedSample& c : done.samples) {
      json lp = opts.logprobs ? LogprobsJson(opts, c.token_ids, c.logprobs, echo_text.size())
                              : json(nullptr);
      json choice = {{"index", c.index}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      } else {
        choice["text"] = echo_text + c.text;
      }
      choice["logprobs"] = std::move(lp);
      choice["finish_reason"] = FinishName(c.finish);
      out_choices.push_back(std::move(choice));
    }
    json out = {{"id", id},
                {"object", chat ? "chat.completion" : "text_completion"},
                {"created", created_at},
                {"model", model},
                {"choices", std::move(out_choices)},
                {"usage", Usage(done, kv_policy)}};
    if (chat) out["system_fingerprint"] = nullptr;
    if (cache.kind != CacheHitKind::kOff) out["kvserve_cache"] = CacheOutcomeJson(cache, done);
    res.set_content(Dump(out), "application/json");
    return;
  }

  // Streaming: the provider runs on this connection's worker once the headers
  // are out, and again after each return until sink.done() or a failure.
  struct StreamCursor {
    StreamCursor(int32_t n, int32_t prompt_tokens) : response(n, prompt_tokens) {}
    ResponseAccumulator response;  // what has been streamed so far
    bool opened = false;    // role / echo chunks written
    bool finished = false;  // [DONE] written
    SteadyTime::time_point last_write = SteadyTime::now();
  };
  auto cursor = std::make_shared<StreamCursor>(n, prompt_tokens);
  const char* object = chat ? "chat.completion.chunk" : "text_completion";
  auto chunk_json = [id, created_at, model, object](json choices) {
    return json{{"id", id},
                {"object", object},
                {"created", created_at},
                {"model", model},
                {"choices", std::move(choices)}};
  };
  auto chunk = [chunk_json](json choices) {
    return absl::StrCat("data: ", Dump(chunk_json(std::move(choices))), "\n\n");
  };
  auto choice_delta = [chat](int index, const std::string& text) {
    json c = {{"index", index}};
    if (chat) {
      c["delta"] = {{"content", text}};
    } else {
      c["text"] = text;
    }
    c["logprobs"] = nullptr;
    c["finish_reason"] = nullptr;
    return c;
  };

  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies must not hold the stream back
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, state, cursor, request_id, opts, n, chat, kv_policy, echo_text, chunk_json, chunk,
       choice_delta, cache](size_t /*offset*/, httplib::DataSink& sink) -> bool {
        StreamCursor& cur = *cursor;
        std::string out;
        if (!cur.opened) {
          cur.opened = true;
          // OpenAI opens each chat choice with the assistant role at once;
          // it also gets the headers and a first byte to the client early.
          for (int i = 0; i < n && (chat || !echo_text.empty()); ++i) {
            json c = choice_delta(i, chat ? "" : echo_text);
            if (chat) c["delta"] = {{"role", "assistant"}, {"content", echo_text}};
            out += chunk(json::array({std::move(c)}));
          }
        }
        std::deque<SeqEvent> events;
        bool stopping_now = false;
        {
          std::unique_lock<std::mutex> lock(state->mu);
          if (out.empty()) {
            state->cv.wait_for(lock, kStreamPoll,
                               [&] { return !state->events.empty() || state->stopping; });
          }
          events.swap(state->events);
          stopping_now = state->stopping;
        }
        std::optional<std::string> abort_message;
        for (const SeqEvent& ev : events) {
          // The sample's text before this event places its log-probabilities.
          const size_t text_offset = echo_text.size() + cur.response.text_size(ev.index);
          const bool finished_sample = cur.response.Add(ev);
          if (ev.index < 0 || ev.index >= n) continue;
          if (!ev.text.empty() || (opts.logprobs && !ev.token_ids.empty())) {
            json d = choice_delta(ev.index, ev.text);
            if (opts.logprobs) {
              d["logprobs"] = LogprobsJson(opts, ev.token_ids, ev.logprobs, text_offset);
            }
            out += chunk(json::array({std::move(d)}));
          }
          if (finished_sample) {
            if (ev.finish == FinishReason::kCancelled || ev.finish == FinishReason::kDeadline) {
              abort_message = "the request was cancelled: the server is shutting down";
            } else {
              json d = choice_delta(ev.index, "");
              if (chat) d["delta"] = json::object();
              d["finish_reason"] = FinishName(ev.finish);
              out += chunk(json::array({std::move(d)}));
            }
          }
        }
        if (abort_message) {
          // Mid-stream failures travel as an error event, which the openai
          // client raises as an APIError.
          out += absl::StrCat(
              "data: ", Dump(ErrorJson({503, *abort_message, "", ""})), "\n\ndata: [DONE]\n\n");
          service->Cancel(request_id);  // the other samples, if any
          cur.finished = true;
        } else if (cur.response.done()) {
          if (opts.include_usage) {
            const CompletedResponse done = cur.response.Take();  // the stream ends here
            json u = chunk_json(json::array());
            u["usage"] = Usage(done, kv_policy);
            if (cache.kind != CacheHitKind::kOff)
              u["kvserve_cache"] = CacheOutcomeJson(cache, done);
            out += absl::StrCat("data: ", Dump(u), "\n\n");
          }
          out += "data: [DONE]\n\n";
          cur.finished = true;
        }
        if (out.empty() && !stopping_now &&
            SteadyTime::now() - cur.last_write >= kStreamHeartbeat) {
          out = ": keep-alive\n\n";  // an SSE comment: clients skip it
        }
        if (!out.empty()) {
          if (!sink.write(out.data(), out.size())) {
            // The client went away: free its KV blocks now, not at max_tokens.
            service->Cancel(request_id);
            return false;
          }
          cur.last_write = SteadyTime::now();
        }
        if (cur.finished) {
          sink.done();
          return true;
        }
        if (stopping_now) service->Cancel(request_id);  // its final events end the stream
        return true;
      },
      [this, request_id, cursor](bool success) {
        // Runs when the response is released: after the stream, a write
        // failure, or a server shutdown that never called the provider.
        if (!success || !cursor->finished) service->Cancel(request_id);
        Untrack(request_id);
      });
}

void HttpServer::Impl::Routes() {
  httplib::Server& s = *server;
  s.new_task_queue = [] { return new ElasticTaskQueue(kMaxHttpThreads); };
  // httplib's default adds SO_REUSEPORT, which would let a second daemon
  // bind the same port and silently take half the traffic; SO_REUSEADDR
  // alone still allows a quick restart. The hook is also our only way to
  // learn the listening socket (see Start: the backlog).
  s.set_socket_options([this](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  s.set_payload_max_length(static_cast<size_t>(std::max<int64_t>(options.max_request_bytes, 0)));

  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path == "/health" || Authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("WWW-Authenticate", "Bearer");
    SendError(res, {401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "",
                    "invalid_api_key"});
    return httplib::Server::HandlerResponse::Handled;
  });
  // Errors httplib produces itself (unknown route, oversized body, bad
  // request line) get OpenAI's error shape too.
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    switch (res.status) {
      case 404:
        return SendError(res, {404, absl::StrCat("no route for ", req.method, " ", req.path), "",
                               "not_found"});
      case 413:
        return SendError(res, {413,
                               absl::StrCat("the request body is larger than max_request_bytes (",
                                            options.max_request_bytes, " bytes)"),
                               "", "request_too_large"});
      case 400:
        if (req.method == "POST" && !req.has_header("Content-Length") &&
            req.get_header_value("Transfer-Encoding") != "chunked") {
          // httplib refuses a POST whose body length is unknown (curl -X POST
          // without -d sends none).
          return SendError(res, {400,
                                 "a POST needs a Content-Length header; send an empty body "
                                 "for none (curl -d '')",
                                 "", ""});
        }
        return SendError(res, {400, "HTTP 400", "", ""});
      default:
        return SendError(res, {res.status, absl::StrCat("HTTP ", res.status), "", ""});
    }
  });
  s.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("http: handler failed: {}", what);
        SendError(res, {500, "internal error: " + what, "", ""});
      });

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    // Load balancers take a draining server out of rotation on 503.
    if (service->draining()) {
      res.status = 503;
      res.set_content("draining", "text/plain");
      return;
    }
    res.set_content("ok", "text/plain");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(service->metrics()->Render(service->Stats()), "text/plain; version=0.0.4");
  });
  auto model_json = [this] {
    const ModelInfo info = service->Info();
    return json{{"id", info.name},
                {"object", "model"},
                {"created", created},
                {"owned_by", "kvserve"},
                {"max_model_len", info.config.context_length}};
  };
  s.Get("/v1/models", [model_json](const httplib::Request&, httplib::Response& res) {
    json out = {{"object", "list"}, {"data", json::array({model_json()})}};
    res.set_content(Dump(out), "application/json");
  });
  s.Get(R"(/v1/models/(.+))", [this, model_json](const httplib::Request& req,
                                                  httplib::Response& res) {
    if (req.matches[1] != service->model_name()) {
      return SendError(res, {404, absl::StrCat("model '", std::string(req.matches[1]),
                                               "' does not exist"),
                             "model", "model_not_found"});
    }
    res.set_content(Dump(model_json()), "application/json");
  });
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleCompletion(req, res, /*chat=*/false);
  });
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleCompletion(req, res, /*chat=*/true);
  });
  // Admin: purges the response cache (server/response_cache_api.h).
  s.Post("/admin/response_cache/purge", [this](const httplib::Request& req,
                                               httplib::Response& res) {
    PurgeAnswer a = PurgeResponseCacheHttp(service, TenantFromApiKey(options.api_key), req.body);
    res.status = a.status;
    res.set_content(Dump(a.body), "application/json");
  });
  // Admin: empties the prefix cache (behind the API key like every route
  // but /health). Blocks this worker until the engine's next step.
  s.Post("/admin/clear_prefix_cache", [this](const httplib::Request&, httplib::Response& res) {
    absl::StatusOr<int32_t> cleared = service->ClearPrefixCache();
    if (!cleared.ok()) {
      ApiError e = FromStatus(cleared.status());
      if (cleared.status().code() == absl::StatusCode::kFailedPrecondition) {
        // The request is fine; the server's configuration does not allow it.
        e.status = 409;
        e.code = "prefix_cache_disabled";
        e.param.clear();
      }
      return SendError(res, e);
    }
    res.set_content(Dump(json{{"blocks_cleared", *cleared}}), "application/json");
  });
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(ModelService* service,
                                                               const HttpServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->service = service;
  impl->options = options;
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key must be given together");
  }
  if (!options.tls_cert.empty()) {
    auto ssl = std::make_unique<httplib::SSLServer>(options.tls_cert.c_str(),
                                                    options.tls_key.c_str());
    if (!ssl->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("tls_cert/tls_key: cannot load ",
                                                     options.tls_cert, " and ", options.tls_key));
    }
    impl->server = std::move(ssl);
  } else {
    impl->server = std::make_unique<httplib::Server>();
  }
  // Streamed tokens are small writes; with Nagle's algorithm on, a reused
  // keep-alive connection holds each for the peer's delayed ACK (~40 ms).
  impl->server->set_tcp_nodelay(true);
  impl->Routes();
  if (options.port == 0) {
    impl->port = impl->server->bind_to_any_port(options.host);
  } else if (impl->server->bind_to_port(options.host, options.port)) {
    impl->port = options.port;
  } else {
    impl->port = -1;
  }
  if (impl->port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("http: cannot listen on ", options.host, ":", options.port));
  }
  // httplib listens with a backlog of 5: a burst of clients (a load test,
  // hundreds of streams opened at once) overflows it and connections stall
  // for SYN retransmits. listen() again on a listening socket only resizes
  // its queue.
  int accepting = 0;
  socklen_t len = sizeof(accepting);
  if (impl->listen_fd >= 0 &&
      getsockopt(impl->listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) == 0 &&
      accepting != 0 && ::listen(impl->listen_fd, SOMAXCONN) != 0) {
    spdlog::warn("http: cannot raise the listen backlog");
  }
  httplib::Server* server = impl->server.get();
  impl->listener = std::thread([server] { server->listen_after_bind(); });
  spdlog::info("http: listening on {}://{}:{}", options.tls_cert.empty() ? "http" : "https",
               options.host, impl->port);
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port; }

void HttpServer::Stop() {
  if (!impl_->listener.joinable()) return;
  std::vector<std::pair<uint64_t, std::shared_ptr<RequestState>>> active;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    active.assign(impl_->active.begin(), impl_->active.end());
  }
  // Streams and waits end through their requests' final (cancelled) events;
  // the workers must return before httplib's shutdown can join them.
  for (auto& [id, state] : active) {
    impl_->service->Cancel(id);
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->stopping = true;
    }
    state->cv.notify_all();
  }
  impl_->server->stop();
  impl_->listener.join();
}

}  // namespace kvserve
