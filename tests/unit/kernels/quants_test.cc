// The extended ggml weight formats (Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K, IQ4_XS):
// the reference dequantizer against values computed by an independent
// implementation (tests/data/make_quants_fixture.py, the `gguf` package's
// numpy port of ggml), bit for bit; and every MatMul path (portable, AVX2,
// AVX-512 VNNI) against the plain-loop reference.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/half.h"
#include "common/thread_pool.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/matmul_internal.h"
#include "kernels/dtype.h"

namespace kvserve::kernels {
namespace {

constexpr DType kExtended[] = {DType::kQ5_0, DType::kQ5_1, DType::kIQ4_NL,
                               DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                               DType::kQ5_K, DType::kQ6_K, DType::kIQ4_XS};

// ggml type id -> DType for the fixture's records.
std::optional<DType> FromGgmlId(uint32_t id) {
  static const std::map<uint32_t, DType> kIds = {
      {6, DType::kQ5_0},  {7, DType::kQ5_1},  {20, DType::kIQ4_NL},
      {10, DType::kQ2_K}, {11, DType::kQ3_K}, {12, DType::kQ4_K},
      {13, DType::kQ5_K}, {14, DType::kQ6_K}, {23, DType::kIQ4_XS}};
  auto it = kIds.find(id);
  if (it == kIds.end()) return std::nullopt;
  return it->second;
}

uint32_t ReadU32(const std::string& s, size_t* pos) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + *pos, sizeof(v));
  *pos += sizeof(v);
  return v;
}

TEST(QuantsTest, BlockSizes) {
  const std::map<DType, std::pair<int64_t, int64_t>> want = {
      {DType::kQ5_0, {32, 22}},   {DType::kQ5_1, {32, 24}},   {DType::kIQ4_NL, {32, 18}},
      {DType::kQ2_K, {256, 84}},  {DType::kQ3_K, {256, 110}}, {DType::kQ4_K, {256, 144}},
      {DType::kQ5_K, {256, 176}}, {DType::kQ6_K, {256, 210}}, {DType::kIQ4_XS, {256, 136}}};
  for (DType t : kExtended) {
    SCOPED_TRACE(DTypeName(t));
    EXPECT_EQ(BlockElems(t), want.at(t).first);
    EXPECT_EQ(BlockBytes(t), want.at(t).second);
    EXPECT_EQ(RowBytes(t, 1536), 1536 / want.at(t).first * want.at(t).second);
  }
}

// Bit-exact against ggml's dequantization as the gguf package computes it.
TEST(QuantsTest, DequantizeMatchesGgmlFixture) {
  const std::string path = std::string(KVSERVE_SOURCE_DIR) + "/tests/data/quants_fixture.bin";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(s.size(), 8u);
  ASSERT_EQ(s.substr(0, 4), "KVQF");
  size_t pos = 4;
  const uint32_t n_records = ReadU32(s, &pos);
  std::map<DType, int> seen;
  for (uint32_t i = 0; i < n_records; ++i) {
    const uint32_t id = ReadU32(s, &pos);
    const uint32_t n = ReadU32(s, &pos);
    const uint32_t n_bytes = ReadU32(s, &pos);
    ASSERT_LE(pos + n_bytes + 4ull * n, s.size());
    const auto type = FromGgmlId(id);
    ASSERT_TRUE(type.has_value()) << "ggml type " << id;
    SCOPED_TRACE(DTypeName(*type));
    ASSERT_EQ(RowBytes(*type, n), n_bytes);
    std::vector<float> want(n);
    std::memcpy(want.data(), s.data() + pos + n_bytes, 4ull * n);
    std::vector<float> got(n, -1.0f);
    DequantizeRow(*type, s.data() + pos, got.data(), n);
    int mismatches = 0;
    for (uint32_t j = 0; j < n; ++j) {
      uint32_t a;
      uint32_t b;
      std::memcpy(&a, &got[j], 4);
      std::memcpy(&b, &want[j], 4);
      if (a != b && ++mismatches <= 5) {
        ADD_FAILURE() << "element " << j << ": got " << got[j] << " want " << want[j];
      }
    }
    EXPECT_EQ(mismatches, 0);
    pos += n_bytes + 4ull * n;
    ++seen[*type];
  }
  for (DType t : kExtended) EXPECT_EQ(seen[t], 1) << DTypeName(t) << " missing from fixture";
}

// Random blocks of a format: random bits everywhere, with the fp16 scales
// replaced by finite values of both signs.
std::vector<uint8_t> RandomWeights(DType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(RowBytes(type, cols) * rows);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  std::vector<int> halves;
  switch (type) {
    case DType::kQ5_1:
    case DType::kQ4_K:
    case DType::kQ5_K:
      halves = {0, 2};
      break;
    case DType::kQ2_K:
      halves = {80, 82};
      break;
    case DType::kQ3_K:
      halves = {108};
      break;
    case DType::kQ6_K:
      halves = {208};
      break;
    default:
      halves = {0};
      break;
  }
  std::uniform_real_distribution<float> mag(0.002f, 0.02f);
  const int64_t bb = BlockBytes(type);
  for (size_t off = 0; off < out.size(); off += bb) {
    for (int h : halves) {
      const float v = (rng() & 1 ? -1.0f : 1.0f) * mag(rng);
      const uint16_t bits = Fp32ToFp16(v);
      std::memcpy(&out[off + h], &bits, 2);
    }
  }
  return out;
}

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0;
  double ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return ref > 0.0 ? err / ref : err;
}

ThreadPool* TestPool() {
  static ThreadPool pool(2);
  return &pool;
}

enum class Path { kScalar, kAvx2, kAvx512 };

// type x n_tokens x rows x cols x path.
using Param = std::tuple<DType, int, int64_t, int64_t, Path>;
class QuantsMatMulTest : public ::testing::TestWithParam<Param> {};

TEST_P(QuantsMatMulTest, MatchesReference) {
  const auto [type, n_tokens, rows, cols, path] = GetParam();
  std::optional<ScopedDisableSimdForTesting> no_simd;
  std::optional<ScopedDisableAvx512ForTesting> no_avx512;
  if (path == Path::kScalar) no_simd.emplace();
  if (path == Path::kAvx2) no_avx512.emplace();
  const auto q = RandomWeights(type, rows, cols, 7);
  const WeightView view{type, q.data(), rows, cols};
  const int64_t x_stride = cols + 3;
  const int64_t y_stride = rows + 5;
  const auto x = RandomFloats(n_tokens * x_stride, 11);
  std::vector<float> want(n_tokens * y_stride, 0.0f);
  std::vector<float> got(n_tokens * y_stride, 0.0f);
  MatMulReference(view, x.data(), n_tokens, x_stride, want.data(), y_stride);
  MatMul(view, x.data(), n_tokens, x_stride, got.data(), y_stride, TestPool());
  // The kernels see x through 8-bit activations: per 32-value block,
  // x ~ q * d16 with d = amax / 127 rounded to fp16, so |x - q d16| <=
  // d / 2 + 127 d 2^-11 < 0.57 d. Each output may then differ from the
  // float reference by sum |w_i| * 0.57 d_block(i), plus float rounding
  // (1e-5 of sum |w_i x_i|). Checked per output, so a wrong scale or
  // sub-block anywhere fails; the bound is a few times tighter than 8-bit
  // noise on average (NMSE also checked against the quantized-type limit).
  // The K-quants and IQ4_XS meet Q8_K activations instead: one scale per
  // 256 values, d = amax / 127 kept in float, so |x - q d| <= 0.51 d.
  const bool q8k = internal::UsesQ8K(type);
  const int64_t act_block = q8k ? 256 : 32;
  const double act_err = q8k ? 0.51 : 0.57;
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(type, q.data() + r * RowBytes(type, cols), row.data(), cols);
    for (int t = 0; t < n_tokens; ++t) {
      const float* xt = x.data() + t * x_stride;
      double bound = 0.0;
      double mag = 0.0;
      for (int64_t b = 0; b < cols / act_block; ++b) {
        float amax = 0.0f;
        for (int j = 0; j < act_block; ++j) {
          amax = std::max(amax, std::fabs(xt[b * act_block + j]));
        }
        for (int j = 0; j < act_block; ++j) {
          const int64_t i = b * act_block + j;
          bound += std::fabs(row[i]) * act_err * amax / 127.0;
          mag += std::fabs(row[i] * xt[i]);
        }
      }
      bound += 1e-5 * mag;
      ASSERT_LE(std::fabs(got[t * y_stride + r] - want[t * y_stride + r]), bound)
          << "row " << r << " token " << t;
    }
  }
  if (rows * n_tokens >= 32) EXPECT_LT(Nmse(got, want), 2e-4);
  for (int t = 0; t < n_tokens; ++t) {
    for (int64_t r = rows; r < y_stride; ++r) EXPECT_EQ(got[t * y_stride + r], 0.0f);
  }
}

std::vector<Param> Params() {
  std::vector<Param> out;
  for (DType type : kExtended) {
    for (int n_tokens : {1, 2, 3, 5, 8, 33}) {
      for (auto [rows, cols] :
           {std::pair<int64_t, int64_t>{1, 256}, {37, 512}, {130, 1536}, {9, 96}, {6, 576}}) {
        if (cols % BlockElems(type) != 0) continue;
        for (Path p : {Path::kScalar, Path::kAvx2, Path::kAvx512}) {
          out.emplace_back(type, n_tokens, rows, cols, p);
        }
      }
    }
  }
  return out;
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto [type, n_tokens, rows, cols, path] = info.param;
  const char* p = path == Path::kScalar ? "scalar" : path == Path::kAvx2 ? "avx2" : "avx512";
  return std::string(DTypeName(type)) + "_t" + std::to_string(n_tokens) + "_" +
         std::to_string(rows) + "x" + std::to_string(cols) + "_" + p;
}

INSTANTIATE_TEST_SUITE_P(Extended, QuantsMatMulTest, ::testing::ValuesIn(Params()), ParamName);

// A mix as K-quant files hold it (Q4_K next to Q6_K, Q5_0, Q8_0 and Q4_1
// weights) sharing one quantized input through MatMulMany.
TEST(QuantsMatMulManyTest, MixedTypesMatchReference) {
  const DType types[] = {DType::kQ4_K, DType::kQ6_K, DType::kQ5_0, DType::kQ8_0, DType::kQ4_1};
  const int64_t cols = 512;
  const int64_t rows[] = {40, 17, 33, 8, 21};
  std::vector<std::vector<uint8_t>> owned;
  std::vector<WeightView> views;
  for (int i = 0; i < 5; ++i) {
    if (types[i] == DType::kQ8_0 || types[i] == DType::kQ4_1) {
      const auto f = RandomFloats(rows[i] * cols, 30 + i);
      std::vector<uint8_t> q(RowBytes(types[i], cols) * rows[i]);
      for (int64_t r = 0; r < rows[i]; ++r) {
        QuantizeRowReference(types[i], f.data() + r * cols, q.data() + r * RowBytes(types[i], cols),
                             cols);
      }
      owned.push_back(std::move(q));
    } else {
      owned.push_back(RandomWeights(types[i], rows[i], cols, 20 + i));
    }
  }
  for (int i = 0; i < 5; ++i) views.push_back({types[i], owned[i].data(), rows[i], cols});
  for (int n_tokens : {1, 6}) {
    const auto x = RandomFloats(n_tokens * cols, 3);
    std::vector<std::vector<float>> got(5), want(5);
    std::vector<float*> ys;
    std::vector<int64_t> strides;
    for (int i = 0; i < 5; ++i) {
      got[i].assign(n_tokens * rows[i], 0.0f);
      want[i].assign(n_tokens * rows[i], 0.0f);
      ys.push_back(got[i].data());
      strides.push_back(rows[i]);
      MatMulReference(views[i], x.data(), n_tokens, cols, want[i].data(), rows[i]);
    }
    MatMulMany(views.data(), 5, x.data(), n_tokens, cols, ys.data(), strides.data(), TestPool());
    for (int i = 0; i < 5; ++i) {
      EXPECT_LT(Nmse(got[i], want[i]), 2e-4) << DTypeName(types[i]) << " t" << n_tokens;
    }
  }
}

// ---- Q8_K activations (the K-quants' and IQ4_XS's vec_dot_type in ggml).

// ggml's quantize_row_q8_K_ref written out in its own form: the signed
// value of largest magnitude (first on ties) sets iscale = -127 / max,
// q = min(127, round-half-even(iscale * x)), d = 1 / iscale.
void GgmlQ8K(const float* x, int8_t* q, float* d, int16_t* bsums) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < 256; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  if (amax == 0.0f) {
    *d = 0.0f;
    std::fill(q, q + 256, 0);
  } else {
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; ++j) {
      // ggml's nearest_int: the 1.5 * 2^23 trick, round-half-even.
      const float v = iscale * x[j] + 12582912.0f;
      int32_t bits;
      std::memcpy(&bits, &v, 4);
      q[j] = static_cast<int8_t>(std::min(127, (bits & 0x007fffff) - 0x00400000));
    }
    *d = 1.0f / iscale;
  }
  for (int i = 0; i < 16; ++i) {
    int sum = 0;
    for (int l = 0; l < 16; ++l) sum += q[16 * i + l];
    bsums[i] = static_cast<int16_t>(sum);
  }
}

// Inputs with what breaks quantizers: per-super-block magnitudes from 1e-3
// to 1e3 (Gemma's activations reach the hundreds), a zero block, a block
// whose largest value is negative, one with +amax and -amax both present,
// and values on exact rounding ties.
std::vector<float> Q8KInputs(int64_t n_blocks) {
  auto x = RandomFloats(n_blocks * 256, 5);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float scale = std::pow(10.0f, static_cast<float>(b % 7) - 3.0f);
    for (int j = 0; j < 256; ++j) x[b * 256 + j] *= scale;
  }
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);                     // block 1: zeros
  for (int j = 0; j < 256; ++j) x[512 + j] = -std::fabs(x[512 + j]);     // block 2: all <= 0
  x[768 + 3] = 4.0f;                                                      // block 3: +-amax
  x[768 + 9] = -4.0f;
  for (int j = 0; j < 256; ++j) x[1024 + j] = static_cast<float>(j % 9 - 4) * 0.5f;  // ties
  x[1024] = 127.0f;  // iscale 1: every x.5 a tie
  return x;
}

TEST(Q8KActsTest, ScalarMatchesGgmlFormAndAvx2MatchesScalar) {
  constexpr int64_t kBlocks = 12;
  const auto x = Q8KInputs(kBlocks);
  const int64_t n = kBlocks * 256;
  std::vector<int8_t> qs(n), qs2(n);
  std::vector<float> ds(2 * n / 32), ds2(2 * n / 32);
  std::vector<int16_t> bs(n / 16), bs2(n / 16);
  internal::QuantizeActsQ8KScalar(x.data(), n, qs.data(), ds.data(), bs.data());
  for (int64_t b = 0; b < kBlocks; ++b) {
    SCOPED_TRACE("super-block " + std::to_string(b));
    int8_t gq[256];
    float gd;
    int16_t gbs[16];
    GgmlQ8K(x.data() + b * 256, gq, &gd, gbs);
    // Same products d * q: ours is ggml's with both signs flipped, or equal.
    const float sign = (gd < 0.0f) ? -1.0f : 1.0f;
    for (int c = 0; c < 8; ++c) {
      ASSERT_EQ(ds[2 * (b * 8 + c)], sign * gd);
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += qs[b * 256 + 32 * c + j];
      EXPECT_EQ(ds[2 * (b * 8 + c) + 1], ds[2 * (b * 8 + c)] * static_cast<float>(sum));
    }
    for (int j = 0; j < 256; ++j) {
      ASSERT_EQ(qs[b * 256 + j], static_cast<int>(sign) * gq[j]) << "value " << j;
      ASSERT_EQ(ds[2 * b * 8] * qs[b * 256 + j], gd * gq[j]);
    }
    for (int i = 0; i < 16; ++i) EXPECT_EQ(bs[b * 16 + i], static_cast<int>(sign) * gbs[i]);
  }
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  internal::QuantizeActsQ8KAvx2(x.data(), n, qs2.data(), ds2.data(), bs2.data());
  EXPECT_EQ(qs2, qs);
  EXPECT_EQ(bs2, bs);
  for (size_t i = 0; i < ds.size(); ++i) ASSERT_EQ(ds2[i], ds[i]) << i;
}

constexpr DType kQ8KTypes[] = {DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                               DType::kQ5_K, DType::kQ6_K, DType::kIQ4_XS};

// The integer form the Q8_K reference sums is the dequantizer's value.
TEST(Q8KDotTest, DecodedIntegersEqualTheDequantizer) {
  for (DType type : kQ8KTypes) {
    SCOPED_TRACE(DTypeName(type));
    ASSERT_TRUE(internal::UsesQ8K(type));
    const auto q = RandomWeights(type, 1, 2048, 13);
    std::vector<float> want(2048);
    DequantizeRow(type, q.data(), want.data(), 2048);
    for (int64_t sb = 0; sb < 8; ++sb) {
      internal::KSuperBlockInts k;
      ASSERT_TRUE(internal::DecodeKSuperBlock(type, q.data() + sb * BlockBytes(type), &k));
      for (int j = 0; j < 256; ++j) {
        const double v = static_cast<double>(k.d) * k.sc[j / 16] * k.q[j] -
                         static_cast<double>(k.dmin) * k.mn[j / 16];
        ASSERT_NEAR(v, want[sb * 256 + j], 1e-6 * std::fabs(v) + 1e-12)
            << "super-block " << sb << " value " << j;
      }
    }
  }
  internal::KSuperBlockInts k;
  EXPECT_FALSE(internal::DecodeKSuperBlock(DType::kQ5_0, nullptr, &k));
}

// The AVX2 and VNNI kernels on Q8_K activations against the plain-loop
// reference: the same exact integer sums, so they may differ only by float
// rounding (the order the per-sub-block terms are added in).
TEST(Q8KDotTest, VectorKernelsMatchReference) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  for (DType type : kQ8KTypes) {
    for (int n_tokens : {1, 2, 5}) {
      SCOPED_TRACE(std::string(DTypeName(type)) + " t" + std::to_string(n_tokens));
      const int64_t rows = 13;
      const int64_t cols = 1536;
      const auto q = RandomWeights(type, rows, cols, 17);
      const WeightView view{type, q.data(), rows, cols};
      auto x = RandomFloats(n_tokens * cols, 19);
      for (int64_t i = 0; i < cols; i += 97) x[i] *= 40.0f;  // outliers, as Gemma's
      const int64_t nb = cols / 32;
      std::vector<int8_t> qs(n_tokens * cols + 64);
      std::vector<float> ds(2 * n_tokens * nb + 16);
      std::vector<int16_t> bs(2 * n_tokens * nb);
      for (int t = 0; t < n_tokens; ++t) {
        internal::QuantizeActsQ8KScalar(x.data() + t * cols, cols, qs.data() + t * cols,
                                        ds.data() + t * 2 * nb, bs.data() + t * 2 * nb);
      }
      internal::QuantizedActs acts;
      acts.n_blocks = nb;
      acts.qs = qs.data();
      acts.ds = ds.data();
      acts.bsums = bs.data();
      std::vector<float> want(n_tokens * rows), avx2(n_tokens * rows), vnni(n_tokens * rows);
      internal::MatMulRowsQ8KReference(view, acts, n_tokens, 0, rows, want.data(), rows);
      internal::MatMulRowsExtendedAvx2(view, acts, n_tokens, 0, rows, avx2.data(), rows);
      const bool has_vnni = UseAvx512Vnni();
      if (has_vnni) {
        internal::MatMulRowsExtendedVnni(view, acts, n_tokens, 0, rows, vnni.data(), rows);
      }
      // Scale of the float rounding: sum |w_i| |x_i| for each output.
      std::vector<float> row(cols);
      for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(type, q.data() + r * RowBytes(type, cols), row.data(), cols);
        for (int t = 0; t < n_tokens; ++t) {
          double mag = 0.0;
          for (int64_t i = 0; i < cols; ++i) mag += std::fabs(row[i] * x[t * cols + i]);
          const float w = want[t * rows + r];
          EXPECT_NEAR(avx2[t * rows + r], w, 2e-6 * mag) << "avx2 row " << r << " token " << t;
          if (has_vnni) {
            EXPECT_NEAR(vnni[t * rows + r], w, 2e-6 * mag) << "vnni row " << r << " token " << t;
          }
        }
      }
    }
  }
}

// MatMul on every path feeds these types Q8_K activations: its output is
// the reference's on QuantizeActsQ8KScalar's values up to float rounding,
// far closer than 32-value blocks would come (their quantization differs
// by ~1e-4 of sum |w x| here).
TEST(Q8KDotTest, MatMulUsesQ8KActivationsOnEveryPath) {
  for (Path path : {Path::kScalar, Path::kAvx2, Path::kAvx512}) {
    std::optional<ScopedDisableSimdForTesting> no_simd;
    std::optional<ScopedDisableAvx512ForTesting> no_avx512;
    if (path == Path::kScalar) no_simd.emplace();
    if (path == Path::kAvx2) no_avx512.emplace();
    for (DType type : kQ8KTypes) {
      SCOPED_TRACE(std::string(DTypeName(type)) + " path " + std::to_string(static_cast<int>(path)));
      const int64_t rows = 40;
      const int64_t cols = 512;
      const int n_tokens = 3;
      const auto q = RandomWeights(type, rows, cols, 23);
      const WeightView view{type, q.data(), rows, cols};
      const auto x = RandomFloats(n_tokens * cols, 29);
      std::vector<int8_t> qs(n_tokens * cols);
      std::vector<float> ds(2 * n_tokens * cols / 32);
      std::vector<int16_t> bs(n_tokens * cols / 16);
      for (int t = 0; t < n_tokens; ++t) {
        internal::QuantizeActsQ8KScalar(x.data() + t * cols, cols, qs.data() + t * cols,
                                        ds.data() + t * 2 * cols / 32,
                                        bs.data() + t * cols / 16);
      }
      internal::QuantizedActs acts;
      acts.n_blocks = cols / 32;
      acts.qs = qs.data();
      acts.ds = ds.data();
      acts.bsums = bs.data();
      std::vector<float> want(n_tokens * rows), got(n_tokens * rows);
      internal::MatMulRowsQ8KReference(view, acts, n_tokens, 0, rows, want.data(), rows);
      MatMul(view, x.data(), n_tokens, cols, got.data(), rows, TestPool());
      std::vector<float> row(cols);
      for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(type, q.data() + r * RowBytes(type, cols), row.data(), cols);
        for (int t = 0; t < n_tokens; ++t) {
          double mag = 0.0;
          for (int64_t i = 0; i < cols; ++i) mag += std::fabs(row[i] * x[t * cols + i]);
          ASSERT_NEAR(got[t * rows + r], want[t * rows + r], 2e-6 * mag)
              << "row " << r << " token " << t;
        }
      }
    }
  }
}

// Q5_0, Q5_1 and IQ4_NL: the vector kernels against the plain-loop form of
// ggml's Q8_0 / Q8_1 dots, with the exact sum and with ggml's Q8_1 sum (the
// mode MatMul picks when Q4_1 / Q5_1 weights are alone in a call).
TEST(Block32DotTest, VectorKernelsMatchReference) {
  if (!UseAvx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  for (DType type : {DType::kQ5_0, DType::kQ5_1, DType::kIQ4_NL}) {
    for (auto mode : {internal::ActSum::kExact, internal::ActSum::kQ8_1}) {
      // MatMul gives Q5_0 the exact sum always: its -16 d offset cancels
      // only against it (ggml's Q8_0 carries no sum at all).
      if (type == DType::kQ5_0 && mode == internal::ActSum::kQ8_1) continue;
      SCOPED_TRACE(std::string(DTypeName(type)) +
                   (mode == internal::ActSum::kExact ? " exact" : " q8_1"));
      const int n_tokens = 3;
      const int64_t rows = 11;
      const int64_t cols = 576;  // two groups of 8 blocks and a tail of 2
      const auto q = RandomWeights(type, rows, cols, 31);
      const WeightView view{type, q.data(), rows, cols};
      const auto x = RandomFloats(n_tokens * cols, 37);
      const int64_t nb = cols / 32;
      std::vector<int8_t> qs(n_tokens * cols + 64);
      std::vector<float> ds(2 * n_tokens * nb + 16);
      for (int t = 0; t < n_tokens; ++t) {
        internal::QuantizeActsScalar(x.data() + t * cols, cols, mode, qs.data() + t * cols,
                                     ds.data() + t * 2 * nb);
      }
      internal::QuantizedActs acts;
      acts.n_blocks = nb;
      acts.qs = qs.data();
      acts.ds = ds.data();
      std::vector<float> want(n_tokens * rows), avx2(n_tokens * rows), vnni(n_tokens * rows);
      internal::MatMulRowsBlock32Reference(view, acts, n_tokens, 0, rows, want.data(), rows);
      internal::MatMulRowsExtendedAvx2(view, acts, n_tokens, 0, rows, avx2.data(), rows);
      const bool has_vnni = UseAvx512Vnni();
      if (has_vnni) {
        internal::MatMulRowsExtendedVnni(view, acts, n_tokens, 0, rows, vnni.data(), rows);
      }
      std::vector<float> row(cols);
      for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(type, q.data() + r * RowBytes(type, cols), row.data(), cols);
        for (int t = 0; t < n_tokens; ++t) {
          double mag = 0.0;
          for (int64_t i = 0; i < cols; ++i) mag += std::fabs(row[i] * x[t * cols + i]);
          const float w = want[t * rows + r];
          EXPECT_NEAR(avx2[t * rows + r], w, 2e-6 * mag) << "avx2 row " << r << " token " << t;
          if (has_vnni) {
            EXPECT_NEAR(vnni[t * rows + r], w, 2e-6 * mag) << "vnni row " << r << " token " << t;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvserve::kernels
