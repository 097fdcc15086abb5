// kvserve: the engine's command-line entry and the serving daemon. main()
// only builds the CLI11 app from the subcommands (one file each,
// server/cmd_*.cc; see server/app/command.h), parses, sets up logging and runs the
// chosen one:
//   generate    complete a prompt (or a chat turn) and stream the text
//   perplexity  perplexity of the model on a text file (any KV dtype)
//   kv-eval     quality of a KV policy (token eviction) on a text
//   kv-error    error of every KV codec on K/V captured from a real forward
//   bench       prefill and decode throughput at several batch sizes
//   loadtest    a request workload through the continuous-batching scheduler
//   plan        KV memory plan for a model and settings (reads metadata only)
//   advise      a recommended serve configuration for a workload (calibrates)
//   info        model hyper-parameters and KV bytes per token
//   probe       GPU memory bandwidth
//   serve       the gRPC/HTTP daemon
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "server/app/command.h"
#include "server/app/serve_flags.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace kvserve {
// server/app/cmd_advise.cc (declared here rather than in command.h, which every
// command includes).
std::unique_ptr<Command> NewAdviseCommand(CLI::App* root);
}  // namespace kvserve

int main(int argc, char** argv) {
  using namespace kvserve;
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvserve"));

  CLI::App app{
      "kvserve: an LLM inference engine and serving daemon built around KV-cache management"};
  app.require_subcommand(1);
  GlobalFlags global;
  global.model_path = DefaultModelPath();
  app.add_option("-m,--model", global.model_path, "GGUF model file (env KVSERVE_MODEL)")
      ->capture_default_str();
  app.add_option("-t,--threads", global.threads,
                 "Compute threads (0 = all cores; env KVSERVE_THREADS)");
  app.add_option("--log-level", global.log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();

  // One set of engine flags, registered on every subcommand that runs an
  // engine; the order below is --help's.
  EngineFlags engine_flags;
  std::vector<std::unique_ptr<Command>> commands;
  commands.push_back(NewGenerateCommand(&app, &engine_flags));
  commands.push_back(NewPerplexityCommand(&app));
  commands.push_back(NewKvErrorCommand(&app));
  commands.push_back(NewKvEvalCommand(&app));
  commands.push_back(NewBenchCommand(&app, &engine_flags));
  commands.push_back(NewLoadtestCommand(&app, &engine_flags));
  commands.push_back(NewPlanCommand(&app, &engine_flags));
  commands.push_back(NewAdviseCommand(&app));
  commands.push_back(NewInfoCommand(&app));
  commands.push_back(NewProbeCommand(&app));
  commands.push_back(NewServeCommand(&app, &engine_flags));
  commands.push_back(NewRouteCommand(&app));

  app.add_option("--log-format", global.log_format, "text or json")->capture_default_str();
  app.set_config("--config", "", "Read options from a TOML/INI file (flags override it)");
  SetEnvNames(&app);

  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(global.log_level));
  if (global.log_format == "json") {
    spdlog::set_pattern(R"({"time":"%Y-%m-%dT%H:%M:%S.%e","level":"%l","msg":"%v"})");
  } else if (global.log_format != "text") {
    Die(absl::InvalidArgumentError("--log-format must be text or json"));
  }
  Command* chosen = nullptr;
  for (const auto& c : commands) {
    if (c->selected()) chosen = c.get();
  }
  if (chosen != nullptr) chosen->BeforeThreads(&app);
  SetThreads(global.threads);
  return chosen != nullptr ? chosen->Run(global) : 0;
}
