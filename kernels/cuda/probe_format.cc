// FormatBandwidthReport (probe.h): plain formatting, built with and without CUDA.
#include "absl/strings/str_format.h"
#include "kernels/cuda/probe.h"

namespace kvserve::cuda {

std::string FormatBandwidthReport(const BandwidthReport& r) {
  return absl::StrFormat(
      "device: %s\n"
      "copy size: %.0f MiB\n"
      "device->device copy: %.1f GB/s copied (%.1f GB/s HBM read+write)\n"
      "host->device (pinned): %.1f GB/s\n"
      "device->host (pinned): %.1f GB/s\n",
      r.device, static_cast<double>(r.bytes) / (1 << 20), r.d2d_copy_gbps, r.d2d_traffic_gbps,
      r.h2d_gbps, r.d2h_gbps);
}

}  // namespace kvserve::cuda
