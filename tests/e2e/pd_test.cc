// Prefill/decode disaggregation end to end, with real processes on
// 127.0.0.1 (stories260K): a `both` node gives the reference outputs; a
// prefill node, a decode node and `kvserve route` must reproduce them
// exactly, through UCX pulls, with and without prefix-cache hits. Then the
// faults: a prefill node that frees leased blocks early (the generation
// fence must catch every one), leases nobody claims (expiry), a decode node
// killed or stopped past the ttl, a prefill node killed after granting and
// restarted on the same port (new incarnation), duplicate, reordered and
// stale releases and attaches, bad leases (forged blocks or endpoint,
// unknown, malformed, other layout), a pull slower than the lease's ttl
// (renewed meanwhile), a decode node too small for the lease, the router
// killed in each protocol state, and a dead prefill node the router retries
// around. Chat goes through the router disaggregated too. After each fault:
// every survivor's free blocks are back at baseline. The router's HTTP front
// end: /v1/models, /metrics, 404/405, keep-alive upstream connections reused
// across requests, and a client gone mid-stream cancelling on the node.
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"
#include "proto/pd.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"
#include "tests/unit/model/cuda_test_skip.h"

namespace kvserve {
namespace {

namespace v1 = ::kvserve::v1;
namespace pdv1 = ::kvserve::pd::v1;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

constexpr int kMaxTokens = 12;

// The daemon under test: the build's, or KVSERVE_BINARY from the
// environment (deploy/gpu-check.sh runs this test from a pack).
std::string Binary() {
  const char* env = std::getenv("KVSERVE_BINARY");
  return env != nullptr && *env != '\0' ? env : KVSERVE_BINARY;
}

// stories260K when ../shared has it, else a tiny Llama with random weights
// that the suite writes (written once per process): for the tests that only
// compare nodes with each other or check a refusal, so they run in a clone
// without ../shared too.
std::string Stories260KOrWritten() {
  const std::string stories = testing::Stories260KPath();
  if (!stories.empty()) return stories;
  static const std::string written = [] {
    const std::string path = testing::TempDir() + "/pd-tiny-llama.gguf";
    std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf({});
    return path;
  }();
  return written;
}

std::vector<std::string> GlobalArgs(const std::string& model = testing::Stories260KPath()) {
  return {"--log-level", "info", "-t", "1", "-m", model};
}

std::vector<std::string> NodeArgs(const std::string& role, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--role", role, "--drain-timeout", "2", "--pd-transfer-timeout",
                                "3", "--pd-test-hooks"};
  if (std::find(extra.begin(), extra.end(), "--kv-cache-memory") == extra.end()) {
    a.insert(a.end(), {"--kv-cache-memory", "16MiB"});
  }
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::unique_ptr<testing::Daemon> StartNode(const std::string& role,
                                           std::vector<std::string> extra = {},
                                           const std::string& model = testing::Stories260KPath()) {
  auto d = testing::Daemon::Start(Binary(), GlobalArgs(model), NodeArgs(role, std::move(extra)));
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? std::move(d).value() : nullptr;
}

struct Client {
  explicit Client(int port) {
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                  grpc::InsecureChannelCredentials());
    api = v1::Kvserve::NewStub(channel);
    pdx = pdv1::KvTransfer::NewStub(channel);
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvserve::Stub> api;
  std::unique_ptr<pdv1::KvTransfer::Stub> pdx;

  v1::GenerateRequest Request(const std::string& prompt) const {
    v1::GenerateRequest r;
    r.set_prompt(prompt);
    r.mutable_sampling()->set_max_tokens(kMaxTokens);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }
  // Greedy token ids, or the error as text.
  std::string Generate(const std::string& prompt, int32_t* cached = nullptr,
                       int32_t* cached_host = nullptr, int32_t* cached_lossy = nullptr) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 60s);
    auto reader = api->Generate(&c, Request(prompt));
    v1::GenerateResponse resp;
    std::string ids;
    while (reader->Read(&resp)) {
      for (int32_t t : resp.token_ids()) ids += std::to_string(t) + " ";
      if (resp.has_usage() && cached) *cached = resp.usage().cached_prompt_tokens();
      if (resp.has_usage() && cached_host) *cached_host = resp.usage().cached_host_tokens();
      if (resp.has_usage() && cached_lossy) *cached_lossy = resp.usage().cached_lossy_tokens();
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) return "error: " + s.error_message();
    return ids;
  }
  // Prompt tokens of `text` on this node.
  int CountTokens(const std::string& text) {
    v1::TokenizeRequest t;
    t.set_text(text);
    v1::TokenizeResponse resp;
    grpc::ClientContext c;
    EXPECT_TRUE(api->Tokenize(&c, t, &resp).ok());
    return resp.token_ids_size();
  }
  v1::ChatRequest ChatRequest(const std::string& user) const {
    v1::ChatRequest r;
    auto* m = r.add_messages();
    m->set_role("system");
    m->set_content("You tell short stories about animals and children.");
    m = r.add_messages();
    m->set_role("user");
    m->set_content(user);
    r.mutable_sampling()->set_max_tokens(kMaxTokens);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }
  // Greedy token ids of a chat reply, or the error as text.
  std::string Chat(const std::string& user) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 60s);
    auto reader = api->Chat(&c, ChatRequest(user));
    v1::GenerateResponse resp;
    std::string ids;
    while (reader->Read(&resp)) {
      for (int32_t t : resp.token_ids()) ids += std::to_string(t) + " ";
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) return "error: " + s.error_message();
    return ids;
  }
  v1::Stats Stats() {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::Stats s;
    EXPECT_TRUE(api->GetStats(&c, v1::GetStatsRequest(), &s).ok());
    return s;
  }
  pdv1::NodeInfo Info() {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 5s);
    pdv1::NodeInfo i;
    EXPECT_TRUE(pdx->GetNodeInfo(&c, pdv1::GetNodeInfoRequest(), &i).ok());
    return i;
  }
  grpc::Status Prefill(const std::string& prompt, pdv1::Lease* lease, uint32_t ttl_ms = 0,
                       bool progressive = false) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 30s);
    pdv1::PrefillRequest r;
    r.set_generate_request(Request(prompt).SerializeAsString());
    r.set_ttl_ms(ttl_ms);
    r.set_progressive(progressive);
    return pdx->Prefill(&c, r, lease);
  }
  // RenewLease with progress: the lease's blocks past `have`.
  grpc::Status Progress(const pdv1::Lease& l, int32_t have, uint32_t wait_ms,
                        pdv1::RenewLeaseResponse* out) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 10s);
    pdv1::RenewLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    r.set_digest(l.digest());
    r.set_progress(true);
    r.set_have_blocks(have);
    r.set_wait_ms(wait_ms);
    return pdx->RenewLease(&c, r, out);
  }
  // Polls a progressive lease until it is complete: its blocks in order.
  std::vector<int32_t> ProgressToCompletion(const pdv1::Lease& l, int* answers = nullptr) {
    std::vector<int32_t> ids;
    for (int i = 0; i < 200; ++i) {
      pdv1::RenewLeaseResponse r;
      grpc::Status s = Progress(l, static_cast<int32_t>(ids.size()), 500, &r);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) break;
      if (answers != nullptr) ++*answers;
      ids.insert(ids.end(), r.block_ids().begin(), r.block_ids().end());
      if (r.complete()) break;
    }
    return ids;
  }
  grpc::Status Attach(const pdv1::Lease& lease) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 10s);
    pdv1::AttachLeaseResponse r;
    return pdx->AttachLease(&c, lease, &r);
  }
  grpc::Status Release(uint64_t id, uint64_t incarnation, bool* released = nullptr) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 5s);
    pdv1::ReleaseLeaseRequest r;
    r.set_transfer_id(id);
    r.set_incarnation(incarnation);
    pdv1::ReleaseLeaseResponse resp;
    grpc::Status s = pdx->ReleaseLease(&c, r, &resp);
    if (released) *released = resp.released();
    return s;
  }
  grpc::Status EarlyFree(const pdv1::Lease& l) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 10s);
    pdv1::ReleaseLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    pdv1::ReleaseLeaseResponse resp;
    return pdx->DebugEarlyFree(&c, r, &resp);
  }
  // Waits until no block is pinned (free or cached-evictable == total) and
  // no lease is held; false after 15 s.
  bool AtBaseline() {
    const auto deadline = std::chrono::steady_clock::now() + 15s;
    while (std::chrono::steady_clock::now() < deadline) {
      const v1::Stats s = Stats();
      const pdv1::NodeInfo i = Info();
      if (s.blocks_free() == s.blocks_total() && s.running() == 0 && s.waiting() == 0 &&
          s.kv_arriving() == 0 && i.leases_active() == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
};

// A prompt set with shared prefixes (five "tenants" of ~60 tokens each) and
// distinct tails, so leases span several blocks and repeats hit the caches.
std::vector<std::string> Prompts(int n, const std::string& tag = "") {
  const char* prefixes[] = {
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends.",
      "One day, a big brown dog came to the garden. The dog was very happy and wanted to play "
      "with the ball.",
      "Tom and Sue went to the beach with their mom. They saw a big red boat on the water and "
      "waved at it.",
      "There was a small bird who lived in a tall tree. Every morning the bird sang a song to "
      "the sun.",
      "Ben had a new toy car. He liked to drive it on the floor and make loud noises with his "
      "mouth."};
  const char* tails[] = {"Then", "But one day", "After that", "Suddenly", "So"};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::string(prefixes[i % 5]) + tag + " " + tails[(i / 5) % 5] + " number " +
                  std::to_string(i) + ",");
  }
  return out;
}

// Prompts whose first block is their own (a leading number), so no node
// holds any of their blocks before: every leased block is pulled.
std::vector<std::string> UniquePrompts(int n, const std::string& tag) {
  std::vector<std::string> base = Prompts(n);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(tag + " " + std::to_string(i) + ": " + base[i]);
  return out;
}

std::string Addr(const testing::Daemon* d) {
  return "127.0.0.1:" + std::to_string(d->grpc_port());
}

// A router over `nodes`; waits until `want_up` nodes are registered (its
// /health counts them).
std::unique_ptr<testing::Daemon> StartRouter(const std::vector<const testing::Daemon*>& nodes,
                                             std::vector<std::string> extra, int want_up) {
  std::string list;
  for (const auto* n : nodes) list += (list.empty() ? "" : ",") + Addr(n);
  std::vector<std::string> args = {"--nodes", list};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = testing::Daemon::StartSubcommand(Binary(), {"--log-level", "info"}, "route", args);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  httplib::Client h("127.0.0.1", (*r)->http_port());
  for (int i = 0; i < 300; ++i) {
    auto res = h.Get("/health");
    if (res) {
      const nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
      int up = 0;
      if (j.is_object() && j.contains("nodes")) {
        for (const auto& n : j["nodes"]) up += n.value("up", false) ? 1 : 0;
      }
      if (up >= want_up) return std::move(r).value();
    }
    std::this_thread::sleep_for(50ms);
  }
  ADD_FAILURE() << "router: fewer than " << want_up << " nodes registered";
  return std::move(r).value();
}

nlohmann::json RouterHealth(const testing::Daemon* r) {
  httplib::Client h("127.0.0.1", r->http_port());
  auto res = h.Get("/health");
  return res ? nlohmann::json::parse(res->body, nullptr, false) : nlohmann::json();
}

// Waits until the daemon's log contains `text`; false after 30 s.
bool WaitForLog(const testing::Daemon* d, const std::string& text) {
  for (int i = 0; i < 600; ++i) {
    if (d->Log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

class PdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Block counts, prefix hits and lease sizes here are stories260K's.
    if (testing::Stories260KPath().empty()) return;
    both_ = StartNode("both").release();
    prefill_ = StartNode("prefill").release();
    decode_ = StartNode("decode").release();
    ASSERT_TRUE(both_ && prefill_ && decode_);
    auto r =
        testing::Daemon::StartSubcommand(Binary(), {"--log-level", "info"}, "route",
                                         {"--nodes",
                                          "127.0.0.1:" + std::to_string(prefill_->grpc_port()) +
                                              ",127.0.0.1:" + std::to_string(decode_->grpc_port()),
                                          "--pd-mode", "always", "--pd-overlap", "on"});
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = r->release();
    WaitForRouter();
  }
  static void TearDownTestSuite() {
    delete router_;
    delete decode_;
    delete prefill_;
    delete both_;
  }
  void SetUp() override {
    KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
    if (both_ == nullptr || router_ == nullptr) GTEST_SKIP() << "daemons did not start";
  }
  // The reference: the same prompt on the `both` node.
  static std::string Reference(const std::string& prompt) {
    return Client(both_->grpc_port()).Generate(prompt);
  }
  // Waits until the router has registered its nodes (the first request
  // otherwise finds none).
  static void WaitForRouter() {
    Client r(router_->grpc_port());
    for (int i = 0; i < 200; ++i) {
      v1::TokenizeRequest t;
      t.set_text("x");
      v1::TokenizeResponse resp;
      grpc::ClientContext c;
      if (r.api->Tokenize(&c, t, &resp).ok()) {
        std::this_thread::sleep_for(700ms);  // both nodes polled
        return;
      }
      std::this_thread::sleep_for(50ms);
    }
  }

  static testing::Daemon* both_;
  static testing::Daemon* prefill_;
  static testing::Daemon* decode_;
  static testing::Daemon* router_;
};
testing::Daemon* PdTest::both_ = nullptr;
testing::Daemon* PdTest::prefill_ = nullptr;
testing::Daemon* PdTest::decode_ = nullptr;
testing::Daemon* PdTest::router_ = nullptr;

TEST_F(PdTest, RouterPrefillDecodeOutputsEqualOneNode) {
  Client router(router_->grpc_port()), p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::vector<std::string> prompts = Prompts(100);
  std::vector<std::string> want;
  for (const auto& s : prompts) want.push_back(Reference(s));
  // Pass 1: prefix hits come from the five shared prefixes (on both sides);
  // pass 2 repeats every prompt (everything cached on the decode node).
  for (int pass = 0; pass < 2; ++pass) {
    const pdv1::NodeInfo before = d.Info();
    int mismatches = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string got = router.Generate(prompts[i]);
      EXPECT_EQ(got, want[i]) << "pass " << pass << " prompt " << i;
      mismatches += got != want[i];
    }
    EXPECT_EQ(mismatches, 0);
    const pdv1::NodeInfo after = d.Info();
    EXPECT_EQ(after.generation_mismatches(), before.generation_mismatches());
    EXPECT_EQ(after.transfers_failed(), before.transfers_failed());
    if (pass == 0) {
      // A figure, not an assertion: what the pulls achieved on this machine.
      std::printf("pass 1: %lld transfers, %lld blocks, %.1f MB in %.3f s of pulls (%.1f MB/s)\n",
                  static_cast<long long>(after.transfers_ok() - before.transfers_ok()),
                  static_cast<long long>(after.blocks_pulled() - before.blocks_pulled()),
                  (after.bytes_pulled() - before.bytes_pulled()) / 1e6,
                  after.pull_seconds() - before.pull_seconds(),
                  (after.bytes_pulled() - before.bytes_pulled()) / 1e6 /
                      std::max(1e-9, after.pull_seconds() - before.pull_seconds()));
      EXPECT_GT(after.leases_attached() - before.leases_attached(), 90);
      EXPECT_GT(after.transfers_ok() - before.transfers_ok(), 0);
      EXPECT_GT(after.blocks_pulled() - before.blocks_pulled(), 0);
    } else {
      // Only blocks the decode node lacks move: it holds every prompt now.
      EXPECT_EQ(after.blocks_pulled(), before.blocks_pulled());
    }
  }
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
  EXPECT_GT(p.Info().leases_granted(), 150);
  // This router asks for progressive leases (--pd-overlap on).
  EXPECT_GT(p.Info().progressive_leases(), 150);
  EXPECT_GT(d.Info().exposed_pull_seconds(), 0);
}

// Overlap: a progressive lease is granted before the prompt's KV exists,
// reports its blocks as the prefill commits them, and what the decode node
// pulls from it equals the single node's output.
TEST_F(PdTest, ProgressiveLeaseReportsBlocksAsThePrefillCommitsThem) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::string prompt = UniquePrompts(1, "Progressive lease")[0];
  const pdv1::NodeInfo p0 = p.Info(), d0 = d.Info();
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease, 0, /*progressive=*/true).ok());
  EXPECT_TRUE(lease.progressive());
  EXPECT_EQ(lease.block_ids_size(), 0);  // granted before any block was pinned
  const int32_t bs = p.Info().layout().block_size();
  ASSERT_GT(lease.tokens_size(), 0);
  EXPECT_EQ(lease.tokens_size() % bs, 0);
  int answers = 0;
  const std::vector<int32_t> ids = p.ProgressToCompletion(lease, &answers);
  EXPECT_EQ(static_cast<int>(ids.size()), lease.tokens_size() / bs);
  EXPECT_GE(answers, 1);
  EXPECT_EQ(p.Info().progress_answers() - p0.progress_answers(), answers);

  // Bad progress requests name the field; a whole lease has no progress.
  pdv1::RenewLeaseResponse r;
  grpc::Status s = p.Progress(lease, lease.tokens_size() / bs + 1, 0, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("have_blocks"));
  pdv1::Lease whole;
  ASSERT_TRUE(p.Prefill(UniquePrompts(2, "Whole lease")[1], &whole).ok());
  EXPECT_FALSE(whole.progressive());
  s = p.Progress(whole, 0, 0, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("whole lease"));
  (void)p.Release(whole.transfer_id(), whole.incarnation());
  // A progressive lease whose tokens are not whole blocks is refused.
  pdv1::Lease cut = lease;
  cut.mutable_tokens()->RemoveLast();
  s = d.Attach(cut);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("progressive"));

  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  const pdv1::NodeInfo d1 = d.Info();
  EXPECT_EQ(d1.transfers_ok(), d0.transfers_ok() + 1);
  EXPECT_EQ(d1.blocks_pulled() - d0.blocks_pulled(), lease.tokens_size() / bs);
  EXPECT_EQ(d1.generation_mismatches(), d0.generation_mismatches());
  EXPECT_EQ(p.Info().progressive_leases(), p0.progressive_leases() + 1);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

TEST_F(PdTest, ProgressiveLeaseEarlyFreeIsCaughtByTheGenerationFence) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::vector<std::string> prompts = UniquePrompts(5, "Progressive early free");
  const pdv1::NodeInfo before = d.Info();
  const int64_t frees_before = p.Info().early_frees();
  for (const auto& prompt : prompts) {
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease, 0, true).ok());
    ASSERT_TRUE(lease.progressive());
    ASSERT_FALSE(p.ProgressToCompletion(lease).empty());
    ASSERT_TRUE(p.EarlyFree(lease).ok());
    ASSERT_TRUE(d.Attach(lease).ok());
    EXPECT_EQ(d.Generate(prompt), Reference(prompt)) << prompt;
    (void)p.Release(lease.transfer_id(), lease.incarnation());
  }
  const pdv1::NodeInfo after = d.Info();
  EXPECT_EQ(after.generation_mismatches() - before.generation_mismatches(), 5);
  EXPECT_EQ(p.Info().early_frees() - frees_before, 5);
  EXPECT_EQ(after.transfers_ok(), before.transfers_ok());
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A slow prefill (--pd-test-progress-delay reveals block i of n at (i + 1)
// / n of the delay): progress answers come block by block, and the decode
// node reads blocks before the lease is complete.
TEST_F(PdTest, ProgressiveLeaseOnASlowPrefillIsPulledBlockByBlock) {
  auto slow = StartNode("prefill", {"--pd-test-progress-delay", "1.5"});
  ASSERT_TRUE(slow);
  Client p(slow->grpc_port()), d(decode_->grpc_port());
  const int32_t bs = p.Info().layout().block_size();
  const std::vector<std::string> prompts = UniquePrompts(2, "Block by block");
  // Polled by hand: the first answer holds some blocks, not all.
  pdv1::Lease lease;
  grpc::Status granted = p.Prefill(prompts[0], &lease, 0, true);
  ASSERT_TRUE(granted.ok()) << granted.error_message();
  const int32_t total = lease.tokens_size() / bs;
  ASSERT_GE(total, 2);
  pdv1::RenewLeaseResponse first;
  ASSERT_TRUE(p.Progress(lease, 0, 1000, &first).ok());
  EXPECT_FALSE(first.complete());
  EXPECT_GE(first.block_ids_size(), 1);
  EXPECT_LT(first.block_ids_size(), total);
  int answers = 0;
  EXPECT_EQ(static_cast<int>(p.ProgressToCompletion(lease, &answers).size()), total);
  EXPECT_GE(answers, 2);
  (void)p.Release(lease.transfer_id(), lease.incarnation());
  // Pulled by the decode node: blocks are read while the prefill "runs".
  const pdv1::NodeInfo d0 = d.Info();
  ASSERT_TRUE(p.Prefill(prompts[1], &lease, 0, true).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompts[1]), Reference(prompts[1]));
  const pdv1::NodeInfo d1 = d.Info();
  EXPECT_EQ(d1.transfers_ok(), d0.transfers_ok() + 1);
  EXPECT_GE(d1.overlapped_blocks() - d0.overlapped_blocks(), 1);
  EXPECT_EQ(d1.blocks_pulled() - d0.blocks_pulled(), lease.tokens_size() / bs);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A slow prefill (--pd-test-progress-delay holds its blocks back): the
// decode node waits on progress; the prefill node dying, or the lease being
// released, meanwhile makes it recompute, and every survivor is at baseline.
TEST_F(PdTest, ProgressivePullWaitingOnADeadOrReleasedPrefillRecomputes) {
  Client d(decode_->grpc_port());
  for (const bool kill_it : {true, false}) {
    auto p3 = StartNode("prefill", {"--pd-test-progress-delay", "20"});
    ASSERT_TRUE(p3);
    Client p(p3->grpc_port());
    const std::string prompt =
        UniquePrompts(1, kill_it ? "Progressive prefill dies" : "Progressive released")[0];
    const pdv1::NodeInfo d0 = d.Info();
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease, 0, true).ok());
    ASSERT_TRUE(d.Attach(lease).ok());
    std::string got;
    std::thread gen([&] { got = d.Generate(prompt); });
    // The decode node's pull now waits on the prefill node's progress.
    for (int i = 0; i < 100 && d.Stats().kv_arriving() == 0; ++i) std::this_thread::sleep_for(20ms);
    EXPECT_EQ(d.Stats().kv_arriving(), 1);
    std::this_thread::sleep_for(300ms);
    if (kill_it) {
      p3->StopWith(SIGKILL, 5);
    } else {
      bool released = false;
      ASSERT_TRUE(p.Release(lease.transfer_id(), lease.incarnation(), &released).ok());
      EXPECT_TRUE(released);
    }
    gen.join();
    EXPECT_EQ(got, Reference(prompt));
    EXPECT_EQ(d.Info().transfers_failed(), d0.transfers_failed() + 1);
    EXPECT_TRUE(d.AtBaseline());
    if (!kill_it) EXPECT_TRUE(p.AtBaseline());  // the prefill was cancelled and freed
  }
}

// --pd-overlap off (the default): the router asks for whole leases,
// granted after the prefill; outputs are the same.
TEST_F(PdTest, RouterWithoutOverlapGrantsWholeLeases) {
  auto r2 = StartRouter({prefill_, decode_}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(r2);
  Client router(r2->grpc_port()), p(prefill_->grpc_port()), d(decode_->grpc_port());
  const pdv1::NodeInfo p0 = p.Info(), d0 = d.Info();
  for (const std::string& prompt : UniquePrompts(6, "No overlap")) {
    EXPECT_EQ(router.Generate(prompt), Reference(prompt));
  }
  const pdv1::NodeInfo p1 = p.Info();
  EXPECT_GE(p1.leases_granted() - p0.leases_granted(), 6);
  EXPECT_EQ(p1.progressive_leases(), p0.progressive_leases());
  EXPECT_GE(d.Info().transfers_ok() - d0.transfers_ok(), 6);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

TEST_F(PdTest, EarlyFreeOnPrefillIsCaughtByTheGenerationFence) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::vector<std::string> prompts = UniquePrompts(10, "Early free");
  const pdv1::NodeInfo before = d.Info();
  const int64_t frees_before = p.Info().early_frees();
  int leased_blocks = 0;
  for (const auto& prompt : prompts) {
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
    ASSERT_GT(lease.block_ids_size(), 0);
    leased_blocks += lease.block_ids_size();
    // The buggy prefill node frees (and reuses) the leased blocks but keeps
    // answering for the lease.
    ASSERT_TRUE(p.EarlyFree(lease).ok());
    ASSERT_TRUE(d.Attach(lease).ok());
    EXPECT_EQ(d.Generate(prompt), Reference(prompt)) << prompt;
    (void)p.Release(lease.transfer_id(), lease.incarnation());
  }
  const pdv1::NodeInfo after = d.Info();
  // 100%: every one of the ten transfers failed the fence and recomputed.
  EXPECT_EQ(after.generation_mismatches() - before.generation_mismatches(), 10);
  EXPECT_EQ(after.transfers_ok(), before.transfers_ok());
  EXPECT_EQ(p.Info().early_frees() - frees_before, 10);
  EXPECT_GT(leased_blocks, 10);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

TEST_F(PdTest, BadLeasesAreRefusedNamingTheProblem) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(UniquePrompts(1, "Bad input")[0], &lease).ok());
  ASSERT_GT(lease.block_ids_size(), 0);

  pdv1::Lease forged = lease;
  forged.set_generations(0, forged.generations(0) + 1);
  grpc::Status s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("forged"));

  forged = lease;
  forged.set_block_ids(0, (forged.block_ids(0) + 1) % 8);
  s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("digest mismatch"));

  pdv1::Lease unknown = lease;
  unknown.set_transfer_id(12345);
  s = d.Attach(unknown);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown transfer id 12345"));

  pdv1::Lease malformed = lease;
  malformed.mutable_generations()->RemoveLast();
  s = d.Attach(malformed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("lease.generations"));

  malformed = lease;
  malformed.set_transfer_id(0);
  s = d.Attach(malformed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("lease.transfer_id"));

  pdv1::Lease other_layout = lease;
  other_layout.mutable_layout()->set_block_size(32);
  s = d.Attach(other_layout);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("block_size 16 (here) vs 32 (peer)"));

  // Leases go to decode nodes only.
  s = p.Attach(lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("role is prefill"));

  // Release: once, then duplicates are harmless no-ops; a stale
  // incarnation and an id never granted are errors naming the problem.
  const int64_t dups = p.Info().duplicate_releases();
  bool released = false;
  EXPECT_TRUE(p.Release(lease.transfer_id(), lease.incarnation(), &released).ok());
  EXPECT_TRUE(released);
  EXPECT_TRUE(p.Release(lease.transfer_id(), lease.incarnation(), &released).ok());
  EXPECT_FALSE(released);
  EXPECT_TRUE(p.Release(lease.transfer_id(), lease.incarnation(), &released).ok());
  EXPECT_EQ(p.Info().duplicate_releases(), dups + 2);
  s = p.Release(lease.transfer_id(), lease.incarnation() + 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("stale incarnation"));
  s = p.Release(777, lease.incarnation());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown transfer id 777"));
  // The released lease cannot be attached any more.
  s = d.Attach(lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);

  // Nothing else was disturbed.
  const std::string prompt = UniquePrompts(3, "After bad input")[2];
  EXPECT_EQ(Client(router_->grpc_port()).Generate(prompt), Reference(prompt));
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

TEST_F(PdTest, UnclaimedLeaseExpiresAndFrees) {
  Client p(prefill_->grpc_port());
  const int64_t expired = p.Info().leases_expired();
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(UniquePrompts(1, "Expiry")[0], &lease, /*ttl_ms=*/400).ok());
  ASSERT_GT(lease.block_ids_size(), 0);
  EXPECT_EQ(p.Info().leases_active(), 1);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_EQ(p.Info().leases_expired(), expired + 1);
}

TEST_F(PdTest, DecodeKilledAfterAttachLeavesPrefillAtBaseline) {
  Client p(prefill_->grpc_port());
  auto d2 = StartNode("decode");
  ASSERT_TRUE(d2);
  Client d(d2->grpc_port());
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(UniquePrompts(1, "Decode dies")[0], &lease, 1000).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  d2->StopWith(SIGKILL, 5);
  EXPECT_TRUE(p.AtBaseline());
}

TEST_F(PdTest, DecodeStoppedPastTtlRecomputesAndBothReturnToBaseline) {
  Client p(prefill_->grpc_port());
  auto d3 = StartNode("decode");
  ASSERT_TRUE(d3);
  Client d(d3->grpc_port());
  const std::string prompt = UniquePrompts(1, "Sigstop")[0];
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease, 800).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  kill(d3->pid(), SIGSTOP);
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(p.AtBaseline());  // the lease expired while decode slept
  kill(d3->pid(), SIGCONT);
  // The decode node never commits KV past the lease: it recomputes.
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  EXPECT_TRUE(d.AtBaseline());
  EXPECT_TRUE(p.AtBaseline());
}

TEST_F(PdTest, PrefillKilledAndRestartedOnSamePortFailsOldTransfersCleanly) {
  Client d(decode_->grpc_port());
  const int port = FreePort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto start_p2 = [&] {
    auto r = testing::Daemon::Start(Binary(), GlobalArgs(), [&] {
      auto a = NodeArgs("prefill");
      a.push_back("--grpc-address");  // instead of the helper's port 0
      a.push_back(address);
      return a;
    }());
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(r).value() : nullptr;
  };
  auto p2 = start_p2();
  ASSERT_TRUE(p2);
  ASSERT_EQ(p2->grpc_port(), port);
  const std::string prompt = UniquePrompts(1, "Prefill dies")[0];
  pdv1::Lease old_lease;
  {
    Client p(port);
    ASSERT_TRUE(p.Prefill(prompt, &old_lease).ok());
    ASSERT_GT(old_lease.block_ids_size(), 0);
  }
  ASSERT_TRUE(d.Attach(old_lease).ok());
  p2->StopWith(SIGKILL, 5);
  // The pull fails (or reads a dead peer's last bytes, fenced by the same
  // generation check); either way the output is the reference one.
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  EXPECT_TRUE(d.AtBaseline());

  p2 = start_p2();
  ASSERT_TRUE(p2);
  Client p(port);
  const pdv1::NodeInfo info = p.Info();
  EXPECT_NE(info.incarnation(), old_lease.incarnation());
  grpc::Status s = p.Release(old_lease.transfer_id(), old_lease.incarnation());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("stale incarnation"));
  s = d.Attach(old_lease);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.error_message(), HasSubstr("stale incarnation"));
  // The new incarnation serves new leases.
  const std::string prompt2 = UniquePrompts(2, "Prefill restarted")[1];
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt2, &lease).ok());
  const int64_t ok_before = d.Info().transfers_ok();
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompt2), Reference(prompt2));
  EXPECT_EQ(d.Info().transfers_ok(), ok_before + 1);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// The OpenAI HTTP API through the router: the same text as the single
// node, plain and streamed, and /health names the registered nodes.
TEST_F(PdTest, OpenAiHttpThroughRouterEqualsOneNode) {
  httplib::Client router("127.0.0.1", router_->http_port()), both("127.0.0.1", both_->http_port());
  router.set_read_timeout(60, 0);
  both.set_read_timeout(60, 0);
  auto health = router.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_THAT(health->body, HasSubstr("\"role\":\"decode\""));
  EXPECT_THAT(health->body, HasSubstr("\"role\":\"prefill\""));
  Client d(decode_->grpc_port());
  const int64_t attached = d.Info().leases_attached();
  for (const std::string& prompt : UniquePrompts(5, "Over HTTP")) {
    nlohmann::json body = {{"prompt", prompt}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                           {"ignore_eos", true}};
    auto want = both.Post("/v1/completions", body.dump(), "application/json");
    auto got = router.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(want && got);
    ASSERT_EQ(got->status, 200) << got->body;
    EXPECT_EQ(nlohmann::json::parse(got->body)["choices"][0]["text"],
              nlohmann::json::parse(want->body)["choices"][0]["text"]);
    body["stream"] = true;
    auto streamed = router.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(streamed);
    EXPECT_THAT(streamed->body, HasSubstr("data: [DONE]"));
  }
  EXPECT_GE(d.Info().leases_attached() - attached, 5);
  EXPECT_TRUE(Client(prefill_->grpc_port()).AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

TEST(PdRouterTest, LayoutMismatchIsRefusedAtRegistration) {
  const std::string model = Stories260KOrWritten();
  auto a = StartNode("both", {}, model);
  auto b = StartNode("both", {"--block-size", "32"}, model);
  ASSERT_TRUE(a && b);
  auto r = testing::Daemon::StartSubcommand(
      Binary(), {"--log-level", "info"}, "route",
      {"--nodes", "127.0.0.1:" + std::to_string(a->grpc_port()) +
                      ",127.0.0.1:" + std::to_string(b->grpc_port())});
  ASSERT_TRUE(r.ok()) << r.status();
  std::string log;
  for (int i = 0; i < 100; ++i) {
    log = (*r)->Log();
    if (log.find("refusing node") != std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_THAT(log, HasSubstr("refusing node 127.0.0.1:" + std::to_string(b->grpc_port())));
  EXPECT_THAT(log, HasSubstr("block_size"));
  // Requests still go to the node that registered.
  Client c((*r)->grpc_port());
  const std::string prompt = Prompts(1)[0];
  EXPECT_EQ(c.Generate(prompt), Client(a->grpc_port()).Generate(prompt));
}

// The lease's digest covers where the GETs go: a lease whose UCX worker
// address or region descriptors were swapped is refused, naming that part.
TEST_F(PdTest, ForgedEndpointIsRefusedNamingTheAddress) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(UniquePrompts(1, "Forged endpoint")[0], &lease).ok());
  ASSERT_GT(lease.block_ids_size(), 0);
  const int64_t forged_before = p.Info().forged_endpoints();
  // Another node's worker address (the decode node's own), as an attacker
  // pointing the GETs elsewhere would use.
  pdv1::Lease forged = lease;
  forged.set_ucx_address(d.Info().ucx_address());
  grpc::Status s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("UCX worker address"));
  forged = lease;
  forged.set_kv_region(forged.kv_region() + "x");
  s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("region descriptors"));
  forged = lease;
  forged.set_generation_region(lease.kv_region());
  s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(p.Info().forged_endpoints(), forged_before + 3);
  // The genuine lease still attaches and is pulled.
  const int64_t ok_before = d.Info().transfers_ok();
  ASSERT_TRUE(d.Attach(lease).ok());
  const std::string prompt = UniquePrompts(1, "Forged endpoint")[0];
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  EXPECT_EQ(d.Info().transfers_ok(), ok_before + 1);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A pull slower than the lease's ttl (the test hook stalls it 2 s; the ttl
// is 0.6 s): the decode node renews the lease meanwhile, so it never
// expires, and the transfer commits.
TEST_F(PdTest, LongPullRenewsTheLease) {
  Client p(prefill_->grpc_port());
  auto slow = StartNode("decode", {"--pd-test-pull-delay", "2"});
  ASSERT_TRUE(slow);
  Client d(slow->grpc_port());
  const std::string prompt = UniquePrompts(1, "Slow link")[0];
  const int64_t expired = p.Info().leases_expired();
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease, /*ttl_ms=*/600).ok());
  ASSERT_GT(lease.block_ids_size(), 0);
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  const pdv1::NodeInfo info = d.Info();
  EXPECT_EQ(info.transfers_ok(), 1);
  EXPECT_EQ(info.transfers_failed(), 0);
  EXPECT_GE(info.lease_renewals(), 3);  // 2 s of stall at a renewal every ttl/3
  EXPECT_EQ(info.blocks_pulled(), lease.block_ids_size());
  EXPECT_EQ(p.Info().leases_expired(), expired);  // renewed, never expired
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A lease attached while its request cannot be admitted yet (here the
// decode node's only seat is taken by another request whose pull stalls
// 1.5 s; a transiently full pool waits the same way) outlives its 450 ms
// ttl: the decode node renews it while requests wait, so the second
// request still pulls instead of recomputing, and nothing leaks.
TEST_F(PdTest, LeaseWaitingForAdmissionIsRenewedNotRecomputed) {
  Client p(prefill_->grpc_port());
  auto busy = StartNode("decode", {"--pd-test-pull-delay", "1.5", "--max-seqs", "1"});
  ASSERT_TRUE(busy);
  Client d(busy->grpc_port());
  const std::vector<std::string> prompts = UniquePrompts(2, "Waiting seat");
  const int64_t expired = p.Info().leases_expired();
  pdv1::Lease first, second;
  ASSERT_TRUE(p.Prefill(prompts[0], &first, /*ttl_ms=*/5000).ok());
  ASSERT_TRUE(p.Prefill(prompts[1], &second, /*ttl_ms=*/450).ok());
  ASSERT_TRUE(d.Attach(first).ok());
  std::string got_first;
  std::thread t([&] { got_first = Client(busy->grpc_port()).Generate(prompts[0]); });
  // The first request holds the seat (its pull is stalled) before the
  // second arrives.
  for (int i = 0; i < 200 && d.Stats().kv_arriving() == 0; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(d.Attach(second).ok());
  const std::string got_second = d.Generate(prompts[1]);
  t.join();
  EXPECT_EQ(got_first, Reference(prompts[0]));
  EXPECT_EQ(got_second, Reference(prompts[1]));
  const pdv1::NodeInfo info = d.Info();
  EXPECT_EQ(info.transfers_ok(), 2);  // the waiting request pulled too
  EXPECT_EQ(info.transfers_failed(), 0);
  EXPECT_EQ(info.leases_unused(), 0);
  EXPECT_GE(info.admission_renewals(), 2);  // ~1.5 s waited at one renewal per ttl/3
  EXPECT_EQ(p.Info().leases_expired(), expired);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A decode node whose pool cannot hold the lease refuses it at attach
// (RESOURCE_EXHAUSTED naming both sizes); through the router the request
// then fails with a clear status, the prefill lease is released at once,
// and both nodes keep serving with their blocks back at baseline.
TEST_F(PdTest, DecodeOutOfBlocksRefusesThePullCleanly) {
  Client p(prefill_->grpc_port());
  auto small = StartNode("decode", {"--kv-cache-memory", "48KiB"});
  ASSERT_TRUE(small);
  Client d(small->grpc_port());
  const int32_t num_blocks = d.Info().num_blocks();
  ASSERT_GT(num_blocks, 0);
  std::string prompt = "Out of blocks:";
  // Longer than the decode pool, shorter than the model's context (128
  // tokens).
  const char* words[] = {"the", "dog", "ran", "to", "the", "park", "and", "saw", "a", "cat."};
  auto count = [&](const std::string& text) { return p.CountTokens(text); };
  for (int i = 0; count(prompt) < (num_blocks + 1) * 16 + 4; ++i) {
    prompt += std::string(" ") + words[i % 10];
  }
  pdv1::Lease lease;
  grpc::Status ps = p.Prefill(prompt, &lease);
  ASSERT_TRUE(ps.ok()) << ps.error_message() << " (pool " << num_blocks << " blocks)";
  ASSERT_GT(lease.block_ids_size(), num_blocks);
  grpc::Status s = d.Attach(lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("this decode node's pool has " + std::to_string(num_blocks)));
  ASSERT_TRUE(p.Release(lease.transfer_id(), lease.incarnation()).ok());

  auto router = StartRouter({prefill_, small.get()}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(router);
  Client r(router->grpc_port());
  const int64_t granted = p.Info().leases_granted(), released = p.Info().leases_released();
  const std::string got = r.Generate(prompt);
  EXPECT_THAT(got, HasSubstr("KV blocks"));  // request needs N KV blocks; the cache has M
  EXPECT_EQ(p.Info().leases_granted(), granted + 1);
  EXPECT_EQ(p.Info().leases_released(), released + 1);  // by the router, at once
  EXPECT_EQ(d.Info().leases_refused_no_blocks(), 2);
  // A prompt that fits still goes through both nodes.
  const std::string fits = "Fits: Once upon a time, there was a big dog.";
  EXPECT_EQ(r.Generate(fits), Reference(fits));
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A decode node with a host KV tier under its pool: a prompt it served
// through a pull and then lost to eviction comes back from its own host
// tier, and a lease for a longer prompt is pulled only past that: one load,
// output equal to the single node's, both nodes back at baseline.
TEST_F(PdTest, ADecodeNodeWithAHostTierLoadsFromItAndPullsOnlyTheRest) {
  Client p(prefill_->grpc_port());
  auto tiered = StartNode("decode", {"--kv-cache-memory", "128KiB", "--kv-host-memory", "8MiB"});
  ASSERT_TRUE(tiered);
  Client d(tiered->grpc_port());
  auto count = [&](const std::string& text) { return p.CountTokens(text); };
  const char* words[] = {"the", "dog", "ran", "to", "the", "park", "and", "saw", "a", "cat."};
  auto grow = [&](std::string text, int tokens) {
    for (int i = 0; count(text) < tokens; ++i) text += std::string(" ") + words[i % 10];
    return text;
  };
  const std::string base = grow("Host tier base:", 50);
  const std::string longer = grow(base + " Then", 90);
  auto pulled = [&](const std::string& prompt, pdv1::Lease* lease) {
    grpc::Status s = p.Prefill(prompt, lease);
    EXPECT_TRUE(s.ok()) << s.error_message();
    s = d.Attach(*lease);
    EXPECT_TRUE(s.ok()) << s.error_message();
  };
  pdv1::Lease first;
  pulled(base, &first);
  EXPECT_EQ(d.Generate(base), Reference(base));
  // Prompts computed on the decode node itself push base's blocks out of
  // its pool, into its host tier.
  for (int i = 0; i < 4; ++i) {
    const std::string filler = grow("Filler " + std::to_string(i) + ":", 50);
    EXPECT_EQ(d.Generate(filler), Reference(filler));
  }
  EXPECT_GT(d.Stats().host_tier_demotions(), 0);
  pdv1::Lease second;
  pulled(longer, &second);
  const pdv1::NodeInfo before = d.Info();
  int32_t cached = 0, cached_host = 0;
  EXPECT_EQ(d.Generate(longer, &cached, &cached_host), Reference(longer));
  const pdv1::NodeInfo after = d.Info();
  EXPECT_GE(cached_host, 48) << "base's whole blocks from the host tier";
  EXPECT_EQ(after.transfers_ok(), before.transfers_ok() + 1);
  EXPECT_EQ(after.blocks_pulled() - before.blocks_pulled(),
            second.block_ids_size() - cached_host / 16)
      << "only the blocks past the host tier's are pulled";
  EXPECT_GT(cached, cached_host);
  // Evicted again, base is all in the host tier: a lease for it is not
  // pulled from, and goes back at once rather than after its ttl (20 s).
  for (int i = 0; i < 4; ++i) {
    const std::string filler = grow("Second filler " + std::to_string(i) + ":", 50);
    EXPECT_EQ(d.Generate(filler), Reference(filler));
  }
  pdv1::Lease third;
  ASSERT_TRUE(p.Prefill(base, &third, 20000).ok());
  ASSERT_TRUE(d.Attach(third).ok());
  const int64_t unused = d.Info().leases_unused(), pulls = d.Info().transfers_ok();
  int32_t host_again = 0;
  EXPECT_EQ(d.Generate(base, nullptr, &host_again), Reference(base));
  EXPECT_GE(host_again, 48);
  bool released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    released = p.Info().leases_active() == 0;
    if (!released) std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(released) << "the lease the host tier made unnecessary is still held";
  EXPECT_EQ(d.Info().leases_unused(), unused + 1);
  EXPECT_EQ(d.Info().transfers_ok(), pulls);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// The router dies with a lease granted (before AttachLease) and with it
// attached (before Generate): the prefill lease expires or the decode node
// releases the lease nobody claimed, within the ttl; no block leaks.
TEST_F(PdTest, RouterKilledAfterGrantOrAttachLeavesNoLeak) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  for (const std::string state : {"granted", "attached"}) {
    auto router = StartRouter({prefill_, decode_},
                              {"--pd-mode", "always", "--pd-lease-ttl-ms", "1000",
                               "--test-stall", state},
                              2);
    ASSERT_TRUE(router);
    const pdv1::NodeInfo p0 = p.Info(), d0 = d.Info();
    const std::string prompt = UniquePrompts(1, "Router dies " + state)[0];
    std::string result;
    std::thread client([&] { result = Client(router->grpc_port()).Generate(prompt); });
    EXPECT_TRUE(WaitForLog(router.get(), "request stopped with its lease " + state)) << state;
    router->StopWith(SIGKILL, 5);
    client.join();
    EXPECT_THAT(result, HasSubstr("error")) << state;
    EXPECT_EQ(p.Info().leases_granted(), p0.leases_granted() + 1) << state;
    EXPECT_TRUE(p.AtBaseline()) << state;
    EXPECT_TRUE(d.AtBaseline()) << state;
    const pdv1::NodeInfo p1 = p.Info(), d1 = d.Info();
    if (state == "granted") {
      EXPECT_EQ(p1.leases_expired(), p0.leases_expired() + 1);
      EXPECT_EQ(d1.leases_attached(), d0.leases_attached());
    } else {
      EXPECT_EQ(d1.leases_attached(), d0.leases_attached() + 1);
      // Released by the decode node as unused, or expired first; gone either way.
      EXPECT_EQ(p1.leases_active(), 0);
      for (int i = 0; i < 100 && d.Info().leases_unused() == d0.leases_unused(); ++i) {
        std::this_thread::sleep_for(50ms);
      }
      EXPECT_EQ(d.Info().leases_unused(), d0.leases_unused() + 1);
    }
    // The nodes keep serving.
    const std::string after = UniquePrompts(1, "After router " + state)[0];
    EXPECT_EQ(Client(router_->grpc_port()).Generate(after), Reference(after));
  }
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// The router dies mid-pull (the pull stalls 1.5 s by the test hook): the
// decode node finishes (or abandons) the pull, releases the lease, and
// both nodes return to baseline.
TEST_F(PdTest, RouterKilledMidPullLeavesNoLeak) {
  Client p(prefill_->grpc_port());
  auto slow = StartNode("decode", {"--pd-test-pull-delay", "1.5"});
  ASSERT_TRUE(slow);
  Client d(slow->grpc_port());
  auto router =
      StartRouter({prefill_, slow.get()}, {"--pd-mode", "always", "--pd-lease-ttl-ms", "1000"}, 2);
  ASSERT_TRUE(router);
  const std::string prompt = UniquePrompts(1, "Router dies mid-pull")[0];
  const pdv1::NodeInfo p0 = p.Info();
  std::string result;
  std::thread client([&] { result = Client(router->grpc_port()).Generate(prompt); });
  bool pulling = false;
  for (int i = 0; i < 600 && !pulling; ++i) {
    pulling = d.Stats().kv_arriving() > 0;
    if (!pulling) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(pulling);
  router->StopWith(SIGKILL, 5);
  client.join();
  EXPECT_THAT(result, HasSubstr("error"));
  EXPECT_TRUE(d.AtBaseline());
  EXPECT_TRUE(p.AtBaseline());
  const pdv1::NodeInfo p1 = p.Info(), d1 = d.Info();
  EXPECT_EQ(p1.leases_granted(), p0.leases_granted() + 1);
  EXPECT_EQ(d1.transfers_ok() + d1.transfers_failed(), 1);
  EXPECT_EQ(p1.leases_active(), 0);
  // Released by the decode node when the pull ended (renewed meanwhile).
  EXPECT_EQ(p1.leases_released(), p0.leases_released() + 1);
  EXPECT_EQ(p1.leases_expired(), p0.leases_expired());
}

// Protocol messages out of order and repeated: a second AttachLease is a
// no-op; the router's release arriving before the decode node's pull and
// commit notification (the decode node's own release then finds nothing);
// a release after expiry. None disturbs anything; outputs stay exact.
TEST_F(PdTest, DuplicateReorderedAndStaleMessagesAreIdempotent) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::vector<std::string> prompts = UniquePrompts(2, "Reordered");
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompts[0], &lease).ok());
  const pdv1::NodeInfo d0 = d.Info(), p0 = p.Info();
  ASSERT_TRUE(d.Attach(lease).ok());
  ASSERT_TRUE(d.Attach(lease).ok());  // duplicate: no second claim
  EXPECT_EQ(d.Info().duplicate_attaches(), d0.duplicate_attaches() + 1);
  EXPECT_EQ(d.Info().leases_attached(), d0.leases_attached() + 1);
  // The router's release overtakes the decode node's pull.
  bool released = false;
  ASSERT_TRUE(p.Release(lease.transfer_id(), lease.incarnation(), &released).ok());
  EXPECT_TRUE(released);
  EXPECT_EQ(d.Generate(prompts[0]), Reference(prompts[0]));
  // The decode node's own release ("committed"/"failed") came after: a
  // duplicate, answered released: false.
  for (int i = 0; i < 100 && p.Info().duplicate_releases() == p0.duplicate_releases(); ++i) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(p.Info().duplicate_releases(), p0.duplicate_releases() + 1);

  // Stale: a lease that expired, then released and attached late.
  pdv1::Lease expiring;
  ASSERT_TRUE(p.Prefill(prompts[1], &expiring, /*ttl_ms=*/300).ok());
  EXPECT_TRUE(p.AtBaseline());
  ASSERT_TRUE(p.Release(expiring.transfer_id(), expiring.incarnation(), &released).ok());
  EXPECT_FALSE(released);
  grpc::Status s = d.Attach(expiring);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown transfer id"));
  EXPECT_EQ(d.Generate(prompts[1]), Reference(prompts[1]));
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// Two prefill nodes: the one the router picks dies before the router
// notices (polls are a minute apart here); the router retries on the other
// within the request's deadline. With both dead, the decode node computes
// the prompt itself. Outputs stay exact, nothing leaks.
TEST(PdRouterTest, DeadPrefillNodeIsRetriedOnAnother) {
  const std::string model = Stories260KOrWritten();
  auto both = StartNode("both", {}, model);
  auto p1 = StartNode("prefill", {}, model);
  auto p2 = StartNode("prefill", {}, model);
  auto d = StartNode("decode", {}, model);
  ASSERT_TRUE(both && p1 && p2 && d);
  auto router = StartRouter({p1.get(), p2.get(), d.get()},
                            {"--pd-mode", "always", "--poll-interval-ms", "60000"}, 3);
  ASSERT_TRUE(router);
  Client r(router->grpc_port()), c2(p2->grpc_port()), cd(d->grpc_port());
  p1->StopWith(SIGKILL, 5);
  const std::vector<std::string> prompts = UniquePrompts(2, "Retry");
  EXPECT_EQ(r.Generate(prompts[0]), Client(both->grpc_port()).Generate(prompts[0]));
  nlohmann::json h = RouterHealth(router.get());
  EXPECT_EQ(h.value("pd_retries", -1), 1) << h.dump();
  EXPECT_EQ(h.value("disaggregated", -1), 1) << h.dump();
  EXPECT_EQ(c2.Info().leases_granted(), 1);
  EXPECT_EQ(cd.Info().transfers_ok(), 1);
  p2->StopWith(SIGKILL, 5);
  EXPECT_EQ(r.Generate(prompts[1]), Client(both->grpc_port()).Generate(prompts[1]));
  h = RouterHealth(router.get());
  EXPECT_EQ(h.value("pd_fallbacks", -1), 1) << h.dump();
  EXPECT_EQ(h.value("local", -1), 1) << h.dump();
  EXPECT_TRUE(cd.AtBaseline());
}

// Chat through the router is disaggregated like Generate (the prefill
// node renders the template as the decode node does, so the leased tokens
// match and the blocks are pulled) and equals the single node's reply, on
// gRPC Chat and on /v1/chat/completions. SmolLM2 (stories260K has no chat
// template).
TEST(PdRouterTest, ChatThroughRouterIsDisaggregatedAndEqualsOneNode) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2");
  auto both_node = StartNode("both", {}, model);
  auto prefill = StartNode("prefill", {}, model);
  auto decode = StartNode("decode", {}, model);
  ASSERT_TRUE(both_node && prefill && decode);
  auto r = StartRouter({prefill.get(), decode.get()}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(r);
  Client router(r->grpc_port()), both(both_node->grpc_port()), d(decode->grpc_port());
  const pdv1::NodeInfo d0 = d.Info();
  const std::vector<std::string> users = UniquePrompts(4, "Chat");
  for (const std::string& u : users) {
    const std::string want = both.Chat(u);
    EXPECT_THAT(want, Not(HasSubstr("error"))) << u;
    EXPECT_EQ(router.Chat(u), want) << u;
  }
  const pdv1::NodeInfo d1 = d.Info();
  EXPECT_EQ(d1.leases_attached() - d0.leases_attached(), 4);
  EXPECT_EQ(d1.transfers_ok() - d0.transfers_ok(), 4);  // the leases matched the rendered prompt
  EXPECT_GT(d1.blocks_pulled(), d0.blocks_pulled());

  httplib::Client rh("127.0.0.1", r->http_port()), bh("127.0.0.1", both_node->http_port());
  rh.set_read_timeout(60, 0);
  bh.set_read_timeout(60, 0);
  for (const std::string& u : UniquePrompts(3, "HTTP chat")) {
    nlohmann::json body = {
        {"messages", {{{"role", "system"}, {"content", "You tell short stories."}},
                      {{"role", "user"}, {"content", u}}}},
        {"max_tokens", kMaxTokens},
        {"temperature", 0},
        {"ignore_eos", true}};
    auto want = bh.Post("/v1/chat/completions", body.dump(), "application/json");
    auto got = rh.Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(want && got);
    ASSERT_EQ(got->status, 200) << got->body;
    EXPECT_EQ(nlohmann::json::parse(got->body)["choices"][0]["message"]["content"],
              nlohmann::json::parse(want->body)["choices"][0]["message"]["content"]);
  }
  const pdv1::NodeInfo d2 = d.Info();
  EXPECT_EQ(d2.leases_attached() - d1.leases_attached(), 3);
  EXPECT_EQ(d2.transfers_ok() - d1.transfers_ok(), 3);
  EXPECT_TRUE(Client(prefill->grpc_port()).AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// --kv-wire-dtype int8 on the prefill node: leased blocks move re-encoded
// (int8 codes and scales instead of f16), the decode node decodes them into
// its f16 pool and marks them lossy; greedy outputs stay close to the f16
// node's; the generation fence and the lease checks still hold.
TEST(PdWireTest, BlocksReEncodedOnTheWireMoveSmallerAndAreMarkedLossy) {
  // How many int8 outputs equal the f16 node's is a property of a trained
  // model (random weights leave near ties that int8 K/V flips).
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto both = StartNode("both");
  auto prefill = StartNode("prefill", {"--kv-wire-dtype", "int8"});
  auto decode = StartNode("decode");
  ASSERT_TRUE(both && prefill && decode);
  // A wire codec no smaller than the pool's is refused at start.
  auto refused = testing::Daemon::Start(
      Binary(), GlobalArgs(),
      NodeArgs("prefill", {"--kv-cache-dtype", "int4", "--kv-wire-dtype", "int8"}));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--kv-wire-dtype int8"));
  Client b(both->grpc_port()), p(prefill->grpc_port()), d(decode->grpc_port());
  EXPECT_EQ(p.Info().wire_dtype(), "int8");
  EXPECT_EQ(d.Info().wire_dtype(), "same");
  const std::vector<std::string> prompts = UniquePrompts(8, "On the wire");
  int64_t leased = 0, wire_block_bytes = 0;
  int equal = 0;
  for (const auto& prompt : prompts) {
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
    ASSERT_GE(lease.block_ids_size(), 1);
    EXPECT_EQ(lease.wire_dtype(), "int8");
    EXPECT_GT(lease.wire_block_bytes(), 0);
    EXPECT_LT(lease.wire_block_bytes(), lease.layout().block_bytes());
    wire_block_bytes = lease.wire_block_bytes();
    leased += lease.block_ids_size();
    ASSERT_TRUE(d.Attach(lease).ok());
    int32_t cached = 0, lossy = 0;
    const std::string got = d.Generate(prompt, &cached, nullptr, &lossy);
    ASSERT_EQ(got.rfind("error", 0), std::string::npos) << got;
    EXPECT_EQ(lossy, lease.block_ids_size() * lease.layout().block_size()) << prompt;
    EXPECT_EQ(cached, lossy) << prompt;
    if (got == b.Generate(prompt)) ++equal;
  }
  const pdv1::NodeInfo di = d.Info();
  EXPECT_EQ(di.transfers_ok(), 8);
  EXPECT_EQ(di.blocks_pulled(), leased);
  EXPECT_EQ(di.bytes_pulled(), leased * wire_block_bytes);
  EXPECT_EQ(di.wire_blocks(), leased);
  EXPECT_EQ(di.generation_mismatches(), 0);
  EXPECT_GT(p.Info().wire_blocks(), 0);
  EXPECT_LE(p.Info().wire_blocks(), leased);  // a block shared by leases is encoded once
  // int8 K/V (98% teacher-forced agreement with f16 on stories260K): most
  // greedy continuations are the f16 node's exactly.
  std::printf("wire int8: %lld blocks of %lld bytes (f16 %lld); %d of 8 outputs equal\n",
              static_cast<long long>(leased), static_cast<long long>(wire_block_bytes),
              static_cast<long long>(p.Info().layout().block_bytes()), equal);
  EXPECT_GE(equal, 6) << "of 8 outputs equal to the f16 node's";
  // Through the router: the lease passes through unchanged.
  {
    auto router = StartRouter({prefill.get(), decode.get()}, {"--pd-mode", "always"}, 2);
    ASSERT_TRUE(router);
    Client r(router->grpc_port());
    for (const auto& prompt : UniquePrompts(3, "Wire via the router")) {
      const std::string got = r.Generate(prompt);
      EXPECT_EQ(got.rfind("error", 0), std::string::npos) << got;
    }
    EXPECT_GT(d.Info().wire_blocks(), leased);
  }
  // A lease whose wire block size was altered is refused, naming the field.
  const std::string bad = UniquePrompts(2, "Wire bad input")[0];
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(bad, &lease).ok());
  pdv1::Lease forged = lease;
  forged.set_wire_block_bytes(lease.wire_block_bytes() * 2);
  grpc::Status s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("wire_block_bytes"));
  forged = lease;
  forged.set_wire_dtype("int3");
  s = d.Attach(forged);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("lease.wire_dtype: unknown codec 'int3'"));
  // The fence: leased blocks freed early are caught on re-encoded copies too.
  ASSERT_TRUE(p.EarlyFree(lease).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(bad), b.Generate(bad));  // recomputed on the decode node: exact
  EXPECT_EQ(d.Info().generation_mismatches(), 1);
  (void)p.Release(lease.transfer_id(), lease.incarnation());
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
  EXPECT_TRUE(b.AtBaseline());
}

// KV pools in CUDA memory on both nodes (the CPU emulator in CI's emulator
// stage; a GPU where one is lent). UCX here has no CUDA support, so the
// prefill node copies a lease's blocks to the transport's host staging
// before granting and the decode node's reads land on its device before the
// pull completes. Outputs through the router and through direct leases
// equal a CUDA `both` node's; the generation fence still catches an early
// free; every node ends at baseline.
TEST(PdCudaTest, DevicePoolsMoveThroughHostStagingAndEqualOneNode) {
  KVSERVE_SKIP_WITHOUT_GPU();
  const std::vector<std::string> cuda = {"--device", "cuda"};
  const std::string model = Stories260KOrWritten();
  auto both = StartNode("both", cuda, model);
  auto prefill = StartNode("prefill", cuda, model);
  auto decode = StartNode("decode", cuda, model);
  ASSERT_TRUE(both && prefill && decode);
  Client b(both->grpc_port()), p(prefill->grpc_port()), d(decode->grpc_port());
  EXPECT_EQ(p.Info().kv_memory(), "device-staged");
  EXPECT_EQ(d.Info().kv_memory(), "device-staged");
  EXPECT_EQ(b.Info().kv_memory(), "device");  // role both: no transport
  const std::vector<std::string> prompts = UniquePrompts(4, "Device pool");
  int leased_blocks = 0;
  for (const auto& prompt : prompts) {
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
    ASSERT_GE(lease.block_ids_size(), 2);
    leased_blocks += lease.block_ids_size();
    ASSERT_TRUE(d.Attach(lease).ok());
    EXPECT_EQ(d.Generate(prompt), b.Generate(prompt)) << prompt;
  }
  pdv1::NodeInfo di = d.Info();
  EXPECT_EQ(di.transfers_ok(), 4);
  EXPECT_EQ(di.blocks_pulled(), leased_blocks);
  EXPECT_EQ(di.generation_mismatches(), 0);
  EXPECT_EQ(p.Info().staged_blocks(), leased_blocks);
  // Through the router, with prefix hits on both sides (shared prefixes).
  auto router = StartRouter({prefill.get(), decode.get()}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(router);
  Client r(router->grpc_port());
  for (const auto& prompt : Prompts(6, " via the router")) {
    EXPECT_EQ(r.Generate(prompt), b.Generate(prompt)) << prompt;
  }
  EXPECT_GT(d.Info().transfers_ok(), 4);
  // A prefill node that frees the leased device blocks early: the fence.
  const std::string early = UniquePrompts(1, "Device early free")[0];
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(early, &lease).ok());
  ASSERT_TRUE(p.EarlyFree(lease).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(early), b.Generate(early));
  EXPECT_EQ(d.Info().generation_mismatches(), 1);
  (void)p.Release(lease.transfer_id(), lease.incarnation());
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
  EXPECT_TRUE(b.AtBaseline());
}


// A hybrid-attention model (a written Gemma 3: 3 layers, a 16-token window
// on 2 of them, so one full KV cache group and two window groups) with
// device pools on both nodes: the prefill node stages every group's leased
// blocks, the decode node pulls them into each group's table on its device,
// and the text equals a CUDA `both` node's for prompts past the window.
TEST(PdCudaTest, HybridModelLeasesEveryGroupThroughHostStaging) {
  KVSERVE_SKIP_WITHOUT_GPU();
  const std::string model = testing::TempDir() + "/pd-cuda-gemma3.gguf";
  std::ofstream(model, std::ios::binary)
      << testing::MakeTinyLlamaGguf(testing::TinyGemma3Options());
  const std::vector<std::string> cuda = {"--device", "cuda"};
  auto both = StartNode("both", cuda, model);
  auto prefill = StartNode("prefill", cuda, model);
  auto decode = StartNode("decode", cuda, model);
  ASSERT_TRUE(both && prefill && decode);
  Client b(both->grpc_port()), p(prefill->grpc_port()), d(decode->grpc_port());
  EXPECT_EQ(p.Info().kv_memory(), "device-staged");
  const pdv1::NodeInfo info = p.Info();
  ASSERT_EQ(info.layout().group_windows_size(), 3);
  int window_groups = 0;
  for (int g = 0; g < 3; ++g) window_groups += info.layout().group_windows(g) == 16;
  EXPECT_EQ(window_groups, 2);
  for (const auto& prompt : UniquePrompts(3, "Hybrid device pool")) {
    ASSERT_GT(p.CountTokens(prompt), 32) << "the prompt must run past the window";
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
    ASSERT_EQ(lease.groups_size(), 2) << "every group beyond the first names its blocks";
    for (const auto& g : lease.groups()) EXPECT_GT(g.block_ids_size(), 0);
    ASSERT_TRUE(d.Attach(lease).ok());
    const std::string want = b.Generate(prompt);
    ASSERT_EQ(want.find("error"), std::string::npos) << want;
    EXPECT_EQ(d.Generate(prompt), want) << prompt;
  }
  EXPECT_EQ(d.Info().transfers_ok(), 3);
  EXPECT_EQ(d.Info().generation_mismatches(), 0);
  // Baseline: nothing pinned or leased; each window group keeps one
  // placeholder block for good.
  for (Client* c : {&b, &p, &d}) {
    bool idle = false;
    for (int i = 0; i < 300 && !idle; ++i) {
      const v1::Stats st = c->Stats();
      idle = st.blocks_free() == st.blocks_total() - window_groups && st.running() == 0 &&
             st.waiting() == 0 && st.kv_arriving() == 0 && c->Info().leases_active() == 0;
      if (!idle) std::this_thread::sleep_for(50ms);
    }
    EXPECT_TRUE(idle);
  }
}

// ---- The router's HTTP front end (server/router/router_http.h) ----

// GET /v1/models lists the registered nodes' model (OpenAI list format),
// /metrics parses and counts placements and nodes, unknown routes are 404
// and wrong methods 405, all with OpenAI-style error bodies.
TEST_F(PdTest, RouterHttpServesModelsMetricsAnd404And405) {
  httplib::Client router("127.0.0.1", router_->http_port()), d("127.0.0.1", decode_->http_port());
  router.set_read_timeout(60, 0);
  auto models = router.Get("/v1/models");
  auto node_models = d.Get("/v1/models");
  ASSERT_TRUE(models && node_models);
  ASSERT_EQ(models->status, 200) << models->body;
  const nlohmann::json j = nlohmann::json::parse(models->body, nullptr, false);
  const nlohmann::json nj = nlohmann::json::parse(node_models->body, nullptr, false);
  ASSERT_TRUE(j.is_object() && nj.is_object()) << models->body;
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u) << models->body;  // prefill and decode serve one model
  EXPECT_EQ(j["data"][0]["id"], nj["data"][0]["id"]);
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["max_model_len"], nj["data"][0]["max_model_len"]);
  EXPECT_EQ(j["data"][0]["nodes"].size(), 2u);

  const int port = router_->http_port();
  EXPECT_EQ(testing::MetricSample(port, "kvserve:router_nodes", {"state=\"up\""}), 2);
  EXPECT_EQ(testing::MetricSample(port, "kvserve:router_nodes", {"state=\"refused\""}), 0);
  const std::string placed = "path=\"/v1/completions\"";
  std::string text;
  ASSERT_TRUE(testing::ScrapeMetrics(port, &text));
  // Absent until the first such request (an earlier test may have sent one).
  const double before = testing::FindMetricSample(text, "kvserve:router_requests_total",
                                                  {placed, "placement=\"disaggregated\""})
                            .value_or(0);
  const nlohmann::json body = {{"prompt", UniquePrompts(1, "Metrics")[0]},
                               {"max_tokens", kMaxTokens},
                               {"temperature", 0}};
  auto r = router.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(testing::MetricSample(port, "kvserve:router_requests_total",
                                  {placed, "placement=\"disaggregated\""}),
            before + 1);
  EXPECT_GE(testing::MetricSample(port, "kvserve:router_http_responses_total", {"code=\"200\""}),
            2);

  auto missing = router.Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_TRUE(nlohmann::json::parse(missing->body, nullptr, false)["error"].contains("message"))
      << missing->body;
  auto get_completion = router.Get("/v1/completions");
  ASSERT_TRUE(get_completion);
  EXPECT_EQ(get_completion->status, 405);
  EXPECT_EQ(get_completion->get_header_value("Allow"), "POST");
  EXPECT_THAT(get_completion->body, HasSubstr("\"message\""));
  auto post_health = router.Post("/health", "{}", "application/json");
  ASSERT_TRUE(post_health);
  EXPECT_EQ(post_health->status, 405);
  EXPECT_EQ(post_health->get_header_value("Allow"), "GET");
  auto bad = router.Post("/v1/completions", "not json", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_THAT(bad->body, HasSubstr("not a JSON object"));
}

// With --api-key, every route but /health needs the key; --metrics-auth
// none opens GET /metrics alone (as on a node, for Prometheus).
TEST_F(PdTest, RouterMetricsAuthNoneOpensOnlyTheScrape) {
  for (const char* mode : {"key", "none"}) {
    SCOPED_TRACE(mode);
    auto r = StartRouter({prefill_, decode_}, {"--api-key", "sekret", "--metrics-auth", mode}, 0);
    ASSERT_TRUE(r);
    httplib::Client c("127.0.0.1", r->http_port());
    auto metrics = c.Get("/metrics");
    auto models = c.Get("/v1/models");
    ASSERT_TRUE(metrics && models);
    EXPECT_EQ(metrics->status, std::string(mode) == "none" ? 200 : 401) << metrics->body;
    if (std::string(mode) == "none") EXPECT_THAT(metrics->body, HasSubstr("kvserve:router_nodes"));
    EXPECT_EQ(models->status, 401) << models->body;
    auto keyed = c.Get("/metrics", {{"Authorization", "Bearer sekret"}});
    ASSERT_TRUE(keyed);
    EXPECT_EQ(keyed->status, 200);
  }
  auto bad = testing::Daemon::StartSubcommand(Binary(), {"--log-level", "warn"}, "route",
                                              {"--nodes", Addr(decode_), "--metrics-auth", "open"});
  EXPECT_FALSE(bad.ok());
}

// Sequential requests through the router reuse its keep-alive connections
// to the decode node instead of opening one each.
TEST_F(PdTest, RouterHttpReusesUpstreamConnections) {
  const int port = router_->http_port();
  const double opened = testing::MetricSample(port, "kvserve:router_upstream_connections_opened_total");
  const double reused = testing::MetricSample(port, "kvserve:router_upstream_connections_reused_total");
  httplib::Client router("127.0.0.1", port);
  router.set_read_timeout(60, 0);
  constexpr int kRequests = 8;
  const std::vector<std::string> prompts = UniquePrompts(kRequests, "Keep-alive");
  for (int i = 0; i < kRequests; ++i) {
    const nlohmann::json body = {{"prompt", prompts[i]},
                                 {"max_tokens", kMaxTokens},
                                 {"temperature", 0},
                                 {"stream", i % 2 == 1}};
    auto r = router.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    if (i % 2 == 1) {
      EXPECT_THAT(r->body, HasSubstr("data: [DONE]"));
    }
  }
  EXPECT_LE(testing::MetricSample(port, "kvserve:router_upstream_connections_opened_total") - opened,
            2);
  EXPECT_GE(testing::MetricSample(port, "kvserve:router_upstream_connections_reused_total") - reused,
            kRequests - 2);
  EXPECT_LE(testing::MetricSample(port, "kvserve:router_upstream_connections_idle"), 8);
  EXPECT_TRUE(Client(prefill_->grpc_port()).AtBaseline());
  EXPECT_TRUE(Client(decode_->grpc_port()).AtBaseline());
}

// A pooled keep-alive connection the node has since closed (its
// --http-idle-timeout ran out) is stale: the router's pool sees the peer's
// close before reuse (a non-blocking peek) and opens a fresh connection
// instead, so the client sees a 200 and nothing is resent. (The resend on a
// fresh connection, for a close racing that peek, is not reached here.)
TEST_F(PdTest, RouterOpensAFreshConnectionWhenAPooledOneWentStale) {
  auto decode = StartNode("decode", {"--http-idle-timeout", "1"});
  ASSERT_TRUE(decode);
  auto r = StartRouter({prefill_, decode.get()}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(r);
  const int port = r->http_port();
  httplib::Client router("127.0.0.1", port);
  router.set_read_timeout(60, 0);
  const std::vector<std::string> prompts = UniquePrompts(3, "Stale");
  auto send = [&](const std::string& prompt) {
    const nlohmann::json body = {{"prompt", prompt}, {"max_tokens", kMaxTokens}, {"temperature", 0}};
    auto res = router.Post("/v1/completions", body.dump(), "application/json");
    return res ? res->status : -1;
  };
  auto metric = [&](const char* name) { return testing::MetricSample(port, name); };
  ASSERT_EQ(send(prompts[0]), 200);
  ASSERT_EQ(metric("kvserve:router_upstream_connections_idle"), 1);
  // Reused while the node keeps it open.
  double opened = metric("kvserve:router_upstream_connections_opened_total");
  double reused = metric("kvserve:router_upstream_connections_reused_total");
  ASSERT_EQ(send(prompts[1]), 200);
  EXPECT_EQ(metric("kvserve:router_upstream_connections_opened_total"), opened);
  EXPECT_EQ(metric("kvserve:router_upstream_connections_reused_total"), reused + 1);
  // The node closes its side after 1 s idle; the router still holds it.
  std::this_thread::sleep_for(2500ms);
  opened = metric("kvserve:router_upstream_connections_opened_total");
  reused = metric("kvserve:router_upstream_connections_reused_total");
  const double retries = metric("kvserve:router_upstream_retries_total");
  const double errors = metric("kvserve:router_upstream_errors_total");
  EXPECT_EQ(send(prompts[2]), 200);
  EXPECT_EQ(metric("kvserve:router_upstream_connections_opened_total"), opened + 1);
  EXPECT_EQ(metric("kvserve:router_upstream_connections_reused_total"), reused);
  EXPECT_EQ(metric("kvserve:router_upstream_retries_total"), retries);
  EXPECT_EQ(metric("kvserve:router_upstream_errors_total"), errors);
  EXPECT_TRUE(Client(decode->grpc_port()).AtBaseline());
}

// A client that closes its connection mid-stream: the router closes its
// upstream connection (the decode node cancels the request) and releases
// the lease; both nodes return to baseline. SmolLM2, whose context holds a
// stream long enough to be cut.
TEST(PdRouterHttpTest, ClientDisconnectMidStreamCancelsAndReleasesTheLease) {
  const std::string model = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(model, "SmolLM2");
  auto prefill = StartNode("prefill", {"--kv-cache-memory", "64MiB"}, model);
  auto decode = StartNode("decode", {"--kv-cache-memory", "64MiB"}, model);
  ASSERT_TRUE(prefill && decode);
  auto r = StartRouter({prefill.get(), decode.get()}, {"--pd-mode", "always"}, 2);
  ASSERT_TRUE(r);
  Client p(prefill->grpc_port()), d(decode->grpc_port());
  const double cancelled = testing::MetricSample(decode->http_port(), "kvserve:request_success_total",
                                                 {"finished_reason=\"cancelled\""});
  const int64_t attached = d.Info().leases_attached();

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(r->http_port()));
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string body =
      nlohmann::json{{"prompt", "Once upon a time, in a quiet village by the sea,"},
                     {"max_tokens", 600},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"stream", true}}
          .dump();
  const std::string request = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              "Content-Type: application/json\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string got;
  char buf[4096];
  while (got.find("\"text\"") == std::string::npos) {  // the first token arrived
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_THAT(got, HasSubstr("200 OK"));
  close(fd);

  double now = cancelled;
  for (int i = 0; i < 300 && now == cancelled; ++i) {
    std::this_thread::sleep_for(100ms);
    now = testing::MetricSample(decode->http_port(), "kvserve:request_success_total",
                                {"finished_reason=\"cancelled\""});
  }
  EXPECT_EQ(now, cancelled + 1);
  EXPECT_EQ(testing::MetricSample(r->http_port(), "kvserve:router_client_disconnects_total"), 1);
  EXPECT_EQ(d.Info().leases_attached() - attached, 1);  // it was disaggregated
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

}  // namespace
}  // namespace kvserve
