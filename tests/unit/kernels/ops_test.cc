#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/dispatch.h"

namespace kvserve::kernels {
namespace {

std::vector<float> RandomFloats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, float rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * (1.0f + std::fabs(want[i]))) << "at " << i;
  }
}

// Vector length x simd. Lengths straddle the 8- and 16-wide loops' tails.
using OpsParam = std::tuple<int, bool>;

class OpsTest : public ::testing::TestWithParam<OpsParam> {
 protected:
  void SetUp() override {
    if (!std::get<1>(GetParam())) no_simd_.emplace();
  }
  int64_t n() const { return std::get<0>(GetParam()); }

 private:
  std::optional<ScopedDisableSimdForTesting> no_simd_;
};

TEST_P(OpsTest, RmsNormMatchesReference) {
  const int64_t rows = 3;
  const auto x = RandomFloats(rows * n(), 1, 3.0f);
  const auto w = RandomFloats(n(), 2);
  std::vector<float> want(x.size()), got(x.size());
  RmsNormReference(x.data(), w.data(), rows, n(), 1e-5f, want.data());
  RmsNorm(x.data(), w.data(), rows, n(), 1e-5f, got.data());
  ExpectNear(got, want, 1e-5f);
  // In place (out aliases x) gives the same answer.
  std::vector<float> inplace = x;
  RmsNorm(inplace.data(), w.data(), rows, n(), 1e-5f, inplace.data());
  ExpectNear(inplace, want, 1e-5f);
}

TEST_P(OpsTest, SiluMulMatchesReference) {
  auto gate = RandomFloats(n(), 3, 4.0f);
  if (n() > 2) {
    gate[0] = -100.0f;  // exp overflow side
    gate[1] = 100.0f;
  }
  const auto up = RandomFloats(n(), 4);
  std::vector<float> want(n()), got(n());
  SiluMulReference(gate.data(), up.data(), n(), want.data());
  SiluMul(gate.data(), up.data(), n(), got.data());
  ExpectNear(got, want, 1e-6f);
  std::vector<float> inplace = gate;
  SiluMul(inplace.data(), up.data(), n(), inplace.data());
  ExpectNear(inplace, want, 1e-6f);
}

// Gemma's GEGLU: the table kernel equals the per-element reference bit for
// bit (both ggml's f16-rounded GELU), which is within f16 rounding of the
// exact tanh-GELU formula; the +-10 cut-offs pass through / give 0.
TEST_P(OpsTest, GeluTanhMulMatchesReference) {
  auto gate = RandomFloats(n(), 31, 6.0f);
  if (n() > 3) {
    gate[0] = -12.0f;
    gate[1] = 11.5f;
    gate[2] = 0.0f;
  }
  const auto up = RandomFloats(n(), 32);
  std::vector<float> want(n()), got(n());
  GeluTanhMulReference(gate.data(), up.data(), n(), want.data());
  GeluTanhMul(gate.data(), up.data(), n(), got.data());
  EXPECT_EQ(got, want);
  for (int64_t i = 0; i < n(); ++i) {
    const double g = gate[i];
    const double exact = 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
    EXPECT_NEAR(want[i], exact * up[i], 2e-3 * std::fabs(exact * up[i]) + 1e-4) << gate[i];
  }
  if (n() > 3) {
    EXPECT_EQ(want[0], 0.0f);
    EXPECT_EQ(want[1], 11.5f * up[1]);
  }
  std::vector<float> inplace = gate;
  GeluTanhMul(inplace.data(), up.data(), n(), inplace.data());
  EXPECT_EQ(inplace, want);
}

// The AVX2 GEGLU rounds the gate to f16 with F16C and gathers from the
// table: equal to the plain loop on every f16 value and on the midpoints
// between neighbours (where round-to-nearest-even decides), with and
// without SIMD.
TEST(GeluTanhMulTest, EveryHalfValueAndMidpointMatchesTheReference) {
  std::vector<float> gate;
  for (uint32_t h = 0; h < (1u << 16); ++h) {
    const float v = Fp16ToFp32(static_cast<uint16_t>(h));
    if (!std::isfinite(v)) continue;
    gate.push_back(v);
    const float next = Fp16ToFp32(static_cast<uint16_t>(h + 1));
    if (std::isfinite(next) && (h & 0x7FFF) != 0x7BFF) gate.push_back(0.5f * (v + next));
  }
  const std::vector<float> up(gate.size(), 1.5f);
  std::vector<float> want(gate.size()), got(gate.size());
  GeluTanhMulReference(gate.data(), up.data(), static_cast<int64_t>(gate.size()), want.data());
  for (bool simd : {true, false}) {
    std::optional<ScopedDisableSimdForTesting> off;
    if (!simd) off.emplace();
    GeluTanhMul(gate.data(), up.data(), static_cast<int64_t>(gate.size()), got.data());
    for (size_t i = 0; i < gate.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
          << "simd " << simd << " gate " << gate[i] << ": " << got[i] << " vs " << want[i];
    }
  }
}

// The model passes a whole batch flattened (n_tokens * ffn_dim), so an
// element's output must not depend on where it sits or how long the array
// is: a token's activations would otherwise change with its batch's size.
TEST_P(OpsTest, SiluMulOfAnElementDoesNotDependOnItsPositionOrTheLength) {
  const auto gate = RandomFloats(n() + 16, 21, 4.0f);
  const auto up = RandomFloats(n() + 16, 22);
  std::vector<float> whole(n() + 16);
  SiluMul(gate.data(), up.data(), n() + 16, whole.data());
  for (int64_t start : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{5}, int64_t{12}}) {
    for (int64_t len = 1; start + len <= n() + 16 && len <= n(); len += (len < 20 ? 1 : 7)) {
      std::vector<float> part(len);
      SiluMul(gate.data() + start, up.data() + start, len, part.data());
      for (int64_t i = 0; i < len; ++i) {
        ASSERT_EQ(std::memcmp(&part[i], &whole[start + i], sizeof(float)), 0)
            << "element " << start + i << " computed at offset " << i << " of " << len;
      }
    }
  }
}

TEST_P(OpsTest, AddInPlaceAdds) {
  auto x = RandomFloats(n(), 5);
  const auto y = RandomFloats(n(), 6);
  std::vector<float> want(n());
  for (int64_t i = 0; i < n(); ++i) want[i] = x[i] + y[i];
  AddInPlace(x.data(), y.data(), n());
  EXPECT_EQ(x, want);
}

// Greedy's argmax equals the plain loop on random rows and on the cases its
// rule decides: ties (lowest index), NaN (never wins; a NaN first value
// keeps 0), -inf rows, the maximum in the tail past the vector loop.
TEST(ArgMaxTest, EqualsThePlainLoop) {
  const float nan = std::nanf("");
  for (int64_t n : {1, 7, 8, 63, 64, 65, 71, 1000, 262144}) {
    for (int c = 0; c < 9; ++c) {
      std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n * 10 + c));
      const int64_t last = n - 1;
      switch (c) {
        case 1:  // a tie between two lanes and a later equal value
          x[n / 3] = x[n / 2] = x[last] = 100.0f;
          break;
        case 2:  // NaNs everywhere but the maximum
          for (int64_t i = 1; i < n; i += 3) x[i] = nan;
          break;
        case 3:  // NaN first: index 0 by the rule
          x[0] = nan;
          break;
        case 4:  // all -inf
          std::fill(x.begin(), x.end(), -INFINITY);
          break;
        case 5:  // -inf first, NaN and one finite value later
          std::fill(x.begin(), x.end(), -INFINITY);
          if (n > 2) x[n / 2] = nan, x[last] = -3.0f;
          break;
        case 6:  // the maximum in the tail
          x[last] = 50.0f;
          break;
        case 7:  // +inf twice
          x[last] = INFINITY, x[n / 2] = INFINITY;
          break;
        case 8:  // all equal
          std::fill(x.begin(), x.end(), 0.5f);
          break;
        default:
          break;
      }
      const int64_t want = ArgMaxReference(x.data(), n);
      EXPECT_EQ(ArgMax(x.data(), n), want) << "n=" << n << " case " << c;
      ScopedDisableSimdForTesting no_simd;
      EXPECT_EQ(ArgMax(x.data(), n), want) << "n=" << n << " case " << c << " (no SIMD)";
    }
  }
}

TEST_P(OpsTest, SoftmaxMatchesDoublePrecision) {
  auto x = RandomFloats(n(), 7, 5.0f);
  double mx = x[0];
  for (float v : x) mx = std::max<double>(mx, v);
  double sum = 0.0;
  for (float v : x) sum += std::exp(v - mx);
  std::vector<float> want(n());
  for (int64_t i = 0; i < n(); ++i) want[i] = static_cast<float>(std::exp(x[i] - mx) / sum);
  const float log_norm = SoftmaxInPlace(x.data(), n());
  ExpectNear(x, want, 1e-6f);
  EXPECT_NEAR(log_norm, std::log(sum) + mx, 1e-5 * (1.0 + std::fabs(mx)));
}

INSTANTIATE_TEST_SUITE_P(Lengths, OpsTest,
                         ::testing::Combine(::testing::Values(1, 7, 8, 33, 576, 1536),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           // std::string first: GCC 12 warns (-Wrestrict) on "literal" + string.
                           return std::string("n") + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_simd" : "_scalar");
                         });

// RoPE against values worked out by hand: x = [1, 2, 3, 4], base 10000,
// rot_dim 4, pos 1 -> theta_0 = 1, theta_1 = 10000^(-1/2) = 0.01.
TEST(RopeTest, NormRotatesAdjacentPairs) {
  const RopeParams p{4, 4, 10000.0f, RopeStyle::kNorm};
  const std::vector<float> want = {-1.14263966f, 1.92207560f, 2.95985067f, 4.02979950f};
  for (auto* fn : {&Rope, &RopeReference}) {
    std::vector<float> x = {1, 2, 3, 4};
    fn(x.data(), 1, 1, p);
    ExpectNear(x, want, 1e-6f);
  }
}

TEST(RopeTest, NeoxRotatesHalves) {
  // Pairs (x0, x2) by theta_0 and (x1, x3) by theta_1.
  const RopeParams p{4, 4, 10000.0f, RopeStyle::kNeox};
  const std::vector<float> want = {-1.98411065f, 1.95990067f, 2.46237790f, 4.01979967f};
  for (auto* fn : {&Rope, &RopeReference}) {
    std::vector<float> x = {1, 2, 3, 4};
    fn(x.data(), 1, 1, p);
    ExpectNear(x, want, 1e-6f);
  }
}

TEST(RopeTest, PartialRotationLeavesTailAlone) {
  // head_dim 6, rot_dim 4, base 100, pos 3: theta = 3 and 3 * 100^(-1/2).
  const RopeParams p{6, 4, 100.0f, RopeStyle::kNorm};
  const std::vector<float> head = {-1.27223251f, -1.83886499f, 1.68392864f, 4.70790658f, 5, 6};
  for (auto* fn : {&Rope, &RopeReference}) {
    std::vector<float> x = {1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6};  // two heads
    fn(x.data(), 2, 3, p);
    std::vector<float> want = head;
    want.insert(want.end(), head.begin(), head.end());
    ExpectNear(x, want, 1e-6f);
  }
}

TEST(RopeTest, PositionZeroIsIdentity) {
  for (RopeStyle style : {RopeStyle::kNorm, RopeStyle::kNeox}) {
    const RopeParams p{64, 64, 10000.0f, style};
    auto x = RandomFloats(3 * 64, 8);
    const auto want = x;
    Rope(x.data(), 3, 0, p);
    EXPECT_EQ(x, want);
  }
}

// Rope computes angles with ggml's float recurrence (theta *= scale), the
// reference exactly in double: a few float roundings of an angle of up to pos
// radians put the two up to ~pos * 2^-23 apart.
float RopeTolerance(int32_t pos) { return 1e-6f + 2.5e-7f * static_cast<float>(pos); }

// Rope caches cos/sin per position: interleaved positions, bases and
// dimensions must still each get their own angles.
TEST(RopeTest, InterleavedCallsMatchReference) {
  const RopeParams a{64, 64, 10000.0f, RopeStyle::kNorm};
  const RopeParams b{64, 32, 500000.0f, RopeStyle::kNeox};
  for (int round = 0; round < 3; ++round) {
    for (int32_t pos : {5, 69, 5, 133, 6, 0}) {  // 5, 69 and 133 share a cache slot
      for (const RopeParams* p : {&a, &b}) {
        auto x = RandomFloats(2 * 64, static_cast<uint32_t>(pos + round));
        auto y = x;
        Rope(x.data(), 2, pos, *p);
        RopeReference(y.data(), 2, pos, *p);
        ExpectNear(x, y, RopeTolerance(pos));
      }
    }
  }
}

using RopeParam = std::tuple<RopeStyle, int, int>;  // style, head_dim, pos
class RopeMatchTest : public ::testing::TestWithParam<RopeParam> {};

TEST_P(RopeMatchTest, FastMatchesReference) {
  const auto [style, head_dim, pos] = GetParam();
  const RopeParams p{head_dim, head_dim, 10000.0f, style};
  auto x = RandomFloats(9 * head_dim, 9);
  auto y = x;
  Rope(x.data(), 9, pos, p);
  RopeReference(y.data(), 9, pos, p);
  ExpectNear(x, y, RopeTolerance(pos));
}

// The vector RmsNorm sums several rows' squares at once; each row must
// still come out bit for bit as the portable one-row loop gives it (the
// model's logits are compared with llama.cpp's exactly).
TEST(RmsNormBitsTest, VectorRowsEqualPortableLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2: only the portable loop runs here";
  for (int64_t n : {1, 7, 64, 256, 576, 640}) {
    for (int64_t rows : {1, 2, 3, 4, 5, 7, 9}) {
      // Wide magnitudes, so a reordered sum would round differently.
      auto x = RandomFloats(rows * n, static_cast<uint32_t>(n * 16 + rows), 3.0f);
      for (int64_t i = 0; i < rows * n; i += 5) x[i] *= 1e4f;
      const auto w = RandomFloats(n, 7);
      std::vector<float> fast(x.size()), portable(x.size());
      RmsNorm(x.data(), w.data(), rows, n, 1e-6f, fast.data());
      {
        ScopedDisableSimdForTesting no_simd;
        RmsNorm(x.data(), w.data(), rows, n, 1e-6f, portable.data());
      }
      ASSERT_EQ(0, std::memcmp(fast.data(), portable.data(), sizeof(float) * fast.size()))
          << "n " << n << " rows " << rows;
    }
  }
}

// The AVX2 rotation keeps the portable loop's fused roundings: bit-equal,
// both pair styles, full and partial rotation, vector tails included.
TEST(RopeBitsTest, VectorRotationEqualsPortableLoop) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2: only the portable loop runs here";
  for (RopeStyle style : {RopeStyle::kNorm, RopeStyle::kNeox}) {
    for (auto [head_dim, rot_dim] : {std::pair{8, 8}, {64, 64}, {256, 256}, {128, 64}, {36, 20}}) {
      for (int32_t pos : {0, 3, 77, 1000}) {
        const RopeParams p{head_dim, rot_dim, 10000.0f, style};
        auto x = RandomFloats(5 * head_dim, static_cast<uint32_t>(pos + head_dim), 2.0f);
        auto y = x;
        Rope(x.data(), 5, pos, p);
        {
          ScopedDisableSimdForTesting no_simd;
          Rope(y.data(), 5, pos, p);
        }
        ASSERT_EQ(0, std::memcmp(x.data(), y.data(), sizeof(float) * x.size()))
            << "style " << static_cast<int>(style) << " head_dim " << head_dim << " pos " << pos;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Styles, RopeMatchTest,
                         ::testing::Combine(::testing::Values(RopeStyle::kNorm, RopeStyle::kNeox),
                                            ::testing::Values(8, 64, 128),
                                            ::testing::Values(1, 17, 4095)));

}  // namespace
}  // namespace kvserve::kernels
