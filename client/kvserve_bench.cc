// kvserve-bench: load tester for kvserve and any OpenAI-compatible server.
//
//   kvserve-bench --url http://127.0.0.1:8000 --input-len 128 --output-len 64
//       --concurrency 1,4,16 --requests 200 --json-out r.json --html-out r.html
//   kvserve-bench --grpc 127.0.0.1:50051 --rate 2,4,8 --duration 60
//   kvserve-bench --compare http://127.0.0.1:8000 http://127.0.0.1:8080 --concurrency 8
//
// Every request streams, so TTFT and the gap between chunks are measured as
// the client sees them; token counts come from the server's usage. Depends
// on the public API (proto/) and HTTP only, like any outside client.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iterator>
#include <memory>
#include <iostream>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "client/bench/backend.h"
#include "client/bench/report.h"
#include "client/bench/workload.h"

namespace kvserve::bench {
namespace {

struct Options {
  std::string url, grpc, tokenizer_grpc, scenario;
  std::vector<std::string> compare;
  BackendOptions backend;
  bool no_ignore_eos = false;
  WorkloadOptions workload;
  std::string input_len = "128", output_len = "128";
  std::vector<int> concurrency;
  std::vector<double> rate;
  std::string arrival = "poisson";
  int requests = 0;
  double duration_s = 0;
  int warmup = 0;
  Slo slo;
  std::string json_out, html_out;
  bool quiet = false;
  // kvserve's speculative modes to compare, one after another on one target.
  std::vector<std::string> speculative;
};

struct LoadPoint {
  std::string mode;  // closed | open
  double value = 0;
  std::string Label(const std::string& arrival) const {
    std::ostringstream o;
    if (mode == "closed") {
      o << "concurrency=" << value;
    } else {
      o << "rate=" << value << "/s (" << arrival << ")";
    }
    return o.str();
  }
};

// Runs conversations against backends and collects the records. Each
// target gets the whole load point to itself (C workers, or every arrival),
// and all targets run at once, conversation k going to each of them, so a
// comparison sees the same prompts at the same moments.
class Driver {
 public:
  Driver(const std::vector<Conversation>& convs, const std::vector<Backend*>& backends,
         const Options& o)
      : convs_(convs),
        backends_(backends),
        o_(o),
        next_item_(new std::atomic<int>[backends.size()]),
        started_(new std::atomic<int>[backends.size()]) {}

  // REQUIRES: no other Run() in progress.
  // Per target, stops at request_limit requests, item_limit conversations
  // (each one once: a finished worker must not steal the turns of one still
  // running) or duration_s, whichever comes first.
  std::vector<RequestRecord> Run(const LoadPoint& lp, int request_limit, int item_limit,
                                 double duration_s, bool warmup, const std::string& label) {
    const int nb = static_cast<int>(backends_.size());
    records_.clear();
    for (int b = 0; b < nb; ++b) {
      next_item_[b] = 0;
      started_[b] = 0;
    }
    done_ = 0;
    errors_ = 0;
    request_limit_ = request_limit;
    item_limit_ = item_limit;
    epoch_ = Clock::now();
    deadline_ = duration_s > 0
                    ? epoch_ + std::chrono::microseconds(static_cast<int64_t>(duration_s * 1e6))
                    : Clock::time_point::max();
    warmup_ = warmup;
    std::atomic<bool> finished{false};
    std::thread progress([&] { Progress(label, finished); });
    std::vector<std::thread> threads;
    if (lp.mode == "closed") {
      for (int b = 0; b < nb; ++b) {
        for (int w = 0; w < static_cast<int>(lp.value); ++w) {
          threads.emplace_back([this, b] {
            while (!Exhausted(b)) {
              const int item = next_item_[b]++;
              if (item >= item_limit_) break;
              RunItem(item, b);
            }
          });
        }
      }
    } else {
      // Open loop: arrivals do not wait for replies, so queueing in the
      // server shows up as latency, as it would with real users.
      std::mt19937_64 rng(o_.workload.seed ^ 0x9e3779b97f4a7c15ULL);
      std::exponential_distribution<double> gap(lp.value);
      // Arrivals go to a pool that grows whenever no worker is idle, so
      // threads stay bounded by the most requests in flight at once.
      std::mutex queue_mu;
      std::condition_variable queue_cv;
      std::deque<std::pair<int, int>> queue;  // (item, backend); guarded by queue_mu
      size_t idle = 0;                        // guarded by queue_mu
      bool closing = false;                   // guarded by queue_mu
      auto worker = [&] {
        std::unique_lock<std::mutex> lock(queue_mu);
        for (;;) {
          while (queue.empty() && !closing) {
            ++idle;
            queue_cv.wait(lock);
            --idle;
          }
          if (queue.empty()) return;
          const auto [item, b] = queue.front();
          queue.pop_front();
          lock.unlock();
          RunItem(item, b);
          lock.lock();
        }
      };
      auto at = Clock::now();
      for (int item = 0; item < item_limit_; ++item) {
        const double g = o_.arrival == "constant" ? 1.0 / lp.value : gap(rng);
        at += std::chrono::microseconds(static_cast<int64_t>(g * 1e6));
        std::this_thread::sleep_until(std::min(at, deadline_));
        bool any = false;
        for (int b = 0; b < nb; ++b) {
          if (Exhausted(b)) continue;
          any = true;
          std::lock_guard<std::mutex> lock(queue_mu);
          queue.emplace_back(item, b);
          // Woken workers count as idle until they run, hence the compare.
          if (idle < queue.size()) {
            threads.emplace_back(worker);
          } else {
            queue_cv.notify_one();
          }
        }
        if (!any) break;
      }
      {
        std::lock_guard<std::mutex> lock(queue_mu);
        closing = true;
      }
      queue_cv.notify_all();
      // The workers use the queue on this frame: join them before it goes.
      for (std::thread& t : threads) t.join();
      threads.clear();
    }
    for (std::thread& t : threads) t.join();
    finished = true;
    progress.join();
    return std::move(records_);
  }

 private:
  bool Exhausted(int b) const {
    return started_[b].load() >= request_limit_ || Clock::now() >= deadline_;
  }

  void RunItem(int item, int b) {
    const Conversation& conv = convs_[item % convs_.size()];
    Backend* backend = backends_[b];
    std::vector<Message> history;
    if (!conv.system.empty()) history.push_back({"system", conv.system});
    for (size_t t = 0; t < conv.turns.size(); ++t) {
      // Claim a request slot first so the bound is never overshot.
      if (started_[b]++ >= request_limit_ || Clock::now() >= deadline_) return;
      history.push_back({"user", conv.turns[t].user});
      RequestRecord r = backend->Send(history, conv.turns[t].max_tokens, epoch_);
      r.conversation = conv.id;
      r.turn = static_cast<int>(t);
      r.warmup = warmup_;
      const bool ok = r.ok;
      history.push_back({"assistant", r.text});
      r.text.clear();  // records keep timings, not replies
      {
        std::lock_guard<std::mutex> lock(mu_);
        r.id = static_cast<int>(records_.size());
        records_.push_back(std::move(r));
      }
      ++done_;
      if (!ok) {
        ++errors_;
        return;  // a broken conversation cannot continue its history
      }
    }
  }

  void Progress(const std::string& label, const std::atomic<bool>& finished) {
    if (o_.quiet) return;
    auto print = [&] {
      const double el = std::chrono::duration<double>(Clock::now() - epoch_).count();
      std::fprintf(stderr, "\r%s: %d done, %d errors, %.2f req/s, %.1f s   ", label.c_str(),
                   done_.load(), errors_.load(), el > 0 ? done_.load() / el : 0.0, el);
      std::fflush(stderr);
    };
    // A redrawn line only makes sense on a terminal; logs get the last one.
    const bool tty = isatty(STDERR_FILENO);
    while (!finished) {
      if (tty) print();
      for (int i = 0; i < 5 && !finished; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    print();
    std::fputc('\n', stderr);
  }

  const std::vector<Conversation>& convs_;
  const std::vector<Backend*>& backends_;
  const Options& o_;
  std::mutex mu_;
  std::vector<RequestRecord> records_;  // guarded by mu_
  // Per target: the next conversation to start and the requests started.
  std::unique_ptr<std::atomic<int>[]> next_item_, started_;
  std::atomic<int> done_{0}, errors_{0};
  int request_limit_ = 0;
  int item_limit_ = 0;
  bool warmup_ = false;
  Clock::time_point epoch_, deadline_;
};

std::unique_ptr<Backend> MakeBackend(const std::string& target, const BackendOptions& bo) {
  if (target.rfind("grpc://", 0) == 0) return MakeGrpcBackend(target.substr(7), bo);
  return MakeHttpBackend(target, bo);
}

int Main(int argc, char** argv) {
  Options o;
  bool no_keep_alive = false;
  CLI::App app{"kvserve-bench: load tester for kvserve and OpenAI-compatible servers"};
  app.add_option("--url", o.url, "OpenAI-compatible server, http://host:port");
  app.add_option("--grpc", o.grpc, "kvserve gRPC address host:port");
  app.add_option("--compare", o.compare,
                 "two targets (http://... or grpc://host:port) run interleaved; prints B/A")
      ->expected(2);
  app.add_option("--api", o.backend.api, "completions or chat")
      ->check(CLI::IsMember({"completions", "chat"}));
  app.add_option("--model", o.backend.model, "model name sent in requests");
  app.add_option("--api-key", o.backend.api_key, "bearer token")->envname("KVSERVE_API_KEY");
  app.add_option("--timeout", o.backend.timeout_s, "per-request timeout (s)");
  app.add_option("--temperature", o.backend.temperature, "sampling temperature");
  app.add_flag("--no-ignore-eos", o.no_ignore_eos,
               "do not send ignore_eos (outputs may end before max_tokens)");
  app.add_flag("--no-keep-alive", no_keep_alive, "HTTP: a new connection for every request");
  app.add_option("--scenario", o.scenario, "named scenario")
      ->check(
          CLI::IsMember({"prefix-cache", "continuous-vs-static", "prefix-sharing", "multi-turn"}));
  app.add_option("--workload", o.workload.kind, "synthetic, shared-prefix, multi-turn or file")
      ->check(CLI::IsMember({"synthetic", "shared-prefix", "multi-turn", "file"}));
  app.add_option("--seed", o.workload.seed, "seed of prompts, lengths and arrivals");
  app.add_option("--num-prompts", o.workload.num_conversations,
                 "prompts (sessions for multi-turn) in the workload");
  app.add_option("--input-len", o.input_len, "input tokens: N, uniform:LO:HI, normal:MEAN:STD");
  auto* out_opt = app.add_option("--output-len", o.output_len, "output tokens, same forms");
  app.add_option("--num-prefixes", o.workload.num_prefixes, "shared-prefix: prefixes");
  app.add_option("--prefix-len", o.workload.prefix_len, "shared-prefix: prefix tokens");
  app.add_option("--questions-per-prefix", o.workload.questions_per_prefix, "shared-prefix");
  app.add_option("--turns", o.workload.turns, "multi-turn: turns per session");
  app.add_option("--file", o.workload.file, "JSONL prompts or ShareGPT conversations");
  app.add_option("--tokenizer-grpc", o.tokenizer_grpc,
                 "kvserve gRPC address whose Tokenize makes prompt lengths exact");
  app.add_option("--concurrency", o.concurrency, "closed loop; a list sweeps")->delimiter(',');
  app.add_option("--rate", o.rate, "open loop req/s; a list sweeps")->delimiter(',');
  app.add_option("--arrival", o.arrival, "poisson or constant")
      ->check(CLI::IsMember({"poisson", "constant"}));
  app.add_option("--requests", o.requests, "requests per load point (default: the workload)");
  app.add_option("--duration", o.duration_s, "seconds per load point");
  app.add_option("--warmup", o.warmup, "requests sent first and left out of results");
  app.add_option("--slo-ttft-ms", o.slo.ttft_ms, "goodput bound on TTFT");
  app.add_option("--slo-tpot-ms", o.slo.tpot_ms, "goodput bound on TPOT");
  app.add_option("--json-out", o.json_out, "result file: every request and the summary");
  app.add_option("--html-out", o.html_out, "self-contained HTML report");
  app.add_flag("-q,--quiet", o.quiet, "no progress line");
  app.add_option("--speculative", o.speculative,
                 "kvserve speculative modes (off, ngram, suffix) sent per request; a list "
                 "runs each load point once per mode, one after another, on one target, and "
                 "prints B/A ratios for two")
      ->delimiter(',');
  CLI11_PARSE(app, argc, argv);

  o.backend.ignore_eos = !o.no_ignore_eos;
  o.backend.keep_alive = !no_keep_alive;
  std::vector<std::string> targets;
  if (!o.compare.empty()) {
    targets = o.compare;
  } else if (!o.grpc.empty()) {
    targets = {"grpc://" + o.grpc};
  } else if (!o.url.empty()) {
    targets = {o.url};
  } else {
    std::cerr << "kvserve-bench: give --url, --grpc or --compare\n";
    return 2;
  }
  if (!o.concurrency.empty() && !o.rate.empty()) {
    std::cerr << "kvserve-bench: --concurrency and --rate exclude each other\n";
    return 2;
  }

  // Scenarios are presets: each names workloads (and a sweep) that show one
  // effect; the same measurements then apply.
  std::vector<std::pair<std::string, WorkloadOptions>> workloads;
  try {
    o.workload.input = LengthDist::Parse(o.input_len);
    o.workload.output = LengthDist::Parse(o.output_len);
    o.workload.use_file_output_len = out_opt->count() == 0;
    if (o.scenario == "prefix-sharing") {
      o.workload.kind = "shared-prefix";
    } else if (o.scenario == "multi-turn") {
      o.workload.kind = "multi-turn";
    } else if (o.scenario == "continuous-vs-static") {
      // Mixed output lengths: static batches wait for their longest member,
      // continuous batching refills slots, so throughput vs concurrency shows it.
      if (out_opt->count() == 0) o.workload.output = LengthDist::Parse("uniform:16:256");
      if (o.concurrency.empty() && o.rate.empty()) o.concurrency = {1, 2, 4, 8, 16};
    }
    if (o.scenario == "prefix-cache") {
      // The same lengths with and without a shared prefix: the gap in TTFT
      // is what the prefix cache saves.
      WorkloadOptions shared = o.workload, unique = o.workload;
      shared.kind = "shared-prefix";
      unique.kind = "synthetic";
      unique.num_conversations = shared.num_prefixes * shared.questions_per_prefix;
      unique.input = LengthDist{LengthDist::Kind::kFixed,
                                static_cast<double>(shared.prefix_len) + o.workload.input.a, 0};
      workloads = {{"unique-prompts", unique}, {"shared-prefix", shared}};
    } else {
      workloads = {{"", o.workload}};
    }
  } catch (const std::exception& e) {
    std::cerr << "kvserve-bench: " << e.what() << "\n";
    return 2;
  }
  if (o.concurrency.empty() && o.rate.empty()) o.concurrency = {1};

  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> backends;
  // Speculative modes are compared one after another (not at once: they
  // would share the server's batches), each as its own target.
  const bool sequential = !o.speculative.empty();
  if (sequential && targets.size() != 1) {
    std::cerr << "kvserve-bench: --speculative takes one target (--url or --grpc)\n";
    return 2;
  }
  for (const std::string& t : targets) {
    if (!sequential) {
      owned.push_back(MakeBackend(t, o.backend));
      backends.push_back(owned.back().get());
      continue;
    }
    for (const std::string& mode : o.speculative) {
      BackendOptions bo = o.backend;
      bo.speculative = mode;
      owned.push_back(MakeBackend(t, bo));
      backends.push_back(owned.back().get());
    }
  }
  // Exact prompt lengths need the server's tokenizer: kvserve's Tokenize.
  std::unique_ptr<Backend> tokenizer;
  if (!o.tokenizer_grpc.empty()) {
    tokenizer = MakeGrpcBackend(o.tokenizer_grpc, o.backend);
  } else {
    for (const std::string& t : targets) {
      if (t.rfind("grpc://", 0) == 0 && !tokenizer)
        tokenizer = MakeGrpcBackend(t.substr(7), o.backend);
    }
  }
  TokenCounter counter;
  if (tokenizer && tokenizer->CountTokens("hello") >= 0) {
    counter = [&](const std::string& s) { return tokenizer->CountTokens(s); };
  } else if (!o.quiet) {
    std::cerr << "kvserve-bench: no tokenizer reachable; prompt lengths are approximate\n";
  }

  std::vector<LoadPoint> points;
  for (int c : o.concurrency) {
    if (c < 1) {
      std::cerr << "kvserve-bench: concurrency must be >= 1\n";
      return 2;
    }
    points.push_back({"closed", static_cast<double>(c)});
  }
  for (double r : o.rate) {
    if (r <= 0) {
      std::cerr << "kvserve-bench: rate must be > 0\n";
      return 2;
    }
    points.push_back({"open", r});
  }

  std::vector<Run> runs;
  bool any_ok = false;
  for (const auto& [wname, wopts] : workloads) {
    std::vector<Conversation> convs;
    try {
      convs = BuildWorkload(wopts, counter);
    } catch (const std::exception& e) {
      std::cerr << "kvserve-bench: " << e.what() << "\n";
      return 2;
    }
    // No bound given: the workload once (per target). A bound given: the
    // workload cycles until it is reached.
    constexpr int kUnbounded = std::numeric_limits<int>::max();
    const bool bounded = o.requests > 0 || o.duration_s > 0;
    const int request_limit = o.requests > 0 ? o.requests : kUnbounded;
    const int item_limit = bounded ? kUnbounded : static_cast<int>(convs.size());
    // Each group of targets runs at once; sequential: one target at a time.
    std::vector<std::vector<Backend*>> groups;
    if (sequential) {
      for (Backend* b : backends) groups.push_back({b});
    } else {
      groups.push_back(backends);
    }
    std::vector<std::unique_ptr<Driver>> drivers;
    for (const auto& g : groups) drivers.push_back(std::make_unique<Driver>(convs, g, o));
    if (o.warmup > 0) {
      const int c = std::min(
          o.warmup, points.front().mode == "closed" ? static_cast<int>(points.front().value) : 4);
      for (auto& driver : drivers) {
        driver->Run({"closed", static_cast<double>(c)}, o.warmup, kUnbounded, 0, /*warmup=*/true,
                    "warm-up");
      }
    }
    for (const LoadPoint& lp : points) {
      std::string label = lp.Label(o.arrival);
      if (!wname.empty()) label = wname + " " + label;
      std::vector<RequestRecord> records;
      for (auto& driver : drivers) {
        std::vector<RequestRecord> part =
            driver->Run(lp, request_limit, item_limit, o.duration_s, false, label);
        records.insert(records.end(), std::make_move_iterator(part.begin()),
                       std::make_move_iterator(part.end()));
      }
      // Split by target so each server gets its own summary.
      for (Backend* b : backends) {
        Run run;
        run.target = b->Name();
        run.load_label = label;
        run.load_mode = lp.mode;
        run.load_value = lp.value;
        for (const RequestRecord& r : records) {
          if (r.target == run.target) run.records.push_back(r);
        }
        run.summary = Summary::Of(run.records, o.slo);
        any_ok |= run.summary.completed > 0;
        runs.push_back(std::move(run));
      }
    }
  }

  std::cout << FormatTable(runs);
  if (backends.size() == 2) std::cout << FormatComparison(runs);
  nlohmann::json config = {{"targets", targets},
                           {"api", o.backend.api},
                           {"model", o.backend.model},
                           {"scenario", o.scenario},
                           {"workload", o.workload.kind},
                           {"seed", o.workload.seed},
                           {"num_prompts", o.workload.num_conversations},
                           {"input_len", o.workload.input.ToString()},
                           {"output_len", o.workload.output.ToString()},
                           {"ignore_eos", o.backend.ignore_eos},
                           {"keep_alive", o.backend.keep_alive},
                           {"exact_lengths", static_cast<bool>(counter)},
                           {"arrival", o.arrival},
                           {"requests", o.requests},
                           {"duration_s", o.duration_s},
                           {"warmup", o.warmup},
                           {"slo_ttft_ms", o.slo.ttft_ms},
                           {"slo_tpot_ms", o.slo.tpot_ms},
                           {"speculative", o.speculative}};
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << ResultsToJson(config, runs).dump(1) << '\n';
    if (!f) {
      std::cerr << "kvserve-bench: cannot write " << o.json_out << "\n";
      return 1;
    }
  }
  if (!o.html_out.empty()) {
    std::ofstream f(o.html_out);
    f << RenderHtml(config, runs, backends.size() == 2);
    if (!f) {
      std::cerr << "kvserve-bench: cannot write " << o.html_out << "\n";
      return 1;
    }
  }
  // Exit 1 only when nothing succeeded: partial errors are results.
  return any_ok ? 0 : 1;
}

}  // namespace
}  // namespace kvserve::bench

int main(int argc, char** argv) { return kvserve::bench::Main(argc, argv); }
