#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: a strided sum of squares, a shared-memory tree
// reduction, then the scaled write.
__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ w, int64_t n,
                              float eps, float* __restrict__ out) {
  __shared__ float partial[kThreads];
  const float* row = x + blockIdx.x * n;
  float* orow = out + blockIdx.x * n;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += row[i] * row[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = rsqrtf(partial[0] / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = row[i] * scale * w[i];
}

}  // namespace

absl::Status RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                     float* out) {
  if (n_rows <= 0 || n <= 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(n_rows), kThreads>>>(x, weight, n, eps, out);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return absl::InternalError(absl::StrCat("RmsNorm: ", cudaGetErrorString(e)));
  return absl::OkStatus();
}

}  // namespace kvserve::cuda
