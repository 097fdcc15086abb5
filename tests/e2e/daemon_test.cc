// The daemon as an operator runs it: graceful drain on SIGTERM, settings
// from the environment and from a config file, readable --help.
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<testing::Daemon> StartStories(const std::vector<std::string>& serve_args) {
  return testing::StartServe(KVSERVE_BINARY, testing::Stories260KPath(), "info", serve_args, {},
                             /*threads=*/2);
}

TEST(DaemonTest, SigtermDrainsInFlightRequestsAndExitsZero) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  // One sequence at a time and a short drain: accepted requests finish or
  // end with a clean cancellation; none may hang or break.
  auto d = StartStories({"--max-seqs", "1", "--drain-timeout", "0.05"});
  ASSERT_TRUE(d);
  constexpr int kRequests = 24;
  std::atomic<int> completed{0}, cancelled{0}, refused{0}, broken{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; ++i) {
    clients.emplace_back([&, i] {
      httplib::Client cli("127.0.0.1", d->http_port());
      cli.set_read_timeout(60);
      nlohmann::json body = {{"prompt", "Once upon a time"}, {"max_tokens", 100},
                             {"temperature", 0},          {"ignore_eos", true},
                             {"seed", i}};
      auto res = cli.Post("/v1/completions", body.dump(), "application/json");
      if (!res) {
        ++refused;  // connection closed before the request was accepted
        return;
      }
      if (res->status == 503) {
        ++refused;
        return;
      }
      auto j = nlohmann::json::parse(res->body, nullptr, false);
      if (res->status != 200 || j.is_discarded()) {
        ++broken;
        return;
      }
      const std::string reason = j["choices"][0]["finish_reason"];
      if (reason == "length") {
        ++completed;
      } else if (reason == "cancelled") {
        ++cancelled;
      } else {
        ++broken;
      }
    });
  }
  // Signal once requests are queued behind the running one, so the drain
  // deadline really cuts some short (no reliance on timing).
  httplib::Client metrics("127.0.0.1", d->http_port());
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    auto res = metrics.Get("/metrics");
    ASSERT_TRUE(res);
    const size_t at = res->body.find("\nkvserve:num_requests_waiting{");
    ASSERT_NE(at, std::string::npos);
    const size_t value = res->body.find("} ", at) + 2;
    if (std::stod(res->body.substr(value)) >= 5) break;
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "requests never queued";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const int exit_code = d->StopWith(SIGTERM, 30);
  for (auto& t : clients) t.join();
  EXPECT_EQ(exit_code, 0) << d->Log();
  EXPECT_EQ(broken.load(), 0);
  EXPECT_EQ(completed + cancelled + refused, kRequests);
  EXPECT_GT(cancelled.load() + refused.load(), 0)
      << "the drain timeout should have cut queued requests short; completed " << completed
      << ", cancelled " << cancelled << ", refused " << refused;
  EXPECT_THAT(d->Log(), HasSubstr("draining"));
}

TEST(DaemonTest, SettingsComeFromEnvironmentAndConfigFile) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto model_id = [](const testing::Daemon& d) {
    httplib::Client cli("127.0.0.1", d.http_port());
    auto res = cli.Get("/v1/models");
    if (!res) return std::string("no response");
    return nlohmann::json::parse(res->body)["data"][0]["id"].get<std::string>();
  };
  setenv("KVSERVE_SERVED_MODEL_NAME", "from-env", 1);
  {
    auto d = StartStories({});
    ASSERT_TRUE(d);
    EXPECT_EQ(model_id(*d), "from-env");
    EXPECT_THAT(d->Log(), HasSubstr("served-model-name"));  // effective configuration logged
  }
  unsetenv("KVSERVE_SERVED_MODEL_NAME");
  const std::string cfg = testing::TempDir() + "/kvserve.toml";
  std::ofstream(cfg) << "[serve]\nserved-model-name = \"from-file\"\n";
  auto d = testing::Daemon::Start(
      KVSERVE_BINARY, {"--config", cfg, "--log-level", "warn", "-m", testing::Stories260KPath()}, {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(model_id(**d), "from-file");
}

TEST(DaemonTest, HelpListsTheSubcommandsAndBadFlagsFailClearly) {
  const std::string help_cmd = std::string(KVSERVE_BINARY) + " --help 2>&1";
  const testing::CommandResult help = testing::RunCommand(help_cmd);
  EXPECT_EQ(help.exit_code, 0);
  const std::string& out = help.out;
  for (const char* sub : {"serve", "generate", "perplexity", "bench", "loadtest", "plan", "info"}) {
    EXPECT_THAT(out, HasSubstr(sub));
  }
  auto d = testing::Daemon::Start(KVSERVE_BINARY, {"-m", "/nonexistent.gguf"}, {});
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("/nonexistent.gguf"));
}

// The --kv-* defaults are checked before the daemon serves: a bad one stops
// start-up with a message naming the flag (and a non-zero exit).
TEST(DaemonTest, BadKvPolicyDefaultsStopStartUpNamingTheFlag) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  struct Case {
    std::vector<std::string> flags;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{"--kv-policy", "bogus"}, "--kv-policy: unknown policy 'bogus'"},
      {{"--kv-policy", "h2o", "--kv-window", "16", "--kv-budget", "8"}, "--kv-budget"},
      {{"--kv-window", "0"}, "--kv-window"},
      // stories260K keeps 128 tokens: 4 sinks + 256 recent cannot fit.
      {{"--kv-policy", "sinks"}, "--kv-policy sinks"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags[0] + " " + c.flags[1]);
    auto d = testing::Daemon::Start(KVSERVE_BINARY, {"--log-level", "warn", "-m", model}, c.flags);
    ASSERT_FALSE(d.ok());
    EXPECT_THAT(std::string(d.status().message()), HasSubstr(c.message));
  }
  // The exit status, seen directly.
  const testing::CommandResult run =
      testing::RunCommand(std::string(KVSERVE_BINARY) + " --log-level warn -m " + model +
                          " serve --grpc-address 127.0.0.1:0 --http-port 0 --kv-policy bogus 2>&1");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.out, HasSubstr("--kv-policy"));
  // A default that fits serves.
  auto ok = testing::Daemon::Start(KVSERVE_BINARY, {"--log-level", "warn", "-m", model},
                                   {"--kv-policy", "sinks", "--kv-window", "32"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->StopWith(SIGTERM, 30), 0) << (*ok)->Log();
}

// `kvserve plan` and `kvserve bench` take the --kv-* defaults: the plan
// counts the blocks a sequence holds under the policy, and the bench runs
// its sequences with it and reports the blocks they held while decoding.
TEST(DaemonTest, PlanAndBenchCountTheKvPolicy) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  const std::string bin = std::string(KVSERVE_BINARY) + " --log-level warn -m " + model;
  const testing::CommandResult plain =
      testing::RunCommand(bin + " plan --kv-cache-memory 1MiB --block-size 16 2>&1");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_THAT(plain.out, Not(HasSubstr("kv policy")));
  const testing::CommandResult plan = testing::RunCommand(
      bin + " plan --kv-cache-memory 1MiB --block-size 16 --kv-policy window --kv-window 32 2>&1");
  ASSERT_EQ(plan.exit_code, 0) << plan.out;
  // 32 tokens kept: 2 blocks + 1 of slack, against 128 / 16 = 8 at full context.
  EXPECT_THAT(plan.out, HasSubstr("window: keeps at most 32 tokens"));
  EXPECT_THAT(plan.out, HasSubstr("blocks per seq  3 at 128 tokens of context (8 without"));
  const testing::CommandResult bench = testing::RunCommand(
      bin + " bench -b 2 --prompt-tokens 96 --gen-tokens 24 --block-size 16 "
            "--kv-policy window --kv-window 32 2>&1");
  ASSERT_EQ(bench.exit_code, 0) << bench.out;
  EXPECT_THAT(bench.out, HasSubstr("kv policy: window (keeps at most 32 tokens)"));
  // The last cell: blocks per sequence while decoding, at most 3 (not 8).
  const size_t row = bench.out.find("|     2 |");
  ASSERT_NE(row, std::string::npos) << bench.out;
  const std::string line = bench.out.substr(row, bench.out.find('\n', row) - row);
  const size_t last = line.find_last_of('|', line.size() - 2);
  const double peak = std::stod(line.substr(last + 1));
  EXPECT_GT(peak, 0) << line;
  EXPECT_LE(peak, 3.0) << line;
  const testing::CommandResult bad =
      testing::RunCommand(
          bin + " bench -b 1 --prompt-tokens 32 --gen-tokens 8 --kv-policy bogus 2>&1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.out, HasSubstr("--kv-policy"));
}

// `kvserve bench --bandwidth`: the bytes one decode step reads (weights
// plus the K and V the step attends to), their rate, and the host's read
// bandwidth measured after the run. The KV term follows the attended
// context: an eviction budget of 32 tokens reads 32 slots a step where the
// full cache reads the whole context.
TEST(DaemonTest, BenchBandwidthCountsWeightsAndAttendedKv) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  const std::string bin = std::string(KVSERVE_BINARY) + " --log-level warn -m " + model +
                          " bench -b 1 --prompt-tokens 96 --gen-tokens 24 --repeat 1 "
                          "--kv-cache-dtype f32 --block-size 16 --bandwidth";
  // The row's cells after "| 1 |".
  auto cells = [](const std::string& out) {
    std::vector<double> v;
    const size_t row = out.find("|     1 |");
    if (row == std::string::npos) return v;
    std::stringstream line(out.substr(row + 1, out.find('\n', row) - row - 1));
    std::string cell;
    while (std::getline(line, cell, '|')) v.push_back(std::strtod(cell.c_str(), nullptr));
    return v;
  };
  const testing::CommandResult full = testing::RunCommand(bin + " 2>&1");
  ASSERT_EQ(full.exit_code, 0) << full.out;
  EXPECT_THAT(full.out, HasSubstr("| MB read/step | decode GB/s | read GB/s | decode / read |"));
  const std::vector<double> f = cells(full.out);
  ASSERT_EQ(f.size(), 11u) << full.out;
  const testing::CommandResult windowed =
      testing::RunCommand(bin + " --kv-policy window --kv-window 32 2>&1");
  ASSERT_EQ(windowed.exit_code, 0) << windowed.out;
  const std::vector<double> w = cells(windowed.out);
  ASSERT_EQ(w.size(), 11u) << windowed.out;
  // stories260K: 1,280 bytes of f32 K and V per token over its 5 layers.
  // Full cache: the step that writes slot 96 + i attends 97 + i slots, i =
  // 0..22 (the prefill samples the first of the 24 tokens): 108 on average.
  // The window's policy keeps at most 32.
  const double kv_full = 108 * 1280 / 1e6, kv_window = 32 * 1280 / 1e6;
  EXPECT_NEAR(f[7] - w[7], kv_full - kv_window, 0.002) << full.out << windowed.out;
  // The rest is the weights, ~1.0 MiB (`kvserve info`: "weights read").
  EXPECT_NEAR(w[7] - kv_window, 1.05, 0.06) << windowed.out;
  // decode GB/s = decode tok/s x MB per step at batch 1 (one run).
  EXPECT_NEAR(f[8], f[4] * f[7] / 1000, 0.02 * f[8] + 0.01) << full.out;
  // A real read measurement, not a placeholder.
  EXPECT_GT(f[9], 0.1) << full.out;
  EXPECT_NEAR(f[10], 100 * f[8] / f[9], 0.2 + 0.01 * f[10]) << full.out;
}

// Past --max-queued waiting requests, new ones are refused at once (429 over
// HTTP) and the ones already accepted still complete.
TEST(DaemonTest, BackPressureRefusesPastMaxQueuedAndKeepsServing) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartStories({"--max-seqs", "1", "--max-queued", "1"});
  ASSERT_TRUE(d);
  std::atomic<int> ok{0}, too_many{0}, other{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < 16; ++i) {
    clients.emplace_back([&] {
      httplib::Client cli("127.0.0.1", d->http_port());
      cli.set_read_timeout(60);
      nlohmann::json body = {{"prompt", "Once upon a time"}, {"max_tokens", 100},
                             {"temperature", 0}, {"ignore_eos", true}};
      auto res = cli.Post("/v1/completions", body.dump(), "application/json");
      if (res && res->status == 200) {
        ++ok;
      } else if (res && res->status == 429) {
        ++too_many;
        EXPECT_THAT(res->body, HasSubstr("queued"));
      } else {
        ++other;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_GT(too_many.load(), 0);
  EXPECT_EQ(other.load(), 0);
  httplib::Client cli("127.0.0.1", d->http_port());
  auto res = cli.Post("/v1/completions", R"({"prompt": "Tom", "max_tokens": 4})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << "still serving after the burst";
}

TEST(DaemonTest, ApiKeyFromAFileIsRequired) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string key_file = testing::TempDir() + "/api.key";
  std::ofstream(key_file) << "s3cret\n";
  auto d = StartStories({"--api-key-file", key_file});
  ASSERT_TRUE(d);
  httplib::Client cli("127.0.0.1", d->http_port());
  const std::string body = R"({"prompt": "Tom", "max_tokens": 4})";
  auto res = cli.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  res = cli.Post("/v1/completions", httplib::Headers{{"Authorization", "Bearer s3cret"}}, body,
                 "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  res = cli.Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_THAT(d->Log(), ::testing::Not(HasSubstr("s3cret")));
}

// The chat path end to end on the default model: HTTP chat completions and
// kvserve-cli's gRPC Chat both apply SmolLM2's ChatML template.
TEST(DaemonTest, SmolLM2AnswersAChatQuestionOverHttpAndGrpc) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2 (run deploy/setup.sh)");
  auto d = testing::Daemon::Start(KVSERVE_BINARY, {"--log-level", "warn", "-t", "2", "-m", model},
                                  {"--served-model-name", "smol"});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string question = "What is the capital of France? Answer in one sentence.";
  httplib::Client cli("127.0.0.1", (*d)->http_port());
  cli.set_read_timeout(60);
  nlohmann::json body = {{"model", "smol"},
                         {"messages", {{{"role", "user"}, {"content", question}}}},
                         {"temperature", 0},
                         {"max_tokens", 40}};
  auto res = cli.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  auto j = nlohmann::json::parse(res->body);
  EXPECT_THAT(j["choices"][0]["message"]["content"].get<std::string>(), HasSubstr("Paris"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");

  const std::string cmd = std::string(KVSERVE_CLI_BINARY) + " --address 127.0.0.1:" +
                          std::to_string((*d)->grpc_port()) + " chat --temperature 0 -p '" +
                          question + "' 2>&1";
  const testing::CommandResult chat = testing::RunCommand(cmd);
  const std::string& out = chat.out;
  EXPECT_EQ(chat.exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("Paris"));
}

}  // namespace
}  // namespace kvserve
