// Dense matmuls on the GPU. Weights are converted once, at load, from any
// kernels::DType to the device format chosen for them.
//
// - kF32/kF16/kBF16: cuBLAS GemmEx; the GGUF block types are dequantized on
//   the host, and activations are converted to the weights' type on the fly.
// - kNative: Q8_0/Q4_0/Q4_1 stay quantized on the device and run the integer
//   kernels of matmul_q.cu, which mirror the CPU backend's numerics
//   (kernels/cpu/matmul_internal.h): activations are quantized per 32-element
//   block to 8 bits exactly as QuantizeActsScalar does, each block's int32 dot
//   product is exact, and its float combination is the same expression as
//   MatMulRowsScalar's, so the result differs from the CPU's only by the
//   order of the float sum over blocks.
//
// Plain C++ header.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/runtime.h"

namespace kvserve::cuda {

// Device storage formats of converted weights.
//   kNative: the GGUF bytes of a Q8_0/Q4_0/Q4_1 matrix, split into two
//     regions of one buffer so that a block's quants are 16-byte aligned:
//       quants: rows * nb blocks of QB bytes, block (r, b) at (r * nb + b) * QB
//               (QB = 32 for Q8_0, 16 for Q4_0/Q4_1, the block's qs as in GGUF);
//       scales: right after the quants (offset rows * nb * QB, a multiple of
//               16), block (r, b) at (r * nb + b) * SB: fp16 d (SB = 2) for
//               Q8_0/Q4_0, fp16 d then fp16 m (SB = 4) for Q4_1.
//     nb = cols / 32. The size is exactly the GGUF tensor's.
//   kNative also holds the extended formats (Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
//     Q4_K, Q5_K, Q6_K, IQ4_XS) as the GGUF tensor's bytes unchanged, rows of
//     whole blocks one after another; their kernels (dequant.cuh) read the
//     blocks byte-wise.
enum class WeightFormat : uint8_t { kF32, kF16, kBF16, kNative };

// A row-major [rows][cols] weight matrix in device memory.
struct DeviceWeight {
  WeightFormat format = WeightFormat::kF16;
  // The source type; with kNative, the block type the bytes are in.
  kernels::DType type = kernels::DType::kF16;
  int64_t rows = 0;
  int64_t cols = 0;
  DeviceBuffer data;
};

// Whether kNative holds type t (Q8_0/Q4_0/Q4_1 and the extended formats).
bool IsNativeType(kernels::DType t);

// Dequantizes/converts w on the host and uploads it (synchronously on
// `stream`). F16 weights keep their bits with kF16, BF16 with kBF16, F32 with
// kF32. kNative takes the IsNativeType types only and keeps their bytes
// (layouts above); other types with kNative are InvalidArgument.
[[nodiscard]] absl::StatusOr<DeviceWeight> UploadWeight(const kernels::WeightView& w,
                                                        WeightFormat format,
                                                        DeviceMemoryPool* pool,
                                                        StreamHandle stream);

// ---- Quantized activations (matmul_q.cu) ----

// The sum term of a quantized activation block (kernels::internal::ActSum):
//   kExact: s = d16 * sum(q), d16 the fp16-rounded scale (Q8_0, Q4_0);
//   kQ8_1: s = fp16(d * sum(q)) with the unrounded d (Q4_1, ggml's Q8_1).
enum class ActSum : uint8_t { kExact, kQ8_1 };

// What the CPU's MatMul uses for a lone weight of type t. (MatMulMany with
// mixed quantized types uses kExact for all; the CUDA path quantizes per
// weight, so such a Q4_1 differs in the last bits of its min term.)
inline ActSum ActSumFor(kernels::DType t) {
  return t == kernels::DType::kQ4_1 ? ActSum::kQ8_1 : ActSum::kExact;
}

// Quantizes n_tokens rows of `cols` floats (x rows x_stride floats apart;
// cols % 32 == 0) bit-identically to kernels::internal::QuantizeActsScalar:
// token t's values at qs + t * cols, its (d, s) pairs at ds + t * 2 * (cols /
// 32). All device memory; enqueued on `stream`.
[[nodiscard]] absl::Status QuantizeActs(const float* x, int64_t n_tokens, int64_t x_stride,
                                        int64_t cols, ActSum mode, int8_t* qs, float* ds,
                                        StreamHandle stream);

// y[t][r] = W[r] . x[t] for a kNative weight (`type` IsNativeType, `data`
// in the kNative layout) against activations quantized by QuantizeActs with
// ActSumFor(type). qs must be 16-byte aligned. Enqueued on `stream`.
[[nodiscard]] absl::Status QuantizedMatMul(kernels::DType type, const void* data, int64_t rows,
                                           int64_t cols, const int8_t* qs, const float* ds,
                                           int64_t n_tokens, float* y, int64_t y_stride,
                                           StreamHandle stream);

// out[r][c] = the value of element c of row r of an extended-format matrix
// (`data`: rows of GGUF blocks, device memory), bit-identical to
// kernels::DequantizeRow. Other types are InvalidArgument. Enqueued on
// `stream`.
[[nodiscard]] absl::Status DequantizeWeight(kernels::DType type, const void* data, int64_t rows,
                                            int64_t cols, float* out, StreamHandle stream);

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
  // f32. Same contract as kernels::MatMul. kNative weights run the integer
  // kernels (QuantizeActs + QuantizedMatMul, scratch from the pool).
  absl::Status MatMul(const DeviceWeight& w, const float* x, int64_t n_tokens, int64_t x_stride,
                      float* y, int64_t y_stride);

 private:
  CublasMatMul() = default;
  void* handle_ = nullptr;  // cublasHandle_t
  DeviceMemoryPool* pool_ = nullptr;
  StreamHandle stream_ = nullptr;
  DeviceBuffer scratch_;  // activations converted to f16/bf16, or quantized
};

}  // namespace kvserve::cuda
