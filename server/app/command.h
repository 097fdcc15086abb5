// The kvserve binary's subcommands and what they share. Each subcommand lives
// in its own server/cmd_<name>.cc: a Command that registers its subcommand
// and options on the CLI11 app when it is made, and runs once the command
// line is parsed. server/app/main.cc makes them in the order --help lists them
// and runs the one the user picked. Also here: the flags every subcommand
// sees, loading a model, and the CLI's single failure path (Die).
//
// Thread-safety: commands are made, parsed and run on the main thread; what a
// command does with threads is its own business (see each cmd_*.cc).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "server/app/serve_flags.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvserve {

// Options of the top-level app, seen by every subcommand.
struct GlobalFlags {
  std::string model_path;  // -m; DefaultModelPath() unless given
  int threads = 0;         // -t; 0: all cores
  std::string log_level = "info";
  std::string log_format = "text";
};

// One subcommand of the binary.
class Command {
 public:
  // Does not take ownership of `app` (the subcommand; CLI11 owns it).
  explicit Command(CLI::App* app) : app_(app) {}
  virtual ~Command() = default;

  Command(const Command&) = delete;
  Command& operator=(const Command&) = delete;

  // The user named this subcommand on the command line.
  bool selected() const;

  // Runs after parsing and logging set-up, before the global thread pool
  // starts (nothing but the main thread exists yet). `root` is the app.
  virtual void BeforeThreads(CLI::App* /*root*/) {}
  // Runs the command; returns the process's exit code (or dies).
  virtual int Run(const GlobalFlags& global) = 0;

 protected:
  CLI::App* app_;
};

// Each adds its subcommand to `root` (in --help's order, see main.cc). The
// engine's flags are one set shared by the subcommands that run an engine.
std::unique_ptr<Command> NewGenerateCommand(CLI::App* root, EngineFlags* engine_flags);
std::unique_ptr<Command> NewPerplexityCommand(CLI::App* root);
std::unique_ptr<Command> NewKvErrorCommand(CLI::App* root);
std::unique_ptr<Command> NewKvEvalCommand(CLI::App* root);
std::unique_ptr<Command> NewBenchCommand(CLI::App* root, EngineFlags* engine_flags);
std::unique_ptr<Command> NewLoadtestCommand(CLI::App* root, EngineFlags* engine_flags);
std::unique_ptr<Command> NewPlanCommand(CLI::App* root, EngineFlags* engine_flags);
std::unique_ptr<Command> NewInfoCommand(CLI::App* root);
std::unique_ptr<Command> NewProbeCommand(CLI::App* root);
std::unique_ptr<Command> NewServeCommand(CLI::App* root, EngineFlags* engine_flags);
std::unique_ptr<Command> NewRouteCommand(CLI::App* root);

// $KVSERVE_MODEL, else $KVSERVE_MODEL_DIR (default "models") +
// /SmolLM2-135M-Instruct.Q4_1.gguf.
std::string DefaultModelPath();

// Prints "kvserve: error: <status>" to stderr and exits 1: the CLI's single
// failure path.
[[noreturn]] void Die(const absl::Status& s);

template <typename T>
T ValueOrDie(absl::StatusOr<T> v) {
  if (!v.ok()) Die(v.status());
  return std::move(v).value();
}

// The whole file, or NotFound("cannot read <path>").
[[nodiscard]] absl::StatusOr<std::string> ReadFileToString(const std::string& path);

struct LoadedModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

// Loads the weights and the tokenizer and logs the model's shape; dies on
// failure.
LoadedModel LoadModelOrDie(const std::string& path);

// Sizes the global thread pool (0: all cores) and logs it with the CPU's
// features.
void SetThreads(int threads);

}  // namespace kvserve
