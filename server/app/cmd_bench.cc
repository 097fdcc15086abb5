// `kvserve bench`: prefill and decode throughput of the engine at several
// batch sizes, on synthetic prompts, stepping the engine by hand and timing
// each step (steps that carry prompt tokens count as prefill). Prints a
// Markdown table; the best of --repeat runs is reported. The --kv-* flags
// (the daemon's kv-policy defaults) give every sequence a token-eviction
// policy, so the table shows what eviction does to decode speed at long
// context; the last column is the most KV blocks the batch held in a decode
// step, per sequence.
//
// --bandwidth adds what batch-1 decode is judged by: the bytes one decode
// step reads (the weights the forward streams, a tied output head counted
// as the head, plus every sequence's K and V over its attended context,
// windows included) times steps per second, against the machine's read
// bandwidth measured right after each run by kernels::ReadProbe on the same
// threads. The ratio is taken per run and the median run is shown: a
// shared host's bandwidth moves between minutes (kernels/cpu/read_probe.h).
//
// Thread-safety: runs on the main thread; the engine is stepped here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "kernels/cpu/read_probe.h"
#include "scheduler/engine.h"
#include "server/app/command.h"
#include "server/app/engine_builder.h"
#include "server/service/kv_policy.h"

namespace kvserve {
namespace {

class BenchCommand final : public Command {
 public:
  BenchCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(
            root->add_subcommand("bench", "Prefill and decode throughput at several batch sizes")),
        engine_flags_(engine_flags) {
    app_->add_option("-b,--batch", batches_, "Batch sizes")->delimiter(',')->capture_default_str();
    app_->add_option("--prompt-tokens", prompt_, "Prompt length per sequence")
        ->capture_default_str();
    app_->add_option("--gen-tokens", gen_, "Generated tokens per sequence")->capture_default_str();
    app_->add_option("--repeat", reps_, "Runs per batch size (best is reported)")
        ->capture_default_str();
    app_->add_flag("--bandwidth", bandwidth_,
                   "Add bytes read per decode step, decode GB/s and its share of the host's read "
                   "bandwidth, measured after each run");
    AddEngineFlags(app_, engine_flags_);
    AddKvPolicyFlags(app_, &kv_policy_flags_);
  }

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    ThreadPool* pool = &ThreadPool::Global();
    const LlamaConfig& c = l.model->config();
    if (prompt_ < 1 || gen_ < 2 || prompt_ + gen_ > c.context_length) {
      Die(
          absl::InvalidArgumentError("need prompt-tokens >= 1, gen-tokens >= 2 and their sum "
                                     "within the context length"));
    }
    const KvPolicyDefaults kv_defaults = ValueOrDie(KvPolicyDefaultsFromFlags(kv_policy_flags_));
    const KvPolicy kv_policy = ValueOrDie(ResolveKvPolicy(std::nullopt, kv_defaults));
    std::printf("kv policy: %s", KvPolicyName(kv_policy.kind));
    if (kv_policy.kind != KvPolicy::Kind::kNone) {
      std::printf(" (keeps at most %d tokens)", kv_policy.capacity());
    }
    std::printf("\n\n");
    std::printf(
        "| batch | prompt tok | gen tok | prefill tok/s | decode tok/s | decode ms/step | "
        "peak KV blocks/seq |%s\n",
        bandwidth_ ? " MB read/step | decode GB/s | read GB/s | decode / read |" : "");
    std::printf(
        "|------:|-----------:|--------:|--------------:|-------------:|---------------:|"
        "-------------------:|%s\n",
        bandwidth_ ? "-------------:|------------:|----------:|--------------:|" : "");
    // What one decode step reads besides the KV: every weight the forward
    // streams (LlamaModel::weight_bytes), whatever the batch.
    const double weight_bytes = static_cast<double>(l.model->weight_bytes());
    // KV bytes per token of one layer, as the pool stores them (quantized
    // K/V with their scales included).
    const double kv_layer_token =
        bandwidth_
            ? static_cast<double>(ValueOrDie(PlanFromFlags(*engine_flags_, c)).kv_bytes_per_token) /
                  c.n_layers
            : 0;
    std::unique_ptr<kernels::ReadProbe> probe;
    if (bandwidth_) {
      // Far beyond any last-level cache, at most 2 GiB.
      const size_t bytes = std::max<size_t>(
          size_t{512} << 20, std::min<size_t>(static_cast<size_t>(weight_bytes), size_t{2} << 30));
      probe = std::make_unique<kernels::ReadProbe>(bytes);
    }
    // Bytes of K and V one sequence's decode step reads when its new token
    // sits at slot `pos`: pos + 1 slots per layer, fewer under a window or an
    // eviction budget.
    auto kv_step_bytes = [&](int64_t pos) {
      int64_t attended = pos + 1;
      if (kv_policy.kind != KvPolicy::Kind::kNone) {
        attended = std::min<int64_t>(attended, kv_policy.capacity());
      }
      double bytes = 0;
      for (int32_t layer = 0; layer < c.n_layers; ++layer) {
        const int64_t n =
            c.LayerWindowed(layer) ? std::min<int64_t>(attended, c.sliding_window) : attended;
        bytes += n * kv_layer_token;
      }
      return bytes;
    };
    for (int batch : batches_) {
      if (batch < 1) continue;
      EngineFlags flags = *engine_flags_;
      flags.max_seqs = std::max(flags.max_seqs, batch);
      flags.max_batched_tokens = std::max(flags.max_batched_tokens, prompt_);
      // The table measures the prefill and decode phases apart; stall-free
      // steps would mix the first decodes into the later prompts' prefill.
      flags.max_stall_factor = 0;
      flags.target_itl_ms = 0;
      // One backend per batch size, shared by its repeats.
      EngineBuilder builder(flags, l.model.get(), l.tokenizer.get());
      double best_prefill = 0, best_decode = 0, best_step = 1e30;
      int64_t peak_blocks = 0;
      struct BandwidthRun {
        double step_bytes = 0, decode_gbps = 0, read_gbps = 0;
      };
      std::vector<BandwidthRun> bw_runs;
      for (int rep = 0; rep < std::max(1, reps_); ++rep) {
        std::unique_ptr<Engine> engine = ValueOrDie(builder.Build(pool));
        for (int i = 0; i < batch; ++i) {
          // Distinct deterministic prompts so no two sequences are identical.
          EngineRequest r;
          r.prompt.resize(prompt_);
          for (int j = 0; j < prompt_; ++j) {
            r.prompt[j] =
                3 + static_cast<int32_t>((1000003LL * (i + 1) + 7919LL * j) % (c.vocab_size - 3));
          }
          r.params.temperature = 0;
          r.params.max_tokens = gen_;
          r.params.ignore_eos = true;
          r.kv_policy = kv_policy;
          if (!engine->Submit(std::move(r), [](const SeqEvent&) {}).ok()) {
            Die(absl::InternalError("submit"));
          }
        }
        // Steps that carry prompt tokens are prefill; the rest decode.
        double prefill_s = 0, decode_s = 0, decode_bytes = 0;
        int64_t decode_steps = 0, decode_tokens = 0;
        for (;;) {
          const auto t0 = std::chrono::steady_clock::now();
          if (!engine->Step()) break;
          const double dt =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          const EngineStats st = engine->Stats();
          if (st.last_batch_tokens > st.last_batch_seqs) {
            prefill_s += dt;
          } else if (st.last_batch_tokens > 0) {
            decode_s += dt;
            // The first decode step writes slot prompt_ (the prefill sampled
            // its token). Exact at batch 1; a larger batch whose prompts took
            // several steps has sequences a few slots apart, which moves the
            // KV term (a small part beside the weights) by as little.
            if (bandwidth_) {
              decode_bytes +=
                  weight_bytes + st.last_batch_seqs * kv_step_bytes(prompt_ + decode_steps);
            }
            ++decode_steps;
            decode_tokens += st.last_batch_tokens;
            peak_blocks = std::max(peak_blocks, st.blocks_used);
          }
        }
        best_prefill = std::max(best_prefill, batch * prompt_ / std::max(1e-9, prefill_s));
        best_decode = std::max(best_decode, decode_tokens / std::max(1e-9, decode_s));
        best_step = std::min(best_step, 1000.0 * decode_s / std::max<int64_t>(1, decode_steps));
        if (probe != nullptr && decode_steps > 0) {
          BandwidthRun r;
          r.step_bytes = decode_bytes / decode_steps;
          r.decode_gbps = decode_bytes / std::max(1e-9, decode_s) / 1e9;
          r.read_gbps = probe->BestGbps(pool, 3);  // right after this run's decode
          bw_runs.push_back(r);
        }
      }
      std::printf("| %5d | %10d | %7d | %13.1f | %12.1f | %14.2f | %18.1f |", batch, prompt_, gen_,
                  best_prefill, best_decode, best_step, static_cast<double>(peak_blocks) / batch);
      if (!bw_runs.empty()) {
        // The median run by its ratio (the lower middle of an even count).
        std::sort(bw_runs.begin(), bw_runs.end(), [](const BandwidthRun& a, const BandwidthRun& b) {
          return a.decode_gbps / a.read_gbps < b.decode_gbps / b.read_gbps;
        });
        const BandwidthRun& m = bw_runs[(bw_runs.size() - 1) / 2];
        std::printf(" %12.3f | %11.2f | %9.1f | %12.1f%% |", m.step_bytes / 1e6, m.decode_gbps,
                    m.read_gbps, 100.0 * m.decode_gbps / m.read_gbps);
      } else if (bandwidth_) {
        std::printf(" %12s | %11s | %9s | %13s |", "-", "-", "-", "-");
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    if (probe != nullptr) {
      // Whether the probe's buffer got huge pages moves its figure
      // (read_probe.h).
      std::printf(
          "\nread GB/s: kernels::ReadProbe over %lld MiB on %d threads, best of 3 passes "
          "after each run; huge pages advised, %s\n",
          static_cast<long long>(probe->bytes() >> 20), pool->num_threads(),
          probe->HugePageNote().c_str());
    }
    return 0;
  }

 private:
  std::vector<int> batches_ = {1, 8, 32};
  int prompt_ = 128;
  int gen_ = 64;
  int reps_ = 1;
  bool bandwidth_ = false;
  EngineFlags* engine_flags_;
  KvPolicyFlags kv_policy_flags_;
};

}  // namespace

std::unique_ptr<Command> NewBenchCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<BenchCommand>(root, engine_flags);
}

}  // namespace kvserve
