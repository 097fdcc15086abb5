// The one backend-selection file (see backend.h).
#include "model/backend.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "model/llama_cuda.h"

namespace kvserve {
namespace {

class CpuBackend final : public ForwardBackend {
 public:
  explicit CpuBackend(LlamaModel* model) : model_(model) {}
  Device device() const override { return Device::kCpu; }
  const LlamaConfig& config() const override { return model_->config(); }
  absl::Status Forward(const ForwardBatch& batch, const kernels::PagedKvView& kv, float* logits,
                       ThreadPool* pool) override {
    return model_->Forward(batch, kv, logits, pool);
  }

 private:
  LlamaModel* model_;
};

}  // namespace

const char* DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

absl::StatusOr<Device> ResolveDevice(std::string_view flag) {
  if (flag == "cpu") return Device::kCpu;
  if (flag == "cuda") return Device::kCuda;
  if (flag == "auto") return cuda::CudaUsable().ok() ? Device::kCuda : Device::kCpu;
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be cpu, cuda or auto; not '", std::string(flag), "'"));
}

std::unique_ptr<ForwardBackend> MakeCpuBackend(LlamaModel* model) {
  return std::make_unique<CpuBackend>(model);
}

absl::StatusOr<std::shared_ptr<ForwardBackend>> CreateBackend(std::string_view device_flag,
                                                              LlamaModel* model,
                                                              kernels::KvDType kv_dtype,
                                                              int32_t block_size) {
  absl::StatusOr<Device> device = ResolveDevice(device_flag);
  if (!device.ok()) return device.status();
  // auto never fails for the GPU's sake: a KV codec or model the CUDA
  // kernels do not run stays on the CPU, as it would without a GPU.
  if (device_flag == "auto" && *device == Device::kCuda &&
      (!CudaLlama::SupportsKvLayout(kv_dtype, block_size, model->config().head_dim).ok() ||
       !CudaLlama::SupportsModel(model->config()).ok())) {
    *device = Device::kCpu;
  }
  if (*device == Device::kCpu) return std::shared_ptr<ForwardBackend>(MakeCpuBackend(model));

  // Cheap checks first: a bad combination fails before any device work.
  const std::string flag = absl::StrCat("--device ", std::string(device_flag));
  auto named = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(flag, ": ", s.message()));
  };
  if (absl::Status s =
          CudaLlama::SupportsKvLayout(kv_dtype, block_size, model->config().head_dim);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaLlama::SupportsModel(model->config()); !s.ok()) return named(s);
  if (absl::Status usable = cuda::CudaUsable(); !usable.ok()) {
    return absl::Status(usable.code(),
                        absl::StrCat(flag, ": no usable CUDA device (", usable.message(),
                                     "); use --device cpu or auto"));
  }
  absl::StatusOr<std::unique_ptr<CudaLlama>> cuda_model = CudaLlama::Create(*model);
  if (!cuda_model.ok()) return named(cuda_model.status());
  return std::shared_ptr<ForwardBackend>(std::move(cuda_model).value());
}

}  // namespace kvserve
