// `kvserve info`: the model's hyper-parameters and its KV bytes per token for
// every KV codec. Loads the model; runs nothing.
//
// Thread-safety: runs on the main thread.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "kernels/kv_view.h"
#include "server/app/command.h"

namespace kvserve {
namespace {

class InfoCommand final : public Command {
 public:
  explicit InfoCommand(CLI::App* root)
      : Command(root->add_subcommand("info", "Model hyper-parameters and KV bytes per token")) {}

  int Run(const GlobalFlags& global) override {
    LoadedModel l = LoadModelOrDie(global.model_path);
    const LlamaConfig& c = l.model->config();
    std::printf(
        "name            %s\narchitecture    %s\nlayers          %d\ndim             %d\n"
        "heads (q/kv)    %d/%d\nhead_dim        %d\nffn             %d\nvocab           %d\n"
        "context         %d\nrope            base %.0f, dims %d\ntied output     %s\n"
        "weights read    %.1f MiB per token\nKV bytes/token  %lld (f32), %lld (f16)\n",
        c.name.c_str(), c.architecture.c_str(), c.n_layers, c.dim, c.n_heads, c.n_kv_heads,
        c.head_dim, c.ffn_dim, c.vocab_size, c.context_length, c.rope_freq_base, c.rope_dim,
        c.tied_output ? "yes" : "no", l.model->weight_bytes() / 1048576.0,
        static_cast<long long>(c.KvBytesPerToken(4)), static_cast<long long>(c.KvBytesPerToken(2)));
    // Per codec, scales included (the pool's own formula, per token of a
    // 16-token block: int4-kivi's key scales are per block).
    std::printf("KV bytes/token by --kv-cache-dtype:");
    for (kernels::KvDType t : kernels::kAllKvDTypes) {
      const int64_t bytes = 2 * c.n_layers *
                            kernels::PagedKvView::HalfLayerBytes(16, c.n_kv_heads, c.head_dim, t) /
                            16;
      std::printf(" %s %lld", std::string(kernels::KvDTypeName(t)).c_str(),
                  static_cast<long long>(bytes));
    }
    std::printf("\n");
    return 0;
  }
};

}  // namespace

std::unique_ptr<Command> NewInfoCommand(CLI::App* root) {
  return std::make_unique<InfoCommand>(root);
}

}  // namespace kvserve
