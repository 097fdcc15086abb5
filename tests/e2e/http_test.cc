// The OpenAI-compatible HTTP API of the real daemon: `kvserve serve` runs as
// a child process on free loopback ports and is driven with httplib's client
// (and, when it is installed, the official `openai` Python client), as users
// drive it with curl and SDKs.
#include <httplib.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Starts `kvserve serve` on `model` (shared launcher: free loopback ports,
// port file); on failure returns null with the reason and log in *error.
std::unique_ptr<testing::Daemon> StartDaemon(const std::string& model,
                                             const std::vector<std::string>& serve_flags,
                                             std::string* error) {
  auto d = testing::Daemon::Start(KVSERVE_BINARY, {"--log-level", "warn", "-m", model},
                                  serve_flags);
  if (!d.ok()) {
    *error = d.status().ToString();
    return nullptr;
  }
  return std::move(d).value();
}

std::unique_ptr<httplib::Client> ClientFor(int port) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", port);
  c->set_read_timeout(120, 0);
  c->set_connection_timeout(10, 0);
  return c;
}

struct HttpResult {
  int status = -1;
  std::string body;
  std::string content_type;
};

HttpResult PostJson(httplib::Client& c, const std::string& path, const std::string& body,
                    const httplib::Headers& headers = {}) {
  HttpResult r;
  auto res = c.Post(path.c_str(), headers, body, "application/json");
  if (!res) return r;
  r.status = res->status;
  r.body = res->body;
  r.content_type = res->get_header_value("Content-Type");
  return r;
}

// A streaming POST that hands each received piece to `on_data`; returning
// false from it drops the connection (a client that goes away).
HttpResult PostStream(httplib::Client& c, const std::string& path, const std::string& body,
                      std::function<bool(const std::string& so_far)> on_data = nullptr) {
  HttpResult r;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body;
  req.response_handler = [&r](const httplib::Response& res) {
    r.status = res.status;
    r.content_type = res.get_header_value("Content-Type");
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    r.body.append(data, len);
    return on_data ? on_data(r.body) : true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!c.send(req, res, err) && r.status == -1) r.body = "transport error: " + httplib::to_string(err);
  return r;
}

// The `data:` payloads of an SSE body, in order (comments skipped).
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) == 0) out.push_back(line.substr(6));
  }
  return out;
}

struct StreamSummary {
  std::vector<std::string> texts;  // per choice index
  std::vector<std::string> finish_reasons;
  json usage;                      // null unless a usage chunk came
  bool done = false;               // ended with [DONE]
  int chunks = 0;
  std::string error;
};

StreamSummary Summarize(const std::string& body, bool chat) {
  StreamSummary s;
  std::vector<std::string> data = SseData(body);
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] == "[DONE]") {
      s.done = i + 1 == data.size();
      if (!s.done) s.error = "[DONE] is not last";
      continue;
    }
    json c = json::parse(data[i], nullptr, false);
    if (c.is_discarded()) {
      s.error = "bad chunk: " + data[i];
      continue;
    }
    ++s.chunks;
    if (c.contains("error")) s.error = c.dump();
    if (c.contains("usage") && !c["usage"].is_null()) s.usage = c["usage"];
    for (const json& ch : c.value("choices", json::array())) {
      const size_t idx = ch["index"].get<size_t>();
      if (s.texts.size() <= idx) {
        s.texts.resize(idx + 1);
        s.finish_reasons.resize(idx + 1);
      }
      if (chat) {
        if (ch["delta"].contains("content") && ch["delta"]["content"].is_string()) {
          s.texts[idx] += ch["delta"]["content"].get<std::string>();
        }
      } else {
        s.texts[idx] += ch["text"].get<std::string>();
      }
      if (!ch["finish_reason"].is_null()) s.finish_reasons[idx] = ch["finish_reason"];
    }
  }
  return s;
}

// A sample value from /metrics: the first series of `name` whose label list
// contains every one of `labels` (e.g. finished_reason="cancelled"). A
// scrape that does not answer 200, or no such series, is a test failure and
// NaN, which every comparison rejects (-1 once passed EXPECT_LT).
double MetricValue(httplib::Client& c, const std::string& name,
                   const std::vector<std::string>& labels = {}) {
  auto res = c.Get("/metrics");
  if (!res || res->status != 200) {
    ADD_FAILURE() << "GET /metrics did not answer 200 while reading " << name;
    return std::nan("");
  }
  std::istringstream in(res->body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) != 0) continue;
    bool match = true;
    for (const std::string& l : labels) match = match && line.find(l) != std::string::npos;
    if (match) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  ADD_FAILURE() << "/metrics has no series " << name << " with the labels asked for";
  return std::nan("");
}

struct Golden {
  std::string prompt;
  int prompt_tokens = 0;
  std::string continuation;
};

std::vector<Golden> LoadGolden() {
  std::vector<Golden> out;
  const std::string path = testing::Stories260KGoldenPath();
  if (path.empty()) return out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || j.value("max_tokens", 0) != 48) continue;
    Golden g;
    g.prompt = j["prompt"];
    g.prompt_tokens = static_cast<int>(j["prompt_ids_with_bos"].size());
    // llama.cpp prints the prompt with the SentencePiece leading space.
    const std::string full = j["output_text_including_prompt"];
    const std::string head = " " + g.prompt;
    if (full.rfind(head, 0) != 0) continue;
    g.continuation = full.substr(head.size());
    out.push_back(std::move(g));
  }
  return out;
}

std::string CompletionBody(const std::string& prompt, int max_tokens, bool stream,
                           json extra = json::object()) {
  json b = {{"model", "stories260K"},
            {"prompt", prompt},
            {"max_tokens", max_tokens},
            {"temperature", 0},
            {"stream", stream}};
  if (stream) b["stream_options"] = {{"include_usage", true}};
  b.update(extra);
  return b.dump();
}

// One daemon on stories260K shared by the tests below.
class HttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string model = testing::Stories260KPath();
    if (model.empty()) return;
    std::string error;
    daemon_ = StartDaemon(model, {"--max-request-bytes", "65536", "--max-n", "4"}, &error)
                  .release();
    if (daemon_ == nullptr) start_error_ = new std::string(error);
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) {
      // SIGTERM drains; a clean exit says no request was left hanging.
      EXPECT_EQ(daemon_->StopWith(SIGTERM, 30), 0) << daemon_->Log();
    }
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
    ASSERT_NE(daemon_, nullptr) << (start_error_ ? *start_error_ : "");
    client_ = ClientFor(daemon_->http_port());
  }
  int port() const { return daemon_->http_port(); }

  static testing::Daemon* daemon_;
  static std::string* start_error_;
  std::unique_ptr<httplib::Client> client_;
};
testing::Daemon* HttpTest::daemon_ = nullptr;
std::string* HttpTest::start_error_ = nullptr;

TEST_F(HttpTest, HealthModelsAndMetricsAnswer) {
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok");

  auto models = client_->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);
  json m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "stories260K");
  EXPECT_EQ(m["data"][0]["object"], "model");

  auto metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->get_header_value("Content-Type"), StartsWith("text/plain; version=0.0.4"));
  EXPECT_THAT(metrics->body, HasSubstr("kvserve:kv_blocks_free{model_name=\"stories260K\"}"));
  EXPECT_THAT(metrics->body, HasSubstr("# TYPE kvserve:time_to_first_token_seconds histogram"));
}

TEST_F(HttpTest, GreedyCompletionsMatchGolden) {
  const std::vector<Golden> golden = LoadGolden();
  if (golden.empty()) GTEST_SKIP() << "golden outputs not found";
  for (const Golden& g : golden) {
    SCOPED_TRACE(g.prompt);
    HttpResult r = PostJson(*client_, "/v1/completions", CompletionBody(g.prompt, 48, false));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_THAT(r.content_type, StartsWith("application/json"));
    json j = json::parse(r.body);
    EXPECT_THAT(j["id"].get<std::string>(), StartsWith("cmpl-"));
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_EQ(j["model"], "stories260K");
    EXPECT_TRUE(j["created"].is_number_integer());
    ASSERT_EQ(j["choices"].size(), 1u);
    EXPECT_EQ(j["choices"][0]["index"], 0);
    EXPECT_EQ(j["choices"][0]["text"], g.continuation);
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
    EXPECT_EQ(j["usage"]["prompt_tokens"], g.prompt_tokens);
    EXPECT_EQ(j["usage"]["completion_tokens"], 48);
    EXPECT_EQ(j["usage"]["total_tokens"], g.prompt_tokens + 48);
    EXPECT_TRUE(j["usage"]["prompt_tokens_details"]["cached_tokens"].is_number_integer());
  }
}

TEST_F(HttpTest, TokenArrayPromptEqualsTextPrompt) {
  const std::vector<Golden> golden = LoadGolden();
  if (golden.empty()) GTEST_SKIP() << "golden outputs not found";
  // "Once upon a time" with BOS, as the golden file lists it.
  json body = {{"prompt", {1, 403, 407, 261, 378}}, {"max_tokens", 48}, {"temperature", 0}};
  HttpResult r = PostJson(*client_, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], golden[0].continuation);
}

TEST_F(HttpTest, StreamedChunksConcatenateToGoldenAndEndWithDone) {
  const std::vector<Golden> golden = LoadGolden();
  if (golden.empty()) GTEST_SKIP() << "golden outputs not found";
  const Golden& g = golden[0];
  HttpResult r = PostStream(*client_, "/v1/completions", CompletionBody(g.prompt, 48, true));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_THAT(r.content_type, StartsWith("text/event-stream"));
  StreamSummary s = Summarize(r.body, /*chat=*/false);
  EXPECT_TRUE(s.error.empty()) << s.error;
  EXPECT_TRUE(s.done) << r.body;
  ASSERT_EQ(s.texts.size(), 1u);
  EXPECT_EQ(s.texts[0], g.continuation);
  EXPECT_EQ(s.finish_reasons[0], "length");
  EXPECT_GT(s.chunks, 3) << "text should arrive in several deltas";
  ASSERT_FALSE(s.usage.is_null()) << "include_usage asked for a usage chunk";
  EXPECT_EQ(s.usage["prompt_tokens"], g.prompt_tokens);
  EXPECT_EQ(s.usage["completion_tokens"], 48);
  EXPECT_EQ(s.usage["total_tokens"], g.prompt_tokens + 48);
  // Every event is `data: ...` followed by a blank line.
  EXPECT_THAT(r.body, StartsWith("data: "));
  EXPECT_THAT(r.body, ::testing::EndsWith("data: [DONE]\n\n"));
}

TEST_F(HttpTest, StreamWithoutIncludeUsageHasNoUsageChunk) {
  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 8}, {"stream", true}};
  HttpResult r = PostStream(*client_, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  StreamSummary s = Summarize(r.body, false);
  EXPECT_TRUE(s.done);
  EXPECT_TRUE(s.usage.is_null());
}

TEST_F(HttpTest, SeveralSamplesAndStopStrings) {
  json body = {{"prompt", "Once upon a time"},
               {"max_tokens", 48},
               {"temperature", 0},
               {"n", 3},
               {"stop", "Lily"}};
  HttpResult r = PostJson(*client_, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    // Greedy samples agree; the stop string ends them before "Lily".
    EXPECT_EQ(j["choices"][i]["text"], ", there was a little girl named ");
    EXPECT_EQ(j["choices"][i]["finish_reason"], "stop");
  }
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int>() % 3, 0);
}

TEST_F(HttpTest, LogprobsAreReturnedWhenAsked) {
  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"temperature", 0},
               {"logprobs", 1}};
  HttpResult r = PostJson(*client_, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json lp = json::parse(r.body)["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << r.body;
  EXPECT_EQ(lp["tokens"].size(), 4u);
  ASSERT_EQ(lp["token_logprobs"].size(), 4u);
  for (const json& v : lp["token_logprobs"]) EXPECT_LE(v.get<double>(), 0.0);
}

// Opens a stream of n x max_tokens tokens (ignore_eos, so it cannot stop
// early), hangs up after a few deltas, then waits until nothing runs and
// expects: the request was cancelled (the cancelled counter rose by n) and
// stopped well short of its end (the server generated fewer than half of
// its tokens), and the KV pool is back at its starting free count. The
// model must be slow enough that the request is certainly still running at
// the hang-up (see WriteSlowTinyLlama); the wait is bounded by the request's
// natural end, so a server that ignores the hang-up fails on the counts.
void ExpectDisconnectCancelsAndFreesBlocks(int port, const std::string& model, int max_tokens) {
  constexpr int kSamples = 2;
  auto client = ClientFor(port);
  const double free_before = MetricValue(*client, "kvserve:kv_blocks_free");
  ASSERT_GT(free_before, 0);
  const auto cancelled = [&] {
    return MetricValue(*client, "kvserve:request_success_total", {"finished_reason=\"cancelled\""});
  };
  const double cancelled_before = cancelled();
  const double tokens_before = MetricValue(*client, "kvserve:generation_tokens_total");
  ASSERT_GE(tokens_before, 0);
  json body = {{"model", model}, {"prompt", "Once upon a time"}, {"max_tokens", max_tokens},
               {"ignore_eos", true}, {"n", kSamples}, {"temperature", 0.8}, {"stream", true}};
  int received = 0;
  auto stream_client = ClientFor(port);
  HttpResult r = PostStream(*stream_client, "/v1/completions", body.dump(),
                            [&](const std::string& so_far) {
                              received = static_cast<int>(SseData(so_far).size());
                              return received < 3;  // hang up after a few deltas
                            });
  stream_client.reset();  // closes the socket
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 500);
  ASSERT_GE(received, 3) << r.body.substr(0, 500);
  EXPECT_EQ(r.body.find("[DONE]"), std::string::npos) << "the stream ended before the hang-up";
  // Until the request is gone: cancelled, or (if the hang-up went unnoticed)
  // run to its end. The bound only keeps a hung server from hanging the test.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < give_up) {
    if (cancelled() > cancelled_before ||
        (MetricValue(*client, "kvserve:num_requests_running") == 0 &&
         MetricValue(*client, "kvserve:num_requests_waiting") == 0)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Stats are published at the end of a step: wait for the one after the cancel.
  double free_now = -1;
  while (std::chrono::steady_clock::now() < give_up) {
    free_now = MetricValue(*client, "kvserve:kv_blocks_free");
    if (free_now == free_before && MetricValue(*client, "kvserve:num_requests_running") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // The counter counts finished samples.
  EXPECT_EQ(cancelled(), cancelled_before + kSamples) << "the hang-up did not cancel the request";
  const double generated = MetricValue(*client, "kvserve:generation_tokens_total") - tokens_before;
  EXPECT_LT(generated, kSamples * max_tokens / 2.0)
      << "the request ran on after the hang-up (" << generated << " of " << kSamples * max_tokens
      << " tokens)";
  EXPECT_EQ(free_now, free_before) << "KV blocks not returned after the hang-up";
  EXPECT_EQ(MetricValue(*client, "kvserve:num_requests_running"), 0);
}

// A daemon on a written model (WriteSlowTinyLlama): stories260K would finish
// its whole context before the hang-up is noticed. Needs no ../shared.
TEST(HttpDisconnectTest, ClientDisconnectMidStreamFreesBlocks) {
  const std::string model = testing::TempDir() + "/http-slow.gguf";
  ASSERT_TRUE(testing::WriteSlowTinyLlama(model).ok());
  std::string error;
  auto daemon = StartDaemon(model, {"--served-model-name", "slow", "--max-n", "4"}, &error);
  ASSERT_NE(daemon, nullptr) << error;
  ExpectDisconnectCancelsAndFreesBlocks(daemon->http_port(), "slow", 4000);
  EXPECT_EQ(daemon->StopWith(SIGTERM, 30), 0) << daemon->Log();
}

TEST_F(HttpTest, HundredsOfConcurrentStreamsAllComplete) {
  const std::vector<Golden> golden = LoadGolden();
  if (golden.empty()) GTEST_SKIP() << "golden outputs not found";
  // 128 by default; KVSERVE_HTTP_TEST_STREAMS raises it (500 for the issue's check).
  const char* env = std::getenv("KVSERVE_HTTP_TEST_STREAMS");
  const int kStreams = env ? std::max(1, std::atoi(env)) : 128;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      const Golden& g = golden[i % golden.size()];
      auto c = ClientFor(port());
      HttpResult r = PostStream(*c, "/v1/completions", CompletionBody(g.prompt, 48, true));
      if (r.status != 200) {
        failures[i] = "status " + std::to_string(r.status) + ": " + r.body;
        return;
      }
      StreamSummary s = Summarize(r.body, false);
      if (!s.error.empty() || !s.done || s.texts.size() != 1 || s.texts[0] != g.continuation ||
          s.usage.is_null() || s.usage["completion_tokens"] != 48) {
        failures[i] = "bad stream: " + r.body.substr(0, 2000);
      }
    });
  }
  for (auto& t : threads) t.join();
  int failed = 0;
  for (int i = 0; i < kStreams; ++i) {
    if (!failures[i].empty() && failed++ < 3) ADD_FAILURE() << "stream " << i << ": " << failures[i];
  }
  EXPECT_EQ(failed, 0);
}

struct BadInput {
  std::string name;
  std::string path;
  std::string body;
  int status;
  std::string param;         // expected error.param ("" for null)
  std::string message_part;  // expected inside error.message
};

TEST_F(HttpTest, InvalidInputsGetTheirCodeAndNameTheField) {
  const std::string long_stop(1000, 'x');
  json many_stops = json::array();
  for (int i = 0; i < 50; ++i) many_stops.push_back("s" + std::to_string(i));
  auto body = [](json extra) {
    json b = {{"prompt", "Once upon a time"}, {"max_tokens", 8}};
    b.update(extra);
    return b.dump();
  };
  const std::vector<BadInput> cases = {
      {"empty prompt", "/v1/completions", body({{"prompt", ""}}), 400, "prompt", "prompt"},
      {"empty token prompt", "/v1/completions", body({{"prompt", json::array()}}), 400, "prompt",
       "prompt"},
      {"missing prompt", "/v1/completions", R"({"max_tokens": 8})", 400, "prompt", "prompt"},
      {"over the context", "/v1/completions", body({{"max_tokens", 100000}}), 400, "max_tokens",
       "max_tokens"},
      {"max_tokens zero", "/v1/completions", body({{"max_tokens", 0}}), 400, "max_tokens",
       "max_tokens"},
      {"n over the limit", "/v1/completions", body({{"n", 100}}), 400, "n", "n must"},
      {"negative temperature", "/v1/completions", body({{"temperature", -0.5}}), 400,
       "temperature", "temperature"},
      {"top_p zero", "/v1/completions", body({{"top_p", 0}}), 400, "top_p", "top_p"},
      {"top_p above one", "/v1/completions", body({{"top_p", 1.5}}), 400, "top_p", "top_p"},
      {"too many stop strings", "/v1/completions", body({{"stop", many_stops}}), 400, "stop",
       "stop"},
      {"too long stop string", "/v1/completions", body({{"stop", long_stop}}), 400, "stop",
       "stop"},
      {"unknown model", "/v1/completions", body({{"model", "gpt-17"}}), 404, "model", "gpt-17"},
      {"malformed json", "/v1/completions", R"({"prompt": "hi", )", 400, "", "JSON"},
      {"not an object", "/v1/completions", R"([1, 2])", 400, "", "object"},
      {"temperature type", "/v1/completions", body({{"temperature", "hot"}}), 400, "temperature",
       "temperature must be a number"},
      {"max_tokens type", "/v1/completions", body({{"max_tokens", 2.5}}), 400, "max_tokens",
       "max_tokens must be an integer"},
      {"stream type", "/v1/completions", body({{"stream", "yes"}}), 400, "stream", "stream"},
      {"stop type", "/v1/completions", body({{"stop", 7}}), 400, "stop", "stop"},
      {"token out of vocab", "/v1/completions", body({{"prompt", {1, 99999}}}), 400, "prompt",
       "prompt"},
      {"chat without messages", "/v1/chat/completions", R"({"max_tokens": 8})", 400, "messages",
       "messages"},
      {"chat messages type", "/v1/chat/completions", R"({"messages": "hi"})", 400, "messages",
       "messages"},
      {"chat empty messages", "/v1/chat/completions", R"({"messages": []})", 400, "messages",
       "messages"},
  };
  for (const BadInput& c : cases) {
    SCOPED_TRACE(c.name);
    HttpResult r = PostJson(*client_, c.path, c.body);
    EXPECT_EQ(r.status, c.status) << r.body;
    json j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    ASSERT_TRUE(j.contains("error")) << r.body;
    const json& e = j["error"];
    EXPECT_THAT(e["message"].get<std::string>(), HasSubstr(c.message_part));
    EXPECT_TRUE(e["type"].is_string());
    EXPECT_TRUE(e.contains("code"));
    if (c.param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << r.body;
    } else {
      EXPECT_EQ(e["param"], c.param) << r.body;
    }
  }
  // Oversized body: 413 in the same error shape.
  json big = {{"prompt", std::string(100000, 'a')}, {"max_tokens", 8}};
  HttpResult r = PostJson(*client_, "/v1/completions", big.dump());
  EXPECT_EQ(r.status, 413);
  EXPECT_THAT(r.body, HasSubstr("max_request_bytes"));
  // Unknown route.
  auto missing = client_->Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);

  // Nothing else was disturbed: the server still answers correctly.
  const std::vector<Golden> golden = LoadGolden();
  if (golden.empty()) return;
  HttpResult ok = PostJson(*client_, "/v1/completions", CompletionBody(golden[0].prompt, 48, false));
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(json::parse(ok.body)["choices"][0]["text"], golden[0].continuation);
}

// kv_policy (our extension): a name or an object; bad values answer 400 with
// param kv_policy; a request under a policy gets usage.kv_dropped_tokens,
// one without keeps OpenAI's usage. Whether the engine evicted anything is
// the engine's tests' business: only the field and the finished request are
// checked. stories260K's context is 128 tokens, so the windows are small.
TEST_F(HttpTest, KvPolicyIsValidatedAndUsageReportsDroppedTokens) {
  auto body = [](json kv_policy, json extra = json::object()) {
    json b = {{"prompt", "Once upon a time"}, {"max_tokens", 8}, {"temperature", 0}};
    if (!kv_policy.is_null()) b["kv_policy"] = std::move(kv_policy);
    b.update(extra);
    return b.dump();
  };
  const std::vector<BadInput> cases = {
      {"unknown policy", "/v1/completions", body("bogus"), 400, "kv_policy", "unknown policy"},
      {"unknown policy in the object", "/v1/completions", body({{"policy", "lru"}}), 400,
       "kv_policy", "h2o"},
      {"budget too small", "/v1/completions",
       body({{"policy", "h2o"}, {"sinks", 4}, {"window", 16}, {"budget", 10}}), 400, "kv_policy",
       "kv_policy.budget"},
      {"window past the context", "/v1/completions", body({{"policy", "window"}, {"window", 4096}}),
       400, "kv_policy", "context length"},
      {"default window past the context", "/v1/completions", body("sinks"), 400, "kv_policy",
       "context length"},
      {"zero window", "/v1/completions", body({{"policy", "sinks"}, {"window", 0}}), 400,
       "kv_policy", "kv_policy.window"},
      {"negative sinks", "/v1/completions",
       body({{"policy", "sinks"}, {"sinks", -1}, {"window", 8}}), 400, "kv_policy",
       "kv_policy.sinks"},
      {"wrong type", "/v1/completions", body(7), 400, "kv_policy", "kv_policy must be"},
      {"array", "/v1/completions", body(json::array({"sinks"})), 400, "kv_policy",
       "kv_policy must be"},
      {"policy type", "/v1/completions", body({{"policy", 3}}), 400, "kv_policy",
       "kv_policy.policy must be a string"},
      {"number type", "/v1/completions", body({{"policy", "window"}, {"window", "wide"}}), 400,
       "kv_policy", "kv_policy.window must be an integer"},
      {"fractional number", "/v1/completions", body({{"policy", "window"}, {"window", 8.5}}), 400,
       "kv_policy", "kv_policy.window must be an integer"},
      {"unknown field", "/v1/completions", body({{"policy", "window"}, {"windw", 8}}), 400,
       "kv_policy", "windw"},
  };
  for (const BadInput& c : cases) {
    SCOPED_TRACE(c.name);
    HttpResult r = PostJson(*client_, c.path, c.body);
    EXPECT_EQ(r.status, c.status) << r.body;
    json j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_EQ(j["error"]["param"], c.param) << r.body;
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.message_part));
  }

  // Without kv_policy, or with none, or null: OpenAI's usage, nothing added.
  for (const json& kv : {json(nullptr), json("none"), json{{"policy", "none"}}}) {
    SCOPED_TRACE(kv.dump());
    json b = json::parse(body(nullptr));
    b["kv_policy"] = kv;
    HttpResult r = PostJson(*client_, "/v1/completions", b.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    json usage = json::parse(r.body)["usage"];
    EXPECT_FALSE(usage.contains("kv_dropped_tokens")) << r.body;
    EXPECT_EQ(usage["completion_tokens"], 8);
  }

  // Under a policy (name with the numbers elsewhere defaulted, or an object
  // with some fields): the request finishes and usage says what it dropped.
  // With a 48-token completion, every policy but the 40-token h2o one has at
  // least a block (16) of tokens to drop: the engine must have dropped them.
  const std::vector<std::pair<json, bool>> policies = {
      {json{{"policy", "window"}, {"window", 16}}, true},
      {json{{"policy", "sinks"}, {"sinks", 2}, {"window", 16}}, true},
      {json{{"policy", "h2o"}, {"window", 16}}, false},  // budget 2 x (4 + 16)
      {json{{"policy", "h2o"}, {"sinks", 0}, {"window", 8}, {"budget", 32}}, true},
      {json{{"policy", "sinks"}, {"sinks", nullptr}, {"window", 16}}, true},  // null: the default
  };
  for (const auto& [kv, drops] : policies) {
    SCOPED_TRACE(kv.dump());
    json b = json::parse(body(kv, {{"max_tokens", 48}, {"n", 2}}));
    HttpResult r = PostJson(*client_, "/v1/completions", b.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body);
    ASSERT_EQ(j["choices"].size(), 2u);
    for (const json& c : j["choices"]) EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(j["usage"]["completion_tokens"], 96);
    ASSERT_TRUE(j["usage"].contains("kv_dropped_tokens")) << r.body;
    EXPECT_TRUE(j["usage"]["kv_dropped_tokens"].is_number_integer()) << r.body;
    if (drops) {
      EXPECT_GT(j["usage"]["kv_dropped_tokens"].get<int64_t>(), 0) << r.body;
    } else {
      EXPECT_EQ(j["usage"]["kv_dropped_tokens"].get<int64_t>(), 0) << r.body;
    }

    // Streamed: the include_usage chunk carries it too.
    b["stream"] = true;
    b["stream_options"] = {{"include_usage", true}};
    HttpResult s = PostStream(*client_, "/v1/completions", b.dump());
    ASSERT_EQ(s.status, 200) << s.body;
    StreamSummary sum = Summarize(s.body, /*chat=*/false);
    EXPECT_TRUE(sum.done);
    EXPECT_TRUE(sum.error.empty()) << sum.error;
    ASSERT_FALSE(sum.usage.is_null()) << s.body;
    EXPECT_EQ(sum.usage.value("kv_dropped_tokens", -1) > 0, drops) << sum.usage.dump();
  }
  // Streamed without a policy: usage as before.
  HttpResult s =
      PostStream(*client_, "/v1/completions", CompletionBody("Once upon a time", 8, true));
  ASSERT_EQ(s.status, 200) << s.body;
  StreamSummary sum = Summarize(s.body, /*chat=*/false);
  ASSERT_FALSE(sum.usage.is_null()) << s.body;
  EXPECT_FALSE(sum.usage.contains("kv_dropped_tokens")) << sum.usage.dump();
}

TEST(HttpApiKeyTest, KeyIsRequiredExceptForHealth) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  std::string error;
  auto d = StartDaemon(model, {"--api-key", "s3cret"}, &error);
  ASSERT_NE(d, nullptr) << error;
  auto c = ClientFor(d->http_port());
  auto health = c->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);

  auto missing = c->Get("/v1/models");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 401);
  EXPECT_THAT(missing->body, HasSubstr("API key"));
  HttpResult wrong = PostJson(*c, "/v1/completions", CompletionBody("Once", 4, false),
                              {{"Authorization", "Bearer nope"}});
  EXPECT_EQ(wrong.status, 401);
  EXPECT_TRUE(json::parse(wrong.body)["error"].is_object());

  HttpResult right = PostJson(*c, "/v1/completions", CompletionBody("Once", 4, false),
                              {{"Authorization", "Bearer s3cret"}});
  EXPECT_EQ(right.status, 200) << right.body;
  c->set_bearer_token_auth("s3cret");
  auto models = c->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);
}

TEST(HttpTlsTest, ServesHttpsWithTheGivenCertificate) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  const std::string dir = testing::TempDir();
  const std::string cert = dir + "/http-cert.pem", key = dir + "/http-key.pem";
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -keyout " + key + " -out " +
                          cert + " -days 1 -subj /CN=127.0.0.1 >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "openssl is not available";
  std::string error;
  auto d = StartDaemon(model, {"--tls-cert", cert, "--tls-key", key}, &error);
  ASSERT_NE(d, nullptr) << error;
  httplib::SSLClient c("127.0.0.1", d->http_port());
  c.enable_server_certificate_verification(false);
  c.set_read_timeout(60, 0);
  auto health = c.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  auto res = c.Post("/v1/completions", CompletionBody("Once upon a time", 8, false),
                    "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["usage"]["completion_tokens"], 8);
  // Plain HTTP to the TLS port gets nowhere.
  httplib::Client plain("127.0.0.1", d->http_port());
  plain.set_read_timeout(5, 0);
  auto p = plain.Get("/health");
  EXPECT_TRUE(!p || p->status != 200);
}

// Chat needs a model with a chat template: the default SmolLM2.
class HttpChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::SmolLM2Path();
    KVSERVE_SKIP_IF_MISSING(model_, "SmolLM2-135M-Instruct.Q4_1.gguf");
    std::string error;
    daemon_ = StartDaemon(model_, {"--served-model-name", "smollm2"}, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    client_ = ClientFor(daemon_->http_port());
  }
  std::string model_;
  std::unique_ptr<testing::Daemon> daemon_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpChatTest, ChatCompletionStreamedAndNot) {
  json body = {{"model", "smollm2"},
               {"messages", {{{"role", "user"}, {"content", "What is the capital of France?"}}}},
               {"max_completion_tokens", 12},
               {"temperature", 0}};
  HttpResult r = PostJson(*client_, "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_THAT(j["id"].get<std::string>(), StartsWith("chatcmpl-"));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string content = j["choices"][0]["message"]["content"];
  EXPECT_FALSE(content.empty());
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int>() <= 12, true);

  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpResult s = PostStream(*client_, "/v1/chat/completions", body.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  StreamSummary sum = Summarize(s.body, /*chat=*/true);
  EXPECT_TRUE(sum.done);
  EXPECT_TRUE(sum.error.empty()) << sum.error;
  ASSERT_EQ(sum.texts.size(), 1u);
  EXPECT_EQ(sum.texts[0], content);
  EXPECT_FALSE(sum.finish_reasons[0].empty());
  EXPECT_EQ(sum.usage["completion_tokens"], j["usage"]["completion_tokens"]);
  // The first chunk names the assistant role, as OpenAI's do.
  json first = json::parse(SseData(s.body)[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
}

TEST_F(HttpChatTest, ChatTakesAKvPolicy) {
  json body = {{"model", "smollm2"},
               {"messages", {{{"role", "user"}, {"content", "Name three colors."}}}},
               {"max_completion_tokens", 12},
               {"temperature", 0},
               {"kv_policy", "sinks"}};  // the defaults: 4 sinks + 256 recent
  HttpResult r = PostJson(*client_, "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_FALSE(j["choices"][0]["finish_reason"].is_null());
  EXPECT_GE(j["usage"].value("kv_dropped_tokens", -1), 0) << r.body;
  body["kv_policy"] = {{"policy", "h2o"}, {"budget", 100}};  // not above 4 + 256
  r = PostJson(*client_, "/v1/chat/completions", body.dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "kv_policy") << r.body;
}

TEST_F(HttpChatTest, ClientDisconnectCancelsTheRequestAndFreesBlocks) {
  ExpectDisconnectCancelsAndFreesBlocks(daemon_->http_port(), "smollm2", 2000);
}

TEST_F(HttpChatTest, ChatValidationNamesTheField) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"temperature", -1}};
  HttpResult r = PostJson(*client_, "/v1/chat/completions", body.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "temperature") << r.body;
  body = {{"messages", {{{"role", "robot"}, {"content", "hi"}}}}};
  r = PostJson(*client_, "/v1/chat/completions", body.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "messages") << r.body;
  body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_completion_tokens", 0}};
  r = PostJson(*client_, "/v1/chat/completions", body.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "max_completion_tokens") << r.body;
}

// The official client, when installed: completions, chat and streaming.
TEST(HttpOpenAiClientTest, OfficialPythonClientWorksUnchanged) {
  const std::string model = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(model, "stories260K.gguf");
  const char* py_env = std::getenv("KVSERVE_PYTHON");
  const std::string python = py_env ? py_env : "python3";
  if (std::system((python + " -c 'import openai' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "the openai Python package is not installed (set KVSERVE_PYTHON to a "
                    "python that has it)";
  }
  const std::vector<Golden> golden = LoadGolden();
  std::string error;
  auto d = StartDaemon(model, {"--api-key", "sk-test"}, &error);
  ASSERT_NE(d, nullptr) << error;
  std::string cmd = python + " " + KVSERVE_OPENAI_CLIENT_TEST + " --base-url http://127.0.0.1:" +
                    std::to_string(d->http_port()) + "/v1 --api-key sk-test --model stories260K";
  if (!golden.empty()) {
    const std::string expected = testing::TempDir() + "/openai-expected.txt";
    std::ofstream(expected, std::ios::binary) << golden[0].continuation;
    cmd += " --expected-file " + expected;
  }
  std::unique_ptr<testing::Daemon> chat;
  const std::string smol = testing::SmolLM2Path();
  if (!smol.empty()) {
    chat = StartDaemon(smol, {"--served-model-name", "smollm2", "--api-key", "sk-test"}, &error);
    ASSERT_NE(chat, nullptr) << error;
    cmd += " --chat-base-url http://127.0.0.1:" + std::to_string(chat->http_port()) +
           "/v1 --chat-model smollm2";
  }
  const int rc = std::system((cmd + " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << cmd;
}

}  // namespace
}  // namespace kvserve
