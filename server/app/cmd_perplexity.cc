// `kvserve perplexity`: the model's perplexity on a text file with the KV
// cache in any codec (model/perplexity.h), optionally against a second codec
// (same-top-1 fraction and mean KL).
//
// Thread-safety: runs on the main thread; the forward uses the global pool.
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "kernels/kv_view.h"
#include "model/perplexity.h"
#include "server/app/command.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

class PerplexityCommand final : public Command {
 public:
  explicit PerplexityCommand(CLI::App* root)
      : Command(root->add_subcommand("perplexity", "Perplexity of the model on a text file")) {
    app_->add_option("-f,--file", file_, "Plain text file")->required();
    app_->add_option("-c,--context", opts_.context, "Tokens per window")->capture_default_str();
    app_->add_option(
            "--stride", opts_.stride,
            "0 = llama.cpp method (score second half of each window); >0 = sliding windows")
        ->capture_default_str();
    app_->add_option("--max-windows", opts_.max_windows, "0 = all")->capture_default_str();
    app_->add_option("--batch", opts_.batch_tokens, "Tokens per forward call")
        ->capture_default_str();
    app_->add_option("--block-size", opts_.block_size, "Tokens per KV block")
        ->capture_default_str();
    app_->add_option("--kv-cache-dtype", kv_dtype_,
                     "KV storage while scoring: " + std::string(kernels::KvDTypeList()))
        ->capture_default_str();
    app_->add_option("--top1-out", top1_out_,
                     "Write the most likely next token of every scored position, one window "
                     "per line, to this file (teacher-forced top-1, e.g. for "
                     "bench/top1_vs_llamacpp.py); a second line per window holds each "
                     "position's negative log-likelihood");
    app_->add_option("--compare-kv-dtype", compare_dtype_,
                     "Also run with this KV dtype; report same-top-1 fraction and mean KL");
  }

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    const std::string text = ValueOrDie(ReadFileToString(file_));
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    opts_.bos_id = l.tokenizer->add_bos_default() ? l.tokenizer->bos_id() : -1;
    if (!kernels::ParseKvDType(kv_dtype_, &opts_.kv_dtype)) {
      Die(absl::InvalidArgumentError(
          absl::StrCat("--kv-cache-dtype: unknown KV dtype '", kv_dtype_, "'")));
    }
    opts_.compare = !compare_dtype_.empty();
    if (opts_.compare && !kernels::ParseKvDType(compare_dtype_, &opts_.compare_dtype)) {
      Die(absl::InvalidArgumentError(
          absl::StrCat("--compare-kv-dtype: unknown KV dtype '", compare_dtype_, "'")));
    }
    if (!top1_out_.empty() && opts_.stride != 0) {
      Die(absl::InvalidArgumentError("--top1-out: needs --stride 0 (one line per window)"));
    }
    spdlog::info("{}: {} tokens", file_, tokens.size());
    auto r = ValueOrDie(ComputePerplexity(*l.model, tokens, opts_, &ThreadPool::Global()));
    for (size_t i = 0; i < r.window_perplexity.size(); ++i) {
      std::fprintf(stderr, "[%zu]%.4f ", i + 1, r.window_perplexity[i]);
    }
    std::fprintf(stderr, "\n");
    std::printf(
        "perplexity %.4f over %lld scored tokens in %d windows (context %d, stride %d, kv %s)\n",
        r.perplexity, static_cast<long long>(r.scored_tokens), r.windows, opts_.context,
        opts_.stride, kv_dtype_.c_str());
    if (!top1_out_.empty()) {
      // --stride 0 scores the same positions of every window: one per line.
      std::FILE* f = std::fopen(top1_out_.c_str(), "w");
      if (f == nullptr) Die(absl::InvalidArgumentError("--top1-out: cannot write " + top1_out_));
      const size_t per_window = r.windows > 0 ? r.top1.size() / r.windows : 0;
      for (size_t w = 0; w < static_cast<size_t>(r.windows); ++w) {
        for (size_t i = w * per_window; i < (w + 1) * per_window; ++i) {
          std::fprintf(f, "%d%c", r.top1[i], i + 1 < (w + 1) * per_window ? ' ' : '\n');
        }
        for (size_t i = w * per_window; i < (w + 1) * per_window; ++i) {
          std::fprintf(f, "%.6f%c", r.nll[i], i + 1 < (w + 1) * per_window ? ' ' : '\n');
        }
      }
      if (std::fclose(f) != 0) Die(absl::InternalError("--top1-out: write failed"));
    }
    if (opts_.compare) {
      std::printf("vs %s: same top-1 token %.2f%%, mean KL %.5f nats\n", compare_dtype_.c_str(),
                  100.0 * r.same_top1, r.mean_kl);
    }
    return 0;
  }

 private:
  std::string file_;
  PerplexityOptions opts_;
  std::string kv_dtype_ = "f32";
  std::string compare_dtype_;
  std::string top1_out_;
};

}  // namespace

std::unique_ptr<Command> NewPerplexityCommand(CLI::App* root) {
  return std::make_unique<PerplexityCommand>(root);
}

}  // namespace kvserve
