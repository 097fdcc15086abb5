// Two network namespaces joined by a veth pair: the initiator in this
// process's namespace, the peer inside a namespace the test creates, tcp over
// the veth. Skipped (with the reason) where namespaces cannot be created.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/unit/transport/transfer_harness.h"
#include "transport/ucx_transport.h"

namespace kvserve::transport {
namespace {

using ::kvserve::transport::testing::ConnectToPeer;
using ::kvserve::transport::testing::PeerConfig;
using ::kvserve::transport::testing::PeerProcess;
using ::kvserve::transport::testing::RunRandomBatches;
using ::kvserve::transport::testing::VerifyWholeRegion;

bool Sh(const std::string& command) {
  return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
}

class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Names unique per process so parallel runs do not collide; interface
    // names must fit in 15 characters.
    const std::string tag = absl::StrCat(getpid() % 100000);
    ns_ = "kvt" + tag;
    host_if_ = "kvh" + tag;
    ns_if_ = "kvn" + tag;
    if (geteuid() != 0 || !Sh("ip netns add " + ns_)) {
      GTEST_SKIP() << "cannot create a network namespace here (needs root and "
                      "`ip netns add`); veth test skipped";
    }
    created_ = true;
    const std::string in_ns = "ip netns exec " + ns_ + " ";
    bool ok = Sh("ip link add " + host_if_ + " type veth peer name " + ns_if_) &&
              Sh("ip link set " + ns_if_ + " netns " + ns_) &&
              Sh("ip addr add " + std::string(kHostIp) + "/30 dev " + host_if_) &&
              Sh("ip link set " + host_if_ + " up") &&
              Sh(in_ns + "ip addr add " + kPeerIp + "/30 dev " + ns_if_) &&
              Sh(in_ns + "ip link set " + ns_if_ + " up") &&
              Sh(in_ns + "ip link set lo up");
    if (!ok) {
      GTEST_SKIP() << "veth pair setup failed; veth test skipped";
    }
  }
  void TearDown() override {
    if (!created_) return;
    // Deleting the namespace destroys its veth end and with it the pair.
    Sh("ip netns del " + ns_);
    Sh("ip link del " + host_if_);
  }

  static constexpr char kHostIp[] = "10.255.213.1";
  static constexpr char kPeerIp[] = "10.255.213.2";
  std::string ns_, host_if_, ns_if_;
  bool created_ = false;
};

TEST_F(NetnsTest, RandomBatchesOverVethThenLinkCutFailsWithinBound) {
  UcxTransportOptions options;
  options.name = "initiator";
  options.tls = "tcp";
  options.net_devices = host_if_;
  options.transfer_timeout = absl::Seconds(5);  // generous: CI machines are loaded
  auto transport = CreateUcxTransport(options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  auto local = (*transport)->AllocateRegion(4 << 20);
  ASSERT_TRUE(local.ok());

  PeerConfig config;
  config.name = "in-netns";
  config.tls = "tcp";
  config.net_devices = ns_if_;
  config.netns = ns_;
  config.seed = 11;
  auto process = PeerProcess::Spawn(config);
  ASSERT_TRUE(process.ok()) << process.status();
  auto session = ConnectToPeer(**transport, *process);
  ASSERT_TRUE(session.ok()) << session.status();
  std::mt19937_64 rng(77);
  absl::Status s = RunRandomBatches(**transport, *local, *session, *process, 300,
                                    rng, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(VerifyWholeRegion(*session, *process).ok());

  // Cut the wire with transfers in flight: they must fail, not hang.
  std::vector<TransferOp> ops;
  for (uint64_t off = 0; off < (4u << 20); off += 65536) {
    ops.push_back({local->id, off, session->remote, off, 65536});
  }
  ASSERT_TRUE(Sh("ip link set " + host_if_ + " down"));
  const absl::Time cut = absl::Now();
  absl::Status failure;
  while (failure.ok() && absl::Now() - cut < absl::Seconds(8)) {
    auto id = (*transport)->PostTransfer(session->peer, Direction::kWrite, ops);
    if (!id.ok()) {
      failure = id.status();
      break;
    }
    failure = (*transport)->Wait(*id, absl::Seconds(8));
    EXPECT_TRUE((*transport)->ReleaseTransfer(*id).ok());
  }
  EXPECT_FALSE(failure.ok());
  EXPECT_LT(absl::Now() - cut, absl::Seconds(8));
  std::printf("[ netns ] link cut detected after %s: %s\n",
              absl::FormatDuration(absl::Now() - cut).c_str(),
              failure.ToString().c_str());
}

}  // namespace
}  // namespace kvserve::transport
