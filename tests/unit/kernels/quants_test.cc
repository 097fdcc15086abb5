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
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(type, q.data() + r * RowBytes(type, cols), row.data(), cols);
    for (int t = 0; t < n_tokens; ++t) {
      const float* xt = x.data() + t * x_stride;
      double bound = 0.0;
      double mag = 0.0;
      for (int64_t b = 0; b < cols / 32; ++b) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xt[b * 32 + j]));
        for (int j = 0; j < 32; ++j) {
          bound += std::fabs(row[b * 32 + j]) * 0.57 * amax / 127.0;
          mag += std::fabs(row[b * 32 + j] * xt[b * 32 + j]);
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

}  // namespace
}  // namespace kvserve::kernels
