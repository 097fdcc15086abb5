// cuBLAS matmuls on weights converted at load (matmul.h). Host code only.
#include "kernels/cuda/matmul.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve::cuda {
namespace {

absl::Status FromCublas(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cublasGetStatusString(s)));
}

size_t ElemBytes(WeightFormat f) { return f == WeightFormat::kF32 ? 4 : 2; }

}  // namespace

absl::StatusOr<DeviceWeight> UploadWeight(const kernels::WeightView& w, WeightFormat format,
                                          DeviceMemoryPool* pool, StreamHandle stream) {
  if (w.rows <= 0 || w.cols <= 0 || w.cols % kernels::BlockElems(w.type) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("UploadWeight: bad shape ", w.rows, "x",
                                                   w.cols, " for ", kernels::DTypeName(w.type)));
  }
  DeviceWeight out;
  out.format = format;
  out.rows = w.rows;
  out.cols = w.cols;
  const size_t row_out = static_cast<size_t>(w.cols) * ElemBytes(format);
  auto buf = pool->Allocate(row_out * static_cast<size_t>(w.rows));
  if (!buf.ok()) return buf.status();
  out.data = std::move(buf).value();

  // Convert in slabs of rows through pinned staging so a large matrix needs
  // no full host copy in the target format.
  const int64_t slab_rows = std::max<int64_t>(1, (int64_t{64} << 20) / static_cast<int64_t>(row_out));
  auto staging = PinnedHostBuffer::Allocate(row_out * static_cast<size_t>(std::min(slab_rows, w.rows)));
  if (!staging.ok()) return staging.status();
  std::vector<float> row(static_cast<size_t>(w.cols));
  const int64_t in_row_bytes = kernels::RowBytes(w.type, w.cols);
  const auto* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r0 = 0; r0 < w.rows; r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, w.rows - r0);
    // The previous slab's copy must finish before the staging is rewritten.
    KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* in = src + (r0 + r) * in_row_bytes;
      uint8_t* dst = staging->as<uint8_t>() + r * row_out;
      if ((w.type == kernels::DType::kF16 && format == WeightFormat::kF16) ||
          (w.type == kernels::DType::kBF16 && format == WeightFormat::kBF16) ||
          (w.type == kernels::DType::kF32 && format == WeightFormat::kF32)) {
        std::memcpy(dst, in, row_out);  // bit-exact
        continue;
      }
      kernels::DequantizeRow(w.type, in, row.data(), w.cols);
      if (format == WeightFormat::kF32) {
        std::memcpy(dst, row.data(), row_out);
      } else {
        auto* h = reinterpret_cast<uint16_t*>(dst);
        for (int64_t i = 0; i < w.cols; ++i) {
          h[i] = format == WeightFormat::kF16 ? Fp32ToFp16(row[i]) : Fp32ToBf16(row[i]);
        }
      }
    }
    KVSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out.data.as<uint8_t>() + r0 * row_out, staging->data(),
                        static_cast<size_t>(n) * row_out, cudaMemcpyHostToDevice, stream),
        "UploadWeight copy");
  }
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
  return out;
}

absl::StatusOr<std::unique_ptr<CublasMatMul>> CublasMatMul::Create(DeviceMemoryPool* pool,
                                                                   StreamHandle stream) {
  std::unique_ptr<CublasMatMul> m(new CublasMatMul());
  cublasHandle_t h = nullptr;
  if (absl::Status s = FromCublas(cublasCreate(&h), "cublasCreate"); !s.ok()) return s;
  m->handle_ = h;
  m->pool_ = pool;
  m->stream_ = stream;
  if (absl::Status s = FromCublas(cublasSetStream(h, stream), "cublasSetStream"); !s.ok()) {
    return s;
  }
  return m;
}

CublasMatMul::~CublasMatMul() {
  if (handle_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

absl::Status CublasMatMul::MatMul(const DeviceWeight& w, const float* x, int64_t n_tokens,
                                  int64_t x_stride, float* y, int64_t y_stride) {
  if (n_tokens <= 0) return absl::OkStatus();
  auto h = static_cast<cublasHandle_t>(handle_);
  // Row-major Y[n][rows] = X[n][cols] * W^T is, column-major,
  // Y^T[rows][n] = W[rows][cols] (stored as W^T col-major, hence OP_T) * X^T.
  const float alpha = 1.0f, beta = 0.0f;
  const void* b = x;
  cudaDataType_t ab_type = CUDA_R_32F;
  int64_t ldb = x_stride;
  if (w.format != WeightFormat::kF32) {
    // cuBLAS wants A and B of one type: activations go to f16/bf16, packed.
    const size_t need = static_cast<size_t>(n_tokens * w.cols) * 2;
    if (scratch_.size() < need) {
      scratch_.Reset();
      auto buf = pool_->Allocate(need);
      if (!buf.ok()) return buf.status();
      scratch_ = std::move(buf).value();
    }
    for (int64_t t = 0; t < n_tokens; ++t) {
      // One launch per token row only when rows are strided; packed input
      // converts in a single launch.
      if (x_stride == w.cols) {
        absl::Status s = w.format == WeightFormat::kF16
                             ? ConvertF32ToF16(x, n_tokens * w.cols, scratch_.as<uint16_t>(), stream_)
                             : ConvertF32ToBF16(x, n_tokens * w.cols, scratch_.as<uint16_t>(), stream_);
        if (!s.ok()) return s;
        break;
      }
      absl::Status s =
          w.format == WeightFormat::kF16
              ? ConvertF32ToF16(x + t * x_stride, w.cols, scratch_.as<uint16_t>() + t * w.cols, stream_)
              : ConvertF32ToBF16(x + t * x_stride, w.cols, scratch_.as<uint16_t>() + t * w.cols,
                                 stream_);
      if (!s.ok()) return s;
    }
    b = scratch_.data();
    ab_type = w.format == WeightFormat::kF16 ? CUDA_R_16F : CUDA_R_16BF;
    ldb = w.cols;
  }
  return FromCublas(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows),
                   static_cast<int>(n_tokens), static_cast<int>(w.cols), &alpha, w.data.data(),
                   ab_type, static_cast<int>(w.cols), b, ab_type, static_cast<int>(ldb), &beta, y,
                   CUDA_R_32F, static_cast<int>(y_stride), CUBLAS_COMPUTE_32F,
                   CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace kvserve::cuda
