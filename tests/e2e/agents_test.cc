// What agent clients send (issue 44), through the daemon with the default
// model (SmolLM2) and the semantic cache's sentence encoder, driven by the
// official openai Python client (tests/e2e/openai_agents_test.py): tool
// calls whole and streamed, the tool and developer roles, refusals by name
// of what is not honoured (logit_bias, unknown fields, vLLM's older guided_*
// fields, an unknown response_format type), /v1/embeddings in float and
// base64 with its token limit, and vLLM's /tokenize and /detokenize; and
// structured outputs (below). Skips without the models or the openai package.
#include <cstdlib>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "grammar/structured_output.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

TEST(AgentsE2eTest, OfficialClientToolsEmbeddingsAndRefusals) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::string encoder = model.substr(0, model.rfind('/')) + "/all-MiniLM-L6-v2";
  KVSERVE_SKIP_IF_MISSING(encoder + "/model.safetensors", "models/all-MiniLM-L6-v2");
  const char* py_env = std::getenv("KVSERVE_PYTHON");
  const std::string python = py_env ? py_env : "python3";
  if (std::system((python + " -c 'import openai' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "the openai Python package is not installed (set KVSERVE_PYTHON to a "
                    "python that has it)";
  }
  auto d = testing::StartServe(
      KVSERVE_BINARY, model, "warn",
      {"--served-model-name", "smollm2", "--api-key", "sk-test", "--response-cache-bytes", "1MiB",
       "--semantic-cache-model", encoder},
      {}, /*threads=*/2);
  ASSERT_NE(d, nullptr);
  const std::string cmd = python + " " + KVSERVE_AGENTS_CLIENT_TEST +
                          " --base-url http://127.0.0.1:" + std::to_string(d->http_port()) +
                          "/v1 --api-key sk-test --model smollm2 --embedding-model "
                          "all-MiniLM-L6-v2 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Structured outputs and forced tool calls (tests/e2e/openai_structured_test.py):
// JSON schemas (strict and not, greedy, sampled, streamed), json_object,
// structured_outputs json/regex/grammar/choice, tool_choice required and
// named (whole and streamed), each reply validated with jsonschema; bad
// schemas refused by name. On SmolLM2, then on Gemma 3 270M (another
// family; a base model, so completions only) when setup fetched it.
void RunStructured(const std::string& model, const std::string& name, bool completions_only) {
  if (!GrammarCompiler::Available()) GTEST_SKIP() << GrammarCompiler::UnavailableReason();
  const char* py_env = std::getenv("KVSERVE_PYTHON");
  const std::string python = py_env ? py_env : "python3";
  if (std::system((python + " -c 'import openai, jsonschema' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "the openai and jsonschema Python packages are not installed (set "
                    "KVSERVE_PYTHON to a python that has them)";
  }
  auto d = testing::StartServe(KVSERVE_BINARY, model, "warn",
                               {"--served-model-name", name, "--api-key", "sk-test",
                                "--response-cache-bytes", "1MiB"},
                               {}, /*threads=*/2);
  ASSERT_NE(d, nullptr);
  const std::string cmd = python + " " + KVSERVE_STRUCTURED_CLIENT_TEST +
                          " --base-url http://127.0.0.1:" + std::to_string(d->http_port()) +
                          "/v1 --api-key sk-test --model " + name +
                          (completions_only ? " --completions-only" : "") + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST(StructuredE2eTest, OfficialClientSchemasAndForcedToolCallsSmolLM2) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2-135M-Instruct.Q4_1.gguf");
  RunStructured(model, "smollm2", /*completions_only=*/false);
}

TEST(StructuredE2eTest, OfficialClientCompletionsGemma3) {
  const std::string model = testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf");
  KVSERVE_SKIP_IF_MISSING(model, "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
  RunStructured(model, "gemma3", /*completions_only=*/true);
}

}  // namespace
}  // namespace kvserve
