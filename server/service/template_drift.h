// TemplateDriftGuard: notices when a chat template renders the earlier turns
// of a conversation differently on the next turn (an empty reasoning block
// dropped from past assistant turns, a date line near the top), which makes
// the new prompt leave the cached previous turn early and recompute all of
// it (docs/cache-control.md).
//
// It remembers, per cache scope, how each turn's prompt was rendered, keyed
// by that turn's messages. On the next turn (the same messages, the reply,
// and new ones) it finds the reply in the new rendering and compares what
// precedes it with the remembered prompt: any difference is drift. The
// template position (the first differing character) is logged once per
// position. With canonicalization on, the history is rendered the way the
// cached turn was: remembered prompt + the new rendering from the reply on.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "model/chat_template.h"

namespace kvserve {

struct DriftCheck {
  bool known = false;        // the previous turn's rendering is remembered
  bool drift = false;        // it differs from how this turn renders it
  size_t char_pos = 0;       // drift: first differing character of the prompt
  std::string previous;      // known: the previous turn's prompt as rendered then
  std::string canonical;     // drift: previous + this rendering from the reply on
};

class TemplateDriftGuard {
 public:
  explicit TemplateDriftGuard(bool canonicalize, size_t max_entries = 4096)
      : canonicalize_(canonicalize), max_entries_(max_entries) {}

  // The messages of this turn and the template's rendering of them (with
  // the generation prompt).
  DriftCheck Check(const std::string& scope, const std::vector<ChatMessage>& messages,
                   const std::string& rendered);
  // The prompt this turn was sent with (canonical or not), for the next.
  void Remember(const std::string& scope, const std::vector<ChatMessage>& messages,
                const std::string& prompt);
  bool canonicalize() const { return canonicalize_; }
  int64_t drifts() const;

 private:
  static std::string Key(const std::string& scope, const std::vector<ChatMessage>& messages,
                         size_t n);
  const bool canonicalize_;
  const size_t max_entries_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> rendered_;  // guarded by mu_
  std::deque<std::string> order_;                          // guarded by mu_
  std::unordered_set<size_t> logged_;                      // guarded by mu_
  int64_t drifts_ = 0;                                     // guarded by mu_
};

}  // namespace kvserve
