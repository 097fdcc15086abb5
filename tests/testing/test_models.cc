#include "tests/testing/test_models.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "nlohmann/json.hpp"

namespace kvserve::testing {
namespace {

std::string IfExists(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec) ? p.string() : std::string();
}

std::filesystem::path SharedDir() {
  if (const char* env = std::getenv("KVSERVE_SHARED_DIR")) return env;
  return std::filesystem::path(KVSERVE_SOURCE_DIR) / ".." / "shared";
}

}  // namespace

std::string Stories260KPath() { return IfExists(SharedDir() / "models" / "stories260K.gguf"); }

std::string Stories260KGoldenPath() {
  return IfExists(SharedDir() / "golden" / "stories260K-greedy.jsonl");
}

std::string SmolLM2Path() {
  std::filesystem::path dir = std::filesystem::path(KVSERVE_SOURCE_DIR) / "models";
  if (const char* env = std::getenv("KVSERVE_MODEL_DIR")) dir = env;
  return IfExists(dir / "SmolLM2-135M-Instruct.Q4_1.gguf");
}

std::string ModelDirFile(const std::string& file) {
  std::filesystem::path dir = std::filesystem::path(KVSERVE_SOURCE_DIR) / "models";
  if (const char* env = std::getenv("KVSERVE_MODEL_DIR")) dir = env;
  return IfExists(dir / file);
}

std::vector<Golden> ReadGolden(const std::string& path) {
  std::vector<Golden> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    out.push_back({j["prompt"], j["prompt_ids_with_bos"].get<std::vector<int32_t>>(),
                   j["max_tokens"], j["output_text_including_prompt"]});
  }
  return out;
}

std::string TempDir() {
  static const std::string dir = [] {
    std::string templ = (std::filesystem::temp_directory_path() / "kvserve-test-XXXXXX").string();
    const char* made = mkdtemp(templ.data());
    return made ? std::string(made) : std::filesystem::temp_directory_path().string();
  }();
  return dir;
}

}  // namespace kvserve::testing
