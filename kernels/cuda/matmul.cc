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

// The types whose kNative layout splits quants from scales.
bool IsBlockType(kernels::DType t) {
  return t == kernels::DType::kQ8_0 || t == kernels::DType::kQ4_0 || t == kernels::DType::kQ4_1;
}

// Extended formats: the GGUF bytes as they are, through pinned staging.
absl::StatusOr<DeviceWeight> UploadBytes(const kernels::WeightView& w, DeviceMemoryPool* pool,
                                         StreamHandle stream) {
  const int64_t row_bytes = kernels::RowBytes(w.type, w.cols);
  DeviceWeight out;
  out.format = WeightFormat::kNative;
  out.type = w.type;
  out.rows = w.rows;
  out.cols = w.cols;
  auto buf = pool->Allocate(static_cast<size_t>(w.rows * row_bytes));
  if (!buf.ok()) return buf.status();
  out.data = std::move(buf).value();
  const int64_t slab_rows = std::max<int64_t>(1, (int64_t{64} << 20) / row_bytes);
  auto staging =
      PinnedHostBuffer::Allocate(static_cast<size_t>(row_bytes * std::min(slab_rows, w.rows)));
  if (!staging.ok()) return staging.status();
  const auto* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r0 = 0; r0 < w.rows; r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, w.rows - r0);
    KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
    std::memcpy(staging->data(), src + r0 * row_bytes, static_cast<size_t>(n * row_bytes));
    KVSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out.data.as<uint8_t>() + r0 * row_bytes, staging->data(),
                        static_cast<size_t>(n * row_bytes), cudaMemcpyHostToDevice, stream),
        "UploadWeight copy");
  }
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
  return out;
}

// kNative (layout in matmul.h): the block's quants and its scales go to two
// regions of one buffer.
absl::StatusOr<DeviceWeight> UploadNative(const kernels::WeightView& w, DeviceMemoryPool* pool,
                                          StreamHandle stream) {
  const int64_t nb = w.cols / kernels::kQK;
  const int64_t block_bytes = kernels::BlockBytes(w.type);
  const int64_t scale_bytes = w.type == kernels::DType::kQ4_1 ? 4 : 2;
  const int64_t quant_bytes = block_bytes - scale_bytes;  // scales lead a GGUF block
  const size_t quants_total = static_cast<size_t>(w.rows * nb * quant_bytes);
  DeviceWeight out;
  out.format = WeightFormat::kNative;
  out.type = w.type;
  out.rows = w.rows;
  out.cols = w.cols;
  auto buf = pool->Allocate(static_cast<size_t>(w.rows * nb * block_bytes));
  if (!buf.ok()) return buf.status();
  out.data = std::move(buf).value();

  const int64_t row_bytes = nb * block_bytes;
  const int64_t slab_rows = std::max<int64_t>(1, (int64_t{64} << 20) / row_bytes);
  auto staging =
      PinnedHostBuffer::Allocate(static_cast<size_t>(row_bytes * std::min(slab_rows, w.rows)));
  if (!staging.ok()) return staging.status();
  const auto* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r0 = 0; r0 < w.rows; r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, w.rows - r0);
    // The previous slab's copies must finish before the staging is rewritten.
    KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
    // Staging: the slab's quants, then its scales.
    uint8_t* q = staging->as<uint8_t>();
    uint8_t* sc = q + n * nb * quant_bytes;
    for (int64_t i = 0; i < n * nb; ++i) {
      const uint8_t* blk = src + (r0 * nb + i) * block_bytes;
      std::memcpy(sc + i * scale_bytes, blk, static_cast<size_t>(scale_bytes));
      std::memcpy(q + i * quant_bytes, blk + scale_bytes, static_cast<size_t>(quant_bytes));
    }
    uint8_t* dst = out.data.as<uint8_t>();
    KVSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + r0 * nb * quant_bytes, q, static_cast<size_t>(n * nb * quant_bytes),
                        cudaMemcpyHostToDevice, stream),
        "UploadWeight copy");
    KVSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + quants_total + r0 * nb * scale_bytes, sc,
                        static_cast<size_t>(n * nb * scale_bytes), cudaMemcpyHostToDevice, stream),
        "UploadWeight copy");
  }
  KVSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "UploadWeight sync");
  return out;
}

}  // namespace

bool IsNativeType(kernels::DType t) {
  switch (t) {
    case kernels::DType::kQ8_0:
    case kernels::DType::kQ4_0:
    case kernels::DType::kQ4_1:
    case kernels::DType::kQ5_0:
    case kernels::DType::kQ5_1:
    case kernels::DType::kIQ4_NL:
    case kernels::DType::kQ2_K:
    case kernels::DType::kQ3_K:
    case kernels::DType::kQ4_K:
    case kernels::DType::kQ5_K:
    case kernels::DType::kQ6_K:
    case kernels::DType::kIQ4_XS:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<DeviceWeight> UploadWeight(const kernels::WeightView& w, WeightFormat format,
                                          DeviceMemoryPool* pool, StreamHandle stream) {
  if (w.rows <= 0 || w.cols <= 0 || w.cols % kernels::BlockElems(w.type) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("UploadWeight: bad shape ", w.rows, "x",
                                                   w.cols, " for ", kernels::DTypeName(w.type)));
  }
  if (format == WeightFormat::kNative) {
    if (!IsNativeType(w.type)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UploadWeight: the native format holds block-quantized types, not ",
          kernels::DTypeName(w.type)));
    }
    return IsBlockType(w.type) ? UploadNative(w, pool, stream) : UploadBytes(w, pool, stream);
  }
  DeviceWeight out;
  out.format = format;
  out.type = w.type;
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
  if (w.format == WeightFormat::kNative) {
    // Scratch: the quantized values, then the (d, s) pairs (offset rounded
    // to 16 bytes; the values of each token are 32-byte multiples).
    const int64_t nb = w.cols / kernels::kQK;
    const size_t qs_bytes = static_cast<size_t>(n_tokens * w.cols);
    const size_t ds_offset = (qs_bytes + 15) / 16 * 16;
    const size_t need = ds_offset + static_cast<size_t>(n_tokens * 2 * nb) * sizeof(float);
    if (scratch_.size() < need) {
      scratch_.Reset();
      auto buf = pool_->Allocate(need);
      if (!buf.ok()) return buf.status();
      scratch_ = std::move(buf).value();
    }
    int8_t* qs = scratch_.as<int8_t>();
    auto* ds = reinterpret_cast<float*>(scratch_.as<uint8_t>() + ds_offset);
    if (absl::Status s =
            QuantizeActs(x, n_tokens, x_stride, w.cols, ActSumFor(w.type), qs, ds, stream_);
        !s.ok()) {
      return s;
    }
    return QuantizedMatMul(w.type, w.data.data(), w.rows, w.cols, qs, ds, n_tokens, y, y_stride,
                           stream_);
  }
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
