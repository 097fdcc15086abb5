// KV row codecs: round-trip error within each codec's stated bound, exact
// int4 packing, fp8 against known encodings, and attention over quantized KV
// within stated bounds of attention over f32 KV.
#include "kernels/cpu/kv_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/dispatch.h"

namespace kvserve::kernels {
namespace {

const KvDType kAllCodecs[] = {KvDType::kF32,  KvDType::kF16,     KvDType::kBF16,
                              KvDType::kFp8E4M3, KvDType::kFp8E5M2, KvDType::kInt8,
                              KvDType::kInt4, KvDType::kInt4G64, KvDType::kInt4Kivi,
                              KvDType::kInt4KiviG64};

std::vector<float> RoundTrip(KvDType t, const std::vector<float>& x) {
  const int32_t n = static_cast<int32_t>(x.size());
  std::vector<uint8_t> data(KvRowBytes(t, n)), meta(KvRowMetaBytes(t, n) + 1);
  QuantizeRow(t, x.data(), n, data.data(), meta.data());
  std::vector<float> y(n);
  DequantizeRow(t, data.data(), meta.data(), n, y.data());
  return y;
}

// Largest error each codec may make on element i of row x.
float Bound(KvDType t, const std::vector<float>& x, int32_t i) {
  const float amax = std::abs(*std::max_element(
      x.begin(), x.end(), [](float a, float b) { return std::abs(a) < std::abs(b); }));
  const float a = std::abs(x[i]);
  switch (t) {
    case KvDType::kF32:
      return 0.0f;
    case KvDType::kF16:
      return std::max(a * 0x1p-11f, 0x1p-25f);  // f16 subnormals: absolute steps
    case KvDType::kBF16:
      return a * 0x1p-8f;
    case KvDType::kFp8E4M3:  // half an ulp of 3 mantissa bits; subnormal step 2^-9
      return 1.0001f * std::max(a * 0x1p-4f, amax / kE4M3Max * 0x1p-10f);
    case KvDType::kFp8E5M2:  // 2 mantissa bits; subnormal step 2^-16
      return 1.0001f * std::max(a * 0x1p-3f, amax / kE5M2Max * 0x1p-17f);
    case KvDType::kInt8:  // half a step of amax / 127
      return 1.0001f * amax / 254.0f;
    case KvDType::kInt4:
    case KvDType::kInt4G64:
    case KvDType::kInt4Kivi:
    case KvDType::kInt4KiviG64: {  // (values) half a step of the group's range / 15, plus f16
                                // scale/min rounding
      const int32_t group = KvInt4GroupOf(t);
      const int32_t g0 = i / group * group;
      const int32_t g1 = std::min<int32_t>(g0 + group, static_cast<int32_t>(x.size()));
      const auto [lo, hi] = std::minmax_element(x.begin() + g0, x.begin() + g1);
      return (*hi - *lo) / 30.0f + (std::abs(*lo) + std::abs(*hi)) * 0x1p-9f;
    }
  }
  return 0.0f;
}

class KvCodecTest : public ::testing::TestWithParam<KvDType> {};

TEST_P(KvCodecTest, RoundTripWithinBound) {
  const KvDType t = GetParam();
  std::mt19937 rng(5);
  for (int32_t n : {1, 7, 8, 33, 64, 128}) {
    for (float sigma : {1e-3f, 1.0f, 30.0f}) {
      std::normal_distribution<float> dist(0.0f, sigma);
      std::vector<float> x(n);
      for (auto& v : x) v = dist(rng);
      if (n > 4) x[3] = 8.0f * sigma;  // an outlier channel, as real keys have
      const std::vector<float> y = RoundTrip(t, x);
      for (int32_t i = 0; i < n; ++i) {
        ASSERT_LE(std::abs(y[i] - x[i]), Bound(t, x, i))
            << KvDTypeName(t) << " n=" << n << " sigma=" << sigma << " i=" << i << " x=" << x[i];
      }
    }
  }
}

TEST_P(KvCodecTest, ZeroRowStaysZero) {
  const std::vector<float> y = RoundTrip(GetParam(), std::vector<float>(64, 0.0f));
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, KvCodecTest, ::testing::ValuesIn(kAllCodecs),
                         [](const ::testing::TestParamInfo<KvDType>& info) {
                           std::string name(KvDTypeName(info.param));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

TEST_P(KvCodecTest, Avx2DecoderEqualsPlainLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2";
  const KvDType t = GetParam();
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (int32_t n : {5, 32, 64, 77}) {
    std::vector<float> x(n), want(n), got(n);
    for (auto& v : x) v = dist(rng);
    std::vector<uint8_t> data(KvRowBytes(t, n)), meta(KvRowMetaBytes(t, n) + 1);
    QuantizeRow(t, x.data(), n, data.data(), meta.data());
    DequantizeRow(t, data.data(), meta.data(), n, want.data());
    internal::DequantizeRowAvx2(t, data.data(), meta.data(), n, got.data());
    // int4 decodes as code * scale + min, rounded twice as the plain loop
    // does (the AVX2 unit keeps the compiler from fusing it into an FMA).
    for (int32_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], want[i]) << KvDTypeName(t) << " n=" << n << " i=" << i;
    }
  }
}

// Values the SIMD-against-plain codec tests draw: zeros, ties (halves of a
// 1/16 grid), values tiny against the row's max, large outliers, and normal
// values times `spread`.
class CodecValueMix {
 public:
  explicit CodecValueMix(uint32_t seed) : rng_(seed) {}
  float operator()(float spread) {
    switch (pick_(rng_)) {
      case 0:
        return 0.0f;
      case 1:
        return std::ldexp(std::nearbyint(normal_(rng_) * 16) + 0.5f, -4);
      case 2:
        return normal_(rng_) * 1e-6f;
      case 3:
        return normal_(rng_) * 1e4f;
      default:
        return normal_(rng_) * spread;
    }
  }

 private:
  std::mt19937 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
  std::uniform_int_distribution<int> pick_{0, 9};
};

// The AVX2 row encoders write the plain loop's bytes (codes and scale) for
// f16, int8 and fp8: rows of every length around the vector width, with
// zeros, ties (halves of the grid), subnormals and values that saturate.
TEST(KvCodecTest, Avx2QuantizeRowEqualsPlainLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  CodecValueMix mix(11);
  for (KvDType t : {KvDType::kF16, KvDType::kInt8, KvDType::kFp8E4M3, KvDType::kFp8E5M2,
                    KvDType::kInt4, KvDType::kInt4G64, KvDType::kInt4Kivi, KvDType::kInt4KiviG64}) {
    for (int32_t n : {1, 7, 8, 9, 16, 32, 63, 64, 65, 128, 192}) {
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<float> x(n);
        for (float& v : x) v = mix(1.0f);
        const size_t bytes = KvRowBytes(t, n), meta_bytes = KvRowMetaBytes(t, n) + 1;
        std::vector<uint8_t> want(bytes), got(bytes), want_meta(meta_bytes), got_meta(meta_bytes);
        QuantizeRow(t, x.data(), n, want.data(), want_meta.data());
        internal::QuantizeRowAvx2(t, x.data(), n, got.data(), got_meta.data());
        ASSERT_EQ(got, want) << KvDTypeName(t) << " n=" << n << " rep=" << rep;
        ASSERT_EQ(got_meta, want_meta) << KvDTypeName(t) << " n=" << n << " rep=" << rep;
      }
    }
  }
}

// The SIMD int4-kivi key encoder of a fresh block against AppendKiviKeys,
// byte for byte, codes and per-channel meta, over rows of the same mix as
// above (zeros, ties, tiny values, outliers) and a strided source.
TEST(KvCodecTest, Avx2KiviKeysEqualPlainLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  CodecValueMix mix(12);
  for (int32_t head_dim : {8, 12, 64, 128}) {
    for (int32_t n : {1, 2, 5, 16}) {
      for (int rep = 0; rep < 100; ++rep) {
        const int64_t stride = head_dim + 8 * (rep % 2);
        std::vector<float> x(static_cast<size_t>(n * stride));
        const float spread = rep % 3 == 0 ? 1e-3f : (rep % 3 == 1 ? 1.0f : 300.0f);
        for (float& v : x) v = mix(spread);
        const size_t bytes = static_cast<size_t>(KvRowBytes(KvDType::kInt4Kivi, head_dim) * n);
        const size_t meta_bytes = static_cast<size_t>(kKiviKeyMetaBytes * head_dim);
        std::vector<uint8_t> want(bytes, 0xa5), got(bytes, 0x5a), want_meta(meta_bytes),
            got_meta(meta_bytes);
        AppendKiviKeys(x.data(), stride, n, 0, head_dim, want.data(), want_meta.data());
        internal::AppendKiviKeysAvx2(x.data(), stride, n, 0, head_dim, got.data(), got_meta.data());
        ASSERT_EQ(got, want) << "head_dim=" << head_dim << " n=" << n << " rep=" << rep;
        ASSERT_EQ(got_meta, want_meta) << "head_dim=" << head_dim << " n=" << n << " rep=" << rep;
      }
    }
  }
}

TEST(KvCodecTest, Int4PackUnpackIsExact) {
  for (int32_t n : {1, 2, 31, 32, 64}) {
    std::vector<uint8_t> codes(n), back(n), packed((n + 1) / 2);
    for (int32_t i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>((i * 7 + 3) % 16);
    PackInt4(codes.data(), n, packed.data());
    UnpackInt4(packed.data(), n, back.data());
    EXPECT_EQ(back, codes) << "n=" << n;
  }
  const uint8_t two[2] = {0x3, 0xa};
  uint8_t byte = 0;
  PackInt4(two, 2, &byte);
  EXPECT_EQ(byte, 0xa3);  // even index in the low nibble
}

TEST(KvCodecTest, Int4ValuesOnTheGridRoundTripExactly) {
  // 0..15 has min 0 and scale 1, both exact in f16: every code is hit exactly.
  std::vector<float> x(32);
  for (int32_t i = 0; i < 32; ++i) x[i] = static_cast<float>(i % 16);
  EXPECT_EQ(RoundTrip(KvDType::kInt4, x), x);
}

TEST(KvCodecTest, Fp8KnownEncodings) {
  EXPECT_EQ(Fp32ToE4M3(1.0f), 0x38);
  EXPECT_EQ(Fp32ToE4M3(-2.0f), 0xc0);
  EXPECT_EQ(Fp32ToE4M3(448.0f), 0x7e);
  EXPECT_EQ(Fp32ToE4M3(1e6f), 0x7e);  // saturates, never NaN
  EXPECT_EQ(E4M3ToFp32(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_TRUE(std::isnan(E4M3ToFp32(0x7f)));
  EXPECT_EQ(Fp32ToE5M2(1.0f), 0x3c);
  EXPECT_EQ(Fp32ToE5M2(57344.0f), 0x7b);
  EXPECT_EQ(Fp32ToE5M2(1e9f), 0x7b);
  EXPECT_EQ(E5M2ToFp32(0x01), 0x1p-16f);
  // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): ties to even.
  EXPECT_EQ(Fp32ToE4M3(1.0625f), 0x38);
  EXPECT_EQ(Fp32ToE4M3(1.1875f), 0x3a);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(Fp32ToE4M3(E4M3ToFp32(static_cast<uint8_t>(c))), c == 0x80 ? 0x80 : c) << c;
  }
}

// The arithmetic fp8 encoders equal the binary search over the sorted codes
// on every code's value, every midpoint between neighbouring codes (the
// ties) and the floats just either side of it, both signs, the specials,
// and random floats of every magnitude.
TEST(KvCodecTest, Fp8EncodersEqualTheSearchReference) {
  struct Format {
    const char* name;
    uint8_t (*fast)(float);
    uint8_t (*ref)(float);
    float (*decode)(uint8_t);
    int max_code;
  };
  const Format formats[] = {{"e4m3", Fp32ToE4M3, Fp32ToE4M3Reference, E4M3ToFp32, 0x7e},
                            {"e5m2", Fp32ToE5M2, Fp32ToE5M2Reference, E5M2ToFp32, 0x7b}};
  for (const Format& f : formats) {
    std::vector<float> probes = {0.0f,
                                 -0.0f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::denorm_min(),
                                 std::numeric_limits<float>::min(),
                                 std::numeric_limits<float>::max()};
    for (int c = 0; c <= f.max_code; ++c) {
      const float v = f.decode(static_cast<uint8_t>(c));
      const float next = c < f.max_code ? f.decode(static_cast<uint8_t>(c + 1)) : 2 * v;
      const float mid = v + (next - v) / 2;
      for (float x : {v, mid}) {
        probes.push_back(x);
        probes.push_back(std::nextafter(x, 0.0f));
        probes.push_back(std::nextafter(x, std::numeric_limits<float>::infinity()));
      }
    }
    std::mt19937 rng(7);
    std::uniform_int_distribution<uint32_t> bits;
    std::uniform_real_distribution<float> near(-2.5f * f.decode(static_cast<uint8_t>(f.max_code)),
                                               2.5f * f.decode(static_cast<uint8_t>(f.max_code)));
    for (int i = 0; i < 200000; ++i) {
      const uint32_t b = bits(rng);
      float x;
      std::memcpy(&x, &b, sizeof(x));
      probes.push_back(x);
      probes.push_back(near(rng));
      probes.push_back(near(rng) * 1e-4f);
    }
    const size_t n = probes.size();
    for (size_t i = 0; i < n; ++i) probes.push_back(-probes[i]);
    int mismatches = 0;
    for (float x : probes) {
      if (f.fast(x) != f.ref(x) && ++mismatches <= 5) {
        ADD_FAILURE() << f.name << " " << x << ": " << int{f.fast(x)} << " vs reference "
                      << int{f.ref(x)};
      }
    }
    EXPECT_EQ(mismatches, 0) << f.name << " of " << probes.size();
  }
}

TEST(KvCodecTest, ParseAcceptsEveryName) {
  for (KvDType t : kAllCodecs) {
    KvDType got;
    ASSERT_TRUE(ParseKvDType(KvDTypeName(t), &got));
    EXPECT_EQ(got, t);
  }
  KvDType got;
  EXPECT_FALSE(ParseKvDType("q4_0", &got));
}

TEST(KvCodecTest, ScalesLiveInTheBlock) {
  // SmolLM2's shape: 3 KV heads x 64 dims per token per layer per K or V.
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kF16), 16 * 3 * 128);
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kInt8), 16 * 3 * (64 + 4));
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kInt4), 16 * 3 * (32 + 8));
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kInt4G64), 16 * 3 * (32 + 4));
  // int4-kivi: keys' 2 bytes per channel per block equal the values' 8
  // bytes per row at block 16, head_dim 64; elsewhere the smaller half pads.
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kInt4Kivi), 16 * 3 * (32 + 8));
  EXPECT_EQ(PagedKvView::HalfLayerBytes(32, 3, 64, KvDType::kInt4Kivi), 3 * (32 * 32 + 32 * 8));
  EXPECT_EQ(PagedKvView::HalfLayerBytes(8, 3, 64, KvDType::kInt4Kivi), 3 * (8 * 32 + 2 * 64));
  // int4-kivi-g64: equal halves at block 32 (4.5 bits a value).
  EXPECT_EQ(PagedKvView::HalfLayerBytes(32, 3, 64, KvDType::kInt4KiviG64), 3 * 32 * (32 + 4));
  EXPECT_EQ(PagedKvView::HalfLayerBytes(16, 3, 64, KvDType::kInt4KiviG64), 3 * 16 * (32 + 8));
}

// int4-kivi keys of one (block, head): block_size rows appended in runs of
// `run` keys (1 = decode, block_size = a prefill chunk), decoded back.
struct KiviBlock {
  int32_t bs, hd;
  std::vector<uint8_t> codes, meta;
  KiviBlock(int32_t block_size, int32_t head_dim, uint8_t fill)
      : bs(block_size), hd(head_dim),
        codes(block_size * KvRowBytes(KvDType::kInt4Kivi, head_dim), fill),
        meta(kKiviKeyMetaBytes * head_dim, fill) {}
  void Append(const std::vector<float>& x, int32_t run) {
    for (int32_t s = 0; s < bs; s += run) {
      AppendKiviKeys(&x[int64_t{s} * hd], hd, std::min(run, bs - s), s, hd, codes.data(),
                     meta.data());
    }
  }
  std::vector<float> Decode() const {
    std::vector<float> scale(hd), offset(hd), y(int64_t{bs} * hd);
    KiviKeyChannelParams(meta.data(), hd, scale.data(), offset.data());
    const int64_t rb = KvRowBytes(KvDType::kInt4Kivi, hd);
    for (int32_t r = 0; r < bs; ++r) {
      DequantizeKiviKeyRow(&codes[r * rb], scale.data(), offset.data(), hd, &y[int64_t{r} * hd]);
    }
    return y;
  }
  float Step(int32_t c) const { return std::exp2((meta[2 * c] - 128) / 8.0f); }
};

// Keys like real ones: per-channel offsets and spreads that differ by
// orders of magnitude (outlier channels), some channels far from zero.
std::vector<float> KiviKeys(int32_t bs, int32_t hd, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> mean(hd), spread(hd), x(int64_t{bs} * hd);
  for (int32_t c = 0; c < hd; ++c) {
    mean[c] = c % 5 == 0 ? 20.0f * dist(rng) : 0.3f * dist(rng);
    spread[c] = c % 7 == 0 ? 8.0f : (c % 3 == 0 ? 0.01f : 0.5f);
  }
  for (int32_t r = 0; r < bs; ++r) {
    for (int32_t c = 0; c < hd; ++c) x[int64_t{r} * hd + c] = mean[c] + spread[c] * dist(rng);
  }
  return x;
}

TEST(KiviKeysTest, BlockAtOnceWithinHalfAStep) {
  std::mt19937 rng(21);
  for (int32_t hd : {8, 40, 64, 77}) {
    for (int32_t bs : {1, 4, 16}) {
      const std::vector<float> x = KiviKeys(bs, hd, rng);
      KiviBlock b(bs, hd, 0);
      b.Append(x, bs);
      const std::vector<float> y = b.Decode();
      for (int32_t c = 0; c < hd; ++c) {
        float lo = x[c], hi = x[c];
        for (int32_t r = 0; r < bs; ++r) {
          lo = std::min(lo, x[int64_t{r} * hd + c]);
          hi = std::max(hi, x[int64_t{r} * hd + c]);
        }
        // The chosen step is the first rung of the 1/8-octave ladder that
        // covers the range (14 steps: the integer zero point may waste one)
        // with the zero point inside int8.
        const float need = std::max({(hi - lo) / 14.0f, -lo / 128.0f, hi / 142.0f});
        ASSERT_LE(b.Step(c), std::max(1.0001f * std::exp2(1.0f / 8) * need, 0x1p-16f))
            << "hd=" << hd << " bs=" << bs << " c=" << c;
        for (int32_t r = 0; r < bs; ++r) {
          const int64_t i = int64_t{r} * hd + c;
          ASSERT_LE(std::abs(y[i] - x[i]), 0.5001f * b.Step(c))
              << "hd=" << hd << " bs=" << bs << " c=" << c << " r=" << r;
        }
      }
    }
  }
}

TEST(KiviKeysTest, OneByOneStaysCloseToBlockAtOnce) {
  // Decode appends one key at a time; a key that widens a channel's range
  // re-encodes that channel's earlier codes. Each re-encoding adds at most
  // half a step: the error stays within a few final steps, and the mean
  // square error within a small factor of writing the block at once.
  std::mt19937 rng(22);
  double sq_once = 0, sq_one = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t bs = 16, hd = 64;
    const std::vector<float> x = KiviKeys(bs, hd, rng);
    KiviBlock once(bs, hd, 0), one(bs, hd, 0);
    once.Append(x, bs);
    one.Append(x, 1);
    const std::vector<float> y_once = once.Decode(), y_one = one.Decode();
    for (int32_t r = 0; r < bs; ++r) {
      for (int32_t c = 0; c < hd; ++c) {
        const int64_t i = int64_t{r} * hd + c;
        ASSERT_LE(std::abs(y_one[i] - x[i]), 2.0f * one.Step(c)) << "r=" << r << " c=" << c;
        sq_once += (y_once[i] - x[i]) * (y_once[i] - x[i]);
        sq_one += (y_one[i] - x[i]) * (y_one[i] - x[i]);
      }
    }
  }
  EXPECT_LT(sq_one, 3.0 * sq_once);
  RecordProperty("mse_ratio", std::to_string(sq_one / sq_once));
}

TEST(KiviKeysTest, FreshBlockIgnoresWhatItHeld) {
  // A block from the free list holds a previous owner's bytes: writing slot
  // 0 must start afresh, whatever they were.
  std::mt19937 rng(23);
  const std::vector<float> x = KiviKeys(16, 40, rng);
  for (int32_t run : {1, 5, 16}) {
    KiviBlock clean(16, 40, 0), dirty(16, 40, 0xff);
    clean.Append(x, run);
    dirty.Append(x, run);
    EXPECT_EQ(clean.codes, dirty.codes) << "run=" << run;
    EXPECT_EQ(clean.meta, dirty.meta) << "run=" << run;
  }
}

TEST(KiviKeysTest, ConstantAndZeroChannels) {
  // A channel constant over the block decodes within its step (the zero
  // point carries its offset); an all-zero block decodes to exact zeros.
  for (float value : {0.0f, 1e-6f, -3.0f, 1234.5f}) {
    std::vector<float> x(16 * 8, value);
    KiviBlock b(16, 8, 0);
    b.Append(x, 1);
    for (float y : b.Decode()) {
      EXPECT_LE(std::abs(y - value), std::max(std::abs(value) / 256.0f * 1.1f, 0x1p-17f))
          << value;
    }
  }
}

TEST(KiviKeysTest, Avx2DecoderEqualsPlainLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(24);
  for (int32_t hd : {8, 40, 64, 77, 128}) {
    const std::vector<float> x = KiviKeys(4, hd, rng);
    KiviBlock b(4, hd, 0);
    b.Append(x, 4);
    std::vector<float> scale(hd), offset(hd), want(hd), got(hd);
    KiviKeyChannelParams(b.meta.data(), hd, scale.data(), offset.data());
    const int64_t rb = KvRowBytes(KvDType::kInt4Kivi, hd);
    for (int32_t r = 0; r < 4; ++r) {
      DequantizeKiviKeyRow(&b.codes[r * rb], scale.data(), offset.data(), hd, want.data());
      internal::DequantizeKiviKeyRowAvx2(&b.codes[r * rb], scale.data(), offset.data(), hd,
                                         got.data());
      for (int32_t i = 0; i < hd; ++i) {
        // code * scale + offset, rounded twice in both (no FMA).
        ASSERT_EQ(got[i], want[i]) << "hd=" << hd << " i=" << i;
      }
    }
  }
}

// Attention over a quantized cache against attention over the same K/V in
// f32: relative RMS error of the outputs within each codec's stated bound
// (random N(0,1) K/V and queries, 300 positions, GQA 3).
struct AttnCase {
  KvDType dtype;
  double max_rel_rms;
  int32_t run = 300;  // tokens per AppendKv call
};

class QuantizedAttentionTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(QuantizedAttentionTest, CloseToF32Attention) {
  const AttnCase c = GetParam();
  constexpr int32_t kBs = 16, kKvHeads = 2, kHd = 64, kGqa = 3, kLen = 300, kLayers = 1;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t row = int64_t{kKvHeads} * kHd;
  std::vector<float> k(kLen * row), v(kLen * row), q(int64_t{kKvHeads} * kGqa * kHd);
  for (auto* vec : {&k, &v, &q}) {
    for (auto& x : *vec) x = dist(rng);
  }
  const int32_t n_blocks = (kLen + kBs - 1) / kBs;
  std::vector<int32_t> ids(n_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  const int32_t offsets[2] = {0, n_blocks};
  std::vector<int32_t> seq(kLen, 0), pos(kLen);
  std::iota(pos.begin(), pos.end(), 0);
  auto attend = [&](KvDType t, int32_t run) {
    PagedKvView view;
    view.block_size = kBs;
    view.n_kv_heads = kKvHeads;
    view.head_dim = kHd;
    view.dtype = t;
    view.layer_bytes = 2 * PagedKvView::HalfLayerBytes(kBs, kKvHeads, kHd, t);
    view.block_bytes = kLayers * view.layer_bytes;
    std::vector<uint8_t> storage(view.block_bytes * n_blocks);
    view.pool = storage.data();
    view.block_ids = ids.data();
    view.seq_block_offsets = offsets;
    view.n_seqs = 1;
    // run = 1 appends token by token as decode does; kLen as one prefill.
    for (int32_t p = 0; p < kLen; p += run) {
      AppendKv(view, 0, std::min(run, kLen - p), seq.data(), pos.data() + p, &k[p * row], row,
               &v[p * row], row);
    }
    const int32_t tseq = 0, tpos = kLen - 1;
    AttentionBatch batch{1, &tseq, &tpos, kKvHeads * kGqa, 1.0f / 8.0f};
    std::vector<float> out(q.size());
    PagedAttention(view, 0, batch, q.data(), 0, out.data(), 0, nullptr);
    return out;
  };
  const std::vector<float> want = attend(KvDType::kF32, kLen);
  const std::vector<float> got = attend(c.dtype, c.run);
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  const double rel = std::sqrt(err / norm);
  EXPECT_LT(rel, c.max_rel_rms) << KvDTypeName(c.dtype);
  RecordProperty("rel_rms", std::to_string(rel));
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, QuantizedAttentionTest,
    ::testing::Values(AttnCase{KvDType::kF16, 2e-3}, AttnCase{KvDType::kBF16, 1e-2},
                      AttnCase{KvDType::kInt8, 2e-2}, AttnCase{KvDType::kFp8E4M3, 6e-2},
                      AttnCase{KvDType::kFp8E5M2, 1.2e-1}, AttnCase{KvDType::kInt4, 2e-1},
                      AttnCase{KvDType::kInt4G64, 2.5e-1}, AttnCase{KvDType::kInt4Kivi, 2e-1},
                      AttnCase{KvDType::kInt4Kivi, 2.5e-1, 1},
                      AttnCase{KvDType::kInt4KiviG64, 2.5e-1}),
    [](const ::testing::TestParamInfo<AttnCase>& info) {
      std::string name(KvDTypeName(info.param.dtype));
      if (info.param.run == 1) name += "_one_by_one";
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

}  // namespace
}  // namespace kvserve::kernels
