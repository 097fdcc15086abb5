// `kvserve plan`: the KV memory plan for a model under the engine flags. Reads
// the GGUF's metadata only, never the weights, so it answers at once even
// for a model too large for this machine.
//
// Thread-safety: runs on the main thread.
#include <algorithm>
#include <cstdio>

#include "CLI/CLI.hpp"
#include "model/gguf.h"
#include "server/app/command.h"
#include "server/app/engine_builder.h"
#include "server/service/kv_policy.h"

namespace kvserve {
namespace {

class PlanCommand final : public Command {
 public:
  PlanCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(root->add_subcommand(
            "plan", "KV memory plan for a model and settings (reads metadata, not weights)")),
        engine_flags_(engine_flags) {
    AddEngineFlags(app_, engine_flags_);
    AddKvPolicyFlags(app_, &kv_policy_flags_);
  }

  int Run(const GlobalFlags& global) override {
    auto file = ValueOrDie(GgufFile::Open(global.model_path));
    auto cfg = ValueOrDie(LlamaConfig::FromGguf(*file));
    std::printf("model           %s (%s)\n", global.model_path.c_str(), cfg.name.c_str());
    std::printf("architecture    %s, %d layers, rope scaling %s%s\n", cfg.architecture.c_str(),
                cfg.n_layers, cfg.rope_scaling.c_str(), cfg.qkv_bias ? ", QKV bias" : "");
    const MemoryPlan plan = ValueOrDie(PlanFromFlags(*engine_flags_, cfg));
    std::printf("kv dtype        %s\n", engine_flags_->kv_cache_dtype.c_str());
    std::printf("%s", plan.ToString().c_str());
    // Token eviction bounds what one sequence holds: the policy's capacity
    // plus one block of slack (compaction frees a block once it is wholly
    // dropped), whatever the context. Prefill chunks add to it for a moment.
    const KvPolicyDefaults kv_defaults = ValueOrDie(KvPolicyDefaultsFromFlags(kv_policy_flags_));
    const KvPolicy policy = ValueOrDie(ResolveKvPolicy(std::nullopt, kv_defaults));
    if (policy.kind != KvPolicy::Kind::kNone && plan.block_size > 0) {
      const int64_t bs = plan.block_size;
      const int64_t full_blocks = (cfg.context_length + bs - 1) / bs;
      const int64_t kept = std::min<int64_t>(policy.capacity(), cfg.context_length);
      const int64_t policy_blocks = std::min(full_blocks, (kept + bs - 1) / bs + 1);
      std::printf("kv policy       %s: keeps at most %lld tokens\n", KvPolicyName(policy.kind),
                  static_cast<long long>(kept));
      std::printf("blocks per seq  %lld at %d tokens of context (%lld without eviction)\n",
                  static_cast<long long>(policy_blocks), cfg.context_length,
                  static_cast<long long>(full_blocks));
      std::printf("sequences       %lld at full context fit with the policy (%lld without)\n",
                  static_cast<long long>(plan.num_blocks / policy_blocks),
                  static_cast<long long>(plan.full_context_sequences));
    }
    return 0;
  }

 private:
  EngineFlags* engine_flags_;
  KvPolicyFlags kv_policy_flags_;
};

}  // namespace

std::unique_ptr<Command> NewPlanCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<PlanCommand>(root, engine_flags);
}

}  // namespace kvserve
