// `kvserve kv-eval`: how much a KV policy (token eviction) costs in quality
// on a text, teacher-forced (scheduler/kv_policy_eval.h): perplexity with
// every token's KV and under the policy, their difference, the mean KL
// between the two next-token distributions, top-1 agreement, and the most KV
// slots the policy kept. deploy/eval-kv-policies.sh sweeps policies and
// budgets with it.
//
// Thread-safety: runs on the main thread; the forward uses the global pool.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "kernels/kv_view.h"
#include "scheduler/kv_policy_eval.h"
#include "server/app/command.h"
#include "server/service/kv_policy.h"
#include "server/app/serve_flags.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

class KvEvalCommand final : public Command {
 public:
  explicit KvEvalCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "kv-eval", "Quality of a KV policy (token eviction) on a text, teacher-forced")) {
    app_->add_option("-f,--file", file_, "Plain text file")->required();
    // The daemon's --kv-* flags, read the same way (server/service/kv_policy.h);
    // evaluating the sinks policy is the default here.
    kv_flags_.policy = "sinks";
    AddKvPolicyFlags(app_, &kv_flags_);
    app_->add_option("--max-tokens", max_tokens_,
                     "Score at most this many tokens (0: the whole text, up to the context "
                     "length unless --past-context)")
        ->capture_default_str();
    app_->add_flag("--past-context", past_context_,
                   "Stream the whole text even past the context length (sinks policy only: "
                   "positions within the cache; no every-token reference past the context)");
    app_->add_option("--repeat", repeat_, "Repeat the text this many times (long streams)")
        ->capture_default_str();
    app_->add_option("--segment", opts_.segment,
                     "Also print the policy's perplexity per this many scored tokens (0: off)")
        ->capture_default_str();
    app_->add_option("--chunk", opts_.chunk, "Tokens per forward; eviction runs between chunks")
        ->capture_default_str();
    app_->add_option("--block-size", opts_.block_size, "Tokens per KV block")
        ->capture_default_str();
    app_->add_option("--kv-cache-dtype", kv_dtype_,
                     "KV storage: " + std::string(kernels::KvDTypeList()))
        ->capture_default_str();
  }

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    const std::string text = ValueOrDie(ReadFileToString(file_));
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    if (repeat_ > 1) {
      const std::vector<int32_t> body = l.tokenizer->Encode(text, false, false);
      for (int32_t i = 1; i < repeat_; ++i) tokens.insert(tokens.end(), body.begin(), body.end());
    }
    const int32_t ctx = l.model->config().context_length;
    int32_t limit = past_context_ ? std::numeric_limits<int32_t>::max() : ctx;
    if (max_tokens_ > 0) limit = std::min(limit, max_tokens_);
    if (static_cast<int32_t>(tokens.size()) > limit) tokens.resize(static_cast<size_t>(limit));
    opts_.policy =
        ValueOrDie(ResolveKvPolicy(std::nullopt, ValueOrDie(KvPolicyDefaultsFromFlags(kv_flags_))));
    if (!kernels::ParseKvDType(kv_dtype_, &opts_.kv_dtype)) {
      Die(absl::InvalidArgumentError(
          absl::StrCat("--kv-cache-dtype: unknown KV dtype '", kv_dtype_, "'")));
    }
    spdlog::info("{}: {} tokens", file_, tokens.size());
    const KvPolicyEvalResult r =
        ValueOrDie(EvaluateKvPolicy(l.model.get(), tokens, opts_, &ThreadPool::Global()));
    if (!r.reference) {
      std::printf(
          "policy %s (sinks %d, window %d) past the context length %d: perplexity %.4f over %lld "
          "tokens, KV slots <= %d, %lld dropped, %lld keys re-rotated\n",
          KvPolicyName(opts_.policy.kind),
          opts_.policy.kind == KvPolicy::Kind::kWindow ? 0 : opts_.policy.sinks, opts_.policy.window, ctx,
          r.perplexity_policy, static_cast<long long>(r.scored_tokens), r.max_slots,
          static_cast<long long>(r.dropped_tokens), static_cast<long long>(r.rotated_keys));
    } else {
      std::printf(
          "policy %s (sinks %d, window %d, budget %d): perplexity %.4f vs %.4f with every token "
          "(%+.2f%%), mean KL %.5f nats, same top-1 %.2f%%, KV slots <= %d of %lld, %lld dropped\n",
          KvPolicyName(opts_.policy.kind), opts_.policy.sinks, opts_.policy.window,
          opts_.policy.budget, r.perplexity_policy, r.perplexity_full,
          100.0 * (r.perplexity_policy / r.perplexity_full - 1.0), r.mean_kl, 100.0 * r.same_top1,
          r.max_slots, static_cast<long long>(r.scored_tokens + 1),
          static_cast<long long>(r.dropped_tokens));
    }
    for (size_t i = 0; i < r.segment_perplexity.size(); ++i) {
      std::printf("segment %zu (tokens %lld-%lld): perplexity %.4f\n", i,
                  static_cast<long long>(i) * opts_.segment + 1,
                  static_cast<long long>(i + 1) * opts_.segment, r.segment_perplexity[i]);
    }
    return 0;
  }

 private:
  std::string file_;
  KvPolicyFlags kv_flags_;
  KvPolicyEvalOptions opts_;
  int32_t max_tokens_ = 0;
  bool past_context_ = false;
  int32_t repeat_ = 1;
  std::string kv_dtype_ = "f16";
};

}  // namespace

std::unique_ptr<Command> NewKvEvalCommand(CLI::App* root) {
  return std::make_unique<KvEvalCommand>(root);
}

}  // namespace kvserve
