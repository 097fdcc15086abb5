// Prefill/decode disaggregation across a real network link that is cut
// mid-pull (stories260K). The test makes two network namespaces: the
// prefill node serves in one, the decode node in the other, joined by a
// veth pair that carries their gRPC (lease renew/release) and their UCX
// pulls (tcp only, over that veth). Each namespace also has a control veth
// into this process's (root) namespace, so the test reaches both nodes'
// gRPC ports while the P<->D link is down. The namespaces have no default
// route: nothing leaves them. A decode pull is stalled
// (--pd-test-pull-delay), the P<->D link is set down, and then: the decode
// request must finish (recomputed locally, equal to a `both` node's output)
// instead of hanging; the prefill node's lease must expire and free its
// blocks (decode cannot release it); both nodes return to baseline; and once
// the link is back a cross-node pull works again. Skipped (with the reason)
// where namespaces cannot be created (not root, no `ip netns`).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/kvserve.grpc.pb.h"
#include "proto/pd.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace v1 = ::kvserve::v1;
namespace pdv1 = ::kvserve::pd::v1;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kMaxTokens = 12;
// iproute2's `ip`, or "" when it is not installed.
std::string IpBinary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

bool Sh(const std::string& command) {
  return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
}

struct Client {
  explicit Client(const std::string& address) {
    channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
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
  // Greedy token ids, or the error as text. The deadline bounds a hang.
  std::string Generate(const std::string& prompt, std::chrono::seconds deadline = 60s) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + deadline);
    auto reader = api->Generate(&c, Request(prompt));
    v1::GenerateResponse resp;
    std::string ids;
    while (reader->Read(&resp)) {
      for (int32_t t : resp.token_ids()) ids += std::to_string(t) + " ";
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) return absl::StrCat("error ", s.error_code(), ": ", s.error_message());
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
  grpc::Status Prefill(const std::string& prompt, uint32_t ttl_ms, pdv1::Lease* lease) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 30s);
    pdv1::PrefillRequest r;
    r.set_generate_request(Request(prompt).SerializeAsString());
    r.set_ttl_ms(ttl_ms);
    return pdx->Prefill(&c, r, lease);
  }
  grpc::Status Attach(const pdv1::Lease& lease) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 10s);
    pdv1::AttachLeaseResponse r;
    return pdx->AttachLease(&c, lease, &r);
  }
  grpc::Status Release(const pdv1::Lease& lease) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + 5s);
    pdv1::ReleaseLeaseRequest r;
    r.set_transfer_id(lease.transfer_id());
    r.set_incarnation(lease.incarnation());
    pdv1::ReleaseLeaseResponse resp;
    return pdx->ReleaseLease(&c, r, &resp);
  }
  // Waits until no block is pinned and no lease is held; false after
  // `bound` (a hang or a leak, not a timing check).
  bool AtBaseline(std::chrono::seconds bound = 15s) {
    const auto deadline = Clock::now() + bound;
    while (Clock::now() < deadline) {
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

// Prompts whose first block is their own, so every leased block is pulled.
std::string UniquePrompt(const std::string& tag) {
  return tag + ": Once upon a time, there was a little girl named Lily. She loved to play "
               "outside in the park with her friends. Then one day";
}

class PdNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K");
    // Names unique per process; interface names fit in 15 characters.
    const int pid = getpid();
    const std::string tag = absl::StrCat(pid % 100000);
    ns_a_ = absl::StrCat("kvs-pd-", pid, "-a");
    ns_b_ = absl::StrCat("kvs-pd-", pid, "-b");
    link_a_ = "kvl" + tag + "a";
    link_b_ = "kvl" + tag + "b";
    ctl_a_ = "kvc" + tag + "a";
    ctl_a_root_ = "kvc" + tag + "A";
    ctl_b_ = "kvc" + tag + "b";
    ctl_b_root_ = "kvc" + tag + "B";
    const int s = pid % 250;
    link_ip_a_ = absl::StrCat("10.201.", s, ".1");
    link_ip_b_ = absl::StrCat("10.201.", s, ".2");
    ctl_ip_a_ = absl::StrCat("10.202.", s, ".2");
    ctl_ip_b_ = absl::StrCat("10.203.", s, ".2");
    if (geteuid() != 0) {
      GTEST_SKIP() << "not root: cannot create network namespaces; netns link-cut test skipped";
    }
    if (IpBinary().empty()) GTEST_SKIP() << "iproute2 `ip` not found; netns link-cut test skipped";
    RemoveNamespaces();  // a stale set left by a crashed run with this pid
    if (!Sh("ip netns add " + ns_a_)) {
      GTEST_SKIP() << "`ip netns add " << ns_a_
                   << "` failed (no privilege or no iproute2); netns link-cut test skipped";
    }
    created_ = true;
    const std::string in_a = "ip netns exec " + ns_a_ + " ";
    const std::string in_b = "ip netns exec " + ns_b_ + " ";
    const bool ok =
        Sh("ip netns add " + ns_b_) &&
        // The P<->D link, namespace to namespace.
        Sh("ip link add " + link_a_ + " type veth peer name " + link_b_) &&
        Sh("ip link set " + link_a_ + " netns " + ns_a_) &&
        Sh("ip link set " + link_b_ + " netns " + ns_b_) &&
        Sh(in_a + "ip addr add " + link_ip_a_ + "/30 dev " + link_a_) &&
        Sh(in_b + "ip addr add " + link_ip_b_ + "/30 dev " + link_b_) &&
        Sh(in_a + "ip link set " + link_a_ + " up") && Sh(in_b + "ip link set " + link_b_ + " up") &&
        // The control links, root namespace to each namespace (this test's
        // gRPC only).
        Sh("ip link add " + ctl_a_root_ + " type veth peer name " + ctl_a_) &&
        Sh("ip link set " + ctl_a_ + " netns " + ns_a_) &&
        Sh(absl::StrCat("ip addr add 10.202.", s, ".1/30 dev ", ctl_a_root_)) &&
        Sh("ip link set " + ctl_a_root_ + " up") &&
        Sh(in_a + "ip addr add " + ctl_ip_a_ + "/30 dev " + ctl_a_) &&
        Sh(in_a + "ip link set " + ctl_a_ + " up") &&
        Sh("ip link add " + ctl_b_root_ + " type veth peer name " + ctl_b_) &&
        Sh("ip link set " + ctl_b_ + " netns " + ns_b_) &&
        Sh(absl::StrCat("ip addr add 10.203.", s, ".1/30 dev ", ctl_b_root_)) &&
        Sh("ip link set " + ctl_b_root_ + " up") &&
        Sh(in_b + "ip addr add " + ctl_ip_b_ + "/30 dev " + ctl_b_) &&
        Sh(in_b + "ip link set " + ctl_b_ + " up") && Sh(in_a + "ip link set lo up") &&
        Sh(in_b + "ip link set lo up");
    if (!ok) GTEST_SKIP() << "veth setup between " << ns_a_ << " and " << ns_b_ << " failed";
  }

  void TearDown() override {
    // The daemons first: a namespace outlives `ip netns del` while a
    // process still runs in it.
    prefill_.reset();
    decode_.reset();
    both_.reset();
    if (created_) RemoveNamespaces();
  }

  void RemoveNamespaces() {
    // Deleting a namespace destroys the veth ends in it, and with them the
    // pairs; the root-side ends go too (deleted here in case).
    Sh("ip netns del " + ns_a_);
    Sh("ip netns del " + ns_b_);
    Sh("ip link del " + ctl_a_root_);
    Sh("ip link del " + ctl_b_root_);
  }

  // `ip netns exec NS kvserve ... serve --role ROLE` (ip execs kvserve, so
  // the Daemon's pid is the node's), UCX on tcp over the P<->D veth only.
  std::unique_ptr<testing::Daemon> StartInNamespace(const std::string& ns, const std::string& role,
                                                    const std::string& grpc_address,
                                                    const std::string& advertise,
                                                    const std::string& ucx_device,
                                                    std::vector<std::string> extra = {}) {
    std::vector<std::string> global = {"netns",       "exec", ns,  KVSERVE_BINARY,
                                       "--log-level", "info", "-t", "1",
                                       "-m",          testing::Stories260KPath()};
    std::vector<std::string> serve = {"--role",
                                      role,
                                      "--grpc-address",
                                      grpc_address,
                                      "--pd-advertise-host",
                                      advertise,
                                      "--pd-ucx-tls",
                                      "tcp",
                                      "--pd-ucx-net-devices",
                                      ucx_device,
                                      "--drain-timeout",
                                      "2",
                                      "--pd-transfer-timeout",
                                      "3",
                                      "--pd-test-hooks",
                                      "--kv-cache-memory",
                                      "16MiB"};
    serve.insert(serve.end(), extra.begin(), extra.end());
    auto d = testing::Daemon::Start(IpBinary(), global, serve);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(d).value() : nullptr;
  }

  // Starts the nodes (decode stalling `pull_delay` s before each pull),
    // checks a pull over the veth, then cuts the link during a stalled pull
    // of a lease with ttl `ttl_ms` (see the tests for which step meets the
    // dead link first) and checks the outcome.
    void CutLinkMidPull(uint32_t ttl_ms, const std::string& pull_delay) {
    // The reference outputs: a `both` node on 127.0.0.1 in this namespace.
    auto b = testing::Daemon::Start(
        KVSERVE_BINARY, {"--log-level", "info", "-t", "1", "-m", testing::Stories260KPath()},
        {"--role", "both", "--kv-cache-memory", "16MiB"});
    ASSERT_TRUE(b.ok()) << b.status();
    both_ = std::move(b).value();
    // Prefill binds every address in its namespace: decode reaches it on the
    // P<->D link (the address in its leases), this test on the control link.
    prefill_ = StartInNamespace(ns_a_, "prefill", "0.0.0.0:0", link_ip_a_, link_a_);
    decode_ = StartInNamespace(ns_b_, "decode", ctl_ip_b_ + ":0", link_ip_b_, link_b_,
                               {"--pd-test-pull-delay", pull_delay});
    ASSERT_TRUE(prefill_ && decode_);
    Client ref("127.0.0.1:" + std::to_string(both_->grpc_port()));
    Client p(ctl_ip_a_ + ":" + std::to_string(prefill_->grpc_port()));
    Client d(ctl_ip_b_ + ":" + std::to_string(decode_->grpc_port()));
    EXPECT_NE(decode_->Log().find("UCX transports 'tcp"), std::string::npos) << decode_->Log();

    // 1. A pull over the veth works (UCX tcp across the namespaces).
    const std::string warm = UniquePrompt("Over the wire");
    pdv1::Lease lease;
    ASSERT_TRUE(p.Prefill(warm, ttl_ms, &lease).ok());
    ASSERT_GT(lease.block_ids_size(), 0);
    EXPECT_EQ(lease.grpc_address().rfind(link_ip_a_ + ":", 0), 0u) << lease.grpc_address();
    ASSERT_TRUE(d.Attach(lease).ok());
    EXPECT_EQ(d.Generate(warm), ref.Generate(warm));
    EXPECT_EQ(d.Info().transfers_ok(), 1);
    EXPECT_TRUE(p.AtBaseline());
    EXPECT_TRUE(d.AtBaseline());

    // 2. A pull stalled by the delay, the link cut meanwhile.
    const std::string cut = UniquePrompt("Cut link");
    const std::string want = ref.Generate(cut);
    ASSERT_TRUE(p.Prefill(cut, ttl_ms, &lease).ok());
    ASSERT_GT(lease.block_ids_size(), 0);
    ASSERT_TRUE(d.Attach(lease).ok());
    const int64_t expired = p.Info().leases_expired();
    // The bound that detects a hang: the stall, the transfer timeout and the
    // renewal/release deadlines, with a wide margin for a loaded machine.
    auto result = std::async(std::launch::async, [&] { return d.Generate(cut, 90s); });
    bool arriving = false;
    for (auto until = Clock::now() + 30s; Clock::now() < until && !arriving;) {
      arriving = d.Stats().kv_arriving() > 0;
      if (!arriving) std::this_thread::sleep_for(20ms);
    }
    ASSERT_TRUE(arriving) << "the decode request never waited for the pull";
    ASSERT_TRUE(Sh("ip netns exec " + ns_a_ + " ip link set " + link_a_ + " down"));
    const auto cut_at = Clock::now();
    const auto secs = [&] { return std::chrono::duration<double>(Clock::now() - cut_at).count(); };
    // Decode cannot reach prefill: it recomputes the prompt locally.
    EXPECT_EQ(result.get(), want) << decode_->Log();
    std::printf("[ netns ] decode request finished %.1f s after the cut\n", secs());
    const pdv1::NodeInfo di = d.Info();
    EXPECT_EQ(di.transfers_ok(), 1);
    EXPECT_EQ(di.transfers_failed(), 1);
    EXPECT_NE(decode_->Log().find("failed, recomputing locally"), std::string::npos);
    EXPECT_TRUE(d.AtBaseline());
    // Nobody can release the prefill node's lease: it expires and frees.
    EXPECT_TRUE(p.AtBaseline(std::chrono::seconds(ttl_ms / 1000 + 30)));
    std::printf("[ netns ] prefill at baseline %.1f s after the cut (lease ttl %.1f s)\n", secs(),
                ttl_ms / 1000.0);
    EXPECT_EQ(p.Info().leases_expired(), expired + 1);
    std::printf("[ netns ] decode log after the cut:\n");
    {
      const std::string log = decode_->Log();
      for (size_t at = log.find("pd: pull of transfer"); at != std::string::npos;
           at = log.find("pd: pull of transfer", at + 1)) {
        std::printf("  %s\n", log.substr(at, log.find('\n', at) - at).c_str());
      }
    }

    // 3. Each node still serves on its own...
    const std::string local = UniquePrompt("Local after the cut");
    EXPECT_EQ(d.Generate(local), ref.Generate(local));
    EXPECT_TRUE(d.AtBaseline());
    // ...and with the link back, a cross-node pull works again. decode's gRPC
    // channel to prefill may sit in reconnect backoff: retry the attach, each
    // try with a fresh lease (this test releases a refused one).
    ASSERT_TRUE(Sh("ip netns exec " + ns_a_ + " ip link set " + link_a_ + " up"));
    const std::string again = UniquePrompt("Link restored");
    grpc::Status attached = grpc::Status(grpc::StatusCode::UNKNOWN, "no attempt");
    int tries = 0;
    const auto restored_at = Clock::now();
    for (auto until = Clock::now() + 90s; Clock::now() < until && !attached.ok();) {
      ASSERT_TRUE(p.Prefill(again, ttl_ms, &lease).ok());
      attached = d.Attach(lease);
      ++tries;
      if (!attached.ok()) {
        EXPECT_TRUE(p.Release(lease).ok());
        std::this_thread::sleep_for(1s);
      }
    }
    ASSERT_TRUE(attached.ok()) << attached.error_message();
    std::printf("[ netns ] attach through the restored link after %d tries, %.1f s\n", tries,
                std::chrono::duration<double>(Clock::now() - restored_at).count());
    EXPECT_EQ(d.Generate(again), ref.Generate(again));
    EXPECT_EQ(d.Info().transfers_ok(), 2);
    EXPECT_TRUE(d.AtBaseline());
    EXPECT_TRUE(p.AtBaseline(std::chrono::seconds(ttl_ms / 1000 + 30)));
  }

  std::string ns_a_, ns_b_, link_a_, link_b_, ctl_a_, ctl_a_root_, ctl_b_, ctl_b_root_;
  std::string link_ip_a_, link_ip_b_, ctl_ip_a_, ctl_ip_b_;
  bool created_ = false;
  std::unique_ptr<testing::Daemon> both_, prefill_, decode_;
};

// A lease ttl of 6 s is renewed every 2 s: the renewal during the 4 s
// stall is the first thing to meet the dead link (gRPC to prefill fails).
TEST_F(PdNetnsTest, LinkCutDuringStalledPullFailsTheRenewalAndRecomputes) {
  CutLinkMidPull(6000, "4");
}

// A lease ttl of 30 s needs no renewal before the UCX read: after the 3 s
// stall the read is posted on the dead link and must fail (transport
// deadline / peer error), not hang.
TEST_F(PdNetnsTest, LinkCutBeforeTheUcxReadFailsTheReadAndRecomputes) {
  CutLinkMidPull(30000, "3");
}

}  // namespace
}  // namespace kvserve
