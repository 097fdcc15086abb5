// `kvserve loadtest`: a closed-loop workload of mixed-length requests through
// the continuous-batching scheduler (and, with --compare-static, through
// static batching), at each concurrency of a sweep. The engine runs on its
// own thread; this command submits from the main thread and gathers latency,
// time to first token and the engine's efficiency counters into a Markdown
// table.
//
// Thread-safety: event callbacks run on the engine thread and share the
// counters with the submitting main thread under one mutex.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "scheduler/engine.h"
#include "server/app/command.h"
#include "server/app/engine_builder.h"

namespace kvserve {
namespace {

class LoadtestCommand final : public Command {
 public:
  LoadtestCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(root->add_subcommand(
            "loadtest",
            "A mixed-length request workload through the continuous-batching scheduler")),
        engine_flags_(engine_flags) {
    app_->add_option("-c,--concurrency", conc_, "Requests in flight (closed loop); a sweep")
        ->delimiter(',')
        ->capture_default_str();
    app_->add_option("--requests", requests_, "Requests per run (0 = 2 x concurrency, >= 16)")
        ->capture_default_str();
    app_->add_option("--prompt-min", pmin_)->capture_default_str();
    app_->add_option("--prompt-max", pmax_)->capture_default_str();
    app_->add_option("--gen-min", gmin_)->capture_default_str();
    app_->add_option("--gen-max", gmax_)->capture_default_str();
    app_->add_option("--seed", seed_, "Workload seed")->capture_default_str();
    app_->add_flag("--compare-static", compare_static_,
                   "Run every point with continuous and with static batching");
    AddEngineFlags(app_, engine_flags_);
  }

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    ThreadPool* pool = &ThreadPool::Global();
    const LlamaConfig& c = l.model->config();
    if (pmin_ < 1 || pmax_ < pmin_ || gmin_ < 1 || gmax_ < gmin_ ||
        pmax_ + gmax_ > c.context_length) {
      Die(
          absl::InvalidArgumentError("need 1 <= prompt-min <= prompt-max, 1 <= gen-min <= "
                                     "gen-max, prompt-max + gen-max within the context"));
    }
    std::printf(
        "| mode | conc | requests | out tok/s | mean latency s | mean TTFT s | slot eff | "
        "contig (req max) | contig (ctx) | preempt |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int conc : conc_) {
      if (conc < 1) continue;
      const int n_req = requests_ > 0 ? requests_ : std::max(16, 2 * conc);
      // The same workload for every mode: lengths drawn from the seed.
      std::mt19937_64 rng(static_cast<uint64_t>(seed_));
      std::vector<EngineRequest> work(n_req);
      for (auto& r : work) {
        const int plen = pmin_ + static_cast<int>(rng() % (pmax_ - pmin_ + 1));
        r.prompt.resize(plen);
        for (auto& t : r.prompt) t = 3 + static_cast<int32_t>(rng() % (c.vocab_size - 3));
        r.params.temperature = 0;
        r.params.ignore_eos = true;
        r.params.max_tokens = gmin_ + static_cast<int>(rng() % (gmax_ - gmin_ + 1));
      }
      for (bool is_static : {false, true}) {
        if (is_static && !compare_static_) continue;
        RunPoint(l, pool, work, conc, is_static);
      }
    }
    return 0;
  }

 private:
  // One row of the table: `work` at `conc` requests in flight.
  void RunPoint(const LoadedModel& l, ThreadPool* pool, const std::vector<EngineRequest>& work,
                int conc, bool is_static) {
    const int n_req = static_cast<int>(work.size());
    EngineFlags flags = *engine_flags_;
    flags.static_batching = is_static;
    flags.max_seqs = conc;
    EngineBuilder builder(flags, l.model.get(), l.tokenizer.get());
    std::unique_ptr<Engine> engine = ValueOrDie(builder.Build(pool));
    std::mutex mu;
    std::condition_variable cv;
    int next = 0, done = 0;
    int64_t out_tokens = 0;
    double sum_latency = 0, sum_ttft = 0;
    std::vector<std::chrono::steady_clock::time_point> start(n_req);
    std::vector<bool> got_first(n_req, false);
    auto on_event = [&](int i, const SeqEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      const auto now = std::chrono::steady_clock::now();
      if (!ev.token_ids.empty() && !got_first[i]) {
        got_first[i] = true;
        sum_ttft += std::chrono::duration<double>(now - start[i]).count();
      }
      out_tokens += static_cast<int64_t>(ev.token_ids.size());
      if (ev.finish != FinishReason::kNone) {
        sum_latency += std::chrono::duration<double>(now - start[i]).count();
        ++done;
        cv.notify_all();
      }
    };
    const auto t0 = std::chrono::steady_clock::now();
    engine->Start();
    std::unique_lock<std::mutex> lock(mu);
    while (done < n_req) {
      // Closed loop: keep `conc` requests in flight.
      while (next < n_req && next - done < conc) {
        const int i = next++;
        start[i] = std::chrono::steady_clock::now();
        lock.unlock();
        auto id = engine->Submit(work[i], [&, i](const SeqEvent& ev) { on_event(i, ev); });
        if (!id.ok()) Die(id.status());
        lock.lock();
      }
      cv.wait(lock, [&] { return done == n_req || (next < n_req && next - done < conc); });
    }
    lock.unlock();
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    engine->Stop();
    const EngineStats st = engine->Stats();
    std::printf("| %s | %d | %d | %.1f | %.2f | %.3f | %.1f%% | %.1f%% | %.1f%% | %lld |\n",
                is_static ? "static" : "continuous", conc, n_req, out_tokens / wall,
                sum_latency / n_req, sum_ttft / n_req, 100 * st.mean_slot_efficiency,
                100 * st.mean_contiguous_request_efficiency,
                100 * st.mean_contiguous_context_efficiency,
                static_cast<long long>(st.preemptions));
    std::fflush(stdout);
  }

  std::vector<int> conc_ = {1, 4, 16, 32, 64};
  int requests_ = 0;
  int pmin_ = 16;
  int pmax_ = 256;
  int gmin_ = 16;
  int gmax_ = 128;
  int64_t seed_ = 1;
  bool compare_static_ = false;
  EngineFlags* engine_flags_;
};

}  // namespace

std::unique_ptr<Command> NewLoadtestCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<LoadtestCommand>(root, engine_flags);
}

}  // namespace kvserve
