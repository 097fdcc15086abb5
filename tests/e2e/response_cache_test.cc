// The response cache against a live daemon (issue 19): the second identical
// greedy request is an exact hit with byte-identical text on HTTP and gRPC
// and says so (x-kvserve-cache, kvserve_cache, CacheInfo); a streamed hit
// replays the same chunks; any change of an input misses (a sampling field, a
// stop string, the salt, the system prompt; the model file, KV dtype and
// tenant are covered by the key's unit test, as entries live in one process);
// sampled requests without a seed are never stored; purges and the metrics
// work behind the API key; bad cache options are refused naming the field.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace pb = ::kvserve::v1;
using json = nlohmann::json;
using ::testing::HasSubstr;

constexpr char kApiKey[] = "tenant-one-key";

std::unique_ptr<testing::Daemon> StartDaemon(const std::string& model,
                                             const std::vector<std::string>& extra) {
  return testing::StartServe(
      KVSERVE_BINARY, model, "warn",
      {"--kv-cache-memory", "4MiB", "--response-cache-bytes", "1MiB", "--drain-timeout", "2"},
      extra);
}

using Reply = testing::HttpReply;
using testing::HttpPost;

// The texts of a completion stream's chunks, in order.
std::vector<std::string> StreamChunks(const Reply& r, json* usage_chunk) {
  std::vector<std::string> chunks;
  std::istringstream lines(r.raw);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    json j = json::parse(line.substr(6));
    if (j.contains("usage")) *usage_chunk = j;
    for (const json& c : j["choices"]) {
      if (c.contains("text") && !c["text"].get<std::string>().empty()) {
        chunks.push_back(c["text"].get<std::string>());
      }
    }
  }
  return chunks;
}

json Greedy() {
  return {{"prompt", "Once upon a time, there was a"}, {"max_tokens", 24}, {"temperature", 0}};
}

TEST(ResponseCacheE2eTest, SecondIdenticalGreedyRequestIsAnExactHitOverHttp) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon(testing::Stories260KPath(), {});
  ASSERT_TRUE(d);
  const Reply first = HttpPost(d->http_port(), "/v1/completions", Greedy());
  ASSERT_EQ(first.status, 200) << first.raw;
  EXPECT_EQ(first.cache_header, "miss");
  EXPECT_EQ(first.body["kvserve_cache"]["kind"], "miss");
  const Reply second = HttpPost(d->http_port(), "/v1/completions", Greedy());
  ASSERT_EQ(second.status, 200) << second.raw;
  EXPECT_EQ(second.cache_header, "exact");
  EXPECT_EQ(second.body["kvserve_cache"]["kind"], "exact");
  EXPECT_EQ(second.body["choices"][0]["text"], first.body["choices"][0]["text"]);
  EXPECT_EQ(second.body["choices"][0]["finish_reason"], first.body["choices"][0]["finish_reason"]);
  EXPECT_EQ(second.body["usage"]["completion_tokens"], first.body["usage"]["completion_tokens"]);
  EXPECT_NE(second.body["id"], first.body["id"]) << "the envelope is the new request's";

  // Streamed: the first stream is computed, the second replays it chunk for
  // chunk (the first non-streamed request already stored the same events).
  json stream = Greedy();
  stream["stream"] = true;
  stream["stream_options"] = {{"include_usage", true}};
  stream["response_cache"] = {{"lookup", false}};
  const Reply computed = HttpPost(d->http_port(), "/v1/completions", stream);
  ASSERT_EQ(computed.status, 200) << computed.raw;
  EXPECT_EQ(computed.cache_header, "bypass");
  stream.erase("response_cache");
  const Reply replayed = HttpPost(d->http_port(), "/v1/completions", stream);
  ASSERT_EQ(replayed.status, 200) << replayed.raw;
  EXPECT_EQ(replayed.cache_header, "exact");
  json usage_computed, usage_replayed;
  const std::vector<std::string> a = StreamChunks(computed, &usage_computed);
  const std::vector<std::string> b = StreamChunks(replayed, &usage_replayed);
  EXPECT_GT(a.size(), 3u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(usage_replayed["kvserve_cache"]["kind"], "exact");
  std::string joined;
  for (const std::string& s : b) joined += s;
  EXPECT_EQ(joined, first.body["choices"][0]["text"].get<std::string>());

  // Any change of a key input misses.
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"max_tokens", 23},
                                                 {"top_k", 3},
                                                 {"stop", json::array({"zzz"})},
                                                 {"repetition_penalty", 1.05},
                                                 {"cache_salt", "other"},
                                                 {"logprobs", 1}}) {
    json changed = Greedy();
    changed[field] = value;
    const Reply r = HttpPost(d->http_port(), "/v1/completions", changed);
    ASSERT_EQ(r.status, 200) << field << ": " << r.raw;
    EXPECT_EQ(r.cache_header, "miss") << field;
  }

  // Sampled without a seed: never stored, never served.
  json sampled = Greedy();
  sampled["temperature"] = 0.8;
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", sampled).cache_header, "bypass");
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", sampled).cache_header, "bypass");
  sampled["seed"] = 11;
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", sampled).cache_header, "miss");
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", sampled).cache_header, "exact");

  // store=false: computed and not kept.
  json no_store = Greedy();
  no_store["max_tokens"] = 5;
  no_store["response_cache"] = {{"store", false}};
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", no_store).cache_header, "miss");
  no_store.erase("response_cache");
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", no_store).cache_header, "miss");

  // Bad options name the field and disturb nothing.
  json bad = Greedy();
  bad["response_cache"] = {{"semantic", "sometimes"}};
  Reply r = HttpPost(d->http_port(), "/v1/completions", bad);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "response_cache") << r.raw;
  EXPECT_THAT(r.raw, HasSubstr("off, verified or approximate"));
  bad["response_cache"] = {{"lookup", "yes"}};
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", bad).status, 400);
  bad["response_cache"] = {{"min_similarity", 3}};
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", bad).status, 400);

  httplib::Client c("127.0.0.1", d->http_port());
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_THAT(
      metrics->body,
      HasSubstr("kvserve:response_cache_hits_total{model_name=\"stories260K\",kind=\"exact\"} 3"));
  EXPECT_THAT(metrics->body, HasSubstr("kvserve:response_cache_stores_total"));
  EXPECT_THAT(metrics->body, HasSubstr("kvserve:response_cache_bytes"));

  // Purge: everything goes; the next identical request is computed again.
  const Reply purged = HttpPost(d->http_port(), "/admin/response_cache/purge", json{{"all", true}});
  ASSERT_EQ(purged.status, 200) << purged.raw;
  EXPECT_GE(purged.body["purged"].get<int>(), 2);
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/completions", Greedy()).cache_header, "miss");
  EXPECT_EQ(HttpPost(d->http_port(), "/admin/response_cache/purge", json{{"nope", 1}}).status, 400);
}

TEST(ResponseCacheE2eTest, TenantsAreTheApiKeysAndPurgesNeedTheKey) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  // One daemon per key: the same request under another key misses, because
  // the tenant scope is derived on the server from the key.
  auto one = StartDaemon(testing::Stories260KPath(), {"--api-key", kApiKey});
  ASSERT_TRUE(one);
  EXPECT_EQ(HttpPost(one->http_port(), "/v1/completions", Greedy(), kApiKey).cache_header, "miss");
  EXPECT_EQ(HttpPost(one->http_port(), "/v1/completions", Greedy(), kApiKey).cache_header, "exact");
  // Unauthenticated purges are refused.
  EXPECT_EQ(HttpPost(one->http_port(), "/admin/response_cache/purge", json::object()).status, 401);
  const Reply purged =
      HttpPost(one->http_port(), "/admin/response_cache/purge", json::object(), kApiKey);
  ASSERT_EQ(purged.status, 200) << purged.raw;
  EXPECT_EQ(purged.body["purged"], 1);
  EXPECT_EQ(HttpPost(one->http_port(), "/v1/completions", Greedy(), kApiKey).cache_header, "miss");
}

using GrpcReply = testing::GrpcReply;

TEST(ResponseCacheE2eTest, GrpcHitsReplayTheStreamAndStatsCountThem) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon(testing::Stories260KPath(), {});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  pb::GenerateRequest r;
  r.set_prompt("The little dog ran");
  r.mutable_sampling()->set_max_tokens(20);
  r.mutable_sampling()->set_temperature(0);
  const GrpcReply first = testing::GrpcGenerate(channel, r);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.cache.kind(), "miss");
  const GrpcReply second = testing::GrpcGenerate(channel, r);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.cache.kind(), "exact");
  EXPECT_EQ(second.text, first.text);
  EXPECT_EQ(second.chunks, first.chunks);
  // HTTP and gRPC share the cache (ModelService): the same request over
  // HTTP is a hit too.
  const Reply http =
      HttpPost(d->http_port(), "/v1/completions",
               {{"prompt", "The little dog ran"}, {"max_tokens", 20}, {"temperature", 0}});
  EXPECT_EQ(http.cache_header, "exact");
  EXPECT_EQ(http.body["choices"][0]["text"].get<std::string>(), first.text);

  pb::GenerateRequest bypass = r;
  bypass.mutable_response_cache()->set_lookup(false);
  EXPECT_EQ(testing::GrpcGenerate(channel, bypass).cache.kind(), "bypass");
  pb::GenerateRequest bad = r;
  bad.mutable_response_cache()->set_semantic("maybe");
  const GrpcReply refused = testing::GrpcGenerate(channel, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("response_cache.semantic"));

  auto stub = pb::Kvserve::NewStub(channel);
  {
    grpc::ClientContext ctx;
    pb::Stats stats;
    ASSERT_TRUE(stub->GetStats(&ctx, pb::GetStatsRequest(), &stats).ok());
    EXPECT_EQ(stats.response_cache_hits_exact(), 2);
    // The bypassing request stored its reply again, replacing the entry.
    EXPECT_EQ(stats.response_cache_stores(), 2);
    EXPECT_EQ(stats.response_cache_entries(), 1);
    EXPECT_GT(stats.response_cache_bytes(), 0);
    EXPECT_EQ(stats.response_cache_bypassed(), 1);
  }
  {
    grpc::ClientContext ctx;
    pb::PurgeResponseCacheRequest req;
    req.set_all(true);
    pb::PurgeResponseCacheResponse resp;
    ASSERT_TRUE(stub->PurgeResponseCache(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.purged(), 1);
  }
  EXPECT_EQ(testing::GrpcGenerate(channel, r).cache.kind(), "miss");
}

TEST(ResponseCacheE2eTest, TheSystemPromptIsPartOfTheKey) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2-135M-Instruct.Q4_1.gguf");
  auto d = StartDaemon(model, {});
  ASSERT_TRUE(d);
  auto chat = [](const std::string& system) {
    return json{{"messages",
                 {{{"role", "system"}, {"content", system}},
                  {{"role", "user"}, {"content", "What is the capital of France?"}}}},
                {"max_tokens", 6},
                {"temperature", 0}};
  };
  const Reply a = HttpPost(d->http_port(), "/v1/chat/completions", chat("You are terse."));
  ASSERT_EQ(a.status, 200) << a.raw;
  EXPECT_EQ(a.cache_header, "miss");
  const Reply b = HttpPost(d->http_port(), "/v1/chat/completions", chat("You are terse."));
  EXPECT_EQ(b.cache_header, "exact");
  EXPECT_EQ(b.body["choices"][0]["message"]["content"], a.body["choices"][0]["message"]["content"]);
  EXPECT_EQ(HttpPost(d->http_port(), "/v1/chat/completions", chat("You are verbose.")).cache_header,
            "miss");
}

// The semantic cache through the daemon with kvserve's own sentence encoder
// (all-MiniLM-L6-v2 beside SmolLM2 in models/): a paraphrase of a cached
// question is a semantic-verified hit, and so is a trap that looks alike
// (another country) — but verification by the model means each answer is
// exactly the greedy answer the same request gets with the cache bypassed.
TEST(ResponseCacheE2eTest, SemanticHitsAreVerifiedByTheModel) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::string encoder = model.substr(0, model.rfind('/')) + "/all-MiniLM-L6-v2";
  KVSERVE_SKIP_IF_MISSING(encoder + "/model.safetensors", "models/all-MiniLM-L6-v2");
  auto d = StartDaemon(model, {"--semantic-cache-model", encoder});
  ASSERT_TRUE(d);
  auto chat = [](const std::string& q, const json& cache) {
    return json{{"messages", {{{"role", "user"}, {"content", q}}}},
                {"max_tokens", 16},
                {"temperature", 0},
                {"response_cache", cache}};
  };
  const json verified = {{"semantic", "verified"}, {"min_similarity", 0.5}};
  const std::string cached = "What is the capital of France?";
  const std::vector<std::string> asks = {"What's the capital city of France?",
                                         "What is the capital of Germany?"};
  // The model's own answers, with the cache bypassed (neither read nor written).
  std::vector<std::string> own;
  for (const std::string& q : asks) {
    const Reply r = HttpPost(d->http_port(), "/v1/chat/completions", chat(q, false));
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.cache_header, "bypass");
    own.push_back(r.body["choices"][0]["message"]["content"]);
  }
  const Reply first = HttpPost(d->http_port(), "/v1/chat/completions", chat(cached, verified));
  ASSERT_EQ(first.status, 200) << first.raw;
  EXPECT_EQ(first.cache_header, "miss");
  for (size_t i = 0; i < asks.size(); ++i) {
    const Reply r = HttpPost(d->http_port(), "/v1/chat/completions", chat(asks[i], verified));
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.cache_header, "semantic-verified") << asks[i];
    EXPECT_EQ(r.body["choices"][0]["message"]["content"], own[i]) << asks[i];
    ASSERT_TRUE(r.body.contains("kvserve_cache")) << r.raw;
    EXPECT_GT(r.body["kvserve_cache"]["similarity"].get<double>(), 0.5);
    // The cached answer was the draft: the model accepted as much of it as
    // agrees with its own answer, so all of it never when the answers
    // differ and some of it when they are the same.
    const int draft = r.body["kvserve_cache"]["draft_tokens"].get<int>();
    const int accepted = r.body["kvserve_cache"]["accepted_tokens"].get<int>();
    EXPECT_GT(draft, 0) << r.raw;
    EXPECT_LE(accepted, draft) << r.raw;
    if (own[i] == first.body["choices"][0]["message"]["content"]) {
      EXPECT_GT(accepted, 0) << asks[i] << ": " << r.raw;
    } else {
      EXPECT_LT(accepted, draft) << asks[i] << ": " << r.raw;
    }
  }
}

TEST(ResponseCacheE2eTest, OffByDefault) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = testing::Daemon::Start(
      KVSERVE_BINARY, {"--log-level", "warn", "-t", "1", "-m", testing::Stories260KPath()},
      {"--kv-cache-memory", "4MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  for (int i = 0; i < 2; ++i) {
    const Reply r = HttpPost((*d)->http_port(), "/v1/completions", Greedy());
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.cache_header, "");
    EXPECT_FALSE(r.body.contains("kvserve_cache"));
  }
  EXPECT_EQ(HttpPost((*d)->http_port(), "/admin/response_cache/purge", json::object()).status, 409);
}

TEST(ResponseCacheE2eTest, BadCacheFlagsStopStartUpNamingTheFlag) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string base = std::string(KVSERVE_BINARY) + " --log-level warn -m " +
                           testing::Stories260KPath() +
                           " serve --http-port 0 --grpc-address 127.0.0.1:0 ";
  for (const auto& [flags, want] : std::vector<std::pair<std::string, std::string>>{
           {"--response-cache-bytes 12XB", "--response-cache-bytes"},
           {"--response-cache-bytes 1MiB --response-cache-ttl -1", "--response-cache-ttl"},
           {"--semantic-cache-model /nonexistent", "--response-cache-bytes"},
           {"--response-cache-bytes 1MiB --semantic-cache-model /nonexistent",
            "--semantic-cache-model"},
           {"--response-cache-bytes 1MiB --semantic-cache-default sometimes",
            "--semantic-cache-default"},
       }) {
    const testing::CommandResult r = testing::RunCommand(base + flags + " 2>&1");
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_THAT(r.out, HasSubstr(want)) << flags;
  }
}

}  // namespace
}  // namespace kvserve
