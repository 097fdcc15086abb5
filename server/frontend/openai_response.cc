// OpenAI response and SSE encoding (see openai_response.h).
#include "server/frontend/openai_response.h"

#include "server/frontend/response_cache_api.h"
#include "server/frontend/status_map.h"
#include "server/frontend/tier_usage.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvserve {
namespace {

using json = nlohmann::json;

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
      "cache_salt", "kv_policy", "response_format", "structured_outputs", "tool_choice"};
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

json ErrorJson(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", ErrorType(e.status)},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", std::move(err)}};
}

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

// kv_dropped_tokens joins OpenAI's fields only when the request ran under a
// kv_policy, so plain requests keep OpenAI's usage.
json Usage(const CompletedResponse& done, bool kv_policy) {
  const int32_t prompt_tokens = done.prompt_tokens;
  const int64_t completion_tokens = done.completion_tokens;
  // cached_tokens: prompt tokens served from the prefix cache (OpenAI's field).
  json usage = {{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion_tokens},
                {"total_tokens", prompt_tokens + completion_tokens},
                {"prompt_tokens_details",
                 {{"cached_tokens", std::clamp(done.cached_tokens, 0, prompt_tokens)}}}};
  if (kv_policy) usage["kv_dropped_tokens"] = done.dropped_tokens;
  AddKvTierUsage(done, &usage);  // kvserve's own: cached tokens per KV tier, when tiers served any
  return usage;
}

json LogprobsJson(bool chat, const TokenPieceFn& piece, const std::vector<int32_t>& tokens,
                  const std::vector<float>& logprobs, size_t text_offset) {
  std::vector<std::string> pieces;
  pieces.reserve(tokens.size());
  for (int32_t t : tokens) pieces.push_back(piece ? piece(t) : "");
  if (chat) {
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

json ChunkJson(const ResponseMeta& meta, json choices) {
  return json{{"id", meta.id},
              {"object", meta.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", std::move(choices)}};
}

std::string Event(const json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

json ChoiceDelta(bool chat, int index, const std::string& text) {
  json c = {{"index", index}};
  if (chat) {
    c["delta"] = {{"content", text}};
  } else {
    c["text"] = text;
  }
  c["logprobs"] = nullptr;
  c["finish_reason"] = nullptr;
  return c;
}

// OpenAI's tool_calls array; stream deltas number the calls (index).
json ToolCallsJson(const std::vector<ToolCall>& calls, bool with_index, int first_index = 0) {
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", calls[i].id},
              {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = first_index + static_cast<int>(i);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace

std::string ErrorBody(const ApiError& e) { return Dump(ErrorJson(e)); }

ApiError ApiErrorFromStatus(const absl::Status& s) {
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

ResponseMeta ResponseMeta::New(bool chat, std::string model) {
  ResponseMeta m;
  m.id = RandomId(chat ? "chatcmpl-" : "cmpl-");
  m.created = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  m.model = std::move(model);
  m.chat = chat;
  return m;
}

static json CacheNotesJson(CacheNotes& notes) {
  std::lock_guard<std::mutex> lock(notes.mu);
  json j = json::object();
  if (!notes.retention_json.empty()) j["retention"] = json::parse(notes.retention_json, nullptr, false);
  if (!notes.report_json.empty()) j["report"] = json::parse(notes.report_json, nullptr, false);
  return j;
}

std::string CompletionBody(const ResponseMeta& meta, const HttpRequestOptions& opts,
                           const CompletedResponse& done, const TokenPieceFn& piece) {
  json out_choices = json::array();
  for (const CompletedSample& c : done.samples) {
    json lp = opts.logprobs
                  ? LogprobsJson(meta.chat, piece, c.token_ids, c.logprobs, meta.echo_text.size())
                  : json(nullptr);
    json choice = {{"index", c.index}};
    std::string finish = FinishName(c.finish);
    if (meta.chat && opts.parse_tool_calls) {
      ParsedToolCalls parsed = ParseToolCalls(c.text, opts.parallel_tool_calls);
      json message = {{"role", "assistant"}};
      message["content"] = parsed.content.empty() && !parsed.calls.empty() ? json(nullptr)
                                                                          : json(parsed.content);
      if (!parsed.calls.empty()) {
        message["tool_calls"] = ToolCallsJson(parsed.calls, /*with_index=*/false);
        if (c.finish == FinishReason::kStop) finish = "tool_calls";
      }
      choice["message"] = std::move(message);
    } else if (meta.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = meta.echo_text + c.text;
    }
    choice["logprobs"] = std::move(lp);
    choice["finish_reason"] = finish;
    out_choices.push_back(std::move(choice));
  }
  json out = {{"id", meta.id},
              {"object", meta.chat ? "chat.completion" : "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", std::move(out_choices)},
              {"usage", Usage(done, meta.kv_policy)}};
  if (meta.chat) out["system_fingerprint"] = nullptr;
  if (meta.cache) out["kvserve_cache"] = CacheOutcomeJson(*meta.cache, done);
  if (meta.cache_notes) out["kvserve_cache_control"] = CacheNotesJson(*meta.cache_notes);
  return Dump(out);
}

SseEncoder::SseEncoder(ResponseMeta meta, HttpRequestOptions opts, int32_t n,
                       int32_t prompt_tokens, TokenPieceFn piece)
    : meta_(std::move(meta)),
      opts_(opts),
      n_(n),
      piece_(std::move(piece)),
      response_(std::make_unique<ResponseAccumulator>(n, prompt_tokens)) {
  if (meta_.chat && opts_.parse_tool_calls && n_ > 0) {
    tool_streams_.assign(n_, ToolCallStreamer(opts_.parallel_tool_calls));
    tool_calls_sent_.assign(n_, 0);
  }
}

const std::string& SseEncoder::Heartbeat() {
  static const std::string kHeartbeat = ": keep-alive\n\n";
  return kHeartbeat;
}

std::string SseEncoder::Open() {
  std::string out;
  if (opened_) return out;
  opened_ = true;
  // OpenAI opens each chat choice with the assistant role at once; it also
  // gets a first byte to the client early.
  for (int i = 0; i < n_ && (meta_.chat || !meta_.echo_text.empty()); ++i) {
    json c = ChoiceDelta(meta_.chat, i, meta_.chat ? "" : meta_.echo_text);
    if (meta_.chat) c["delta"] = {{"role", "assistant"}, {"content", meta_.echo_text}};
    out += Event(ChunkJson(meta_, json::array({std::move(c)})));
  }
  return out;
}

std::string SseEncoder::Add(const std::vector<SeqEvent>& events) {
  std::string out;
  if (finished_) return out;
  std::optional<std::string> abort_message;
  for (const SeqEvent& ev : events) {
    // The sample's text before this event places its log-probabilities.
    const size_t text_offset = meta_.echo_text.size() + response_->text_size(ev.index);
    const bool finished_sample = response_->Add(ev);
    if (ev.index < 0 || ev.index >= n_) continue;
    std::string text = ev.text;
    std::vector<ToolCall> calls;
    ToolCallStreamer* tools = nullptr;
    if (!tool_streams_.empty()) {
      tools = &tool_streams_[ev.index];
      text = tools->Feed(ev.text, &calls);
      if (finished_sample) text += tools->Finish(&calls);
    }
    if (!calls.empty()) {
      json d = ChoiceDelta(true, ev.index, "");
      d["delta"] = {{"tool_calls", ToolCallsJson(calls, true, tool_calls_sent_[ev.index])}};
      tool_calls_sent_[ev.index] += static_cast<int>(calls.size());
      out += Event(ChunkJson(meta_, json::array({std::move(d)})));
    }
    if (!text.empty() || (opts_.logprobs && !ev.token_ids.empty())) {
      json d = ChoiceDelta(meta_.chat, ev.index, text);
      if (opts_.logprobs) {
        d["logprobs"] = LogprobsJson(meta_.chat, piece_, ev.token_ids, ev.logprobs, text_offset);
      }
      out += Event(ChunkJson(meta_, json::array({std::move(d)})));
    }
    if (finished_sample) {
      if (ev.finish == FinishReason::kCancelled || ev.finish == FinishReason::kDeadline) {
        abort_message = "the request was cancelled: the server is shutting down";
      } else {
        json d = ChoiceDelta(meta_.chat, ev.index, "");
        if (meta_.chat) d["delta"] = json::object();
        d["finish_reason"] = FinishName(ev.finish);
        if (tools != nullptr && tools->num_calls() > 0 && ev.finish == FinishReason::kStop) {
          d["finish_reason"] = "tool_calls";
        }
        out += Event(ChunkJson(meta_, json::array({std::move(d)})));
      }
    }
  }
  if (abort_message) {
    out += absl::StrCat(Event(ErrorJson({503, *abort_message, "", ""})), "data: [DONE]\n\n");
    finished_ = true;
    aborted_ = true;
  } else if (response_->done()) {
    if (opts_.include_usage) {
      const CompletedResponse done = response_->Take();  // the stream ends here
      json u = ChunkJson(meta_, json::array());
      u["usage"] = Usage(done, meta_.kv_policy);
      if (meta_.cache) u["kvserve_cache"] = CacheOutcomeJson(*meta_.cache, done);
      if (meta_.cache_notes) u["kvserve_cache_control"] = CacheNotesJson(*meta_.cache_notes);
      out += Event(u);
    }
    out += "data: [DONE]\n\n";
    finished_ = true;
  }
  return out;
}

}  // namespace kvserve
