// RequestBoard: the requests ModelService has in flight, as the dashboard
// shows them (prompt and generated token counts, waiting or decoding, cached
// prompt tokens), and a bounded record of the ones that finished, so the
// dashboard can count which cached prefixes served them.
//
// Cost on the engine thread: per event a few relaxed atomic stores; one
// mutex lock when a request finishes. Snapshots are taken by the dashboard's
// own thread (server/observe/dashboard.h), never by the engine.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvserve {

class RequestBoard {
 public:
  // One request; shared by the board and the request's event sink.
  struct Entry {
    uint64_t key = 0;  // the board's own id (the engine's id is set later)
    std::atomic<uint64_t> request_id{0};
    std::vector<int32_t> prompt;  // immutable after Add
    std::string cache_salt;       // immutable after Add
    int32_t prompt_tokens = 0;
    int32_t max_tokens = 0;
    int32_t n = 1;
    std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
    std::atomic<int32_t> generated{0};      // tokens produced so far (all samples)
    std::atomic<int32_t> cached_tokens{-1};  // -1 until the first event says
    std::atomic<bool> decoding{false};      // the first token came out
  };

  // What a snapshot shows of one request.
  struct Row {
    uint64_t request_id = 0;
    int32_t prompt_tokens = 0;
    int32_t generated = 0;
    int32_t max_tokens = 0;
    int32_t n = 1;
    int32_t cached_tokens = -1;
    bool decoding = false;
    double age_s = 0;
  };

  // A finished request as the hit accounting needs it.
  struct Finished {
    std::vector<int32_t> prompt;
    std::string cache_salt;
    int32_t cached_tokens = 0;
  };

  // The finished record keeps at most `max_finished` requests and
  // `max_finished_tokens` prompt tokens (the oldest go first), so a daemon
  // nobody watches holds a few megabytes at most.
  explicit RequestBoard(size_t max_finished = 4096, size_t max_finished_tokens = size_t{1} << 20)
      : max_finished_(max_finished), max_finished_tokens_(max_finished_tokens) {}

  std::shared_ptr<Entry> Add(std::vector<int32_t> prompt, std::string cache_salt,
                             int32_t max_tokens, int32_t n);
  // Engine thread: an event of the entry's request arrived.
  static void OnEvent(Entry* e, int32_t new_tokens, int32_t cached_tokens);
  // The request is over (finished, cancelled, or never admitted).
  void Remove(const std::shared_ptr<Entry>& e);

  // In submission order, at most `limit` rows (0: all); `total` gets the
  // number in flight.
  std::vector<Row> Snapshot(size_t limit, size_t* total) const;
  // The finished requests since the last call (oldest first); the board
  // keeps at most max_finished of them, dropping the oldest.
  std::vector<Finished> TakeFinished();
  int64_t dropped_finished() const;

 private:
  const size_t max_finished_;
  const size_t max_finished_tokens_;
  size_t finished_tokens_ = 0;                          // guarded by mu_
  mutable std::mutex mu_;
  uint64_t next_key_ = 1;                               // guarded by mu_
  std::map<uint64_t, std::shared_ptr<Entry>> live_;     // guarded by mu_
  std::deque<Finished> finished_;                       // guarded by mu_
  int64_t dropped_ = 0;                                 // guarded by mu_
};

}  // namespace kvserve
