// KV block transcoding (--kv-host-dtype): the block kernel equals its
// row-at-a-time reference byte for byte, the host codec's error stays within
// its bound of the primary block's values, decoding back into the primary
// codec adds only that codec's own rounding, and pages shrink as stated.
#include "kernels/cpu/kv_transcode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/kv_codec.h"

namespace kvserve::kernels {
namespace {

constexpr KvBlockShape kShape{/*n_layers=*/3, /*n_kv_heads=*/2, /*head_dim=*/64, /*block_size=*/16};

// A full block in codec t from random rows (keys with an outlier channel,
// as real keys have).
std::vector<uint8_t> RandomBlock(KvDType t, uint32_t seed) {
  std::vector<uint8_t> block(static_cast<size_t>(KvBlockBytes(t, kShape)));
  const PagedKvView v = OneBlockView(t, kShape, block.data());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t hd = kShape.head_dim, bs = kShape.block_size;
  std::vector<float> keys(static_cast<size_t>(bs) * hd), row(hd);
  for (int32_t l = 0; l < kShape.n_layers; ++l) {
    for (int32_t h = 0; h < kShape.n_kv_heads; ++h) {
      for (int32_t j = 0; j < bs; ++j) {
        for (int32_t c = 0; c < hd; ++c) keys[j * hd + c] = normal(rng) * (c == 5 ? 8.0f : 1.0f);
        if (!KvIsKivi(t)) {
          QuantizeRow(t, keys.data() + j * hd, hd, v.KeyAt(l, 0, j, h),
                      v.RowMetaBytes() > 0 ? v.KeyMetaAt(l, 0, j, h) : nullptr);
        }
        for (int32_t c = 0; c < hd; ++c) row[c] = normal(rng) * 0.5f;
        QuantizeRow(t, row.data(), hd, v.ValueAt(l, 0, j, h),
                    v.RowMetaBytes() > 0 ? v.ValueMetaAt(l, 0, j, h) : nullptr);
      }
      if (KvIsKivi(t)) {
        AppendKiviKeys(keys.data(), hd, bs, 0, hd, v.BlockHead(l, 0, h), v.BlockHeadMeta(l, 0, h));
      }
    }
  }
  return block;
}

// Every decoded row of a block: [layer][head][K/V][slot][channel].
std::vector<float> Decode(KvDType t, const std::vector<uint8_t>& block) {
  const PagedKvView v = OneBlockView(t, kShape, const_cast<uint8_t*>(block.data()));
  std::vector<float> out;
  std::vector<float> row(kShape.head_dim);
  for (int32_t l = 0; l < kShape.n_layers; ++l) {
    for (int32_t h = 0; h < kShape.n_kv_heads; ++h) {
      for (int half = 0; half < 2; ++half) {
        for (int32_t j = 0; j < kShape.block_size; ++j) {
          ReadKvRow(v, l, 0, j, h, half == 1, row.data());
          out.insert(out.end(), row.begin(), row.end());
        }
      }
    }
  }
  return out;
}

// The largest error host codec `t` may add to the rows of one (layer,
// head, half) group x (block_size rows of head_dim), at element (j, c).
float HostBound(KvDType t, bool value, const float* x, int32_t j, int32_t c) {
  const int32_t hd = kShape.head_dim, bs = kShape.block_size;
  const float* r = x + j * hd;
  float amax = 0;
  for (int32_t i = 0; i < hd; ++i) amax = std::max(amax, std::abs(r[i]));
  const float a = std::abs(r[c]);
  switch (t) {
    case KvDType::kInt8:
      return 1.0001f * amax / 254.0f;
    case KvDType::kFp8E4M3:
      return 1.0001f * std::max(a * 0x1p-4f, amax / kE4M3Max * 0x1p-10f);
    case KvDType::kInt4Kivi: {
      if (!value) {
        // Keys per channel over the block: half a step. The integer zero
        // point floors the range's start, so 14 steps must cover it, and
        // the ladder's steps are up to 9% coarser than needed.
        float lo = x[c], hi = x[c];
        for (int32_t k = 1; k < bs; ++k) {
          lo = std::min(lo, x[k * hd + c]);
          hi = std::max(hi, x[k * hd + c]);
        }
        const float range = std::max({hi - lo, -lo / 128.0f * 15.0f, hi / 142.0f * 15.0f});
        return range / 14.0f * 1.1f * 0.5f + 1e-6f;
      }
      const int32_t g0 = c / kInt4Group * kInt4Group;
      float lo = r[g0], hi = r[g0];
      for (int32_t i = g0; i < g0 + kInt4Group; ++i) {
        lo = std::min(lo, r[i]);
        hi = std::max(hi, r[i]);
      }
      // Half a step plus the f16 scale and minimum's rounding.
      return (hi - lo) / 30.0f * 1.01f + (std::abs(lo) + hi - lo) * 0x1p-10f + 1e-6f;
    }
    default:
      return 0;
  }
}

// The primary codec's own rounding of a value a.
float PrimaryRounding(KvDType t, float a, float amax) {
  a = std::abs(a);
  switch (t) {
    case KvDType::kF32:
      return 0;
    case KvDType::kF16:
      return std::max(a * 0x1p-11f, 0x1p-25f);
    case KvDType::kBF16:
      return a * 0x1p-8f;
    default:  // int8
      return 1.0001f * amax / 254.0f;
  }
}

using Combo = std::tuple<KvDType, KvDType>;  // primary, host

class KvTranscodeTest : public ::testing::TestWithParam<Combo> {};

TEST_P(KvTranscodeTest, BlockKernelEqualsReference) {
  const auto [primary, host] = GetParam();
  const std::vector<uint8_t> src = RandomBlock(primary, 1);
  std::vector<uint8_t> a(KvBlockBytes(host, kShape), 0xAA), b(a.size(), 0x55);
  TranscodeKvBlock(kShape, primary, src.data(), host, a.data());
  TranscodeKvBlockReference(kShape, primary, src.data(), host, b.data());
  EXPECT_EQ(a, b) << "host encode";
  std::vector<uint8_t> c(src.size(), 0xAA), d(src.size(), 0x55);
  TranscodeKvBlock(kShape, host, a.data(), primary, c.data());
  TranscodeKvBlockReference(kShape, host, a.data(), primary, d.data());
  EXPECT_EQ(c, d) << "decode back";
}

TEST_P(KvTranscodeTest, RoundTripWithinTheHostCodecsBound) {
  const auto [primary, host] = GetParam();
  const std::vector<uint8_t> src = RandomBlock(primary, 2);
  std::vector<uint8_t> page(KvBlockBytes(host, kShape));
  TranscodeKvBlock(kShape, primary, src.data(), host, page.data());
  std::vector<uint8_t> back(src.size());
  TranscodeKvBlock(kShape, host, page.data(), primary, back.data());
  const std::vector<float> x = Decode(primary, src);  // what the pool held
  const std::vector<float> y = Decode(host, page);    // what the host tier holds
  const std::vector<float> z = Decode(primary, back); // what a promotion gives back
  ASSERT_EQ(x.size(), y.size());
  ASSERT_EQ(x.size(), z.size());
  const int32_t hd = kShape.head_dim, bs = kShape.block_size;
  const size_t group = static_cast<size_t>(bs) * hd;
  double worst = 0;
  for (size_t g0 = 0; g0 < x.size(); g0 += group) {
    const bool value = (g0 / group) % 2 == 1;
    for (int32_t j = 0; j < bs; ++j) {
      float zmax = 0;
      for (int32_t c = 0; c < hd; ++c) zmax = std::max(zmax, std::abs(y[g0 + j * hd + c]));
      for (int32_t c = 0; c < hd; ++c) {
        const size_t i = g0 + static_cast<size_t>(j) * hd + c;
        const float bound = HostBound(host, value, x.data() + g0, j, c);
        ASSERT_LE(std::abs(y[i] - x[i]), bound)
            << KvDTypeName(host) << (value ? " value" : " key") << " at " << i;
        ASSERT_LE(std::abs(z[i] - y[i]), PrimaryRounding(primary, y[i], zmax) + 1e-7f)
            << "decoding back into " << KvDTypeName(primary) << " at " << i;
        worst = std::max(worst, static_cast<double>(std::abs(z[i] - x[i])));
      }
    }
  }
  EXPECT_GT(worst, 0.0) << "a lossy host codec changed nothing: not re-encoded?";
}

// Every primary codec the tier re-encodes from, to every host codec other
// than itself (equal codecs copy the bytes: SameCodecCopiesTheBytes).
std::vector<Combo> Combos() {
  std::vector<Combo> out;
  for (KvDType p : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kInt8}) {
    for (KvDType h : {KvDType::kInt8, KvDType::kFp8E4M3, KvDType::kInt4Kivi}) {
      if (p != h) out.emplace_back(p, h);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    PrimaryToHost, KvTranscodeTest, ::testing::ValuesIn(Combos()),
    [](const ::testing::TestParamInfo<Combo>& info) {
      std::string name = std::string(KvDTypeName(std::get<0>(info.param))) + "_to_" +
                         std::string(KvDTypeName(std::get<1>(info.param)));
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

TEST(KvTranscodeTest, SameCodecCopiesTheBytes) {
  const std::vector<uint8_t> src = RandomBlock(KvDType::kF16, 3);
  std::vector<uint8_t> dst(src.size(), 0xAA);
  TranscodeKvBlock(kShape, KvDType::kF16, src.data(), KvDType::kF16, dst.data());
  EXPECT_EQ(src, dst);
}

TEST(KvTranscodeTest, PagesShrinkAsStated) {
  // SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64, blocks of 16.
  const KvBlockShape smol{30, 3, 64, 16};
  EXPECT_EQ(KvBlockBytes(KvDType::kF16, smol), 368640);     // 360 KiB
  EXPECT_EQ(KvBlockBytes(KvDType::kInt8, smol), 195840);    // 0.53x
  EXPECT_EQ(KvBlockBytes(KvDType::kFp8E4M3, smol), 195840);
  EXPECT_EQ(KvBlockBytes(KvDType::kInt4Kivi, smol), 115200);  // 0.31x
}

}  // namespace
}  // namespace kvserve::kernels
