// kernels/cuda without CUDA (KVSERVE_WITH_CUDA=OFF): every entry point of
// runtime.h, cuda_kernels.h, matmul.h and probe.h answers Unavailable, so
// callers and tests build unchanged and pick the CPU backend at run time.
#include <utility>

#include "kernels/cuda/attention_generic.h"
#include "kernels/cuda/attention_mass.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/probe.h"
#include "kernels/cuda/runtime.h"

namespace kvserve::cuda {
namespace {

absl::Status NotBuilt() {
  return absl::UnavailableError("kvserve was built without CUDA (KVSERVE_WITH_CUDA=OFF)");
}

}  // namespace

bool BuiltWithCuda() { return false; }
int UsableDeviceCount() { return 0; }
absl::Status CudaUsable() { return NotBuilt(); }
absl::StatusOr<std::string> DeviceName(int) { return NotBuilt(); }
int MultiprocessorCount() { return 0; }

absl::StatusOr<void*> DeviceAlloc(size_t) { return NotBuilt(); }
absl::Status DeviceFree(void*) { return NotBuilt(); }
absl::Status CopyToDevice(void*, const void*, size_t) { return NotBuilt(); }
absl::Status CopyToHost(void*, const void*, size_t) { return NotBuilt(); }
absl::Status CopyToDeviceAsync(void*, const void*, size_t, StreamHandle) { return NotBuilt(); }
absl::Status CopyToHostAsync(void*, const void*, size_t, StreamHandle) { return NotBuilt(); }
absl::Status CopyDeviceToDeviceAsync(void*, const void*, size_t, StreamHandle) {
  return NotBuilt();
}
absl::Status MemsetAsync(void*, int, size_t, StreamHandle) { return NotBuilt(); }
absl::Status DeviceSynchronize() { return NotBuilt(); }
absl::Status DeviceMemoryInfo(size_t*, size_t*) { return NotBuilt(); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  pool_ = std::exchange(o.pool_, nullptr);
  data_ = std::exchange(o.data_, nullptr);
  bytes_ = std::exchange(o.bytes_, 0);
  capacity_ = std::exchange(o.capacity_, 0);
  return *this;
}
void DeviceBuffer::Reset() {
  pool_ = nullptr;
  data_ = nullptr;
  bytes_ = capacity_ = 0;
}

struct DeviceMemoryPool::State {};
DeviceMemoryPool::DeviceMemoryPool() : state_(nullptr) {}
DeviceMemoryPool::~DeviceMemoryPool() = default;
absl::StatusOr<DeviceBuffer> DeviceMemoryPool::Allocate(size_t) { return NotBuilt(); }
absl::Status DeviceMemoryPool::Trim() { return absl::OkStatus(); }
size_t DeviceMemoryPool::bytes_in_use() const { return 0; }
size_t DeviceMemoryPool::bytes_reserved() const { return 0; }
int64_t DeviceMemoryPool::live_buffers() const { return 0; }
void DeviceMemoryPool::Return(void*, size_t) {}

PinnedHostBuffer::~PinnedHostBuffer() = default;
PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& o) noexcept {
  data_ = std::exchange(o.data_, nullptr);
  bytes_ = std::exchange(o.bytes_, 0);
  return *this;
}
absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Allocate(size_t) { return NotBuilt(); }

CudaStream::~CudaStream() = default;
CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  stream_ = std::exchange(o.stream_, nullptr);
  return *this;
}
absl::StatusOr<CudaStream> CudaStream::Create() { return NotBuilt(); }
absl::Status CudaStream::Synchronize() const { return NotBuilt(); }

CudaEvent::~CudaEvent() = default;
CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  event_ = std::exchange(o.event_, nullptr);
  return *this;
}
absl::StatusOr<CudaEvent> CudaEvent::Create() { return NotBuilt(); }
absl::Status CudaEvent::Record(StreamHandle) { return NotBuilt(); }
absl::Status CudaEvent::Synchronize() const { return NotBuilt(); }
absl::Status CudaEvent::BlockStream(StreamHandle) const { return NotBuilt(); }
absl::StatusOr<float> CudaEvent::ElapsedMs(const CudaEvent&, const CudaEvent&) {
  return NotBuilt();
}

absl::Status EmbeddingGather(kernels::DType, const void*, int64_t, int64_t, const int32_t*,
                             int64_t, float*, StreamHandle) {
  return NotBuilt();
}
absl::Status RmsNorm(const float*, const float*, int64_t, int64_t, float, float*, StreamHandle) {
  return NotBuilt();
}
absl::Status Rope(float*, int64_t, int64_t, int32_t, const int32_t*, const kernels::RopeParams&,
                  StreamHandle) {
  return NotBuilt();
}
absl::Status SiluMul(const float*, const float*, int64_t, float*, StreamHandle) {
  return NotBuilt();
}
absl::Status GeluTanhMul(const float*, const float*, int64_t, float*, StreamHandle) {
  return NotBuilt();
}
absl::Status AddRowBias(float*, const float*, int64_t, int64_t, StreamHandle) { return NotBuilt(); }
absl::Status ScaleInPlace(float*, float, int64_t, StreamHandle) { return NotBuilt(); }
absl::Status SoftcapInPlace(float*, float, int64_t, StreamHandle) { return NotBuilt(); }
absl::Status AddInPlace(float*, const float*, int64_t, StreamHandle) { return NotBuilt(); }
absl::Status ArgmaxRows(const float*, int64_t, int64_t, int64_t, int32_t*, StreamHandle) {
  return NotBuilt();
}
absl::Status ConvertF32ToF16(const float*, int64_t, uint16_t*, StreamHandle) {
  return NotBuilt();
}
absl::Status ConvertF32ToBF16(const float*, int64_t, uint16_t*, StreamHandle) {
  return NotBuilt();
}
absl::Status AppendKv(const kernels::PagedKvView&, int32_t, int32_t, const int32_t*,
                      const int32_t*, const float*, int64_t, const float*, int64_t,
                      StreamHandle) {
  return NotBuilt();
}
size_t PagedDecodeAttentionWorkspaceBytes(const kernels::PagedKvView&,
                                          const DecodeAttentionBatch&) {
  return 0;
}
absl::Status PagedDecodeAttention(const kernels::PagedKvView&, int32_t,
                                  const DecodeAttentionBatch&, const float*, int64_t, float*,
                                  int64_t, void*, size_t, StreamHandle) {
  return NotBuilt();
}
absl::Status PagedPrefillAttention(const kernels::PagedKvView&, int32_t,
                                   const PrefillAttentionBatch&, const float*, int64_t, float*,
                                   int64_t, StreamHandle) {
  return NotBuilt();
}
absl::Status CopyBlocks(uint8_t*, int64_t, const int32_t*, const int32_t*, int32_t,
                        StreamHandle) {
  return NotBuilt();
}
absl::Status GatherBlocksToHost(const uint8_t*, int64_t, const int32_t*, int32_t, void*,
                                StreamHandle) {
  return NotBuilt();
}
absl::Status ScatterBlocksFromHost(const void*, int64_t, const int32_t*, int32_t, uint8_t*,
                                   StreamHandle) {
  return NotBuilt();
}

absl::StatusOr<DeviceWeight> UploadWeight(const kernels::WeightView&, WeightFormat,
                                          DeviceMemoryPool*, StreamHandle) {
  return NotBuilt();
}
absl::Status QuantizeActs(const float*, int64_t, int64_t, int64_t, ActSum, int8_t*, float*,
                          StreamHandle) {
  return NotBuilt();
}
absl::Status QuantizedMatMul(kernels::DType, const void*, int64_t, int64_t, const int8_t*,
                             const float*, int64_t, float*, int64_t, StreamHandle) {
  return NotBuilt();
}
absl::Status DequantizeWeight(kernels::DType, const void*, int64_t, int64_t, float*,
                              StreamHandle) {
  return NotBuilt();
}
bool IsNativeType(kernels::DType) { return false; }
absl::StatusOr<std::unique_ptr<CublasMatMul>> CublasMatMul::Create(DeviceMemoryPool*,
                                                                   StreamHandle) {
  return NotBuilt();
}
CublasMatMul::~CublasMatMul() = default;
absl::Status CublasMatMul::MatMul(const DeviceWeight&, const float*, int64_t, int64_t, float*,
                                  int64_t) {
  return NotBuilt();
}

absl::StatusOr<BandwidthReport> ProbeBandwidth(size_t, int) { return NotBuilt(); }

absl::Status PagedAttentionGeneric(const kernels::PagedKvView&, int32_t, int32_t, const int32_t*,
                                   const int32_t*, int32_t, float, const float*, int64_t, float*,
                                   int64_t, int32_t, StreamHandle) {
  return NotBuilt();
}

absl::Status MoveKvRows(const kernels::PagedKvView&, int32_t, int32_t, const int32_t*,
                        const int32_t*, int32_t, StreamHandle) {
  return NotBuilt();
}

absl::Status AccumulateAttentionMass(const kernels::PagedKvView&, int32_t, int32_t, const int32_t*,
                                     const int32_t*, int32_t, float, const float*, int64_t,
                                     const int32_t*, float*, int64_t, StreamHandle) {
  return NotBuilt();
}

}  // namespace kvserve::cuda
