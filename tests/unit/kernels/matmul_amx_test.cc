// Packed 16-row panels and the kernels that read them: the VNNI panel
// kernel, the AMX kernel on the hardware tiles and on their software model.
// Every one must give the same bits as the scalar statement of the panel
// expression (matmul_panels.h) on random shapes -- odd row counts, token
// counts around the 16-token tile, row ranges that start mid-panel -- and
// stay within the quantized tolerance of the plain-loop reference.
// Hardware-AMX cases skip with a message on CPUs without AMX; the emulated
// ones need only AVX-512 VNNI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
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
#include "kernels/cpu/matmul_panels.h"
#include "kernels/dtype.h"

namespace kvserve::kernels {
namespace {

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<uint8_t> Quantize(DType type, const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(RowBytes(type, cols) * rows);
  if (type == DType::kQ6_K) {
    // Random Q6_K blocks (every bit pattern of values and int8 scales is
    // valid) with d drawn from w.
    std::mt19937 rng(static_cast<uint32_t>(w.size()) + 1);
    auto* blocks = reinterpret_cast<BlockQ6_K*>(out.data());
    for (int64_t i = 0; i < rows * cols / kQK_K; ++i) {
      blocks[i].d = Fp32ToFp16(std::fabs(w[i]) * 0.001f + 1e-4f);
      for (auto& b : blocks[i].ql) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].qh) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].scales) b = static_cast<int8_t>(rng());
    }
    return out;
  }
  if (type == DType::kQ5_K) {
    // Random Q5_K blocks, as Q4_K's below plus random fifth bits.
    std::mt19937 rng(static_cast<uint32_t>(w.size()) + 2);
    auto* blocks = reinterpret_cast<BlockQ5_K*>(out.data());
    for (int64_t i = 0; i < rows * cols / kQK_K; ++i) {
      blocks[i].d = Fp32ToFp16(std::fabs(w[i]) * 0.005f + 1e-3f);
      blocks[i].dmin = Fp32ToFp16(std::fabs(w[i + 1 < static_cast<int64_t>(w.size()) ? i + 1 : 0]) * 0.01f);
      for (auto& b : blocks[i].scales) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].qh) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].qs) b = static_cast<uint8_t>(rng());
    }
    return out;
  }
  if (type == DType::kQ4_K) {
    // No Q4_K quantizer here: random blocks (every bit pattern of scales,
    // mins and nibbles is a valid Q4_K block) with d, dmin drawn from w.
    std::mt19937 rng(static_cast<uint32_t>(w.size()));
    auto* blocks = reinterpret_cast<BlockQ4_K*>(out.data());
    for (int64_t i = 0; i < rows * cols / kQK_K; ++i) {
      blocks[i].d = Fp32ToFp16(std::fabs(w[i]) * 0.01f + 1e-3f);
      blocks[i].dmin = Fp32ToFp16(std::fabs(w[i + 1 < static_cast<int64_t>(w.size()) ? i + 1 : 0]) * 0.01f);
      for (auto& b : blocks[i].scales) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].qs) b = static_cast<uint8_t>(rng());
    }
    return out;
  }
  if (type == DType::kQ2_K || type == DType::kQ3_K) {
    // Random Q2_K / Q3_K blocks: every bit pattern of values, high bits,
    // scales and mins is valid; d (and dmin) drawn from w.
    std::mt19937 rng(static_cast<uint32_t>(w.size()) + 5);
    for (int64_t i = 0; i < rows * cols / kQK_K; ++i) {
      const float d = std::fabs(w[i]) * 0.002f + 2e-4f;
      if (type == DType::kQ2_K) {
        auto& b = reinterpret_cast<BlockQ2_K*>(out.data())[i];
        b.d = Fp32ToFp16(d * 5);
        b.dmin = Fp32ToFp16(d * 2);
        for (auto& q : b.scales) q = static_cast<uint8_t>(rng());
        for (auto& q : b.qs) q = static_cast<uint8_t>(rng());
      } else {
        auto& b = reinterpret_cast<BlockQ3_K*>(out.data())[i];
        b.d = Fp32ToFp16(d);
        for (auto& q : b.hmask) q = static_cast<uint8_t>(rng());
        for (auto& q : b.qs) q = static_cast<uint8_t>(rng());
        for (auto& q : b.scales) q = static_cast<uint8_t>(rng());
      }
    }
    return out;
  }
  if (type == DType::kIQ4_XS) {
    // Random IQ4_XS blocks: every bit pattern of indices and 6-bit scales is
    // valid; d drawn from w.
    std::mt19937 rng(static_cast<uint32_t>(w.size()) + 3);
    auto* blocks = reinterpret_cast<BlockIQ4_XS*>(out.data());
    for (int64_t i = 0; i < rows * cols / kQK_K; ++i) {
      blocks[i].d = Fp32ToFp16(std::fabs(w[i]) * 0.0005f + 1e-4f);
      blocks[i].scales_h = static_cast<uint16_t>(rng());
      for (auto& b : blocks[i].scales_l) b = static_cast<uint8_t>(rng());
      for (auto& b : blocks[i].qs) b = static_cast<uint8_t>(rng());
    }
    return out;
  }
  if (type == DType::kQ5_1 || type == DType::kIQ4_NL) {
    // Random blocks (no quantizer for these here): d from w; Q5_1's min
    // centres its 0..31 values.
    std::mt19937 rng(static_cast<uint32_t>(w.size()) + 4);
    for (int64_t i = 0; i < rows * cols / kQK; ++i) {
      const float d = std::fabs(w[i]) * 0.05f + 0.01f;
      if (type == DType::kQ5_1) {
        auto& b = reinterpret_cast<BlockQ5_1*>(out.data())[i];
        b.d = Fp32ToFp16(d);
        b.m = Fp32ToFp16(-16.0f * d + 0.1f * w[(i + 1) % w.size()] * d);
        for (auto& q : b.qh) q = static_cast<uint8_t>(rng());
        for (auto& q : b.qs) q = static_cast<uint8_t>(rng());
      } else {
        auto& b = reinterpret_cast<BlockIQ4_NL*>(out.data())[i];
        b.d = Fp32ToFp16(d * 0.1f);
        for (auto& q : b.qs) q = static_cast<uint8_t>(rng());
      }
    }
    return out;
  }
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRowReference(type, w.data() + r * cols, out.data() + r * RowBytes(type, cols), cols);
  }
  return out;
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

// Index of the first differing float (bitwise), or -1.
int64_t FirstBitDifference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

#define SKIP_WITHOUT_VNNI()                                                             \
  do {                                                                                  \
    if (!UseAvx512Vnni()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU: panels unused"; \
  } while (0)

// A quantized weight, its packed panels and a batch of activations
// quantized as MatMulMany does.
struct Case {
  DType type;
  int64_t rows, cols, n_tokens;
  std::vector<uint8_t> q;
  WeightView view{};
  std::shared_ptr<const PackedWeight> packed;
  std::vector<float> x;
  std::vector<int8_t> qs;
  std::vector<float> ds;
  std::vector<int32_t> sums;
  std::vector<int16_t> bsums;
  internal::QuantizedActs acts;

  Case(DType t, int64_t r, int64_t c, int64_t n, uint32_t seed)
      : type(t), rows(r), cols(c), n_tokens(n) {
    q = Quantize(t, RandomFloats(r * c, seed), r, c);
    view = WeightView{t, q.data(), r, c};
    packed = PackWeight(view);
    view.packed = packed.get();
    x = RandomFloats(n * c, seed + 1);
    const int64_t nb = c / kQK;
    qs.assign(n * c + 64, 0);
    ds.assign(2 * n * nb + 16, 0.0f);
    sums.assign(n * nb, 0);
    const auto mode = internal::PanelHasMin(t) ? internal::ActSum::kQ8_1 : internal::ActSum::kExact;
    // Q4_K meets Q8_K activations (one scale per 256 values), as MatMulMany
    // gives it.
    const bool q8k = internal::UsesQ8K(t);
    if (q8k) bsums.assign(n * nb * 2, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (q8k) {
        internal::QuantizeActsQ8KAvx2(x.data() + i * c, c, qs.data() + i * c,
                                      ds.data() + i * 2 * nb, bsums.data() + i * nb * 2);
      } else {
        internal::QuantizeActsAvx2(x.data() + i * c, c, mode, qs.data() + i * c,
                                   ds.data() + i * 2 * nb, sums.data() + i * nb);
      }
    }
    acts.n_blocks = nb;
    acts.qs = qs.data();
    acts.ds = ds.data();
    acts.sums = q8k ? nullptr : sums.data();
    acts.bsums = q8k ? bsums.data() : nullptr;
  }
  std::vector<float> Out() const { return std::vector<float>(n_tokens * rows, 0.0f); }
};

using PanelParam = std::tuple<DType, int, int, int>;  // type, rows, cols, n_tokens

class PanelKernelTest : public ::testing::TestWithParam<PanelParam> {};

TEST_P(PanelKernelTest, VnniAndAmxEqualTheScalarExpressionBitForBit) {
  SKIP_WITHOUT_VNNI();
  const auto [type, rows, cols, n_tokens] = GetParam();
  const Case c(type, rows, cols, n_tokens, 7 + rows + cols + n_tokens);
  ASSERT_NE(c.packed, nullptr);

  std::vector<float> want = c.Out();
  internal::MatMulPanelsScalar(c.view, c.acts, n_tokens, 0, rows, want.data(), rows);

  std::vector<float> vnni = c.Out();
  internal::MatMulPanelsVnni(*c.packed, c.acts, n_tokens, 0, rows, vnni.data(), rows);
  EXPECT_EQ(FirstBitDifference(vnni, want), -1) << "VNNI panels";

  std::vector<float> emu = c.Out();
  internal::MatMulPanelsAmxEmulated(*c.packed, c.acts, n_tokens, 0, rows, emu.data(), rows);
  EXPECT_EQ(FirstBitDifference(emu, want), -1) << "AMX (emulated tiles)";

  if (UseAmx()) {
    std::vector<float> amx = c.Out();
    internal::MatMulPanelsAmx(*c.packed, c.acts, n_tokens, 0, rows, amx.data(), rows);
    EXPECT_EQ(FirstBitDifference(amx, want), -1) << "AMX (hardware tiles)";
  }

  // A row range that starts and ends inside panels writes only its rows.
  if (rows > 20) {
    const int64_t r0 = 5;
    const int64_t r1 = rows - 3;
    std::vector<float> part(n_tokens * rows, -1.0f);
    internal::MatMulPanelsAmxEmulated(*c.packed, c.acts, n_tokens, r0, r1, part.data(), rows);
    std::vector<float> part_vnni(n_tokens * rows, -1.0f);
    internal::MatMulPanelsVnni(*c.packed, c.acts, n_tokens, r0, r1, part_vnni.data(), rows);
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        const float expect = (r >= r0 && r < r1) ? want[t * rows + r] : -1.0f;
        ASSERT_EQ(std::memcmp(&part[t * rows + r], &expect, 4), 0) << "AMX t " << t << " r " << r;
        ASSERT_EQ(std::memcmp(&part_vnni[t * rows + r], &expect, 4), 0)
            << "VNNI t " << t << " r " << r;
      }
    }
  }
}

TEST_P(PanelKernelTest, PackedMatMulMatchesReference) {
  SKIP_WITHOUT_VNNI();
  const auto [type, rows, cols, n_tokens] = GetParam();
  const Case c(type, rows, cols, n_tokens, 100 + rows + cols + n_tokens);
  std::vector<float> want = c.Out();
  MatMulReference(c.view, c.x.data(), n_tokens, cols, want.data(), rows);
  for (AmxKernel k : {AmxKernel::kOff, AmxKernel::kEmulated, AmxKernel::kHardware}) {
    if (k == AmxKernel::kHardware && !UseAmx()) continue;
    ScopedAmxForTesting amx(k, /*min_tokens=*/1);
    std::vector<float> got = c.Out();
    MatMul(c.view, c.x.data(), n_tokens, cols, got.data(), rows, Pool());
    // Q4_K, Q5_K, Q6_K: Q8_K activations (one scale per 256 values) on random
    // blocks (Q4_K's mins cancel much of each dot). Q5_1 and IQ4_NL: random
    // blocks too, whose values are not shaped like the activations' (one
    // 32-value row measured 2.2e-4).
    const bool random_blocks = type == DType::kQ5_1 || type == DType::kIQ4_NL;
    EXPECT_LT(Nmse(got, want), internal::UsesQ8K(type) ? 1e-3 : (random_blocks ? 5e-4 : 2e-4))
        << "kernel " << static_cast<int>(k);
  }
}

std::string PanelName(const ::testing::TestParamInfo<PanelParam>& info) {
  const auto [type, rows, cols, n_tokens] = info.param;
  return std::string(DTypeName(type)) + "_" + std::to_string(rows) + "x" + std::to_string(cols) +
         "_t" + std::to_string(n_tokens);
}

std::vector<PanelParam> PanelParams() {
  std::vector<PanelParam> p;
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1,
                     DType::kIQ4_NL}) {
    for (auto [rows, cols] : {std::pair{1, 32}, std::pair{17, 64}, std::pair{37, 96},
                              std::pair{130, 576}, std::pair{51, 1536}, std::pair{77, 4160}}) {
      for (int n_tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 33, 64, 70}) {
        p.emplace_back(type, rows, cols, n_tokens);
      }
    }
  }
  // Q4_K: rows of whole 256-value super-blocks.
  for (auto [rows, cols] : {std::pair{1, 256}, std::pair{17, 512}, std::pair{37, 768},
                            std::pair{130, 2048}, std::pair{51, 1536}}) {
    for (int n_tokens : {1, 2, 3, 5, 8, 9, 16, 17, 33, 70}) {
      p.emplace_back(DType::kQ4_K, rows, cols, n_tokens);
      p.emplace_back(DType::kQ6_K, rows, cols, n_tokens);
      p.emplace_back(DType::kQ5_K, rows, cols, n_tokens);
      p.emplace_back(DType::kIQ4_XS, rows, cols, n_tokens);
      p.emplace_back(DType::kQ2_K, rows, cols, n_tokens);
      p.emplace_back(DType::kQ3_K, rows, cols, n_tokens);
    }
  }
  return p;
}

INSTANTIATE_TEST_SUITE_P(Shapes, PanelKernelTest, ::testing::ValuesIn(PanelParams()), PanelName);

// MatMulMany over stacked weights of odd heights (so the pool's row ranges
// start mid-panel) and mixed packed / unpacked types: the AMX route gives
// the VNNI route's bits at every batch size, the F16 weight is untouched.
TEST(PanelMatMulManyTest, AmxRouteEqualsVnniRouteBitForBit) {
  SKIP_WITHOUT_VNNI();
  constexpr int64_t kCols = 576;
  const DType types[] = {DType::kQ4_1, DType::kQ8_0, DType::kF16, DType::kQ4_0};
  const int64_t rows[] = {67, 19, 42, 45};
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::shared_ptr<const PackedWeight>> packs;
  std::vector<WeightView> views;
  for (int i = 0; i < 4; ++i) {
    data.push_back(Quantize(types[i], RandomFloats(rows[i] * kCols, 30 + i), rows[i], kCols));
    WeightView v{types[i], data.back().data(), rows[i], kCols};
    packs.push_back(PackWeight(v));
    EXPECT_EQ(packs.back() == nullptr, types[i] == DType::kF16);
    v.packed = packs.back().get();
    views.push_back(v);
  }
  for (int64_t n_tokens : {1, 7, 16, 32, 45}) {
    const auto x = RandomFloats(n_tokens * kCols, 5 + static_cast<uint32_t>(n_tokens));
    auto run = [&](AmxKernel k) {
      ScopedAmxForTesting amx(k, /*min_tokens=*/1);
      std::vector<std::vector<float>> y(4);
      float* ys[4];
      int64_t strides[4];
      for (int i = 0; i < 4; ++i) {
        y[i].assign(n_tokens * (rows[i] + 3), 0.0f);
        ys[i] = y[i].data();
        strides[i] = rows[i] + 3;
      }
      MatMulMany(views.data(), 4, x.data(), n_tokens, kCols, ys, strides, Pool());
      return y;
    };
    const auto vnni = run(AmxKernel::kOff);
    const auto emu = run(AmxKernel::kEmulated);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(FirstBitDifference(emu[i], vnni[i]), -1)
          << DTypeName(types[i]) << " n_tokens " << n_tokens << " (emulated AMX)";
    }
    if (UseAmx()) {
      const auto amx = run(AmxKernel::kHardware);
      for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(FirstBitDifference(amx[i], vnni[i]), -1)
            << DTypeName(types[i]) << " n_tokens " << n_tokens << " (hardware AMX)";
      }
    }
  }
}

// A row's output does not depend on the batch it came in: row t of a
// 40-token product equals the same token multiplied alone.
TEST(PanelMatMulManyTest, OutputsDoNotDependOnBatchSize) {
  SKIP_WITHOUT_VNNI();
  const Case c(DType::kQ4_1, 37, 576, 40, 77);
  ScopedAmxForTesting amx(AmxKernel::kEmulated, /*min_tokens=*/16);
  std::vector<float> all = c.Out();
  MatMul(c.view, c.x.data(), c.n_tokens, c.cols, all.data(), c.rows, Pool());
  for (int64_t t : {0, 17, 39}) {
    std::vector<float> one(c.rows);
    MatMul(c.view, c.x.data() + t * c.cols, 1, c.cols, one.data(), c.rows, Pool());
    EXPECT_EQ(std::memcmp(one.data(), all.data() + t * c.rows, c.rows * sizeof(float)), 0)
        << "token " << t;
  }
}

// Mean |error| of y against the same quantized product in double: exact
// block dots times the same scales (Q4_1's min term with its ggml s).
double MeanAbsErrorVsExact(const Case& c, const std::vector<float>& y) {
  const int64_t nb = c.cols / kQK;
  const int64_t row_bytes = RowBytes(c.type, c.cols);
  std::vector<float> deq(c.cols);
  double err = 0.0;
  for (int64_t r = 0; r < c.rows; ++r) {
    const uint8_t* row = c.q.data() + r * row_bytes;
    DequantizeRow(c.type, row, deq.data(), c.cols);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      const int8_t* xq = c.qs.data() + t * c.cols;
      const float* xds = c.ds.data() + t * 2 * nb;
      double s = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        double block = 0.0;
        if (c.type == DType::kQ4_1) {
          const BlockQ4_1& blk = reinterpret_cast<const BlockQ4_1*>(row)[b];
          for (int j = 0; j < kQK / 2; ++j) {
            block += static_cast<double>(blk.qs[j] & 0x0F) * xq[b * kQK + j] +
                     static_cast<double>(blk.qs[j] >> 4) * xq[b * kQK + j + kQK / 2];
          }
          s += block * Fp16ToFp32(blk.d) * xds[2 * b] +
               static_cast<double>(Fp16ToFp32(blk.m)) * xds[2 * b + 1];
        } else {
          for (int j = 0; j < kQK; ++j) block += static_cast<double>(deq[b * kQK + j]) * xq[b * kQK + j];
          s += block * xds[2 * b];
        }
      }
      err += std::fabs(y[t * c.rows + r] - s);
    }
  }
  return err / static_cast<double>(c.rows * c.n_tokens);
}

// The panel expression (exact block integers, signed for Q8_0/Q4_0, blocks
// accumulated in order) is at least as close to exact arithmetic on the
// same 8-bit activations as the row kernels it replaces for model weights;
// measured: Q4_1 4.8e-6 vs 8.8e-6, Q8_0 and Q4_0 3.5e-6 vs 1.1e-5 (|y| ~ 31).
// Q5_0's row kernel (the extended one) already forms signed block integers,
// so the two differ only in float rounding: 3.3e-6 vs 3.1e-6, allowed 1.25x.
// Q4_K: the panels sum a super-block's scaled dots and mins as integers and
// take two float steps per super-block (llama.cpp's order), the row kernel
// a float step per sub-block: 6.8e-6 vs 8.4e-6. (Per-sub-block float steps
// in the panels measured 1.6e-5, and moved Gemma 3's greedy outputs.)
TEST(PanelAccuracyTest, AtLeastAsCloseToExactArithmeticAsTheRowKernels) {
  SKIP_WITHOUT_VNNI();
  for (DType type :
       {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ4_K, DType::kQ5_K,
        DType::kQ6_K}) {
    const Case c(type, 256, 1536, 8, 1);
    std::vector<float> rows = c.Out();
    WeightView unpacked = c.view;
    unpacked.packed = nullptr;
    MatMul(unpacked, c.x.data(), c.n_tokens, c.cols, rows.data(), c.rows, nullptr);
    std::vector<float> panels = c.Out();
    MatMul(c.view, c.x.data(), c.n_tokens, c.cols, panels.data(), c.rows, nullptr);
    const double e_rows = MeanAbsErrorVsExact(c, rows);
    const double e_panels = MeanAbsErrorVsExact(c, panels);
    const double allowed = type == DType::kQ5_0 ? 1.25 : 1.0;
    EXPECT_LE(e_panels, allowed * e_rows) << DTypeName(type);
    EXPECT_LT(e_panels, 1e-5) << DTypeName(type);
  }
}

TEST(PackWeightTest, PacksOnlyQuantizedTypesAndReportsItsBytes) {
  SKIP_WITHOUT_VNNI();
  std::vector<uint16_t> f16(17 * 64, 0);
  EXPECT_EQ(PackWeight(WeightView{DType::kF16, f16.data(), 17, 64}), nullptr);
  const Case c(DType::kQ4_0, 17, 64, 1, 3);
  ASSERT_NE(c.packed, nullptr);
  // Two panels (17 rows), one pair of blocks each: 2 x 256 bytes of
  // nibbles, then 2 x 32 of d -- GGUF's 18 bytes a row-block, no padding.
  EXPECT_EQ(PackedBytes(*c.packed), 2 * 576);
  // Q5_0: per block the nibbles and 64 bytes of fifth bits, then the pair's
  // d (22 bytes a row-block).
  const Case c5(DType::kQ5_0, 17, 64, 1, 3);
  ASSERT_NE(c5.packed, nullptr);
  EXPECT_EQ(PackedBytes(*c5.packed), 2 * 704);
  // Q8_0 with 3 blocks a row: a full pair and a half-empty one per panel.
  const Case c8(DType::kQ8_0, 17, 96, 1, 3);
  ASSERT_NE(c8.packed, nullptr);
  EXPECT_EQ(PackedBytes(*c8.packed), 2 * 2 * 1088);
  // Q4_1: single blocks of nibbles, d and m (320 bytes, no padding).
  const Case c41(DType::kQ4_1, 17, 64, 1, 3);
  ASSERT_NE(c41.packed, nullptr);
  EXPECT_EQ(PackedBytes(*c41.packed), 2 * 2 * 320);
  // Q4_K: per super-block 8 x 256 bytes of nibbles, 8 x 32 of scales and
  // mins, 64 of d and dmin.
  const Case ck(DType::kQ4_K, 17, 512, 1, 3);
  ASSERT_NE(ck.packed, nullptr);
  EXPECT_EQ(PackedBytes(*ck.packed), 2 * 2 * 2368);
  // Q6_K: per super-block 8 x 384 bytes of nibbles and bit masks, 256 of
  // scales, 32 of d, padded to 3,392.
  const Case c6(DType::kQ6_K, 17, 512, 1, 3);
  ASSERT_NE(c6.packed, nullptr);
  EXPECT_EQ(PackedBytes(*c6.packed), 2 * 2 * 3392);
  // Q5_K: Q4_K's layout with 64 bytes of fifth bits after each sub-block's
  // nibbles.
  const Case c5k(DType::kQ5_K, 17, 512, 1, 3);
  ASSERT_NE(c5k.packed, nullptr);
  EXPECT_EQ(PackedBytes(*c5k.packed), 2 * 2 * 2880);
  {
    ScopedDisableAvx512ForTesting no_avx512;
    EXPECT_EQ(PackWeight(WeightView{DType::kQ4_0, c.q.data(), 17, 64}), nullptr);
  }
}

// Panels cut from a PanelArena (as a model loads them) are the same bytes
// as panels allocated one by one, at 64-byte aligned, non-overlapping
// places, and outlive the arena (each weight holds its chunk).
TEST(PanelArenaTest, PanelsEqualStandaloneOnesAndOutliveTheArena) {
  SKIP_WITHOUT_VNNI();
  std::vector<std::shared_ptr<const PackedWeight>> from_arena;
  std::vector<Case> cases;
  // ~49 MB of panels (Q8_0 of 4,096 x 1,024 is 4.6 MB): past one 32 MB
  // chunk, so the test also crosses a chunk boundary.
  cases.reserve(15);
  for (int i = 0; i < 15; ++i) {
    const DType t = i % 3 == 0 ? DType::kQ8_0 : (i % 3 == 1 ? DType::kQ5_0 : DType::kQ4_K);
    cases.emplace_back(t, 4096 + 16 * i + 1, 1024, 1, 40 + i);
  }
  {
    PanelArena arena;
    for (const Case& c : cases) {
      auto p = PackWeight(WeightView{c.type, c.q.data(), c.rows, c.cols}, &arena);
      ASSERT_NE(p, nullptr);
      from_arena.push_back(std::move(p));
    }
  }  // the arena goes; the weights keep their chunks
  for (size_t i = 0; i < cases.size(); ++i) {
    const PackedWeight& a = *from_arena[i];
    const PackedWeight& b = *cases[i].packed;
    ASSERT_EQ(PackedBytes(a), PackedBytes(b));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.storage.get()) % 64, 0u);
    EXPECT_EQ(0, std::memcmp(a.storage.get(), b.storage.get(), PackedBytes(a))) << i;
    for (size_t j = 0; j < i; ++j) {
      const uint8_t* lo = from_arena[j]->storage.get();
      const uint8_t* hi = lo + PackedBytes(*from_arena[j]);
      const uint8_t* p = a.storage.get();
      EXPECT_TRUE(p + PackedBytes(a) <= lo || p >= hi) << i << " overlaps " << j;
    }
  }
}

TEST(AmxDetectionTest, HardwareKernelRunsWhereTheCpuHasAmx) {
  if (!UseAmx()) {
    GTEST_SKIP() << "no usable AMX-INT8 here (CPU, OS permission or KVSERVE_DISABLE_AMX): "
                 << MatMulPathDescription();
  }
  EXPECT_EQ(ActiveAmxKernel(), AmxKernel::kHardware);
  EXPECT_NE(MatMulPathDescription().find("amx-int8"), std::string::npos);
}

}  // namespace
}  // namespace kvserve::kernels
