// Paged attention on the CPU: the reference, the portable and AVX2 paths of
// the online-softmax loop, and the driver that spreads (token, KV head,
// context chunk) items over the pool.

#include "kernels/cpu/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/kv_codec.h"

namespace kvserve::kernels {
namespace {

using internal::AttnItem;
using internal::AttnState;
using internal::kPosTile;

// Chunks of context shorter than this are not worth a separate item: the
// merge and the dispatch would cost more than the parallelism gains.
constexpr int32_t kMinSplitPositions = 128;

// The first slot a token at `len - 1` attends to: 0, or the start of its
// sliding window (batch.window positions ending at the token). Slots before
// it are never read: a window group may have released their blocks.
int32_t WindowBegin(const AttentionBatch& batch, int32_t len) {
  return batch.window > 0 ? std::max(0, len - batch.window) : 0;
}

template <typename Elem>
float ToFloat(Elem e) {
  if constexpr (sizeof(Elem) == 4) {
    return e;
  } else {
    return Fp16ToFp32(e);
  }
}

template <typename Elem>
struct ScalarOps {
  static void Scores(const float* q, int32_t group, int32_t hd, const Elem* k_rows, int32_t n,
                     float scale, float* scores, int32_t ld) {
    for (int32_t h = 0; h < group; ++h) {
      for (int32_t j = 0; j < n; ++j) {
        const Elem* k = k_rows + static_cast<int64_t>(j) * hd;
        float s = 0.0f;
        for (int32_t i = 0; i < hd; ++i) s += q[h * hd + i] * ToFloat(k[i]);
        scores[h * ld + j] = s * scale;
      }
    }
  }
  static float Max(const float* x, int32_t n) {
    float m = x[0];
    for (int32_t j = 1; j < n; ++j) m = std::max(m, x[j]);
    return m;
  }
  static float ExpShift(float* x, int32_t n, float shift) {
    float sum = 0.0f;
    for (int32_t j = 0; j < n; ++j) {
      x[j] = std::exp(x[j] - shift);
      sum += x[j];
    }
    return sum;
  }
  static void Scale(float* v, float c, int32_t n) {
    for (int32_t i = 0; i < n; ++i) v[i] *= c;
  }
  static void AccumulateV(float* acc, int32_t group, int32_t stride, int32_t width, const float* p,
                          int32_t ld, const Elem* v_rows, int32_t n) {
    for (int32_t h = 0; h < group; ++h) {
      for (int32_t j = 0; j < n; ++j) {
        const Elem* v = v_rows + static_cast<int64_t>(j) * stride;
        const float pj = p[h * ld + j];
        for (int32_t i = 0; i < width; ++i) acc[h * stride + i] += pj * ToFloat(v[i]);
      }
    }
  }
  static void RoundF16(const float* x, float* dst, int32_t n) {
    for (int32_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(Fp32ToFp16(x[i]));
  }
  static void ScaleRoundF16(float* x, int32_t n, float c) {
    for (int32_t i = 0; i < n; ++i) x[i] = Fp16ToFp32(Fp32ToFp16(x[i] * c));
  }
};

void AttendScalar(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                  float scale, AttnState st, float* scores, float* rows) {
  if (KvIsQuantized(kv.dtype)) {
    internal::AttendRangeQuant<ScalarOps<float>, internal::PlainRowDecoder>(
        kv, layer, item, group, scale, st, scores, rows);
  } else if (kv.dtype == KvDType::kF32) {
    internal::AttendRange<ScalarOps<float>, float>(kv, layer, item, group, scale, st, scores);
  } else {
    internal::AttendRange<ScalarOps<uint16_t>, uint16_t>(kv, layer, item, group, scale, st, scores);
  }
}

// The f16 cache's split path (below) pays off only where whole pairs leave
// a thread with nothing to do (fewer pairs than threads: Gemma 3's one KV
// head in single-stream decode), from this many positions: its units wait
// on each other, and short contexts leave little to share. Where every
// thread has a pair (SmolLM2's three on two threads: only the last round is
// short) splitting measured no better. kvserve_kernels_bench
// AttentionDecodeSplit/*/f16/threads:2, whole vs split, median us of 6
// interleaved runs (--benchmark_enable_random_interleaving) on the 2-vCPU
// EPYC: gemma3 (1 pair, 4 x 256) at 64 / 128 / 256 / 1024 / 4096 positions
// 3.5 / 6.5 / 13.1 / 55.1 / 240 vs 6.8 / 6.1 / 9.9 / 35.6 / 139; smollm2 (3
// pairs, 3 x 64) at 256 / 512 / 1024 / 4096 6.8 / 12.9 / 26.3 / 120 vs
// 10.2 / 18.1 / 30.0 / 139 (an earlier run had split ahead at 1024 and
// 4096, 25 vs 26 and 100 vs 113). The former rule, any pair count below
// twice the threads from 256 positions, split SmolLM2 where it cost 35-50%.
constexpr int32_t kMinF16SplitPositions = 128;

// -1: the heuristic decides; 0/1: ScopedF16SplitForTesting's choice.
std::atomic<int> g_f16_split_override{-1};

// f16 cache, few (token, KV head) pairs: each pair's three steps (see
// AttendTwoPassF16) are spread over all threads -- score ranges of whole
// blocks, then one head's softmax per work unit, then channel ranges of the
// output -- with results bitwise equal to running each pair on one thread.
void PagedAttentionF16Split(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                            const float* q, int64_t q_stride, float* out, int64_t out_stride,
                            ThreadPool* pool, const internal::F16Kernels& k) {
  const int32_t group = batch.n_heads / kv.n_kv_heads;
  const int32_t hd = kv.head_dim;
  const int32_t bs = kv.block_size;
  const int32_t n_pairs = batch.n_tokens * kv.n_kv_heads;
  const int n_threads = pool->num_threads();

  // Per pair: the f16 query (group * hd floats), then the scores
  // (group * ld floats), in one buffer shared by all threads.
  struct Pair {
    int32_t t, kvh, begin, len, ld, first_block, n_blocks;
    const int32_t* blocks;
    int64_t offset;
  };
  // The caller's buffers; the lambdas below run on every thread, so they
  // reach them through the plain pointers pairs and base, never by naming
  // the thread_locals.
  thread_local std::vector<Pair> pair_buf;
  thread_local std::vector<float> shared;
  pair_buf.resize(n_pairs);
  Pair* const pairs = pair_buf.data();
  int64_t total = 0;
  for (int32_t i = 0; i < n_pairs; ++i) {
    Pair& pr = pairs[i];
    pr.t = i / kv.n_kv_heads;
    pr.kvh = i % kv.n_kv_heads;
    pr.len = batch.token_pos[pr.t] + 1;
    pr.begin = WindowBegin(batch, pr.len);
    pr.ld = (pr.len - pr.begin + 15) & ~15;
    pr.first_block = pr.begin / bs;
    pr.n_blocks = (pr.len + bs - 1) / bs - pr.first_block;
    pr.blocks = kv.block_ids + kv.seq_block_offsets[batch.token_seq[pr.t]];
    pr.offset = total;
    total += static_cast<int64_t>(group) * (hd + pr.ld);
  }
  if (shared.size() < static_cast<size_t>(total)) shared.resize(total);
  float* const base = shared.data();
  for (int32_t i = 0; i < n_pairs; ++i) {
    const Pair& pr = pairs[i];
    k.round_query(q + pr.t * q_stride + static_cast<int64_t>(pr.kvh) * group * hd, group * hd,
                  base + pr.offset);
  }

  // One region, one queue of units: all score units, then all softmax
  // units, then all V units. A unit waits only for earlier units of its own
  // pair (counted in `done`), which threads already hold and are running, so
  // the queue cannot deadlock (and a pool running the region inline on one
  // thread meets every dependency in order). One region instead of one per
  // step: a thread that starts late, or is preempted, costs less.
  const int32_t n_groups8 = std::max(1, hd / 8);
  const int32_t n_ranges = std::min(n_threads, n_groups8);
  const int64_t n_score = int64_t{n_pairs} * n_threads;
  const int64_t n_norm = int64_t{n_pairs} * group;
  const int64_t n_units = n_score + n_norm + int64_t{n_pairs} * n_ranges;
  std::unique_ptr<std::atomic<int32_t>[]> done(new std::atomic<int32_t>[2 * n_pairs]);
  for (int32_t i = 0; i < 2 * n_pairs; ++i) done[i].store(0, std::memory_order_relaxed);
  auto wait_for = [&](int32_t slot, int32_t count) {
    for (int spin = 0; done[slot].load(std::memory_order_acquire) < count; ++spin) {
      if (spin >= 256) std::this_thread::yield();
    }
  };
  auto run_unit = [&](int64_t u) {
    if (u < n_score) {
      // Scores: each pair's blocks in n_threads ranges of whole blocks.
      const int32_t i = static_cast<int32_t>(u / n_threads);
      const Pair& pr = pairs[i];
      const int32_t c = static_cast<int32_t>(u % n_threads);
      const int32_t b0 =
          pr.first_block + static_cast<int32_t>(int64_t{pr.n_blocks} * c / n_threads);
      const int32_t b1 =
          pr.first_block + static_cast<int32_t>(int64_t{pr.n_blocks} * (c + 1) / n_threads);
      const int32_t p0 = std::max(pr.begin, b0 * bs);
      const int32_t p1 = std::min(pr.len, b1 * bs);
      if (p0 < p1) {
        const float* q16 = base + pr.offset;
        k.score_range(kv, layer, pr.blocks, pr.kvh, group, batch.scale, q16, p0, p1,
                      base + pr.offset + int64_t{group} * hd, pr.ld, pr.begin);
      }
      done[i].fetch_add(1, std::memory_order_release);
    } else if (u < n_score + n_norm) {
      // Softmax: one head per unit, once all of its pair's scores are in.
      const int32_t i = static_cast<int32_t>((u - n_score) / group);
      const int32_t h = static_cast<int32_t>((u - n_score) % group);
      const Pair& pr = pairs[i];
      wait_for(i, n_threads);
      k.normalize(base + pr.offset + int64_t{group} * hd + int64_t{h} * pr.ld, pr.len - pr.begin);
      done[n_pairs + i].fetch_add(1, std::memory_order_release);
    } else {
      // V: each pair's channels in ranges of whole groups of 8 (the tail of
      // a head_dim that is not a multiple of 8 goes with the last range),
      // once all of its pair's heads are normalized.
      const int32_t i = static_cast<int32_t>((u - n_score - n_norm) / n_ranges);
      const int32_t r = static_cast<int32_t>((u - n_score - n_norm) % n_ranges);
      const Pair& pr = pairs[i];
      const int32_t c0 = 8 * static_cast<int32_t>(int64_t{n_groups8} * r / n_ranges);
      const int32_t c1 = r + 1 == n_ranges
                             ? hd
                             : 8 * static_cast<int32_t>(int64_t{n_groups8} * (r + 1) / n_ranges);
      wait_for(n_pairs + i, group);
      const float* probs = base + pr.offset + int64_t{group} * hd;
      float* o = out + pr.t * out_stride + static_cast<int64_t>(pr.kvh) * group * hd;
      k.accumulate_v(kv, layer, pr.blocks, pr.kvh, group, probs, pr.ld, pr.begin, pr.len, c0, c1,
                     o);
    }
  };
  std::atomic<int64_t> next{0};
  pool->Run([&](int, int) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < n_units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      run_unit(u);
    }
  });
}

// Per-thread scratch: one state (m, l, acc) and the score tile.
struct AttnScratch {
  std::vector<float> buf;
  float* Reserve(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

AttnScratch& ThreadScratch() {
  thread_local AttnScratch scratch;
  return scratch;
}

}  // namespace

void AppendKv(const PagedKvView& kv, int32_t layer, int32_t n_tokens, const int32_t* token_seq,
              const int32_t* token_pos, const float* k, int64_t k_stride, const float* v,
              int64_t v_stride) {
  // The AVX2 row encoders where the CPU has them: byte for byte the plain
  // loops (kv_codec_test), at a fraction of the cost (the plain f16 row was
  // 3% of a decode step at long context).
  const bool simd = UseAvx2();
  auto* const encode_row = simd ? &internal::QuantizeRowAvx2 : &QuantizeRow;
  auto* const encode_kivi_keys = simd ? &internal::AppendKiviKeysAvx2 : &AppendKiviKeys;
  if (KvIsKivi(kv.dtype)) {
    // Values: per (token, KV head) row, as int4. Keys: per channel over a
    // block, so a run of consecutive positions of one sequence inside one
    // block is appended at once (a prefill chunk sets each block's channel
    // ranges from all its keys; decode appends runs of one).
    const int32_t bs = kv.block_size;
    for (int32_t t = 0; t < n_tokens; ++t) {
      for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
        const int64_t off = static_cast<int64_t>(h) * kv.head_dim;
        encode_row(kv.dtype, v + t * v_stride + off, kv.head_dim,
                   kv.ValueAt(layer, token_seq[t], token_pos[t], h),
                   kv.ValueMetaAt(layer, token_seq[t], token_pos[t], h));
      }
    }
    for (int32_t t = 0; t < n_tokens;) {
      const int32_t seq = token_seq[t];
      const int32_t pos = token_pos[t];
      const int32_t slot = pos % bs;
      int32_t n = 1;
      while (t + n < n_tokens && token_seq[t + n] == seq && token_pos[t + n] == pos + n &&
             slot + n < bs) {
        ++n;
      }
      const int32_t block = kv.block_ids[kv.seq_block_offsets[seq] + pos / bs];
      for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
        encode_kivi_keys(k + t * k_stride + static_cast<int64_t>(h) * kv.head_dim, k_stride, n,
                         slot, kv.head_dim, kv.BlockHead(layer, block, h),
                         kv.BlockHeadMeta(layer, block, h));
      }
      t += n;
    }
    return;
  }
  for (int32_t t = 0; t < n_tokens; ++t) {
    for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
      // Quantized codecs compute their scales here, per (token, KV head) row.
      const int64_t off = static_cast<int64_t>(h) * kv.head_dim;
      encode_row(kv.dtype, k + t * k_stride + off, kv.head_dim,
                 kv.KeyAt(layer, token_seq[t], token_pos[t], h),
                 kv.KeyMetaAt(layer, token_seq[t], token_pos[t], h));
      encode_row(kv.dtype, v + t * v_stride + off, kv.head_dim,
                 kv.ValueAt(layer, token_seq[t], token_pos[t], h),
                 kv.ValueMetaAt(layer, token_seq[t], token_pos[t], h));
    }
  }
}

void PagedAttention(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                    const float* q, int64_t q_stride, float* out, int64_t out_stride,
                    ThreadPool* pool) {
  if (batch.n_tokens <= 0) return;
  const int32_t group = batch.n_heads / kv.n_kv_heads;
  const int32_t hd = kv.head_dim;
  const int64_t n_pairs = static_cast<int64_t>(batch.n_tokens) * kv.n_kv_heads;
  const int n_threads = pool != nullptr ? pool->num_threads() : 1;
  const bool simd = UseAvx2();
  const bool quantized = KvIsQuantized(kv.dtype);

  if (kv.dtype == KvDType::kF16) {
    // f16 cache: two passes per (token, KV head) with llama.cpp's rounding
    // points (see AttendTwoPassF16). Few pairs (single-stream decode has
    // n_kv_heads of them) would leave threads idle on long contexts: split
    // each pair's steps across the threads instead, bit for bit the same.
    if (n_threads > 1) {
      const int over = g_f16_split_override.load(std::memory_order_relaxed);
      bool split = over == 1;
      if (over < 0 && n_pairs < n_threads) {
        int32_t max_len = 0;  // positions attended, windows applied
        for (int32_t t = 0; t < batch.n_tokens; ++t) {
          const int32_t len = batch.token_pos[t] + 1;
          max_len = std::max(max_len, len - WindowBegin(batch, len));
        }
        split = max_len >= kMinF16SplitPositions;
      }
      if (split) {
        static constexpr internal::F16Kernels kScalarF16 =
            internal::MakeF16Kernels<ScalarOps<uint16_t>>();
        PagedAttentionF16Split(kv, layer, batch, q, q_stride, out, out_stride, pool,
                               simd ? internal::F16KernelsAvx2() : kScalarF16);
        return;
      }
    }
    // Otherwise each item covers a whole pair.
    auto run_pair = [&](int64_t pair) {
      const int32_t t = static_cast<int32_t>(pair / kv.n_kv_heads);
      const int32_t kvh = static_cast<int32_t>(pair % kv.n_kv_heads);
      const int32_t len = batch.token_pos[t] + 1;
      const int32_t begin = WindowBegin(batch, len);
      const int32_t ld = (len - begin + 15) & ~15;
      AttnItem item{batch.token_seq[t], kvh, begin, len,
                    q + t * q_stride + static_cast<int64_t>(kvh) * group * hd};
      float* buf = ThreadScratch().Reserve(static_cast<size_t>(group) * (ld + hd));
      float* o = out + t * out_stride + static_cast<int64_t>(kvh) * group * hd;
      if (simd) {
        internal::AttendTwoPassF16Avx2(kv, layer, item, group, batch.scale, buf, ld,
                                       buf + static_cast<int64_t>(group) * ld, o);
      } else {
        internal::AttendTwoPassF16<ScalarOps<uint16_t>>(kv, layer, item, group, batch.scale, buf,
                                                        ld, buf + static_cast<int64_t>(group) * ld,
                                                        o);
      }
    };
    if (pool != nullptr && n_pairs > 1) {
      std::atomic<int64_t> next{0};
      pool->Run([&](int, int) {
        for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_pairs;
             i = next.fetch_add(1, std::memory_order_relaxed)) {
          run_pair(i);
        }
      });
    } else {
      for (int64_t i = 0; i < n_pairs; ++i) run_pair(i);
    }
    return;
  }

  // Few (token, KV head) pairs -- single-stream decode has n_kv_heads of
  // them -- would leave threads idle: split each context into chunks and
  // merge their softmax states afterwards (flash-decoding).
  int32_t n_split = 1;
  if (n_threads > 1 && n_pairs < 4 * n_threads) {
    int32_t max_len = 0;  // positions attended, windows applied
    for (int32_t t = 0; t < batch.n_tokens; ++t) {
      const int32_t len = batch.token_pos[t] + 1;
      max_len = std::max(max_len, len - WindowBegin(batch, len));
    }
    const int64_t want = (4 * n_threads + n_pairs - 1) / n_pairs;
    const int64_t can = std::max(1, max_len / kMinSplitPositions);
    int64_t split = std::min(want, can);
    // Equal-sized items: a count divisible by the threads leaves none idle
    // at the end (9 items on 2 threads would run 5 + 4).
    while (split < can && (n_pairs * split) % n_threads != 0) ++split;
    n_split = static_cast<int32_t>(split);
  }
  const int64_t n_items = n_pairs * n_split;
  const int64_t state_floats = static_cast<int64_t>(group) * (hd + 2);
  std::vector<float> partials;
  if (n_split > 1) partials.resize(n_items * state_floats);

  auto run_item = [&](int64_t idx) {
    const int64_t pair = idx / n_split;
    const int32_t chunk = static_cast<int32_t>(idx % n_split);
    const int32_t t = static_cast<int32_t>(pair / kv.n_kv_heads);
    const int32_t kvh = static_cast<int32_t>(pair % kv.n_kv_heads);
    const int32_t len = batch.token_pos[t] + 1;
    const int32_t begin = WindowBegin(batch, len);
    // Chunk boundaries on whole blocks so no block is read by two items;
    // the first chunk starts at the window's first position.
    const int32_t first_block = begin / kv.block_size;
    const int32_t n_blocks = (len + kv.block_size - 1) / kv.block_size - first_block;
    const int32_t b0 =
        first_block + static_cast<int32_t>(static_cast<int64_t>(n_blocks) * chunk / n_split);
    const int32_t b1 =
        first_block + static_cast<int32_t>(static_cast<int64_t>(n_blocks) * (chunk + 1) / n_split);
    AttnItem item{batch.token_seq[t], kvh, std::clamp(b0 * kv.block_size, begin, len),
                  std::min(len, b1 * kv.block_size),
                  q + t * q_stride + static_cast<int64_t>(kvh) * group * hd};

    AttnScratch& scratch = ThreadScratch();
    const size_t rows_floats = quantized ? static_cast<size_t>(kPosTile) * hd : 0;
    float* buf =
        scratch.Reserve(state_floats + static_cast<size_t>(group) * kPosTile + rows_floats);
    float* state = n_split > 1 ? partials.data() + idx * state_floats : buf;
    float* scores = buf + state_floats;
    float* rows = scores + static_cast<int64_t>(group) * kPosTile;
    AttnState st{state, state + group, state + 2 * group};
    std::fill(st.m, st.m + group, -std::numeric_limits<float>::infinity());
    std::fill(st.l, st.l + group, 0.0f);
    std::fill(st.acc, st.acc + static_cast<int64_t>(group) * hd, 0.0f);
    if (item.pos_begin < item.pos_end) {
      if (simd) {
        internal::AttendAvx2(kv, layer, item, group, batch.scale, st, scores, rows);
      } else {
        AttendScalar(kv, layer, item, group, batch.scale, st, scores, rows);
      }
    }
    if (n_split == 1) {
      float* o = out + t * out_stride + static_cast<int64_t>(kvh) * group * hd;
      for (int32_t h = 0; h < group; ++h) {
        const float inv = st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f;
        for (int32_t i = 0; i < hd; ++i) o[h * hd + i] = st.acc[h * hd + i] * inv;
      }
    }
  };

  if (pool != nullptr && n_items > 1) {
    // Items differ in cost (ragged lengths, prefill vs decode), so threads
    // pull them one by one instead of taking fixed ranges.
    std::atomic<int64_t> next{0};
    pool->Run([&](int, int) {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        run_item(i);
      }
    });
  } else {
    for (int64_t i = 0; i < n_items; ++i) run_item(i);
  }

  if (n_split > 1) {
    for (int64_t pair = 0; pair < n_pairs; ++pair) {
      const int32_t t = static_cast<int32_t>(pair / kv.n_kv_heads);
      const int32_t kvh = static_cast<int32_t>(pair % kv.n_kv_heads);
      float* o = out + t * out_stride + static_cast<int64_t>(kvh) * group * hd;
      for (int32_t h = 0; h < group; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int32_t c = 0; c < n_split; ++c) {
          m = std::max(m, partials[(pair * n_split + c) * state_floats + h]);
        }
        float l = 0.0f;
        std::fill(o + h * hd, o + (h + 1) * hd, 0.0f);
        for (int32_t c = 0; c < n_split; ++c) {
          const float* st = partials.data() + (pair * n_split + c) * state_floats;
          if (st[group + h] == 0.0f) continue;  // empty chunk
          const float w = std::exp(st[h] - m);
          l += st[group + h] * w;
          const float* acc = st + 2 * group + static_cast<int64_t>(h) * hd;
          for (int32_t i = 0; i < hd; ++i) o[h * hd + i] += acc[i] * w;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int32_t i = 0; i < hd; ++i) o[h * hd + i] *= inv;
      }
    }
  }
}

ScopedF16SplitForTesting::ScopedF16SplitForTesting(bool split)
    : previous_(g_f16_split_override.exchange(split ? 1 : 0)) {}

ScopedF16SplitForTesting::~ScopedF16SplitForTesting() { g_f16_split_override.store(previous_); }

// With an f16 cache the query meets the keys as f16 (see AttendTwoPassF16).
static float QueryElem(float q, KvDType dtype) {
  return dtype == KvDType::kF16 ? Fp16ToFp32(Fp32ToFp16(q)) : q;
}

namespace {

// Softmax weights of one query head over slots [begin, len) of one
// sequence, in plain loops (double accumulation): probs[p] for every slot,
// summing to 1 (0 before begin).
void SlotProbabilities(const PagedKvView& kv, int32_t layer, int32_t seq, int32_t begin,
                       int32_t len, const float* qh, int32_t kvh, float scale,
                       std::vector<float>* row, std::vector<double>* probs) {
  const int32_t hd = kv.head_dim;
  probs->assign(len, 0.0);
  // The query as the keys meet it, once per head rather than once per slot
  // (the same values; the per-slot conversion was most of H2O's mass pass).
  thread_local std::vector<double> qd;
  qd.resize(static_cast<size_t>(hd));
  for (int32_t i = 0; i < hd; ++i) qd[i] = static_cast<double>(QueryElem(qh[i], kv.dtype));
  double mx = -std::numeric_limits<double>::infinity();
  for (int32_t p = begin; p < len; ++p) {
    ReadKvRow(kv, layer, seq, p, kvh, /*value=*/false, row->data());
    double s = 0.0;
    for (int32_t i = 0; i < hd; ++i) s += qd[i] * (*row)[i];
    (*probs)[p] = s * scale;
    mx = std::max(mx, (*probs)[p]);
  }
  double sum = 0.0;
  for (int32_t p = begin; p < len; ++p) {
    (*probs)[p] = std::exp((*probs)[p] - mx);
    sum += (*probs)[p];
  }
  for (int32_t p = begin; p < len; ++p) (*probs)[p] /= sum;
}

}  // namespace

namespace {

// The plain-loop pass both entry points share: per query token and head,
// the slot probabilities, then (when `out`) the weighted values and (when
// `mass`) the probabilities added to the KV head's mass row.
// Tokens [t_begin, t_end) only (the windowed path spreads tokens over
// threads).
void ReferencePass(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                   const float* q, int64_t q_stride, float* out, int64_t out_stride, float* mass,
                   int64_t mass_stride, const uint8_t* seq_wanted, int32_t t_begin = 0,
                   int32_t t_end = -1) {
  const int32_t group = batch.n_heads / kv.n_kv_heads;
  const int32_t hd = kv.head_dim;
  std::vector<double> probs;
  std::vector<double> acc(hd);
  // Every codec is read through the plain-loop ReadKvRow, one row at a time
  // through KeyAt/ValueAt, so the fast path is checked against an
  // independent walk of the layout.
  std::vector<float> row(hd);
  if (t_end < 0) t_end = batch.n_tokens;
  for (int32_t t = t_begin; t < t_end; ++t) {
    const int32_t seq = batch.token_seq[t];
    if (out == nullptr && seq_wanted != nullptr && !seq_wanted[seq]) continue;
    const int32_t len = batch.token_pos[t] + 1;
    const int32_t begin = WindowBegin(batch, len);
    for (int32_t h = 0; h < batch.n_heads; ++h) {
      const int32_t kvh = h / group;
      const float* qh = q + t * q_stride + static_cast<int64_t>(h) * hd;
      SlotProbabilities(kv, layer, seq, begin, len, qh, kvh, batch.scale, &row, &probs);
      if (mass != nullptr) {
        float* m = mass + (static_cast<int64_t>(seq) * kv.n_kv_heads + kvh) * mass_stride;
        for (int32_t p = begin; p < len; ++p) m[p] += static_cast<float>(probs[p]);
      }
      if (out == nullptr) continue;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int32_t p = begin; p < len; ++p) {
        ReadKvRow(kv, layer, seq, p, kvh, /*value=*/true, row.data());
        const double w = kv.dtype == KvDType::kF16
                             ? Fp16ToFp32(Fp32ToFp16(static_cast<float>(probs[p])))
                             : probs[p];
        for (int32_t i = 0; i < hd; ++i) acc[i] += w * row[i];
      }
      float* o = out + t * out_stride + static_cast<int64_t>(h) * hd;
      for (int32_t i = 0; i < hd; ++i) o[i] = static_cast<float>(acc[i]);
    }
  }
}

}  // namespace

void PagedAttentionReference(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                             const float* q, int64_t q_stride, float* out, int64_t out_stride) {
  ReferencePass(kv, layer, batch, q, q_stride, out, out_stride, nullptr, 0, nullptr);
}

void AccumulateAttentionMass(const PagedKvView& kv, int32_t layer, const AttentionBatch& batch,
                             const float* q, int64_t q_stride, float* mass, int64_t mass_stride,
                             const uint8_t* seq_wanted) {
  ReferencePass(kv, layer, batch, q, q_stride, nullptr, 0, mass, mass_stride, seq_wanted);
}

}  // namespace kvserve::kernels
