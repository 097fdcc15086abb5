// Host entry points of the CUDA kernels. Plain C++ header (no CUDA types) so
// callers compile with g++; every launcher returns a Status.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvserve::cuda {

// Number of usable CUDA devices; 0 (not an error) when there is no driver or
// no device, as on build machines.
int UsableDeviceCount();
// Name of a device, for logs.
absl::StatusOr<std::string> DeviceName(int device);

// Device memory helpers for tests and the backend seam.
absl::StatusOr<void*> DeviceAlloc(size_t bytes);
absl::Status DeviceFree(void* p);
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; device pointers; same
// contract as kernels::RmsNorm. Synchronous on the default stream.
absl::Status RmsNorm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                     float* out);

}  // namespace kvserve::cuda
