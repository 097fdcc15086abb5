// `kvserve plan`: the KV memory plan for a model under the engine flags. Reads
// the GGUF's metadata only, never the weights, so it answers at once even
// for a model too large for this machine.
//
// Thread-safety: runs on the main thread.
#include <cstdio>

#include "CLI/CLI.hpp"
#include "model/gguf.h"
#include "server/command.h"
#include "server/engine_builder.h"

namespace kvserve {
namespace {

class PlanCommand final : public Command {
 public:
  PlanCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(root->add_subcommand(
            "plan", "KV memory plan for a model and settings (reads metadata, not weights)")),
        engine_flags_(engine_flags) {
    AddEngineFlags(app_, engine_flags_);
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
    return 0;
  }

 private:
  EngineFlags* engine_flags_;
};

}  // namespace

std::unique_ptr<Command> NewPlanCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<PlanCommand>(root, engine_flags);
}

}  // namespace kvserve
