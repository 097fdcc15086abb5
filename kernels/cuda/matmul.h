// Dense matmuls on the GPU through cuBLAS. Weights are converted once, at
// load, from any kernels::DType (F32, F16, BF16 and the GGUF block types,
// dequantized on the host) to the device format chosen for them; activations
// are converted to the same format on the fly. Plain C++ header.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/runtime.h"

namespace kvserve::cuda {

// Device storage formats of converted weights.
enum class WeightFormat : uint8_t { kF32, kF16, kBF16 };

// A row-major [rows][cols] weight matrix in device memory.
struct DeviceWeight {
  WeightFormat format = WeightFormat::kF16;
  int64_t rows = 0;
  int64_t cols = 0;
  DeviceBuffer data;
};

// Dequantizes/converts w on the host and uploads it (synchronously on
// `stream`). F16 weights keep their bits with kF16, BF16 with kBF16.
[[nodiscard]] absl::StatusOr<DeviceWeight> UploadWeight(const kernels::WeightView& w,
                                                        WeightFormat format,
                                                        DeviceMemoryPool* pool,
                                                        StreamHandle stream);

// Owns a cuBLAS handle bound to one stream plus the activation scratch.
// Not thread-safe: one per engine thread/stream.
class CublasMatMul {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CublasMatMul>> Create(
      DeviceMemoryPool* pool, StreamHandle stream);
  ~CublasMatMul();
  CublasMatMul(const CublasMatMul&) = delete;
  CublasMatMul& operator=(const CublasMatMul&) = delete;

  // y[t][r] = sum_i W[r][i] * x[t][i] for t < n_tokens (x rows x_stride floats
  // apart, y rows y_stride floats apart; all device memory), accumulated in
  // f32. Same contract as kernels::MatMul.
  absl::Status MatMul(const DeviceWeight& w, const float* x, int64_t n_tokens, int64_t x_stride,
                      float* y, int64_t y_stride);

 private:
  CublasMatMul() = default;
  void* handle_ = nullptr;  // cublasHandle_t
  DeviceMemoryPool* pool_ = nullptr;
  StreamHandle stream_ = nullptr;
  DeviceBuffer scratch_;  // activations converted to f16/bf16
};

}  // namespace kvserve::cuda
