// `kvserve kv-error`: the error of every KV codec and granularity on K and V
// captured from a real forward over a text file (model/perplexity.h), as a
// Markdown table.
//
// Thread-safety: runs on the main thread; the forward uses the global pool.
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/thread_pool.h"
#include "model/perplexity.h"
#include "server/app/command.h"

namespace kvserve {
namespace {

class KvErrorCommand final : public Command {
 public:
  explicit KvErrorCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "kv-error",
            "Error of every KV codec and granularity on K/V captured from a real forward")) {
    app_->add_option("-f,--file", file_, "Plain text file")->required();
    app_->add_option("-c,--context", context_, "Tokens to run")->capture_default_str();
  }

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    const std::string text = ValueOrDie(ReadFileToString(file_));
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    const std::vector<KvErrorRow> rows =
        ValueOrDie(ComputeKvError(*l.model, tokens, context_, &ThreadPool::Global()));
    std::printf(
        "| codec | granularity | K MSE | K max abs | K cosine | V MSE | V max abs | V cosine |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (const KvErrorRow& r : rows) {
      std::printf("| %s | %s | %.3g | %.3g | %.6f | %.3g | %.3g | %.6f |\n", r.codec.c_str(),
                  r.granularity.c_str(), r.k_mse, r.k_max_abs, r.k_cosine, r.v_mse, r.v_max_abs,
                  r.v_cosine);
    }
    return 0;
  }

 private:
  std::string file_;
  int32_t context_ = 512;
};

}  // namespace

std::unique_ptr<Command> NewKvErrorCommand(CLI::App* root) {
  return std::make_unique<KvErrorCommand>(root);
}

}  // namespace kvserve
