// Prefill/decode disaggregation on a hybrid-attention model (Gemma 3 270M:
// one full-attention KV cache group and five window-512 groups), with real
// processes on 127.0.0.1. A prefill node's lease names every group's blocks
// (the full group's for the whole leased prompt, each window group's from
// where its window reaches); the decode node pulls them into its own
// per-group tables behind the generation fence. Checked: the pair's greedy
// text equals one node's for a prompt longer than the window and a short
// one, the leases' shape and the blocks pulled, every group's blocks under
// the fence (an early free is caught), a lease with a group's blocks left
// out is refused naming it, the router over prefill + decode, and a node
// with another KV layout (all layers in one block) refused at registration
// naming the groups. Skips when the Gemma 3 file is absent.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/kvserve.grpc.pb.h"
#include "proto/pd.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace v1 = ::kvserve::v1;
namespace pdv1 = ::kvserve::pd::v1;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr int kMaxTokens = 12;
constexpr int kBlock = 16;
constexpr int kWindow = 512;  // Gemma 3 270M's sliding window

std::string Gemma3Path() { return testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf"); }

std::unique_ptr<testing::Daemon> StartNode(const std::string& role,
                                           std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--role", role, "--drain-timeout", "2", "--pd-transfer-timeout",
                                "10", "--pd-test-hooks", "--kv-cache-memory", "96MiB"};
  a.insert(a.end(), extra.begin(), extra.end());
  auto d = testing::Daemon::Start(KVSERVE_BINARY,
                                  {"--log-level", "info", "-t", "1", "-m", Gemma3Path()}, a);
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

  static v1::GenerateRequest Request(const std::string& prompt) {
    v1::GenerateRequest r;
    r.set_prompt(prompt);
    r.mutable_sampling()->set_max_tokens(kMaxTokens);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }
  // Greedy text, or the error as text.
  std::string Generate(const std::string& prompt) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 180s);
    auto reader = api->Generate(&c, Request(prompt));
    v1::GenerateResponse resp;
    std::string text;
    while (reader->Read(&resp)) text += resp.text();
    grpc::Status s = reader->Finish();
    if (!s.ok()) return "error: " + s.error_message();
    return text;
  }
  int CountTokens(const std::string& text) {
    v1::TokenizeRequest t;
    t.set_text(text);
    v1::TokenizeResponse resp;
    grpc::ClientContext c;
    EXPECT_TRUE(api->Tokenize(&c, t, &resp).ok());
    return resp.token_ids_size();
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
  grpc::Status Prefill(const std::string& prompt, pdv1::Lease* lease, bool progressive = false) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 180s);
    pdv1::PrefillRequest r;
    r.set_generate_request(Request(prompt).SerializeAsString());
    r.set_progressive(progressive);
    return pdx->Prefill(&c, r, lease);
  }
  grpc::Status Attach(const pdv1::Lease& lease) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 10s);
    pdv1::AttachLeaseResponse r;
    return pdx->AttachLease(&c, lease, &r);
  }
  grpc::Status Release(const pdv1::Lease& l) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 5s);
    pdv1::ReleaseLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    pdv1::ReleaseLeaseResponse resp;
    return pdx->ReleaseLease(&c, r, &resp);
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
  // No block pinned or in use and no lease held; false after 20 s. Each
  // window group holds one placeholder block for good: the free count of a
  // fresh node is the pool less those.
  bool AtBaseline() {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    const int placeholders = std::max(0, Info().layout().group_windows_size() - 1);
    v1::Stats s;
    pdv1::NodeInfo i;
    while (std::chrono::steady_clock::now() < deadline) {
      s = Stats();
      i = Info();
      if (s.blocks_free() == s.blocks_total() - placeholders && s.running() == 0 &&
          s.waiting() == 0 && s.kv_arriving() == 0 && i.leases_active() == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    ADD_FAILURE() << "not at baseline: " << s.blocks_free() << " of " << s.blocks_total()
                  << " blocks free (" << placeholders << " placeholders), "
                  << i.leases_active() << " leases";
    return false;
  }
};

// A prose prompt of at least `min_tokens` tokens on node c, opened by `tag`
// (so no node holds any of its blocks before).
std::string LongPrompt(Client* c, const std::string& tag, int min_tokens) {
  const char* sentences[] = {
      "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. ",
      "Ships passing the rocky coast relied on its beam to find the harbour in the fog. ",
      "His daughter kept a logbook of every vessel, its flag, and the hour it passed. ",
      "In winter the storms were fierce, and waves reached the windows of the tower. ",
      "One night a small fishing boat lost its engine near the reef and drifted. ",
      "The keeper rowed out with a lantern and a rope while his daughter rang the bell. "};
  std::string p = tag + ". ";
  for (int i = 0; c->CountTokens(p) < min_tokens; ++i) {
    p += sentences[i % 6];
    if (i % 6 == 5) p += "Chapter " + std::to_string(i / 6 + 2) + ". ";
  }
  return p;
}

int LeaseBlocks(const pdv1::Lease& l) {
  int n = l.block_ids_size();
  for (const auto& g : l.groups()) n += g.block_ids_size();
  return n;
}

class PdHybridTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Gemma3Path().empty()) return;
    both_ = StartNode("both").release();
    prefill_ = StartNode("prefill").release();
    decode_ = StartNode("decode").release();
  }
  static void TearDownTestSuite() {
    delete decode_;
    delete prefill_;
    delete both_;
  }
  void SetUp() override {
    KVSERVE_SKIP_IF_MISSING(Gemma3Path(), "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
    if (both_ == nullptr || prefill_ == nullptr || decode_ == nullptr) {
      GTEST_SKIP() << "daemons did not start";
    }
  }
  static std::string Reference(const std::string& prompt) {
    return Client(both_->grpc_port()).Generate(prompt);
  }

  static testing::Daemon* both_;
  static testing::Daemon* prefill_;
  static testing::Daemon* decode_;
};
testing::Daemon* PdHybridTest::both_ = nullptr;
testing::Daemon* PdHybridTest::prefill_ = nullptr;
testing::Daemon* PdHybridTest::decode_ = nullptr;

// The lease names each group's blocks; the decode node pulls every one of
// them and its greedy text equals the single node's, for a prompt past the
// window (the window groups lease only their last window's blocks) and a
// short one (every group leases every block).
TEST_F(PdHybridTest, PairOnGemma3EqualsOneNodeForLongAndShortPrompts) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const pdv1::NodeInfo info = p.Info();
  ASSERT_EQ(info.layout().group_windows_size(), 6);
  EXPECT_EQ(info.layout().group_windows(0), 0);
  for (int g = 1; g < 6; ++g) EXPECT_EQ(info.layout().group_windows(g), kWindow);
  const std::string prompts[] = {LongPrompt(&p, "The lighthouse, part one", 640),
                                 LongPrompt(&p, "A short tale", 40)};
  for (const std::string& prompt : prompts) {
    const int n = p.CountTokens(prompt);
    const std::string want = Reference(prompt);
    ASSERT_THAT(want, ::testing::Not(HasSubstr("error")));
    pdv1::Lease lease;
    grpc::Status s = p.Prefill(prompt, &lease);
    ASSERT_TRUE(s.ok()) << s.error_message();
    // The whole blocks before the prompt's last token (the decode node
    // computes that one); each window group from where its window reaches.
    const int full = (n - 1) / kBlock;
    ASSERT_EQ(lease.block_ids_size(), full) << n << " tokens";
    ASSERT_EQ(lease.groups_size(), 5);
    const int end = full * kBlock;
    const int first = std::max(0, end - kWindow + 1) / kBlock;
    for (const auto& g : lease.groups()) {
      EXPECT_EQ(g.first_block(), first);
      EXPECT_EQ(g.block_ids_size(), full - first);
    }
    if (n > kWindow + kBlock) {
      EXPECT_GT(first, 0) << "a prompt past the window leases only the window's blocks";
    }
    const pdv1::NodeInfo before = d.Info();
    ASSERT_TRUE(d.Attach(lease).ok());
    EXPECT_EQ(d.Generate(prompt), want) << n << " tokens";
    const pdv1::NodeInfo after = d.Info();
    EXPECT_EQ(after.transfers_ok() - before.transfers_ok(), 1);
    EXPECT_EQ(after.blocks_pulled() - before.blocks_pulled(), LeaseBlocks(lease));
    EXPECT_EQ(after.generation_mismatches(), before.generation_mismatches());
    std::printf("%d-token prompt: leased %d full-group blocks + 5 x %d window blocks\n", n, full,
                full - first);
  }
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A progressive lease is asked for: the hybrid prefill node grants it whole
// (its groups named), and the pull still equals one node.
TEST_F(PdHybridTest, ProgressiveRequestIsGrantedWhole) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::string prompt = LongPrompt(&p, "Progressive, the harbour", 120);
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease, /*progressive=*/true).ok());
  EXPECT_FALSE(lease.progressive());
  EXPECT_GT(lease.block_ids_size(), 0);
  EXPECT_EQ(lease.groups_size(), 5);
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// The generation fence covers every group: blocks freed and overwritten
// early on the prefill node fail the pull, which recomputes.
TEST_F(PdHybridTest, EarlyFreeIsCaughtByTheFenceOverEveryGroup) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::string prompt = LongPrompt(&p, "Early free, the reef", 600);
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
  ASSERT_EQ(lease.groups_size(), 5);
  const pdv1::NodeInfo before = d.Info();
  ASSERT_TRUE(p.EarlyFree(lease).ok());
  ASSERT_TRUE(d.Attach(lease).ok());
  EXPECT_EQ(d.Generate(prompt), Reference(prompt));
  const pdv1::NodeInfo after = d.Info();
  EXPECT_EQ(after.generation_mismatches() - before.generation_mismatches(), 1);
  EXPECT_EQ(after.transfers_ok(), before.transfers_ok());
  (void)p.Release(lease);
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// A lease whose window group's blocks were left out (or cut short of its
// window) is refused naming the group field, before anything is pulled.
TEST_F(PdHybridTest, LeaseMissingAGroupsBlocksIsRefused) {
  Client p(prefill_->grpc_port()), d(decode_->grpc_port());
  const std::string prompt = LongPrompt(&p, "Missing groups, the bell", 600);
  pdv1::Lease lease;
  ASSERT_TRUE(p.Prefill(prompt, &lease).ok());
  ASSERT_EQ(lease.groups_size(), 5);
  pdv1::Lease bad = lease;
  bad.mutable_groups()->RemoveLast();
  grpc::Status s = d.Attach(bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("lease.groups: 4 groups besides group 0"));
  bad = lease;
  auto* g = bad.mutable_groups(2);
  g->set_first_block(g->first_block() + 1);
  g->mutable_block_ids()->erase(g->mutable_block_ids()->begin());
  g->mutable_generations()->erase(g->mutable_generations()->begin());
  s = d.Attach(bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("lease.groups[2].first_block"));
  // Altered but well formed: the prefill node's digest covers the groups.
  bad = lease;
  bad.mutable_groups(1)->set_block_ids(0, lease.groups(0).block_ids(0));
  s = d.Attach(bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("digest mismatch"));
  ASSERT_TRUE(p.Release(lease).ok());
  EXPECT_TRUE(p.AtBaseline());
  EXPECT_TRUE(d.AtBaseline());
}

// The router over the pair: disaggregated requests equal one node, and a
// node whose KV layout has other groups (all layers in one block) is
// refused at registration naming the groups.
TEST_F(PdHybridTest, RouterPairEqualsOneNodeAndRefusesAnotherLayout) {
  auto other = StartNode("decode", {"--kv-layout", "all-layers"});
  ASSERT_TRUE(other);
  auto r = testing::Daemon::StartSubcommand(
      KVSERVE_BINARY, {"--log-level", "info"}, "route",
      {"--nodes",
       "127.0.0.1:" + std::to_string(prefill_->grpc_port()) + ",127.0.0.1:" +
           std::to_string(decode_->grpc_port()) + ",127.0.0.1:" +
           std::to_string(other->grpc_port()),
       "--pd-mode", "always", "--pd-overlap", "on"});
  ASSERT_TRUE(r.ok()) << r.status();
  std::string log;
  for (int i = 0; i < 200; ++i) {
    log = (*r)->Log();
    if (log.find("refusing node") != std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_THAT(log, HasSubstr("refusing node 127.0.0.1:" + std::to_string(other->grpc_port())));
  EXPECT_THAT(log, HasSubstr("kv_cache_groups"));
  std::this_thread::sleep_for(700ms);  // both nodes of the pair polled
  Client router((*r)->grpc_port()), d(decode_->grpc_port());
  const std::string prompt = LongPrompt(&d, "Through the router, the storm", 560);
  const pdv1::NodeInfo before = d.Info();
  EXPECT_EQ(router.Generate(prompt), Reference(prompt));
  const pdv1::NodeInfo after = d.Info();
  EXPECT_EQ(after.transfers_ok() - before.transfers_ok(), 1);
  EXPECT_GT(after.blocks_pulled() - before.blocks_pulled(), 0);
}

}  // namespace
}  // namespace kvserve
