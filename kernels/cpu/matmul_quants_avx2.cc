// AVX2 kernels of the extended weight formats (matmul_quants_tile.h).
// Compiled with -mavx2 -mfma -mf16c; entered only after UseAvx2().

#include "kernels/cpu/matmul_quants_tile.h"

namespace kvserve::kernels::internal {

void MatMulRowsExtendedAvx2(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  ExtDispatch(w, acts, n_tokens, r0, r1, y, y_stride);
}

}  // namespace kvserve::kernels::internal
