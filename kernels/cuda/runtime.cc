// CUDA runtime pieces (runtime.h): device query, copies, the caching device
// memory pool, pinned host buffers, streams and events. Host code only, so
// g++ compiles it.
#include "kernels/cuda/runtime.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_check.h"

namespace kvserve::cuda {

using internal::FromCuda;

bool BuiltWithCuda() { return true; }

namespace {

// The first probe's result; a process does not gain or lose its driver.
struct DeviceProbe {
  int count = 0;
  cudaError_t error = cudaSuccess;
};

const DeviceProbe& Probe() {
  static const DeviceProbe probe = [] {
    DeviceProbe p;
    // Without a driver this returns cudaErrorInsufficientDriver or
    // cudaErrorNoDevice: both mean "run on the CPU".
    p.error = cudaGetDeviceCount(&p.count);
    if (p.error != cudaSuccess) {
      cudaGetLastError();  // clear the error so later calls start clean
      p.count = 0;
    }
    return p;
  }();
  return probe;
}

}  // namespace

int UsableDeviceCount() { return Probe().count; }

absl::Status CudaUsable() {
  const DeviceProbe& p = Probe();
  if (p.error != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorString(p.error)));
  }
  if (p.count == 0) return absl::UnavailableError("no CUDA device visible");
  return absl::OkStatus();
}

absl::StatusOr<std::string> DeviceName(int device) {
  cudaDeviceProp prop;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return std::string(prop.name);
}

int MultiprocessorCount() {
  static const int n = [] {
    if (UsableDeviceCount() == 0) return 0;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return sms;
  }();
  return n;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

absl::Status DeviceFree(void* p) { return FromCuda(cudaFree(p), "cudaFree"); }

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  // From pageable memory cudaMemcpy returns once the driver has staged the
  // bytes; the DMA finishes later on the legacy default stream, which the
  // project's non-blocking streams do not wait for. Seen on an H200: a
  // kernel launched right after read the tail of a 1 MB upload stale. Wait
  // for the legacy stream so the bytes are on the device when this returns.
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice),
                               "cudaMemcpy H2D");
  return FromCuda(cudaStreamSynchronize(cudaStreamLegacy), "cudaMemcpy H2D (legacy stream sync)");
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  return FromCuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync H2D");
}

absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync D2H");
}

absl::Status CopyDeviceToDeviceAsync(void* dst, const void* src, size_t bytes,
                                     StreamHandle stream) {
  return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                  "cudaMemcpyAsync D2D");
}

absl::Status MemsetAsync(void* dst, int value, size_t bytes, StreamHandle stream) {
  return FromCuda(cudaMemsetAsync(dst, value, bytes, stream), "cudaMemsetAsync");
}

absl::Status DeviceSynchronize() {
  return FromCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

absl::Status DeviceMemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  return FromCuda(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}

// ---- DeviceBuffer / DeviceMemoryPool ----

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr && pool_ != nullptr) pool_->Return(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  capacity_ = 0;
}

namespace {

// 256-byte granules below 1 MiB; above, eight classes per power of two.
size_t SizeClass(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= (size_t{1} << 20)) return (bytes + 255) & ~size_t{255};
  size_t p = size_t{1} << 20;
  while (p < bytes) p <<= 1;
  const size_t step = p / 16;  // p/2 .. p in eighths of p/2
  return (bytes + step - 1) / step * step;
}

}  // namespace

struct DeviceMemoryPool::State {
  mutable absl::Mutex mu;
  std::multimap<size_t, void*> free ABSL_GUARDED_BY(mu);  // capacity -> span
  size_t in_use ABSL_GUARDED_BY(mu) = 0;
  size_t reserved ABSL_GUARDED_BY(mu) = 0;
  int64_t live ABSL_GUARDED_BY(mu) = 0;
};

DeviceMemoryPool::DeviceMemoryPool() : state_(new State) {}

DeviceMemoryPool::~DeviceMemoryPool() {
  {
    absl::MutexLock l(&state_->mu);
    if (state_->live != 0) {
      std::fprintf(stderr, "DeviceMemoryPool: destroyed with %lld live buffers (%zu bytes)\n",
                   static_cast<long long>(state_->live), state_->in_use);
    }
  }
  (void)Trim();
  delete state_;
}

absl::StatusOr<DeviceBuffer> DeviceMemoryPool::Allocate(size_t bytes) {
  const size_t cap = SizeClass(bytes);
  DeviceBuffer b;
  b.pool_ = this;
  b.bytes_ = bytes;
  b.capacity_ = cap;
  {
    absl::MutexLock l(&state_->mu);
    auto it = state_->free.find(cap);
    if (it != state_->free.end()) {
      b.data_ = it->second;
      state_->free.erase(it);
      state_->in_use += cap;
      ++state_->live;
      return b;
    }
  }
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, cap);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    // Cached spans of other sizes may be what is missing: free them and retry.
    if (absl::Status s = Trim(); !s.ok()) return s;
    e = cudaMalloc(&p, cap);
  }
  if (e != cudaSuccess) {
    absl::Status s = FromCuda(e, "cudaMalloc");
    b.pool_ = nullptr;  // nothing to return
    return absl::Status(s.code(), absl::StrCat("DeviceMemoryPool: ", bytes, " bytes: ",
                                               s.message()));
  }
  absl::MutexLock l(&state_->mu);
  state_->reserved += cap;
  state_->in_use += cap;
  ++state_->live;
  b.data_ = p;
  return b;
}

void DeviceMemoryPool::Return(void* p, size_t capacity) {
  absl::MutexLock l(&state_->mu);
  state_->free.emplace(capacity, p);
  state_->in_use -= capacity;
  --state_->live;
}

absl::Status DeviceMemoryPool::Trim() {
  std::multimap<size_t, void*> spans;
  {
    absl::MutexLock l(&state_->mu);
    spans.swap(state_->free);
    for (const auto& [cap, p] : spans) state_->reserved -= cap;
  }
  absl::Status result;
  for (const auto& [cap, p] : spans) result.Update(FromCuda(cudaFree(p), "cudaFree"));
  return result;
}

size_t DeviceMemoryPool::bytes_in_use() const {
  absl::MutexLock l(&state_->mu);
  return state_->in_use;
}

size_t DeviceMemoryPool::bytes_reserved() const {
  absl::MutexLock l(&state_->mu);
  return state_->reserved;
}

int64_t DeviceMemoryPool::live_buffers() const {
  absl::MutexLock l(&state_->mu);
  return state_->live;
}

// ---- PinnedHostBuffer ----

PinnedHostBuffer::~PinnedHostBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Allocate(size_t bytes) {
  PinnedHostBuffer b;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&b.data_, bytes, cudaHostAllocDefault),
                               "cudaHostAlloc");
  b.bytes_ = bytes;
  return b;
}

// ---- CudaStream / CudaEvent ----

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream s;
  // Non-blocking: no implicit ordering against the legacy default stream,
  // so copies on one stream overlap compute on another.
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking),
                               "cudaStreamCreate");
  return s;
}

absl::Status CudaStream::Synchronize() const {
  return FromCuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

absl::StatusOr<CudaEvent> CudaEvent::Create() {
  CudaEvent e;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e.event_), "cudaEventCreate");
  return e;
}

absl::Status CudaEvent::Record(StreamHandle stream) {
  return FromCuda(cudaEventRecord(event_, stream), "cudaEventRecord");
}

absl::Status CudaEvent::Synchronize() const {
  return FromCuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

absl::Status CudaEvent::BlockStream(StreamHandle stream) const {
  return FromCuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

absl::StatusOr<float> CudaEvent::ElapsedMs(const CudaEvent& start, const CudaEvent& end) {
  float ms = 0;
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.event_, end.event_),
                               "cudaEventElapsedTime");
  return ms;
}

}  // namespace kvserve::cuda
