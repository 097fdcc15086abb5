// Bandwidth probe (probe.h): device-to-device and pinned host<->device copies
// timed with CUDA events. Host code only.
#include "kernels/cuda/probe.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/runtime.h"

namespace kvserve::cuda {
namespace {

// Best (shortest) time of `iters` copies after one warm-up, in seconds.
absl::StatusOr<double> BestCopySeconds(void* dst, const void* src, size_t bytes,
                                       cudaMemcpyKind kind, int iters, cudaStream_t stream) {
  auto start = CudaEvent::Create();
  auto stop = CudaEvent::Create();
  if (!start.ok()) return start.status();
  if (!stop.ok()) return stop.status();
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream), "probe warm-up");
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "probe warm-up");
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    if (absl::Status s = start->Record(stream); !s.ok()) return s;
    KVSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream), "probe copy");
    if (absl::Status s = stop->Record(stream); !s.ok()) return s;
    if (absl::Status s = stop->Synchronize(); !s.ok()) return s;
    auto ms = CudaEvent::ElapsedMs(*start, *stop);
    if (!ms.ok()) return ms.status();
    best = std::min(best, static_cast<double>(*ms) / 1e3);
  }
  return best;
}

}  // namespace

absl::StatusOr<BandwidthReport> ProbeBandwidth(size_t bytes, int iters) {
  if (absl::Status s = CudaUsable(); !s.ok()) return s;
  if (bytes == 0 || iters <= 0) return absl::InvalidArgumentError("ProbeBandwidth: empty probe");
  BandwidthReport r;
  r.bytes = bytes;
  int dev = 0;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev), "cudaGetDevice");
  auto name = DeviceName(dev);
  r.device = name.ok() ? *name : "unknown";

  auto stream = CudaStream::Create();
  if (!stream.ok()) return stream.status();
  DeviceMemoryPool pool;
  auto a = pool.Allocate(bytes);
  if (!a.ok()) return a.status();
  auto b = pool.Allocate(bytes);
  if (!b.ok()) return b.status();
  auto host = PinnedHostBuffer::Allocate(bytes);
  if (!host.ok()) return host.status();
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a->data(), 1, bytes, stream->get()), "memset");
  std::fill_n(host->as<uint8_t>(), bytes, uint8_t{1});

  auto d2d = BestCopySeconds(b->data(), a->data(), bytes, cudaMemcpyDeviceToDevice, iters,
                             stream->get());
  if (!d2d.ok()) return d2d.status();
  auto h2d = BestCopySeconds(a->data(), host->data(), bytes, cudaMemcpyHostToDevice, iters,
                             stream->get());
  if (!h2d.ok()) return h2d.status();
  auto d2h = BestCopySeconds(host->data(), a->data(), bytes, cudaMemcpyDeviceToHost, iters,
                             stream->get());
  if (!d2h.ok()) return d2h.status();
  r.d2d_copy_gbps = static_cast<double>(bytes) / *d2d / 1e9;
  r.d2d_traffic_gbps = 2 * r.d2d_copy_gbps;
  r.h2d_gbps = static_cast<double>(bytes) / *h2d / 1e9;
  r.d2h_gbps = static_cast<double>(bytes) / *d2h / 1e9;
  return r;
}

}  // namespace kvserve::cuda
