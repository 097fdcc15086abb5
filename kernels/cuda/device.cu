#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve::cuda {
namespace {

absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

int UsableDeviceCount() {
  int n = 0;
  // Without a driver this returns cudaErrorInsufficientDriver or
  // cudaErrorNoDevice: both mean "run on the CPU".
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  return n;
}

absl::StatusOr<std::string> DeviceName(int device) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return FromCuda(e, "cudaGetDeviceProperties");
  return std::string(prop.name);
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) return FromCuda(e, "cudaMalloc");
  return p;
}

absl::Status DeviceFree(void* p) { return FromCuda(cudaFree(p), "cudaFree"); }

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  return FromCuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  return FromCuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

}  // namespace kvserve::cuda
