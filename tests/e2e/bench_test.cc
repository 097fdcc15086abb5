// End-to-end tests of kvserve-bench: the real binary against a live kvserve
// (HTTP and gRPC) and against a fake OpenAI server that injects errors and
// delays, so the measurements can be checked against known truth.
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using nlohmann::json;

struct BenchOutput {
  int exit_code = -1;
  std::string out;
};

// Runs kvserve-bench with `args`; stdout is captured, stderr discarded.
BenchOutput RunBench(const std::vector<std::string>& args) {
  std::string cmd = KVSERVE_BENCH_BINARY;
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " -q 2>/dev/null";
  const testing::CommandResult run = testing::RunCommand(cmd);
  return BenchOutput{run.exit_code, run.out};
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvserve_bench_" + std::to_string(getpid()) + "_" + name))
      .string();
}

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// The schema client/README.md "kvserve-bench" documents: required keys and types.
void ExpectValidSchema(const json& j) {
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.value("schema", ""), "kvserve-bench/1");
  ASSERT_TRUE(j.contains("config") && j["config"].is_object());
  for (const char* k : {"targets", "api", "workload", "seed", "input_len", "output_len"}) {
    EXPECT_TRUE(j["config"].contains(k)) << k;
  }
  ASSERT_TRUE(j.contains("runs") && j["runs"].is_array());
  for (const json& run : j["runs"]) {
    ASSERT_TRUE(run["target"].is_string());
    ASSERT_TRUE(run["load"]["mode"].is_string());
    ASSERT_TRUE(run["load"]["value"].is_number());
    const json& s = run["summary"];
    for (const char* k : {"completed", "failed", "prompt_tokens", "output_tokens", "cached_tokens",
                          "good_requests"}) {
      EXPECT_TRUE(s[k].is_number_integer()) << k;
    }
    EXPECT_TRUE(s["errors"].is_object());
    for (const char* k : {"duration_s", "request_throughput", "output_token_throughput",
                          "total_token_throughput", "goodput"}) {
      EXPECT_TRUE(s[k].is_number()) << k;
    }
    for (const char* d : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}) {
      for (const char* k : {"count", "mean", "p50", "p90", "p95", "p99", "max"}) {
        EXPECT_TRUE(s[d][k].is_number()) << d << "." << k;
      }
    }
    ASSERT_TRUE(run["requests"].is_array());
    for (const json& r : run["requests"]) {
      for (const char* k : {"id", "conversation", "turn", "prompt_tokens", "output_tokens",
                            "cached_tokens", "chunks"}) {
        EXPECT_TRUE(r[k].is_number_integer()) << k;
      }
      EXPECT_TRUE(r["ok"].is_boolean());
      EXPECT_TRUE(r["warmup"].is_boolean());
      EXPECT_TRUE(r["error"].is_string());
      EXPECT_TRUE(r["start_s"].is_number());
      EXPECT_TRUE(r["e2e_ms"].is_number());
      EXPECT_TRUE(r["ttft_ms"].is_number() || r["ttft_ms"].is_null());
      EXPECT_TRUE(r["tpot_ms"].is_number() || r["tpot_ms"].is_null());
      EXPECT_TRUE(r["itl_ms"].is_array());
    }
  }
}

class BenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (testing::Stories260KPath().empty()) return;
    auto d = testing::Daemon::Start(KVSERVE_BINARY,
                                    {"--log-level", "warn", "-m", testing::Stories260KPath()}, {});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    if (testing::Stories260KPath().empty()) GTEST_SKIP() << "stories260K not found";
    ASSERT_NE(daemon_, nullptr);
  }

  static std::string Url() { return "http://127.0.0.1:" + std::to_string(daemon_->http_port()); }
  static std::string GrpcAddress() { return "127.0.0.1:" + std::to_string(daemon_->grpc_port()); }

  // kvserve:generation_tokens_total from /metrics: the server's own count.
  static long GenerationTokens() {
    httplib::Client cli("127.0.0.1", daemon_->http_port());
    auto res = cli.Get("/metrics");
    if (!res || res->status != 200) return -1;
    std::smatch m;
    static const std::regex re(R"(kvserve:generation_tokens_total\{[^}]*\} (\d+))");
    if (!std::regex_search(res->body, m, re)) return -1;
    return std::stol(m[1]);
  }

  // Checks per-request facts and that the tokens of all records (warm-up
  // included) equal what the server counted.
  static void ExpectMatchesServer(const json& j, long server_tokens, int expected_requests,
                                  int output_len) {
    long tokens = 0;
    int measured = 0;
    for (const json& run : j["runs"]) {
      EXPECT_EQ(run["summary"]["failed"], 0);
      for (const json& r : run["requests"]) {
        ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
        if (!r["warmup"].get<bool>()) ++measured;
        EXPECT_LE(r["ttft_ms"].get<double>(), r["e2e_ms"].get<double>());
        EXPECT_GT(r["prompt_tokens"].get<int>(), 0);
        // ignore_eos makes every output exactly max_tokens long.
        EXPECT_EQ(r["output_tokens"].get<int>(), output_len);
        tokens += r["output_tokens"].get<int>();
      }
    }
    EXPECT_EQ(measured, expected_requests);
    EXPECT_EQ(tokens, server_tokens);
  }

  static testing::Daemon* daemon_;
};

testing::Daemon* BenchTest::daemon_ = nullptr;

TEST_F(BenchTest, HttpSweepCountsMatchServer) {
  const std::string json_path = TempPath("http.json"), html_path = TempPath("http.html");
  const long before = GenerationTokens();
  BenchOutput b = RunBench({"--url", Url(), "--num-prompts", "10", "--input-len", "uniform:8:24",
                            "--output-len", "8", "--concurrency", "1,3", "--warmup", "2", "--seed",
                            "7", "--json-out", json_path, "--html-out", html_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_NE(b.out.find("TTFT"), std::string::npos);
  const long after = GenerationTokens();
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const json& run : j["runs"]) EXPECT_EQ(run["summary"]["completed"], 10);
  // Warm-up records are not in the runs; the server saw them, so add them.
  ExpectMatchesServer(j, after - before - 2 * 8, 20, 8);

  std::ifstream html(html_path);
  std::string page((std::istreambuf_iterator<char>(html)), std::istreambuf_iterator<char>());
  EXPECT_NE(page.find("<svg"), std::string::npos);
  EXPECT_NE(page.find("Latency vs load"), std::string::npos);  // a sweep
  EXPECT_EQ(page.find("http://www.w3.org/1999/xhtml\" src"), std::string::npos);
  EXPECT_EQ(page.find("<script src"), std::string::npos);  // self-contained
  std::filesystem::remove(json_path);
  std::filesystem::remove(html_path);
}

TEST_F(BenchTest, GrpcOpenLoopUsesServerTokenizer) {
  const std::string json_path = TempPath("grpc.json");
  const long before = GenerationTokens();
  BenchOutput b =
      RunBench({"--grpc", GrpcAddress(), "--num-prompts", "12", "--input-len", "20", "--output-len",
                "6", "--rate", "100", "--arrival", "constant", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  const long after = GenerationTokens();
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  ASSERT_EQ(j["runs"].size(), 1u);
  EXPECT_EQ(j["runs"][0]["summary"]["completed"], 12);
  EXPECT_TRUE(j["config"]["exact_lengths"].get<bool>());
  ExpectMatchesServer(j, after - before, 12, 6);
  for (const json& r : j["runs"][0]["requests"]) {
    // Word-level bisection may overshoot by a multi-token word, no more.
    EXPECT_GE(r["prompt_tokens"].get<int>(), 20);
    EXPECT_LE(r["prompt_tokens"].get<int>(), 23);
  }
  std::filesystem::remove(json_path);
}

TEST_F(BenchTest, MultiTurnHistoryGrowsAndSeedReproduces) {
  const std::string a = TempPath("mt_a.json"), c = TempPath("mt_c.json");
  const std::vector<std::string> args = {
      "--url",       Url(), "--workload",   "multi-turn", "--num-prompts", "2", "--turns", "3",
      "--input-len", "8",   "--output-len", "4",          "--concurrency", "2", "--seed",  "3"};
  std::vector<std::string> args_a = args, args_c = args;
  args_a.insert(args_a.end(), {"--json-out", a});
  args_c.insert(args_c.end(), {"--json-out", c});
  ASSERT_EQ(RunBench(args_a).exit_code, 0);
  ASSERT_EQ(RunBench(args_c).exit_code, 0);
  const json ja = ReadJson(a), jc = ReadJson(c);
  ExpectValidSchema(ja);
  std::map<std::pair<int, int>, int> prompt;  // (conversation, turn) -> tokens
  for (const json& r : ja["runs"][0]["requests"]) {
    ASSERT_TRUE(r["ok"].get<bool>());
    prompt[{r["conversation"], r["turn"]}] = r["prompt_tokens"];
  }
  ASSERT_EQ(prompt.size(), 6u);
  for (int conv = 0; conv < 2; ++conv) {
    const int t0 = prompt[std::make_pair(conv, 0)], t1 = prompt[std::make_pair(conv, 1)],
              t2 = prompt[std::make_pair(conv, 2)];
    EXPECT_GT(t1, t0 + 4);  // history: the last prompt, its reply, the new turn
    EXPECT_GT(t2, t1 + 4);
  }
  // Same seed, same prompts: the server counts the same prompt tokens.
  EXPECT_EQ(ja["runs"][0]["summary"]["prompt_tokens"], jc["runs"][0]["summary"]["prompt_tokens"]);
  std::filesystem::remove(a);
  std::filesystem::remove(c);
}

TEST_F(BenchTest, CompareRunsBothTargetsInterleaved) {
  const std::string json_path = TempPath("cmp.json");
  BenchOutput b =
      RunBench({"--compare", Url(), "grpc://" + GrpcAddress(), "--num-prompts", "6", "--input-len",
                "12", "--output-len", "5", "--concurrency", "2", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_NE(b.out.find("B/A"), std::string::npos);
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["runs"][0]["summary"]["completed"], 6);
  EXPECT_EQ(j["runs"][1]["summary"]["completed"], 6);
  EXPECT_NE(j["runs"][0]["target"], j["runs"][1]["target"]);
  std::filesystem::remove(json_path);
}

TEST_F(BenchTest, PrefixCacheScenarioRunsBothWorkloads) {
  const std::string json_path = TempPath("scenario.json");
  BenchOutput b = RunBench({"--grpc", GrpcAddress(), "--scenario", "prefix-cache", "--num-prefixes",
                            "2", "--prefix-len", "16", "--questions-per-prefix", "3", "--input-len",
                            "4", "--output-len", "3", "--rate", "200", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_NE(j["runs"][0]["load"]["label"].get<std::string>().find("unique-prompts"),
            std::string::npos);
  EXPECT_NE(j["runs"][1]["load"]["label"].get<std::string>().find("shared-prefix"),
            std::string::npos);
  for (const json& run : j["runs"]) {
    EXPECT_EQ(run["summary"]["completed"], 6);
    EXPECT_EQ(run["summary"]["output_tokens"], 6 * 3);
  }
  std::filesystem::remove(json_path);
}

TEST_F(BenchTest, JsonlFileWorkload) {
  const std::string file = TempPath("prompts.jsonl"), json_path = TempPath("file.json");
  {
    std::ofstream f(file);
    f << R"({"prompt": "Once upon a time", "max_tokens": 3})" << '\n'
      << R"({"conversations": [{"from": "human", "value": "The cat sat"},)"
      << R"( {"from": "gpt", "value": "on the mat"}]})" << '\n'
      << R"({"prompt": "Lily went to the park", "max_tokens": 5})" << '\n';
  }
  BenchOutput b = RunBench({"--url", Url(), "--workload", "file", "--file", file, "--concurrency",
                            "2", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  const json j = ReadJson(json_path);
  EXPECT_EQ(j["runs"][0]["summary"]["completed"], 3);
  EXPECT_EQ(j["runs"][0]["summary"]["output_tokens"].get<int>(), 3 + 5 + 4);  // gpt reply: ~4
  std::filesystem::remove(file);
  std::filesystem::remove(json_path);
}

// A fake OpenAI server: every 4th request fails with 500; the others wait
// kFirstTokenDelay, then stream kTokens chunks kGap apart, then usage.
class FakeOpenAiServer {
 public:
  static constexpr auto kFirstTokenDelay = std::chrono::milliseconds(150);
  static constexpr auto kGap = std::chrono::milliseconds(20);
  static constexpr int kTokens = 5;

  FakeOpenAiServer() {
    server_.Post("/v1/completions", [this](const httplib::Request&, httplib::Response& res) {
      if (++requests_ % 4 == 0) {
        res.status = 500;
        res.set_content(R"({"error": {"message": "injected"}})", "application/json");
        return;
      }
      res.set_chunked_content_provider("text/event-stream", [](size_t, httplib::DataSink& sink) {
        std::this_thread::sleep_for(kFirstTokenDelay);
        for (int i = 0; i < kTokens; ++i) {
          if (i > 0) std::this_thread::sleep_for(kGap);
          const std::string ev = R"(data: {"choices": [{"index": 0, "text": "tok"}]})"
                                 "\n\n";
          sink.write(ev.data(), ev.size());
        }
        const std::string usage =
            "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 7, \"completion_tokens\": " +
            std::to_string(kTokens) + "}}\n\ndata: [DONE]\n\n";
        sink.write(usage.data(), usage.size());
        sink.done();
        return true;
      });
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    // bind_to_any_port already listens, so early connections just queue.
  }
  ~FakeOpenAiServer() {
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  int requests() const { return requests_; }

 private:
  httplib::Server server_;
  std::atomic<int> requests_{0};
  int port_ = 0;
  std::thread thread_;
};

// Needs no model: the fake server stands in for one.
TEST(BenchFakeServerTest, ErrorsAndDelaysComeOutAsInjected) {
  FakeOpenAiServer fake;
  const std::string json_path = TempPath("fake.json");
  BenchOutput b =
      RunBench({"--url", "http://127.0.0.1:" + std::to_string(fake.port()), "--num-prompts", "16",
                "--input-len", "8", "--output-len", "5", "--concurrency", "4", "--slo-ttft-ms",
                "5000", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(fake.requests(), 16);
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  const json& s = j["runs"][0]["summary"];
  EXPECT_EQ(s["completed"], 12);
  EXPECT_EQ(s["failed"], 4);
  EXPECT_EQ(s["errors"]["http_500"], 4);
  EXPECT_EQ(s["output_tokens"], 12 * FakeOpenAiServer::kTokens);
  EXPECT_EQ(s["good_requests"], 12);
  // Loose bounds: the injected delays are floors; scheduling adds a little.
  EXPECT_GE(s["ttft_ms"]["p50"].get<double>(), 145);
  EXPECT_LE(s["ttft_ms"]["p99"].get<double>(), 1000);
  EXPECT_GE(s["tpot_ms"]["p50"].get<double>(), 18);
  EXPECT_LE(s["tpot_ms"]["p50"].get<double>(), 200);
  EXPECT_GE(s["e2e_ms"]["p50"].get<double>(), 145 + 4 * 18);
  for (const json& r : j["runs"][0]["requests"]) {
    if (r["ok"].get<bool>()) {
      EXPECT_EQ(r["itl_ms"].size(), 4u);
    }
  }
  std::filesystem::remove(json_path);
}

TEST(BenchFakeServerTest, SlowFirstTokenIsATimeout) {
  FakeOpenAiServer fake;
  const std::string json_path = TempPath("slow.json");
  // The first token comes after 150 ms; a 50 ms timeout cuts every stream.
  BenchOutput b = RunBench({"--url", "http://127.0.0.1:" + std::to_string(fake.port()),
                            "--num-prompts", "8", "--input-len", "4", "--output-len", "5",
                            "--concurrency", "2", "--timeout", "0.05", "--json-out", json_path});
  EXPECT_EQ(b.exit_code, 1);  // nothing succeeded
  const json j = ReadJson(json_path);
  const json& errors = j["runs"][0]["summary"]["errors"];
  EXPECT_EQ(errors["http_500"], 2);
  EXPECT_EQ(errors["timeout"], 6);
  std::filesystem::remove(json_path);
}

TEST(BenchFakeServerTest, UnreachableServerIsAConnectionError) {
  const std::string json_path = TempPath("down.json");
  // Port 1 on loopback: nothing listens there.
  BenchOutput b = RunBench({"--url", "http://127.0.0.1:1", "--num-prompts", "3", "--input-len", "4",
                            "--output-len", "2", "--json-out", json_path});
  EXPECT_EQ(b.exit_code, 1);  // nothing succeeded
  const json j = ReadJson(json_path);
  EXPECT_EQ(j["runs"][0]["summary"]["errors"]["connection"], 3);
  std::filesystem::remove(json_path);
}

}  // namespace
}  // namespace kvserve
