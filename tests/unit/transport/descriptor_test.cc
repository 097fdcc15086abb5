#include "transport/descriptor.h"

#include "gtest/gtest.h"
#include "transport/cost_model.h"

namespace kvserve::transport {
namespace {

RegionDescriptor Sample() {
  RegionDescriptor d;
  d.backend = "ucx";
  d.agent_id = 42;
  d.region = 7;
  d.kind = MemoryKind::kCuda;
  d.staged = true;
  d.remote_address = 0x7f0000001000;
  d.length = 1 << 20;
  d.rkey = std::string("\x01\x02\x00\x03rkey", 8);
  return d;
}

TEST(DescriptorTest, RoundTrips) {
  auto d = UnpackRegionDescriptor(PackRegionDescriptor(Sample()));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->backend, "ucx");
  EXPECT_EQ(d->agent_id, 42u);
  EXPECT_EQ(d->region, 7u);
  EXPECT_EQ(d->kind, MemoryKind::kCuda);
  EXPECT_TRUE(d->staged);
  EXPECT_EQ(d->remote_address, 0x7f0000001000u);
  EXPECT_EQ(d->length, 1u << 20);
  EXPECT_EQ(d->rkey, Sample().rkey);
}

TEST(DescriptorTest, EveryTruncationIsRejected) {
  std::string blob = PackRegionDescriptor(Sample());
  for (size_t n = 0; n < blob.size(); ++n) {
    EXPECT_FALSE(UnpackRegionDescriptor(blob.substr(0, n)).ok()) << n;
  }
}

TEST(DescriptorTest, EveryBitFlipIsRejected) {
  std::string blob = PackRegionDescriptor(Sample());
  for (size_t i = 0; i < blob.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = blob;
      bad[i] ^= static_cast<char>(1 << bit);
      auto d = UnpackRegionDescriptor(bad);
      ASSERT_FALSE(d.ok()) << "byte " << i << " bit " << bit;
      EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(DescriptorTest, ErrorsSayWhatIsWrong) {
  EXPECT_NE(UnpackRegionDescriptor("garbage").status().message().find("too short"),
            std::string::npos);
  std::string blob = PackRegionDescriptor(Sample());
  blob[blob.size() - 1] ^= 1;
  EXPECT_NE(UnpackRegionDescriptor(blob).status().message().find("checksum"),
            std::string::npos);
  // A peer address is not a region descriptor even with a valid checksum.
  PeerAddress a{"ucx", 1, "n", "addr", "", 0, 0};
  EXPECT_NE(UnpackRegionDescriptor(PackPeerAddress(a)).status().message().find(
                "magic"),
            std::string::npos);
}

TEST(DescriptorTest, RejectsZeroLengthAndWrappingRegions) {
  RegionDescriptor d = Sample();
  d.length = 0;
  EXPECT_FALSE(UnpackRegionDescriptor(PackRegionDescriptor(d)).ok());
  d = Sample();
  d.remote_address = ~0ull - 10;
  EXPECT_FALSE(UnpackRegionDescriptor(PackRegionDescriptor(d)).ok());
}

TEST(DescriptorTest, PeerAddressRoundTrips) {
  PeerAddress a{"ucx", 9, "prefill-0", std::string("\0\1\2", 3), "host", 5, 6};
  auto b = UnpackPeerAddress(PackPeerAddress(a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->name, "prefill-0");
  EXPECT_EQ(b->address, a.address);
  EXPECT_FALSE(UnpackPeerAddress(PackRegionDescriptor(Sample())).ok());
}

TEST(CostModelTest, AddsLatencyMessagesAndBytes) {
  LinkModel link{"test", 1e-6, 2e-6, 1e9};
  EXPECT_DOUBLE_EQ(EstimateTransferSeconds(link, 1000000000, 10), 1e-6 + 2e-5 + 1.0);
}

TEST(CostModelTest, PresetsAreOrderedByBandwidth) {
  EXPECT_GT(NvLink4().bandwidth_bytes_per_s, PcieGen5x16().bandwidth_bytes_per_s);
  EXPECT_GT(PcieGen5x16().bandwidth_bytes_per_s,
            Infiniband400G().bandwidth_bytes_per_s * 0.9);
  // Many small pieces cost more than one large message of the same bytes.
  LinkModel ib = Infiniband400G();
  EXPECT_GT(EstimateTransferSeconds(ib, 64 << 20, 1024),
            EstimateTransferSeconds(ib, 64 << 20, 1));
}

TEST(CostModelTest, FitRecoversCoefficients) {
  LinkModel truth{"truth", 5e-6, 1.5e-6, 4e9};
  std::vector<LinkSample> samples;
  for (uint64_t bytes : {4096ull, 65536ull, 1ull << 20, 16ull << 20, 64ull << 20}) {
    for (uint64_t messages : {1ull, 16ull, 1024ull}) {
      samples.push_back({bytes, messages, EstimateTransferSeconds(truth, bytes, messages)});
    }
  }
  auto fit = FitLinkModel("measured", samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->latency_s, truth.latency_s, 1e-7);
  EXPECT_NEAR(fit->per_message_s, truth.per_message_s, 1e-8);
  EXPECT_NEAR(fit->bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s, 1.0, 1e-6);
}

TEST(CostModelTest, FitNeedsIndependentSamples) {
  std::vector<LinkSample> samples = {{100, 1, 1e-6}, {200, 2, 2e-6}, {300, 3, 3e-6}};
  EXPECT_FALSE(FitLinkModel("bad", samples).ok());
  EXPECT_FALSE(FitLinkModel("few", {{1, 1, 1.0}}).ok());
}

TEST(CostModelTest, ChoosesRecomputeForShortPromptsOnSlowLinks) {
  // 1 token of a 30-layer model at 2 KiB/token/layer is tiny: transfer wins.
  LinkModel slow{"slow", 1e-3, 1e-4, 1e8};
  auto short_prompt = ChooseTransferOrRecompute(slow, 60 << 10, 30, 16, 1e5);
  EXPECT_FALSE(short_prompt.transfer);  // 16 tokens recompute in 160 us
  auto long_prompt = ChooseTransferOrRecompute(NvLink4(), 1ull << 30, 4096, 8192, 1e4);
  EXPECT_TRUE(long_prompt.transfer);
  EXPECT_LT(long_prompt.transfer_s, long_prompt.recompute_s);
}

}  // namespace
}  // namespace kvserve::transport
