// AVX2 versions of the element-wise kernels (ops_avx2.cc); ops.cc decides
// at run time whether to call them.
#pragma once

#include <cstdint>

namespace kvserve::kernels::internal {

void RmsNormAvx2(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
                 float* out);
// Rope's rotation of n_heads heads from one position's cos/sin table (kNeox
// when neox, else kNorm pairs), with the portable loop's fused roundings.
void RotateHeadsAvx2(float* x, int32_t n_heads, int32_t head_dim, const float* cs,
                     const float* sn, int32_t half, bool neox);
void SiluMulAvx2(const float* gate, const float* up, int64_t n, float* out);
// ggml's GELU (tanh form) of every f16 value, indexed by its bits.
const float* GeluTanhTable();
// GeluTanhMul with F16C rounding and gathers from `table`, bit for bit the
// plain loop (both round the gate to f16 to nearest even).
void GeluTanhMulAvx2(const float* table, const float* gate, const float* up, int64_t n,
                     float* out);
void AddInPlaceAvx2(float* x, const float* y, int64_t n);
float SoftmaxInPlaceAvx2(float* x, int64_t n);
int64_t ArgMaxAvx2(const float* x, int64_t n);

}  // namespace kvserve::kernels::internal
