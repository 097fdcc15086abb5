// The implementation of TemplateDriftGuard. What it owns and how it is used: the
// opening paragraph of server/service/template_drift.h.

#include "server/service/template_drift.h"

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvserve {

std::string TemplateDriftGuard::Key(const std::string& scope,
                                    const std::vector<ChatMessage>& messages, size_t n) {
  // Length-prefixed, so no two message lists share a key.
  std::string k = absl::StrCat(scope.size(), ":", scope);
  for (size_t i = 0; i < n && i < messages.size(); ++i) {
    absl::StrAppend(&k, "|", messages[i].role.size(), ":", messages[i].role,
                    messages[i].content.size(), ":", messages[i].content);
  }
  // Stored by hash: a long conversation's key would be the conversation.
  const XXH128_hash_t h = XXH3_128bits(k.data(), k.size());
  return absl::StrCat(absl::Hex(h.high64, absl::kZeroPad16), absl::Hex(h.low64, absl::kZeroPad16));
}

DriftCheck TemplateDriftGuard::Check(const std::string& scope,
                                     const std::vector<ChatMessage>& messages,
                                     const std::string& rendered) {
  DriftCheck c;
  // The previous turn: the messages before the last assistant message.
  size_t last_assistant = messages.size();
  for (size_t i = messages.size(); i-- > 0;) {
    if (messages[i].role == "assistant") {
      last_assistant = i;
      break;
    }
  }
  if (last_assistant == messages.size() || last_assistant == 0) return c;
  const std::string& reply = messages[last_assistant].content;
  if (reply.empty()) return c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rendered_.find(Key(scope, messages, last_assistant));
    if (it == rendered_.end()) return c;
    c.previous = it->second;
  }
  c.known = true;
  // Where the reply starts in this rendering: its last occurrence at or
  // after the previous prompt's length minus what drift may have removed.
  const size_t pos = rendered.rfind(reply);
  if (pos == std::string::npos) return c;
  const std::string_view history(rendered.data(), pos);
  if (history == c.previous) return c;
  c.drift = true;
  size_t i = 0;
  while (i < history.size() && i < c.previous.size() && history[i] == c.previous[i]) ++i;
  c.char_pos = i;
  c.canonical = c.previous + rendered.substr(pos);
  bool log = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++drifts_;
    log = logged_.insert(i).second;
  }
  if (log) {
    const size_t from = i >= 24 ? i - 24 : 0;
    spdlog::warn(
        "chat template drift: the history renders differently from the cached turn at "
        "character {} (cached: '{}' | now: '{}'){}",
        i, c.previous.substr(from, 48), std::string(history.substr(from, 48)),
        canonicalize_ ? "; canonicalizing history" : "; --chat-canonicalize-history reuses the cached turn");
  }
  return c;
}

void TemplateDriftGuard::Remember(const std::string& scope,
                                  const std::vector<ChatMessage>& messages,
                                  const std::string& prompt) {
  std::string key = Key(scope, messages, messages.size());
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = rendered_.insert_or_assign(key, prompt);
  if (inserted) order_.push_back(std::move(key));
  while (order_.size() > max_entries_) {
    rendered_.erase(order_.front());
    order_.pop_front();
  }
}

int64_t TemplateDriftGuard::drifts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return drifts_;
}

}  // namespace kvserve
