// Drives the real kvserve binary as a user would.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

struct RunResult {
  int exit_code;
  std::string out;  // stdout and stderr together
};

RunResult RunKvserve(const std::string& args) {
  const std::string cmd = std::string(KVSERVE_BINARY) + " " + args + " 2>&1";
  const testing::CommandResult run = testing::RunCommand(cmd);
  return RunResult{run.exit_code, run.out};
}

std::string LastLine(const std::string& s) {
  size_t end = s.find_last_not_of('\n');
  size_t start = s.rfind('\n', end);
  return s.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

TEST(CliTest, GenerateJsonOnStories260KMatchesGolden) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  RunResult r = RunKvserve("--log-level off -t 2 -m " + model +
                    " generate -p 'Once upon a time' -n 48 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_EQ(j["text"].get<std::string>(),
            ", there was a little girl named Lily. She loved to play outside in the park. One "
            "day, she saw a big, red ball. She wanted to play with it,");
  EXPECT_EQ(j["completion_tokens"].get<int>(), 48);
  EXPECT_EQ(j["prompt_tokens"].get<int>(), 5);
  EXPECT_EQ(j["finish_reason"].get<std::string>(), "length");
}

TEST(CliTest, GenerateOnTinyFixtureModelStreamsText) {
  const std::string path = testing::TempDir() + "/cli-tiny.gguf";
  testing::TinyLlamaOptions o;
  o.weight_type = GgmlType::kQ8_0;
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  RunResult r = RunKvserve("--log-level off -m " + path +
                    " generate -p hello -n 8 --json --temperature 0.8 --seed 7");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_LE(j["completion_tokens"].get<int>(), 8);
  // Same seed, same output.
  RunResult again = RunKvserve("--log-level off -m " + path +
                        " generate -p hello -n 8 --json --temperature 0.8 --seed 7");
  EXPECT_EQ(LastLine(again.out), LastLine(r.out));
}

TEST(CliTest, MissingModelFileIsAClearError) {
  RunResult r = RunKvserve("-m /nonexistent/x.gguf generate -p hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("/nonexistent/x.gguf"));
}

TEST(CliTest, CorruptModelFileIsRejectedNotCrashed) {
  const std::string path = testing::TempDir() + "/corrupt.gguf";
  std::string bytes = testing::MakeTinyLlamaGguf({});
  bytes.resize(bytes.size() / 3);  // truncated mid-file
  std::ofstream(path, std::ios::binary) << bytes;
  RunResult r = RunKvserve("-m " + path + " generate -p hi");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("error"));
}

TEST(CliTest, InvalidSamplingIsNamed) {
  const std::string path = testing::TempDir() + "/cli-tiny2.gguf";
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf({});
  RunResult r = RunKvserve("--log-level off -m " + path + " generate -p hi --top-p 1.5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("top_p"));
}

TEST(CliTest, GenerateTakesTheKvPolicyFlags) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  const std::string base = "--log-level off -t 2 -m " + model + " generate -p 'Once upon a time' ";
  RunResult r = RunKvserve(base + "-n 48 --json --kv-policy sinks --kv-sinks 2 --kv-window 16");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_EQ(j["completion_tokens"].get<int>(), 48);
  EXPECT_EQ(j["finish_reason"].get<std::string>(), "length");
  ASSERT_TRUE(j.contains("dropped_tokens")) << r.out;
  // The prompt and 48 tokens pass 2 sinks + a window of 16: some were
  // dropped, never more than the sequence held.
  EXPECT_GT(j["dropped_tokens"].get<int>(), 0) << r.out;
  EXPECT_LE(j["dropped_tokens"].get<int>(), 48 + 6) << r.out;
  // Without a policy the JSON is as it always was.
  r = RunKvserve(base + "-n 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_FALSE(nlohmann::json::parse(LastLine(r.out)).contains("dropped_tokens")) << r.out;

  r = RunKvserve(base + "--kv-policy bogus");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("--kv-policy"));
  r = RunKvserve(base + "--kv-policy h2o --kv-window 16 --kv-budget 10");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("--kv-budget"));
  r = RunKvserve(base + "--kv-policy window");  // 256 > stories260K's 128
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("context length"));
}

}  // namespace
}  // namespace kvserve
