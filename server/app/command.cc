// The implementation of command.h. What it owns and how it is used: the
// opening paragraph of server/app/command.h.

#include "server/app/command.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "spdlog/spdlog.h"

namespace kvserve {

bool Command::selected() const { return static_cast<bool>(*app_); }

std::string DefaultModelPath() {
  if (const char* m = std::getenv("KVSERVE_MODEL")) return m;
  std::string dir = "models";
  if (const char* d = std::getenv("KVSERVE_MODEL_DIR")) dir = d;
  return dir + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

void Die(const absl::Status& s) {
  std::fprintf(stderr, "kvserve: error: %s\n", s.ToString().c_str());
  std::exit(1);
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

LoadedModel LoadModelOrDie(const std::string& path) {
  LoadedModel l;
  l.model = ValueOrDie(LlamaModel::Load(path));
  l.tokenizer = ValueOrDie(Tokenizer::FromGguf(l.model->file()));
  const LlamaConfig& c = l.model->config();
  spdlog::info(
      "model {}: {} layers, dim {}, heads {}/{} (q/kv), head_dim {}, ffn {}, vocab {}, ctx {}",
      path, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size,
      c.context_length);
  spdlog::info("matmul kernels: {}; {:.1f} MiB of weights repacked for them",
               kernels::MatMulPathDescription(), l.model->packed_bytes() / 1048576.0);
  return l;
}

void SetThreads(int threads) {
  ThreadPool::SetGlobalThreads(threads);
  spdlog::info("threads: {}, cpu: {}", ThreadPool::Global().num_threads(),
               GetCpuFeatures().ToString());
}

}  // namespace kvserve
