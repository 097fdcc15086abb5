// Element-wise, normalization and sampling kernels of the forward
// (cuda_kernels.h). Memory-bound one-pass kernels: vector loads where the
// alignment allows, one block per row for the row reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve::cuda {
namespace {

using internal::LaunchStatus;

constexpr int kThreads = 256;

unsigned GridFor(int64_t n, int per_thread = 1) {
  const int64_t blocks = (n + int64_t{kThreads} * per_thread - 1) / (int64_t{kThreads} * per_thread);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks));
}

__device__ __forceinline__ float Half(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ float BHalf(uint16_t h) {
  return __bfloat162float(__ushort_as_bfloat16(h));
}

// Block-wide sum; every thread gets the result. REQUIRES: blockDim.x == kThreads.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // warp_sums may still be read from a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) t += warp_sums[w];
  return t;
}

// ---- embedding ----

// One block per token; element i of the row dequantized from its format.
__global__ void EmbeddingKernel(kernels::DType type, const uint8_t* __restrict__ table,
                                int64_t vocab, int64_t dim, int64_t row_bytes,
                                const int32_t* __restrict__ tokens, float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int32_t id = tokens[t];
  float* o = out + t * dim;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = 0.f;
    return;
  }
  const uint8_t* row = table + static_cast<int64_t>(id) * row_bytes;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = 0.f;
    switch (type) {
      case kernels::DType::kF32:
        v = reinterpret_cast<const float*>(row)[i];
        break;
      case kernels::DType::kF16:
        v = Half(reinterpret_cast<const uint16_t*>(row)[i]);
        break;
      case kernels::DType::kBF16:
        v = BHalf(reinterpret_cast<const uint16_t*>(row)[i]);
        break;
      case kernels::DType::kQ8_0: {
        const uint8_t* b = row + (i / 32) * 34;
        const float d = Half(static_cast<uint16_t>(b[0] | (b[1] << 8)));
        v = d * static_cast<float>(static_cast<int8_t>(b[2 + i % 32]));
        break;
      }
      case kernels::DType::kQ4_0: {
        const uint8_t* b = row + (i / 32) * 18;
        const float d = Half(static_cast<uint16_t>(b[0] | (b[1] << 8)));
        const int j = static_cast<int>(i % 32);
        const int q = j < 16 ? (b[2 + j] & 0xf) : (b[2 + j - 16] >> 4);
        v = static_cast<float>(q - 8) * d;
        break;
      }
      case kernels::DType::kQ4_1: {
        const uint8_t* b = row + (i / 32) * 20;
        const float d = Half(static_cast<uint16_t>(b[0] | (b[1] << 8)));
        const float m = Half(static_cast<uint16_t>(b[2] | (b[3] << 8)));
        const int j = static_cast<int>(i % 32);
        const int q = j < 16 ? (b[4 + j] & 0xf) : (b[4 + j - 16] >> 4);
        v = static_cast<float>(q) * d + m;
        break;
      }
      default:  // the extended formats (dequant.cuh)
        v = internal::DequantRowElem(type, row, i);
        break;
    }
    o[i] = v;
  }
}

// ---- RMSNorm ----

__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ w, int64_t n,
                              float eps, float* out) {
  const float* row = x + blockIdx.x * n;
  float* orow = out + blockIdx.x * n;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += row[i] * row[i];
  const float scale = rsqrtf(BlockSum(sum) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = (row[i] * scale) * w[i];
}

// ---- RoPE ----

// One thread per (token, head, pair). theta follows ggml's recurrence
// (theta_i = pos * scale^i, multiplied up in float) as kernels::Rope does.
__global__ void RopeKernel(float* x, int64_t n_tokens, int64_t stride, int32_t n_heads,
                           const int32_t* __restrict__ positions, int32_t head_dim, int32_t half,
                           float theta_scale, const float* __restrict__ freq_factors, bool neox) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t total = n_tokens * n_heads * half;
  if (idx >= total) return;
  const int32_t i = static_cast<int32_t>(idx % half);
  const int64_t th = idx / half;
  const int32_t h = static_cast<int32_t>(th % n_heads);
  const int64_t t = th / n_heads;
  float theta = static_cast<float>(positions[t]);
  for (int32_t k = 0; k < i; ++k) theta *= theta_scale;
  if (freq_factors != nullptr) theta /= freq_factors[i];
  float sn, cs;
  sincosf(theta, &sn, &cs);
  float* head = x + t * stride + static_cast<int64_t>(h) * head_dim;
  const int32_t i0 = neox ? i : 2 * i;
  const int32_t i1 = neox ? i + half : 2 * i + 1;
  const float a = head[i0];
  const float b = head[i1];
  head[i0] = fmaf(a, cs, -(b * sn));
  head[i1] = fmaf(a, sn, b * cs);
}

// ---- element-wise ----

__global__ void SiluMulKernel(const float* gate, const float* __restrict__ up, int64_t n,
                              float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// g and its GELU rounded to f16, the tails exact, as kernels::GeluTanhMul
// computes ggml's CPU GELU.
__global__ void GeluTanhMulKernel(const float* gate, const float* __restrict__ up, int64_t n,
                                  float* out) {
  constexpr float kSqrt2OverPi = 0.79788456080286535588f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    float gelu;
    if (g <= -10.0f) {
      gelu = 0.0f;
    } else if (g >= 10.0f) {
      gelu = g;
    } else {
      const float h = __half2float(__float2half_rn(g));
      gelu = __half2float(
          __float2half_rn(0.5f * h * (1.0f + tanhf(kSqrt2OverPi * h * (1.0f + 0.044715f * h * h)))));
    }
    out[i] = gelu * up[i];
  }
}

// x[r * n + i] += bias[i] for n_rows rows.
__global__ void AddRowBiasKernel(float* x, const float* __restrict__ bias, int64_t n_rows,
                                 int64_t n) {
  const int64_t total = n_rows * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += bias[i % n];
  }
}

__global__ void ScaleKernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] *= s;
  }
}

__global__ void SoftcapKernel(float* x, float cap, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = cap * tanhf(x[i] / cap);
  }
}

__global__ void AddKernel(float* x, const float* __restrict__ y, int64_t n) {
  // float4 body (pointers are checked for 16-byte alignment by the launcher).
  const int64_t n4 = n / 4;
  float4* x4 = reinterpret_cast<float4*>(x);
  const float4* y4 = reinterpret_cast<const float4*>(y);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += step) {
    float4 a = x4[i];
    const float4 b = y4[i];
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
    x4[i] = a;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += step) {
    x[i] += y[i];
  }
}

__global__ void AddScalarKernel(float* x, const float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void ToHalfKernel(const float* __restrict__ in, int64_t n, uint16_t* __restrict__ out,
                             bool bf16) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(in[i]))
                  : __half_as_ushort(__float2half_rn(in[i]));
  }
}

// ---- argmax ----

// (value, index) with "greater value, then lower index" order; NaN loses.
__device__ __forceinline__ void ArgmaxMerge(float& v, int32_t& i, float ov, int32_t oi) {
  if (ov > v || (ov == v && oi < i) || (v != v && ov == ov)) {
    v = ov;
    i = oi;
  }
}

__global__ void ArgmaxKernel(const float* __restrict__ logits, int64_t vocab, int64_t stride,
                             int32_t* __restrict__ out) {
  const float* row = logits + blockIdx.x * stride;
  float best = -INFINITY;
  int32_t best_i = INT32_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    ArgmaxMerge(best, best_i, row[i], static_cast<int32_t>(i));
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    ArgmaxMerge(best, best_i, ov, oi);
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int32_t si[kThreads / 32];
  if (threadIdx.x % 32 == 0) {
    sv[threadIdx.x / 32] = best;
    si[threadIdx.x / 32] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) ArgmaxMerge(best, best_i, sv[w], si[w]);
    // An all -inf (or all NaN) row picks token 0 rather than an invalid id.
    out[blockIdx.x] = best_i == INT32_MAX ? 0 : best_i;
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

absl::Status EmbeddingGather(kernels::DType table_type, const void* table, int64_t vocab,
                             int64_t dim, const int32_t* tokens, int64_t n_tokens, float* out,
                             StreamHandle stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (dim <= 0 || vocab <= 0 || dim % kernels::BlockElems(table_type) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("EmbeddingGather: dim ", dim, " does not fit table type ",
                     kernels::DTypeName(table_type)));
  }
  const int64_t row_bytes = kernels::RowBytes(table_type, dim);
  KVSERVE_CUDA_LAUNCH(static_cast<unsigned>(n_tokens), kThreads, 0, stream, EmbeddingKernel)(
      table_type, static_cast<const uint8_t*>(table), vocab, dim, row_bytes, tokens, out);
  return LaunchStatus("EmbeddingGather");
}

absl::Status RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                     float* out, StreamHandle stream) {
  if (n_rows <= 0 || n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(static_cast<unsigned>(n_rows), kThreads, 0, stream, RmsNormKernel)(x, weight, n, eps, out);
  return LaunchStatus("RmsNorm");
}

absl::Status Rope(float* x, int64_t n_tokens, int64_t stride, int32_t n_heads,
                  const int32_t* positions, const kernels::RopeParams& p, StreamHandle stream) {
  if (n_tokens <= 0 || n_heads <= 0) return absl::OkStatus();
  if (p.rot_dim <= 0 || p.rot_dim % 2 != 0 || p.rot_dim > p.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: rot_dim ", p.rot_dim, " for head_dim ", p.head_dim));
  }
  const int32_t half = p.rot_dim / 2;
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.rot_dim));
  const int64_t total = n_tokens * n_heads * half;
  KVSERVE_CUDA_LAUNCH(static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream, RopeKernel)(
      x, n_tokens, stride, n_heads, positions, p.head_dim, half, theta_scale, p.freq_factors,
      p.style == kernels::RopeStyle::kNeox);
  return LaunchStatus("Rope");
}

absl::Status SiluMul(const float* gate, const float* up, int64_t n, float* out,
                     StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, SiluMulKernel)(gate, up, n, out);
  return LaunchStatus("SiluMul");
}

absl::Status GeluTanhMul(const float* gate, const float* up, int64_t n, float* out,
                         StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, GeluTanhMulKernel)(gate, up, n, out);
  return LaunchStatus("GeluTanhMul");
}

absl::Status AddRowBias(float* x, const float* bias, int64_t n_rows, int64_t n,
                        StreamHandle stream) {
  if (n_rows <= 0 || n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n_rows * n, 4), kThreads, 0, stream, AddRowBiasKernel)(x, bias,
                                                                                    n_rows, n);
  return LaunchStatus("AddRowBias");
}

absl::Status ScaleInPlace(float* x, float s, int64_t n, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, ScaleKernel)(x, s, n);
  return LaunchStatus("ScaleInPlace");
}

absl::Status SoftcapInPlace(float* x, float cap, int64_t n, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  if (!(cap > 0)) return absl::InvalidArgumentError("SoftcapInPlace: cap must be positive");
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, SoftcapKernel)(x, cap, n);
  return LaunchStatus("SoftcapInPlace");
}

absl::Status AddInPlace(float* x, const float* y, int64_t n, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  if (Aligned16(x) && Aligned16(y)) {
    KVSERVE_CUDA_LAUNCH(GridFor(n, 8), kThreads, 0, stream, AddKernel)(x, y, n);
  } else {
    KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, AddScalarKernel)(x, y, n);
  }
  return LaunchStatus("AddInPlace");
}

absl::Status ArgmaxRows(const float* logits, int64_t n_rows, int64_t vocab, int64_t stride,
                        int32_t* out_ids, StreamHandle stream) {
  if (n_rows <= 0) return absl::OkStatus();
  if (vocab <= 0 || vocab > INT32_MAX - 1) return absl::InvalidArgumentError("ArgmaxRows: vocab");
  KVSERVE_CUDA_LAUNCH(static_cast<unsigned>(n_rows), kThreads, 0, stream, ArgmaxKernel)(logits, vocab, stride,
                                                                        out_ids);
  return LaunchStatus("ArgmaxRows");
}

absl::Status ConvertF32ToF16(const float* in, int64_t n, uint16_t* out, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, ToHalfKernel)(in, n, out, false);
  return LaunchStatus("ConvertF32ToF16");
}

absl::Status ConvertF32ToBF16(const float* in, int64_t n, uint16_t* out, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  KVSERVE_CUDA_LAUNCH(GridFor(n, 4), kThreads, 0, stream, ToHalfKernel)(in, n, out, true);
  return LaunchStatus("ConvertF32ToBF16");
}

}  // namespace kvserve::cuda
