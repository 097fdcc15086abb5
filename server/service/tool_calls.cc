// Tool calling: rendering tools into the prompt and parsing tool calls out of
// the reply (see tool_calls.h).
#include "server/service/tool_calls.h"

#include <algorithm>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvserve {

namespace {

// Ordered: the catalogue and the calls keep the client's key order (name
// before arguments), as the model saw them in training.
using nlohmann::ordered_json;

// char arrays for absl::StrCat (it does not take std::string_view here).
constexpr char kOpenTag[] = "<tool_call>";
constexpr char kCloseTag[] = "</tool_call>";
constexpr std::string_view kOpen = kOpenTag;
constexpr std::string_view kClose = kCloseTag;

std::string CallId() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id.push_back(kChars[rng() % (sizeof(kChars) - 1)]);
  return id;
}

// A JSON value as the template sees it.
jinja::Value ToJinja(const ordered_json& j) {
  switch (j.type()) {
    case ordered_json::value_t::null: return jinja::Value::None();
    case ordered_json::value_t::boolean: return jinja::Value::Bool(j.get<bool>());
    case ordered_json::value_t::number_integer:
    case ordered_json::value_t::number_unsigned: return jinja::Value::Int(j.get<int64_t>());
    case ordered_json::value_t::number_float: return jinja::Value::Float(j.get<double>());
    case ordered_json::value_t::string: return jinja::Value::String(j.get<std::string>());
    case ordered_json::value_t::array: {
      jinja::Array a;
      for (const ordered_json& e : j) a.push_back(ToJinja(e));
      return jinja::Value::MakeArray(std::move(a));
    }
    case ordered_json::value_t::object: {
      jinja::Object o;
      for (const auto& [k, v] : j.items()) o.emplace_back(k, ToJinja(v));
      return jinja::Value::MakeObject(std::move(o));
    }
    default: return jinja::Value();
  }
}

// An OpenAI call's arguments (a JSON text) as an object when they parse.
ordered_json ArgumentsJson(const ordered_json& function) {
  auto a = function.find("arguments");
  if (a == function.end() || a->is_null()) return ordered_json::object();
  if (!a->is_string()) return *a;
  ordered_json parsed = ordered_json::parse(a->get<std::string>(), nullptr, /*allow_exceptions=*/false);
  return parsed.is_discarded() ? *a : parsed;
}

// One block's JSON as a call, when it is {"name": string, "arguments": ...}.
std::optional<ToolCall> CallFromJson(std::string_view body) {
  ordered_json j = ordered_json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) {
    return std::nullopt;
  }
  ToolCall c;
  c.id = CallId();
  c.name = name->get<std::string>();
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");  // some models' spelling
  if (args == j.end() || args->is_null()) {
    c.arguments = "{}";
  } else if (args->is_string()) {
    c.arguments = args->get<std::string>();
  } else {
    c.arguments = args->dump();
  }
  return c;
}

bool IsBlank(std::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isspace(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// The length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t HeldPrefix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

bool NeedsToolRendering(const std::vector<ChatMessage>& messages, const std::string& tools_json) {
  if (!tools_json.empty()) return true;
  for (const ChatMessage& m : messages) {
    if (m.role == "tool" || m.role == "developer" || !m.tool_calls_json.empty()) return true;
  }
  return false;
}

std::string HermesToolsPrompt(const std::string& tools_json) {
  std::string out =
      "# Tools\n\nYou can call the functions listed below when they help with the user's request. "
      "Their signatures are inside the <tools></tools> tags:\n<tools>";
  ordered_json tools = ordered_json::parse(tools_json, nullptr, /*allow_exceptions=*/false);
  if (tools.is_array()) {
    for (const ordered_json& t : tools) absl::StrAppend(&out, "\n", t.dump());
  }
  absl::StrAppend(
      &out,
      "\n</tools>\n\nTo call a function, reply with a JSON object holding its name and its "
      "arguments inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
      "{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>");
  return out;
}

absl::StatusOr<std::string> RenderChatWithTools(const ChatTemplate& t,
                                                std::vector<ChatMessage> messages,
                                                const std::string& tools_json) {
  if (!t.Mentions("developer")) {
    for (ChatMessage& m : messages) {
      if (m.role == "developer") m.role = "system";
    }
  }
  ordered_json tools = tools_json.empty() ? ordered_json::array() : ordered_json::parse(tools_json, nullptr, false);
  if (tools.is_discarded()) return absl::InvalidArgumentError("tools is not valid JSON");

  if (t.interpreted() && (t.Mentions("tools") || t.Mentions("tool_calls"))) {
    // The template renders tools itself: give them as apply_chat_template does.
    jinja::Object variables;
    if (!tools.empty()) variables.emplace_back("tools", ToJinja(tools));
    std::vector<jinja::Object> fields(messages.size());
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if (!m.tool_calls_json.empty()) {
        ordered_json calls = ordered_json::parse(m.tool_calls_json, nullptr, false);
        if (calls.is_discarded()) {
          return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].tool_calls is not JSON"));
        }
        // Hugging Face's templates expect the arguments as an object.
        for (ordered_json& c : calls) {
          if (c.contains("function")) c["function"]["arguments"] = ArgumentsJson(c["function"]);
        }
        fields[i].emplace_back("tool_calls", ToJinja(calls));
      }
      if (!m.tool_call_id.empty()) {
        fields[i].emplace_back("tool_call_id", jinja::Value::String(m.tool_call_id));
      }
      if (!m.name.empty()) fields[i].emplace_back("name", jinja::Value::String(m.name));
    }
    return t.Render(messages, /*add_generation_prompt=*/true, variables, fields);
  }

  // The template knows nothing of tools: write them in (Hermes convention).
  std::vector<ChatMessage> out;
  out.reserve(messages.size() + 1);
  if (!tools.empty()) {
    const std::string catalogue = HermesToolsPrompt(tools.dump());
    if (!messages.empty() && messages[0].role == "system") {
      messages[0].content = absl::StrCat(messages[0].content, "\n\n", catalogue);
    } else {
      const std::string& base = t.default_system();
      out.push_back({"system", base.empty() ? catalogue : absl::StrCat(base, "\n\n", catalogue)});
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    ChatMessage m = messages[i];
    if (!m.tool_calls_json.empty()) {
      ordered_json calls = ordered_json::parse(m.tool_calls_json, nullptr, false);
      if (calls.is_discarded()) {
        return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].tool_calls is not JSON"));
      }
      for (const ordered_json& c : calls) {
        const ordered_json& f = c.at("function");
        ordered_json call = {{"name", f.value("name", "")}, {"arguments", ArgumentsJson(f)}};
        absl::StrAppend(&m.content, m.content.empty() ? "" : "\n", kOpenTag, "\n", call.dump(),
                        "\n", kCloseTag);
      }
    }
    if (m.role == "tool") {
      m.content = absl::StrCat("<tool_response>\n", m.content, "\n</tool_response>");
    }
    m.tool_calls_json.clear();
    m.tool_call_id.clear();
    m.name.clear();
    out.push_back(std::move(m));
  }
  return t.Render(out, /*add_generation_prompt=*/true);
}

ParsedToolCalls ParseToolCalls(std::string_view text, bool parallel) {
  ParsedToolCalls out;
  ToolCallStreamer s(parallel);
  std::string content = s.Feed(text, &out.calls);
  content += s.Finish(&out.calls);
  out.content = std::string(absl::StripAsciiWhitespace(content));
  return out;
}

void ToolCallStreamer::AddCall(ToolCall call, std::vector<ToolCall>* calls) {
  ++num_calls_;
  if (parallel_ || num_calls_ == 1) calls->push_back(std::move(call));
}

std::string ToolCallStreamer::Content(std::string text, bool final) {
  // Whitespace alone waits: it is dropped if only calls follow it.
  pending_ += text;
  if (IsBlank(pending_)) {
    if (final && num_calls_ == 0) return std::exchange(pending_, "");
    return "";
  }
  sent_content_ = true;
  return std::exchange(pending_, "");
}

std::string ToolCallStreamer::Feed(std::string_view text, std::vector<ToolCall>* calls) {
  buffer_.append(text);
  std::string out;
  while (true) {
    if (!inside_) {
      const size_t open = buffer_.find(kOpen);
      if (open == std::string::npos) {
        const size_t hold = HeldPrefix(buffer_, kOpen);
        out += Content(buffer_.substr(0, buffer_.size() - hold), false);
        buffer_.erase(0, buffer_.size() - hold);
        return out;
      }
      out += Content(buffer_.substr(0, open), false);
      buffer_.erase(0, open + kOpen.size());
      inside_ = true;
    }
    const size_t close = buffer_.find(kClose);
    if (close == std::string::npos) return out;
    if (std::optional<ToolCall> c = CallFromJson(buffer_.substr(0, close))) {
      pending_.clear();  // whitespace before a call is not content
      AddCall(*std::move(c), calls);
    } else {
      out += Content(absl::StrCat(kOpenTag, buffer_.substr(0, close + kClose.size())), false);
    }
    buffer_.erase(0, close + kClose.size());
    inside_ = false;
  }
}

std::string ToolCallStreamer::Finish(std::vector<ToolCall>* calls) {
  std::string out;
  if (inside_) {
    // A model that stops after the JSON without closing the tag.
    if (std::optional<ToolCall> c = CallFromJson(buffer_)) {
      pending_.clear();
      AddCall(*std::move(c), calls);
    } else {
      out += Content(absl::StrCat(kOpenTag, buffer_), true);
    }
  } else {
    out += Content(buffer_, true);
  }
  buffer_.clear();
  inside_ = false;
  return out;
}

}  // namespace kvserve
