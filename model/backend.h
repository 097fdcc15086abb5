// The backend seam: which device runs the model's forward and holds the KV
// cache. This file (with backend.cc) is the one place that chooses between
// the CPU forward (model/llama.cc over host KV memory) and the CUDA forward
// (model/llama_cuda.cc over device KV memory); the engine only sees a
// ForwardBackend. Neither file has an #ifdef: without CUDA the kernels/cuda
// stub answers Unavailable, so `--device cuda` fails at start-up with that
// reason and `--device auto` picks the CPU.
//
// Thread-safety: a backend belongs to one engine thread (Forward reuses
// scratch); creating one is done before the engine starts.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "kernels/cuda/runtime.h"
#include "kernels/kv_view.h"
#include "model/llama.h"

namespace kvserve {

enum class Device { kCpu, kCuda };
const char* DeviceName(Device d);

// "cpu", "cuda" or "auto" (cuda when cuda::CudaUsable() is OK, else cpu).
// InvalidArgument for anything else; `cuda` is not checked for usability here
// (CreateBackend reports why it cannot run).
[[nodiscard]] absl::StatusOr<Device> ResolveDevice(std::string_view flag);

// Runs LlamaModel's forward on one device. The KV view handed to Forward
// points into memory of this backend's kind (kv.pool is host memory for the
// CPU, device memory for CUDA); its block table (block_ids,
// seq_block_offsets) is always HOST memory, as the engine builds it, and
// `logits` is host memory: the CPU sampler works unchanged.
class ForwardBackend {
 public:
  virtual ~ForwardBackend() = default;
  virtual Device device() const = 0;
  const char* name() const { return DeviceName(device()); }
  virtual const LlamaConfig& config() const = 0;

  // Same contract as LlamaModel::Forward (see model/llama.h).
  [[nodiscard]] virtual absl::Status Forward(const ForwardBatch& batch,
                                             const kernels::PagedKvView& kv, float* logits,
                                             ThreadPool* pool) = 0;

  // Where the KV pool must put its blocks: nullptr for host memory, else the
  // device pool to allocate them from; block copies (copy-on-write) are then
  // enqueued on kv_stream(), the stream Forward runs on, so they are ordered
  // before the next forward.
  virtual cuda::DeviceMemoryPool* kv_device_memory() { return nullptr; }
  virtual cuda::StreamHandle kv_stream() { return nullptr; }

  // OK when this backend can run a KV cache of this codec and block size;
  // otherwise InvalidArgument/Unimplemented naming the problem (checked at
  // start-up, before any request).
  [[nodiscard]] virtual absl::Status CheckKvLayout(kernels::KvDType dtype,
                                                   int32_t block_size) const {
    return absl::OkStatus();
  }
};

// The CPU backend: LlamaModel::Forward over host KV, exactly as without a
// backend. `model` must outlive it.
std::unique_ptr<ForwardBackend> MakeCpuBackend(LlamaModel* model);

// Resolves `device_flag` (see ResolveDevice; "auto" also stays on the CPU
// when the KV codec, block size or head dim is one the CUDA kernels do not
// run), checks the combination (KV
// codec, block size, head dim) and builds the backend: for CUDA this uploads
// every weight to the device. `model` must outlive the backend. Errors name
// the flag and the problem, e.g. "--device cuda: no usable CUDA device
// (built without CUDA)" or "--device cuda does not support
// --kv-cache-dtype int8".
[[nodiscard]] absl::StatusOr<std::shared_ptr<ForwardBackend>> CreateBackend(
    std::string_view device_flag, LlamaModel* model, kernels::KvDType kv_dtype, int32_t block_size);

}  // namespace kvserve
