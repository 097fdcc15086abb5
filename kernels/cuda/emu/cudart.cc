// The CUDA emulator's runtime API: the subset of cudart that kernels/cuda
// calls, on host memory. Device allocations end flush against a guard page,
// so a kernel that runs past the end of its buffer faults at once (to within
// the 256-byte allocation granularity) rather than reading a neighbour.
// Copies check that their device side lies inside one allocation.
//
// Environment: KVSERVE_CUDA_EMU_MEMORY (bytes of emulated device memory,
// default 4 GiB), KVSERVE_CUDA_EMU_DEVICES (0 emulates a machine without a
// GPU), KVSERVE_CUDA_EMU_SEED (device.h).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cuda/emu/queue.h"

struct CUstream_st {
  int id = 0;
  bool blocking = true;  // created without cudaStreamNonBlocking
};

struct CUevent_st {
  std::chrono::steady_clock::time_point at;
  std::atomic<bool> recorded{false};  // a record was queued
  std::atomic<bool> done{false};      // ... and has run
};

namespace kvserve::cuda_emu {
namespace {

constexpr size_t kAlign = 256;

struct Allocation {
  size_t bytes = 0;  // as asked for: copies must stay inside
  size_t rounded = 0;  // as accounted
  void* map_base = nullptr;  // device memory only
  size_t map_bytes = 0;
  bool pinned = false;
};

std::mutex g_mem_mu;
std::map<uintptr_t, Allocation> g_allocs;  // by start address
size_t g_device_bytes = 0;

size_t Capacity() {
  static const size_t cap = [] {
    const char* s = std::getenv("KVSERVE_CUDA_EMU_MEMORY");
    return s != nullptr ? static_cast<size_t>(std::strtoull(s, nullptr, 10))
                        : size_t{4} << 30;
  }();
  return cap;
}

int DeviceCount() {
  const char* s = std::getenv("KVSERVE_CUDA_EMU_DEVICES");
  return s != nullptr ? std::atoi(s) : 1;
}

// Whether [p, p+n) lies inside one allocation of the given kind.
bool Inside(const void* p, size_t n, bool pinned) {
  std::lock_guard<std::mutex> lock(g_mem_mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return false;
  --it;
  return it->second.pinned == pinned && a + n <= it->first + it->second.bytes;
}

bool IsDevice(const void* p, size_t n) { return n == 0 || Inside(p, n, false); }
bool IsPinned(const void* p, size_t n) { return n > 0 && Inside(p, n, true); }

cudaError_t Fail(cudaError_t e) {
  SetLastError(e);
  return e;
}

cudaError_t CheckCopy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return IsDevice(dst, n) ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost:
      return IsDevice(src, n) ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice:
      return IsDevice(dst, n) && IsDevice(src, n) ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault:
      return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

// Synchronous pageable host-to-device copies whose DMA has not landed.
std::mutex g_legacy_mu;
std::vector<std::pair<void*, std::vector<char>>> g_legacy_copies;

bool WaitsForLegacy(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread || s->blocking;
}

}  // namespace

void SyncLegacyStream() {
  std::vector<std::pair<void*, std::vector<char>>> copies;
  {
    std::lock_guard<std::mutex> lock(g_legacy_mu);
    copies.swap(g_legacy_copies);
  }
  for (auto& [dst, bytes] : copies) std::memcpy(dst, bytes.data(), bytes.size());
}

void OrderAfterLegacy(cudaStream_t stream) {
  if (WaitsForLegacy(stream)) Enqueue([] { SyncLegacyStream(); });
}

namespace {

// What a device-wide wait sees: every queued op, then the legacy stream's
// pending copies.
void DrainAll() {
  Drain();
  SyncLegacyStream();
}

}  // namespace

}  // namespace kvserve::cuda_emu

using namespace kvserve::cuda_emu;  // NOLINT: the C API below is the emulator's surface

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  const int n = DeviceCount();
  *count = n > 0 ? n : 0;
  return n > 0 ? cudaSuccess : Fail(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : Fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "kvserve CUDA emulator (CPU)", sizeof(prop->name) - 1);
  prop->totalGlobalMem = Capacity();
  prop->sharedMemPerBlock = 48 * 1024;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  prop->multiProcessorCount = 132;  // as an H200, so work-splitting heuristics match it
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    default:
      return Fail(cudaErrorInvalidValue);
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    default:
      return "unrecognized error code";
  }
}

const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  const size_t page = static_cast<size_t>(getpagesize());
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    if (rounded > Capacity() - g_device_bytes) return Fail(cudaErrorMemoryAllocation);
    g_device_bytes += rounded;
  }
  const size_t map_bytes = (rounded + page - 1) / page * page + page;
  void* base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    g_device_bytes -= rounded;
    return Fail(cudaErrorMemoryAllocation);
  }
  char* guard = static_cast<char*>(base) + map_bytes - page;
  mprotect(guard, page, PROT_NONE);
  char* start = guard - rounded;
  // Fresh device memory is not zero on a GPU; make reads of it visible.
  std::memset(start, 0xA5, rounded);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  g_allocs[reinterpret_cast<uintptr_t>(start)] = {bytes, rounded, base, map_bytes, false};
  *p = start;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  DrainAll();  // cudaFree waits for the device
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end() || it->second.pinned) return Fail(cudaErrorInvalidValue);
    a = it->second;
    g_allocs.erase(it);
    g_device_bytes -= a.rounded;
  }
  munmap(a.map_base, a.map_bytes);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int /*flags*/) {
  *p = nullptr;
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* mem = std::aligned_alloc(4096, rounded);
  if (mem == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  g_allocs[reinterpret_cast<uintptr_t>(mem)] = {bytes, rounded, nullptr, 0, true};
  *p = mem;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  Drain();
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end() || !it->second.pinned) return Fail(cudaErrorInvalidValue);
    g_allocs.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(g_mem_mu);
  *total_bytes = Capacity();
  *free_bytes = Capacity() - g_device_bytes;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (cudaError_t e = CheckCopy(dst, src, n, kind); e != cudaSuccess) return Fail(e);
  DrainAll();  // copies on the legacy stream run one after another
  if (n == 0) return cudaSuccess;
  if (kind == cudaMemcpyHostToDevice && !IsPinned(src, n)) {
    // Staged and returned; the DMA lands later (queue.h).
    std::lock_guard<std::mutex> lock(g_legacy_mu);
    g_legacy_copies.emplace_back(dst, std::vector<char>(static_cast<const char*>(src),
                                                        static_cast<const char*>(src) + n));
    return cudaSuccess;
  }
  std::memmove(dst, src, n);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (cudaError_t e = CheckCopy(dst, src, n, kind); e != cudaSuccess) return Fail(e);
  if (n == 0) return cudaSuccess;
  OrderAfterLegacy(stream);
  if (kind == cudaMemcpyHostToDevice && !IsPinned(src, n)) {
    // From pageable memory the driver stages the source before returning.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + n);
    Enqueue([dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  if (kind == cudaMemcpyDeviceToHost && !IsPinned(dst, n)) {
    // To pageable memory the copy is synchronous.
    Drain();  // OrderAfterLegacy above has queued the legacy wait where due
    std::memcpy(dst, src, n);
    return cudaSuccess;
  }
  Enqueue([dst, src, n] { std::memmove(dst, src, n); });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t stream) {
  if (!IsDevice(dst, n)) return Fail(cudaErrorInvalidValue);
  OrderAfterLegacy(stream);
  if (n > 0) Enqueue([dst, value, n] { std::memset(dst, value, n); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, size_t n) {
  if (!IsDevice(dst, n)) return Fail(cudaErrorInvalidValue);
  DrainAll();
  if (n > 0) std::memset(dst, value, n);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  DrainAll();
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  *s = new CUstream_st;
  (*s)->blocking = (flags & cudaStreamNonBlocking) == 0;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Drain();
  if (WaitsForLegacy(stream)) SyncLegacyStream();
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t /*stream*/, cudaEvent_t event,
                                unsigned int /*flags*/) {
  // One queue in issue order already runs everything recorded before.
  return event != nullptr ? cudaSuccess : Fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int /*flags*/) {
  return cudaEventCreate(e);
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  Drain();  // a queued record may still point at it
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  OrderAfterLegacy(stream);
  e->recorded = true;
  e->done = false;
  Enqueue([e] {
    e->at = std::chrono::steady_clock::now();
    e->done = true;
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  Drain();
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (start == nullptr || end == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (!start->recorded || !end->recorded) return Fail(cudaErrorInvalidResourceHandle);
  if (!start->done || !end->done) return Fail(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}

}  // extern "C"
