// Copies between device memory and host staging buffers. transport/ depends
// only on common/, so the CUDA copy routine is injected by the layer that owns
// CUDA; without one, host memory stands in for device memory (CPU builds and
// tests), which exercises the very same staging path.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>

#include "absl/status/status.h"

namespace kvserve::transport {

// Thread-safe: called from the transport's progress thread and from callers
// of PostTransfer.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  [[nodiscard]] virtual absl::Status CopyDeviceToHost(void* host_dst,
                                                      const void* device_src,
                                                      size_t length) = 0;
  [[nodiscard]] virtual absl::Status CopyHostToDevice(void* device_dst,
                                                      const void* host_src,
                                                      size_t length) = 0;
};

// "Device" memory that is really host memory. Counts bytes so tests can prove
// the staging path ran.
class HostStandInCopier : public DeviceCopier {
 public:
  absl::Status CopyDeviceToHost(void* host_dst, const void* device_src,
                                size_t length) override {
    std::memcpy(host_dst, device_src, length);
    device_to_host_bytes_ += length;
    return absl::OkStatus();
  }
  absl::Status CopyHostToDevice(void* device_dst, const void* host_src,
                                size_t length) override {
    std::memcpy(device_dst, host_src, length);
    host_to_device_bytes_ += length;
    return absl::OkStatus();
  }
  size_t device_to_host_bytes() const { return device_to_host_bytes_; }
  size_t host_to_device_bytes() const { return host_to_device_bytes_; }

 private:
  std::atomic<size_t> device_to_host_bytes_{0};
  std::atomic<size_t> host_to_device_bytes_{0};
};

}  // namespace kvserve::transport
