// Quantized matmuls on weights kept in their GGUF bytes (WeightFormat::kNative,
// layouts in matmul.h), with the CPU backend's numerics (kernels/cpu/matmul.cc):
//
// - QuantizeActsKernel is QuantizeActsScalar: per 32-element block, amax,
//   q = round-half-even(x * (127 / amax)), d = amax / 127 through fp16, and
//   the ActSum term. Every float operation is a single IEEE rounding
//   (__fmul_rn/__fdiv_rn), so nvcc cannot contract it into something the CPU
//   does not compute; the reductions (max, integer sum) are exact in any order.
// - MatVecKernel computes each block's int32 dot product exactly (dp4a) and
//   combines it with the scales by MatMulRowsScalar's expression,
//   (acc * d) * xd [+ m * xs], again one rounding per operation. Only the
//   float sum over blocks is ordered differently (per thread, then across
//   the threads of a row).
//
// Shape: kLanesPerRow (8) threads per weight row striding over its blocks
// with 16-byte loads of quants (8 threads read 128 contiguous bytes of Q4,
// 256 of Q8_0, per step; 8 rather than 32 keeps all threads busy on short
// rows such as SmolLM2's 18 blocks); a CUDA block is 16 rows and a tile of
// up to kMaxT tokens whose quantized activations are staged in shared memory
// when they fit. Tokens beyond the tile are further grid rows (blockIdx.y),
// which re-read the weights (from L2) once per kMaxT tokens: enough for
// decode and modest prefill, not a tuned prefill GEMM.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/matmul.h"

namespace kvserve::cuda {
namespace {

using internal::DequantElem;
using internal::ExtFormat;
using internal::IsExtendedType;
using internal::LaunchStatus;
using kernels::DType;

constexpr int kQK = 32;
constexpr int kQuantThreads = 256;  // 8 activation blocks per CUDA block
constexpr int kThreads = 128;       // matmul threads per CUDA block
constexpr int kLanesPerRow = 8;     // threads sharing one weight row
constexpr int kRowsPerBlock = kThreads / kLanesPerRow;
constexpr int kMaxT = 8;            // tokens per CUDA block
// Shared staging of a T-token tile of activations up to this many columns
// (wider rows read the activations from global memory, through L1).
constexpr int kSmemCols = 4096;
template <int T>
struct alignas(16) ActStage {
  int8_t qs[T * kSmemCols];
  float ds[T * 2 * (kSmemCols / kQK)];
};

__device__ __forceinline__ float Half(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ float RoundThroughHalf(float v) {
  return __half2float(__float2half_rn(v));
}

// Four signed byte products summed into c.
__device__ __forceinline__ int Dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

// One warp per 32-element block (blocks of all tokens numbered t * nb + b).
template <bool kQ8_1>
__global__ void __launch_bounds__(kQuantThreads)
    QuantizeActsKernel(const float* __restrict__ x, int64_t n_tokens, int64_t x_stride,
                       int64_t nb, int8_t* __restrict__ qs, float* __restrict__ ds) {
  const int64_t blk = static_cast<int64_t>(blockIdx.x) * (kQuantThreads / 32) + threadIdx.x / 32;
  if (blk >= n_tokens * nb) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int64_t t = blk / nb, b = blk % nb;
  const float v = x[t * x_stride + b * kQK + lane];
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = __fdiv_rn(amax, 127.0f);
  const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  // rintf rounds half to even, as the CPU's nearbyint in the default mode.
  const int q = static_cast<int>(rintf(__fmul_rn(v, inv)));
  qs[blk * kQK + lane] = static_cast<int8_t>(q);
  int sum = q;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    const float d16 = RoundThroughHalf(scale);
    ds[2 * blk] = d16;
    ds[2 * blk + 1] = kQ8_1 ? RoundThroughHalf(__fmul_rn(scale, static_cast<float>(sum)))
                            : __fmul_rn(d16, static_cast<float>(sum));
  }
}

template <DType kType>
struct Traits;
template <>
struct Traits<DType::kQ8_0> {
  static constexpr int kQB = 32;  // quant bytes per block
  static constexpr int kSB = 2;   // scale bytes per block
};
template <>
struct Traits<DType::kQ4_0> {
  static constexpr int kQB = 16;
  static constexpr int kSB = 2;
};
template <>
struct Traits<DType::kQ4_1> {
  static constexpr int kQB = 16;
  static constexpr int kSB = 4;
};

// Exact int32 dot product of weight block quants `wq` (16-byte aligned)
// with 32 activation bytes `a` (16-byte aligned).
template <DType kType>
__device__ __forceinline__ int BlockDot(const uint8_t* wq, const int8_t* a) {
  const int4 a0 = *reinterpret_cast<const int4*>(a);
  const int4 a1 = *reinterpret_cast<const int4*>(a + 16);
  const int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  int acc = 0;
  if constexpr (kType == DType::kQ8_0) {
    const int4 w0 = __ldg(reinterpret_cast<const int4*>(wq));
    const int4 w1 = __ldg(reinterpret_cast<const int4*>(wq + 16));
    const int wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = Dp4a(wv[i], av[i], acc);
  } else {
    // Byte j holds element j (low nibble) and j + 16 (high), unsigned 0..15.
    const int4 w = __ldg(reinterpret_cast<const int4*>(wq));
    const int wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = Dp4a(wv[i] & 0x0F0F0F0F, av[i], acc);
      acc = Dp4a((wv[i] >> 4) & 0x0F0F0F0F, av[4 + i], acc);
    }
  }
  return acc;
}

// MatMulRowsScalar's per-block value: (acc * d) * xd for Q8_0,
// (acc * d) * xd + m * xs for Q4_0 (m = -8 d) and Q4_1.
template <DType kType>
__device__ __forceinline__ float BlockValue(int acc, const uint8_t* sc, float xd, float xs) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(sc);
  const float d = Half(h[0]);
  const float p = __fmul_rn(__fmul_rn(static_cast<float>(acc), d), xd);
  if constexpr (kType == DType::kQ8_0) {
    return p;
  } else {
    const float m = kType == DType::kQ4_1 ? Half(h[1]) : __fmul_rn(-8.0f, d);
    return __fadd_rn(p, __fmul_rn(m, xs));
  }
}

template <DType kType, int T>
__global__ void __launch_bounds__(kThreads)
    MatVecKernel(const uint8_t* __restrict__ wq, const uint8_t* __restrict__ wsc, int64_t rows,
                 int64_t nb, const int8_t* __restrict__ qs, const float* __restrict__ ds,
                 int64_t n_tokens, float* __restrict__ y, int64_t y_stride) {
  __shared__ ActStage<T> stage;
  __shared__ float partial[T][kThreads];
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * T;
  const int nt = static_cast<int>(n_tokens - t0 < T ? n_tokens - t0 : T);
  const int8_t* aq = qs + t0 * nb * kQK;
  const float* ad = ds + t0 * 2 * nb;
  // Uniform across the block: the tile's activations fit the staging.
  if (nb * kQK <= kSmemCols) {
    const int64_t n16 = static_cast<int64_t>(nt) * nb * kQK / 16;
    for (int64_t i = threadIdx.x; i < n16; i += kThreads) {
      reinterpret_cast<int4*>(stage.qs)[i] = reinterpret_cast<const int4*>(aq)[i];
    }
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(nt) * 2 * nb; i += kThreads) {
      stage.ds[i] = ad[i];
    }
    __syncthreads();
    aq = stage.qs;
    ad = stage.ds;
  }
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t r = row0 + threadIdx.x / kLanesPerRow;
  const int sub = threadIdx.x % kLanesPerRow;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  if constexpr (IsExtendedType(kType)) {
    // 32-element chunk b of the row lies in GGUF block b / kChunks.
    using F = ExtFormat<kType>;
    constexpr int kChunks = F::kElems / kQK;
    if (r < rows) {
      const uint8_t* rb = wq + r * (nb / kChunks) * F::kBytes;
      for (int64_t b = sub; b < nb; b += kLanesPerRow) {
        const uint8_t* blk = rb + (b / kChunks) * F::kBytes;
        const int e0 = static_cast<int>(b % kChunks) * kQK;
        float w[kQK];
#pragma unroll
        for (int j = 0; j < kQK; ++j) w[j] = DequantElem<kType>(blk, e0 + j);
#pragma unroll
        for (int t = 0; t < T; ++t) {
          if (t < nt) {
            const int64_t tb = t * nb + b;
            const int8_t* a = aq + tb * kQK;
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < kQK; ++j) {
              part = __fadd_rn(part, __fmul_rn(w[j], static_cast<float>(a[j])));
            }
            acc[t] = __fadd_rn(acc[t], __fmul_rn(part, ad[2 * tb]));
          }
        }
      }
    }
  } else if (r < rows) {
    using Tr = Traits<kType>;
    const uint8_t* rq = wq + r * nb * Tr::kQB;
    const uint8_t* rs = wsc + r * nb * Tr::kSB;
    for (int64_t b = sub; b < nb; b += kLanesPerRow) {
#pragma unroll
      for (int t = 0; t < T; ++t) {
        if (t < nt) {
          const int64_t tb = t * nb + b;
          const int dot = BlockDot<kType>(rq + b * Tr::kQB, aq + tb * kQK);
          acc[t] = __fadd_rn(acc[t], BlockValue<kType>(dot, rs + b * Tr::kSB, ad[2 * tb],
                                                       ad[2 * tb + 1]));
        }
      }
    }
  }
  // The kLanesPerRow partial sums of each (row, token) meet in shared
  // memory: one barrier instead of a shuffle tree per token.
#pragma unroll
  for (int t = 0; t < T; ++t) partial[t][threadIdx.x] = acc[t];
  __syncthreads();
  for (int o = threadIdx.x; o < T * kRowsPerBlock; o += kThreads) {
    const int t = o / kRowsPerBlock, ri = o % kRowsPerBlock;
    if (t < nt && row0 + ri < rows) {
      float v = 0.0f;
#pragma unroll
      for (int l = 0; l < kLanesPerRow; ++l) v = __fadd_rn(v, partial[t][ri * kLanesPerRow + l]);
      y[(t0 + t) * y_stride + row0 + ri] = v;
    }
  }
}

template <DType kType, int T>
absl::Status LaunchMatVec(const uint8_t* wq, const uint8_t* wsc, int64_t rows, int64_t nb,
                          const int8_t* qs, const float* ds, int64_t n_tokens, float* y,
                          int64_t y_stride, StreamHandle stream) {
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>((n_tokens + T - 1) / T));
  KVSERVE_CUDA_LAUNCH(grid, dim3(kThreads), 0, stream, MatVecKernel<kType, T>)
  (wq, wsc, rows, nb, qs, ds, n_tokens, y, y_stride);
  return LaunchStatus("QuantizedMatMul");
}

template <DType kType>
absl::Status MatMulFor(const void* data, int64_t rows, int64_t cols, const int8_t* qs,
                       const float* ds, int64_t n_tokens, float* y, int64_t y_stride,
                       StreamHandle stream) {
  const int64_t nb = cols / kQK;
  const auto* wq = static_cast<const uint8_t*>(data);
  // The extended formats keep their GGUF blocks whole: no scale region.
  const uint8_t* wsc = wq;
  if constexpr (!IsExtendedType(kType)) wsc += rows * nb * Traits<kType>::kQB;
  if (n_tokens == 1) {
    return LaunchMatVec<kType, 1>(wq, wsc, rows, nb, qs, ds, n_tokens, y, y_stride, stream);
  }
  if (n_tokens == 2) {
    return LaunchMatVec<kType, 2>(wq, wsc, rows, nb, qs, ds, n_tokens, y, y_stride, stream);
  }
  if (n_tokens <= 4) {
    return LaunchMatVec<kType, 4>(wq, wsc, rows, nb, qs, ds, n_tokens, y, y_stride, stream);
  }
  return LaunchMatVec<kType, kMaxT>(wq, wsc, rows, nb, qs, ds, n_tokens, y, y_stride, stream);
}

// One thread per 32-element chunk of the matrix (rows are whole blocks, so
// the chunks of all rows are one sequence).
template <DType kType>
__global__ void __launch_bounds__(kQuantThreads)
    DequantizeKernel(const uint8_t* __restrict__ w, int64_t n_chunks, float* __restrict__ out) {
  using F = ExtFormat<kType>;
  constexpr int kChunks = F::kElems / kQK;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  if (c >= n_chunks) return;
  const uint8_t* blk = w + (c / kChunks) * F::kBytes;
  const int e0 = static_cast<int>(c % kChunks) * kQK;
  float* o = out + c * kQK;
#pragma unroll
  for (int j = 0; j < kQK; ++j) o[j] = DequantElem<kType>(blk, e0 + j);
}

template <DType kType>
absl::Status LaunchDequantize(const void* data, int64_t n_chunks, float* out,
                              StreamHandle stream) {
  const dim3 grid(static_cast<unsigned>((n_chunks + kQuantThreads - 1) / kQuantThreads));
  KVSERVE_CUDA_LAUNCH(grid, dim3(kQuantThreads), 0, stream, DequantizeKernel<kType>)
  (static_cast<const uint8_t*>(data), n_chunks, out);
  return LaunchStatus("DequantizeWeight");
}

}  // namespace

absl::Status DequantizeWeight(DType type, const void* data, int64_t rows, int64_t cols,
                              float* out, StreamHandle stream) {
  if (!IsExtendedType(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DequantizeWeight: ", kernels::DTypeName(type), " is not an extended format"));
  }
  if (rows <= 0 || cols <= 0 || cols % kernels::BlockElems(type) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("DequantizeWeight: bad shape ", rows, "x", cols,
                                                   " for ", kernels::DTypeName(type)));
  }
  const int64_t n_chunks = rows * (cols / kQK);
  switch (type) {
#define KVSERVE_EXT_CASE(T) \
  case T:                   \
    return LaunchDequantize<T>(data, n_chunks, out, stream);
    KVSERVE_FOR_EACH_EXT_DTYPE(KVSERVE_EXT_CASE)
#undef KVSERVE_EXT_CASE
    default:
      return absl::InvalidArgumentError("DequantizeWeight: unreachable");
  }
}

absl::Status QuantizeActs(const float* x, int64_t n_tokens, int64_t x_stride, int64_t cols,
                          ActSum mode, int8_t* qs, float* ds, StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (cols <= 0 || cols % kQK != 0 || x_stride < cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeActs: bad shape cols=", cols, " x_stride=", x_stride));
  }
  const int64_t nb = cols / kQK;
  const int64_t per_block = kQuantThreads / 32;
  const dim3 grid(static_cast<unsigned>((n_tokens * nb + per_block - 1) / per_block));
  if (mode == ActSum::kQ8_1) {
    KVSERVE_CUDA_LAUNCH(grid, dim3(kQuantThreads), 0, stream, QuantizeActsKernel<true>)
    (x, n_tokens, x_stride, nb, qs, ds);
  } else {
    KVSERVE_CUDA_LAUNCH(grid, dim3(kQuantThreads), 0, stream, QuantizeActsKernel<false>)
    (x, n_tokens, x_stride, nb, qs, ds);
  }
  return LaunchStatus("QuantizeActs");
}

absl::Status QuantizedMatMul(DType type, const void* data, int64_t rows, int64_t cols,
                             const int8_t* qs, const float* ds, int64_t n_tokens, float* y,
                             int64_t y_stride, StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (rows <= 0 || cols <= 0 || cols % kernels::BlockElems(type) != 0 || cols % kQK != 0 ||
      y_stride < rows) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizedMatMul: bad shape ", rows, "x",
                                                   cols, " for ", kernels::DTypeName(type),
                                                   " y_stride=", y_stride));
  }
  if (reinterpret_cast<uintptr_t>(qs) % 16 != 0 || reinterpret_cast<uintptr_t>(data) % 16 != 0) {
    return absl::InvalidArgumentError("QuantizedMatMul: weights and activations need 16-byte alignment");
  }
  switch (type) {
    case DType::kQ8_0:
      return MatMulFor<DType::kQ8_0>(data, rows, cols, qs, ds, n_tokens, y, y_stride, stream);
    case DType::kQ4_0:
      return MatMulFor<DType::kQ4_0>(data, rows, cols, qs, ds, n_tokens, y, y_stride, stream);
    case DType::kQ4_1:
      return MatMulFor<DType::kQ4_1>(data, rows, cols, qs, ds, n_tokens, y, y_stride, stream);
#define KVSERVE_EXT_CASE(T) \
  case T:                   \
    return MatMulFor<T>(data, rows, cols, qs, ds, n_tokens, y, y_stride, stream);
    KVSERVE_FOR_EACH_EXT_DTYPE(KVSERVE_EXT_CASE)
#undef KVSERVE_EXT_CASE
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("QuantizedMatMul: no integer kernel for ", kernels::DTypeName(type)));
  }
}

}  // namespace kvserve::cuda
