#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/half.h"
#include "common/thread_pool.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/matmul_internal.h"
#include "kernels/dtype.h"

namespace kvserve::kernels {
namespace {

// Normalized mean squared error, as llama.cpp's test-backend-ops compares
// backends: sum((a - b)^2) / sum(b^2).
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

std::vector<float> RandomFloats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<uint8_t> Quantize(DType type, const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(RowBytes(type, cols) * rows);
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRowReference(type, w.data() + r * cols, out.data() + r * RowBytes(type, cols), cols);
  }
  return out;
}

ThreadPool* TestPool() {
  static ThreadPool pool(2);
  return &pool;
}

struct Shape {
  int64_t rows;
  int64_t cols;
};

// Which kernels run: each path is forced in-process so one machine checks all
// it supports (paths the CPU lacks fall back to the next lower one).
enum class Path { kScalar, kAvx2, kAvx512 };

const char* PathName(Path p) {
  switch (p) {
    case Path::kScalar:
      return "scalar";
    case Path::kAvx2:
      return "avx2";
    case Path::kAvx512:
      return "avx512";
  }
  return "?";
}

// dtype x n_tokens x shape x pool x path.
using MatMulParam = std::tuple<DType, int, Shape, bool, Path>;

class MatMulTest : public ::testing::TestWithParam<MatMulParam> {};

TEST_P(MatMulTest, MatchesReference) {
  const auto [type, n_tokens, shape, use_pool, path] = GetParam();
  std::optional<ScopedDisableSimdForTesting> no_simd;
  std::optional<ScopedDisableAvx512ForTesting> no_avx512;
  if (path == Path::kScalar) no_simd.emplace();
  if (path == Path::kAvx2) no_avx512.emplace();

  const auto w = RandomFloats(shape.rows * shape.cols, 1);
  const auto q = Quantize(type, w, shape.rows, shape.cols);
  const WeightView view{type, q.data(), shape.rows, shape.cols};
  // Strides wider than the rows catch kernels that assume packed rows.
  const int64_t x_stride = shape.cols + 3;
  const int64_t y_stride = shape.rows + 5;
  const auto x = RandomFloats(n_tokens * x_stride, 2);
  std::vector<float> want(n_tokens * y_stride, 0.0f);
  std::vector<float> got(n_tokens * y_stride, 0.0f);
  MatMulReference(view, x.data(), n_tokens, x_stride, want.data(), y_stride);
  MatMul(view, x.data(), n_tokens, x_stride, got.data(), y_stride, use_pool ? TestPool() : nullptr);

  // 8-bit activations bound the error of the quantized types (ggml's
  // test-backend-ops allows 5e-4 for them); float types differ from the
  // reference only in summation order.
  const double limit =
      (type == DType::kQ8_0 || type == DType::kQ4_0 || type == DType::kQ4_1) ? 2e-4 : 1e-10;
  EXPECT_LT(Nmse(got, want), limit);
  // Padding between rows must be left alone.
  for (int t = 0; t < n_tokens; ++t) {
    for (int64_t r = shape.rows; r < y_stride; ++r) EXPECT_EQ(got[t * y_stride + r], 0.0f);
  }
}

std::string MatMulName(const ::testing::TestParamInfo<MatMulParam>& info) {
  const auto [type, n_tokens, shape, use_pool, path] = info.param;
  return std::string(DTypeName(type)) + "_t" + std::to_string(n_tokens) + "_" +
         std::to_string(shape.rows) + "x" + std::to_string(shape.cols) +
         (use_pool ? "_pool_" : "_nopool_") + PathName(path);
}

// The full grid minus shapes a block format cannot hold (cols % 32 != 0).
std::vector<MatMulParam> MatMulParams() {
  std::vector<MatMulParam> params;
  for (DType type :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
    for (int n_tokens : {1, 3, 8, 33}) {
      for (Shape shape : {Shape{1, 32}, Shape{7, 64}, Shape{37, 160}, Shape{5, 96}, Shape{130, 576},
                          Shape{65, 1536}, Shape{9, 13}}) {
        if (shape.cols % BlockElems(type) != 0) continue;
        for (bool use_pool : {false, true}) {
          for (Path path : {Path::kScalar, Path::kAvx2, Path::kAvx512}) {
            params.emplace_back(type, n_tokens, shape, use_pool, path);
          }
        }
      }
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatMulTest, ::testing::ValuesIn(MatMulParams()), MatMulName);

// Q/K/V-like weights of different heights and types sharing one input.
class MatMulManyTest : public ::testing::TestWithParam<std::tuple<int, bool, Path>> {};

TEST_P(MatMulManyTest, EachOutputMatchesReference) {
  const auto [n_tokens, use_pool, path] = GetParam();
  std::optional<ScopedDisableSimdForTesting> no_simd;
  std::optional<ScopedDisableAvx512ForTesting> no_avx512;
  if (path == Path::kScalar) no_simd.emplace();
  if (path == Path::kAvx2) no_avx512.emplace();
  constexpr int64_t kCols = 576;
  const DType types[] = {DType::kQ4_1, DType::kQ8_0, DType::kF16};
  const int64_t rows[] = {67, 19, 42};
  std::vector<std::vector<uint8_t>> data;
  std::vector<WeightView> views;
  for (int i = 0; i < 3; ++i) {
    data.push_back(Quantize(types[i], RandomFloats(rows[i] * kCols, 10 + i), rows[i], kCols));
    views.push_back({types[i], data.back().data(), rows[i], kCols});
  }
  const auto x = RandomFloats(n_tokens * kCols, 3);
  std::vector<std::vector<float>> got(3), want(3);
  float* ys[3];
  int64_t strides[3];
  for (int i = 0; i < 3; ++i) {
    got[i].assign(n_tokens * rows[i], 0.0f);
    want[i].assign(n_tokens * rows[i], 0.0f);
    ys[i] = got[i].data();
    strides[i] = rows[i];
    MatMulReference(views[i], x.data(), n_tokens, kCols, want[i].data(), rows[i]);
  }
  MatMulMany(views.data(), 3, x.data(), n_tokens, kCols, ys, strides,
             use_pool ? TestPool() : nullptr);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(Nmse(got[i], want[i]), types[i] == DType::kF16 ? 1e-10 : 2e-4) << DTypeName(types[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Batches, MatMulManyTest,
                         ::testing::Combine(::testing::Values(1, 5), ::testing::Bool(),
                                            ::testing::Values(Path::kScalar, Path::kAvx2,
                                                              Path::kAvx512)),
                         [](const auto& info) {
                           return std::string("t") + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_pool_" : "_nopool_") +
                                  PathName(std::get<2>(info.param));
                         });

// The activation quantizers round like ggml's quantize_row_q8_0/q8_1 (the
// engine's greedy output is compared with llama.cpp's), and the AVX2 and
// portable versions agree bit for bit.
TEST(QuantizeActsTest, MatchesGgmlRoundingOnBothPaths) {
  const int64_t n = 256;
  auto x = RandomFloats(n, 21, 3.0f);
  std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero block
  for (auto mode : {internal::ActSum::kExact, internal::ActSum::kQ8_1}) {
    std::vector<int8_t> qs_a(n), qs_b(n);
    std::vector<float> ds_a(2 * n / kQK), ds_b(2 * n / kQK);
    internal::QuantizeActsScalar(x.data(), n, mode, qs_a.data(), ds_a.data());
    if (UseAvx2()) {
      internal::QuantizeActsAvx2(x.data(), n, mode, qs_b.data(), ds_b.data());
      EXPECT_EQ(qs_a, qs_b);
      EXPECT_EQ(ds_a, ds_b);
    }
    for (int64_t b = 0; b < n / kQK; ++b) {
      float amax = 0.0f;
      int sum = 0;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[b * kQK + j]));
      const float d = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int j = 0; j < kQK; ++j) {
        const int q = static_cast<int>(std::nearbyint(x[b * kQK + j] * id));
        EXPECT_EQ(qs_a[b * kQK + j], q);
        sum += q;
      }
      const float d16 = Fp16ToFp32(Fp32ToFp16(d));
      EXPECT_EQ(ds_a[2 * b], d16);
      const float want_s = mode == internal::ActSum::kQ8_1 ? Fp16ToFp32(Fp32ToFp16(d * sum))
                                                           : d16 * static_cast<float>(sum);
      EXPECT_EQ(ds_a[2 * b + 1], want_s);
    }
  }
}

class QuantizeTest : public ::testing::TestWithParam<DType> {};

// Round trip error is bounded by the format's step: half a step per element
// for round-to-nearest formats.
TEST_P(QuantizeTest, RoundTripErrorIsSmall) {
  const DType type = GetParam();
  const int64_t n = 1024;
  const auto x = RandomFloats(n, 7);
  std::vector<uint8_t> q(RowBytes(type, n));
  QuantizeRowReference(type, x.data(), q.data(), n);
  std::vector<float> back(n);
  DequantizeRow(type, q.data(), back.data(), n);
  double limit = 0.0;
  switch (type) {
    case DType::kF32:
      limit = 0.0;
      break;
    case DType::kF16:
      limit = 1e-7;
      break;
    case DType::kBF16:
      limit = 3e-5;
      break;
    case DType::kQ8_0:
      limit = 5e-5;
      break;
    case DType::kQ4_0:
    case DType::kQ4_1:
      limit = 1e-2;
      break;
  }
  EXPECT_LE(Nmse(back, x), limit);
}

// Quantizing what was already dequantized reproduces the same bits: the
// quantizer and dequantizer agree on the format.
TEST_P(QuantizeTest, RequantizeIsStable) {
  const DType type = GetParam();
  const int64_t n = 256;
  const auto x = RandomFloats(n, 9);
  std::vector<uint8_t> q(RowBytes(type, n));
  QuantizeRowReference(type, x.data(), q.data(), n);
  std::vector<float> back(n);
  DequantizeRow(type, q.data(), back.data(), n);
  std::vector<uint8_t> q2(q.size());
  QuantizeRowReference(type, back.data(), q2.data(), n);
  std::vector<float> back2(n);
  DequantizeRow(type, q2.data(), back2.data(), n);
  // Scales go through fp16, so values may move by fp16 rounding of d.
  EXPECT_LT(Nmse(back2, back), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantizeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                           DType::kQ4_0, DType::kQ4_1),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Hand-computed blocks pin the ggml bit layout: x[j] = j - 16.
TEST(QuantizeLayoutTest, Q4_0MatchesGgml) {
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j - 16);
  BlockQ4_0 b;
  QuantizeRowReference(DType::kQ4_0, x.data(), &b, 32);
  // Largest magnitude is -16 -> d = -16 / -8 = 2; q = trunc(x / 2 + 8.5).
  EXPECT_EQ(b.d, Fp32ToFp16(2.0f));
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>((j - 16) / 2.0f + 8.5f));
    const int hi = std::min(15, static_cast<int>(j / 2.0f + 8.5f));
    EXPECT_EQ(b.qs[j], lo | (hi << 4)) << j;
  }
  EXPECT_EQ(b.qs[0], 0x80);  // x=-16 -> 0, x=0 -> 8 in the high nibble
}

TEST(QuantizeLayoutTest, Q4_1MatchesGgml) {
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j - 16);
  BlockQ4_1 b;
  QuantizeRowReference(DType::kQ4_1, x.data(), &b, 32);
  EXPECT_EQ(b.m, Fp32ToFp16(-16.0f));
  EXPECT_EQ(b.d, Fp32ToFp16(31.0f / 15.0f));
  const float id = 15.0f / 31.0f;
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>(j * id + 0.5f));
    const int hi = std::min(15, static_cast<int>((j + 16) * id + 0.5f));
    EXPECT_EQ(b.qs[j], lo | (hi << 4)) << j;
  }
  EXPECT_EQ(b.qs[15] >> 4, 15);  // the max lands on the top code
}

TEST(QuantizeLayoutTest, Q8_0MatchesGgml) {
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j - 16);
  BlockQ8_0 b;
  QuantizeRowReference(DType::kQ8_0, x.data(), &b, 32);
  EXPECT_EQ(b.d, Fp32ToFp16(16.0f / 127.0f));
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(b.qs[j], static_cast<int8_t>(std::round((j - 16) * (127.0f / 16.0f)))) << j;
  }
  EXPECT_EQ(b.qs[0], -127);
}

TEST(QuantizeLayoutTest, ZeroBlockDequantizesToZero) {
  std::vector<float> x(32, 0.0f);
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
    std::vector<uint8_t> q(RowBytes(t, 32));
    QuantizeRowReference(t, x.data(), q.data(), 32);
    std::vector<float> back(32, 1.0f);
    DequantizeRow(t, q.data(), back.data(), 32);
    for (float v : back) EXPECT_EQ(v, 0.0f) << DTypeName(t);
  }
}

TEST(DTypeTest, SizesMatchGguf) {
  EXPECT_EQ(BlockBytes(DType::kQ8_0), 34);
  EXPECT_EQ(BlockBytes(DType::kQ4_0), 18);
  EXPECT_EQ(BlockBytes(DType::kQ4_1), 20);
  EXPECT_EQ(BlockElems(DType::kQ4_1), 32);
  EXPECT_EQ(BlockElems(DType::kF16), 1);
  EXPECT_EQ(RowBytes(DType::kQ4_1, 576), 18 * 20);
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
}

}  // namespace
}  // namespace kvserve::kernels
