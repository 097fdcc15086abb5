#include "transport/loopback_transport.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace kvserve::transport {
namespace {

class LoopbackTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    copier_ = std::make_shared<HostStandInCopier>();
    a_ = CreateLoopbackTransport({"a", copier_});
    b_ = CreateLoopbackTransport({"b", copier_});
    src_.resize(1 << 16);
    std::iota(src_.begin(), src_.end(), 0);
    dst_.assign(1 << 16, 0);
    src_region_ = *a_->RegisterRegion(src_.data(), src_.size(), MemoryKind::kHost);
    dst_region_ = *b_->RegisterRegion(dst_.data(), dst_.size(), MemoryKind::kHost);
    peer_ = *a_->Connect(*b_->LocalAddress());
    remote_ = *a_->ImportRegion(peer_, *b_->DescribeRegion(dst_region_.id));
  }

  std::shared_ptr<HostStandInCopier> copier_;
  std::unique_ptr<Transport> a_, b_;
  std::vector<uint8_t> src_, dst_;
  LocalRegion src_region_, dst_region_;
  PeerId peer_ = 0;
  RemoteRegionId remote_ = 0;
};

TEST_F(LoopbackTransportTest, ScatterGatherWriteLandsAndNotifies) {
  std::vector<TransferOp> ops = {{src_region_.id, 0, remote_, 1000, 100},
                                 {src_region_.id, 500, remote_, 0, 50}};
  auto id = a_->PostTransfer(peer_, Direction::kWrite, ops, "batch-1");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(a_->Wait(*id, absl::Seconds(1)).ok());
  EXPECT_TRUE(a_->ReleaseTransfer(*id).ok());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(dst_[1000 + i], src_[i]);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(dst_[i], src_[500 + i]);
  auto note = b_->WaitNotification(absl::Seconds(1));
  ASSERT_TRUE(note.ok());
  EXPECT_EQ(note->from, "a");
  EXPECT_EQ(note->payload, "batch-1");
}

TEST_F(LoopbackTransportTest, ReadsRemoteBytes) {
  dst_[7] = 99;
  std::vector<TransferOp> ops = {{src_region_.id, 0, remote_, 7, 1}};
  auto id = a_->PostTransfer(peer_, Direction::kRead, ops);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(src_[0], 99);
}

TEST_F(LoopbackTransportTest, RejectsOutOfRangeOps) {
  std::vector<TransferOp> bad = {{src_region_.id, 0, remote_, (1 << 16) - 10, 11}};
  auto id = a_->PostTransfer(peer_, Direction::kWrite, bad);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kOutOfRange);
  bad = {{src_region_.id, ~0ull, remote_, 0, 2}};
  EXPECT_EQ(a_->PostTransfer(peer_, Direction::kWrite, bad).status().code(),
            absl::StatusCode::kOutOfRange);
  bad = {{src_region_.id + 100, 0, remote_, 0, 2}};
  EXPECT_EQ(a_->PostTransfer(peer_, Direction::kWrite, bad).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(LoopbackTransportTest, DeviceRegionsGoThroughTheCopier) {
  std::vector<uint8_t> device(4096, 0);
  auto gpu = b_->RegisterRegion(device.data(), device.size(), MemoryKind::kCuda);
  ASSERT_TRUE(gpu.ok());
  auto remote = a_->ImportRegion(peer_, *b_->DescribeRegion(gpu->id));
  ASSERT_TRUE(remote.ok());
  std::vector<TransferOp> ops = {{src_region_.id, 10, *remote, 20, 30}};
  ASSERT_TRUE(a_->PostTransfer(peer_, Direction::kWrite, ops).ok());
  EXPECT_EQ(copier_->host_to_device_bytes(), 30u);
  EXPECT_EQ(device[20], src_[10]);
}

TEST_F(LoopbackTransportTest, GonePeerFailsTransfers) {
  b_.reset();
  std::vector<TransferOp> ops = {{src_region_.id, 0, remote_, 0, 1}};
  EXPECT_EQ(a_->PostTransfer(peer_, Direction::kWrite, ops).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(LoopbackTransportTest, RejectsForeignDescriptors) {
  EXPECT_FALSE(a_->ImportRegion(peer_, "not a descriptor").ok());
  EXPECT_FALSE(a_->Connect("junk").ok());
}

}  // namespace
}  // namespace kvserve::transport
