#include "common/half.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvserve {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

bool IsFp16Nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool IsBf16Nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

// Decodes fp16 from the IEEE definition, independent of the bit tricks in
// half.h.
double Fp16Reference(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0x1f) return mant ? std::nan("") : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}

// Round-to-nearest-even by search: `values` holds every non-negative finite
// value of the format in encoding order (which is value order), and
// `next_power` the value one ulp above the largest (where inf would round
// from). Returns the encoding of the nearest value, or `values.size()` for
// overflow to infinity.
uint32_t RoundReference(const std::vector<double>& values, double next_power, double x) {
  const auto it = std::upper_bound(values.begin(), values.end(), x);
  if (it == values.begin()) return 0;
  const uint32_t lo = static_cast<uint32_t>(it - values.begin() - 1);
  const double lo_value = values[lo];
  const double hi_value = lo + 1 < values.size() ? values[lo + 1] : next_power;
  const double d_lo = x - lo_value;
  const double d_hi = hi_value - x;
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return lo + 1;
  return (lo & 1) ? lo + 1 : lo;  // tie: even encoding
}

std::vector<double> Fp16PositiveFinite() {
  std::vector<double> v;
  for (uint32_t h = 0; h < 0x7c00; ++h) v.push_back(Fp16Reference(static_cast<uint16_t>(h)));
  return v;
}

std::vector<double> Bf16PositiveFinite() {
  std::vector<double> v;
  for (uint32_t b = 0; b < 0x7f80; ++b) v.push_back(Bf16ToFp32(static_cast<uint16_t>(b)));
  return v;
}

// Floats spread over the exponents where the format's rounding cases live,
// plus fully random bit patterns.
std::vector<float> InterestingFloats(int min_exp, int max_exp, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> exp_dist(min_exp, max_exp);
  std::uniform_int_distribution<uint32_t> mant_dist(0, 0x7fffff);
  std::vector<float> out;
  for (int i = 0; i < count; ++i) {
    uint32_t mant = mant_dist(rng);
    // Exact ties are rare in random mantissas; force some.
    if (i % 4 == 0) mant = (mant & ~0x1fffu) | 0x1000u;  // fp16 tie
    if (i % 4 == 1) mant = (mant & ~0xffffu) | 0x8000u;  // bf16 tie
    const uint32_t sign = (i & 8) ? 0x80000000u : 0;
    out.push_back(FromBits(sign | (exp_dist(rng) << 23) | mant));
  }
  return out;
}

// --- fp16 --------------------------------------------------------------------

TEST(HalfTest, Fp16DecodesEveryPatternPerIeee) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    const double ref = Fp16Reference(static_cast<uint16_t>(h));
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(f, ref) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(HalfTest, Fp16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t back = Fp32ToFp16(Fp16ToFp32(static_cast<uint16_t>(h)));
    if (IsFp16Nan(static_cast<uint16_t>(h))) {
      ASSERT_TRUE(IsFp16Nan(back)) << std::hex << h << " -> " << back;
      ASSERT_EQ(back & 0x8000, h & 0x8000);
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(HalfTest, Fp16RoundsToNearestEven) {
  const float one_ulp = std::ldexp(1.0f, -10);  // ulp of 1.0 in fp16
  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3c00);
  EXPECT_EQ(Fp32ToFp16(1.0f + one_ulp / 2), 0x3c00);      // tie, down to even
  EXPECT_EQ(Fp32ToFp16(1.0f + 3 * one_ulp / 2), 0x3c02);  // tie, up to even
  EXPECT_EQ(Fp32ToFp16(std::nextafter(1.0f + one_ulp / 2, 2.0f)), 0x3c01);
  EXPECT_EQ(Fp32ToFp16(std::nextafter(1.0f + one_ulp / 2, 0.0f)), 0x3c00);
  EXPECT_EQ(Fp32ToFp16(-1.0f - one_ulp / 2), 0xbc00);
  EXPECT_EQ(Fp32ToFp16(0.1f), 0x2e66);
  EXPECT_EQ(Fp32ToFp16(3.14159265f), 0x4248);
  // Carry out of the mantissa bumps the exponent: 2 - 2^-12 rounds to 2.0.
  EXPECT_EQ(Fp32ToFp16(2.0f - std::ldexp(1.0f, -12)), 0x4000);
  EXPECT_EQ(Fp32ToFp16(0.0f), 0x0000);
  EXPECT_EQ(Fp32ToFp16(-0.0f), 0x8000);
}

TEST(HalfTest, Fp16Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);  // smallest fp16 subnormal
  EXPECT_EQ(Fp32ToFp16(tiny), 0x0001);
  EXPECT_EQ(Fp32ToFp16(tiny / 2), 0x0000);  // tie, down to even (zero)
  EXPECT_EQ(Fp32ToFp16(std::nextafter(tiny / 2, 1.0f)), 0x0001);
  EXPECT_EQ(Fp32ToFp16(3 * tiny / 2), 0x0002);  // tie, up to even
  EXPECT_EQ(Fp32ToFp16(5 * tiny / 2), 0x0002);  // tie, down to even
  EXPECT_EQ(Fp32ToFp16(1023 * tiny), 0x03ff);   // largest subnormal
  // Halfway between the largest subnormal and the smallest normal.
  EXPECT_EQ(Fp32ToFp16(1023.5f * tiny), 0x0400);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(Fp32ToFp16(-tiny), 0x8001);
  EXPECT_EQ(Fp32ToFp16(1e-10f), 0x0000);
  EXPECT_EQ(Fp32ToFp16(-1e-10f), 0x8000);
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(HalfTest, Fp16OverflowsToInfinity) {
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7bff);                              // max finite
  EXPECT_EQ(Fp32ToFp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);        // below the tie
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7c00);                              // tie, up to inf
  EXPECT_EQ(Fp32ToFp16(1e6f), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(-1e6f), 0xfc00);
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(INFINITY), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(-INFINITY), 0xfc00);
}

TEST(HalfTest, Fp16NanStaysNan) {
  EXPECT_TRUE(IsFp16Nan(Fp32ToFp16(NAN)));
  // A NaN whose payload lives only in low bits must not truncate to inf.
  EXPECT_TRUE(IsFp16Nan(Fp32ToFp16(FromBits(0x7f800001u))));
  EXPECT_TRUE(IsFp16Nan(Fp32ToFp16(FromBits(0xff800001u))));
}

TEST(HalfTest, Fp16MatchesReferenceRounding) {
  const std::vector<double> values = Fp16PositiveFinite();
  // fp32 exponents 100..145 span below the fp16 subnormals to above overflow.
  for (float f : InterestingFloats(100, 145, 400000, 1)) {
    const uint32_t mag = RoundReference(values, 65536.0, std::fabs(f));
    const uint16_t expected = static_cast<uint16_t>((std::signbit(f) ? 0x8000 : 0) | mag);
    ASSERT_EQ(Fp32ToFp16(f), expected) << f << " bits " << std::hex << std::bit_cast<uint32_t>(f);
  }
}

// --- bf16 --------------------------------------------------------------------

TEST(HalfTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = Bf16ToFp32(static_cast<uint16_t>(b));
    const uint16_t back = Fp32ToBf16(f);
    if (IsBf16Nan(static_cast<uint16_t>(b))) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
      ASSERT_TRUE(IsBf16Nan(back)) << std::hex << b << " -> " << back;
      ASSERT_EQ(back & 0x8000, b & 0x8000);
    } else {
      ASSERT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(HalfTest, Bf16RoundsToNearestEven) {
  const float one_ulp = std::ldexp(1.0f, -7);  // ulp of 1.0 in bf16
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Fp32ToBf16(1.0f + one_ulp / 2), 0x3f80);      // tie, down to even
  EXPECT_EQ(Fp32ToBf16(1.0f + 3 * one_ulp / 2), 0x3f82);  // tie, up to even
  EXPECT_EQ(Fp32ToBf16(std::nextafter(1.0f + one_ulp / 2, 2.0f)), 0x3f81);
  EXPECT_EQ(Fp32ToBf16(-1.0f - 3 * one_ulp / 2), 0xbf82);
  EXPECT_EQ(Fp32ToBf16(3.14159265f), 0x4049);
  EXPECT_EQ(Fp32ToBf16(-0.0f), 0x8000);
}

TEST(HalfTest, Bf16SubnormalsOverflowAndNan) {
  // fp32 subnormals keep their top mantissa bits.
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00010000u)), 0x0001);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00008000u)), 0x0000);  // tie, down to even
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00018000u)), 0x0002);  // tie, up to even
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00000001u)), 0x0000);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x007fffffu)), 0x0080);  // rounds up to the smallest normal
  // Largest bf16 is 0x7f7f; FLT_MAX lies past the tie and rounds to inf.
  EXPECT_EQ(Fp32ToBf16(FromBits(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x7f7f8000u)), 0x7f80);
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(Fp32ToBf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(Fp32ToBf16(INFINITY), 0x7f80);
  EXPECT_EQ(Fp32ToBf16(-INFINITY), 0xff80);
  EXPECT_TRUE(IsBf16Nan(Fp32ToBf16(NAN)));
  // Truncating this NaN would give 0x7f80 (inf); the conversion must not.
  EXPECT_TRUE(IsBf16Nan(Fp32ToBf16(FromBits(0x7f800001u))));
  EXPECT_TRUE(IsBf16Nan(Fp32ToBf16(FromBits(0xffffffffu))));
}

TEST(HalfTest, Bf16MatchesReferenceRounding) {
  const std::vector<double> values = Bf16PositiveFinite();
  const double next_power = std::ldexp(1.0, 128);
  for (float f : InterestingFloats(0, 254, 400000, 2)) {
    const uint32_t mag = RoundReference(values, next_power, std::fabs(f));
    const uint16_t expected = static_cast<uint16_t>((std::signbit(f) ? 0x8000 : 0) | mag);
    ASSERT_EQ(Fp32ToBf16(f), expected) << f << " bits " << std::hex << std::bit_cast<uint32_t>(f);
  }
}

}  // namespace
}  // namespace kvserve
