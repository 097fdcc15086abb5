// The implementation of RequestBoard. What it owns and how it is used: the
// opening paragraph of server/service/request_board.h.

#include "server/service/request_board.h"

#include <utility>

namespace kvserve {

std::shared_ptr<RequestBoard::Entry> RequestBoard::Add(std::vector<int32_t> prompt,
                                                       std::string cache_salt,
                                                       int32_t max_tokens, int32_t n) {
  auto e = std::make_shared<Entry>();
  e->prompt_tokens = static_cast<int32_t>(prompt.size());
  e->prompt = std::move(prompt);
  e->cache_salt = std::move(cache_salt);
  e->max_tokens = max_tokens;
  e->n = n;
  std::lock_guard<std::mutex> lock(mu_);
  e->key = next_key_++;
  live_.emplace(e->key, e);
  return e;
}

void RequestBoard::OnEvent(Entry* e, int32_t new_tokens, int32_t cached_tokens) {
  if (new_tokens > 0) {
    e->generated.fetch_add(new_tokens, std::memory_order_relaxed);
    e->decoding.store(true, std::memory_order_relaxed);
  }
  if (cached_tokens >= 0 && e->cached_tokens.load(std::memory_order_relaxed) < 0) {
    e->cached_tokens.store(cached_tokens, std::memory_order_relaxed);
  }
}

void RequestBoard::Remove(const std::shared_ptr<Entry>& e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (live_.erase(e->key) == 0) return;
  const int32_t cached = e->cached_tokens.load(std::memory_order_relaxed);
  if (cached <= 0 || max_finished_ == 0) return;  // nothing for the hit accounting
  if (e->prompt.size() > max_finished_tokens_) {
    ++dropped_;
    return;
  }
  while (!finished_.empty() && (finished_.size() >= max_finished_ ||
                                finished_tokens_ + e->prompt.size() > max_finished_tokens_)) {
    finished_tokens_ -= finished_.front().prompt.size();
    finished_.pop_front();
    ++dropped_;
  }
  finished_tokens_ += e->prompt.size();
  // The entry is gone from the board and its sink is done with it: its
  // prompt can be moved (the shared_ptr may still be held by the sink).
  finished_.push_back({std::move(e->prompt), e->cache_salt, cached});
}

std::vector<RequestBoard::Row> RequestBoard::Snapshot(size_t limit, size_t* total) const {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Row> rows;
  std::lock_guard<std::mutex> lock(mu_);
  if (total != nullptr) *total = live_.size();
  for (const auto& [key, e] : live_) {
    if (limit != 0 && rows.size() >= limit) break;
    Row r;
    r.request_id = e->request_id.load(std::memory_order_relaxed);
    r.prompt_tokens = e->prompt_tokens;
    r.generated = e->generated.load(std::memory_order_relaxed);
    r.max_tokens = e->max_tokens;
    r.n = e->n;
    r.cached_tokens = e->cached_tokens.load(std::memory_order_relaxed);
    r.decoding = e->decoding.load(std::memory_order_relaxed);
    r.age_s = std::chrono::duration<double>(now - e->submitted).count();
    rows.push_back(r);
  }
  return rows;
}

std::vector<RequestBoard::Finished> RequestBoard::TakeFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Finished> out(std::make_move_iterator(finished_.begin()),
                            std::make_move_iterator(finished_.end()));
  finished_.clear();
  finished_tokens_ = 0;
  return out;
}

int64_t RequestBoard::dropped_finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

}  // namespace kvserve
