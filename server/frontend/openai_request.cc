// Parses OpenAI request bodies into CompletionParams (see openai_request.h).
#include "server/frontend/openai_request.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/frontend/response_cache_api.h"

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

// An assistant message's tool_calls: [{"id", "type": "function",
// "function": {"name", "arguments": JSON text}}]. Returns what is wrong.
std::optional<std::string> CheckToolCalls(const json& v, const std::string& at) {
  if (!v.is_array()) return at + " must be an array";
  for (size_t i = 0; i < v.size(); ++i) {
    const json& c = v[i];
    const std::string ci = absl::StrCat(at, "[", i, "]");
    if (!c.is_object()) return ci + " must be an object";
    auto type = c.find("type");
    if (type != c.end() && !type->is_null() && *type != "function") {
      return ci + ".type must be \"function\"";
    }
    auto f = c.find("function");
    if (f == c.end() || !f->is_object()) return ci + ".function must be an object";
    auto name = f->find("name");
    if (name == f->end() || !name->is_string()) return ci + ".function.name must be a string";
    auto args = f->find("arguments");
    if (args != f->end() && !args->is_null() && !args->is_string()) {
      return ci + ".function.arguments must be a string (JSON text)";
    }
  }
  return std::nullopt;
}

// tools, tool_choice and parallel_tool_calls (chat). required and named
// choices need grammar-constrained decoding to be enforced: refused until
// then, rather than asked of the model and hoped for.
void ReadTools(FieldReader& r, CompletionParams* p, HttpRequestOptions* o) {
  std::vector<std::string> names;
  std::vector<size_t> strict_tools;  // tools with strict: true
  if (const json* tools = r.Get("tools")) {
    if (!tools->is_array()) return r.Fail("tools", "tools must be an array of tool objects");
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string at = absl::StrCat("tools[", i, "]");
      if (!t.is_object()) return r.Fail("tools", at + " must be an object");
      for (const auto& [k, v] : t.items()) {
        if (k != "type" && k != "function" && !v.is_null()) {
          return r.Fail("tools", absl::StrCat(at, ".", k, " is not supported"));
        }
      }
      if (t.value("type", json()) != "function") {
        return r.Fail("tools", at + ".type must be \"function\" (the only tool type served)");
      }
      auto f = t.find("function");
      if (f == t.end() || !f->is_object()) return r.Fail("tools", at + ".function must be an object");
      for (const auto& [k, v] : f->items()) {
        if (v.is_null()) continue;
        if (k == "name") {
          const std::string n = v.is_string() ? v.get<std::string>() : "";
          const bool ok = !n.empty() && n.size() <= 64 &&
                          n.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                              "0123456789_-") == std::string::npos;
          if (!ok) {
            return r.Fail("tools", at + ".function.name must be 1-64 letters, digits, _ or -");
          }
          names.push_back(n);
        } else if (k == "description") {
          if (!v.is_string()) return r.Fail("tools", at + ".function.description must be a string");
        } else if (k == "parameters") {
          if (!v.is_object()) {
            return r.Fail("tools", at + ".function.parameters must be a JSON schema object");
          }
        } else if (k == "strict") {
          if (!v.is_boolean()) return r.Fail("tools", at + ".function.strict must be a boolean");
          if (v.get<bool>()) strict_tools.push_back(i);
        } else {
          return r.Fail("tools", absl::StrCat(at, ".function.", k, " is not supported"));
        }
      }
      if (names.size() != i + 1) return r.Fail("tools", at + ".function.name is required");
    }
    if (!tools->empty()) p->tools_json = tools->dump();  // ParseOpenAiRequest keeps key order
  }
  std::string choice = "auto";
  if (const json* tc = r.Get("tool_choice")) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (choice != "auto" && choice != "none" && choice != "required") {
        return r.Fail("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or "
                                     "{\"type\": \"function\", \"function\": {\"name\"}}");
      }
    } else if (tc->is_object()) {
      // {"type": "function", "function": {"name": "..."}}
      for (const auto& [k, v] : tc->items()) {
        if (k != "type" && k != "function" && !v.is_null()) {
          return r.Fail("tool_choice", absl::StrCat("tool_choice.", k, " is not supported"));
        }
      }
      auto f = tc->find("function");
      const json* name = nullptr;
      if (f != tc->end() && f->is_object()) {
        auto n = f->find("name");
        if (n != f->end() && n->is_string()) name = &*n;
      }
      if (tc->value("type", json()) != "function" || name == nullptr) {
        return r.Fail("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or "
                                     "{\"type\": \"function\", \"function\": {\"name\"}}");
      }
      for (const auto& [k, v] : f->items()) {
        if (k != "name" && !v.is_null()) {
          return r.Fail("tool_choice", absl::StrCat("tool_choice.function.", k, " is not supported"));
        }
      }
      choice = name->get<std::string>();
      if (std::find(names.begin(), names.end(), choice) == names.end()) {
        return r.Fail("tool_choice", absl::StrCat("tool_choice names function '", choice,
                                                  "', which is not among tools"));
      }
      o->forced_tool = choice;
      choice = "function";
    } else {
      return r.Fail("tool_choice", "tool_choice must be a string or an object");
    }
  }
  if (choice == "required" || choice == "function") {
    // Enforced by a grammar (ParseOpenAiRequest builds it from the tools as
    // the client ordered them): the reply is one tool call whose arguments
    // match the function's parameters schema.
    if (names.empty()) {
      return r.Fail("tool_choice", absl::StrCat("tool_choice \"", choice == "required" ? "required" : o->forced_tool,
                                                "\" forces a tool call, but no tools are given"));
    }
    o->force_tool_call = true;
  } else if (!strict_tools.empty() && choice == "auto") {
    // With "auto" the model may answer in text; a grammar triggered by
    // <tool_call> constrains each call it opens (ParseOpenAiRequest).
    o->strict_auto_tools = true;
  }
  r.Bool("parallel_tool_calls", &o->parallel_tool_calls);
  // none: the model is not shown the tools and its reply is plain content.
  if (choice == "none") p->tools_json.clear();
  o->parse_tool_calls = !p->tools_json.empty();
}

// response_format (chat): {"type": "text"} (free text), {"type":
// "json_object"}, or {"type": "json_schema", "json_schema": {"name",
// "description", "schema", "strict"}}.
void ReadResponseFormat(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("response_format");
  if (v == nullptr) return;
  if (!v->is_object()) return r.Fail("response_format", "response_format must be an object");
  auto type = v->find("type");
  if (type == v->end() || !type->is_string()) {
    return r.Fail("response_format", "response_format.type must be \"text\", \"json_object\" or "
                                     "\"json_schema\"");
  }
  const std::string t = type->get<std::string>();
  for (const auto& [k, value] : v->items()) {
    if (value.is_null() || k == "type" || (k == "json_schema" && t == "json_schema")) continue;
    return r.Fail("response_format",
                  absl::StrCat("response_format.", k, " is not supported with type \"", t, "\""));
  }
  if (t == "text") return;
  GrammarSpec g;
  if (t == "json_object") {
    g.kind = GrammarSpec::Kind::kJsonObject;
  } else if (t == "json_schema") {
    auto js = v->find("json_schema");
    if (js == v->end() || !js->is_object()) {
      return r.Fail("response_format", "response_format.json_schema must be an object {\"name\", "
                                       "\"schema\", \"strict\"}");
    }
    g.kind = GrammarSpec::Kind::kJsonSchema;
    g.strict = false;  // OpenAI's default
    bool named = false;
    for (const auto& [k, value] : js->items()) {
      if (value.is_null()) continue;
      if (k == "name") {
        const std::string n = value.is_string() ? value.get<std::string>() : "";
        if (n.empty() || n.size() > 64 ||
            n.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") !=
                std::string::npos) {
          return r.Fail("response_format",
                        "response_format.json_schema.name must be 1-64 letters, digits, _ or -");
        }
        named = true;
      } else if (k == "description") {
        if (!value.is_string()) {
          return r.Fail("response_format", "response_format.json_schema.description must be a string");
        }
      } else if (k == "schema") {
        if (!value.is_object()) {
          return r.Fail("response_format",
                        "response_format.json_schema.schema must be a JSON schema object");
        }
        g.text = value.dump();
      } else if (k == "strict") {
        if (!value.is_boolean()) {
          return r.Fail("response_format", "response_format.json_schema.strict must be a boolean");
        }
        g.strict = value.get<bool>();
      } else {
        return r.Fail("response_format",
                      absl::StrCat("response_format.json_schema.", k, " is not supported"));
      }
    }
    if (!named) return r.Fail("response_format", "response_format.json_schema.name is required");
    if (g.text.empty()) g.kind = GrammarSpec::Kind::kJsonObject;  // no schema: any object
  } else {
    return r.Fail("response_format", absl::StrCat("response_format.type \"", t,
                                                  "\" is not supported (text, json_object, "
                                                  "json_schema)"));
  }
  p->grammar = std::move(g);
  p->grammar_field = "response_format";
}

// structured_outputs (vLLM's shape): exactly one of {"json": schema (object
// or its JSON text)}, {"regex": str}, {"choice": [str]}, {"grammar": EBNF
// str}, {"json_object": true}.
void ReadStructuredOutputs(FieldReader& r, CompletionParams* p) {
  const json* v = r.Get("structured_outputs");
  if (v == nullptr) return;
  constexpr char kShape[] =
      "structured_outputs must be an object with one of json, regex, choice, grammar, json_object";
  if (!v->is_object()) return r.Fail("structured_outputs", kShape);
  GrammarSpec g;
  int given = 0;
  for (const auto& [k, value] : v->items()) {
    if (value.is_null()) continue;
    const std::string at = "structured_outputs." + k;
    if (k == "json") {
      ++given;
      g.kind = GrammarSpec::Kind::kJsonSchema;
      if (value.is_string()) {
        json parsed = json::parse(value.get<std::string>(), nullptr, false);
        if (parsed.is_discarded() || !parsed.is_object()) {
          return r.Fail("structured_outputs", at + " must be a JSON schema (an object or its JSON text)");
        }
        g.text = parsed.dump();
      } else if (value.is_object()) {
        g.text = value.dump();
      } else {
        return r.Fail("structured_outputs", at + " must be a JSON schema (an object or its JSON text)");
      }
    } else if (k == "regex" || k == "grammar") {
      ++given;
      if (!value.is_string() || value.get<std::string>().empty()) {
        return r.Fail("structured_outputs", at + " must be a non-empty string");
      }
      g.kind = k == "regex" ? GrammarSpec::Kind::kRegex : GrammarSpec::Kind::kEbnf;
      g.text = value.get<std::string>();
    } else if (k == "choice") {
      ++given;
      if (!value.is_array() || value.empty()) {
        return r.Fail("structured_outputs", at + " must be a non-empty array of strings");
      }
      g.kind = GrammarSpec::Kind::kChoice;
      for (const json& c : value) {
        if (!c.is_string() || c.get<std::string>().empty()) {
          return r.Fail("structured_outputs", at + " must be a non-empty array of non-empty strings");
        }
        g.choices.push_back(c.get<std::string>());
      }
    } else if (k == "json_object") {
      if (!value.is_boolean()) return r.Fail("structured_outputs", at + " must be a boolean");
      if (value.get<bool>()) {
        ++given;
        g.kind = GrammarSpec::Kind::kJsonObject;
      }
    } else {
      return r.Fail("structured_outputs",
                    absl::StrCat(at, " is not supported (json, regex, choice, grammar, json_object)"));
    }
  }
  if (given != 1) return r.Fail("structured_outputs", kShape);
  if (p->grammar.kind != GrammarSpec::Kind::kNone) {
    return r.Fail("structured_outputs",
                  "structured_outputs and response_format both constrain the output; send one");
  }
  p->grammar = std::move(g);
  p->grammar_field = "structured_outputs";
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
    for (const auto& [key, value] : m.items()) {
      if (value.is_null() || key == "role" || key == "content") continue;
      if (key == "tool_calls" && out.role == "assistant") {
        if (auto e = CheckToolCalls(value, at + ".tool_calls")) return r.Fail("messages", *e);
        if (!value.empty()) out.tool_calls_json = value.dump();
        continue;
      }
      if (key == "tool_call_id" && out.role == "tool") {
        if (!value.is_string()) return r.Fail("messages", at + ".tool_call_id must be a string");
        out.tool_call_id = value.get<std::string>();
        continue;
      }
      return r.Fail("messages", absl::StrCat(at, ".", key, " is not supported",
                                             key == "name" ? " (participant names are not rendered)"
                                                           : "",
                                             " on a '", out.role, "' message"));
    }
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

// Every top-level field a body may carry, by endpoint. Honoured fields are
// read below; refused ones are OpenAI fields this server does not implement:
// a body carrying one (non-null) is a 400 naming it, never a silent ignore
// (issue 44). A few refused fields are honoured at the one value that asks
// for nothing (store: false, modalities: ["text"], ...); AcceptedAsNoOp
// says which. Anything else is an unknown field: a 400 naming it too.
enum class Endpoint { kBoth, kChat, kCompletions };
constexpr char kGuidedRefusal[] =
    "vLLM's older guided_* fields are not accepted; send structured_outputs {\"json\": schema} "
    "(or \"regex\", \"choice\", \"grammar\", \"json_object\"), as vLLM does now";
struct FieldRule {
  const char* name;
  Endpoint endpoint;
  const char* refusal;  // nullptr: honoured
};
constexpr FieldRule kFieldRules[] = {
    // OpenAI's fields this server honours.
    {"model", Endpoint::kBoth, nullptr},
    {"messages", Endpoint::kChat, nullptr},
    {"prompt", Endpoint::kCompletions, nullptr},
    {"max_tokens", Endpoint::kBoth, nullptr},
    {"max_completion_tokens", Endpoint::kChat, nullptr},
    {"temperature", Endpoint::kBoth, nullptr},
    {"top_p", Endpoint::kBoth, nullptr},
    {"n", Endpoint::kBoth, nullptr},
    {"stop", Endpoint::kBoth, nullptr},
    {"seed", Endpoint::kBoth, nullptr},
    {"presence_penalty", Endpoint::kBoth, nullptr},
    {"frequency_penalty", Endpoint::kBoth, nullptr},
    {"stream", Endpoint::kBoth, nullptr},
    {"stream_options", Endpoint::kBoth, nullptr},
    {"logprobs", Endpoint::kBoth, nullptr},
    {"top_logprobs", Endpoint::kChat, nullptr},
    {"echo", Endpoint::kCompletions, nullptr},
    {"tools", Endpoint::kChat, nullptr},
    {"tool_choice", Endpoint::kChat, nullptr},
    {"parallel_tool_calls", Endpoint::kChat, nullptr},
    // vLLM's sampling extensions and kvserve's own.
    {"top_k", Endpoint::kBoth, nullptr},
    {"min_p", Endpoint::kBoth, nullptr},
    {"repetition_penalty", Endpoint::kBoth, nullptr},
    {"ignore_eos", Endpoint::kBoth, nullptr},
    {"stop_token_ids", Endpoint::kBoth, nullptr},
    {"priority", Endpoint::kBoth, nullptr},
    {"cache_salt", Endpoint::kBoth, nullptr},
    {"kv_policy", Endpoint::kBoth, nullptr},
    {"cache_control", Endpoint::kBoth, nullptr},
    {"cache_report", Endpoint::kBoth, nullptr},
    {"speculative", Endpoint::kBoth, nullptr},
    {"response_cache", Endpoint::kBoth, nullptr},
    // Structured outputs (grammar-constrained decoding): OpenAI's
    // response_format, and vLLM's structured_outputs for what a JSON schema
    // cannot say (regex, EBNF grammar, choice).
    {"response_format", Endpoint::kChat, nullptr},
    {"structured_outputs", Endpoint::kBoth, nullptr},
    {"guided_json", Endpoint::kBoth, kGuidedRefusal},
    {"guided_regex", Endpoint::kBoth, kGuidedRefusal},
    {"guided_choice", Endpoint::kBoth, kGuidedRefusal},
    {"guided_grammar", Endpoint::kBoth, kGuidedRefusal},
    {"guided_decoding_backend", Endpoint::kBoth, kGuidedRefusal},
    {"guided_whitespace_pattern", Endpoint::kBoth, kGuidedRefusal},
    // OpenAI's fields this server does not implement.
    {"logit_bias", Endpoint::kBoth, "token biases are not implemented by this server"},
    {"audio", Endpoint::kChat, "audio output is not supported by this server"},
    {"modalities", Endpoint::kChat, "this server produces text only; only [\"text\"] is accepted"},
    {"prediction", Endpoint::kChat, "predicted outputs are not supported by this server"},
    {"reasoning_effort", Endpoint::kChat, "reasoning models are not supported by this server"},
    {"verbosity", Endpoint::kChat, "verbosity is not supported by this server"},
    {"web_search_options", Endpoint::kChat, "web search is not supported by this server"},
    {"functions", Endpoint::kChat,
     "the deprecated functions field is not supported; send tools instead"},
    {"function_call", Endpoint::kChat,
     "the deprecated function_call field is not supported; send tool_choice instead"},
    {"store", Endpoint::kChat, "this server stores no completions; only false is accepted"},
    {"metadata", Endpoint::kChat, "this server stores no completions to attach metadata to"},
    {"service_tier", Endpoint::kChat,
     "this server has one service tier; only \"auto\" or \"default\" is accepted"},
    {"prompt_cache_key", Endpoint::kChat,
     "OpenAI's prompt cache routing key is not implemented; kvserve's prefix cache needs no key "
     "(cache_salt scopes it)"},
    {"prompt_cache_retention", Endpoint::kChat,
     "OpenAI's prompt cache retention is not implemented; see kvserve's cache_control"},
    {"safety_identifier", Endpoint::kChat, "this server does no abuse monitoring to identify users for"},
    {"user", Endpoint::kBoth, "this server does no abuse monitoring to identify users for"},
    {"best_of", Endpoint::kCompletions,
     "best_of is not implemented by this server; only 1 (or n) is accepted"},
    {"suffix", Endpoint::kCompletions, "insertion (suffix) is not supported by this server"},
};

bool RuleApplies(const FieldRule& rule, bool chat) {
  return rule.endpoint == Endpoint::kBoth || (rule.endpoint == Endpoint::kChat) == chat;
}

// A refused field sent at the value that asks for nothing extra.
bool AcceptedAsNoOp(const std::string& key, const json& v, const json& body) {
  if (key == "response_format") {
    auto t = v.is_object() ? v.find("type") : v.end();
    return t != v.end() && *t == "text" && v.size() == 1;
  }
  if (key == "store") return v.is_boolean() && !v.get<bool>();
  if (key == "modalities") return v == json::array({"text"});
  if (key == "service_tier") return v == "auto" || v == "default";
  if (key == "best_of") {
    auto n = body.find("n");
    const json one = 1;
    return v == one || (n != body.end() && !n->is_null() && v == *n);
  }
  return false;
}

// The first stream option this server does not honour ("" when none).
std::string UnsupportedStreamOption(const json& so) {
  for (const auto& [key, value] : so.items()) {
    if (value.is_null() || key == "include_usage") continue;
    if (key == "include_obfuscation" && value == false) continue;
    return key;
  }
  return "";
}

// Refuses (first by body order) a field this server does not honour.
std::optional<ApiError> CheckFields(const json& body, bool chat) {
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;  // clients send explicit nulls for absent fields
    const FieldRule* rule = nullptr;
    const FieldRule* other_endpoint = nullptr;
    for (const FieldRule& r : kFieldRules) {
      if (key != r.name) continue;
      (RuleApplies(r, chat) ? rule : other_endpoint) = &r;
    }
    if (rule == nullptr) {
      if (other_endpoint != nullptr) {
        return ApiError{400,
                        absl::StrCat(key, " is not a field of ",
                                     chat ? "/v1/chat/completions" : "/v1/completions"),
                        key, "unsupported_parameter"};
      }
      return ApiError{400, absl::StrCat(key, ": unknown field; this server refuses fields it does not "
                                        "honour rather than ignore them"),
                      key, "unknown_parameter"};
    }
    if (rule->refusal != nullptr && !AcceptedAsNoOp(key, value, body)) {
      return ApiError{400, absl::StrCat(key, " is not supported: ", rule->refusal), key,
                      "unsupported_parameter"};
    }
  }
  return std::nullopt;
}

// Parses an OpenAI completion or chat body into the shared parameters.
std::optional<ApiError> ParseBody(const json& body, bool chat, CompletionParams* p,
                                  HttpRequestOptions* o) {
  if (!body.is_object()) {
    return ApiError{400, "the request body must be a JSON object", "", "invalid_json"};
  }
  if (auto e = CheckFields(body, chat)) return e;
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
    ReadResponseFormat(r, p);
    ReadTools(r, p, o);
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
    } else if (top_logprobs > 0) {
      // The reply carries the sampled token's log-probability only.
      r.Fail("top_logprobs",
             "top_logprobs is not supported: only the sampled token's log-probability is "
             "returned (top_logprobs 0)");
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
      } else if (*k > 1) {
        r.Fail("logprobs",
               "logprobs > 1 is not supported: only the sampled token's log-probability is "
               "returned (logprobs 0 or 1)");
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
  ReadStructuredOutputs(r, p);
  if (o->force_tool_call && p->grammar.kind != GrammarSpec::Kind::kNone) {
    r.Fail("tool_choice", absl::StrCat("tool_choice forces a tool call, and ", p->grammar_field,
                                       " constrains the reply too; send one of them"));
  }
  if (o->strict_auto_tools && p->grammar.kind != GrammarSpec::Kind::kNone) {
    r.Fail("tools", absl::StrCat("tools with strict: true constrain their calls by a grammar, and ",
                                 p->grammar_field, " constrains the reply too; send one of them"));
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
    } else if (std::string bad = UnsupportedStreamOption(*so); !bad.empty()) {
      r.Fail("stream_options", absl::StrCat("stream_options.", bad,
                                            " is not supported (only include_usage, and "
                                            "include_obfuscation false)"));
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

std::vector<std::string> KnownOpenAiFields(bool chat) {
  std::vector<std::string> out;
  for (const FieldRule& r : kFieldRules) {
    if (RuleApplies(r, chat)) out.emplace_back(r.name);
  }
  return out;
}

std::optional<ApiError> ParseOpenAiRequest(std::string_view body, bool chat, OpenAiRequest* out) {
  json parsed = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return ApiError{400, "the request body is not valid JSON", "", "invalid_json"};
  }
  *out = OpenAiRequest{};
  std::optional<ApiError> e = ParseBody(parsed, chat, &out->params, &out->options);
  const bool schema = out->params.grammar.kind == GrammarSpec::Kind::kJsonSchema;
  if (!e && (!out->params.tools_json.empty() || schema)) {
    // The catalogue and the schemas as the client ordered them (name,
    // description, parameters; a schema's properties): the model reads the
    // tools, the grammar writes properties in schema order, and parsing
    // above sorted the keys.
    nlohmann::ordered_json ordered =
        nlohmann::ordered_json::parse(body.begin(), body.end(), nullptr, false);
    if (!ordered.is_discarded()) {
      if (!out->params.tools_json.empty()) out->params.tools_json = ordered["tools"].dump();
      if (schema && out->params.grammar_field == "response_format") {
        out->params.grammar.text = ordered["response_format"]["json_schema"]["schema"].dump();
      } else if (schema && ordered["structured_outputs"]["json"].is_object()) {
        out->params.grammar.text = ordered["structured_outputs"]["json"].dump();
      } else if (schema && ordered["structured_outputs"]["json"].is_string()) {
        nlohmann::ordered_json s = nlohmann::ordered_json::parse(
            ordered["structured_outputs"]["json"].get<std::string>(), nullptr, false);
        if (!s.is_discarded()) out->params.grammar.text = s.dump();
      }
    }
  }
  if (!e && (out->options.force_tool_call || out->options.strict_auto_tools)) {
    // One Hermes <tool_call> of the named function, or of any tool
    // (required), whose arguments match its parameters schema.
    nlohmann::ordered_json tools = nlohmann::ordered_json::parse(out->params.tools_json, nullptr, false);
    nlohmann::ordered_json allowed = nlohmann::ordered_json::array();
    for (const auto& t : tools) {
      const auto& f = t["function"];
      if (!f.is_object() || !f["name"].is_string()) continue;
      const std::string name = f["name"].get<std::string>();
      if (!out->options.forced_tool.empty() && name != out->options.forced_tool) continue;
      nlohmann::ordered_json entry = {{"name", name}};
      if (f.contains("parameters") && !f["parameters"].is_null()) entry["parameters"] = f["parameters"];
      entry["strict"] = f.contains("strict") && f["strict"].is_boolean() && f["strict"].get<bool>();
      allowed.push_back(std::move(entry));
    }
    out->params.grammar.kind = out->options.force_tool_call ? GrammarSpec::Kind::kToolCall
                                                            : GrammarSpec::Kind::kToolCallAuto;
    out->params.grammar.text = allowed.dump();
    out->params.grammar.strict = true;
    out->params.grammar_field = "tool_choice";
  }
  return e;
}

}  // namespace kvserve
