// `kvserve advise`: a recommended `kvserve serve` configuration for a
// workload and a memory budget, from a short calibration on this machine
// (the engine's decode step cost at a few batch sizes, its prefill cost per
// token, the memory copy bandwidth). The choices and their reasons live in
// server/app/advisor.h; this file measures and prints. --apply writes the TOML
// `kvserve --config FILE serve` reads.
//
// Thread-safety: runs on the main thread; the engine is stepped here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "scheduler/engine.h"
#include "server/app/advisor.h"
#include "server/app/command.h"
#include "server/app/engine_builder.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

// Least squares y = a + b x.
std::pair<double, double> FitLine(const std::vector<std::pair<double, double>>& xy) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (auto [x, y] : xy) {
    n += 1;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double den = n * sxx - sx * sx;
  if (n < 2 || den <= 0) return {n > 0 ? sy / n : 0, 0};
  const double b = (n * sxy - sx * sy) / den;
  return {(sy - b * sx) / n, b};
}

double CopyGbps() {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    a[i] = b[bytes - 1 - i];  // keep the copies observable
  }
  return bytes / best / 1e9;
}

class AdviseCommand final : public Command {
 public:
  explicit AdviseCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "advise",
            "Recommend a serve configuration for a workload, from a calibration on this machine")) {
    app_->add_option("--memory", memory_, "Memory for weights + KV (512MiB, 4GiB; or a fraction of "
                                          "available memory, 0.5)")
        ->required();
    app_->add_option("--prompt-len", prompt_, "Prompt length distribution (N, uniform:LO:HI, "
                                              "normal:MEAN:STD)")
        ->capture_default_str();
    app_->add_option("--output-len", output_, "Output length distribution")->capture_default_str();
    app_->add_option("--prefix-share", prefix_share_, "Share of prompt tokens in a common prefix (0-1)")
        ->capture_default_str();
    app_->add_option("--prefixes", prefixes_, "Distinct common prefixes in use")->capture_default_str();
    app_->add_option("--concurrency", concurrency_, "Closed loop: clients, one request each in flight");
    app_->add_option("--rate", rate_, "Open loop: requests per second");
    app_->add_option("--slo-ttft-ms", slo_ttft_, "TTFT objective (ms; 0: none)")->capture_default_str();
    app_->add_option("--slo-tpot-ms", slo_tpot_, "TPOT objective (ms; 0: none)")->capture_default_str();
    app_->add_option("--from-bench", from_bench_,
                     "A kvserve-bench --json-out result as the workload (lengths, load, SLOs, "
                     "measured prefix share)");
    app_->add_option("--apply", apply_, "Write the recommendation as TOML for kvserve --config");
    app_->add_option("--json-out", json_out_, "Write the recommendation, reasons, prediction and "
                                              "calibration as JSON");
    app_->add_option("--calibration", calibration_in_,
                     "Reuse a calibration from an earlier --json-out instead of measuring");
  }

  int Run(const GlobalFlags& global) override {
    AdvisorInputs in;
    if (!from_bench_.empty()) {
      std::ifstream f(from_bench_);
      json j = json::parse(f, nullptr, /*allow_exceptions=*/false);
      if (!f || j.is_discarded()) {
        Die(absl::InvalidArgumentError(absl::StrCat("--from-bench: cannot read JSON from ", from_bench_)));
      }
      in.workload = ValueOrDie(WorkloadFromBench(j));
      in.workload.source = absl::StrCat("kvserve-bench result ", from_bench_);
      if (concurrency_ > 0 || rate_ > 0) {  // flags override the file's load
        in.workload.concurrency = concurrency_;
        in.workload.rate = concurrency_ > 0 ? 0 : rate_;
      }
    } else {
      in.workload.prompt = ValueOrDie(ParseLengthSpec(prompt_));
      in.workload.output = ValueOrDie(ParseLengthSpec(output_));
      in.workload.prefix_share = prefix_share_;
      in.workload.prefixes = prefixes_;
      in.workload.concurrency = concurrency_;
      in.workload.rate = rate_;
      in.workload.slo_ttft_ms = slo_ttft_;
      in.workload.slo_tpot_ms = slo_tpot_;
      in.workload.source = "flags";
    }
    if (concurrency_ < 0 || rate_ < 0) Die(absl::InvalidArgumentError("--concurrency and --rate must be >= 0"));
    in.memory_budget_bytes = ValueOrDie(ParseMemoryBudget(memory_));
    std::error_code ec;
    in.model_bytes = static_cast<int64_t>(std::filesystem::file_size(global.model_path, ec));
    if (ec) Die(absl::NotFoundError(absl::StrCat("model ", global.model_path, ": ", ec.message())));

    LoadedModel l = LoadModelOrDie(global.model_path);
    const LlamaConfig& cfg = l.model->config();
    in.shape = KvShapeOf(cfg, /*groups=*/true);  // hybrid models: memory per KV cache group
    in.model_name = cfg.name;
    if (!calibration_in_.empty()) {
      std::ifstream f(calibration_in_);
      json j = json::parse(f, nullptr, false);
      if (j.is_discarded() || !j.contains("calibration")) {
        Die(absl::InvalidArgumentError(absl::StrCat("--calibration: no calibration in ", calibration_in_)));
      }
      const json& c = j["calibration"];
      in.calibration.step_fixed_s = c.value("step_fixed_ms", 0.0) / 1e3;
      in.calibration.decode_per_seq_s = c.value("decode_per_seq_ms", 0.0) / 1e3;
      in.calibration.prefill_per_token_s = c.value("prefill_per_token_ms", 0.0) / 1e3;
      in.calibration.copy_gbps = c.value("copy_gbps", 0.0);
      std::printf("calibration     reused from %s\n", calibration_in_.c_str());
    } else {
      in.calibration = Calibrate(l);
    }
    const Calibration& c = in.calibration;
    std::printf("model           %s (%s), %s of weights\n", global.model_path.c_str(),
                cfg.name.c_str(), FormatBytes(in.model_bytes).c_str());
    std::printf("workload        prompt %s, output %s, prefix share %.2f (%d prefixes), %s, "
                "SLO TTFT %g ms / TPOT %g ms (from %s)\n",
                in.workload.prompt.text.c_str(), in.workload.output.text.c_str(),
                in.workload.prefix_share, in.workload.prefixes,
                in.workload.concurrency > 0
                    ? absl::StrCat("concurrency ", in.workload.concurrency).c_str()
                    : absl::StrCat("rate ", in.workload.rate, "/s").c_str(),
                in.workload.slo_ttft_ms, in.workload.slo_tpot_ms, in.workload.source.c_str());
    std::printf("calibration     step = %.2f ms + %.3f ms x decoding seqs + %.4f ms x prompt "
                "tokens; copy %.1f GB/s\n\n",
                1e3 * c.step_fixed_s, 1e3 * c.decode_per_seq_s, 1e3 * c.prefill_per_token_s,
                c.copy_gbps);
    const Advice advice = ValueOrDie(Advise(in));
    std::printf("%s", advice.ToText().c_str());

    json out = advice.ToJson();
    out["calibration"] = {{"step_fixed_ms", 1e3 * c.step_fixed_s},
                          {"decode_per_seq_ms", 1e3 * c.decode_per_seq_s},
                          {"prefill_per_token_ms", 1e3 * c.prefill_per_token_s},
                          {"copy_gbps", c.copy_gbps}};
    out["workload"] = {{"prompt_len", in.workload.prompt.text},
                       {"output_len", in.workload.output.text},
                       {"prefix_share", in.workload.prefix_share},
                       {"prefixes", in.workload.prefixes},
                       {"concurrency", in.workload.concurrency},
                       {"rate", in.workload.rate},
                       {"slo_ttft_ms", in.workload.slo_ttft_ms},
                       {"slo_tpot_ms", in.workload.slo_tpot_ms},
                       {"source", in.workload.source}};
    if (!json_out_.empty()) {
      std::ofstream f(json_out_);
      f << out.dump(2) << '\n';
      if (!f) Die(absl::UnavailableError(absl::StrCat("cannot write ", json_out_)));
    }
    if (!apply_.empty()) {
      std::ofstream f(apply_);
      f << advice.ToToml(absl::StrCat(
          "kvserve advise for ", cfg.name, ": prompt ", in.workload.prompt.text, ", output ",
          in.workload.output.text, ", prefix share ", in.workload.prefix_share, ", ",
          in.workload.concurrency > 0 ? absl::StrCat("concurrency ", in.workload.concurrency)
                                      : absl::StrCat("rate ", in.workload.rate, "/s"),
          ".\nUse: kvserve --config ", apply_, " -m MODEL serve"));
      if (!f) Die(absl::UnavailableError(absl::StrCat("cannot write ", apply_)));
      std::printf("\nwrote %s (kvserve --config %s -m MODEL serve)\n", apply_.c_str(), apply_.c_str());
    }
    return 0;
  }

 private:
  // Steps an engine by hand over synthetic prompts at a few batch sizes and
  // fits the step cost. Short: ~64-token prompts, 12 generated tokens. Each
  // batch size runs kRounds times and only its quietest round (least total
  // step time) is kept: on a shared machine a neighbour's burst inflates a
  // whole round, and a fit over such a round predicted TPOT 3.7x too slow.
  Calibration Calibrate(const LoadedModel& l) {
    constexpr int kRounds = 3;
    const LlamaConfig& cfg = l.model->config();
    EngineFlags flags;
    flags.kv_cache_memory = "256MiB";
    flags.max_seqs = 16;
    flags.max_batched_tokens = 256;
    flags.prefix_cache = false;
    flags.max_stall_factor = 0;
    flags.target_itl_ms = 0;
    EngineBuilder builder(flags, l.model.get(), l.tokenizer.get());
    const int prompt = std::min(64, std::max(8, cfg.context_length / 4));
    const int gen = 12;
    using DecodeSamples = std::vector<std::pair<double, double>>;                // (seqs, seconds)
    using PrefillSamples = std::vector<std::tuple<double, double, double>>;      // (tokens, decodes, seconds)
    // Runs `batch` requests to completion; returns the total step time. With
    // null sample vectors (the warm-up) it records nothing.
    auto run_batch = [&](int batch, DecodeSamples* decode, PrefillSamples* prefill) {
      std::unique_ptr<Engine> engine = ValueOrDie(builder.Build(&ThreadPool::Global()));
      for (int i = 0; i < batch; ++i) {
        EngineRequest r;
        r.prompt.resize(prompt);
        for (int j = 0; j < prompt; ++j) {
          r.prompt[j] = 3 + static_cast<int32_t>((1000003LL * (i + 1) + 7919LL * j) % (cfg.vocab_size - 3));
        }
        r.params.temperature = 0;
        r.params.max_tokens = gen;
        r.params.ignore_eos = true;
        if (!engine->Submit(std::move(r), [](const SeqEvent&) {}).ok()) {
          Die(absl::InternalError("calibration: submit failed"));
        }
      }
      double total = 0;
      for (;;) {
        const auto t0 = std::chrono::steady_clock::now();
        if (!engine->Step()) break;
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        total += dt;
        const EngineStats st = engine->Stats();
        if (decode == nullptr || st.last_batch_tokens == 0) continue;
        const double p = static_cast<double>(st.last_batch_prefill_tokens);
        if (p > 0) {
          prefill->emplace_back(p, static_cast<double>(st.last_batch_seqs) - 1, dt);
        } else {
          decode->emplace_back(static_cast<double>(st.last_batch_seqs), dt);
        }
      }
      return total;
    };
    DecodeSamples decode;
    PrefillSamples prefill;
    run_batch(1, nullptr, nullptr);  // warms the caches
    for (int batch : {1, 4, 16}) {
      double best = 1e300;
      DecodeSamples best_d;
      PrefillSamples best_p;
      for (int round = 0; round < kRounds; ++round) {
        DecodeSamples d;
        PrefillSamples p;
        const double total = run_batch(batch, &d, &p);
        if (total < best) {
          best = total;
          best_d = std::move(d);
          best_p = std::move(p);
        }
      }
      decode.insert(decode.end(), best_d.begin(), best_d.end());
      prefill.insert(prefill.end(), best_p.begin(), best_p.end());
    }
    Calibration c;
    auto [fixed, per_seq] = FitLine(decode);
    c.step_fixed_s = std::max(0.0, fixed);
    c.decode_per_seq_s = std::max(0.0, per_seq);
    double tokens = 0, seconds = 0;
    for (auto [p, d, t] : prefill) {
      tokens += p;
      seconds += std::max(0.0, t - c.step_fixed_s - c.decode_per_seq_s * std::max(0.0, d));
    }
    c.prefill_per_token_s = tokens > 0 ? seconds / tokens : 0;
    c.copy_gbps = CopyGbps();
    return c;
  }

  std::string memory_;
  std::string prompt_ = "256";
  std::string output_ = "128";
  double prefix_share_ = 0;
  int32_t prefixes_ = 1;
  int32_t concurrency_ = 0;
  double rate_ = 0;
  double slo_ttft_ = 0;
  double slo_tpot_ = 0;
  std::string from_bench_, apply_, json_out_, calibration_in_;
};

}  // namespace

std::unique_ptr<Command> NewAdviseCommand(CLI::App* root) {
  return std::make_unique<AdviseCommand>(root);
}

}  // namespace kvserve
