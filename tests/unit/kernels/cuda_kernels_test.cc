// CUDA kernels against the CPU reference (kernels/cpu plain loops), with
// normalized error thresholds (llama.cpp test-backend-ops style: NMSE =
// sum (got - want)^2 / sum want^2). Every GPU test skips with a message when
// no device is usable (build machines, CI); deploy/gpu-check.sh runs them on
// a real GPU. The build-without-CUDA checks run everywhere.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/matmul_internal.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention_generic.h"
#include "kernels/cuda/attention_mass.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/probe.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"

namespace kvserve {
namespace {

using kernels::KvDType;

double MaxAbsDiff(const std::vector<float>& got, const std::vector<float>& want) {
  double m = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return m;
}

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? num / den : num;
}

std::vector<float> RandomFloats(size_t n, uint32_t seed, float sigma = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// GPU tests: skip without a device; every buffer comes from one pool, which
// must have nothing lent out when the test ends.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status usable = cuda::CudaUsable();
    if (!usable.ok()) GTEST_SKIP() << "no usable CUDA device: " << usable.message();
    auto s = cuda::CudaStream::Create();
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = std::move(s).value();
    pool_ = std::make_unique<cuda::DeviceMemoryPool>();
  }
  void TearDown() override {
    if (pool_ == nullptr) return;
    EXPECT_TRUE(cuda::DeviceSynchronize().ok());
    buffers_.clear();
    EXPECT_EQ(pool_->live_buffers(), 0);
    EXPECT_EQ(pool_->bytes_in_use(), 0u);
    EXPECT_TRUE(pool_->Trim().ok());
    EXPECT_EQ(pool_->bytes_reserved(), 0u);
  }

  template <typename T>
  T* Upload(const std::vector<T>& v) {
    T* p = Alloc<T>(v.size());
    EXPECT_TRUE(cuda::CopyToDevice(p, v.data(), v.size() * sizeof(T)).ok());
    return p;
  }
  template <typename T>
  T* Alloc(size_t n) {
    auto b = pool_->Allocate(std::max<size_t>(1, n * sizeof(T)));
    EXPECT_TRUE(b.ok()) << b.status();
    T* p = b->template as<T>();
    buffers_.push_back(std::move(b).value());
    return p;
  }
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    EXPECT_TRUE(stream_.Synchronize().ok());
    std::vector<T> v(n);
    EXPECT_TRUE(cuda::CopyToHost(v.data(), p, n * sizeof(T)).ok());
    return v;
  }
  cuda::StreamHandle stream() const { return stream_.get(); }

  struct GotWant {
    std::vector<float> got, want;
  };
  // Random query rows (seq[i], pos[i]) of n_heads heads, and what
  // kernels::PagedAttentionReference makes of them over layer 1 of fixture
  // f (a PagedKvFixture), scaled by 1 / sqrt(head_dim), with `window`.
  struct ReferenceRows {
    std::vector<float> q, want;
    float scale;
    int64_t q_dim;
  };
  template <typename Fixture>
  ReferenceRows Reference(Fixture& f, const std::vector<int32_t>& seq,
                          const std::vector<int32_t>& pos, int32_t n_heads, int32_t window,
                          uint32_t q_seed) {
    const int32_t n = static_cast<int32_t>(seq.size());
    ReferenceRows r;
    r.q_dim = int64_t{n_heads} * f.head_dim;
    r.q = RandomFloats(n * r.q_dim, q_seed);
    r.scale = 1.f / std::sqrt(static_cast<float>(f.head_dim));
    kernels::AttentionBatch cb;
    cb.n_tokens = n;
    cb.token_seq = seq.data();
    cb.token_pos = pos.data();
    cb.n_heads = n_heads;
    cb.scale = r.scale;
    cb.window = window;
    r.want.resize(n * r.q_dim);
    kernels::PagedAttentionReference(f.HostView(), 1, cb, r.q.data(), r.q_dim, r.want.data(),
                                     r.q_dim);
    return r;
  }
  // The device rows a kernel call wrote to `out` (NaNs if it failed, which
  // is recorded as a test failure too).
  GotWant Compare(const absl::Status& s, const float* out, std::vector<float> want) {
    EXPECT_TRUE(s.ok()) << s;
    GotWant r;
    r.got = s.ok() ? Download(out, want.size()) : std::vector<float>(want.size(), NAN);
    r.want = std::move(want);
    return r;
  }

  // Rows (seq[i], pos[i]) through cuda::PagedDecodeAttention against the
  // reference (above).
  template <typename Fixture>
  GotWant DecodeVsReference(Fixture& f, const std::vector<int32_t>& seq,
                            const std::vector<int32_t>& pos, int32_t n_heads, int32_t window,
                            uint32_t q_seed) {
    ReferenceRows ref = Reference(f, seq, pos, n_heads, window, q_seed);
    const auto view = f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets));
    cuda::DecodeAttentionBatch b;
    b.n_tokens = static_cast<int32_t>(seq.size());
    b.token_seq = Upload(seq);
    b.token_pos = Upload(pos);
    b.n_heads = n_heads;
    b.scale = ref.scale;
    b.max_context = *std::max_element(f.lens.begin(), f.lens.end());
    b.window = window;
    const size_t ws_bytes = cuda::PagedDecodeAttentionWorkspaceBytes(view, b);
    void* ws = ws_bytes > 0 ? Alloc<uint8_t>(ws_bytes) : nullptr;
    float* out = Alloc<float>(ref.want.size());
    const absl::Status s = cuda::PagedDecodeAttention(view, 1, b, Upload(ref.q), ref.q_dim, out,
                                                      ref.q_dim, ws, ws_bytes, stream());
    return Compare(s, out, std::move(ref.want));
  }

  // Each sequence s of fixture f prefills its last chunk[s] positions (its
  // KV already holds them) through cuda::PagedPrefillAttention, against the
  // reference (above).
  template <typename Fixture>
  GotWant PrefillVsReference(Fixture& f, const std::vector<int32_t>& chunk, int32_t n_heads,
                             int32_t window, uint32_t q_seed) {
    std::vector<int32_t> seq, pos, q_offsets = {0};
    for (int32_t s = 0; s < static_cast<int32_t>(chunk.size()); ++s) {
      for (int32_t j = 0; j < chunk[s]; ++j) {
        seq.push_back(s);
        pos.push_back(f.lens[s] - chunk[s] + j);
      }
      q_offsets.push_back(q_offsets.back() + chunk[s]);
    }
    ReferenceRows ref = Reference(f, seq, pos, n_heads, window, q_seed);
    cuda::PrefillAttentionBatch b;
    b.q_seq_offsets = Upload(q_offsets);
    b.seq_lens = Upload(f.lens);
    b.max_q_per_seq = *std::max_element(chunk.begin(), chunk.end());
    b.n_heads = n_heads;
    b.scale = ref.scale;
    b.window = window;
    float* out = Alloc<float>(ref.want.size());
    const absl::Status s =
        cuda::PagedPrefillAttention(f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets)),
                                    1, b, Upload(ref.q), ref.q_dim, out, ref.q_dim, stream());
    return Compare(s, out, std::move(ref.want));
  }

  cuda::CudaStream stream_;
  std::unique_ptr<cuda::DeviceMemoryPool> pool_;
  std::vector<cuda::DeviceBuffer> buffers_;
};

// ---- availability (runs with and without CUDA, with and without a GPU) ----

TEST(CudaAvailabilityTest, UnusableCudaIsACleanUnavailable) {
  const absl::Status s = cuda::CudaUsable();
  if (!cuda::BuiltWithCuda()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(cuda::RmsNorm(nullptr, nullptr, 1, 1, 0.f, nullptr, nullptr).code(),
              absl::StatusCode::kUnavailable);
    cuda::DeviceMemoryPool pool;
    EXPECT_EQ(pool.Allocate(16).status().code(), absl::StatusCode::kUnavailable);
  }
  if (!s.ok()) {
    // No usable device is a count of zero, not a negative error code.
    EXPECT_EQ(cuda::UsableDeviceCount(), 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(cuda::ProbeBandwidth(1 << 20, 1).status().code(), absl::StatusCode::kUnavailable);
  } else {
    EXPECT_GT(cuda::UsableDeviceCount(), 0);
  }
}

// ---- memory pool ----

TEST_F(CudaTest, PoolReusesSpansAndLeaksNothing) {
  size_t free0 = 0, total = 0;
  ASSERT_TRUE(cuda::DeviceMemoryInfo(&free0, &total).ok());
  void* first = nullptr;
  {
    auto a = pool_->Allocate(1000);
    ASSERT_TRUE(a.ok());
    first = a->data();
    auto b = pool_->Allocate(3 << 20);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool_->live_buffers(), 2);
    EXPECT_GE(pool_->bytes_in_use(), size_t{(3 << 20) + 1000});
    cuda::DeviceBuffer moved = std::move(*b);
    EXPECT_EQ(pool_->live_buffers(), 2);
  }
  EXPECT_EQ(pool_->live_buffers(), 0);
  EXPECT_EQ(pool_->bytes_in_use(), 0u);
  auto again = pool_->Allocate(900);  // same 256-byte class: the cached span
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), first);
  again->Reset();
  ASSERT_TRUE(pool_->Trim().ok());
  EXPECT_EQ(pool_->bytes_reserved(), 0u);
  size_t free1 = 0;
  ASSERT_TRUE(cuda::DeviceMemoryInfo(&free1, &total).ok());
  EXPECT_GE(free1 + (2u << 20), free0);  // driver granularity slack only
}

TEST_F(CudaTest, PinnedBuffersAndEventsWork) {
  auto host = cuda::PinnedHostBuffer::Allocate(1 << 20);
  ASSERT_TRUE(host.ok());
  std::iota(host->as<uint8_t>(), host->as<uint8_t>() + (1 << 20), uint8_t{0});
  uint8_t* dev = Alloc<uint8_t>(1 << 20);
  auto e0 = cuda::CudaEvent::Create();
  auto e1 = cuda::CudaEvent::Create();
  ASSERT_TRUE(e0.ok() && e1.ok());
  ASSERT_TRUE(e0->Record(stream()).ok());
  ASSERT_TRUE(cuda::CopyToDeviceAsync(dev, host->data(), 1 << 20, stream()).ok());
  ASSERT_TRUE(e1->Record(stream()).ok());
  ASSERT_TRUE(e1->Synchronize().ok());
  auto ms = cuda::CudaEvent::ElapsedMs(*e0, *e1);
  ASSERT_TRUE(ms.ok());
  EXPECT_GE(*ms, 0.f);
  auto back = Download(dev, 1 << 20);
  EXPECT_EQ(0, std::memcmp(back.data(), host->data(), 1 << 20));
}

// ---- element-wise ----

TEST_F(CudaTest, EmbeddingGatherMatchesDequantizeRow) {
  const int64_t vocab = 50, dim = 128;
  const std::vector<int32_t> tokens = {0, 49, 7, 7, 23};
  const auto src = RandomFloats(vocab * dim, 1);
  for (kernels::DType type : {kernels::DType::kF32, kernels::DType::kF16, kernels::DType::kBF16,
                              kernels::DType::kQ8_0, kernels::DType::kQ4_0,
                              kernels::DType::kQ4_1}) {
    SCOPED_TRACE(kernels::DTypeName(type));
    const int64_t row_bytes = kernels::RowBytes(type, dim);
    std::vector<uint8_t> table(vocab * row_bytes);
    for (int64_t r = 0; r < vocab; ++r) {
      kernels::QuantizeRowReference(type, src.data() + r * dim, table.data() + r * row_bytes, dim);
    }
    std::vector<float> want(tokens.size() * dim);
    for (size_t t = 0; t < tokens.size(); ++t) {
      kernels::DequantizeRow(type, table.data() + tokens[t] * row_bytes, want.data() + t * dim,
                             dim);
    }
    float* out = Alloc<float>(want.size());
    ASSERT_TRUE(cuda::EmbeddingGather(type, Upload(table), vocab, dim, Upload(tokens),
                                      static_cast<int64_t>(tokens.size()), out, stream())
                    .ok());
    EXPECT_EQ(Download(out, want.size()), want);  // dequantization is exact
  }
}

TEST_F(CudaTest, RmsNormMatchesCpuReference) {
  for (int64_t n : {8, 64, 576, 4097}) {
    const int64_t rows = 5;
    const auto x = RandomFloats(rows * n, static_cast<uint32_t>(n));
    auto w = RandomFloats(n, 7, 0.1f);
    for (auto& v : w) v += 1.f;
    std::vector<float> want(rows * n);
    kernels::RmsNormReference(x.data(), w.data(), rows, n, 1e-5f, want.data());
    float* dx = Upload(x);
    ASSERT_TRUE(cuda::RmsNorm(dx, Upload(w), rows, n, 1e-5f, dx, stream()).ok());  // in place
    EXPECT_LT(Nmse(Download(dx, x.size()), want), 1e-12) << "n=" << n;
  }
}

TEST_F(CudaTest, RopeMatchesCpuInBothLayouts) {
  const int64_t n_tokens = 6;
  const std::vector<int32_t> pos = {0, 1, 17, 255, 4096, 32767};
  for (auto style : {kernels::RopeStyle::kNorm, kernels::RopeStyle::kNeox}) {
    for (int32_t hd : {64, 128}) {
      for (int32_t rot : {hd, hd / 2}) {
        const int32_t n_heads = 3;
        const int64_t stride = n_heads * hd + 4;  // rows with padding
        const kernels::RopeParams p{hd, rot, 10000.f, style};
        const auto x = RandomFloats(n_tokens * stride, 3);
        std::vector<float> fast = x, exact = x;
        for (int64_t t = 0; t < n_tokens; ++t) {
          kernels::Rope(fast.data() + t * stride, n_heads, pos[t], p);
          kernels::RopeReference(exact.data() + t * stride, n_heads, pos[t], p);
        }
        float* dx = Upload(x);
        ASSERT_TRUE(cuda::Rope(dx, n_tokens, stride, n_heads, Upload(pos), p, stream()).ok());
        const auto got = Download(dx, x.size());
        SCOPED_TRACE(testing::Message() << "style=" << static_cast<int>(style) << " hd=" << hd
                                        << " rot=" << rot);
        EXPECT_LT(Nmse(got, fast), 1e-10);   // same float angle recurrence
        EXPECT_LT(Nmse(got, exact), 1e-6);   // vs exact double angles
      }
    }
  }
}

TEST_F(CudaTest, SiluMulAndResidualAddMatchCpu) {
  for (int64_t n : {1, 7, 1024, 100003}) {
    const auto g = RandomFloats(n, 1), u = RandomFloats(n, 2);
    std::vector<float> want(n);
    kernels::SiluMulReference(g.data(), u.data(), n, want.data());
    float* dg = Upload(g);
    ASSERT_TRUE(cuda::SiluMul(dg, Upload(u), n, dg, stream()).ok());
    EXPECT_LT(Nmse(Download(dg, n), want), 1e-12);

    std::vector<float> x = g;
    for (int64_t i = 0; i < n; ++i) x[i] += u[i];
    float* dx = Upload(g);
    ASSERT_TRUE(cuda::AddInPlace(dx, Upload(u), n, stream()).ok());
    EXPECT_EQ(Download(dx, n), x);
    // Unaligned pointers take the scalar path.
    if (n > 1) {
      float* dx2 = Upload(g);
      ASSERT_TRUE(cuda::AddInPlace(dx2 + 1, Upload(u) + 1, n - 1, stream()).ok());
      EXPECT_EQ(Download(dx2, n)[n - 1], x[n - 1]);
    }
  }
}

// Llama 3's RoPE scaling: the divisors are a device array here, a host one
// for the CPU twin.
TEST_F(CudaTest, RopeWithFreqFactorsMatchesCpu) {
  const int64_t n_tokens = 4;
  const std::vector<int32_t> pos = {0, 3, 700, 9000};
  for (auto style : {kernels::RopeStyle::kNorm, kernels::RopeStyle::kNeox}) {
    const int32_t hd = 64, n_heads = 2;
    std::vector<float> factors(hd / 2);
    for (size_t i = 0; i < factors.size(); ++i) factors[i] = 1.0f + 0.25f * static_cast<float>(i);
    kernels::RopeParams p{hd, hd, 500000.f, style};
    p.freq_factors = factors.data();
    const auto x = RandomFloats(n_tokens * n_heads * hd, 4);
    std::vector<float> want = x, unscaled = x;
    kernels::RopeParams plain = p;
    plain.freq_factors = nullptr;
    for (int64_t t = 0; t < n_tokens; ++t) {
      kernels::Rope(want.data() + t * n_heads * hd, n_heads, pos[t], p);
      kernels::Rope(unscaled.data() + t * n_heads * hd, n_heads, pos[t], plain);
    }
    kernels::RopeParams dp = p;
    dp.freq_factors = Upload(factors);
    float* dx = Upload(x);
    ASSERT_TRUE(cuda::Rope(dx, n_tokens, n_heads * hd, n_heads, Upload(pos), dp, stream()).ok());
    const auto got = Download(dx, x.size());
    EXPECT_LT(Nmse(got, want), 1e-10) << "style=" << static_cast<int>(style);
    EXPECT_GT(Nmse(got, unscaled), 1e-3);  // the divisors were applied
  }
}

TEST_F(CudaTest, GeluBiasScaleAndSoftcapMatchCpu) {
  for (int64_t n : {1, 7, 1024, 100003}) {
    auto g = RandomFloats(n, 5, 4.f);
    if (n > 4) g[0] = -11.f, g[1] = 12.f, g[2] = -10.f, g[3] = 0.f;  // the exact tails
    const auto u = RandomFloats(n, 6);
    std::vector<float> want(n);
    kernels::GeluTanhMulReference(g.data(), u.data(), n, want.data());
    float* dg = Upload(g);
    ASSERT_TRUE(cuda::GeluTanhMul(dg, Upload(u), n, dg, stream()).ok());
    const auto got = Download(dg, n);
    // tanhf on the device and in the CPU's table may differ in a last bit,
    // which the f16 rounding of the GELU hides but for rare ties.
    int64_t equal = 0;
    for (int64_t i = 0; i < n; ++i) equal += got[i] == want[i];
    EXPECT_GE(equal, n - std::max<int64_t>(1, n / 1000)) << "n=" << n;
    EXPECT_LT(Nmse(got, want), 1e-9) << "n=" << n;
  }
  const int64_t rows = 3, width = 40;
  const auto x = RandomFloats(rows * width, 7), bias = RandomFloats(width, 8);
  std::vector<float> want = x;
  for (int64_t r = 0; r < rows; ++r) kernels::AddInPlace(want.data() + r * width, bias.data(), width);
  float* dx = Upload(x);
  ASSERT_TRUE(cuda::AddRowBias(dx, Upload(bias), rows, width, stream()).ok());
  EXPECT_EQ(Download(dx, x.size()), want);

  std::vector<float> scaled = x;
  for (float& v : scaled) v *= 25.3f;
  float* ds = Upload(x);
  ASSERT_TRUE(cuda::ScaleInPlace(ds, 25.3f, x.size(), stream()).ok());
  EXPECT_EQ(Download(ds, x.size()), scaled);

  std::vector<float> capped = scaled;
  for (float& v : capped) v = 30.f * std::tanh(v / 30.f);
  ASSERT_TRUE(cuda::SoftcapInPlace(ds, 30.f, x.size(), stream()).ok());
  EXPECT_LT(Nmse(Download(ds, x.size()), capped), 1e-12);
  EXPECT_FALSE(cuda::SoftcapInPlace(ds, 0.f, x.size(), stream()).ok());
}

TEST_F(CudaTest, ArgmaxPicksFirstMaximum) {
  const int64_t rows = 4, vocab = 49152, stride = vocab + 3;
  auto logits = RandomFloats(rows * stride, 9);
  logits[0 * stride + 100] = 50.f;
  logits[0 * stride + 40000] = 50.f;  // tie: the lower id wins
  logits[1 * stride + vocab - 1] = 60.f;
  logits[2 * stride + 5] = std::nanf("");  // NaN never wins
  std::vector<int32_t> want(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int32_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      const float v = logits[r * stride + i], b = logits[r * stride + best];
      if (v > b || std::isnan(b)) best = static_cast<int32_t>(i);
    }
    want[r] = best;
  }
  int32_t* ids = Alloc<int32_t>(rows);
  ASSERT_TRUE(cuda::ArgmaxRows(Upload(logits), rows, vocab, stride, ids, stream()).ok());
  EXPECT_EQ(Download(ids, rows), want);
}

// ---- paged KV ----

// A host pool and its device twin with the same shuffled CSR block table.
struct PagedKvFixture {
  int32_t n_layers = 2, n_kv_heads = 2, head_dim = 64, block_size = 16;
  KvDType dtype = KvDType::kF32;
  std::vector<int32_t> lens;  // KV length per sequence
  std::vector<int32_t> block_ids, offsets;
  std::vector<uint8_t> host;
  int64_t block_bytes = 0, layer_bytes = 0;
  int32_t n_blocks = 0;

  void Build(uint32_t seed) {
    layer_bytes = 2 * kernels::PagedKvView::HalfLayerBytes(block_size, n_kv_heads, head_dim, dtype);
    block_bytes = layer_bytes * n_layers;
    offsets = {0};
    for (int32_t len : lens) offsets.push_back(offsets.back() + (len + block_size - 1) / block_size);
    n_blocks = offsets.back() + 3;  // a few blocks nobody owns
    std::vector<int32_t> perm(n_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    block_ids.assign(perm.begin(), perm.begin() + offsets.back());
    host.assign(block_bytes * n_blocks, 0);
  }
  kernels::PagedKvView View(uint8_t* pool, const int32_t* ids, const int32_t* offs) const {
    kernels::PagedKvView v;
    v.pool = pool;
    v.block_bytes = block_bytes;
    v.layer_bytes = layer_bytes;
    v.block_size = block_size;
    v.n_kv_heads = n_kv_heads;
    v.head_dim = head_dim;
    v.dtype = dtype;
    v.block_ids = ids;
    v.seq_block_offsets = offs;
    v.n_seqs = static_cast<int32_t>(lens.size());
    return v;
  }
  kernels::PagedKvView HostView() { return View(host.data(), block_ids.data(), offsets.data()); }
  // Makes K and V of `pos` of sequence s in `layer` unreadable: data bytes
  // and row scales 0xFF (NaN for the float codecs and the scales), so a
  // kernel that reads a slot before a window returns NaN.
  void Poison(int32_t layer, int32_t s, int32_t pos) {
    const kernels::PagedKvView v = HostView();
    const int32_t block = block_ids[offsets[s] + pos / block_size];
    for (int32_t h = 0; h < n_kv_heads; ++h) {
      uint8_t* k = v.BlockHead(layer, block, h) + (pos % block_size) * v.RowBytes();
      std::memset(k, 0xFF, v.RowBytes());
      std::memset(k + layer_bytes / 2, 0xFF, v.RowBytes());
      const int64_t meta = kernels::KvRowMetaBytes(dtype, head_dim);
      if (meta > 0) {
        uint8_t* m = v.BlockHeadMeta(layer, block, h) + (pos % block_size) * meta;
        std::memset(m, 0xFF, meta);
        std::memset(m + layer_bytes / 2, 0xFF, meta);
      }
    }
  }
  // Every position of every sequence, appended on the CPU, in both layers.
  void FillOnCpu(uint32_t seed) {
    const int64_t w = int64_t{n_kv_heads} * head_dim;
    for (int32_t s = 0; s < static_cast<int32_t>(lens.size()); ++s) {
      std::vector<int32_t> seq(lens[s], s), pos(lens[s]);
      std::iota(pos.begin(), pos.end(), 0);
      for (int32_t l = 0; l < n_layers; ++l) {
        const auto k = RandomFloats(lens[s] * w, seed + 17 * s + l);
        const auto v = RandomFloats(lens[s] * w, seed + 31 * s + l + 1000);
        kernels::AppendKv(HostView(), l, lens[s], seq.data(), pos.data(), k.data(), w, v.data(), w);
      }
    }
  }
};

using KvParam = std::tuple<KvDType, int32_t, int32_t, int32_t>;  // dtype, block, head_dim, group

class CudaPagedKvTest : public CudaTest, public ::testing::WithParamInterface<KvParam> {
 protected:
  void SetUpKv(const std::vector<int32_t>& lens, uint32_t seed) {
    f_.dtype = std::get<0>(GetParam());
    f_.block_size = std::get<1>(GetParam());
    f_.head_dim = std::get<2>(GetParam());
    group_ = std::get<3>(GetParam());
    f_.lens = lens;
    f_.Build(seed);
  }
  kernels::PagedKvView DeviceView(uint8_t* pool) {
    return f_.View(pool, Upload(f_.block_ids), Upload(f_.offsets));
  }
  double Threshold() const {
    // f16 caches: f16 query and K/V, f32 probabilities on the GPU vs f16
    // probabilities in the reference.
    return f_.dtype == KvDType::kF16 ? 1e-5 : 1e-9;
  }
  // Quantized codecs with scales (int8, fp8, int4): the kernels dequantize
  // as they read, the reference dequantizes each row with the CPU codec, so
  // both see the same K/V (int4: an FMA on the GPU, multiply-add on the
  // CPU, one rounding apart). Besides the NMSE, the CPU attention tests'
  // bound for quantized caches (attention_test.cc: 5e-5 absolute) holds.
  void ExpectQuantizedBound(const std::vector<float>& got, const std::vector<float>& want) const {
    if (kernels::KvRowMetaBytes(f_.dtype, f_.head_dim) == 0) return;
    EXPECT_LT(MaxAbsDiff(got, want), 5e-5);
  }
  PagedKvFixture f_;
  int32_t group_ = 1;
};

TEST_P(CudaPagedKvTest, AppendKvIsByteIdenticalToCpu) {
  SetUpKv({1, 37, 70}, 5);
  const int64_t w = int64_t{f_.n_kv_heads} * f_.head_dim;
  std::vector<int32_t> seq, pos;
  for (int32_t s = 0; s < 3; ++s) {
    for (int32_t p = 0; p < f_.lens[s]; ++p) {
      seq.push_back(s);
      pos.push_back(p);
    }
  }
  const int32_t n = static_cast<int32_t>(seq.size());
  const int64_t stride = w + 8;
  auto k = RandomFloats(n * stride, 11), v = RandomFloats(n * stride, 12);
  // Rows that exercise the codecs' edge cases (the rest stay random): all
  // zeros (scale 0), a constant row (int4 range 0), tiny and large
  // magnitudes (f16 subnormal int4 scales), exact rounding ties (int8 with
  // scale 1: x.5; fp8 with scale 1: midpoints between codes; int4 with
  // scale 1 and minimum 0: x.5), each with both signs.
  const float fmt_max = f_.dtype == KvDType::kFp8E4M3   ? 448.f
                        : f_.dtype == KvDType::kFp8E5M2 ? 57344.f
                                                        : 127.f;
  for (int32_t t = 0; t < 8; ++t) {
    for (float* row : {&k[t * stride], &v[t * stride]}) {
      for (int64_t e = 0; e < w; ++e) {
        const int32_t i = static_cast<int32_t>(e % f_.head_dim);
        const float sign = (i % 3 == 2) ? -1.f : 1.f;
        float x = row[e];
        switch (t) {
          case 0: x = 0.f; break;
          case 1: x = 3.f; break;
          case 2: x *= 1e-6f; break;
          case 3: x *= 1e3f; break;
          case 4:  // int8 / fp8 ties at scale 1
            if (i == 0) {
              x = fmt_max;
            } else if (f_.dtype == KvDType::kFp8E4M3) {
              x = sign * (1.f + (2 * (i % 8) + 1) / 16.f);
            } else if (f_.dtype == KvDType::kFp8E5M2) {
              x = sign * (1.f + (2 * (i % 4) + 1) / 8.f);
            } else {
              x = sign * ((i % 20) + 0.5f);
            }
            break;
          case 5:  // int4 ties: every group spans [0, 15]
            x = i % 32 == 0 ? 0.f : (i % 32 == 1 ? 15.f : (i % 15) + 0.5f);
            break;
          case 6: x = sign * 1e-30f * (i + 1); break;  // underflows every scale
          default: break;
        }
        row[e] = x;
      }
    }
  }
  kernels::AppendKv(f_.HostView(), 1, n, seq.data(), pos.data(), k.data(), stride, v.data(),
                    stride);
  uint8_t* dpool = Upload(std::vector<uint8_t>(f_.host.size(), 0));
  ASSERT_TRUE(cuda::AppendKv(DeviceView(dpool), 1, n, Upload(seq), Upload(pos), Upload(k), stride,
                             Upload(v), stride, stream())
                  .ok());
  EXPECT_TRUE(Download(dpool, f_.host.size()) == f_.host);
}

TEST_P(CudaPagedKvTest, DecodeAttentionMatchesReference) {
  // Ragged, including one context long enough to be split over CTAs.
  SetUpKv({1, 5, 37, 300, 2500}, 21);
  f_.FillOnCpu(3);
  const int32_t n_heads = f_.n_kv_heads * group_;
  // The last token of each sequence, plus a few earlier ones (any ragged
  // batch is valid input).
  std::vector<int32_t> seq, pos;
  for (int32_t s = 0; s < static_cast<int32_t>(f_.lens.size()); ++s) {
    seq.push_back(s);
    pos.push_back(f_.lens[s] - 1);
    if (f_.lens[s] > 3) {
      seq.push_back(s);
      pos.push_back(f_.lens[s] / 3);
    }
  }
  const auto [got, want] = DecodeVsReference(f_, seq, pos, n_heads, 0, 8);
  EXPECT_LT(Nmse(got, want), Threshold());
  ExpectQuantizedBound(got, want);
}

// Sliding windows in the decode kernel: a window inside one split, and one
// spanning several splits of a 2,500-position context. The slots before
// every query's window are poisoned in layer 1, so reading one gives NaN.
TEST_P(CudaPagedKvTest, DecodeAttentionHonoursTheWindow) {
  for (int32_t window : {1, 100, 1000}) {
    SetUpKv({1, 5, 37, 300, 2500}, 23);
    f_.FillOnCpu(5);
    std::vector<int32_t> seq, pos;
    for (int32_t s = 0; s < static_cast<int32_t>(f_.lens.size()); ++s) {
      seq.push_back(s);
      pos.push_back(f_.lens[s] - 1);
      for (int32_t p = 0; p < f_.lens[s] - window; ++p) f_.Poison(1, s, p);
    }
    const auto [got, want] = DecodeVsReference(f_, seq, pos, f_.n_kv_heads * group_, window, 9);
    SCOPED_TRACE(testing::Message() << "window=" << window);
    for (float v : got) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(Nmse(got, want), Threshold());
    ExpectQuantizedBound(got, want);
  }
}

// Per sequence: KV length after the chunk, and the chunk's query rows;
// causal over everything (window 0) and with windows of 1 and 50, whose
// query tiles start their rows' windows at different keys (the slots before
// every row's window poisoned, as above).
TEST_P(CudaPagedKvTest, PrefillAttentionMatchesReference) {
  for (int32_t window : {0, 1, 50}) {
    SetUpKv({1, 40, 64, 300}, 33);
    const std::vector<int32_t> chunk = {1, 17, 64, 100};
    f_.FillOnCpu(4);
    if (window > 0) {
      for (int32_t s = 0; s < 4; ++s) {
        const int32_t first = f_.lens[s] - chunk[s];  // the chunk's first position
        for (int32_t p = 0; p < first - window + 1; ++p) f_.Poison(1, s, p);
      }
    }
    const auto [got, want] = PrefillVsReference(f_, chunk, f_.n_kv_heads * group_, window, 18);
    SCOPED_TRACE(testing::Message() << "window=" << window);
    for (float v : got) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(Nmse(got, want), Threshold());
    ExpectQuantizedBound(got, want);
  }
}

// H2O statistics: the device mass equals the plain-loop reference's, for
// a ragged batch with several query rows per sequence (prefill and decode
// rows mixed), added on top of what the rows already hold, with one
// sequence not asked for (its row must stay untouched).
TEST_P(CudaPagedKvTest, AttentionMassMatchesReference) {
  SetUpKv({1, 40, 300, 90}, 51);
  f_.FillOnCpu(6);
  const int32_t n_heads = f_.n_kv_heads * group_;
  const int64_t q_dim = int64_t{n_heads} * f_.head_dim;
  const int32_t n_seqs = static_cast<int32_t>(f_.lens.size());
  std::vector<int32_t> seq, pos;
  for (int32_t s = 0; s < n_seqs; ++s) {
    const int32_t rows = std::min(f_.lens[s], s == 1 ? 9 : 2);
    for (int32_t j = 0; j < rows; ++j) {
      seq.push_back(s);
      pos.push_back(f_.lens[s] - rows + j);
    }
  }
  seq.push_back(0);  // a second, separate run of sequence 0
  pos.push_back(0);
  const int32_t n = static_cast<int32_t>(seq.size());
  const auto q = RandomFloats(n * q_dim, 19);
  const int64_t stride = 301;  // > every position
  const std::vector<uint8_t> wanted = {1, 1, 1, 0};
  const std::vector<int32_t> wanted_ints(wanted.begin(), wanted.end());
  std::vector<float> want(static_cast<size_t>(n_seqs) * f_.n_kv_heads * stride);
  for (size_t i = 0; i < want.size(); ++i) want[i] = 0.25f * static_cast<float>(i % 7);
  const std::vector<float> before = want;
  kernels::AttentionBatch cb;
  cb.n_tokens = n;
  cb.token_seq = seq.data();
  cb.token_pos = pos.data();
  cb.n_heads = n_heads;
  cb.scale = 1.f / std::sqrt(static_cast<float>(f_.head_dim));
  kernels::AccumulateAttentionMass(f_.HostView(), 1, cb, q.data(), q_dim, want.data(), stride,
                                   wanted.data());

  float* mass = Upload(before);
  ASSERT_TRUE(cuda::AccumulateAttentionMass(DeviceView(Upload(f_.host)), 1, n, Upload(seq),
                                            Upload(pos), n_heads, cb.scale, Upload(q), q_dim,
                                            Upload(wanted_ints), mass, stride, stream())
                  .ok());
  const auto got = Download(mass, want.size());
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) /
                                (1.0 + std::abs(static_cast<double>(want[i]))));
  }
  // f32 scores and exponentials against double ones; f16 and the quantized
  // codecs read the same dequantized K as the reference.
  EXPECT_LT(worst, 2e-5);
  // The unwanted sequence's rows are exactly what they were.
  const int64_t row0 = int64_t{3} * f_.n_kv_heads * stride;
  for (int64_t i = row0; i < static_cast<int64_t>(want.size()); ++i) {
    ASSERT_EQ(got[i], before[i]) << "slot " << i - row0 << " of an unwanted sequence";
  }
  // Every (token, head) adds one distribution: a wanted row gains exactly
  // its sequence's token count times the group size.
  for (int32_t s = 0; s < 3; ++s) {
    const int32_t tokens = static_cast<int32_t>(std::count(seq.begin(), seq.end(), s));
    double gained = 0.0;
    for (int32_t h = 0; h < f_.n_kv_heads; ++h) {
      for (int64_t p = 0; p < stride; ++p) {
        const size_t i = (static_cast<size_t>(s) * f_.n_kv_heads + h) * stride + p;
        gained += static_cast<double>(got[i]) - before[i];
      }
    }
    EXPECT_NEAR(gained, static_cast<double>(tokens) * n_heads, 1e-3) << "sequence " << s;
  }
}

// Compaction: the device moves the same bytes as the CPU twin, including
// moves whose source an earlier move's destination precedes within a block.
TEST_P(CudaPagedKvTest, MoveKvRowsIsByteIdenticalToCpu) {
  SetUpKv({70, 53}, 61);
  f_.FillOnCpu(9);
  // Keep 4 sinks, every third slot of the middle, and the last 10: a kept
  // slot list as the h2o evictor makes it (ascending, keep[i] >= i).
  std::vector<int32_t> keep;
  for (int32_t p = 0; p < 53; ++p) {
    if (p < 4 || p % 3 == 0 || p >= 43) keep.push_back(p);
  }
  std::vector<int32_t> from, to;
  for (int32_t i = 0; i < static_cast<int32_t>(keep.size()); ++i) {
    if (keep[i] != i) {
      from.push_back(keep[i]);
      to.push_back(i);
    }
  }
  ASSERT_FALSE(from.empty());
  uint8_t* dpool = Upload(f_.host);
  kernels::MoveKvRows(f_.HostView(), f_.n_layers, 1, from.data(), to.data(),
                      static_cast<int32_t>(from.size()));
  ASSERT_TRUE(cuda::MoveKvRows(DeviceView(dpool), f_.n_layers, 1, Upload(from), Upload(to),
                               static_cast<int32_t>(from.size()), stream())
                  .ok());
  EXPECT_TRUE(Download(dpool, f_.host.size()) == f_.host);
}

TEST_F(CudaTest, AttentionMassRejectsBadShapes) {
  PagedKvFixture f;
  f.head_dim = 12;  // not a multiple of 8
  f.lens = {4};
  f.Build(1);
  const auto view = f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets));
  std::vector<int32_t> seq = {0}, pos = {3};
  float* mass = Alloc<float>(64);
  const auto q = RandomFloats(4 * 12, 2);
  const absl::Status s = cuda::AccumulateAttentionMass(
      view, 0, 1, Upload(seq), Upload(pos), 4, 1.f, Upload(q), 48, nullptr, mass, 16, stream());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("head_dim 12"), std::string::npos) << s;
}

TEST_P(CudaPagedKvTest, BlockCopyGatherAndScatterMoveBytesExactly) {
  SetUpKv({40, 40}, 44);
  f_.FillOnCpu(5);
  uint8_t* dpool = Upload(f_.host);
  // Copy-on-write: the first blocks of sequence 0 onto the spare blocks.
  std::vector<int32_t> all(f_.n_blocks);
  std::iota(all.begin(), all.end(), 0);
  std::vector<int32_t> used(f_.block_ids);
  std::vector<int32_t> spares;
  for (int32_t b : all) {
    if (std::find(used.begin(), used.end(), b) == used.end()) spares.push_back(b);
  }
  ASSERT_EQ(spares.size(), 3u);
  const std::vector<int32_t> src = {f_.block_ids[0], f_.block_ids[1], f_.block_ids[2]};
  ASSERT_TRUE(cuda::CopyBlocks(dpool, f_.block_bytes, Upload(src), Upload(spares), 3, stream()).ok());
  std::vector<uint8_t> want = f_.host;
  for (int i = 0; i < 3; ++i) {
    std::memcpy(want.data() + spares[i] * f_.block_bytes, f_.host.data() + src[i] * f_.block_bytes,
                f_.block_bytes);
  }
  EXPECT_TRUE(Download(dpool, want.size()) == want);

  // Tier round trip through pinned memory: gather (runs 2,3,4 coalesce).
  const std::vector<int32_t> ids = {2, 3, 4, f_.n_blocks - 1, 0};
  auto pinned = cuda::PinnedHostBuffer::Allocate(ids.size() * f_.block_bytes);
  ASSERT_TRUE(pinned.ok());
  ASSERT_TRUE(cuda::GatherBlocksToHost(dpool, f_.block_bytes, ids.data(),
                                       static_cast<int32_t>(ids.size()), pinned->data(), stream())
                  .ok());
  ASSERT_TRUE(stream_.Synchronize().ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(pinned->as<uint8_t>() + i * f_.block_bytes,
                             want.data() + ids[i] * f_.block_bytes, f_.block_bytes));
  }
  // Scatter them back in reverse order of blocks.
  const std::vector<int32_t> back = {0, f_.n_blocks - 1, 4, 3, 2};
  ASSERT_TRUE(cuda::ScatterBlocksFromHost(pinned->data(), f_.block_bytes, back.data(),
                                          static_cast<int32_t>(back.size()), dpool, stream())
                  .ok());
  std::vector<uint8_t> want2 = want;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::memcpy(want2.data() + back[i] * f_.block_bytes, want.data() + ids[i] * f_.block_bytes,
                f_.block_bytes);
  }
  EXPECT_TRUE(Download(dpool, want2.size()) == want2);
}

std::string KvParamName(const ::testing::TestParamInfo<KvParam>& info) {
  std::string name(kernels::KvDTypeName(std::get<0>(info.param)));
  std::replace(name.begin(), name.end(), '-', '_');  // fp8-e4m3 -> fp8_e4m3
  return absl::StrCat(name, "_b",
                      std::get<1>(info.param), "_d", std::get<2>(info.param), "_g",
                      std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    DTypeBlockHeadDimGroup, CudaPagedKvTest,
    ::testing::Combine(::testing::Values(KvDType::kF32, KvDType::kF16, KvDType::kBF16),
                       ::testing::Values(8, 16, 32), ::testing::Values(64, 128),
                       ::testing::Values(1, 4, 8)),
    KvParamName);

// Quantized caches (quantize on append, dequantize inside attention).
INSTANTIATE_TEST_SUITE_P(
    QuantDTypeBlockHeadDimGroup, CudaPagedKvTest,
    ::testing::Combine(::testing::Values(KvDType::kInt8, KvDType::kFp8E4M3, KvDType::kFp8E5M2,
                                         KvDType::kInt4, KvDType::kInt4G64),
                       ::testing::Values(8, 32), ::testing::Values(64, 128),
                       ::testing::Values(1, 8)),
    KvParamName);

// More query heads per KV head than one CTA takes (two head tiles).
INSTANTIATE_TEST_SUITE_P(WideGroup, CudaPagedKvTest,
                         ::testing::Values(KvParam{KvDType::kF16, 16, 64, 12},
                                           KvParam{KvDType::kF32, 32, 128, 3},
                                           KvParam{KvDType::kInt4, 16, 128, 12},
                                           KvParam{KvDType::kFp8E4M3, 16, 64, 3}),
                         KvParamName);

// The generic kernel (head dims without a tuned kernel, and every windowed
// layer whose window masks) with sliding windows, against the CPU
// reference. The slots before each window are poisoned (NaN) in layer 1:
// a kernel that read one would return NaN.
TEST_F(CudaTest, GenericAttentionHonoursTheWindow) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16}) {
    for (int32_t hd : {8, 64, 256}) {
      for (int32_t window : {0, 7, 16, 1000}) {
        PagedKvFixture f;
        f.dtype = dtype;
        f.head_dim = hd;
        f.n_kv_heads = 1;
        f.lens = {1, 5, 37, 300};
        f.Build(31);
        f.FillOnCpu(9);
        const kernels::PagedKvView host = f.HostView();
        std::vector<int32_t> seq, pos;
        for (int32_t s = 0; s < static_cast<int32_t>(f.lens.size()); ++s) {
          seq.push_back(s);
          pos.push_back(f.lens[s] - 1);
          if (window == 0) continue;
          for (int32_t p = 0; p < f.lens[s] - window; ++p) {  // before the window
            uint8_t* k = host.BlockHead(1, f.block_ids[f.offsets[s] + p / f.block_size], 0) +
                         (p % f.block_size) * host.RowBytes();
            std::memset(k, 0xFF, host.RowBytes());
            std::memset(k + host.layer_bytes / 2, 0xFF, host.RowBytes());
          }
        }
        const int32_t n = static_cast<int32_t>(seq.size()), n_heads = 4;
        const int64_t q_dim = int64_t{n_heads} * hd;
        const auto q = RandomFloats(n * q_dim, 12);
        kernels::AttentionBatch cb;
        cb.n_tokens = n;
        cb.token_seq = seq.data();
        cb.token_pos = pos.data();
        cb.n_heads = n_heads;
        cb.scale = 1.f / std::sqrt(static_cast<float>(hd));
        cb.window = window;
        std::vector<float> want(n * q_dim);
        kernels::PagedAttentionReference(host, 1, cb, q.data(), q_dim, want.data(), q_dim);
        const auto view = f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets));
        float* out = Alloc<float>(want.size());
        ASSERT_TRUE(cuda::PagedAttentionGeneric(view, 1, n, Upload(seq), Upload(pos), n_heads,
                                                cb.scale, Upload(q), q_dim, out, q_dim, window,
                                                stream())
                        .ok());
        const auto got = Download(out, want.size());
        SCOPED_TRACE(testing::Message() << KvDTypeName(dtype) << " hd=" << hd << " window=" << window);
        for (float v : got) ASSERT_TRUE(std::isfinite(v));
        EXPECT_LT(Nmse(got, want), dtype == KvDType::kF16 ? 1e-5 : 1e-9);
      }
    }
  }
  PagedKvFixture f;
  f.lens = {4};
  f.Build(1);
  const auto view = f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets));
  const std::vector<int32_t> zero = {0};
  EXPECT_FALSE(cuda::PagedAttentionGeneric(view, 0, 1, Upload(zero), Upload(zero), 2, 1.f,
                                           Alloc<float>(128), 128, Alloc<float>(128), 128, -1,
                                           stream())
                   .ok());
}

// Gemma 3's 256-wide heads on the decode kernel (every codec with 8-element
// loads; f32 is refused by name), ragged, split and windowed, against the
// reference; the slots before each window are poisoned.
// The prefill kernel at Gemma 3's 256-wide heads, which it stages 128
// channels at a time (K chunks, softmax, V chunks): every codec, f32
// included, causal and windowed (the slots before every row's window
// poisoned), one KV head under four query heads.
TEST_F(CudaTest, PrefillAttentionRuns256WideHeads) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kInt8,
                        KvDType::kFp8E4M3, KvDType::kInt4, KvDType::kInt4G64}) {
    for (int32_t window : {0, 1, 50}) {
      PagedKvFixture f;
      f.dtype = dtype;
      f.head_dim = 256;
      f.n_kv_heads = 1;
      f.block_size = 16;
      f.lens = {1, 40, 64, 300};
      f.Build(43);
      f.FillOnCpu(12);
      const std::vector<int32_t> chunk = {1, 17, 64, 100};
      if (window > 0) {
        for (int32_t s = 0; s < 4; ++s) {
          for (int32_t p = 0; p < f.lens[s] - chunk[s] - window + 1; ++p) f.Poison(1, s, p);
        }
      }
      const auto [got, want] = PrefillVsReference(f, chunk, 4, window, 19);
      SCOPED_TRACE(testing::Message() << KvDTypeName(dtype) << " window=" << window);
      for (float v : got) ASSERT_TRUE(std::isfinite(v));
      EXPECT_LT(Nmse(got, want), dtype == KvDType::kF16 ? 1e-5 : 1e-9);
      if (kernels::KvRowMetaBytes(dtype, 256) > 0) {
        EXPECT_LT(MaxAbsDiff(got, want), 5e-5);
      }
    }
  }
}

TEST_F(CudaTest, DecodeAttentionRuns256WideHeads) {
  for (KvDType dtype : {KvDType::kF16, KvDType::kBF16, KvDType::kInt8, KvDType::kFp8E4M3,
                        KvDType::kInt4, KvDType::kInt4G64}) {
    for (int32_t window : {0, 100}) {
      PagedKvFixture f;
      f.dtype = dtype;
      f.head_dim = 256;
      f.n_kv_heads = 1;
      f.block_size = 16;
      f.lens = {1, 37, 700};
      f.Build(41);
      f.FillOnCpu(11);
      std::vector<int32_t> seq, pos;
      for (int32_t s = 0; s < static_cast<int32_t>(f.lens.size()); ++s) {
        seq.push_back(s);
        pos.push_back(f.lens[s] - 1);
        if (f.lens[s] > 3) {  // an earlier row too: any ragged batch
          seq.push_back(s);
          pos.push_back(f.lens[s] / 3);
        }
        if (window > 0) {
          // Poison only what no row of this sequence sees.
          for (int32_t p = 0; p < std::min(f.lens[s], f.lens[s] / 3 + 1) - window; ++p) {
            f.Poison(1, s, p);
          }
        }
      }
      const auto [got, want] = DecodeVsReference(f, seq, pos, 4, window, 13);
      SCOPED_TRACE(testing::Message() << KvDTypeName(dtype) << " window=" << window);
      for (float v : got) ASSERT_TRUE(std::isfinite(v));
      EXPECT_LT(Nmse(got, want), dtype == KvDType::kF16 ? 1e-5 : 1e-9);
      if (kernels::KvRowMetaBytes(dtype, 256) > 0) {
        EXPECT_LT(MaxAbsDiff(got, want), 5e-5);
      }
    }
  }
  PagedKvFixture f;
  f.head_dim = 256;
  f.n_kv_heads = 1;
  f.lens = {4};
  f.Build(1);
  const std::vector<int32_t> zero = {3};
  cuda::DecodeAttentionBatch b;
  b.n_tokens = 1;
  b.token_seq = Upload(std::vector<int32_t>{0});
  b.token_pos = Upload(zero);
  b.n_heads = 1;
  b.max_context = 4;
  const absl::Status s =
      cuda::PagedDecodeAttention(f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets)),
                                 0, b, Alloc<float>(256), 256, Alloc<float>(256), 256, nullptr, 0,
                                 stream());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("f32"), std::string::npos) << s;
}

// Append takes any head dim (attention takes 64 and 128): int4 rows with a
// partial last group and an odd channel count (the last byte's high nibble
// stays zero), byte codecs with an odd row length.
TEST_F(CudaTest, AppendKvQuantizesOddHeadDimsLikeCpu) {
  for (KvDType dtype : {KvDType::kInt8, KvDType::kFp8E4M3, KvDType::kFp8E5M2, KvDType::kInt4,
                        KvDType::kInt4G64}) {
    for (int32_t hd : {9, 40, 72}) {
      PagedKvFixture f;
      f.dtype = dtype;
      f.head_dim = hd;
      f.n_kv_heads = 3;
      f.block_size = 4;
      f.lens = {11, 6};
      f.Build(7);
      const int64_t w = int64_t{f.n_kv_heads} * hd;
      std::vector<int32_t> seq, pos;
      for (int32_t s = 0; s < 2; ++s) {
        for (int32_t p = 0; p < f.lens[s]; ++p) {
          seq.push_back(s);
          pos.push_back(p);
        }
      }
      const int32_t n = static_cast<int32_t>(seq.size());
      const auto k = RandomFloats(n * w, 70 + hd, 3.f), v = RandomFloats(n * w, 71 + hd, 0.1f);
      kernels::AppendKv(f.HostView(), 0, n, seq.data(), pos.data(), k.data(), w, v.data(), w);
      uint8_t* dpool = Upload(std::vector<uint8_t>(f.host.size(), 0));
      ASSERT_TRUE(cuda::AppendKv(f.View(dpool, Upload(f.block_ids), Upload(f.offsets)), 0, n,
                                 Upload(seq), Upload(pos), Upload(k), w, Upload(v), w, stream())
                      .ok());
      EXPECT_TRUE(Download(dpool, f.host.size()) == f.host)
          << kernels::KvDTypeName(dtype) << " head_dim " << hd;
    }
  }
}

TEST_F(CudaTest, UnsupportedKvDTypeIsUnimplemented) {
  PagedKvFixture f;
  f.dtype = KvDType::kInt4Kivi;  // per-channel keys: CPU only for now
  f.lens = {4};
  f.Build(1);
  auto view = f.View(Upload(f.host), Upload(f.block_ids), Upload(f.offsets));
  cuda::DecodeAttentionBatch b;
  b.n_tokens = 1;
  b.n_heads = 2;
  b.max_context = 4;
  EXPECT_EQ(cuda::PagedDecodeAttention(view, 0, b, nullptr, 0, nullptr, 0, nullptr, 0, stream())
                .code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cuda::AppendKv(view, 0, 1, nullptr, nullptr, nullptr, 0, nullptr, 0, stream()).code(),
            absl::StatusCode::kUnimplemented);
}

// ---- matmul ----

TEST_F(CudaTest, CublasMatMulMatchesReferenceForEveryWeightType) {
  auto mm = cuda::CublasMatMul::Create(pool_.get(), stream());
  ASSERT_TRUE(mm.ok()) << mm.status();
  const int64_t rows = 96, cols = 256;
  const auto wsrc = RandomFloats(rows * cols, 5, 0.05f);
  struct Case {
    kernels::DType type;
    cuda::WeightFormat format;
    double nmse;
  };
  for (const Case& c : {Case{kernels::DType::kF32, cuda::WeightFormat::kF32, 1e-10},
                        Case{kernels::DType::kF16, cuda::WeightFormat::kF16, 1e-5},
                        Case{kernels::DType::kBF16, cuda::WeightFormat::kBF16, 1e-4},
                        Case{kernels::DType::kQ8_0, cuda::WeightFormat::kF16, 1e-5},
                        Case{kernels::DType::kQ4_1, cuda::WeightFormat::kF16, 1e-5},
                        // Native: activations quantized to 8 bits as on the CPU.
                        Case{kernels::DType::kQ8_0, cuda::WeightFormat::kNative, 1e-4},
                        Case{kernels::DType::kQ4_0, cuda::WeightFormat::kNative, 1e-4},
                        Case{kernels::DType::kQ4_1, cuda::WeightFormat::kNative, 1e-4}}) {
    SCOPED_TRACE(kernels::DTypeName(c.type));
    std::vector<uint8_t> wbytes(rows * kernels::RowBytes(c.type, cols));
    for (int64_t r = 0; r < rows; ++r) {
      kernels::QuantizeRowReference(c.type, wsrc.data() + r * cols,
                                    wbytes.data() + r * kernels::RowBytes(c.type, cols), cols);
    }
    const kernels::WeightView wv{c.type, wbytes.data(), rows, cols};
    auto dw = cuda::UploadWeight(wv, c.format, pool_.get(), stream());
    ASSERT_TRUE(dw.ok()) << dw.status();
    for (int64_t n_tokens : {1, 7}) {
      const int64_t x_stride = cols + 4, y_stride = rows + 2;
      const auto x = RandomFloats(n_tokens * x_stride, 6);
      std::vector<float> want(n_tokens * y_stride, 0.f);
      kernels::MatMulReference(wv, x.data(), n_tokens, x_stride, want.data(), y_stride);
      float* y = Upload(std::vector<float>(want.size(), 0.f));
      ASSERT_TRUE((*mm)->MatMul(*dw, Upload(x), n_tokens, x_stride, y, y_stride).ok());
      EXPECT_LT(Nmse(Download(y, want.size()), want), c.nmse) << n_tokens << " tokens";
    }
  }
}

// Activations with the awkward cases of 8-bit block quantization, one kind
// per 32-element block: exact ties of x * 127 / amax (round-half-even),
// zeros and all-zero blocks, a negative amax, fp16-subnormal and fp16-zero
// scales, large magnitudes, and plain random blocks at several scales.
// `large` scales the large blocks (2e5 overflows Q8_1's fp16 sum term, as
// it does on the CPU).
std::vector<float> AwkwardActivations(int64_t n_tokens, int64_t x_stride, int64_t cols,
                                      uint32_t seed, float large = 2e5f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> small(-126, 126);
  std::vector<float> x(static_cast<size_t>(n_tokens * x_stride), 12345.f);  // padding
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      float* xb = x.data() + t * x_stride + b * 32;
      const int kind = static_cast<int>((b + t) % 9);
      for (int j = 0; j < 32; ++j) {
        float v = normal(rng);
        switch (kind) {
          case 0:  // amax 127 -> inv 1: halves are exact ties
            v = j == 0 ? 127.f : static_cast<float>(small(rng)) + 0.5f;
            break;
          case 1:  // amax 254 -> inv 0.5: odd integers are ties
            v = j == 5 ? -254.f : static_cast<float>(2 * small(rng) + 1);
            break;
          case 2:  // all zero, with signed zeros
            v = j % 2 ? 0.f : -0.f;
            break;
          case 3:  // some zeros, negative amax
            v = j % 3 == 0 ? 0.f : (j == 7 ? -40.f : v);
            break;
          case 4:  // d is an fp16 subnormal
            v *= 1e-3f;
            break;
          case 5:  // d rounds to fp16 zero
            v *= 1e-20f;
            break;
          case 6:  // large
            v *= large;
            break;
          case 7:
            v *= 1e-2f;
            break;
          default:
            break;
        }
        xb[j] = v;
      }
    }
  }
  return x;
}

TEST_F(CudaTest, QuantizeActsIsBitIdenticalToCpu) {
  const int64_t cols = 32 * 23, n_tokens = 5, x_stride = cols + 7;
  const int64_t nb = cols / 32;
  const auto x = AwkwardActivations(n_tokens, x_stride, cols, 11);
  const float* dx = Upload(x);
  for (cuda::ActSum mode : {cuda::ActSum::kExact, cuda::ActSum::kQ8_1}) {
    SCOPED_TRACE(mode == cuda::ActSum::kExact ? "exact sum" : "q8_1 sum");
    std::vector<int8_t> want_qs(n_tokens * cols);
    std::vector<float> want_ds(n_tokens * 2 * nb);
    for (int64_t t = 0; t < n_tokens; ++t) {
      kernels::internal::QuantizeActsScalar(
          x.data() + t * x_stride, cols,
          mode == cuda::ActSum::kExact ? kernels::internal::ActSum::kExact
                                       : kernels::internal::ActSum::kQ8_1,
          want_qs.data() + t * cols, want_ds.data() + t * 2 * nb);
    }
    int8_t* qs = Alloc<int8_t>(want_qs.size());
    float* ds = Alloc<float>(want_ds.size());
    ASSERT_TRUE(cuda::QuantizeActs(dx, n_tokens, x_stride, cols, mode, qs, ds, stream()).ok());
    const auto got_qs = Download(qs, want_qs.size());
    const auto got_ds = Download(ds, want_ds.size());
    for (size_t i = 0; i < want_qs.size(); ++i) {
      ASSERT_EQ(got_qs[i], want_qs[i]) << "value " << i << " (token " << i / cols << ", block "
                                       << i % cols / 32 << ") x=" << x[i / cols * x_stride + i % cols];
    }
    for (size_t i = 0; i < want_ds.size(); ++i) {
      uint32_t g, w;
      std::memcpy(&g, &got_ds[i], 4);
      std::memcpy(&w, &want_ds[i], 4);
      ASSERT_EQ(g, w) << (i % 2 ? "s" : "d") << " of block " << i / 2 << ": " << got_ds[i]
                      << " vs " << want_ds[i];
    }
  }
}

TEST_F(CudaTest, QuantizeActsRejectsBadShapes) {
  EXPECT_EQ(cuda::QuantizeActs(nullptr, 1, 40, 40, cuda::ActSum::kExact, nullptr, nullptr,
                               stream())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::QuantizeActs(nullptr, 0, 64, 64, cuda::ActSum::kExact, nullptr, nullptr,
                                 stream())
                  .ok());
}

// The native path must agree with the CPU's production MatMul up to the
// order of the float sum over blocks: same activation quantization, exact
// integer block dots, the same per-block float expression.
TEST_F(CudaTest, NativeMatMulMatchesCpuMatMul) {
  auto mm = cuda::CublasMatMul::Create(pool_.get(), stream());
  ASSERT_TRUE(mm.ok()) << mm.status();
  // 77 rows: not a multiple of the kernel's rows per block. 4160 columns:
  // too wide for the shared-memory staging of activations.
  for (const int64_t cols : {int64_t{320}, int64_t{4160}}) {
    const int64_t rows = 77;
    const auto wsrc = RandomFloats(rows * cols, 21, 0.05f);
    for (kernels::DType type : {kernels::DType::kQ8_0, kernels::DType::kQ4_0,
                                kernels::DType::kQ4_1}) {
      SCOPED_TRACE(absl::StrCat(kernels::DTypeName(type), " cols=", cols));
      const int64_t row_bytes = kernels::RowBytes(type, cols);
      std::vector<uint8_t> wbytes(rows * row_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        kernels::QuantizeRowReference(type, wsrc.data() + r * cols, wbytes.data() + r * row_bytes,
                                      cols);
      }
      const kernels::WeightView wv{type, wbytes.data(), rows, cols};
      auto dw = cuda::UploadWeight(wv, cuda::WeightFormat::kNative, pool_.get(), stream());
      ASSERT_TRUE(dw.ok()) << dw.status();
      EXPECT_EQ(dw->data.size(), wbytes.size());  // the GGUF size
      EXPECT_EQ(dw->type, type);
      for (int64_t n_tokens : {1, 3, 17, 64}) {
        SCOPED_TRACE(absl::StrCat(n_tokens, " tokens"));
        const int64_t x_stride = cols + 5, y_stride = rows + 3;
        auto x = RandomFloats(n_tokens * x_stride, 22 + n_tokens);
        if (n_tokens == 17) x = AwkwardActivations(n_tokens, x_stride, cols, 23, 300.f);
        std::vector<float> want(n_tokens * y_stride, -7.f);
        kernels::MatMul(wv, x.data(), n_tokens, x_stride, want.data(), y_stride, nullptr);
        float* y = Upload(std::vector<float>(want.size(), -7.f));
        ASSERT_TRUE((*mm)->MatMul(*dw, Upload(x), n_tokens, x_stride, y, y_stride).ok());
        const auto got = Download(y, want.size());
        double worst = 0;
        for (int64_t t = 0; t < n_tokens; ++t) {
          double scale = 0;
          for (int64_t r = 0; r < rows; ++r) {
            scale = std::max(scale, std::fabs(static_cast<double>(want[t * y_stride + r])));
          }
          for (int64_t r = 0; r < y_stride; ++r) {
            const size_t i = t * y_stride + r;
            if (r >= rows) {
              ASSERT_EQ(got[i], -7.f) << "wrote past the rows at token " << t;
              continue;
            }
            const double err = std::fabs(static_cast<double>(got[i]) - want[i]) / scale;
            worst = std::max(worst, err);
            ASSERT_LT(err, 1e-5) << "token " << t << " row " << r << ": " << got[i] << " vs "
                                 << want[i];
          }
        }
        RecordProperty(absl::StrCat(kernels::DTypeName(type), "_", cols, "_", n_tokens),
                       absl::StrCat(worst));
      }
    }
  }
}

TEST_F(CudaTest, NativeWeightFormatTakesBlockTypesOnly) {
  std::vector<uint16_t> h(64 * 32, 0);
  const kernels::WeightView wv{kernels::DType::kF16, h.data(), 32, 64};
  EXPECT_EQ(cuda::UploadWeight(wv, cuda::WeightFormat::kNative, pool_.get(), stream())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- extended weight formats (Q5_0, Q5_1, IQ4_NL, K-quants, IQ4_XS) ----

constexpr kernels::DType kExtendedTypes[] = {
    kernels::DType::kQ5_0, kernels::DType::kQ5_1, kernels::DType::kIQ4_NL,
    kernels::DType::kQ2_K, kernels::DType::kQ3_K, kernels::DType::kQ4_K,
    kernels::DType::kQ5_K, kernels::DType::kQ6_K, kernels::DType::kIQ4_XS};

// Rows of random blocks of an extended type: every quant, scale and index
// byte random, the fp16 super-scales (and mins) random finite values, so
// each bit field of the layout reaches the result. Nothing in the project
// quantizes to these formats; files carry them.
std::vector<uint8_t> RandomBlocks(kernels::DType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<int> half_at;  // byte offsets of the block's fp16 fields
  switch (type) {
    case kernels::DType::kQ5_1:
    case kernels::DType::kQ4_K:
    case kernels::DType::kQ5_K:
      half_at = {0, 2};
      break;
    case kernels::DType::kQ2_K:
      half_at = {80, 82};
      break;
    case kernels::DType::kQ3_K:
      half_at = {108};
      break;
    case kernels::DType::kQ6_K:
      half_at = {208};
      break;
    default:  // Q5_0, IQ4_NL, IQ4_XS
      half_at = {0};
      break;
  }
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  const int64_t bb = kernels::BlockBytes(type);
  std::vector<uint8_t> out(rows * kernels::RowBytes(type, cols));
  for (auto& b : out) b = static_cast<uint8_t>(byte(rng));
  for (size_t blk = 0; blk < out.size() / bb; ++blk) {
    for (int at : half_at) {
      const uint16_t h = Fp32ToFp16(scale(rng));
      out[blk * bb + at] = static_cast<uint8_t>(h & 0xff);
      out[blk * bb + at + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return out;
}

TEST_F(CudaTest, ExtendedFormatsDequantizeBitIdenticallyToDequantizeRow) {
  const int64_t rows = 5, cols = 768;
  const std::vector<int32_t> tokens = {4, 0, 2, 2};
  for (kernels::DType type : kExtendedTypes) {
    SCOPED_TRACE(kernels::DTypeName(type));
    const auto bytes = RandomBlocks(type, rows, cols, 31);
    const int64_t row_bytes = kernels::RowBytes(type, cols);
    std::vector<float> want(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      kernels::DequantizeRow(type, bytes.data() + r * row_bytes, want.data() + r * cols, cols);
    }
    const uint8_t* dbytes = Upload(bytes);
    float* out = Alloc<float>(want.size());
    ASSERT_TRUE(cuda::DequantizeWeight(type, dbytes, rows, cols, out, stream()).ok());
    const auto got = Download(out, want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      uint32_t g, w;
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want[i], 4);
      ASSERT_EQ(g, w) << "row " << i / cols << " element " << i % cols << ": " << got[i]
                      << " vs " << want[i];
    }
    // The embedding gather reads the same tables element by element.
    float* emb = Alloc<float>(tokens.size() * cols);
    ASSERT_TRUE(cuda::EmbeddingGather(type, dbytes, rows, cols, Upload(tokens),
                                      static_cast<int64_t>(tokens.size()), emb, stream())
                    .ok());
    const auto got_emb = Download(emb, tokens.size() * cols);
    for (size_t t = 0; t < tokens.size(); ++t) {
      for (int64_t i = 0; i < cols; ++i) {
        ASSERT_EQ(got_emb[t * cols + i], want[tokens[t] * cols + i]) << "token " << t << " " << i;
      }
    }
  }
  EXPECT_EQ(cuda::DequantizeWeight(kernels::DType::kQ8_0, nullptr, 1, 32, nullptr, stream()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::DequantizeWeight(kernels::DType::kQ4_K, nullptr, 1, 320, nullptr, stream()).code(),
      absl::StatusCode::kInvalidArgument);
}

// Native extended weights agree with the CPU's algorithm on 32-value
// activation blocks (8-bit activations, per-32 float block sums; the
// portable MatMulRowsExtendedScalar) up to the order of the sum over
// blocks, and with the plain-loop MatMulReference (float activations) up to
// the activations' quantization. (The CPU's production MatMul gives the
// K-quants and IQ4_XS Q8_K activations instead, as llama.cpp's CPU backend
// does; its CUDA backend, like this one, uses 32-value blocks for all.)
TEST_F(CudaTest, ExtendedFormatsMatMulMatchesCpu) {
  auto mm = cuda::CublasMatMul::Create(pool_.get(), stream());
  ASSERT_TRUE(mm.ok()) << mm.status();
  // 77 rows: not a multiple of the kernel's rows per block. 4352 columns:
  // too wide for the shared-memory staging of activations.
  for (const int64_t cols : {int64_t{512}, int64_t{4352}}) {
    const int64_t rows = 77;
    for (kernels::DType type : kExtendedTypes) {
      SCOPED_TRACE(absl::StrCat(kernels::DTypeName(type), " cols=", cols));
      const auto wbytes = RandomBlocks(type, rows, cols, 41 + static_cast<uint32_t>(cols));
      const kernels::WeightView wv{type, wbytes.data(), rows, cols};
      auto dw = cuda::UploadWeight(wv, cuda::WeightFormat::kNative, pool_.get(), stream());
      ASSERT_TRUE(dw.ok()) << dw.status();
      EXPECT_EQ(dw->data.size(), wbytes.size());  // the GGUF size
      for (int64_t n_tokens : {1, 3, 17}) {
        SCOPED_TRACE(absl::StrCat(n_tokens, " tokens"));
        const int64_t x_stride = cols + 5, y_stride = rows + 3;
        const auto x = RandomFloats(n_tokens * x_stride, 42 + n_tokens);
        std::vector<float> want(n_tokens * y_stride, -7.f);
        {
          const int64_t nb = cols / 32;
          std::vector<int8_t> qs(n_tokens * cols);
          std::vector<float> ds(2 * n_tokens * nb);
          for (int64_t t = 0; t < n_tokens; ++t) {
            kernels::internal::QuantizeActsScalar(x.data() + t * x_stride, cols,
                                                  kernels::internal::ActSum::kExact,
                                                  qs.data() + t * cols, ds.data() + t * 2 * nb);
          }
          kernels::internal::QuantizedActs acts;
          acts.n_blocks = nb;
          acts.qs = qs.data();
          acts.ds = ds.data();
          kernels::internal::MatMulRowsExtendedScalar(wv, acts, n_tokens, 0, rows, want.data(),
                                                      y_stride);
        }
        std::vector<float> ref(n_tokens * y_stride, -7.f);
        kernels::MatMulReference(wv, x.data(), n_tokens, x_stride, ref.data(), y_stride);
        float* y = Upload(std::vector<float>(want.size(), -7.f));
        ASSERT_TRUE((*mm)->MatMul(*dw, Upload(x), n_tokens, x_stride, y, y_stride).ok());
        const auto got = Download(y, want.size());
        std::vector<float> got_rows, ref_rows;
        for (int64_t t = 0; t < n_tokens; ++t) {
          double scale = 0;
          for (int64_t r = 0; r < rows; ++r) {
            scale = std::max(scale, std::fabs(static_cast<double>(want[t * y_stride + r])));
          }
          for (int64_t r = 0; r < y_stride; ++r) {
            const size_t i = t * y_stride + r;
            if (r >= rows) {
              ASSERT_EQ(got[i], -7.f) << "wrote past the rows at token " << t;
              continue;
            }
            const double err = std::fabs(static_cast<double>(got[i]) - want[i]) / scale;
            ASSERT_LT(err, 1e-5) << "token " << t << " row " << r << ": " << got[i] << " vs "
                                 << want[i];
            got_rows.push_back(got[i]);
            ref_rows.push_back(ref[i]);
          }
        }
        EXPECT_LT(Nmse(got_rows, ref_rows), 1e-3);
      }
    }
  }
}

TEST_F(CudaTest, ProbeReportsPositiveBandwidth) {
  auto r = cuda::ProbeBandwidth(64 << 20, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->d2d_copy_gbps, 0);
  EXPECT_GT(r->h2d_gbps, 0);
  EXPECT_GT(r->d2h_gbps, 0);
  EXPECT_FALSE(cuda::FormatBandwidthReport(*r).empty());
}

}  // namespace
}  // namespace kvserve
