// Also the pieces of a prefill step (BM_MatMul, BM_PagedPrefillAttention) at
// SmolLM2-135M's shapes, to place the GPU forward's time without a profiler
// (no profiler ran on the lent machine this was written for).
//
// Paged decode attention on the GPU: achieved bandwidth (KV bytes read / time)
// against the device's measured copy bandwidth (kernels/cuda/probe.h), for
// contexts of 1k..32k tokens. Built only with CUDA; exits 1 without a device.
//
//   build-cuda/bench/kvserve_cuda_bench --benchmark_counters_tabular=true
//
// Shape: 8 KV heads x head_dim 128, 32 query heads (GQA 4, Llama-3-8B-like),
// block size 16, one layer, a batch of 16 sequences (one decode token each)
// whose blocks are scattered over the pool, as a live cache's are.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/probe.h"
#include "kernels/cuda/runtime.h"

namespace kvserve {
namespace {

constexpr int32_t kKvHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kHeads = 32;
constexpr int32_t kBlockSize = 16;
constexpr int32_t kBatch = 16;

double g_copy_traffic_gbps = 0;  // from the probe, read + write
std::vector<cuda::DeviceBuffer> keep_;  // small uploads of the running benchmark

// Copies `bytes` of host memory to a new device buffer of `pool`, kept in
// keep_ until the running benchmark clears it; null when allocation fails.
void* Upload(cuda::DeviceMemoryPool& pool, const void* src, size_t bytes) {
  auto b = pool.Allocate(bytes);
  if (!b.ok()) return nullptr;
  (void)cuda::CopyToDevice(b->data(), src, bytes);
  void* p = b->data();
  keep_.push_back(std::move(b).value());
  return p;
}

// A one-layer paged KV view over `pool_mem` with its block table uploaded.
kernels::PagedKvView OneLayerKv(cuda::DeviceMemoryPool& pool, uint8_t* pool_mem, int64_t half,
                                int32_t block_size, int32_t n_kv_heads, int32_t head_dim,
                                kernels::KvDType dtype, const std::vector<int32_t>& ids,
                                const std::vector<int32_t>& offsets) {
  kernels::PagedKvView kv;
  kv.pool = pool_mem;
  kv.block_bytes = 2 * half;
  kv.layer_bytes = 2 * half;
  kv.block_size = block_size;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = head_dim;
  kv.dtype = dtype;
  kv.block_ids = static_cast<const int32_t*>(Upload(pool, ids.data(), ids.size() * 4));
  kv.seq_block_offsets =
      static_cast<const int32_t*>(Upload(pool, offsets.data(), offsets.size() * 4));
  kv.n_seqs = static_cast<int32_t>(offsets.size()) - 1;
  return kv;
}

// Times `reps` launches per benchmark iteration between two events on
// `stream` (amortizing the events' overhead) and reports each launch's
// time; returns the sum of those per-launch times over the iterations.
template <class Launch>
double TimeLaunches(benchmark::State& state, cuda::StreamHandle stream, cuda::CudaEvent& e0,
                    cuda::CudaEvent& e1, int reps, Launch&& launch) {
  double total_s = 0;
  for (auto _ : state) {
    (void)e0.Record(stream);
    for (int r = 0; r < reps; ++r) (void)launch();
    (void)e1.Record(stream);
    (void)e1.Synchronize();
    auto ms = cuda::CudaEvent::ElapsedMs(e0, e1);
    const double sec = ms.ok() ? *ms / 1e3 / reps : 0.0;
    total_s += sec;
    state.SetIterationTime(sec);
  }
  return total_s;
}

void BM_PagedDecodeAttention(benchmark::State& state) {
  const int32_t ctx = static_cast<int32_t>(state.range(0));
  const auto dtype = static_cast<kernels::KvDType>(state.range(1));
  // Stored bytes of one (token, KV head) row: data plus its scale area.
  const int64_t row_bytes =
      kernels::KvRowBytes(dtype, kHeadDim) + kernels::KvRowMetaBytes(dtype, kHeadDim);
  const int64_t half = kernels::PagedKvView::HalfLayerBytes(kBlockSize, kKvHeads, kHeadDim, dtype);
  const int32_t blocks_per_seq = (ctx + kBlockSize - 1) / kBlockSize;
  const int32_t n_blocks = blocks_per_seq * kBatch;

  cuda::DeviceMemoryPool pool;
  auto stream = cuda::CudaStream::Create();
  auto kv_mem = pool.Allocate(static_cast<size_t>(n_blocks) * 2 * half);
  if (!stream.ok() || !kv_mem.ok()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  // 0x3c bytes: every f16 is ~1.06, every f32 ~0.011, int8/fp8 codes times a
  // scale of ~0.011, int4 f16 scale and minimum ~1.06; the math is the same.
  (void)cuda::MemsetAsync(kv_mem->data(), 0x3c, kv_mem->size(), stream->get());

  std::vector<int32_t> ids(n_blocks), offsets(kBatch + 1), seq(kBatch), pos(kBatch, ctx - 1);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  for (int32_t s = 0; s <= kBatch; ++s) offsets[s] = s * blocks_per_seq;
  std::iota(seq.begin(), seq.end(), 0);
  std::vector<float> q(static_cast<size_t>(kBatch) * kHeads * kHeadDim, 0.01f);

  keep_.clear();
  const kernels::PagedKvView kv = OneLayerKv(pool, kv_mem->as<uint8_t>(), half, kBlockSize,
                                             kKvHeads, kHeadDim, dtype, ids, offsets);
  cuda::DecodeAttentionBatch b;
  b.n_tokens = kBatch;
  b.token_seq = static_cast<const int32_t*>(Upload(pool, seq.data(), seq.size() * 4));
  b.token_pos = static_cast<const int32_t*>(Upload(pool, pos.data(), pos.size() * 4));
  b.n_heads = kHeads;
  b.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  b.max_context = ctx;
  const auto* dq = static_cast<const float*>(Upload(pool, q.data(), q.size() * 4));
  auto out = pool.Allocate(q.size() * 4);
  const size_t ws_bytes = cuda::PagedDecodeAttentionWorkspaceBytes(kv, b);
  auto ws = pool.Allocate(std::max<size_t>(ws_bytes, 1));
  auto e0 = cuda::CudaEvent::Create();
  auto e1 = cuda::CudaEvent::Create();
  if (!out.ok() || !ws.ok() || !e0.ok() || !e1.ok() || kv.block_ids == nullptr) {
    state.SkipWithError("setup failed");
    return;
  }
  const int64_t q_dim = int64_t{kHeads} * kHeadDim;
  auto launch = [&] {
    return cuda::PagedDecodeAttention(kv, 0, b, dq, q_dim, out->as<float>(), q_dim, ws->data(),
                                      ws_bytes, stream->get());
  };
  if (absl::Status s = launch(); !s.ok() || !stream->Synchronize().ok()) {
    state.SkipWithError(s.ok() ? "kernel fault" : std::string(s.message()).c_str());
    return;
  }
  const double total_s = TimeLaunches(state, stream->get(), *e0, *e1, 10, launch);
  // K and V (and their scales) of every attended position, every KV head, once.
  const double kv_bytes = 2.0 * kBatch * ctx * kKvHeads * row_bytes;
  state.counters["kv_MB"] = kv_bytes / 1e6;
  const double gbps =
      total_s > 0 ? kv_bytes * static_cast<double>(state.iterations()) / total_s / 1e9 : 0;
  state.counters["GB/s"] = gbps;
  state.counters["pct_of_copy"] =
      g_copy_traffic_gbps > 0 ? 100.0 * gbps / g_copy_traffic_gbps : 0;
  state.counters["splits_ws_KB"] = static_cast<double>(ws_bytes) / 1e3;
  // Decode tokens (one per sequence) per second: the codecs' goal compares
  // these (fp8/int8 read half of f16's bytes, so >= 1.8x its rate).
  state.counters["tok/s"] =
      total_s > 0 ? kBatch * static_cast<double>(state.iterations()) / total_s : 0;
  state.SetLabel(kernels::KvDTypeName(dtype).data());
  keep_.clear();
}


// One matmul of SmolLM2-135M (dim 576, FFN 1536, 3 KV heads of 64) on Q4_1
// weights, kept native (the integer kernels of matmul_q.cu, activations
// quantized per call) or dequantized to f16 at upload (cuBLAS GemmEx, tensor
// cores), for 1..512 tokens. TOPS counts 2 * rows * cols * tokens.
void BM_MatMul(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1), n = state.range(2);
  const auto format = static_cast<cuda::WeightFormat>(state.range(3));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> wf(static_cast<size_t>(rows * cols));
  for (float& v : wf) v = nd(rng);
  const int64_t row_bytes = kernels::RowBytes(kernels::DType::kQ4_1, cols);
  std::vector<uint8_t> wq(static_cast<size_t>(rows * row_bytes));
  for (int64_t r = 0; r < rows; ++r) {
    kernels::QuantizeRowReference(kernels::DType::kQ4_1, wf.data() + r * cols,
                                  wq.data() + r * row_bytes, cols);
  }
  cuda::DeviceMemoryPool pool;
  auto stream = cuda::CudaStream::Create();
  if (!stream.ok()) return state.SkipWithError("stream");
  const kernels::WeightView wv{kernels::DType::kQ4_1, wq.data(), rows, cols};
  auto w = cuda::UploadWeight(wv, format, &pool, stream->get());
  auto mm = cuda::CublasMatMul::Create(&pool, stream->get());
  std::vector<float> xh(static_cast<size_t>(n * cols));
  for (float& v : xh) v = nd(rng) * 20.0f;
  auto x = pool.Allocate(xh.size() * 4);
  auto y = pool.Allocate(static_cast<size_t>(n * rows) * 4);
  auto e0 = cuda::CudaEvent::Create();
  auto e1 = cuda::CudaEvent::Create();
  if (!w.ok() || !mm.ok() || !x.ok() || !y.ok() || !e0.ok() || !e1.ok()) {
    return state.SkipWithError("setup failed");
  }
  (void)cuda::CopyToDevice(x->data(), xh.data(), xh.size() * 4);
  auto launch = [&] {
    return (*mm)->MatMul(*w, x->as<float>(), n, cols, y->as<float>(), rows);
  };
  if (absl::Status st = launch(); !st.ok() || !stream->Synchronize().ok()) {
    return state.SkipWithError(st.ok() ? "kernel fault" : std::string(st.message()).c_str());
  }
  const double total_s = TimeLaunches(state, stream->get(), *e0, *e1, 20, launch);
  const double per_call = total_s / static_cast<double>(state.iterations());
  state.counters["TOPS"] = per_call > 0 ? 2.0 * rows * cols * n / per_call / 1e12 : 0;
  state.counters["weight_GB/s"] =
      per_call > 0 ? static_cast<double>(w->data.size()) / per_call / 1e9 : 0;
  state.SetLabel(format == cuda::WeightFormat::kNative ? "q4_1 native" : "f16 cublas");
}

// One layer's prefill attention, f16 KV, block 16: one sequence's chunk of
// `n` query rows at the end of a context of `ctx` positions. Shapes:
// SmolLM2 (9 query heads, 3 KV heads of 64) and Gemma 3 270M (4 query
// heads, 1 KV head of 256). `kernel`: 0 the tiled prefill kernel, 1 the
// decode kernel on the same rows (how 256-wide prefill chunks ran before
// the prefill kernel took them). TFLOPS counts QK^T and PV over the causal
// part (2 * 2 * head_dim * heads * attended pairs).
void BM_PagedPrefillAttention(benchmark::State& state) {
  const int32_t n = static_cast<int32_t>(state.range(0)), ctx = static_cast<int32_t>(state.range(1));
  const bool gemma = state.range(2) == 1;
  const bool decode_kernel = state.range(3) == 1;
  const int32_t kH = gemma ? 4 : 9, kKvH = gemma ? 1 : 3, kD = gemma ? 256 : 64;
  constexpr int32_t kB = 16;
  const auto dtype = kernels::KvDType::kF16;
  const int64_t half = kernels::PagedKvView::HalfLayerBytes(kB, kKvH, kD, dtype);
  const int32_t n_blocks = (ctx + kB - 1) / kB;
  cuda::DeviceMemoryPool pool;
  auto stream = cuda::CudaStream::Create();
  auto kv_mem = pool.Allocate(static_cast<size_t>(n_blocks) * 2 * half);
  if (!stream.ok() || !kv_mem.ok()) return state.SkipWithError("device allocation failed");
  (void)cuda::MemsetAsync(kv_mem->data(), 0x3c, kv_mem->size(), stream->get());
  std::vector<int32_t> ids(n_blocks), offsets = {0, n_blocks}, qoff = {0, n}, lens = {ctx};
  std::iota(ids.begin(), ids.end(), 0);
  keep_.clear();
  const kernels::PagedKvView kv =
      OneLayerKv(pool, kv_mem->as<uint8_t>(), half, kB, kKvH, kD, dtype, ids, offsets);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  cuda::PrefillAttentionBatch b;
  b.q_seq_offsets = static_cast<const int32_t*>(Upload(pool, qoff.data(), qoff.size() * 4));
  b.seq_lens = static_cast<const int32_t*>(Upload(pool, lens.data(), lens.size() * 4));
  b.max_q_per_seq = n;
  b.n_heads = kH;
  b.scale = scale;
  // The same rows as decode rows: sequence 0 at positions ctx - n .. ctx - 1.
  std::vector<int32_t> seq(n, 0), pos(n);
  std::iota(pos.begin(), pos.end(), ctx - n);
  cuda::DecodeAttentionBatch d;
  d.n_tokens = n;
  d.token_seq = static_cast<const int32_t*>(Upload(pool, seq.data(), seq.size() * 4));
  d.token_pos = static_cast<const int32_t*>(Upload(pool, pos.data(), pos.size() * 4));
  d.n_heads = kH;
  d.scale = scale;
  d.max_context = ctx;
  const size_t ws_bytes = decode_kernel ? cuda::PagedDecodeAttentionWorkspaceBytes(kv, d) : 0;
  auto ws_buf = pool.Allocate(std::max<size_t>(ws_bytes, 1));
  void* ws = ws_bytes > 0 && ws_buf.ok() ? ws_buf->data() : nullptr;
  const int64_t q_dim = int64_t{kH} * kD;
  std::vector<float> qh(static_cast<size_t>(n * q_dim), 0.01f);
  const auto* q = static_cast<const float*>(Upload(pool, qh.data(), qh.size() * 4));
  auto out = pool.Allocate(qh.size() * 4);
  auto e0 = cuda::CudaEvent::Create();
  auto e1 = cuda::CudaEvent::Create();
  if (!out.ok() || !e0.ok() || !e1.ok() || q == nullptr || (ws_bytes > 0 && ws == nullptr)) {
    return state.SkipWithError("setup failed");
  }
  auto launch = [&] {
    if (decode_kernel) {
      return cuda::PagedDecodeAttention(kv, 0, d, q, q_dim, out->as<float>(), q_dim, ws, ws_bytes,
                                        stream->get());
    }
    return cuda::PagedPrefillAttention(kv, 0, b, q, q_dim, out->as<float>(), q_dim, stream->get());
  };
  if (absl::Status st = launch(); !st.ok() || !stream->Synchronize().ok()) {
    return state.SkipWithError(st.ok() ? "kernel fault" : std::string(st.message()).c_str());
  }
  const double total_s = TimeLaunches(state, stream->get(), *e0, *e1, 10, launch);
  // Query row i (position ctx - n + i) attends ctx - n + i + 1 positions.
  const double pairs = static_cast<double>(n) * (ctx - n) + 0.5 * n * (n + 1.0);
  const double per_call = total_s / static_cast<double>(state.iterations());
  state.counters["TFLOPS"] = per_call > 0 ? 4.0 * kD * kH * pairs / per_call / 1e12 : 0;
  state.SetLabel(std::string(gemma ? "gemma3 4x256/1" : "smollm2 9x64/3") +
                 (decode_kernel ? " decode kernel" : " prefill kernel"));
  keep_.clear();
}
}  // namespace
}  // namespace kvserve

BENCHMARK(kvserve::BM_PagedDecodeAttention)
    ->ArgsProduct({{1024, 2048, 4096, 8192, 16384, 32768},
                   {static_cast<int64_t>(kvserve::kernels::KvDType::kF16),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kBF16),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kF32),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kInt8),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kFp8E4M3),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kFp8E5M2),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kInt4),
                    static_cast<int64_t>(kvserve::kernels::KvDType::kInt4G64)}})
    ->ArgNames({"ctx", "dtype"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(kvserve::BM_MatMul)
    ->ArgsProduct({{576}, {576}, {1, 8, 64, 512},
                   {static_cast<int64_t>(kvserve::cuda::WeightFormat::kNative),
                    static_cast<int64_t>(kvserve::cuda::WeightFormat::kF16)}})
    ->ArgsProduct({{1536}, {576}, {1, 8, 64, 512},
                   {static_cast<int64_t>(kvserve::cuda::WeightFormat::kNative),
                    static_cast<int64_t>(kvserve::cuda::WeightFormat::kF16)}})
    ->ArgsProduct({{576}, {1536}, {1, 8, 64, 512},
                   {static_cast<int64_t>(kvserve::cuda::WeightFormat::kNative),
                    static_cast<int64_t>(kvserve::cuda::WeightFormat::kF16)}})
    ->ArgNames({"rows", "cols", "tokens", "fmt"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(kvserve::BM_PagedPrefillAttention)
    ->Args({64, 64, 0, 0})
    ->Args({512, 512, 0, 0})
    ->Args({512, 2048, 0, 0})
    ->ArgsProduct({{512}, {512, 2048}, {1}, {0, 1}})
    ->ArgNames({"chunk", "ctx", "gemma3", "decode_kernel"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (absl::Status s = kvserve::cuda::CudaUsable(); !s.ok()) {
    std::fprintf(stderr, "kvserve_cuda_bench: no usable CUDA device: %s\n",
                 std::string(s.message()).c_str());
    return 1;
  }
  auto probe = kvserve::cuda::ProbeBandwidth();
  if (!probe.ok()) {
    std::fprintf(stderr, "kvserve_cuda_bench: probe failed: %s\n", probe.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", kvserve::cuda::FormatBandwidthReport(*probe).c_str());
  kvserve::g_copy_traffic_gbps = probe->d2d_traffic_gbps;
  benchmark::AddCustomContext("copy_traffic_GBps", std::to_string(probe->d2d_traffic_gbps));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("roofline: paged decode attention GB/s (KV bytes read / time) vs %.1f GB/s "
              "device copy traffic (read + write); goal >= 80%% for long contexts\n",
              probe->d2d_traffic_gbps);
  return 0;
}
