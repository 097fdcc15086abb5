// Renders chat messages into a prompt string. The model's Jinja template
// (tokenizer.chat_template) is recognized, not interpreted: known families
// (ChatML, as SmolLM2 uses it, with its default system prompt) are rendered
// natively; an unknown template is an error unless the caller opts into the
// documented ChatML fallback.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/gguf.h"

namespace kvserve {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  enum class Family { kChatML };

  // From the model's metadata. Missing or unrecognized template:
  // InvalidArgument naming it, unless allow_fallback (then ChatML).
  [[nodiscard]] static absl::StatusOr<ChatTemplate> FromGguf(const GgufFile& file,
                                                             bool allow_fallback = false);
  [[nodiscard]] static absl::StatusOr<ChatTemplate> FromTemplateString(
      const std::string& jinja, bool allow_fallback = false);

  // add_generation_prompt appends the opening of the assistant turn.
  [[nodiscard]] absl::StatusOr<std::string> Render(const std::vector<ChatMessage>& messages,
                                                   bool add_generation_prompt) const;

  Family family() const { return family_; }
  // Default system prompt injected when the first message is not "system"
  // (empty when the template has none).
  const std::string& default_system() const { return default_system_; }

 private:
  Family family_ = Family::kChatML;
  std::string default_system_;
};

}  // namespace kvserve
