// A randomized property test of the engine, driven by hand from the test
// thread: thousands of random operations per seed (submits with shared
// prefixes, n in 1..4, priorities, sampling settings and deadlines; cancels;
// CancelAll; prefix-cache clears; steps) on KV pools small enough that
// preemption and prefix-cache eviction happen, with the scheduler's
// invariants checked after every step. Only the engine's public API
// (scheduler/engine.h, scheduler/request.h) is used, so the test holds for
// any implementation of it.
//
// Invariants, checked after every step unless said otherwise:
//  - Events: every event names an accepted request and a sample index in
//    [0, n); no sample gets an event after its finish event; no sample emits
//    more than max_tokens tokens; completion_tokens counts exactly the tokens
//    delivered so far (recompute after preemption emits nothing twice).
//  - Cancel(id) / CancelAll(): after the next step every sample that had not
//    finished has finished with kCancelled. A deadline already past at
//    Submit: after the next step every sample has finished with kDeadline (or
//    kCancelled when a cancel came in the same window) and emitted nothing.
//  - Limits: Stats().last_batch_tokens <= max_batched_tokens; Stats().running
//    <= max_seqs; blocks_free + blocks_used == blocks_total.
//  - Blocks: whenever no request is outstanding, kv_pool free blocks plus the
//    prefix cache's evictable blocks == the pool size (nothing leaked), and a
//    ClearPrefixCache that ran while nothing was outstanding leaves every
//    block free. At the end of a seed (all drained): the same, and every
//    sample of every accepted request had exactly one finish event.
//  - Counters: Stats().generation_tokens_total equals the tokens delivered;
//    requests_finished equals the accepted requests; requests_cancelled
//    equals the requests with a sample that finished cancelled/deadline.
//  - FCFS (seeds with schedule_policy fcfs and continuous batching): for two
//    requests A and B of the same priority, A submitted before B, both
//    *served* — the first event of each is a token or a stop/length finish,
//    not a cancel or deadline — A's first event comes before B's. A correct
//    FCFS engine satisfies this: it admits waiting sequences in arrival order
//    within a priority without overtaking; it schedules the remaining prompt
//    of running sequences in admission order before admitting anyone; so a
//    later request is admitted only in a step where budget is left after
//    every earlier admitted request took all of its remaining prompt, i.e.
//    in a step where the earlier one samples first (earlier in the batch);
//    and it preempts the most recently admitted sequence of the lowest
//    priority first, and a preempted sequence keeps its place in the queue.
//    (Static batching admits a whole batch with no budget left and LPM
//    reorders by cached prefix, so neither is checked.)
//  - Coverage: over all seeds, preemption and prefix-cache eviction happened.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "scheduler/request.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

struct Model {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

// A written model with random weights: needs no ../shared.
const Model* WrittenModel(std::string* error) {
  static const Model* m = [error]() -> const Model* {
    testing::TinyLlamaOptions o;
    o.context_length = 256;
    o.seed = 7;
    const std::string path = testing::TempDir() + "/scheduler-property-tiny.gguf";
    std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
    auto model = LlamaModel::Load(path);
    if (!model.ok()) {
      *error = model.status().ToString();
      return nullptr;
    }
    auto tok = Tokenizer::FromGguf((*model)->file());
    if (!tok.ok()) {
      *error = tok.status().ToString();
      return nullptr;
    }
    auto* out = new Model;
    out->model = std::move(model).value();
    out->tokenizer = std::move(tok).value();
    return out;
  }();
  return m;
}

bool IsAbort(FinishReason r) { return r == FinishReason::kCancelled || r == FinishReason::kDeadline; }

struct SampleLog {
  int tokens = 0;
  int finishes = 0;
  FinishReason reason = FinishReason::kNone;
};

struct RequestLog {
  int n = 1;
  int max_tokens = 0;
  int priority = 0;
  bool past_deadline = false;   // deadline already passed at Submit
  int64_t first_event = -1;     // global event number of its first event
  bool first_is_abort = false;  // that event finished it cancelled/deadline
  std::vector<SampleLog> samples;
  int finished_samples() const {
    int f = 0;
    for (const SampleLog& s : samples) f += s.finishes > 0;
    return f;
  }
  bool done() const { return finished_samples() == n; }
};

struct SeedConfig {
  EngineOptions options;
  int32_t max_request_n = 4;  // n of submitted requests is in [1, this]
  bool check_fcfs = false;
  std::string description;
};

SeedConfig MakeConfig(uint32_t seed) {
  std::mt19937 rng(seed);
  auto pick = [&rng](std::initializer_list<int32_t> v) { return *(v.begin() + rng() % v.size()); };
  SeedConfig c;
  EngineOptions& o = c.options;
  o.block_size = pick({4, 8, 16});
  // Small pools: room for a few sequences, so admission waits, running
  // sequences get preempted and cached blocks get evicted.
  o.num_blocks = static_cast<int32_t>((96 + rng() % 160) / o.block_size);
  o.max_batched_tokens = pick({8, 16, 32, 64, 128});
  o.max_seqs = pick({2, 3, 4, 8});
  o.max_n = 4;
  o.prefix_cache = rng() % 5 != 0;
  o.schedule_policy =
      rng() % 3 == 0 ? EngineOptions::SchedulePolicy::kLpm : EngineOptions::SchedulePolicy::kFcfs;
  o.static_batching = rng() % 6 == 0;
  c.max_request_n = rng() % 3 == 0 ? 1 : 4;
  c.check_fcfs = o.schedule_policy == EngineOptions::SchedulePolicy::kFcfs && !o.static_batching;
  std::ostringstream d;
  d << "seed " << seed << ": block_size " << o.block_size << ", num_blocks " << o.num_blocks
    << ", max_batched_tokens " << o.max_batched_tokens << ", max_seqs " << o.max_seqs
    << ", prefix_cache " << o.prefix_cache << ", policy "
    << (o.schedule_policy == EngineOptions::SchedulePolicy::kLpm ? "lpm" : "fcfs")
    << ", static_batching " << o.static_batching << ", n <= " << c.max_request_n;
  c.description = d.str();
  return c;
}

struct SeedTotals {
  int64_t preemptions = 0;
  int64_t evictions = 0;
  int64_t steps = 0;
  int64_t requests = 0;
};

// Runs one seed; adds failures (stopping at the first step that has any) and
// returns what the run exercised.
SeedTotals RunSeed(const Model& m, uint32_t seed, int operations) {
  const SeedConfig config = MakeConfig(seed);
  SCOPED_TRACE(config.description);
  std::cout << "[ property ] " << config.description << std::endl;
  const EngineOptions& o = config.options;
  ThreadPool pool(1);
  auto created = Engine::Create(m.model.get(), m.tokenizer.get(), &pool, o);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return {};
  Engine& e = **created;
  const int32_t total = o.num_blocks;
  const int32_t vocab = m.model->config().vocab_size;
  std::mt19937 rng(seed * 7919u + 1);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return lo + static_cast<int>(rng() % static_cast<uint32_t>(hi - lo + 1));
  };

  // Shared prefixes (system prompts) that prompts start from.
  std::vector<std::vector<int32_t>> prefixes(4);
  for (auto& p : prefixes) {
    p.resize(48);
    for (int32_t& t : p) t = uniform(3, vocab - 1);
  }

  std::map<uint64_t, RequestLog> requests;
  int64_t event_counter = 0;
  int64_t tokens_delivered = 0;
  int bad_events = 0;
  auto callback = [&](const SeqEvent& ev) {
    const int64_t event_number = event_counter++;
    auto it = requests.find(ev.request_id);
    if (it == requests.end()) {
      // Submit returns after queueing, so events cannot precede the log
      // entry (Step runs on this thread).
      if (bad_events++ < 5) ADD_FAILURE() << "event for unknown request " << ev.request_id;
      return;
    }
    RequestLog& r = it->second;
    if (ev.index < 0 || ev.index >= r.n) {
      if (bad_events++ < 5) ADD_FAILURE() << "request " << ev.request_id << ": index " << ev.index;
      return;
    }
    SampleLog& s = r.samples[ev.index];
    if (s.finishes > 0) {
      if (bad_events++ < 5) {
        ADD_FAILURE() << "request " << ev.request_id << " sample " << ev.index
                      << ": event after its finish (" << FinishReasonName(s.reason) << "), "
                      << ev.token_ids.size() << " tokens, finish "
                      << FinishReasonName(ev.finish);
      }
    }
    if (r.first_event < 0) {
      r.first_event = event_number;
      r.first_is_abort = ev.token_ids.empty() && IsAbort(ev.finish);
    }
    for (int32_t t : ev.token_ids) {
      if ((t < 0 || t >= vocab) && bad_events++ < 5) ADD_FAILURE() << "token " << t;
    }
    s.tokens += static_cast<int>(ev.token_ids.size());
    tokens_delivered += static_cast<int64_t>(ev.token_ids.size());
    if (s.tokens > r.max_tokens && bad_events++ < 5) {
      ADD_FAILURE() << "request " << ev.request_id << " sample " << ev.index << ": " << s.tokens
                    << " tokens, max_tokens " << r.max_tokens;
    }
    if (ev.completion_tokens != s.tokens && bad_events++ < 5) {
      ADD_FAILURE() << "request " << ev.request_id << " sample " << ev.index
                    << ": completion_tokens " << ev.completion_tokens << " but " << s.tokens
                    << " tokens delivered";
    }
    if (ev.finish != FinishReason::kNone) {
      ++s.finishes;
      if (s.reason == FinishReason::kNone) s.reason = ev.finish;
    }
  };

  // Requests whose unfinished samples must be cancelled by the next step:
  // id -> samples unfinished when Cancel was called.
  std::map<uint64_t, std::vector<int>> cancel_due;
  std::vector<uint64_t> past_deadline_due;
  auto cancel = [&](uint64_t id) {
    auto it = requests.find(id);
    if (it == requests.end()) return;
    auto& due = cancel_due[id];
    for (int i = 0; i < it->second.n; ++i) {
      if (it->second.samples[i].finishes == 0) due.push_back(i);
    }
  };
  auto outstanding = [&] {
    int out = 0;
    for (const auto& [id, r] : requests) out += !r.done();
    return out;
  };
  auto reclaimable = [&] {
    return e.kv_pool().num_free_blocks() +
           (e.prefix_cache() ? e.prefix_cache()->num_evictable_blocks() : 0);
  };

  std::vector<std::future<int32_t>> clears;
  int64_t last_preemptions = 0, last_steps = 0;
  bool idle_checked_clear = false;
  // Checks after a step; `idle_before` says nothing was outstanding when it
  // started (so a clear it ran leaves every block free).
  auto check_step = [&](bool idle_before, bool had_clear) {
    const EngineStats st = e.Stats();
    EXPECT_LE(st.last_batch_tokens, o.max_batched_tokens);
    // Forked samples count too: admission reserves room for all n.
    EXPECT_LE(st.running, o.max_seqs) << "more sequences running than max_seqs";
    EXPECT_EQ(st.blocks_free + st.blocks_used, st.blocks_total);
    EXPECT_EQ(st.blocks_total, total);
    EXPECT_GE(st.blocks_free, 0);
    EXPECT_GE(st.preemptions, last_preemptions);
    EXPECT_GE(st.steps, last_steps);
    last_preemptions = st.preemptions;
    last_steps = st.steps;
    EXPECT_LE(reclaimable(), total);
    for (const auto& [id, due] : cancel_due) {
      const RequestLog& r = requests.at(id);
      for (int i : due) {
        EXPECT_EQ(r.samples[i].finishes, 1) << "request " << id << " sample " << i
                                            << " still running a step after Cancel";
        EXPECT_EQ(r.samples[i].reason, FinishReason::kCancelled)
            << "request " << id << " sample " << i << " finished "
            << FinishReasonName(r.samples[i].reason) << " after Cancel";
      }
    }
    cancel_due.clear();
    for (uint64_t id : past_deadline_due) {
      const RequestLog& r = requests.at(id);
      for (int i = 0; i < r.n; ++i) {
        EXPECT_EQ(r.samples[i].finishes, 1) << "request " << id << " past its deadline still runs";
        EXPECT_TRUE(IsAbort(r.samples[i].reason))
            << "request " << id << " past its deadline finished "
            << FinishReasonName(r.samples[i].reason);
        EXPECT_EQ(r.samples[i].tokens, 0) << "request " << id << " ran past its deadline";
      }
    }
    past_deadline_due.clear();
    for (auto& f : clears) {
      ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
          << "ClearPrefixCache not answered by the next step";
      const int32_t dropped = f.get();
      if (o.prefix_cache) {
        EXPECT_GE(dropped, 0);
      } else {
        EXPECT_EQ(dropped, -1);
      }
    }
    clears.clear();
    if (outstanding() == 0) {
      EXPECT_EQ(reclaimable(), total) << "blocks leaked with no request outstanding";
      EXPECT_EQ(st.running, 0);
      EXPECT_EQ(st.waiting, 0);
      EXPECT_EQ(st.blocks_used, 0);
      if (idle_before && had_clear) {
        EXPECT_EQ(e.kv_pool().num_free_blocks(), total)
            << "ClearPrefixCache on an idle engine left blocks held";
        idle_checked_clear = true;
      }
    }
  };

  int accepted = 0, rejected = 0;
  for (int op = 0; op < operations && !::testing::Test::HasFailure(); ++op) {
    const int r = uniform(0, 99);
    if (r < 22 && outstanding() < 3 * o.max_seqs) {
      EngineRequest req;
      const auto& prefix = prefixes[rng() % prefixes.size()];
      const int shared = rng() % 4 == 0 ? 0 : uniform(0, static_cast<int>(prefix.size()));
      req.prompt.assign(prefix.begin(), prefix.begin() + shared);
      for (int i = uniform(shared == 0 ? 1 : 0, 20); i > 0; --i) req.prompt.push_back(uniform(3, vocab - 1));
      req.n = std::min(config.max_request_n, o.max_seqs) > 1 && rng() % 3 == 0
                  ? uniform(2, std::min(config.max_request_n, o.max_seqs))
                  : 1;
      req.priority = uniform(0, 2);
      req.params.max_tokens = uniform(1, 40);
      req.params.ignore_eos = rng() % 2 == 0;
      req.params.temperature = rng() % 2 == 0 ? 0.0f : 1.0f;
      req.params.seed = rng();
      req.params.has_seed = true;
      if (rng() % 8 == 0) req.cache_salt = "tenant-b";
      const int d = uniform(0, 29);
      bool past = false;
      if (d == 0) {
        req.deadline = std::chrono::steady_clock::now() - std::chrono::milliseconds(1);
        past = true;
      } else if (d == 1) {
        req.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(uniform(0, 3));
      }
      RequestLog log;
      log.n = req.n;
      log.max_tokens = req.params.max_tokens;
      log.priority = req.priority;
      log.past_deadline = past;
      log.samples.resize(req.n);
      absl::StatusOr<uint64_t> id = e.Submit(req, callback);
      if (!id.ok()) {
        // Only a request the pool could never hold may be refused.
        EXPECT_TRUE(absl::IsResourceExhausted(id.status())) << id.status();
        ++rejected;
        continue;
      }
      ++accepted;
      EXPECT_EQ(requests.count(*id), 0u) << "request id reused";
      requests[*id] = std::move(log);
      if (past) past_deadline_due.push_back(*id);
    } else if (r < 27 && !requests.empty()) {
      // Any request: running, waiting, finished, or not yet stepped.
      auto it = requests.begin();
      std::advance(it, rng() % requests.size());
      e.Cancel(it->first);
      cancel(it->first);
    } else if (r < 28) {
      e.Cancel(1000000 + rng() % 100);  // unknown ids are ignored
    } else if (r < 29 && rng() % 4 == 0) {
      e.CancelAll();
      for (const auto& [id, req] : requests) cancel(id);
    } else if (r < 31) {
      clears.push_back(e.ClearPrefixCache());
    } else {
      const bool idle_before = outstanding() == 0;
      const bool had_clear = !clears.empty();
      e.Step();
      check_step(idle_before, had_clear);
    }
  }

  // Drain: everything accepted must finish.
  int guard = 0;
  for (;;) {
    const bool idle_before = outstanding() == 0;
    const bool had_clear = !clears.empty();
    const bool worked = e.Step();
    check_step(idle_before, had_clear);
    if (::testing::Test::HasFailure()) break;
    if (!worked && outstanding() == 0) break;
    if (++guard > 100000) {
      ADD_FAILURE() << "engine did not drain: " << outstanding() << " requests outstanding";
      break;
    }
  }
  const EngineStats st = e.Stats();
  if (!::testing::Test::HasFailure()) {
    int64_t aborted = 0;
    for (const auto& [id, r] : requests) {
      bool any_abort = false;
      for (int i = 0; i < r.n; ++i) {
        EXPECT_EQ(r.samples[i].finishes, 1) << "request " << id << " sample " << i;
        any_abort = any_abort || IsAbort(r.samples[i].reason);
      }
      aborted += any_abort;
    }
    EXPECT_EQ(st.generation_tokens_total, tokens_delivered);
    EXPECT_EQ(st.requests_finished, accepted);
    EXPECT_EQ(st.requests_cancelled, aborted);
    EXPECT_EQ(reclaimable(), total) << "blocks leaked after the drain";

    // Emptying the cache of an idle engine frees every block.
    std::future<int32_t> cleared = e.ClearPrefixCache();
    EXPECT_FALSE(e.Step());
    if (cleared.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      ADD_FAILURE() << "ClearPrefixCache not answered by the next step";
    } else {
      EXPECT_EQ(cleared.get(), o.prefix_cache ? static_cast<int32_t>(st.prefix_cached_blocks) : -1);
    }
    EXPECT_EQ(e.kv_pool().num_free_blocks(), total) << "ClearPrefixCache left blocks held";
    EXPECT_EQ(e.Stats().prefix_cached_blocks, 0);

    if (config.check_fcfs) {
      // Served requests by submission (id) order within each priority.
      std::map<int, std::vector<std::pair<uint64_t, const RequestLog*>>> served;
      for (const auto& [id, r] : requests) {
        if (r.first_event >= 0 && !r.first_is_abort) served[r.priority].emplace_back(id, &r);
      }
      int reported = 0;
      for (const auto& [priority, list] : served) {
        // Ids ascend; every first event must be later than all earlier ones'.
        int64_t latest = -1;
        uint64_t latest_id = 0;
        for (const auto& [id, r] : list) {
          if (r->first_event < latest && reported++ < 3) {
            ADD_FAILURE() << "FCFS: request " << id << " (priority " << priority
                          << ") got its first event (#" << r->first_event
                          << ") before earlier request " << latest_id << " (#" << latest << ")";
          }
          if (r->first_event > latest) {
            latest = r->first_event;
            latest_id = id;
          }
        }
      }
    }
  }
  std::cout << "[ property ]   " << accepted << " accepted, " << rejected << " refused, "
            << st.steps << " steps, " << st.preemptions << " preemptions, "
            << st.prefix_evicted_blocks << " cached blocks evicted, " << st.requests_cancelled
            << " cancelled/deadline" << (idle_checked_clear ? ", idle clear checked" : "")
            << std::endl;
  // The engine's destructor cancels what is left; its events still find the
  // logs alive.
  created->reset();
  return {st.preemptions, st.prefix_evicted_blocks, st.steps, accepted};
}

TEST(SchedulerPropertyTest, RandomOperationsKeepTheInvariants) {
  std::string error;
  const Model* m = WrittenModel(&error);
  if (m == nullptr) GTEST_SKIP() << "could not write or load the tiny model: " << error;
  SeedTotals sum;
  // Fixed seeds, printed with their configuration; a failure names its seed
  // (SCOPED_TRACE), and RunSeed(*m, seed, ...) replays it alone.
  for (uint32_t seed = 1; seed <= 12 && !HasFailure(); ++seed) {
    const SeedTotals t = RunSeed(*m, seed, 2500);
    sum.preemptions += t.preemptions;
    sum.evictions += t.evictions;
    sum.steps += t.steps;
    sum.requests += t.requests;
  }
  if (HasFailure()) return;
  // The run must have exercised the paths it is about.
  EXPECT_GT(sum.preemptions, 0) << "no seed preempted: make the pools smaller";
  EXPECT_GT(sum.evictions, 0) << "no seed evicted cached blocks";
  EXPECT_GT(sum.requests, 1000);
}

// max_seqs caps running sequences (engine.h); the samples a request forks
// at its first token are sequences too (found by the property test above:
// the engine once admitted n > 1 requests as one sequence each).
TEST(SchedulerPropertyTest, ForkedSamplesCountAgainstMaxSeqs) {
  std::string error;
  const Model* m = WrittenModel(&error);
  if (m == nullptr) GTEST_SKIP() << "could not write or load the tiny model: " << error;
  ThreadPool pool(1);
  EngineOptions o;
  o.num_blocks = 64;
  o.max_seqs = 4;
  auto e = Engine::Create(m->model.get(), m->tokenizer.get(), &pool, o).value();
  EngineRequest req;
  req.prompt = {5, 6, 7, 8};
  req.n = 4;
  EngineRequest too_many = req;
  too_many.n = 5;
  EXPECT_TRUE(absl::IsInvalidArgument(e->Submit(too_many, [](const SeqEvent&) {}).status()))
      << "n above max_seqs could never run";
  req.params.max_tokens = 8;
  req.params.ignore_eos = true;
  ASSERT_TRUE(e->Submit(req, [](const SeqEvent&) {}).ok());
  ASSERT_TRUE(e->Submit(req, [](const SeqEvent&) {}).ok());
  while (e->Step()) {
    EXPECT_LE(e->Stats().running, o.max_seqs);
    EXPECT_LE(e->Stats().last_batch_seqs, o.max_seqs);
  }
}

}  // namespace
}  // namespace kvserve
