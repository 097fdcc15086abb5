// The implementation of dashboard.h. What it owns and how it is used: the
// opening paragraph of server/observe/dashboard.h.

#include "server/observe/dashboard.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/service/model_service.h"

namespace kvserve {

using json = nlohmann::json;

BlockMap BlockMapFromStats(const EngineStats& s) {
  BlockMap m;
  m.total = s.blocks_total;
  // blocks_free counts the free list and the evictable cached blocks;
  // blocks_used the rest (what sequences hold, cached or not).
  m.cached_evictable = std::clamp<int64_t>(s.prefix_evictable_blocks, 0, s.blocks_free);
  m.free = s.blocks_free - m.cached_evictable;
  m.pinned = std::clamp<int64_t>(s.prefix_cached_blocks - s.prefix_evictable_blocks, 0,
                                 s.blocks_used);
  m.running = s.blocks_used - m.pinned;
  return m;
}

namespace {
// Debian's Abseil has its own string_view.
bool ToDouble(std::string_view s, double* out) {
  return absl::SimpleAtod(absl::string_view(s.data(), s.size()), out);
}
}  // namespace

HistogramView ParseHistogram(std::string_view text, std::string_view name) {
  HistogramView h;
  const std::string bucket = std::string(name) + "_bucket{";
  const std::string sum = std::string(name) + "_sum";
  const std::string count = std::string(name) + "_count";
  uint64_t prev = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string_view::npos) continue;
    const std::string_view value = line.substr(space + 1);
    if (line.substr(0, bucket.size()) == bucket) {
      const size_t le = line.find("le=\"");
      if (le == std::string_view::npos) continue;
      const size_t q = line.find('"', le + 4);
      if (q == std::string_view::npos) continue;
      const std::string_view bound = line.substr(le + 4, q - le - 4);
      double upper = 0;
      if (bound == "+Inf") {
        upper = INFINITY;
      } else if (!ToDouble(bound, &upper)) {
        continue;
      }
      double cumulative = 0;
      if (!ToDouble(value, &cumulative)) continue;
      const uint64_t c = static_cast<uint64_t>(cumulative);
      h.upper.push_back(upper);
      h.counts.push_back(c >= prev ? c - prev : 0);
      prev = c;
    } else if (line.substr(0, sum.size()) == sum &&
               (line.size() > sum.size() && (line[sum.size()] == '{' || line[sum.size()] == ' '))) {
      (void)ToDouble(value, &h.sum);
    } else if (line.substr(0, count.size()) == count &&
               (line.size() > count.size() &&
                (line[count.size()] == '{' || line[count.size()] == ' '))) {
      double c = 0;
      if (ToDouble(value, &c)) h.count = static_cast<uint64_t>(c);
    }
  }
  return h;
}

// ---------------------------------------------------------------------------

void DashboardState::Store(const KvCacheEvent& e) {
  auto [it, inserted] = nodes_.try_emplace(e.block_hash);
  if (!inserted) return;  // already known (a repeated snapshot entry)
  it->second.parent = e.parent_hash;
  it->second.tokens = e.token_ids;
  if (e.parent_hash == 0) {
    roots_.push_back(e.block_hash);
  } else if (auto p = nodes_.find(e.parent_hash); p != nodes_.end()) {
    p->second.children.push_back(e.block_hash);
  }
}

void DashboardState::Remove(uint64_t hash) {
  auto it = nodes_.find(hash);
  if (it == nodes_.end()) return;
  const uint64_t parent = it->second.parent;
  // The cache evicts leaves only; a removed inner node (a cleared subtree)
  // takes its descendants along.
  std::vector<uint64_t> children = std::move(it->second.children);
  nodes_.erase(it);
  for (uint64_t c : children) Remove(c);
  auto drop = [hash](std::vector<uint64_t>* v) {
    v->erase(std::remove(v->begin(), v->end(), hash), v->end());
  };
  if (parent == 0) {
    drop(&roots_);
  } else if (auto p = nodes_.find(parent); p != nodes_.end()) {
    drop(&p->second.children);
  }
}

void DashboardState::Apply(const KvEventRead& read) {
  if (read.is_snapshot) {
    // Keep the hit counts of blocks that survive the reset.
    std::unordered_map<uint64_t, int64_t> hits;
    for (const auto& [h, n] : nodes_) {
      if (n.hits > 0) hits.emplace(h, n.hits);
    }
    nodes_.clear();
    roots_.clear();
    for (const KvCacheEvent& e : read.snapshot) {
      if (e.tier == KvTier::kNone && e.group == 0) Store(e);
    }
    for (const auto& [h, n] : hits) {
      if (auto it = nodes_.find(h); it != nodes_.end()) it->second.hits = n;
    }
    last_sequence_ = read.snapshot_sequence;
  }
  for (const SequencedKvEvent& se : read.events) {
    const KvCacheEvent& e = se.event;
    last_sequence_ = se.sequence;
    // A tier's page, or another KV cache group's block (the same hashes as
    // the full group's): not in the block map, which draws group 0's index.
    if (e.tier != KvTier::kNone || e.group != 0) continue;
    switch (e.kind) {
      case KvCacheEvent::Kind::kBlockStored:
        Store(e);
        break;
      case KvCacheEvent::Kind::kBlockRemoved:
        Remove(e.block_hash);
        break;
      case KvCacheEvent::Kind::kAllCleared:
        nodes_.clear();
        roots_.clear();
        break;
    }
    last_sequence_ = se.sequence;
  }
}

void DashboardState::AccountHits(const std::vector<RequestBoard::Finished>& finished,
                                 int32_t block_size) {
  if (block_size <= 0) return;
  for (const RequestBoard::Finished& f : finished) {
    const int32_t full = std::min<int32_t>(f.cached_tokens, static_cast<int32_t>(f.prompt.size())) /
                         block_size;
    const std::vector<uint64_t>* level = &roots_;
    bool counted = false;
    for (int32_t b = 0; b < full; ++b) {
      const auto first = f.prompt.begin() + static_cast<ptrdiff_t>(b) * block_size;
      Node* next = nullptr;
      uint64_t next_hash = 0;
      for (uint64_t h : *level) {
        Node& n = nodes_.at(h);
        if (n.tokens.size() == static_cast<size_t>(block_size) &&
            std::equal(n.tokens.begin(), n.tokens.end(), first)) {
          next = &n;
          next_hash = h;
          break;
        }
      }
      if (next == nullptr) break;
      (void)next_hash;
      ++next->hits;
      counted = true;
      level = &next->children;
    }
    if (counted) ++hits_accounted_;
  }
}

int64_t DashboardState::SubtreeSize(uint64_t hash) const {
  int64_t n = 0;
  std::vector<uint64_t> stack{hash};
  while (!stack.empty()) {
    const uint64_t h = stack.back();
    stack.pop_back();
    auto it = nodes_.find(h);
    if (it == nodes_.end()) continue;
    ++n;
    stack.insert(stack.end(), it->second.children.begin(), it->second.children.end());
  }
  return n;
}

std::vector<PrefixRow> DashboardState::Rows(size_t max_chain_tokens) const {
  std::vector<PrefixRow> rows;
  rows.reserve(roots_.size());
  for (uint64_t root : roots_) {
    const Node& r = nodes_.at(root);
    PrefixRow row;
    row.hash = root;
    row.hits = r.hits;
    row.blocks = SubtreeSize(root);
    // Follow the chain while it does not branch.
    const Node* n = &r;
    for (;;) {
      ++row.depth;
      const size_t room = max_chain_tokens > row.tokens.size() ? max_chain_tokens - row.tokens.size() : 0;
      row.tokens.insert(row.tokens.end(), n->tokens.begin(),
                        n->tokens.begin() + static_cast<ptrdiff_t>(std::min(room, n->tokens.size())));
      if (n->children.size() != 1 || row.tokens.size() >= max_chain_tokens) {
        row.branches = n->children.size() > 1 ? static_cast<int64_t>(n->children.size()) : 0;
        break;
      }
      n = &nodes_.at(n->children.front());
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

std::vector<PrefixRow> DashboardState::TopByHits(size_t k, size_t max_chain_tokens) const {
  std::vector<PrefixRow> rows = Rows(max_chain_tokens);
  std::stable_sort(rows.begin(), rows.end(), [](const PrefixRow& a, const PrefixRow& b) {
    return a.hits != b.hits ? a.hits > b.hits : a.blocks > b.blocks;
  });
  if (rows.size() > k) rows.resize(k);
  return rows;
}

std::vector<PrefixRow> DashboardState::TopBySize(size_t k, size_t max_chain_tokens) const {
  std::vector<PrefixRow> rows = Rows(max_chain_tokens);
  std::stable_sort(rows.begin(), rows.end(), [](const PrefixRow& a, const PrefixRow& b) {
    return a.blocks != b.blocks ? a.blocks > b.blocks : a.hits > b.hits;
  });
  if (rows.size() > k) rows.resize(k);
  return rows;
}

// ---------------------------------------------------------------------------

DashboardFeed::DashboardFeed(ModelService* service, Options options)
    : service_(service), options_(options) {
  thread_ = std::thread([this] { Run(); });
}

DashboardFeed::~DashboardFeed() {
  {
    std::lock_guard<std::mutex> lock(run_mu_);
    stop_ = true;
  }
  run_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string DashboardFeed::SseEvent(const std::string& json) {
  return absl::StrCat("event: snapshot\ndata: ", json, "\n\n");
}

int64_t DashboardFeed::Subscribe(std::function<void(const std::string&)> write) {
  std::string first;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    TickLocked(true);
    first = latest_;
  }
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(subs_mu_);
    if (static_cast<int>(subs_.size()) >= options_.max_subscribers) return -1;
    id = next_sub_++;
    subs_.emplace(id, write);
  }
  write(SseEvent(first));
  return id;
}

void DashboardFeed::Unsubscribe(int64_t id) {
  std::lock_guard<std::mutex> lock(subs_mu_);
  subs_.erase(id);
}

std::string DashboardFeed::SnapshotJson() {
  std::lock_guard<std::mutex> lock(state_mu_);
  TickLocked(true);
  return latest_;
}

int DashboardFeed::num_subscribers() const {
  std::lock_guard<std::mutex> lock(subs_mu_);
  return static_cast<int>(subs_.size());
}

void DashboardFeed::Run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(run_mu_);
      if (run_cv_.wait_for(lock, options_.period, [this] { return stop_; })) return;
    }
    // Nobody watching: keep the replica and the hit counts current, build
    // nothing.
    const bool build = num_subscribers() > 0;
    std::string event;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      TickLocked(build);
      if (!build) continue;
      event = SseEvent(latest_);
    }
    std::vector<std::function<void(const std::string&)>> subs;
    {
      std::lock_guard<std::mutex> lock(subs_mu_);
      for (const auto& [id, w] : subs_) subs.push_back(w);
    }
    for (auto& w : subs) w(event);
  }
}

void DashboardFeed::TickLocked(bool build) {
  if (KvEventLog* log = service_->kv_events()) {
    // Everything new since the last tick (a snapshot when we fell behind).
    state_.Apply(log->Read(state_.last_sequence(), 0, std::chrono::milliseconds(0)));
  }
  const ModelInfo info = service_->Info();
  state_.AccountHits(service_->board()->TakeFinished(), info.block_size);
  if (!build) return;
  const EngineStats stats = service_->Stats();
  json j = BuildLocked(stats);
  ++ticks_;
  j["tick"] = ticks_;
  latest_ = j.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

json HistogramJson(const HistogramView& h) {
  json upper = json::array();
  for (double u : h.upper) {
    if (std::isinf(u)) {
      upper.push_back(nullptr);  // +Inf
    } else {
      upper.push_back(u);
    }
  }
  return {{"upper", upper}, {"counts", h.counts}, {"sum", h.sum}, {"count", h.count}};
}

double Ratio(double num, double den) { return den > 0 ? num / den : 0; }

}  // namespace

json DashboardFeed::BuildLocked(const EngineStats& s) {
  const auto now = std::chrono::steady_clock::now();
  const ModelInfo info = service_->Info();
  const BlockMap m = BlockMapFromStats(s);
  json j;
  j["model"] = {{"name", info.name},
                {"block_size", info.block_size},
                {"kv_dtype", info.kv_dtype},
                {"context_length", info.config.context_length}};
  j["pool"] = {{"total", m.total},
               {"free", m.free},
               {"running", m.running},
               {"cached_evictable", m.cached_evictable},
               {"pinned", m.pinned},
               // The figures /metrics publishes, for cross-checking.
               {"metrics_used", s.blocks_used},
               {"metrics_free", s.blocks_free},
               {"prefix_cached", s.prefix_cached_blocks}};
  const KvTiersStats& t = s.tiers;
  json tiers = json::array();
  if (t.host_enabled) {
    tiers.push_back({{"name", "host"},
                     {"blocks", t.host_blocks},
                     {"capacity", t.host_capacity_blocks},
                     {"hit_tokens", t.hit_tokens_host},
                     {"demotions", t.demotions_host},
                     {"promotions", t.promotions_host}});
  }
  if (t.disk_enabled) {
    tiers.push_back({{"name", "disk"},
                     {"blocks", t.disk_blocks},
                     {"capacity", t.disk_capacity_blocks},
                     {"hit_tokens", t.hit_tokens_disk},
                     {"demotions", t.demotions_disk},
                     {"promotions", t.promotions_disk}});
  }
  j["tiers"] = tiers;

  // Hit rates: since start, and over the last period.
  json rates = {{"prefix_cache_enabled", s.prefix_cache_enabled},
                {"prefix_hit_rate", Ratio(static_cast<double>(s.prefix_hit_tokens),
                                          static_cast<double>(s.prefix_query_tokens))},
                {"prefix_hit_tokens", s.prefix_hit_tokens},
                {"prefix_query_tokens", s.prefix_query_tokens},
                {"host_hit_tokens", t.hit_tokens_host},
                {"disk_hit_tokens", t.hit_tokens_disk},
                {"evicted_blocks", s.prefix_evicted_blocks},
                {"preemptions", s.preemptions}};
  if (have_prev_) {
    const double dt = std::chrono::duration<double>(now - prev_at_).count();
    const double dq = static_cast<double>(s.prefix_query_tokens - prev_stats_.prefix_query_tokens);
    const double dh = static_cast<double>(s.prefix_hit_tokens - prev_stats_.prefix_hit_tokens);
    rates["recent_hit_rate"] = dq > 0 ? json(dh / dq) : json(nullptr);
    rates["prompt_tokens_per_s"] =
        Ratio(static_cast<double>(s.prompt_tokens_total - prev_stats_.prompt_tokens_total), dt);
    rates["generation_tokens_per_s"] = Ratio(
        static_cast<double>(s.generation_tokens_total - prev_stats_.generation_tokens_total), dt);
  }
  j["rates"] = rates;
  prev_stats_ = s;
  prev_at_ = now;
  have_prev_ = true;

  // The radix tree's top prefixes.
  auto prefix_rows = [&](const std::vector<PrefixRow>& rows) {
    json a = json::array();
    for (const PrefixRow& r : rows) {
      absl::StatusOr<std::string> text = service_->Detokenize(r.tokens);
      a.push_back({{"hash", absl::StrCat(absl::Hex(r.hash, absl::kZeroPad16))},
                   {"text", text.ok() ? *text : std::string()},
                   {"tokens", r.tokens.size()},
                   {"depth", r.depth},
                   {"blocks", r.blocks},
                   {"hits", r.hits},
                   {"branches", r.branches}});
    }
    return a;
  };
  j["tree"] = {{"events", service_->kv_events() != nullptr},
               {"blocks", state_.num_blocks()},
               {"sequence", state_.last_sequence()},
               {"requests_accounted", state_.hits_accounted()},
               {"top_by_hits", prefix_rows(state_.TopByHits(options_.top_k, 96))},
               {"top_by_size", prefix_rows(state_.TopBySize(options_.top_k, 96))}};

  size_t in_flight = 0;
  json seqs = json::array();
  for (const RequestBoard::Row& r : service_->board()->Snapshot(options_.max_sequences, &in_flight)) {
    seqs.push_back({{"id", r.request_id},
                    {"state", r.decoding ? "decoding" : "waiting/prefill"},
                    {"prompt_tokens", r.prompt_tokens},
                    {"generated", r.generated},
                    {"max_tokens", r.max_tokens},
                    {"n", r.n},
                    {"cached_tokens", r.cached_tokens},
                    {"age_s", r.age_s}});
  }
  j["sequences"] = {{"in_flight", in_flight},
                    {"running", s.running},
                    {"waiting", s.waiting},
                    {"last_batch_seqs", s.last_batch_seqs},
                    {"last_batch_tokens", s.last_batch_tokens},
                    {"rows", seqs}};

  if (Metrics* metrics = service_->metrics()) {
    const std::string text = metrics->Render(s);
    j["histograms"] = {
        {"ttft", HistogramJson(ParseHistogram(text, "kvserve:time_to_first_token_seconds"))},
        {"itl", HistogramJson(ParseHistogram(text, "kvserve:inter_token_latency_seconds"))}};
  }
  j["engine"] = {{"steps", s.steps},
                 {"requests_finished", s.requests_finished},
                 {"step_fixed_ms", s.step_fixed_ms},
                 {"step_decode_ms_per_token", s.step_decode_ms_per_token},
                 {"step_prefill_ms_per_token", s.step_prefill_ms_per_token}};
  return j;
}

}  // namespace kvserve
