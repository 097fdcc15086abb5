// Bandwidth probe: what the memory system of the device delivers, the
// roofline against which decode attention (KV bytes read / time) is judged.
// Plain C++ header; Unavailable without CUDA or without a device.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace kvserve::cuda {

struct BandwidthReport {
  std::string device;
  size_t bytes = 0;  // size of each copy
  // Device-to-device cudaMemcpy: bytes copied per second, and the HBM traffic
  // that implies (read + write = 2x). A read-only kernel is compared with
  // the traffic figure.
  double d2d_copy_gbps = 0;
  double d2d_traffic_gbps = 0;
  // Pinned host <-> device.
  double h2d_gbps = 0;
  double d2h_gbps = 0;
};

// Times `iters` copies of `bytes` each way after a warm-up (CUDA events,
// best of the iterations). GB = 1e9 bytes.
[[nodiscard]] absl::StatusOr<BandwidthReport> ProbeBandwidth(size_t bytes = size_t{1} << 30,
                                                             int iters = 10);

// Human-readable lines, for `kvserve probe` and the benchmark.
std::string FormatBandwidthReport(const BandwidthReport& r);

}  // namespace kvserve::cuda
