// Where tests find real models. The shared test model (stories260K) lives in
// ../shared/models next to a developer checkout and is absent from a user's
// clone; the default model (SmolLM2) is fetched by deploy/setup.sh into
// models/. Tests that need a missing model skip with a message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvserve::testing {

// Path of ../shared/models/stories260K.gguf, or "" when absent.
std::string Stories260KPath();
// Path of ../shared/golden/stories260K-greedy.jsonl, or "" when absent.
std::string Stories260KGoldenPath();
// Path of the SmolLM2 default model ($KVSERVE_MODEL_DIR or <repo>/models),
// or "" when absent.
std::string SmolLM2Path();
// Path of `file` in the model directory ($KVSERVE_MODEL_DIR or <repo>/models),
// or "" when absent (the optional files deploy/setup.sh --models all fetches).
std::string ModelDirFile(const std::string& file);
// One line of the stories260K golden file (llama.cpp's greedy outputs).
struct Golden {
  std::string prompt;
  std::vector<int32_t> ids;  // prompt ids with BOS
  int max_tokens = 0;
  std::string text;          // output text including the prompt
};
std::vector<Golden> ReadGolden(const std::string& path);

// A fresh scratch directory for this test process.
std::string TempDir();

}  // namespace kvserve::testing

// Skips the current test when `path` is empty.
#define KVSERVE_SKIP_IF_MISSING(path, what)                                          \
  do {                                                                               \
    if ((path).empty()) GTEST_SKIP() << what << " not found; skipping (see README)"; \
  } while (0)
