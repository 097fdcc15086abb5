// Kernel micro-benchmarks. The matmul shapes are SmolLM2-135M's (dim 576,
// 9/3 heads of 64, FFN 1536, vocab 49152): the default model, whose decode
// the engine must run at least as fast as llama.cpp on the same CPU.
//
//   ninja -C build-kern kvserve_kernels_bench
//   build-kern/bench/kvserve_kernels_bench --benchmark_filter='MatMul/q4_1'
//
// weight_GB/s counts weight bytes read per second (decode is bound by it).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul_internal.h"
#include "kernels/cpu/kv_transcode.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/dtype.h"

namespace kvserve::kernels {
namespace {

ThreadPool* Pool(int threads) {
  if (threads <= 1) return nullptr;
  static ThreadPool pool(threads);
  return &pool;
}

// Quantized random weights. Quantizing a tile and repeating it keeps setup
// fast for the 49152-row head; the kernels' speed does not depend on values.
// The formats only read from files (no quantizer here): random blocks with
// finite fp16 scales, which is all a kernel's speed depends on.
bool HasQuantizer(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || t == DType::kQ8_0 ||
         t == DType::kQ4_0 || t == DType::kQ4_1;
}

std::vector<uint8_t> RandomBlocks(DType type, int64_t rows, int64_t cols) {
  std::vector<uint8_t> w(RowBytes(type, cols) * rows);
  std::mt19937 rng(1);
  for (size_t i = 0; i < w.size(); i += 4) {
    const uint32_t v = rng();
    std::memcpy(&w[i], &v, std::min<size_t>(4, w.size() - i));
  }
  // fp16 fields at these offsets of each block; 0x2000 is 2^-7.
  std::vector<int> halves = {0};
  if (type == DType::kQ5_1 || type == DType::kQ4_K || type == DType::kQ5_K) halves = {0, 2};
  if (type == DType::kQ2_K) halves = {80, 82};
  if (type == DType::kQ3_K) halves = {108};
  if (type == DType::kQ6_K) halves = {208};
  const uint16_t h = 0x2000;
  for (size_t off = 0; off < w.size(); off += BlockBytes(type)) {
    for (int o : halves) std::memcpy(&w[off + o], &h, 2);
  }
  return w;
}

std::vector<uint8_t> MakeWeights(DType type, int64_t rows, int64_t cols) {
  if (!HasQuantizer(type)) return RandomBlocks(type, rows, cols);
  const int64_t row_bytes = RowBytes(type, cols);
  const int64_t tile_rows = std::min<int64_t>(rows, 256);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> src(cols);
  std::vector<uint8_t> w(row_bytes * rows);
  for (int64_t r = 0; r < tile_rows; ++r) {
    for (auto& v : src) v = dist(rng);
    QuantizeRowReference(type, src.data(), w.data() + r * row_bytes, cols);
  }
  for (int64_t r = tile_rows; r < rows; r += tile_rows) {
    std::memcpy(w.data() + r * row_bytes, w.data(), std::min(tile_rows, rows - r) * row_bytes);
  }
  return w;
}

std::vector<float> MakeActs(int64_t n) {
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

void BM_MatMul(benchmark::State& state, DType type, int64_t rows, int64_t cols, int n_tokens,
               bool reference, int threads, bool packed = false) {
  const auto w = MakeWeights(type, rows, cols);
  const auto x = MakeActs(n_tokens * cols);
  std::vector<float> y(n_tokens * rows);
  WeightView view{type, w.data(), rows, cols};
  // packed: the 16-row panels the model loads (VNNI panel kernel, AMX from
  // AmxMinTokens() tokens where the CPU has it); else the GGUF rows.
  const std::shared_ptr<const PackedWeight> pw = packed ? PackWeight(view) : nullptr;
  if (packed && pw == nullptr) {
    state.SkipWithError("no AVX-512 VNNI: nothing to pack for");
    return;
  }
  view.packed = pw.get();
  ThreadPool* pool = Pool(threads);
  for (auto _ : state) {
    if (reference) {
      MatMulReference(view, x.data(), n_tokens, cols, y.data(), rows);
    } else {
      MatMul(view, x.data(), n_tokens, cols, y.data(), rows, pool);
    }
    benchmark::ClobberMemory();
  }
  state.counters["weight_GB/s"] = benchmark::Counter(static_cast<double>(w.size()),
                                                     benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * rows * cols * n_tokens,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// One format's decode from DRAM: 24 distinct 1536 x 2048 and 2048 x 1536
// matrices (75M weights, 40-80 MB for the 4-6 bit formats, beyond the 32 MB
// L3), all run once per iteration as a forward pass runs its layers.
// weight_GB/s is the figure to hold against the machine's read bandwidth;
// tokens/s counts n_tokens per pass.
void BM_FormatPass(benchmark::State& state, DType type, int threads, bool packed = false) {
  const int n_tokens = static_cast<int>(state.range(0));
  std::vector<std::vector<uint8_t>> owned;
  std::vector<WeightView> views;
  for (int i = 0; i < 24; ++i) {
    const int64_t rows = i % 2 ? 1536 : 2048;
    const int64_t cols = i % 2 ? 2048 : 1536;
    owned.push_back(MakeWeights(type, rows, cols));
    views.push_back({type, owned.back().data(), rows, cols});
  }
  // packed: the panels the model loads, as it reads them.
  std::vector<std::shared_ptr<const PackedWeight>> packs;
  if (packed) {
    for (WeightView& v : views) {
      packs.push_back(PackWeight(v));
      if (packs.back() == nullptr) {
        state.SkipWithError("no AVX-512 VNNI or not a panel format");
        return;
      }
      v.packed = packs.back().get();
    }
  }
  size_t bytes = 0;
  for (const auto& o : owned) bytes += o.size();
  const auto x = MakeActs(n_tokens * 2048);
  std::vector<float> y(n_tokens * 2048);
  ThreadPool* pool = Pool(threads);
  for (auto _ : state) {
    for (const WeightView& v : views) {
      MatMul(v, x.data(), n_tokens, v.cols, y.data(), v.rows, pool);
    }
    benchmark::ClobberMemory();
  }
  state.counters["weight_GB/s"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(n_tokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// Every matmul of one SmolLM2-135M decode step (30 layers of q, k, v, o,
// gate, up, down in Q4_1 plus the Q8_0 output head) over distinct weights,
// ~96 MB, so nothing stays in cache between layers as in the real forward.
// items/s = decode tokens/s of the matmul share of a forward. `fused` runs
// q/k/v and gate/up through MatMulMany (one dispatch each).
void BM_SmolLM2DecodeMatMuls(benchmark::State& state, int threads, bool fused,
                             bool packed = false) {
  struct Mat {
    int64_t rows, cols;
  };
  const Mat layer[] = {{576, 576},  {192, 576},  {192, 576}, {576, 576},
                       {1536, 576}, {1536, 576}, {576, 1536}};
  const int n_tokens = static_cast<int>(state.range(0));
  std::vector<std::vector<uint8_t>> owned;
  std::vector<WeightView> views;
  for (int l = 0; l < 30; ++l) {
    for (const Mat& m : layer) {
      owned.push_back(MakeWeights(DType::kQ4_1, m.rows, m.cols));
      views.push_back({DType::kQ4_1, owned.back().data(), m.rows, m.cols});
    }
  }
  owned.push_back(MakeWeights(DType::kQ8_0, 49152, 576));
  views.push_back({DType::kQ8_0, owned.back().data(), 49152, 576});
  size_t bytes = 0;
  for (const auto& o : owned) bytes += o.size();
  std::vector<std::shared_ptr<const PackedWeight>> packs;
  if (packed) {
    for (WeightView& v : views) {
      packs.push_back(PackWeight(v));
      v.packed = packs.back().get();
    }
  }
  const auto x = MakeActs(n_tokens * 1536);
  std::vector<float> y(n_tokens * 49152);
  ThreadPool* pool = Pool(threads);
  std::vector<float> y2(n_tokens * 1536), y3(n_tokens * 1536);
  for (auto _ : state) {
    if (!fused) {
      for (const WeightView& v : views) {
        MatMul(v, x.data(), n_tokens, v.cols, y.data(), v.rows, pool);
      }
    } else {
      for (int l = 0; l < 30; ++l) {
        const WeightView* lv = &views[l * 7];
        float* qkv_out[3] = {y.data(), y2.data(), y3.data()};
        const int64_t qkv_strides[3] = {576, 192, 192};
        MatMulMany(lv, 3, x.data(), n_tokens, 576, qkv_out, qkv_strides, pool);
        MatMul(lv[3], x.data(), n_tokens, 576, y.data(), 576, pool);
        float* gu_out[2] = {y2.data(), y3.data()};
        const int64_t gu_strides[2] = {1536, 1536};
        MatMulMany(lv + 4, 2, x.data(), n_tokens, 576, gu_out, gu_strides, pool);
        MatMul(lv[6], x.data(), n_tokens, 1536, y.data(), 576, pool);
      }
      MatMul(views.back(), x.data(), n_tokens, 576, y.data(), 49152, pool);
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n_tokens);
  state.counters["weight_GB/s"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// Every matmul of one Gemma 3 270M Q4_K_M forward over distinct packed
// weights in the file's formats (18 layers: q, k, v in Q5_0 -- v Q8_0 on
// half the layers --, the output projection in Q4_K, gate and up in Q5_0,
// down in Q6_K or Q4_K; then the tied 262,144 x 640 Q8_0 head, 178 MB), as
// the forward calls them, packed into one PanelArena as the model loads them. part 0: all of it; 1: the layers only (68 MB);
// 2: the head only. weight_GB/s counts the GGUF bytes read per pass, the
// figure to hold against the machine's read bandwidth; items/s = tokens/s
// of the matmul share of a decode step (or prefill chunk, n_tokens > 1).
void BM_GemmaMatMuls(benchmark::State& state, int threads, int part) {
  const int n_tokens = static_cast<int>(state.range(0));
  struct Layer {
    WeightView q, k, v, o, gate, up, down;
  };
  std::vector<std::vector<uint8_t>> owned;
  std::vector<std::shared_ptr<const PackedWeight>> packs;
  size_t bytes = 0;
  PanelArena arena;  // as the model packs them (one arena, huge pages)
  auto make = [&](DType type, int64_t rows, int64_t cols) {
    owned.push_back(MakeWeights(type, rows, cols));
    WeightView v{type, owned.back().data(), rows, cols};
    packs.push_back(PackWeight(v, &arena));
    v.packed = packs.back().get();
    return v;
  };
  std::vector<Layer> layers;
  if (part != 2) {
    for (int l = 0; l < 18; ++l) {
      Layer L;
      L.q = make(DType::kQ5_0, 1024, 640);
      L.k = make(DType::kQ5_0, 256, 640);
      L.v = make(l % 2 ? DType::kQ8_0 : DType::kQ5_0, 256, 640);
      L.o = make(DType::kQ4_K, 640, 1024);
      L.gate = make(DType::kQ5_0, 2048, 640);
      L.up = make(DType::kQ5_0, 2048, 640);
      L.down = make(l % 2 ? DType::kQ6_K : DType::kQ4_K, 640, 2048);
      layers.push_back(L);
    }
  }
  WeightView head{};
  if (part != 1) head = make(DType::kQ8_0, 262144, 640);
  for (const auto& o : owned) bytes += o.size();
  if (std::any_of(packs.begin(), packs.end(), [](const auto& p) { return p == nullptr; })) {
    state.SkipWithError("no AVX-512 VNNI: nothing to pack for");
    return;
  }
  const auto x = MakeActs(n_tokens * 2048);
  std::vector<float> y(static_cast<size_t>(n_tokens) * (part != 1 ? 262144 : 2048));
  std::vector<float> y2(n_tokens * 2048), y3(n_tokens * 2048);
  ThreadPool* pool = Pool(threads);
  for (auto _ : state) {
    for (const Layer& L : layers) {
      const WeightView qkv[3] = {L.q, L.k, L.v};
      float* qkv_out[3] = {y.data(), y2.data(), y3.data()};
      const int64_t qkv_strides[3] = {1024, 256, 256};
      MatMulMany(qkv, 3, x.data(), n_tokens, 640, qkv_out, qkv_strides, pool);
      MatMul(L.o, x.data(), n_tokens, 1024, y.data(), 640, pool);
      const WeightView gu[2] = {L.gate, L.up};
      float* gu_out[2] = {y2.data(), y3.data()};
      const int64_t gu_strides[2] = {2048, 2048};
      MatMulMany(gu, 2, x.data(), n_tokens, 640, gu_out, gu_strides, pool);
      MatMul(L.down, x.data(), n_tokens, 2048, y.data(), 640, pool);
    }
    if (part != 1) MatMul(head, x.data(), n_tokens, 640, y.data(), 262144, pool);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n_tokens);
  state.counters["weight_GB/s"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// One layer's attention of a single decode token at context `ctx`, SmolLM2
// geometry (9 query heads, 3 KV heads of 64), 16-token blocks.
// One decode token's attention over ctx positions. Shape: SmolLM2's (3 KV
// heads x 3 query heads, head_dim 64), or with gemma Gemma 3 270M's (1 KV
// head x 4, head_dim 256). split: -1 the kernel's own choice, 0 one thread
// per (token, KV head), 1 each pair's steps spread over the threads (f16).
void BM_AttentionDecode(benchmark::State& state, KvDType dtype, bool reference, int threads,
                        bool gemma, int split) {
  const int32_t ctx = static_cast<int32_t>(state.range(0));
  constexpr int32_t kBlock = 16;
  const int32_t kKvHeads = gemma ? 1 : 3, kHeads = gemma ? 4 : 9, kHeadDim = gemma ? 256 : 64;
  std::unique_ptr<kernels::ScopedF16SplitForTesting> forced;
  if (split >= 0) forced = std::make_unique<kernels::ScopedF16SplitForTesting>(split == 1);
  PagedKvView kv;
  kv.block_size = kBlock;
  kv.n_kv_heads = kKvHeads;
  kv.head_dim = kHeadDim;
  kv.dtype = dtype;
  kv.layer_bytes = 2 * PagedKvView::HalfLayerBytes(kBlock, kKvHeads, kHeadDim, dtype);
  kv.block_bytes = kv.layer_bytes;
  const int32_t n_blocks = (ctx + kBlock - 1) / kBlock;
  std::vector<uint8_t> storage(n_blocks * kv.block_bytes);
  std::vector<int32_t> ids(n_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  const int32_t offsets[2] = {0, n_blocks};
  kv.pool = storage.data();
  kv.block_ids = ids.data();
  kv.seq_block_offsets = offsets;
  kv.n_seqs = 1;
  const int64_t row = kKvHeads * kHeadDim;
  const auto kvals = MakeActs(ctx * row);
  std::vector<int32_t> seqs(ctx, 0), pos(ctx);
  std::iota(pos.begin(), pos.end(), 0);
  AppendKv(kv, 0, ctx, seqs.data(), pos.data(), kvals.data(), row, kvals.data(), row);

  const auto q = MakeActs(kHeads * kHeadDim);
  std::vector<float> out(kHeads * kHeadDim);
  const int32_t seq = 0, last = ctx - 1;
  AttentionBatch batch{1, &seq, &last, kHeads, 1.0f / std::sqrt(static_cast<float>(kHeadDim))};
  ThreadPool* pool = Pool(threads);
  for (auto _ : state) {
    if (reference) {
      PagedAttentionReference(kv, 0, batch, q.data(), kHeads * kHeadDim, out.data(),
                              kHeads * kHeadDim);
    } else {
      PagedAttention(kv, 0, batch, q.data(), kHeads * kHeadDim, out.data(), kHeads * kHeadDim,
                     pool);
    }
    benchmark::ClobberMemory();
  }
  // Stored bytes read per token, scales included.
  state.counters["kv_GB/s"] = benchmark::Counter(static_cast<double>(ctx) * kv.layer_bytes / kBlock,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// Element-wise ops at SmolLM2 sizes: SiluMul over the FFN width, softmax
// over the vocabulary, RmsNorm and RoPE over one token.
void BM_Ops(benchmark::State& state, int which, bool reference) {
  constexpr int64_t kDim = 576, kFfn = 1536, kVocab = 49152, kGemmaVocab = 262144;
  auto a = MakeActs(kGemmaVocab);
  const auto b = MakeActs(kGemmaVocab);
  std::vector<float> out(kGemmaVocab);
  const RopeParams rope{64, 64, 100000.0f, RopeStyle::kNorm};
  for (auto _ : state) {
    switch (which) {
      case 0:
        reference ? RmsNormReference(a.data(), b.data(), 1, kDim, 1e-5f, out.data())
                  : RmsNorm(a.data(), b.data(), 1, kDim, 1e-5f, out.data());
        break;
      case 1:
        reference ? SiluMulReference(a.data(), b.data(), kFfn, out.data())
                  : SiluMul(a.data(), b.data(), kFfn, out.data());
        break;
      case 2:
        reference ? RopeReference(a.data(), 9, 1000, rope) : Rope(a.data(), 9, 1000, rope);
        break;
      case 3:
        std::copy(b.begin(), b.begin() + kVocab, out.begin());
        benchmark::DoNotOptimize(SoftmaxInPlace(out.data(), kVocab));
        break;
      case 4:  // greedy decoding over Gemma 3's vocabulary
        benchmark::DoNotOptimize(reference ? ArgMaxReference(b.data(), kGemmaVocab)
                                           : ArgMax(b.data(), kGemmaVocab));
        break;
    }
    benchmark::ClobberMemory();
  }
}

// One whole KV block re-encoded as the host tier does on demotion (from the
// pool's codec to --kv-host-dtype) and back on promotion: SmolLM2's block
// (30 layers, 3 KV heads of 64, 16 slots). The bytes counted are the f32
// values the block holds.
void BM_TranscodeKvBlock(benchmark::State& state, KvDType from, KvDType to) {
  const KvBlockShape shape{30, 3, 64, 16};
  const int64_t values =
      2LL * shape.n_layers * shape.n_kv_heads * shape.head_dim * shape.block_size;
  const auto f32 = MakeActs(values);
  // A real block of codec `from`: f32 values through the block transcoder.
  std::vector<uint8_t> src(KvBlockBytes(from, shape));
  TranscodeKvBlock(shape, KvDType::kF32, reinterpret_cast<const uint8_t*>(f32.data()), from,
                   src.data());
  std::vector<uint8_t> dst(KvBlockBytes(to, shape));
  for (auto _ : state) {
    TranscodeKvBlock(shape, from, src.data(), to, dst.data());
    benchmark::ClobberMemory();
  }
  state.counters["values/s"] = benchmark::Counter(static_cast<double>(values),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

void RegisterAll() {
  struct Shape {
    DType type;
    int64_t rows, cols;
  };
  std::vector<Shape> shapes;
  for (DType t :
       {DType::kQ4_1, DType::kQ4_0, DType::kQ8_0, DType::kF16, DType::kBF16, DType::kF32}) {
    for (auto [r, c] :
         {std::pair<int64_t, int64_t>{576, 576}, {192, 576}, {1536, 576}, {576, 1536}}) {
      shapes.push_back({t, r, c});
    }
  }
  shapes.push_back({DType::kQ8_0, 49152, 576});
  // Issue 40's formats at an in-cache shape (kernel compute rate).
  for (DType t : {DType::kQ4_K, DType::kQ6_K, DType::kQ5_0, DType::kQ5_K, DType::kQ3_K,
                  DType::kQ2_K, DType::kIQ4_NL, DType::kIQ4_XS, DType::kQ5_1}) {
    shapes.push_back({t, 576, 1536});
  }
  for (const Shape& s : shapes) {
    const std::string base = std::string("MatMul/") + DTypeName(s.type) + "/" +
                             std::to_string(s.rows) + "x" + std::to_string(s.cols);
    for (int n_tokens : {1, 8, 32}) {
      for (int threads : {1, 2}) {
        benchmark::RegisterBenchmark(
            (base + "/t" + std::to_string(n_tokens) + "/threads:" + std::to_string(threads))
                .c_str(),
            BM_MatMul, s.type, s.rows, s.cols, n_tokens, false, threads, false)
            ->UseRealTime();
      }
    }
    if (kernels::internal::CanPackPanels(s.type)) {
      // One thread, CPU time: GGUF rows (the row kernels) against packed
      // panels, side by side in one run.
      for (int n_tokens : {1, 8, 32, 128}) {
        for (bool packed : {false, true}) {
          benchmark::RegisterBenchmark(
              (base + "/t" + std::to_string(n_tokens) + (packed ? "/panels" : "/rows")).c_str(),
              BM_MatMul, s.type, s.rows, s.cols, n_tokens, false, 1, packed);
        }
      }
    }
    benchmark::RegisterBenchmark((base + "/t1/reference").c_str(), BM_MatMul, s.type, s.rows,
                                 s.cols, 1, true, 1, false)
        ->UseRealTime();
  }
  // Per-format passes over DRAM-resident weights (issue 40's formats next to
  // the older ones): batch-1 decode GB/s, batch 32-128 tokens/s.
  for (DType t :
       {DType::kQ4_K, DType::kQ6_K, DType::kQ5_0, DType::kQ8_0, DType::kQ5_K, DType::kQ3_K,
        DType::kQ2_K, DType::kIQ4_NL, DType::kIQ4_XS, DType::kQ5_1, DType::kQ4_0, DType::kQ4_1}) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          (std::string("FormatPass/") + DTypeName(t) + "/threads:" + std::to_string(threads))
              .c_str(),
          BM_FormatPass, t, threads, false)
          ->Arg(1)
          ->Arg(32)
          ->Arg(128)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      if (kernels::internal::CanPackPanels(t)) {
        benchmark::RegisterBenchmark((std::string("FormatPass/") + DTypeName(t) +
                                      "/panels/threads:" + std::to_string(threads))
                                         .c_str(),
                                     BM_FormatPass, t, threads, true)
            ->Arg(1)
            ->Arg(32)
            ->Arg(128)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  for (bool fused : {false, true}) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          (std::string("SmolLM2DecodeMatMuls/") + (fused ? "fused" : "separate") +
           "/threads:" + std::to_string(threads))
              .c_str(),
          BM_SmolLM2DecodeMatMuls, threads, fused, false)
          ->Arg(1)
          ->Arg(8)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  // The model's layout: every matrix in 16-row panels (VNNI / AMX kernels).
  benchmark::RegisterBenchmark("SmolLM2DecodeMatMuls/fused/panels/threads:1",
                               BM_SmolLM2DecodeMatMuls, 1, true, true)
      // 1: decode alone; 2-8: a speculative verify chunk or a small decode
      // batch; 16, 64: prefill chunks (AMX where the CPU has it).
      ->Arg(1)
      ->Arg(2)
      ->Arg(3)
      ->Arg(4)
      ->Arg(8)
      ->Arg(16)
      ->Arg(64)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("SmolLM2DecodeMatMuls/fused/rows/threads:1", BM_SmolLM2DecodeMatMuls,
                               1, true, false)
      ->Arg(1)
      ->Arg(8)
      ->Unit(benchmark::kMillisecond);
  for (int part : {0, 1, 2}) {
    static const char* kParts[] = {"all", "layers", "head"};
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark((std::string("GemmaMatMuls/") + kParts[part] +
                                    "/threads:" + std::to_string(threads))
                                       .c_str(),
                                   BM_GemmaMatMuls, threads, part)
          ->Arg(1)
          ->Arg(128)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  const char* op_names[] = {"RmsNorm/576", "SiluMul/1536", "Rope/9x64", "Softmax/49152",
                            "ArgMax/262144"};
  for (int which = 0; which < 5; ++which) {
    benchmark::RegisterBenchmark((std::string("Ops/") + op_names[which]).c_str(), BM_Ops, which,
                                 false);
    if (which != 3) {
      benchmark::RegisterBenchmark((std::string("Ops/") + op_names[which] + "/reference").c_str(),
                                   BM_Ops, which, true);
    }
  }
  // Demotion (f16 pool to each host codec) and promotion (back).
  for (KvDType host : {KvDType::kInt8, KvDType::kFp8E4M3, KvDType::kInt4Kivi}) {
    const std::string name(KvDTypeName(host));
    benchmark::RegisterBenchmark(("TranscodeKvBlock/f16->" + name).c_str(), BM_TranscodeKvBlock,
                                 KvDType::kF16, host)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("TranscodeKvBlock/" + name + "->f16").c_str(),
                                 BM_TranscodeKvBlock, host, KvDType::kF16)
        ->Unit(benchmark::kMicrosecond);
  }
  for (KvDType dt : kAllKvDTypes) {
    const std::string base = std::string("AttentionDecode/") + std::string(KvDTypeName(dt));
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark((base + "/threads:" + std::to_string(threads)).c_str(),
                                   BM_AttentionDecode, dt, false, threads, false, -1)
          ->Arg(512)
          ->Arg(2048)
          ->UseRealTime();
    }
    benchmark::RegisterBenchmark((base + "/reference").c_str(), BM_AttentionDecode, dt, true, 1,
                                 false, -1)
        ->Arg(512)
        ->Arg(2048)
        ->UseRealTime();
  }
  // Single-stream decode on an f16 cache: one (token, KV head) pair per
  // thread or its steps split over both threads, by context length, for
  // SmolLM2's and Gemma 3 270M's heads (kMinF16SplitWork in attention.cc).
  for (bool gemma : {false, true}) {
    for (int split : {-1, 0, 1}) {
      const char* how = split < 0 ? "auto" : split == 0 ? "whole" : "split";
      benchmark::RegisterBenchmark((std::string("AttentionDecodeSplit/") +
                                    (gemma ? "gemma3" : "smollm2") + "/f16/threads:2/" + how)
                                       .c_str(),
                                   BM_AttentionDecode, KvDType::kF16, false, 2, gemma, split)
          ->Arg(32)
          ->Arg(64)
          ->Arg(128)
          ->Arg(256)
          ->Arg(512)
          ->Arg(1024)
          ->Arg(4096)
          ->UseRealTime();
    }
  }
}

}  // namespace
}  // namespace kvserve::kernels

int main(int argc, char** argv) {
  kvserve::kernels::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
