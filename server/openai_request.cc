// Parses OpenAI request bodies into CompletionParams (see openai_request.h).
#include "server/openai_request.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/response_cache_api.h"

namespace kvserve {

// The cache_control field (below ParseOpenAiRequest).
std::optional<std::string> ReadCacheControl(const nlohmann::json& cc, CompletionParams* p);

namespace {

using json = nlohmann::json;

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
    // Converting a double beyond float's range is undefined behaviour.
    const double d = v->get<double>();
    if (!(std::fabs(d) <= static_cast<double>(std::numeric_limits<float>::max()))) {
      return Fail(key, absl::StrCat(key, " must be a finite number in float range"));
    }
    *out = static_cast<float>(d);
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
      // The range first: casting a double beyond int64 (1.9e85) is undefined
      // behaviour (the request fuzzer's finding), and so is NaN.
      const double d = v.get<double>();
      if (!(d >= static_cast<double>(std::numeric_limits<Int>::min()) &&
            d < static_cast<double>(std::numeric_limits<Int>::max()) + 1.0)) {
        return std::nullopt;
      }
      if (d != std::trunc(d)) return std::nullopt;
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
  // Cache control (docs/cache-control.md): {"retain": {"ttl_s": s, "tokens": n}}.
  if (const json* cc = r.Get("cache_control")) {
    if (auto e = ReadCacheControl(*cc, p)) r.Fail("cache_control", *e);
  }
  r.Bool("cache_report", &p->cache_report);
  // Our extension: the speculative-decoding mode of this request.
  if (const json* sp = r.Get("speculative")) {
    if (!sp->is_string()) {
      r.Fail("speculative", "speculative must be a string: off, ngram, suffix or default");
    } else {
      p->speculative = sp->get<std::string>();
    }
  }
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
}  // namespace

std::optional<std::string> ReadCacheControl(const nlohmann::json& cc, CompletionParams* p) {
  using json = nlohmann::json;
  if (!cc.is_object()) return "cache_control must be an object like {\"retain\": {\"ttl_s\": 300}}";
  for (const auto& [k, v] : cc.items()) {
    if (k != "retain") return "cache_control: unknown field '" + k + "' (expected retain)";
  }
  auto it = cc.find("retain");
  if (it == cc.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) return "cache_control.retain must be an object {\"ttl_s\": s, \"tokens\": n}";
  RetainAsk ask;
  for (const auto& [k, v] : it->items()) {
    if (k == "ttl_s") {
      if (!v.is_number() || !(v.get<double>() > 0)) return "cache_control.retain.ttl_s must be a number > 0";
      ask.ttl_s = v.get<double>();
    } else if (k == "tokens") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (int64_t{1} << 30)) {
        return "cache_control.retain.tokens must be an integer >= 0 (0: the whole prompt)";
      }
      ask.tokens = v.get<int32_t>();
    } else {
      return "cache_control.retain: unknown field '" + k + "' (expected ttl_s, tokens)";
    }
  }
  p->retain = ask;
  return std::nullopt;
}

std::optional<ApiError> ParseOpenAiRequest(std::string_view body, bool chat, OpenAiRequest* out) {
  json parsed = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return ApiError{400, "the request body is not valid JSON", "", "invalid_json"};
  }
  *out = OpenAiRequest{};
  return ParseBody(parsed, chat, &out->params, &out->options);
}

}  // namespace kvserve
