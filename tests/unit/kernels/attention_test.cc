#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/half.h"
#include "common/thread_pool.h"
#include "kernels/cpu/dispatch.h"

namespace kvserve::kernels {
namespace {

ThreadPool* TestPool() {
  static ThreadPool pool(2);
  return &pool;
}

std::vector<float> RandomFloats(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// A host KV pool of two layers whose sequences own scattered, shuffled
// blocks, filled with random K/V through AppendKv. Tests attend on layer 1 so
// layer offsets are exercised.
class KvFixture {
 public:
  // run: positions per AppendKv call (0 = a whole sequence at once; 1 = as
  // decode appends).
  KvFixture(int32_t block_size, int32_t n_kv_heads, int32_t head_dim, KvDType dtype,
            const std::vector<int32_t>& seq_lens, uint32_t seed, int32_t run = 0)
      : rng_(seed) {
    constexpr int32_t kLayers = 2;
    view_.block_size = block_size;
    view_.n_kv_heads = n_kv_heads;
    view_.head_dim = head_dim;
    view_.dtype = dtype;
    view_.layer_bytes = 2 * PagedKvView::HalfLayerBytes(block_size, n_kv_heads, head_dim, dtype);
    view_.block_bytes = kLayers * view_.layer_bytes;
    int32_t total_blocks = 0;
    for (int32_t len : seq_lens) total_blocks += (len + block_size - 1) / block_size;
    // Spare blocks so ids are sparse, then a shuffle so no sequence is
    // contiguous or in order.
    const int32_t pool_blocks = 2 * total_blocks + 3;
    std::vector<int32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    offsets_.push_back(0);
    int32_t next = 0;
    // The last id is never handed out: it stays NaN (ReleaseBlocksBefore).
    spare_block_ = ids.back();
    for (int32_t len : seq_lens) {
      for (int32_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
        block_ids_.push_back(ids[next++]);
      }
      offsets_.push_back(static_cast<int32_t>(block_ids_.size()));
    }
    // NaN filler: reading a slot that was never written poisons the result.
    storage_.assign(pool_blocks * view_.block_bytes / 4 + 1, std::nanf(""));
    view_.pool = reinterpret_cast<uint8_t*>(storage_.data());
    view_.block_ids = block_ids_.data();
    view_.seq_block_offsets = offsets_.data();
    view_.n_seqs = static_cast<int32_t>(seq_lens.size());

    // Append every position of every sequence, one sequence-chunk at a time.
    const int64_t row = static_cast<int64_t>(n_kv_heads) * head_dim;
    for (int32_t s = 0; s < view_.n_seqs; ++s) {
      const int32_t len = seq_lens[s];
      std::vector<int32_t> seqs(len, s), pos(len);
      std::iota(pos.begin(), pos.end(), 0);
      const auto k = RandomFloats(len * row, rng_);
      const auto v = RandomFloats(len * row, rng_);
      const int32_t step = run > 0 ? run : len;
      for (int32_t p = 0; p < len; p += step) {
        AppendKv(view_, 1, std::min(step, len - p), seqs.data() + p, pos.data() + p, &k[p * row],
                 row, &v[p * row], row);
      }
    }
  }

  const PagedKvView& view() const { return view_; }
  std::mt19937& rng() { return rng_; }

  // Sequence seq's whole blocks before position pos now point at a block
  // that was never written (NaN), as a window group's released blocks are
  // gone: a kernel that reads one returns NaN.
  void ReleaseBlocksBefore(int32_t seq, int32_t pos) {
    for (int32_t b = 0; b < pos / view_.block_size; ++b) {
      block_ids_[offsets_[seq] + b] = spare_block_;
    }
  }

 private:
  std::mt19937 rng_;
  PagedKvView view_;
  std::vector<int32_t> block_ids_;
  std::vector<int32_t> offsets_;
  std::vector<float> storage_;
  int32_t spare_block_ = 0;
};

// block size x head dim x GQA ratio x KV dtype x pool.
using AttnParam = std::tuple<int, int, int, KvDType, bool>;

class PagedAttentionTest : public ::testing::TestWithParam<AttnParam> {
 protected:
  // Runs the batch through both kernels and compares.
  // window > 0: a sliding window, with each sequence's blocks before its
  // tokens' earliest window released (NaN).
  void Check(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& token_seq,
             const std::vector<int32_t>& token_pos, int32_t window = 0) {
    const auto [block_size, head_dim, gqa, dtype, use_pool] = GetParam();
    constexpr int32_t kKvHeads = 2;
    KvFixture kv(block_size, kKvHeads, head_dim, dtype, seq_lens, 42);
    if (window > 0) {
      for (int32_t s = 0; s < static_cast<int32_t>(seq_lens.size()); ++s) {
        int32_t earliest = seq_lens[s];
        for (size_t t = 0; t < token_seq.size(); ++t) {
          if (token_seq[t] == s) earliest = std::min(earliest, token_pos[t]);
        }
        kv.ReleaseBlocksBefore(s, std::max(0, earliest + 1 - window));
      }
    }
    AttentionBatch batch;
    batch.window = window;
    batch.n_tokens = static_cast<int32_t>(token_seq.size());
    batch.token_seq = token_seq.data();
    batch.token_pos = token_pos.data();
    batch.n_heads = kKvHeads * gqa;
    batch.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const int64_t q_row = static_cast<int64_t>(batch.n_heads) * head_dim;
    const int64_t q_stride = q_row + 8;  // padded rows
    const auto q = RandomFloats(batch.n_tokens * q_stride, kv.rng());
    std::vector<float> want(batch.n_tokens * q_stride, 0.0f);
    std::vector<float> got(batch.n_tokens * q_stride, 0.0f);
    PagedAttentionReference(kv.view(), 1, batch, q.data(), q_stride, want.data(), q_stride);
    PagedAttention(kv.view(), 1, batch, q.data(), q_stride, got.data(), q_stride,
                   use_pool ? TestPool() : nullptr);
    for (int32_t t = 0; t < batch.n_tokens; ++t) {
      for (int64_t i = 0; i < q_stride; ++i) {
        // f16: probabilities are rounded to f16 after normalization, and a
        // float vs double score can land on either side of a rounding step
        // (one f16 ulp of a probability is 2^-11 of it).
        ASSERT_NEAR(got[t * q_stride + i], want[t * q_stride + i],
                    dtype == KvDType::kF16 ? 1e-3f : (KvIsQuantized(dtype) ? 5e-5f : 2e-5f))
            << "token " << t << " element " << i;
      }
    }
  }
};

TEST_P(PagedAttentionTest, RaggedMixedBatchMatchesReference) {
  // Sequence 0: one decode token at the end of a short context. Sequence 1:
  // a prefill chunk (positions 20..36) after a cached prefix. Sequence 2: a
  // decode token deep in a long context. Sequence 3: first token ever.
  const std::vector<int32_t> lens = {5, 37, 100, 1};
  std::vector<int32_t> seq = {0};
  std::vector<int32_t> pos = {4};
  for (int32_t p = 20; p < 37; ++p) {
    seq.push_back(1);
    pos.push_back(p);
  }
  seq.push_back(2);
  pos.push_back(99);
  seq.push_back(3);
  pos.push_back(0);
  Check(lens, seq, pos);
}

TEST_P(PagedAttentionTest, LongDecodeMatchesReference) {
  // Few (token, KV head) pairs and a long context: the kernel splits the
  // context across threads and merges softmax states.
  Check({700, 300}, {0, 1}, {699, 299});
}

// Sliding windows (Gemma 3's local layers): decode deep past the window, a
// prefill chunk whose tokens' windows start mid-block, a window wider than
// the context, with the blocks before every window released. The split
// (flash-decoding) and f16 split paths are taken by the long decodes.
TEST_P(PagedAttentionTest, SlidingWindowMatchesReferenceAndSkipsReleasedBlocks) {
  std::vector<int32_t> seq = {0, 1};
  std::vector<int32_t> pos = {699, 299};
  for (int32_t p = 150; p < 170; ++p) {
    seq.push_back(2);
    pos.push_back(p);
  }
  seq.push_back(3);
  pos.push_back(40);
  Check({700, 300, 170, 41}, seq, pos, /*window=*/100);
  Check({700, 300}, {0, 1}, {699, 299}, /*window=*/257);
  Check({700, 300, 170, 41}, seq, pos, /*window=*/1);
}

TEST_P(PagedAttentionTest, ScalarPathMatchesReference) {
  ScopedDisableSimdForTesting no_simd;
  Check({9, 130}, {0, 1, 1}, {8, 128, 129});
  Check({9, 130}, {0, 1, 1}, {8, 128, 129}, /*window=*/50);
}

std::string DTypeTestName(KvDType t) {
  std::string name(KvDTypeName(t));
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

std::string AttnName(const ::testing::TestParamInfo<AttnParam>& info) {
  const auto [block_size, head_dim, gqa, dtype, use_pool] = info.param;
  return "bs" + std::to_string(block_size) + "_hd" + std::to_string(head_dim) + "_gqa" +
         std::to_string(gqa) + "_" + DTypeTestName(dtype) + (use_pool ? "_pool" : "_nopool");
}

INSTANTIATE_TEST_SUITE_P(Grid, PagedAttentionTest,
                         ::testing::Combine(::testing::Values(1, 4, 16, 32),
                                            ::testing::Values(8, 64, 128),
                                            ::testing::Values(1, 3, 4),
                                            ::testing::Values(KvDType::kF32, KvDType::kF16),
                                            ::testing::Bool()),
                         AttnName);

// Quantized caches: the kernel dequantizes tile by tile as it reads; the
// reference dequantizes every row with the plain-loop codec. Odd head dims
// (int4 tails) and head dims over one int4 group are covered.
INSTANTIATE_TEST_SUITE_P(
    QuantGrid, PagedAttentionTest,
    ::testing::Combine(::testing::Values(1, 16), ::testing::Values(8, 40, 64),
                       ::testing::Values(1, 3),
                       ::testing::Values(KvDType::kBF16, KvDType::kFp8E4M3, KvDType::kFp8E5M2,
                                         KvDType::kInt8, KvDType::kInt4, KvDType::kInt4G64,
                                         KvDType::kInt4Kivi, KvDType::kInt4KiviG64),
                       ::testing::Bool()),
    AttnName);

// AppendKv writes token t of sequence s at position p into block
// block_ids[offsets[s] + p / block_size], slot p % block_size, with the
// layout kv_view.h documents (K first, V at layer_bytes / 2).
TEST(AppendKvTest, WritesDocumentedSlot) {
  const int32_t bs = 4, heads = 2, hd = 8;
  KvFixture kv(bs, heads, hd, KvDType::kF16, {6}, 1);
  const PagedKvView& v = kv.view();
  std::vector<float> k(heads * hd), val(heads * hd);
  for (int i = 0; i < heads * hd; ++i) {
    k[i] = 0.5f * i;
    val[i] = -0.25f * i;
  }
  const int32_t seq = 0, pos = 5;
  AppendKv(v, 0, 1, &seq, &pos, k.data(), heads * hd, val.data(), heads * hd);
  const int32_t block = v.block_ids[v.seq_block_offsets[0] + pos / bs];
  for (int h = 0; h < heads; ++h) {
    const uint8_t* kbase =
        v.pool + block * v.block_bytes + 0 * v.layer_bytes + (h * bs + pos % bs) * hd * 2;
    const uint8_t* vbase = kbase + v.layer_bytes / 2;
    for (int i = 0; i < hd; ++i) {
      uint16_t kh, vh;
      std::memcpy(&kh, kbase + 2 * i, 2);
      std::memcpy(&vh, vbase + 2 * i, 2);
      EXPECT_EQ(Fp16ToFp32(kh), k[h * hd + i]);
      EXPECT_EQ(Fp16ToFp32(vh), val[h * hd + i]);
    }
  }
}

// int4-kivi keys appended as decode appends them (one position per call,
// earlier keys of a block re-encoded as channel ranges widen): the fast
// path (SIMD and portable) reads exactly what the reference reads.
TEST(KiviAttentionTest, DecodeAppendedCacheMatchesReference) {
  for (bool simd : {true, false}) {
    std::optional<ScopedDisableSimdForTesting> no_simd;
    if (!simd) no_simd.emplace();
    for (int32_t hd : {40, 64, 128}) {
      KvFixture kv(hd == 128 ? 32 : 16, 2, hd,
                   hd == 128 ? KvDType::kInt4KiviG64 : KvDType::kInt4Kivi, {37, 300}, 7,
                   /*run=*/1);
      const std::vector<int32_t> seq = {0, 1}, pos = {36, 299};
      AttentionBatch batch{2, seq.data(), pos.data(), 6, 1.0f / 8.0f};
      const int64_t q_row = int64_t{6} * hd;
      const auto q = RandomFloats(2 * q_row, kv.rng());
      std::vector<float> want(2 * q_row), got(2 * q_row);
      PagedAttentionReference(kv.view(), 1, batch, q.data(), q_row, want.data(), q_row);
      PagedAttention(kv.view(), 1, batch, q.data(), q_row, got.data(), q_row, TestPool());
      for (int64_t i = 0; i < 2 * q_row; ++i) {
        ASSERT_NEAR(got[i], want[i], 5e-5f) << "simd=" << simd << " hd=" << hd << " i=" << i;
      }
    }
  }
}

// f16 cache with few (token, KV head) pairs: the kernel may split each
// pair's scores, softmax and output channels across threads. That split must
// be bitwise equal to running each pair on one thread, for any thread count
// -- block boundaries, contexts that end mid-block, head dims with a tail
// past the last group of 8 -- with and without SIMD.
TEST(F16SplitAttentionTest, SplitIsBitwiseEqualToUnsplit) {
  static ThreadPool pool3(3), pool4(4);
  ThreadPool* pools[] = {TestPool(), &pool3, &pool4};
  struct Case {
    int32_t block_size, head_dim, gqa;
    std::vector<int32_t> lens;  // one decode token at the end of each
  };
  const std::vector<Case> cases = {
      {16, 64, 3, {1}},    {16, 64, 3, {16}},         {16, 64, 3, {17}},         {16, 64, 3, {300}},
      {16, 64, 3, {2048}}, {1, 64, 3, {37}},          {32, 128, 4, {255, 513}},  {16, 8, 1, {100}},
      {4, 20, 5, {61}},    {32, 40, 2, {97, 3, 640}}, {16, 64, 3, {15, 33, 48}},
  };
  for (bool simd : {true, false}) {
    std::optional<ScopedDisableSimdForTesting> no_simd;
    if (!simd) no_simd.emplace();
    for (const Case& c : cases) {
      constexpr int32_t kKvHeads = 3;
      KvFixture kv(c.block_size, kKvHeads, c.head_dim, KvDType::kF16, c.lens, 11);
      const int32_t n_tokens = static_cast<int32_t>(c.lens.size());
      std::vector<int32_t> seq(n_tokens), pos(n_tokens);
      for (int32_t t = 0; t < n_tokens; ++t) {
        seq[t] = t;
        pos[t] = c.lens[t] - 1;
      }
      for (int32_t window : {0, 37}) {
        // With a window, the blocks before every token's window are released.
        for (int32_t t = 0; window > 0 && t < n_tokens; ++t) {
          kv.ReleaseBlocksBefore(t, std::max(0, c.lens[t] - window));
        }
        AttentionBatch batch{n_tokens, seq.data(), pos.data(), kKvHeads * c.gqa,
                             1.0f / std::sqrt(static_cast<float>(c.head_dim))};
        batch.window = window;
        const int64_t q_row = static_cast<int64_t>(batch.n_heads) * c.head_dim;
        // Large scores make some probabilities round to f16 subnormals or 0.
        auto q = RandomFloats(n_tokens * q_row, kv.rng());
        for (auto& x : q) x *= 4.0f;
        std::vector<float> want(n_tokens * q_row), got(n_tokens * q_row);
        {
          ScopedF16SplitForTesting unsplit(false);
          PagedAttention(kv.view(), 1, batch, q.data(), q_row, want.data(), q_row, TestPool());
        }
        for (ThreadPool* pool : pools) {
          ScopedF16SplitForTesting split(true);
          std::fill(got.begin(), got.end(), std::nanf(""));
          PagedAttention(kv.view(), 1, batch, q.data(), q_row, got.data(), q_row, pool);
          ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
              << "simd=" << simd << " threads=" << pool->num_threads() << " bs=" << c.block_size
              << " hd=" << c.head_dim << " gqa=" << c.gqa << " len[0]=" << c.lens[0]
              << " window=" << window;
        }
        // The heuristic's own choice (split for the single long decode) too.
        std::fill(got.begin(), got.end(), std::nanf(""));
        PagedAttention(kv.view(), 1, batch, q.data(), q_row, got.data(), q_row, TestPool());
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
        for (float x : got) ASSERT_FALSE(std::isnan(x)) << "window " << window;
      }
    }
  }
}

// A query that matches one key far better than the others attends (almost)
// only to it: a sanity check of the reference itself.
TEST(PagedAttentionReferenceTest, SharpQueryPicksMatchingValue) {
  KvFixture kv(4, 1, 8, KvDType::kF32, {10}, 3);
  const PagedKvView& v = kv.view();
  const int32_t target = 6;
  std::vector<float> q(8);
  const auto* key = reinterpret_cast<const float*>(v.KeyAt(1, 0, target, 0));
  for (int i = 0; i < 8; ++i) q[i] = 100.0f * key[i];
  const int32_t seq = 0, pos = 9;
  AttentionBatch batch{1, &seq, &pos, 1, 1.0f};
  std::vector<float> out(8);
  PagedAttentionReference(v, 1, batch, q.data(), 8, out.data(), 8);
  const auto* val = reinterpret_cast<const float*>(v.ValueAt(1, 0, target, 0));
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(out[i], val[i], 1e-3f);
}

}  // namespace
}  // namespace kvserve::kernels
