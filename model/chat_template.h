// Renders chat messages into a prompt string. The model's Jinja template
// (tokenizer.chat_template) is interpreted by model/jinja.h with the
// variables Hugging Face's apply_chat_template gives it (messages,
// add_generation_prompt, bos_token, eos_token, strftime_now). A template
// outside the interpreter's subset is an error naming the construct,
// unless the caller opts into the documented ChatML fallback (rendered
// natively, as is a model without a template when the fallback is
// allowed).
#pragma once

#include <string>
#include <vector>

#include <ctime>
#include <memory>

#include "absl/status/statusor.h"
#include "model/gguf.h"
#include "model/jinja.h"

namespace kvserve {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool", "developer"
  std::string content;
  // Tool calling (server/service/tool_calls.h): an assistant turn's tool_calls (a
  // JSON array text, "" when none), a tool turn's tool_call_id, and a tool
  // turn's function name.
  std::string tool_calls_json = {};
  std::string tool_call_id = {};
  std::string name = {};
};

class ChatTemplate {
 public:
  enum class Family { kChatML };

  // From the model's metadata. Missing or unrecognized template:
  // InvalidArgument naming it, unless allow_fallback (then ChatML).
  [[nodiscard]] static absl::StatusOr<ChatTemplate> FromGguf(const GgufFile& file,
                                                             bool allow_fallback = false);
  // The model's BOS / EOS texts with another template (serve --chat-template).
  [[nodiscard]] static absl::StatusOr<ChatTemplate> FromGgufWithTemplate(const GgufFile& file,
                                                                         const std::string& jinja);
  // bos_token / eos_token: the texts of the model's BOS / EOS tokens, as
  // the template sees them.
  [[nodiscard]] static absl::StatusOr<ChatTemplate> FromTemplateString(
      const std::string& jinja, bool allow_fallback = false, std::string bos_token = "",
      std::string eos_token = "");

  // add_generation_prompt appends the opening of the assistant turn.
  [[nodiscard]] absl::StatusOr<std::string> Render(const std::vector<ChatMessage>& messages,
                                                   bool add_generation_prompt) const;
  // The same with more template variables (tools) and, per message, more
  // fields (tool_calls, ...; message_fields is empty or one per message).
  // REQUIRES: interpreted().
  [[nodiscard]] absl::StatusOr<std::string> Render(
      const std::vector<ChatMessage>& messages, bool add_generation_prompt,
      const jinja::Object& variables, const std::vector<jinja::Object>& message_fields) const;
  // True when the interpreted template's source mentions `name` (a variable
  // such as "tools", or a role such as "developer").
  bool Mentions(const std::string& name) const {
    return jinja_ != nullptr && source_.find(name) != std::string::npos;
  }

  Family family() const { return family_; }
  // True when the model's own template is interpreted (false: the native
  // ChatML fallback).
  bool interpreted() const { return jinja_ != nullptr; }
  // Why the model's template was not used (set when the fallback was taken
  // for a template that does not parse).
  const std::string& fallback_reason() const { return fallback_reason_; }
  // Tests pin the clock strftime_now reads (0: the current time).
  void set_now_for_testing(std::time_t now) { now_ = now; }
  // Default system prompt injected when the first message is not "system"
  // (empty when the template has none).
  const std::string& default_system() const { return default_system_; }

 private:
  Family family_ = Family::kChatML;
  std::string default_system_;
  std::shared_ptr<const jinja::Template> jinja_;
  std::string source_;  // the interpreted template's text
  std::string bos_token_, eos_token_;
  std::string fallback_reason_;
  std::time_t now_ = 0;
};

}  // namespace kvserve
