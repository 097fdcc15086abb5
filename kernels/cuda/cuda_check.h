// Internal to kernels/cuda (CUDA builds only): cudaError_t -> Status.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvserve::cuda::internal {

inline absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky; clear it so later calls are clean
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Status of the last launch on this thread.
inline absl::Status LaunchStatus(const char* what) { return FromCuda(cudaGetLastError(), what); }

}  // namespace kvserve::cuda::internal

#define KVSERVE_CUDA_RETURN_IF_ERROR(expr, what)                                \
  do {                                                                          \
    const cudaError_t kvserve_cuda_err_ = (expr);                               \
    if (kvserve_cuda_err_ != cudaSuccess)                                       \
      return ::kvserve::cuda::internal::FromCuda(kvserve_cuda_err_, what);      \
  } while (0)
