#include "model/chat_template.h"

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvserve {

namespace {

// char arrays, not string_views: this absl's StrCat takes its own
// string_view type, which std::string_view does not convert to.
constexpr char kImStart[] = "<|im_start|>";
constexpr char kImEnd[] = "<|im_end|>";
constexpr size_t kQuoteChars = 80;  // how much of an unknown template an error shows

// Undoes the escapes a Jinja string literal may use, so a default prompt
// written as '...\n...' in the template source renders as the model saw it.
std::string UnescapeJinjaLiteral(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      default:  // \' \" \\ and anything else: the character itself
        out.push_back(c);
        break;
    }
  }
  return out;
}

bool IsPlainLiteralText(std::string_view s) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;  // an escaped character, quotes included, stays inside the literal
    } else if (s[i] == '\'' || s[i] == '"' || s[i] == '{' || s[i] == '}') {
      return false;
    }
  }
  return true;
}

// The system prompt a ChatML template writes as a literal when the
// conversation has none: the text between "<|im_start|>system" + newline
// and the next "<|im_end|>", when that span is plain text (no Jinja
// expression, so it is not the caller's system message being rendered).
std::string ExtractDefaultSystem(std::string_view jinja) {
  const std::string header = absl::StrCat(kImStart, "system");
  size_t pos = 0;
  while ((pos = jinja.find(header, pos)) != std::string_view::npos) {
    size_t begin = pos + header.size();
    if (jinja.substr(begin, 1) == "\n") {
      begin += 1;
    } else if (jinja.substr(begin, 2) == "\\n") {
      begin += 2;
    } else {
      pos = begin;
      continue;
    }
    const size_t end = jinja.find(kImEnd, begin);
    if (end == std::string_view::npos) break;
    const std::string_view body = jinja.substr(begin, end - begin);
    // An unescaped quote or a brace means the span leaves the literal (e.g.
    // '...' + message['content'] + '...'): that is the caller's system
    // turn, not a default.
    if (!body.empty() && IsPlainLiteralText(body)) return UnescapeJinjaLiteral(body);
    pos = end;
  }
  return "";
}

}  // namespace

namespace {

// The text of the token a metadata key names (tokenizer.ggml.bos_token_id),
// or "" when the model has none.
std::string SpecialTokenText(const GgufFile& file, const std::string& key) {
  if (!file.Has(key) || !file.Has("tokenizer.ggml.tokens")) return "";
  absl::StatusOr<int64_t> id = file.GetI64(key);
  if (!id.ok() || *id < 0) return "";
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok() || *id >= static_cast<int64_t>(tokens->size())) return "";
  return (*tokens)[*id];
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromGguf(const GgufFile& file, bool allow_fallback) {
  if (!file.Has("tokenizer.chat_template")) {
    if (allow_fallback) return ChatTemplate();
    return absl::InvalidArgumentError(
        "the model's GGUF has no tokenizer.chat_template (base models' files often have none)");
  }
  ASSIGN_OR_RETURN(std::string jinja, file.GetString("tokenizer.chat_template"));
  return FromTemplateString(jinja, allow_fallback,
                            SpecialTokenText(file, "tokenizer.ggml.bos_token_id"),
                            SpecialTokenText(file, "tokenizer.ggml.eos_token_id"));
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromGgufWithTemplate(const GgufFile& file,
                                                                const std::string& jinja) {
  return FromTemplateString(jinja, /*allow_fallback=*/false,
                            SpecialTokenText(file, "tokenizer.ggml.bos_token_id"),
                            SpecialTokenText(file, "tokenizer.ggml.eos_token_id"));
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTemplateString(const std::string& jinja,
                                                              bool allow_fallback,
                                                              std::string bos_token,
                                                              std::string eos_token) {
  ChatTemplate t;
  const bool chatml =
      jinja.find(kImStart) != std::string::npos && jinja.find(kImEnd) != std::string::npos;
  if (chatml) t.default_system_ = ExtractDefaultSystem(jinja);
  if (jinja.empty()) {
    if (allow_fallback) return t;
    return absl::InvalidArgumentError(
        "tokenizer.chat_template is empty; pass allow_fallback to use ChatML");
  }
  absl::StatusOr<std::shared_ptr<const jinja::Template>> parsed = jinja::Template::Parse(jinja);
  if (!parsed.ok()) {
    if (allow_fallback) {
      t.fallback_reason_ = std::string(parsed.status().message());
      return t;  // plain ChatML
    }
    const bool cut = jinja.size() > kQuoteChars;
    return absl::InvalidArgumentError(absl::StrCat(
        parsed.status().message(), " in tokenizer.chat_template \"", jinja.substr(0, kQuoteChars),
        cut ? "...\"" : "\"", "; pass allow_fallback to use ChatML"));
  }
  t.jinja_ = *std::move(parsed);
  t.source_ = jinja;
  t.bos_token_ = std::move(bos_token);
  t.eos_token_ = std::move(eos_token);
  return t;
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const std::vector<ChatMessage>& messages, bool add_generation_prompt,
    const jinja::Object& variables, const std::vector<jinja::Object>& message_fields) const {
  if (jinja_ == nullptr) return absl::FailedPreconditionError("the chat template is not interpreted");
  jinja::Context ctx;
  jinja::Array msgs;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role is empty"));
    }
    jinja::Object m = {{"role", jinja::Value::String(messages[i].role)},
                       {"content", jinja::Value::String(messages[i].content)}};
    if (i < message_fields.size()) {
      for (const auto& [k, v] : message_fields[i]) m.emplace_back(k, v);
    }
    msgs.push_back(jinja::Value::MakeObject(std::move(m)));
  }
  ctx.variables = {{"messages", jinja::Value::MakeArray(std::move(msgs))},
                   {"add_generation_prompt", jinja::Value::Bool(add_generation_prompt)},
                   {"bos_token", jinja::Value::String(bos_token_)},
                   {"eos_token", jinja::Value::String(eos_token_)}};
  for (const auto& [k, v] : variables) ctx.variables.emplace_back(k, v);
  ctx.now = now_;
  return jinja_->Render(ctx);
}

absl::StatusOr<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                 bool add_generation_prompt) const {
  if (jinja_ != nullptr) return Render(messages, add_generation_prompt, {}, {});
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role is empty"));
    }
    if (i == 0 && m.role != "system" && !default_system_.empty()) {
      absl::StrAppend(&out, kImStart, "system\n", default_system_, kImEnd, "\n");
    }
    absl::StrAppend(&out, kImStart, m.role, "\n", m.content, kImEnd, "\n");
  }
  if (add_generation_prompt) absl::StrAppend(&out, kImStart, "assistant\n");
  return out;
}

}  // namespace kvserve
