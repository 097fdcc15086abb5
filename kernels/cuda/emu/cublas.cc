// The CUDA emulator's cuBLAS: handles and cublasGemmEx for f32, f16 and bf16
// operands with f32 output and f32 compute, the combinations matmul.cc uses.
// Column-major, as cuBLAS is. The GEMM queues on the handle's stream like any
// device work (queue.h) and accumulates in f32, in eight interleaved partial
// sums so that the compiler can vectorize it without reassociating anything.
#include <cublas_v2.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/half.h"
#include "kernels/cuda/emu/queue.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace kvserve::cuda_emu {
namespace {

size_t ElementBytes(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    default:
      return 0;
  }
}

float Load(const void* base, cudaDataType t, int64_t i) {
  switch (t) {
    case CUDA_R_32F:
      return static_cast<const float*>(base)[i];
    case CUDA_R_16F:
      return Fp16ToFp32(static_cast<const uint16_t*>(base)[i]);
    case CUDA_R_16BF:
      return Bf16ToFp32(static_cast<const uint16_t*>(base)[i]);
    default:
      return 0.0f;
  }
}

// op(M)(r, c) for a column-major M with leading dimension ld.
float At(const void* m, cudaDataType t, int64_t ld, bool trans, int64_t r, int64_t c) {
  return trans ? Load(m, t, c + r * ld) : Load(m, t, r + c * ld);
}

float Dot(const float* a, const float* b, int64_t k) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  float sum = 0.0f;
  for (; i < k; ++i) sum += a[i] * b[i];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

}  // namespace
}  // namespace kvserve::cuda_emu

using namespace kvserve::cuda_emu;  // NOLINT: the C API below is the emulator's surface

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  Drain();
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS (other)";
  }
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t /*algo*/) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (ElementBytes(Atype) == 0 || ElementBytes(Btype) == 0 || Ctype != CUDA_R_32F ||
      Atype != Btype || (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  // Leading dimensions as cuBLAS checks them.
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m || lda < 1 || ldb < 1 || ldc < 1) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float a_scale = *static_cast<const float*>(alpha);
  const float b_scale = *static_cast<const float*>(beta);
  OrderAfterLegacy(handle->stream);
  Enqueue([=] {
    // op(A) rows and op(B) columns as contiguous f32 vectors of length k.
    std::vector<float> a_rows(static_cast<size_t>(m) * k), b_cols(static_cast<size_t>(n) * k);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t i = 0; i < k; ++i) a_rows[r * k + i] = At(A, Atype, lda, ta, r, i);
    }
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t i = 0; i < k; ++i) b_cols[c * k + i] = At(B, Btype, ldb, tb, i, c);
    }
    auto* out = static_cast<float*>(C);
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t r = 0; r < m; ++r) {
        const float acc = Dot(&a_rows[r * k], &b_cols[c * k], k);
        float& y = out[r + c * static_cast<int64_t>(ldc)];
        // beta == 0 must not read C (it may hold NaN), as cuBLAS promises.
        y = b_scale == 0.0f ? a_scale * acc : a_scale * acc + b_scale * y;
      }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
