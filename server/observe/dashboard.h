// The operator's dashboard (GET /dashboard): what feeds it.
//
// DashboardState is the pure part: a replica of the radix index rebuilt from
// the KV event stream (cache/kv_event_log.h), hit counts attributed from the
// requests that finished (server/service/request_board.h), the pool's block map from
// an EngineStats snapshot, and the latency histograms from the metrics text.
// DashboardFeed owns one thread that, at a fixed period, drains the event log
// and the board into the state, builds one JSON snapshot and hands it to
// every subscriber (the SSE streams of GET /dashboard/events). The cost is
// one snapshot per period whatever the number of viewers (at most
// max_subscribers of them); the engine thread renders nothing.
//
// Thread-safety: DashboardState is not thread-safe (the feed's thread owns
// it); DashboardFeed's methods are thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/kv_event_log.h"
#include "nlohmann/json.hpp"
#include "scheduler/engine.h"
#include "server/service/request_board.h"

namespace kvserve {

class ModelService;

// The page (GET /dashboard) and the API-key form a browser gets as the 401's
// body; self-contained HTML (server/observe/dashboard_page.cc).
std::string_view DashboardPageHtml();
std::string_view DashboardLoginHtml();

// The pool split four ways; the four add up to blocks_total.
struct BlockMap {
  int64_t total = 0;
  int64_t free = 0;              // on the free list
  int64_t running = 0;           // held only by running sequences
  int64_t cached_evictable = 0;  // held only by the prefix cache (an eviction frees it)
  int64_t pinned = 0;            // cached and in use by a running sequence
};
BlockMap BlockMapFromStats(const EngineStats& s);

// A histogram read back from the Prometheus text: per-bucket (not
// cumulative) counts with their upper bounds (the last is +Inf).
struct HistogramView {
  std::vector<double> upper;
  std::vector<uint64_t> counts;
  double sum = 0;
  uint64_t count = 0;
};
// `name` without the _bucket suffix (kvserve:time_to_first_token_seconds).
HistogramView ParseHistogram(std::string_view metrics_text, std::string_view name);

// One cached prefix as the dashboard lists it: a depth-1 block and what hangs
// below it.
struct PrefixRow {
  uint64_t hash = 0;
  std::vector<int32_t> tokens;  // the chain's tokens while it does not branch (capped)
  int64_t blocks = 0;           // blocks in the subtree
  int64_t hits = 0;             // finished requests whose cached prompt used the first block
  int64_t branches = 0;         // children where the chain first branches (0: a plain chain)
  int32_t depth = 0;            // blocks in the shown chain
};

class DashboardState {
 public:
  // Applies one read of the event log (a snapshot resets the replica).
  void Apply(const KvEventRead& read);
  // Adds one hit to every replica block a finished request's cached prompt
  // used (full blocks of `block_size` tokens, matched by tokens from the
  // depth-1 blocks; salts are not told apart).
  void AccountHits(const std::vector<RequestBoard::Finished>& finished, int32_t block_size);
  // The top `k` depth-1 prefixes by hits and by size (ties: the larger, then
  // the older hash order). Chains are followed up to `max_chain_tokens`.
  std::vector<PrefixRow> TopByHits(size_t k, size_t max_chain_tokens) const;
  std::vector<PrefixRow> TopBySize(size_t k, size_t max_chain_tokens) const;

  size_t num_blocks() const { return nodes_.size(); }
  uint64_t last_sequence() const { return last_sequence_; }
  int64_t hits_accounted() const { return hits_accounted_; }

 private:
  struct Node {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> children;
    int64_t hits = 0;
  };
  void Store(const KvCacheEvent& e);
  void Remove(uint64_t hash);
  std::vector<PrefixRow> Rows(size_t max_chain_tokens) const;
  int64_t SubtreeSize(uint64_t hash) const;

  std::unordered_map<uint64_t, Node> nodes_;
  std::vector<uint64_t> roots_;  // depth-1 blocks (parent 0), in arrival order
  uint64_t last_sequence_ = 0;
  int64_t hits_accounted_ = 0;
};

class DashboardFeed {
 public:
  struct Options {
    std::chrono::milliseconds period{500};
    int max_subscribers = 16;
    size_t top_k = 10;
    size_t max_sequences = 64;  // rows of the sequences table
  };
  // REQUIRES: service outlives the feed.
  DashboardFeed(ModelService* service, Options options);
  ~DashboardFeed();  // stops the thread; subscribers get nothing more
  DashboardFeed(const DashboardFeed&) = delete;
  DashboardFeed& operator=(const DashboardFeed&) = delete;

  // `write` gets each snapshot as one SSE event (from the feed's thread; it
  // must not block), the latest one at once. Returns an id for Unsubscribe,
  // or -1 when max_subscribers are connected.
  int64_t Subscribe(std::function<void(const std::string&)> write);
  void Unsubscribe(int64_t id);
  int num_subscribers() const;
  int max_subscribers() const { return options_.max_subscribers; }
  // The latest snapshot as JSON (built now if none was built yet).
  std::string SnapshotJson();
  // An SSE event carrying `json`.
  static std::string SseEvent(const std::string& json);

 private:
  void Run();
  // REQUIRES: state_mu_ held. Drains the event log and the board; with
  // `build`, also makes the snapshot.
  void TickLocked(bool build);
  nlohmann::json BuildLocked(const EngineStats& stats);

  ModelService* service_;
  Options options_;
  std::mutex state_mu_;  // the state and the last snapshot
  DashboardState state_;
  std::string latest_;   // guarded by state_mu_
  uint64_t ticks_ = 0;   // guarded by state_mu_
  EngineStats prev_stats_;  // guarded by state_mu_; for the per-period rates
  bool have_prev_ = false;  // guarded by state_mu_
  std::chrono::steady_clock::time_point prev_at_;

  mutable std::mutex subs_mu_;
  std::map<int64_t, std::function<void(const std::string&)>> subs_;  // guarded by subs_mu_
  int64_t next_sub_ = 1;  // guarded by subs_mu_

  std::mutex run_mu_;
  std::condition_variable run_cv_;
  bool stop_ = false;  // guarded by run_mu_
  std::thread thread_;
};

}  // namespace kvserve
