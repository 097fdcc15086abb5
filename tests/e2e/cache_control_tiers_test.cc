// Cache control with the KV tiers and through the chat front end, against
// live daemons (issue 23):
// - a retained prefix whose lease lapsed leaves the primary pool for the
//   host tier and from there for the disk tier (a retained block counts as
//   proven useful), so it is still a hit after pressure that drops every
//   other once-used prefix;
// - retention survives a warm restart where the disk tier holds it: daemon
//   A retains and stops, daemon B on the same model lists the lease
//   (`kvserve-cli cache list`, tier disk, the TTL continuing), hits it from
//   disk, and the lease moves to the pool; a lease that expired while
//   stopped is dropped; a torn table and a table of another fingerprint are
//   ignored with a log line;
// - a public prefix demoted to the host tier is still every tenant's hit
//   (blocks are named across the tiers as in the pool) while what a tenant
//   appended to it stays that tenant's;
// - the template-drift guard through /v1/chat/completions: a fixture
//   template that shows an empty think block on the turn being generated
//   and drops it from past turns makes the second turn report "diverged at
//   token N" with N the first token where the two renderings differ
//   (tokenized here with the model's own tokenizer), and with
//   --chat-canonicalize-history the second turn hits the cached first turn.
#include <signal.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

using Reply = testing::HttpReply;
using testing::CachedTokens;
using testing::Completion;
using testing::HttpPost;
using testing::Words;

std::unique_ptr<testing::Daemon> Start(const std::string& model,
                                       const std::vector<std::string>& serve_flags) {
  return testing::StartServe(KVSERVE_BINARY, model, "info", {"--drain-timeout", "2"}, serve_flags);
}

json Explain(int port, const std::string& prompt, const std::string& key = "") {
  const Reply r = HttpPost(port, "/admin/cache/explain", {{"prompt", prompt}}, key);
  EXPECT_EQ(r.status, 200) << r.raw;
  return r.body;
}

// 96 token ids starting with `first` (stories260K's vocabulary is 512).
// Prompts with distinct first tokens share no partly matched first block,
// from which the tiers would not continue a match (KvTiers::Lookup works
// from block boundaries).
json Ids(int first, int seed) {
  json ids = json::array({first});
  uint32_t x = 2654435761u * static_cast<uint32_t>(seed + 1);
  for (int i = 1; i < 96; ++i) {
    x = x * 1664525u + 1013904223u;
    ids.push_back(3 + static_cast<int>((x >> 16) % 480));
  }
  return ids;
}

TEST(CacheControlTiersE2eTest, ALapsedRetainedPrefixIsDemotedNotDropped) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string root = testing::TempDir() + "/cc-tiers-demote";
  std::filesystem::remove_all(root);
  // A small pool, a host tier of a few blocks, a disk tier under it.
  auto d = Start(testing::Stories260KPath(),
                 {"--kv-cache-memory", "320KiB", "--kv-host-memory", "48KiB", "--kv-disk-dir",
                  root + "/disk", "--kv-disk-bytes", "16MiB"});
  ASSERT_TRUE(d);
  const int port = d->http_port();
  const json p = Ids(500, 1);
  auto explain = [&](const json& ids) {
    const Reply r = HttpPost(port, "/admin/cache/explain", {{"prompt_ids", ids}});
    EXPECT_EQ(r.status, 200) << r.raw << d->Log();
    return r.body;
  };
  auto complete = [&](const json& ids) {
    return HttpPost(port, "/v1/completions",
                    {{"prompt", ids}, {"max_tokens", 1}, {"temperature", 0}});
  };
  // Computed once by the retain call itself: its blocks are never hit, so
  // unretained they would not qualify for the disk tier.
  const Reply g = HttpPost(port, "/admin/cache/retain", {{"prompt_ids", p}, {"ttl_s", 1.5}});
  ASSERT_EQ(g.status, 200) << g.raw;
  ASSERT_EQ(g.body["outcome"], "granted") << g.raw;
  const int kept = g.body["tokens"].get<int>();
  ASSERT_EQ(kept, 96) << g.raw;
  // Pressure while it is retained: it stays in the pool.
  for (int i = 0; i < 8; ++i) ASSERT_EQ(complete(Ids(3 + i, 100 + i)).status, 200);
  json ex = explain(p);
  EXPECT_EQ(ex["cached_by_tier"]["primary"].get<int>(), kept - 1) << ex.dump();
  // The lease lapses (the idle engine checks once a second), then more
  // pressure pushes it out of the pool and through the small host tier.
  std::this_thread::sleep_for(std::chrono::milliseconds(2600));
  for (int i = 8; i < 24; ++i) ASSERT_EQ(complete(Ids(3 + i, 100 + i)).status, 200);
  ex = explain(p);
  EXPECT_EQ(ex["cached_by_tier"]["primary"].get<int>(), 0) << "evicted: " << ex.dump();
  EXPECT_EQ(ex["cached_tokens"].get<int>(), kept - 1) << "demoted, not dropped: " << ex.dump();
  EXPECT_GT(ex["cached_by_tier"]["disk"].get<int>(), 0) << ex.dump();
  // The request reuses it (loaded from the tiers; the last token is computed).
  const Reply r = complete(p);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), kept - 1)
      << r.raw;
  // The once-used pressure prompts went nowhere below the host tier.
  const json early = explain(Ids(3 + 8, 100 + 8));
  EXPECT_EQ(early["cached_by_tier"]["disk"].get<int>(), 0) << early.dump();
}

TEST(CacheControlTiersE2eTest, ADemotedPublicPrefixIsEveryTenantsHitThePrivatePartStaysPrivate) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string keys = testing::TempDir() + "/cc-tiers-keys.txt";
  std::ofstream(keys) << "alice-key alice\nbob-key bob\n";
  // The public prefix's own lease lapses after 1 s (--cache-retain-max-ttl).
  auto d = Start(testing::Stories260KPath(),
                 {"--kv-cache-memory", "320KiB", "--kv-host-memory", "4MiB", "--api-key",
                  "operator-key", "--api-keys-file", keys, "--cache-retain-max-ttl", "1"});
  ASSERT_TRUE(d);
  const int port = d->http_port();
  const std::string system = Words("shared system prompt", 7, 80);
  const Reply mark = HttpPost(port, "/admin/cache/public", {{"prompt", system}}, "operator-key");
  ASSERT_EQ(mark.status, 200) << mark.raw;
  const int pub = mark.body["public_tokens"].get<int>();
  ASSERT_GE(pub, 32) << mark.raw;
  const std::string a_prompt = system + " Alice asks about lanterns and the meadow by the harbor.";
  const Reply a1 = HttpPost(port, "/v1/completions", Completion(a_prompt), "alice-key");
  ASSERT_EQ(a1.status, 200) << a1.raw;
  EXPECT_GE(CachedTokens(a1), pub);
  // The lease lapses; pressure moves everything to the host tier.
  std::this_thread::sleep_for(std::chrono::milliseconds(2200));
  for (int i = 0; i < 16; ++i) {
    ASSERT_EQ(
        HttpPost(port, "/v1/completions", Completion(Words("pressure", i)), "alice-key").status,
        200);
  }
  // B, who never sent it, finds the public part in the host tier.
  const std::string b_prompt = system + " Bob wonders about quills.";
  const json ex = Explain(port, b_prompt, "bob-key");
  EXPECT_EQ(ex["cached_by_tier"]["primary"].get<int>(), 0) << "evicted: " << ex.dump();
  EXPECT_GE(ex["cached_by_tier"]["host"].get<int>(), pub) << ex.dump();
  const Reply b1 = HttpPost(port, "/v1/completions", Completion(b_prompt), "bob-key");
  ASSERT_EQ(b1.status, 200) << b1.raw;
  EXPECT_GE(CachedTokens(b1), pub) << "B reuses the demoted public prefix: " << b1.raw;
  // A's continuation (demoted too) is A's: B gets the public part and at
  // most the leading tokens of one block its own prompt shares with A's.
  const Reply b2 = HttpPost(port, "/v1/completions", Completion(a_prompt), "bob-key");
  EXPECT_GE(CachedTokens(b2), pub);
  EXPECT_LT(CachedTokens(b2), pub + 16) << "B gets the public part only: " << b2.raw;
  const Reply a2 = HttpPost(port, "/v1/completions", Completion(a_prompt), "alice-key");
  EXPECT_GE(CachedTokens(a2), pub + 16)
      << "A hits its private continuation from the tier: " << a2.raw;
  // Back in the pool, the public part is public again (explain counts it).
  const json ex2 = Explain(port, b_prompt + " more", "alice-key");
  EXPECT_EQ(ex2["public_tokens"].get<int>(), pub) << ex2.dump();
  std::remove(keys.c_str());
}

json CliList(int grpc_port) {
  const testing::CommandResult r = testing::RunCommand(
      absl::StrFormat("%s -a 127.0.0.1:%d cache list 2>&1", KVSERVE_CLI_BINARY, grpc_port));
  EXPECT_EQ(r.exit_code, 0) << r.out;
  return json::parse(r.out, nullptr, false);
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string FindRetentionTable(const std::string& disk) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(disk)) {
    if (e.path().filename() == "retention.tbl") return e.path().string();
  }
  return "";
}

TEST(CacheControlTiersE2eTest, RetentionSurvivesAWarmRestartOnTheDiskTier) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string root = testing::TempDir() + "/cc-tiers-restart";
  std::filesystem::remove_all(root);
  const std::string disk = root + "/disk";
  const std::vector<std::string> flags = {"--kv-cache-memory", "320KiB", "--kv-disk-dir", disk,
                                          "--kv-disk-bytes", "16MiB"};
  const std::string p = Words("restart-retained", 2);
  const std::string brief = Words("brief-retained", 3, 40);
  int kept = 0;
  {
    auto a = Start(testing::Stories260KPath(), flags);
    ASSERT_TRUE(a);
    const Reply g =
        HttpPost(a->http_port(), "/admin/cache/retain", {{"prompt", p}, {"ttl_s", 600}});
    ASSERT_EQ(g.status, 200) << g.raw;
    kept = g.body["tokens"].get<int>();
    ASSERT_GE(kept, 64) << g.raw;
    const Reply s =
        HttpPost(a->http_port(), "/admin/cache/retain", {{"prompt", brief}, {"ttl_s", 1}});
    ASSERT_EQ(s.status, 200) << s.raw;
    EXPECT_EQ(a->StopWith(SIGTERM, 20), 0) << a->Log();
    EXPECT_THAT(a->Log(), HasSubstr("2 leases written")) << a->Log();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // the 1 s lease lapses
  const std::string table = FindRetentionTable(disk);
  ASSERT_FALSE(table.empty());
  const std::string good = ReadFile(table);
  {
    auto b = Start(testing::Stories260KPath(), flags);
    ASSERT_TRUE(b);
    EXPECT_THAT(b->Log(), HasSubstr("1 leases restored")) << b->Log();
    EXPECT_THAT(b->Log(), HasSubstr("1 expired while stopped")) << b->Log();
    const json l = CliList(b->grpc_port());
    ASSERT_TRUE(l.is_object() && l["leases"].size() == 1) << l.dump();
    EXPECT_EQ(l["leases"][0]["tier"], "disk") << l.dump();
    EXPECT_EQ(l["leases"][0]["tokens"].get<int>(), kept);
    const double left = l["leases"][0]["remaining_s"].get<double>();
    EXPECT_LT(left, 600) << "the TTL continues";
    EXPECT_GT(left, 500);
    // Hit from the disk tier.
    json req = Completion(p);
    req["cache_report"] = true;
    const Reply r = HttpPost(b->http_port(), "/v1/completions", req);
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), kept) << r.raw;
    EXPECT_EQ(r.body["kvserve_cache_control"]["report"]["cached_by_tier"]["disk"].get<int>(), kept)
        << r.raw;
    // Loaded into the pool, the lease pins it there now.
    const Reply again = HttpPost(b->http_port(), "/v1/completions", Completion(p));
    ASSERT_EQ(again.status, 200);
    const json l2 = CliList(b->grpc_port());
    ASSERT_EQ(l2["leases"].size(), 1u) << l2.dump();
    EXPECT_EQ(l2["leases"][0]["tier"], "primary") << l2.dump();
    EXPECT_EQ(b->StopWith(SIGTERM, 20), 0) << b->Log();
  }
  // A torn table: ignored, said so, nothing restored.
  {
    std::ofstream(table, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() / 2);
    auto c = Start(testing::Stories260KPath(), flags);
    ASSERT_TRUE(c);
    EXPECT_THAT(c->Log(), HasSubstr("retention table")) << c->Log();
    EXPECT_THAT(c->Log(), HasSubstr("ignored")) << c->Log();
    EXPECT_EQ(CliList(c->grpc_port())["leases"].size(), 0u);
    c->StopWith(SIGKILL, 5);  // no shutdown write: the next start reads the table below
  }
  // A well-formed table written for another fingerprint.
  {
    std::string body = "kvserve-retention 1\nfingerprint 0123456789abcdef\nend 0\n";
    body += absl::StrFormat("checksum %016x\n", XXH3_64bits(body.data(), body.size()));
    std::ofstream(table, std::ios::binary | std::ios::trunc) << body;
    auto c = Start(testing::Stories260KPath(), flags);
    ASSERT_TRUE(c);
    EXPECT_THAT(c->Log(), HasSubstr("written for another model")) << c->Log();
    EXPECT_EQ(CliList(c->grpc_port())["leases"].size(), 0u);
  }
}

// Qwen3-style: the turn being generated opens with an empty think block,
// past assistant turns render without it.
constexpr char kDriftingTemplate[] =
    "{%- for m in messages -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}";

std::string Render(const std::vector<std::pair<std::string, std::string>>& msgs) {
  std::string s;
  for (const auto& [role, content] : msgs) {
    s += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
  }
  return s + "<|im_start|>assistant\n<think>\n\n</think>\n\n";
}

TEST(CacheControlTiersE2eTest, TemplateDriftDivergesAtTheRightTokenAndCanonicalizationHits) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::string tpl = testing::TempDir() + "/drifting-template.jinja";
  std::ofstream(tpl, std::ios::binary | std::ios::trunc) << kDriftingTemplate;
  auto gguf = GgufFile::Open(model);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto tok = Tokenizer::FromGguf(**gguf);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<std::pair<std::string, std::string>> turn1 = {
      {"system", "You are a careful assistant who answers in one short sentence."},
      {"user", "Name three rivers in Europe, please."}};
  for (bool canonicalize : {false, true}) {
    SCOPED_TRACE(canonicalize ? "canonicalize" : "plain");
    std::vector<std::string> flags = {"--kv-cache-memory", "64MiB", "--chat-template", tpl};
    if (canonicalize) flags.push_back("--chat-canonicalize-history");
    auto d = Start(model, flags);
    ASSERT_TRUE(d);
    auto messages = [](const std::vector<std::pair<std::string, std::string>>& m) {
      json a = json::array();
      for (const auto& [role, content] : m) a.push_back({{"role", role}, {"content", content}});
      return a;
    };
    const Reply r1 =
        HttpPost(d->http_port(), "/v1/chat/completions",
                 {{"messages", messages(turn1)}, {"max_tokens", 8}, {"temperature", 0}});
    ASSERT_EQ(r1.status, 200) << r1.raw;
    const std::string reply = r1.body["choices"][0]["message"]["content"];
    ASSERT_FALSE(reply.empty()) << r1.raw;
    auto turn2 = turn1;
    turn2.push_back({"assistant", reply});
    turn2.push_back({"user", "And which is the longest?"});
    // Where the two renderings part, in the model's tokens.
    const std::vector<int32_t> t1 = (*tok)->Encode(Render(turn1), false, true);
    std::string r2 = Render(turn2);
    const std::vector<int32_t> t2 = (*tok)->Encode(r2, false, true);
    size_t n = 0;
    while (n < t1.size() && n < t2.size() && t1[n] == t2[n]) ++n;
    ASSERT_LT(n, t1.size()) << "the template drifts";
    ASSERT_GT(n, 16u);
    const Reply r = HttpPost(d->http_port(), "/v1/chat/completions",
                             {{"messages", messages(turn2)},
                              {"max_tokens", 1},
                              {"temperature", 0},
                              {"cache_report", true}});
    ASSERT_EQ(r.status, 200) << r.raw;
    const json rep = r.body["kvserve_cache_control"]["report"];
    const int cached = r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
    if (!canonicalize) {
      EXPECT_EQ(rep["reason"], "template_drift") << r.raw;
      ASSERT_TRUE(rep["diverged_at"].is_number_integer()) << r.raw;
      EXPECT_EQ(rep["diverged_at"].get<size_t>(), n) << r.raw;
      EXPECT_EQ(cached, static_cast<int>(n)) << r.raw;
      EXPECT_THAT(d->Log(), HasSubstr("chat template drift")) << "logged";
    } else {
      // The history is sent as the cached turn had it: all of turn 1's
      // prompt is reused, past the point where the plain rendering left it.
      EXPECT_NE(rep["reason"], "template_drift") << r.raw;
      // (The turn's last tokens, "\n\n" then the reply, may split
      // differently from the generated ones.)
      EXPECT_GE(cached, static_cast<int>(t1.size()) - 2) << r.raw;
      EXPECT_GT(cached, static_cast<int>(n)) << r.raw;
    }
  }
}

TEST(CacheControlTiersE2eTest, BadChatTemplateFilesStopStartUpNamingTheFlag) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string bad = testing::TempDir() + "/bad-template.jinja";
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << "{% for m in messages %}{{ m.content ";
  for (const std::string& file : {std::string("/nonexistent/template.jinja"), bad}) {
    const testing::CommandResult r = testing::RunCommand(
        std::string(KVSERVE_BINARY) + " -m " + testing::Stories260KPath() +
        " serve --grpc-address 127.0.0.1:0 --http-port 0 --chat-template " + file + " 2>&1");
    EXPECT_NE(r.exit_code, 0) << r.out;
    EXPECT_THAT(r.out, HasSubstr("--chat-template")) << r.out;
  }
}


}  // namespace
}  // namespace kvserve
