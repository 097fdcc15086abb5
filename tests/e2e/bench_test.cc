// End-to-end tests of kvserve-bench: the real binary against a live kvserve
// (HTTP and gRPC) and against a fake OpenAI server that injects errors and
// delays, so the measurements can be checked against known truth.
#include <sys/wait.h>

#include <algorithm>
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

// A latency distribution as the summary reports it: `count` samples, and
// quantiles that can only grow from p50 to max. Every request over a socket
// takes time, so a distribution of them is positive (a zero is a clock or
// bookkeeping bug); gaps between tokens may be zero (`all_positive`
// false): tokens that arrive in one read share a timestamp, and a short
// reply from a fast model (stories260K, 4 tokens) can arrive whole in one
// read, so even the largest gap may be zero (seen once in a full suite run
// after decode got faster); they must not be negative.
void ExpectSaneDistribution(const json& d, long count, const std::string& name,
                            bool all_positive = true) {
  SCOPED_TRACE(name);
  EXPECT_EQ(d["count"].get<long>(), count);
  if (count == 0) return;
  if (all_positive) {
    EXPECT_GT(d["p50"].get<double>(), 0);
    EXPECT_GT(d["max"].get<double>(), 0);
    EXPECT_GT(d["mean"].get<double>(), 0);
  } else {
    EXPECT_GE(d["p50"].get<double>(), 0);
    EXPECT_GE(d["mean"].get<double>(), 0);
  }
  EXPECT_LE(d["p50"].get<double>(), d["p90"].get<double>());
  EXPECT_LE(d["p90"].get<double>(), d["p95"].get<double>());
  EXPECT_LE(d["p95"].get<double>(), d["p99"].get<double>());
  EXPECT_LE(d["p99"].get<double>(), d["max"].get<double>());
  EXPECT_LE(d["mean"].get<double>(), d["max"].get<double>() * (1 + 1e-12));
}

// The summary of a run agrees with its measured (non-warm-up) records:
// counts, token sums, the distributions' sample counts and maxima, and the
// per-request timing relations (first token before the end; the gaps
// between tokens fit between them; TPOT from e2e and TTFT).
void ExpectSummaryMatchesRecords(const json& run) {
  const json& s = run["summary"];
  long completed = 0, failed = 0, output_tokens = 0, with_ttft = 0, with_tpot = 0, gaps = 0;
  double max_e2e = 0, max_ttft = 0;
  for (const json& r : run["requests"]) {
    if (r["warmup"].get<bool>()) continue;
    if (!r["ok"].get<bool>()) {
      ++failed;
      EXPECT_FALSE(r["error"].get<std::string>().empty()) << r.dump();
      continue;
    }
    ++completed;
    output_tokens += r["output_tokens"].get<long>();
    const double e2e = r["e2e_ms"].get<double>();
    EXPECT_GT(e2e, 0) << r.dump();
    max_e2e = std::max(max_e2e, e2e);
    gaps += static_cast<long>(r["itl_ms"].size());
    double itl_sum = 0;
    for (const json& g : r["itl_ms"]) {
      EXPECT_GE(g.get<double>(), 0) << r.dump();
      itl_sum += g.get<double>();
    }
    if (r["ttft_ms"].is_number()) {
      ++with_ttft;
      const double ttft = r["ttft_ms"].get<double>();
      max_ttft = std::max(max_ttft, ttft);
      EXPECT_GT(ttft, 0) << r.dump();
      EXPECT_LE(ttft, e2e) << r.dump();
      // The gaps run from the first token to the last, inside [ttft, e2e].
      EXPECT_LE(itl_sum, e2e - ttft + 1e-6) << r.dump();
    }
    if (r["tpot_ms"].is_number()) {
      ++with_tpot;
      const int out = r["output_tokens"].get<int>();
      ASSERT_GT(out, 1) << r.dump();
      EXPECT_NEAR(r["tpot_ms"].get<double>(), (e2e - r["ttft_ms"].get<double>()) / (out - 1), 1e-6)
          << r.dump();
    }
  }
  EXPECT_EQ(s["completed"].get<long>(), completed);
  EXPECT_EQ(s["failed"].get<long>(), failed);
  long errors = 0;
  for (const auto& [k, v] : s["errors"].items()) errors += v.get<long>();
  EXPECT_EQ(errors, failed);
  EXPECT_EQ(s["output_tokens"].get<long>(), output_tokens);
  EXPECT_LE(s["good_requests"].get<long>(), completed);
  ExpectSaneDistribution(s["e2e_ms"], completed, "e2e_ms");
  ExpectSaneDistribution(s["ttft_ms"], with_ttft, "ttft_ms");
  ExpectSaneDistribution(s["tpot_ms"], with_tpot, "tpot_ms");
  ExpectSaneDistribution(s["itl_ms"], gaps, "itl_ms", /*all_positive=*/false);
  if (completed > 0) EXPECT_DOUBLE_EQ(s["e2e_ms"]["max"].get<double>(), max_e2e);
  if (with_ttft > 0) EXPECT_DOUBLE_EQ(s["ttft_ms"]["max"].get<double>(), max_ttft);
  // The run lasts at least as long as its longest request; throughput is
  // completions over that duration.
  const double duration_s = s["duration_s"].get<double>();
  EXPECT_GE(duration_s * 1e3, max_e2e - 1e-6);
  if (duration_s > 0) {
    EXPECT_NEAR(s["request_throughput"].get<double>() * duration_s, completed, 1e-6 * (1 + completed));
    EXPECT_NEAR(s["output_token_throughput"].get<double>() * duration_s, output_tokens,
                1e-6 * (1 + output_tokens));
  }
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
    ExpectSummaryMatchesRecords(run);
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
  // A scrape that fails or lacks the sample is a test failure (and -1).
  static long GenerationTokens() {
    httplib::Client cli("127.0.0.1", daemon_->http_port());
    auto res = cli.Get("/metrics");
    if (!res || res->status != 200) {
      ADD_FAILURE() << "GET /metrics did not answer 200";
      return -1;
    }
    std::smatch m;
    static const std::regex re(R"(kvserve:generation_tokens_total\{[^}]*\} (\d+))");
    if (!std::regex_search(res->body, m, re)) {
      ADD_FAILURE() << "/metrics has no kvserve:generation_tokens_total";
      return -1;
    }
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
  for (const json& run : j["runs"]) {
    EXPECT_EQ(run["summary"]["completed"], 10);
    // No SLO given: every completed request is good.
    EXPECT_EQ(run["summary"]["good_requests"], 10);
  }
  // A sweep runs its loads in the order given.
  EXPECT_EQ(j["runs"][0]["load"]["value"].get<double>(), 1);
  EXPECT_EQ(j["runs"][1]["load"]["value"].get<double>(), 3);
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
// first_token_delay, then stream kTokens chunks kGap apart, then usage.
// The delays are floors on what a client can measure (the server cannot
// answer sooner), never ceilings: the machine may add any amount.
class FakeOpenAiServer {
 public:
  static constexpr auto kFirstTokenDelay = std::chrono::milliseconds(150);
  static constexpr auto kGap = std::chrono::milliseconds(20);
  static constexpr int kTokens = 5;

  explicit FakeOpenAiServer(std::chrono::milliseconds first_token_delay = kFirstTokenDelay)
      : first_token_delay_(first_token_delay) {
    server_.Post("/v1/completions", [this](const httplib::Request&, httplib::Response& res) {
      if (++requests_ % 4 == 0) {
        res.status = 500;
        res.set_content(R"({"error": {"message": "injected"}})", "application/json");
        return;
      }
      const auto first_token_delay = first_token_delay_;
      res.set_chunked_content_provider("text/event-stream", [first_token_delay](
                                                                size_t, httplib::DataSink& sink) {
        std::this_thread::sleep_for(first_token_delay);
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
  const std::chrono::milliseconds first_token_delay_;
  httplib::Server server_;
  std::atomic<int> requests_{0};
  int port_ = 0;
  std::thread thread_;
};

// Needs no model: the fake server stands in for one.
TEST(BenchFakeServerTest, ErrorsAndDelaysComeOutAsInjected) {
  FakeOpenAiServer fake;
  const std::string json_path = TempPath("fake.json");
  // An SLO below the injected first-token delay: no request can meet it.
  BenchOutput b =
      RunBench({"--url", "http://127.0.0.1:" + std::to_string(fake.port()), "--num-prompts", "16",
                "--input-len", "8", "--output-len", "5", "--concurrency", "4", "--slo-ttft-ms",
                "100", "--json-out", json_path});
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(fake.requests(), 16);
  const json j = ReadJson(json_path);
  ExpectValidSchema(j);
  const json& s = j["runs"][0]["summary"];
  EXPECT_EQ(s["completed"], 12);
  EXPECT_EQ(s["failed"], 4);
  EXPECT_EQ(s["errors"]["http_500"], 4);
  EXPECT_EQ(s["output_tokens"], 12 * FakeOpenAiServer::kTokens);
  EXPECT_EQ(s["good_requests"], 0) << "a TTFT SLO of 100 ms against a 150 ms first token";
  EXPECT_EQ(s["goodput"].get<double>(), 0);
  // Every success has a first token, a TPOT and kTokens - 1 gaps; the
  // failures have none.
  EXPECT_EQ(s["ttft_ms"]["count"], 12);
  EXPECT_EQ(s["tpot_ms"]["count"], 12);
  EXPECT_EQ(s["e2e_ms"]["count"], 12);
  EXPECT_EQ(s["itl_ms"]["count"], 12 * (FakeOpenAiServer::kTokens - 1));
  // The injected delays are floors (the server cannot answer sooner), so
  // these hold however slow the machine is; no upper bound is asserted.
  const double first_ms = FakeOpenAiServer::kFirstTokenDelay.count();
  const double stream_ms = first_ms + (FakeOpenAiServer::kTokens - 1) * FakeOpenAiServer::kGap.count();
  int ok = 0;
  for (const json& r : j["runs"][0]["requests"]) {
    if (r["ok"].get<bool>()) {
      ++ok;
      EXPECT_EQ(r["itl_ms"].size(), 4u);
      EXPECT_EQ(r["output_tokens"], FakeOpenAiServer::kTokens);
      EXPECT_EQ(r["chunks"], FakeOpenAiServer::kTokens);
      EXPECT_GE(r["ttft_ms"].get<double>(), first_ms) << r.dump();
      EXPECT_GE(r["e2e_ms"].get<double>(), stream_ms) << r.dump();
    } else {
      EXPECT_EQ(r["error"], "http_500") << r.dump();
      EXPECT_TRUE(r["ttft_ms"].is_null()) << r.dump();
      EXPECT_EQ(r["chunks"], 0) << r.dump();
    }
  }
  EXPECT_EQ(ok, 12);
  EXPECT_GE(s["ttft_ms"]["p50"].get<double>(), first_ms);
  EXPECT_GE(s["e2e_ms"]["p50"].get<double>(), stream_ms);
  std::filesystem::remove(json_path);
}

TEST(BenchFakeServerTest, SlowFirstTokenIsATimeout) {
  // The first token comes after 1 s at the earliest; a 50 ms timeout cuts
  // every stream (the wide gap keeps a busy machine from blurring them).
  FakeOpenAiServer fake(std::chrono::milliseconds(1000));
  const std::string json_path = TempPath("slow.json");
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
