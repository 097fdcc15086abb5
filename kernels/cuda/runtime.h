// CUDA runtime pieces the backend owns: the "is CUDA usable?" query, a
// caching device-memory pool with RAII buffers, pinned host buffers, and
// stream/event owners. Plain C++ (no CUDA headers): g++ translation units
// include it, and builds without CUDA link cuda_stub.cc, whose functions all
// return Unavailable, so callers never need an #ifdef.
//
// Streams and events cross this header as CUstream_st* / CUevent_st*, which is
// exactly what cudaStream_t / cudaEvent_t are, so .cu files pass them to the
// runtime without casts. A null StreamHandle is the legacy default stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
struct CUevent_st;

namespace kvserve::cuda {

using StreamHandle = ::CUstream_st*;
using EventHandle = ::CUevent_st*;

// True when this binary was built with KVSERVE_WITH_CUDA=ON.
bool BuiltWithCuda();
// Number of usable CUDA devices; 0 (not an error) when there is no driver or
// no device, as on build machines, or when built without CUDA.
int UsableDeviceCount();
// OK when the CUDA kernels can run here; otherwise Unavailable with the
// reason ("built without CUDA", "cudaGetDeviceCount: insufficient driver").
absl::Status CudaUsable();
// Name of a device, for logs.
absl::StatusOr<std::string> DeviceName(int device);
// Streaming multiprocessors of the current device (cached; launchers size
// their grids with it). 0 when unknown.
int MultiprocessorCount();

// Synchronous helpers for tests and one-off uploads (default stream). The
// bytes of CopyToDevice are on the device when it returns, visible to work
// issued afterwards on any stream.
absl::StatusOr<void*> DeviceAlloc(size_t bytes);
absl::Status DeviceFree(void* p);
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
// Asynchronous copies on a stream (host memory should be pinned for overlap).
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, StreamHandle stream);
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, StreamHandle stream);
absl::Status CopyDeviceToDeviceAsync(void* dst, const void* src, size_t bytes, StreamHandle stream);
absl::Status MemsetAsync(void* dst, int value, size_t bytes, StreamHandle stream);
// Waits for all work on the device (tests, shutdown).
absl::Status DeviceSynchronize();
// cudaMemGetInfo of the current device.
absl::Status DeviceMemoryInfo(size_t* free_bytes, size_t* total_bytes);

class DeviceMemoryPool;

// A span of device memory lent by a DeviceMemoryPool; returns it on
// destruction. Move-only. Not thread-safe itself; the pool is.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  // Returns the memory to the pool now.
  void Reset();

 private:
  friend class DeviceMemoryPool;
  DeviceMemoryPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;     // requested
  size_t capacity_ = 0;  // size class actually held
};

// Caching allocator over cudaMalloc (never managed memory): freed spans go to
// a per-size-class free list and are handed out again without a cudaMalloc;
// Trim() gives cached spans back to the driver. Sizes round up to 256 bytes
// below 1 MiB and to a power of two's eighth above, so a reuse wastes at most
// 12.5%. Thread-safe. The pool must outlive its buffers.
class DeviceMemoryPool {
 public:
  DeviceMemoryPool();
  ~DeviceMemoryPool();  // frees cached spans; live buffers are a bug (logged)
  DeviceMemoryPool(const DeviceMemoryPool&) = delete;
  DeviceMemoryPool& operator=(const DeviceMemoryPool&) = delete;

  // ResourceExhausted when the device is out of memory (after trimming the
  // cache once), Unavailable without CUDA.
  [[nodiscard]] absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  // Frees every cached (unused) span.
  absl::Status Trim();

  size_t bytes_in_use() const;    // lent out, by size class
  size_t bytes_reserved() const;  // obtained from cudaMalloc and not yet freed
  int64_t live_buffers() const;

 private:
  friend class DeviceBuffer;
  void Return(void* p, size_t capacity);
  struct State;
  State* state_;
};

// Page-locked host memory (cudaHostAlloc) for staging copies. Move-only.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& o) noexcept { *this = std::move(o); }
  PinnedHostBuffer& operator=(PinnedHostBuffer&& o) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  [[nodiscard]] static absl::StatusOr<PinnedHostBuffer> Allocate(size_t bytes);
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Owns one non-blocking CUDA stream. Move-only.
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& o) noexcept { *this = std::move(o); }
  CudaStream& operator=(CudaStream&& o) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  [[nodiscard]] static absl::StatusOr<CudaStream> Create();
  StreamHandle get() const { return stream_; }
  absl::Status Synchronize() const;

 private:
  StreamHandle stream_ = nullptr;
};

// Owns one CUDA event (timing enabled). Move-only.
class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& o) noexcept { *this = std::move(o); }
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  [[nodiscard]] static absl::StatusOr<CudaEvent> Create();
  EventHandle get() const { return event_; }
  absl::Status Record(StreamHandle stream);
  absl::Status Synchronize() const;
  // Makes `stream` wait for this event (cross-stream ordering without a host sync).
  absl::Status BlockStream(StreamHandle stream) const;
  // Milliseconds between two recorded, completed events.
  static absl::StatusOr<float> ElapsedMs(const CudaEvent& start, const CudaEvent& end);

 private:
  EventHandle event_ = nullptr;
};

}  // namespace kvserve::cuda
