// `kvserve serve`: the gRPC and OpenAI-compatible HTTP daemon. This file owns
// only the subcommand: its flags (server/app/serve_flags.h), blocking the
// shutdown signals and logging the effective configuration before any thread
// starts, and handing over to Daemon (server/app/daemon.h), which owns start-up,
// signals and the drain.
//
// Thread-safety: runs on the main thread, which ends up in sigwait.
#include <sstream>
#include <string>

#include "CLI/CLI.hpp"
#include "common/thread_pool.h"
#include "embed/sentence_encoder.h"
#include "server/app/command.h"
#include "server/app/daemon.h"
#include "server/service/semantic_cache.h"
#include "server/app/serve_flags.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

// The configuration as logged: API keys show as "***" (the key file's path
// is no secret).
std::string MaskSecrets(std::string config) {
  std::stringstream in(config), out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("api-key") != std::string::npos && line.find('=') != std::string::npos &&
        line.find("api-key-file") == std::string::npos) {
      line = line.substr(0, line.find('=') + 1) + " \"***\"";
    }
    out << line << "\n";
  }
  return out.str();
}

class ServeCommand final : public Command {
 public:
  ServeCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(root->add_subcommand("serve", "Run the daemon: gRPC and OpenAI-compatible HTTP")),
        engine_flags_(engine_flags) {
    AddServeFlags(app_, &flags_);
    AddEngineFlags(app_, engine_flags_);
  }

  void BeforeThreads(CLI::App* root) override {
    // SIGTERM/SIGINT are taken by sigwait in the main thread: block them
    // before any thread exists so every thread inherits the mask.
    Daemon::BlockShutdownSignals();
    spdlog::info("configuration:\n{}", MaskSecrets(root->config_to_str(true, false)));
  }

  int Run(const GlobalFlags& global) override {
    // --semantic-cache-model: kvserve's own sentence encoder (embed/).
    SetEmbedderFactory([](const std::string& dir) { return embed::LoadSentenceEncoder(dir); });
    // Probes get answers while the model loads (503 / NOT_SERVING).
    std::unique_ptr<LoadingProbes> probes = LoadingProbes::Start(flags_);
    LoadedModel l = LoadModelOrDie(global.model_path);
    std::unique_ptr<Daemon> daemon = ValueOrDie(Daemon::Start(
        l, global.model_path, flags_, *engine_flags_, &ThreadPool::Global(), probes.get()));
    probes.reset();
    daemon->WaitForSignalAndDrain();
    return 0;
  }

 private:
  ServeFlags flags_;
  EngineFlags* engine_flags_;
};

}  // namespace

std::unique_ptr<Command> NewServeCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<ServeCommand>(root, engine_flags);
}

}  // namespace kvserve
