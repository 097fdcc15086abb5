// libFuzzer target: the chat-template renderer. The input is split at NUL
// bytes: the first piece is the template string, then role/content pairs.
// Recognizing the template and rendering must return a Status, never crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      parts.emplace_back();
    } else {
      parts.back().push_back(static_cast<char>(data[i]));
    }
  }
  for (bool fallback : {false, true}) {
    auto tmpl = kvserve::ChatTemplate::FromTemplateString(parts[0], fallback);
    if (!tmpl.ok()) continue;
    std::vector<kvserve::ChatMessage> messages;
    for (size_t i = 1; i + 1 < parts.size(); i += 2) {
      kvserve::ChatMessage m;
      m.role = parts[i];
      m.content = parts[i + 1];
      messages.push_back(std::move(m));
    }
    (void)tmpl->Render(messages, /*add_generation_prompt=*/true);
    (void)tmpl->Render(messages, /*add_generation_prompt=*/false);
  }
  return 0;
}
