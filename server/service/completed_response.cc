// The implementation of CompletedResponse. What it owns and how it is used: the
// opening paragraph of server/service/completed_response.h.

#include "server/service/completed_response.h"

#include <algorithm>
#include <utility>

namespace kvserve {

ResponseAccumulator::ResponseAccumulator(int32_t n, int32_t prompt_tokens) {
  const int32_t samples = std::max(1, n);
  response_.samples.resize(samples);
  for (int32_t i = 0; i < samples; ++i) response_.samples[i].index = i;
  response_.prompt_tokens = prompt_tokens;
  open_samples_ = samples;
}

bool ResponseAccumulator::Add(const SeqEvent& ev) {
  absl::MutexLock lock(&mu_);
  if (taken_) return false;
  response_.request_id = ev.request_id;
  if (ev.prompt_tokens > 0) response_.prompt_tokens = ev.prompt_tokens;
  response_.cached_tokens = std::max(response_.cached_tokens, ev.cached_tokens);
  response_.draft_accepted = std::max(response_.draft_accepted, ev.draft_accepted);
  response_.cached_host_tokens = std::max(response_.cached_host_tokens, ev.cached_host_tokens);
  response_.cached_disk_tokens = std::max(response_.cached_disk_tokens, ev.cached_disk_tokens);
  response_.cached_lossy_tokens = std::max(response_.cached_lossy_tokens, ev.cached_lossy_tokens);
  response_.lossy_kv = response_.lossy_kv || ev.lossy_kv;
  if (ev.index < 0 || ev.index >= static_cast<int32_t>(response_.samples.size())) return false;
  CompletedSample& s = response_.samples[ev.index];
  s.token_ids.insert(s.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
  s.logprobs.insert(s.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
  s.text += ev.text;
  if (ev.completion_tokens > s.completion_tokens) {
    response_.completion_tokens += ev.completion_tokens - s.completion_tokens;
    s.completion_tokens = ev.completion_tokens;
  }
  // Like completion_tokens, a running count: the newest is the largest.
  if (ev.dropped_tokens > s.dropped_tokens) {
    response_.dropped_tokens += ev.dropped_tokens - s.dropped_tokens;
    s.dropped_tokens = ev.dropped_tokens;
  }
  if (ev.finish == FinishReason::kNone || s.finish != FinishReason::kNone) return false;
  s.finish = ev.finish;
  --open_samples_;
  if (ev.finish == FinishReason::kCancelled || ev.finish == FinishReason::kDeadline) {
    response_.abort_reason = ev.finish;
  }
  return true;
}

bool ResponseAccumulator::done() const {
  absl::MutexLock lock(&mu_);
  return open_samples_ == 0;
}

size_t ResponseAccumulator::text_size(int32_t index) const {
  absl::MutexLock lock(&mu_);
  if (index < 0 || index >= static_cast<int32_t>(response_.samples.size())) return 0;
  return response_.samples[index].text.size();
}

CompletedResponse ResponseAccumulator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return response_;
}

CompletedResponse ResponseAccumulator::Take() {
  absl::MutexLock lock(&mu_);
  taken_ = true;
  return std::move(response_);
}

}  // namespace kvserve
