#include "transport/ucx_transport.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/unit/transport/transfer_harness.h"
#include "transport/descriptor.h"
#include "transport/loopback_transport.h"

namespace kvserve::transport {
namespace {

using ::kvserve::transport::testing::BatchStats;
using ::kvserve::transport::testing::ConnectToPeer;
using ::kvserve::transport::testing::PeerConfig;
using ::kvserve::transport::testing::PeerProcess;
using ::kvserve::transport::testing::PeerSession;
using ::kvserve::transport::testing::RunRandomBatches;
using ::kvserve::transport::testing::VerifyWholeRegion;

constexpr char kShmTls[] = "posix,cma";

UcxTransportOptions Options(std::string name, std::string tls = kShmTls,
                            std::string devices = "") {
  UcxTransportOptions o;
  o.name = std::move(name);
  o.tls = std::move(tls);
  o.net_devices = std::move(devices);
  // Long enough that a peer starved of CPU on a loaded 2-core CI machine is
  // not declared dead, short enough to bound the killed-peer test.
  o.transfer_timeout = absl::Seconds(6);
  return o;
}

// Two agents in one process, over shared memory.
class UcxTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    copier_ = std::make_shared<HostStandInCopier>();
    auto oa = Options("a");
    auto ob = Options("b");
    oa.device_copier = ob.device_copier = copier_;
    oa.force_cuda_staging = ob.force_cuda_staging = true;
    a_ = *CreateUcxTransport(oa);
    b_ = *CreateUcxTransport(ob);
    src_ = *a_->AllocateRegion(kBytes);
    dst_ = *b_->AllocateRegion(kBytes);
    auto* s = static_cast<uint8_t*>(src_.address);
    for (size_t i = 0; i < kBytes; ++i) s[i] = static_cast<uint8_t>(i * 7 + 1);
    peer_ = *a_->Connect(*b_->LocalAddress());
    remote_ = *a_->ImportRegion(peer_, *b_->DescribeRegion(dst_.id));
  }
  absl::Status Move(Direction d, std::vector<TransferOp> ops,
                    absl::string_view note = {}) {
    auto id = a_->PostTransfer(peer_, d, ops, note);
    if (!id.ok()) return id.status();
    absl::Status s = a_->Wait(*id, absl::Seconds(5));
    absl::Status r = a_->ReleaseTransfer(*id);
    return s.ok() ? r : s;
  }

  static constexpr size_t kBytes = 1 << 20;
  std::shared_ptr<HostStandInCopier> copier_;
  std::unique_ptr<Transport> a_, b_;
  LocalRegion src_, dst_;
  PeerId peer_ = 0;
  RemoteRegionId remote_ = 0;
};

TEST_F(UcxTransportTest, ReportsCapabilitiesAndStagingChoice) {
  Capabilities c = a_->GetCapabilities();
  EXPECT_EQ(c.backend, "ucx");
  EXPECT_TRUE(c.notifications);
  EXPECT_TRUE(c.reads);
  // Forced here; on Debian's UCX (no CUDA) it is the only choice anyway.
  EXPECT_TRUE(c.cuda_staged);
  EXPECT_FALSE(c.cuda_direct);
  EXPECT_EQ(c.transports, kShmTls);
}

TEST_F(UcxTransportTest, WriteBatchLandsBeforeNotification) {
  std::vector<TransferOp> ops;
  for (int i = 0; i < 16; ++i) {
    ops.push_back({src_.id, uint64_t(i) * 65536, remote_,
                   uint64_t(15 - i) * 65536, 65536});
  }
  ASSERT_TRUE(Move(Direction::kWrite, ops, "landed").ok());
  auto note = b_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->from, "a");
  EXPECT_EQ(note->payload, "landed");
  auto* s = static_cast<uint8_t*>(src_.address);
  auto* d = static_cast<uint8_t*>(dst_.address);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(Fnv1a64(s + i * 65536, 65536), Fnv1a64(d + (15 - i) * 65536, 65536));
  }
}

TEST_F(UcxTransportTest, ReadsRemoteBytes) {
  auto* d = static_cast<uint8_t*>(dst_.address);
  for (int i = 0; i < 4096; ++i) d[100 + i] = static_cast<uint8_t>(i ^ 0x5a);
  ASSERT_TRUE(Move(Direction::kRead, {{src_.id, 7, remote_, 100, 4096}}).ok());
  EXPECT_EQ(Fnv1a64(static_cast<uint8_t*>(src_.address) + 7, 4096),
            Fnv1a64(d + 100, 4096));
}

TEST_F(UcxTransportTest, RejectsOutOfRangeAndUnknownOps) {
  auto code = [&](TransferOp op) {
    return a_->PostTransfer(peer_, Direction::kWrite, {op}).status().code();
  };
  EXPECT_EQ(code({src_.id, 0, remote_, kBytes - 1, 2}), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code({src_.id, kBytes, remote_, 0, 1}), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code({src_.id, ~0ull, remote_, 0, 2}), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code({src_.id, 0, remote_, 1, ~0ull}), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code({src_.id, 0, remote_, 0, 0}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({src_.id + 1000, 0, remote_, 0, 1}), absl::StatusCode::kNotFound);
  EXPECT_EQ(code({src_.id, 0, remote_ + 1000, 0, 1}), absl::StatusCode::kNotFound);
  auto status = a_->PostTransfer(peer_, Direction::kWrite,
                                 {{src_.id, 0, remote_, kBytes - 1, 2}}).status();
  EXPECT_NE(status.message().find("exceeds remote region"), std::string::npos)
      << status;
  // A bad op anywhere rejects the whole batch; nothing was posted.
  EXPECT_TRUE(a_->DeregisterRegion(src_.id).ok());
}

TEST_F(UcxTransportTest, RejectsMalformedDescriptorsAndAddresses) {
  std::string good = *b_->DescribeRegion(dst_.id);
  EXPECT_EQ(a_->ImportRegion(peer_, good.substr(0, good.size() / 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::string flipped = good;
  flipped[20] ^= 0x10;
  EXPECT_EQ(a_->ImportRegion(peer_, flipped).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A descriptor of another backend.
  auto loop = CreateLoopbackTransport();
  std::vector<char> mem(64);
  auto r = loop->RegisterRegion(mem.data(), mem.size(), MemoryKind::kHost);
  auto foreign = a_->ImportRegion(peer_, *loop->DescribeRegion(r->id));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(foreign.status().message().find("loopback"), std::string::npos);
  // A valid descriptor of a third agent is not importable through peer b.
  auto c = CreateUcxTransport(Options("c"));
  ASSERT_TRUE(c.ok());
  auto c_region = (*c)->AllocateRegion(4096);
  auto third = a_->ImportRegion(peer_, *(*c)->DescribeRegion(c_region->id));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(third.status().message().find("another agent"), std::string::npos);
  EXPECT_EQ(a_->Connect("short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->Connect(*loop->LocalAddress()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->ImportRegion(peer_ + 99, good).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(UcxTransportTest, StagedDeviceRegionsMoveThroughHostBuffers) {
  std::vector<uint8_t> device_src(8192), device_dst(8192, 0);
  std::iota(device_src.begin(), device_src.end(), 3);
  auto gpu_src = a_->RegisterRegion(device_src.data(), device_src.size(), MemoryKind::kCuda);
  auto gpu_dst = b_->RegisterRegion(device_dst.data(), device_dst.size(), MemoryKind::kCuda);
  ASSERT_TRUE(gpu_src.ok() && gpu_dst.ok());
  auto remote = a_->ImportRegion(peer_, *b_->DescribeRegion(gpu_dst->id));
  ASSERT_TRUE(remote.ok());
  EXPECT_TRUE(UnpackRegionDescriptor(*b_->DescribeRegion(gpu_dst->id))->staged);
  size_t d2h = copier_->device_to_host_bytes();
  size_t h2d = copier_->host_to_device_bytes();
  // No notification asked for: the transport still tells the target to copy
  // its staging to the device.
  ASSERT_TRUE(Move(Direction::kWrite, {{gpu_src->id, 0, *remote, 100, 4000},
                                       {gpu_src->id, 5000, *remote, 6000, 1000}})
                  .ok());
  EXPECT_EQ(copier_->device_to_host_bytes() - d2h, 5000u);
  // The target applies staged ranges on its progress thread; wait for it.
  for (int i = 0; i < 500 && copier_->host_to_device_bytes() - h2d < 5000; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(copier_->host_to_device_bytes() - h2d, 5000u);
  EXPECT_TRUE(std::equal(device_src.begin(), device_src.begin() + 4000,
                         device_dst.begin() + 100));
  EXPECT_TRUE(std::equal(device_src.begin() + 5000, device_src.begin() + 6000,
                         device_dst.begin() + 6000));
  // Reading into a staged local region lands on the device when done.
  std::fill(device_src.begin(), device_src.end(), 0);
  ASSERT_TRUE(Move(Direction::kRead, {{gpu_src->id, 0, remote_, 0, 256}}).ok());
  EXPECT_EQ(Fnv1a64(device_src.data(), 256), Fnv1a64(dst_.address, 256));
}

// A peer reads a staged device region from its host buffer: device writes
// made after registration are invisible to it until the owner syncs the
// range (what a prefill node with a CUDA pool does before granting a lease).
TEST_F(UcxTransportTest, RemoteReadsOfAStagedRegionSeeDeviceWritesOnlyAfterSync) {
  std::vector<uint8_t> device(8192, 0x11);
  auto gpu = b_->RegisterRegion(device.data(), device.size(), MemoryKind::kCuda);
  ASSERT_TRUE(gpu.ok());
  auto remote = a_->ImportRegion(peer_, *b_->DescribeRegion(gpu->id));
  ASSERT_TRUE(remote.ok());
  auto* got = static_cast<uint8_t*>(src_.address);
  ASSERT_TRUE(Move(Direction::kRead, {{src_.id, 0, *remote, 4096, 1024}}).ok());
  EXPECT_EQ(got[0], 0x11);                                        // the bytes at registration
  std::fill(device.begin() + 4096, device.begin() + 5120, 0x22);  // a device write
  ASSERT_TRUE(Move(Direction::kRead, {{src_.id, 0, *remote, 4096, 1024}}).ok());
  EXPECT_EQ(got[0], 0x11) << "unsynced device writes must not be what this test sees";
  const size_t d2h = copier_->device_to_host_bytes();
  ASSERT_TRUE(b_->SyncStagingFromDevice(gpu->id, 4096, 1024).ok());
  EXPECT_EQ(copier_->device_to_host_bytes() - d2h, 1024u);
  ASSERT_TRUE(Move(Direction::kRead, {{src_.id, 0, *remote, 4096, 1024}}).ok());
  EXPECT_TRUE(std::all_of(got, got + 1024, [](uint8_t b) { return b == 0x22; }));
  // Host regions have no staging (a no-op); bad ranges and ids are errors.
  EXPECT_TRUE(b_->SyncStagingFromDevice(dst_.id, 0, 64).ok());
  EXPECT_EQ(copier_->device_to_host_bytes() - d2h, 1024u);
  EXPECT_EQ(b_->SyncStagingFromDevice(gpu->id, 8000, 400).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(b_->SyncStagingFromDevice(gpu->id + 1000, 0, 1).code(), absl::StatusCode::kNotFound);
}

TEST_F(UcxTransportTest, CancelEndsTheTransferAndReleasesIt) {
  std::vector<TransferOp> ops;
  for (int i = 0; i < 16; ++i) {
    ops.push_back({src_.id, uint64_t(i) * 65536, remote_, uint64_t(i) * 65536, 65536});
  }
  auto id = a_->PostTransfer(peer_, Direction::kWrite, ops, "never");
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a_->Cancel(*id).ok());
  absl::Status s = a_->Wait(*id, absl::Seconds(5));
  EXPECT_TRUE(s.ok() || absl::IsCancelled(s)) << s;
  EXPECT_TRUE(a_->ReleaseTransfer(*id).ok());
  EXPECT_EQ(a_->Poll(*id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a_->Cancel(*id).code(), absl::StatusCode::kNotFound);
  // The agent keeps working.
  EXPECT_TRUE(Move(Direction::kWrite, {{src_.id, 0, remote_, 0, 64}}).ok());
}

TEST_F(UcxTransportTest, RegionInUseCannotBeDeregisteredAndDisconnectReleases) {
  EXPECT_EQ(a_->DeregisterRegion(12345).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(a_->ReleaseRemoteRegion(remote_).ok());
  EXPECT_EQ(a_->ReleaseRemoteRegion(remote_).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(a_->Disconnect(peer_).ok());
  EXPECT_EQ(a_->PostTransfer(peer_, Direction::kWrite, {{src_.id, 0, remote_, 0, 1}})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(UcxTransportOptionsTest, BadTransportListIsAnError) {
  auto t = CreateUcxTransport(Options("x", "no-such-transport"));
  EXPECT_FALSE(t.ok());
}

// ---- Two processes ----

struct Link {
  const char* name;
  const char* tls;
  const char* net_devices;
};

class TransportProcessTest : public ::testing::TestWithParam<Link> {
 protected:
  PeerConfig Peer(std::string name, uint64_t seed) {
    PeerConfig c;
    c.name = std::move(name);
    c.tls = GetParam().tls;
    c.net_devices = GetParam().net_devices;
    c.seed = seed;
    return c;
  }
  std::unique_ptr<Transport> Initiator() {
    auto t = CreateUcxTransport(Options("initiator", GetParam().tls,
                                        GetParam().net_devices));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
};

TEST_P(TransportProcessTest, RandomScatterGatherBatchesVerifyEveryByte) {
  auto transport = Initiator();
  ASSERT_NE(transport, nullptr);
  auto local = transport->AllocateRegion(4 << 20);
  ASSERT_TRUE(local.ok());
  std::mt19937_64 rng(1234);
  // One peer exposes UCX-allocated memory, the other plain malloc'd memory
  // (a different UCX path for shared memory transports).
  for (bool user_memory : {false, true}) {
    PeerConfig config = Peer(user_memory ? "user-mem" : "ucx-mem", 7);
    config.user_memory = user_memory;
    auto process = PeerProcess::Spawn(config);
    ASSERT_TRUE(process.ok()) << process.status();
    auto session = ConnectToPeer(*transport, *process);
    ASSERT_TRUE(session.ok()) << session.status();
    BatchStats stats;
    absl::Status s = RunRandomBatches(*transport, *local, *session, *process,
                                      user_memory ? 500 : 1500, rng, &stats);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(VerifyWholeRegion(*session, *process).ok());
    EXPECT_GT(stats.write_batches, 0);
    EXPECT_GT(stats.read_batches, 0);
    std::printf("[ %s ] %s: %d write + %d read batches, %llu pieces, %.1f MiB\n",
                GetParam().name, config.name.c_str(), stats.write_batches,
                stats.read_batches, static_cast<unsigned long long>(stats.pieces),
                stats.bytes / 1048576.0);
    ASSERT_TRUE(transport->Disconnect(session->peer).ok());
  }
}

TEST_P(TransportProcessTest, StagedDeviceTargetInAnotherProcess) {
  auto transport = Initiator();
  ASSERT_NE(transport, nullptr);
  auto local = transport->AllocateRegion(4 << 20);
  PeerConfig config = Peer("staged", 3);
  config.staged = true;
  auto process = PeerProcess::Spawn(config);
  ASSERT_TRUE(process.ok()) << process.status();
  auto session = ConnectToPeer(*transport, *process);
  ASSERT_TRUE(session.ok()) << session.status();
  std::mt19937_64 rng(99);
  // Writes are verified by the peer against its "device" copy, which only
  // holds the bytes if the staging copy ran before the notification.
  ASSERT_TRUE(RunRandomBatches(*transport, *local, *session, *process, 200, rng,
                               nullptr)
                  .ok());
  ASSERT_TRUE(VerifyWholeRegion(*session, *process).ok());
}

TEST_P(TransportProcessTest, KilledPeerFailsWithinBoundAndSurvivorContinues) {
  auto transport = Initiator();  // transfer_timeout 6 s
  ASSERT_NE(transport, nullptr);
  auto local = transport->AllocateRegion(16 << 20);
  ASSERT_TRUE(local.ok());
  PeerConfig victim_config = Peer("victim", 5);
  victim_config.region_bytes = 16 << 20;
  victim_config.user_memory = true;  // not a shared segment: death is visible
  auto victim = PeerProcess::Spawn(victim_config);
  auto other = PeerProcess::Spawn(Peer("survivor", 6));
  ASSERT_TRUE(victim.ok() && other.ok());
  auto victim_session = ConnectToPeer(*transport, *victim);
  auto other_session = ConnectToPeer(*transport, *other);
  ASSERT_TRUE(victim_session.ok() && other_session.ok());

  // Keep several 16 MiB batches of 64 KiB pieces in flight, kill the victim,
  // and keep posting until the failure shows.
  std::vector<TransferOp> ops;
  for (uint64_t off = 0; off < (16u << 20); off += 65536) {
    ops.push_back({local->id, off, victim_session->remote, off, 65536});
  }
  // Both connections carry verified traffic before the kill, as a decode
  // node's links to its prefill peers do. Over shared memory (UCX 1.13) a
  // connection whose first use comes after a peer was killed could hang its
  // first notification: the new endpoint's handshake reply is never read
  // (7 of 120 runs; 0 of 120 with both links in use before the kill).
  {
    std::mt19937_64 warm_rng(11);
    ASSERT_TRUE(RunRandomBatches(*transport, *local, *victim_session, *victim, 6,
                                 warm_rng, nullptr)
                    .ok());
    ASSERT_TRUE(RunRandomBatches(*transport, *local, *other_session, *other, 6,
                                 warm_rng, nullptr)
                    .ok());
  }
  std::vector<TransferId> pending;
  for (int i = 0; i < 4; ++i) {
    auto id = transport->PostTransfer(victim_session->peer, i % 2 ? Direction::kRead
                                                                 : Direction::kWrite,
                                      ops, "x");
    ASSERT_TRUE(id.ok()) << id.status();
    pending.push_back(*id);
  }
  victim->Kill();
  const absl::Time killed = absl::Now();
  const absl::Duration bound = absl::Seconds(6) + absl::Seconds(2);
  absl::Status failure;
  while (failure.ok() && absl::Now() - killed < bound) {
    auto id = transport->PostTransfer(victim_session->peer, Direction::kRead, ops);
    if (!id.ok()) {
      failure = id.status();
      break;
    }
    pending.push_back(*id);
    failure = transport->Wait(*id, bound);
  }
  const absl::Duration took = absl::Now() - killed;
  EXPECT_FALSE(failure.ok()) << "no error within " << bound;
  EXPECT_LT(took, bound);
  std::printf("[ %s ] killed peer detected after %s: %s\n", GetParam().name,
              absl::FormatDuration(took).c_str(), failure.ToString().c_str());
  // Every transfer to the dead peer is finished (OK if it beat the kill).
  for (TransferId id : pending) {
    absl::Status s = transport->Wait(id, absl::Seconds(1));
    EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(transport->ReleaseTransfer(id).ok());
  }
  EXPECT_FALSE(transport->PostTransfer(victim_session->peer, Direction::kWrite, ops).ok());
  EXPECT_TRUE(transport->Disconnect(victim_session->peer).ok());

  // The survivor is unaffected.
  std::mt19937_64 rng(5);
  absl::Status survivor =
      RunRandomBatches(*transport, *local, *other_session, *other, 100, rng, nullptr);
  ASSERT_TRUE(survivor.ok()) << survivor;
  ASSERT_TRUE(VerifyWholeRegion(*other_session, *other).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Links, TransportProcessTest,
    ::testing::Values(Link{"shm_posix", "posix,cma", ""},
                      Link{"shm_sysv", "sysv,cma", ""},
                      Link{"tcp", "tcp", "lo"}),
    [](const ::testing::TestParamInfo<Link>& info) { return info.param.name; });

}  // namespace
}  // namespace kvserve::transport
