// AVX-512 VNNI kernels of the extended weight formats
// (matmul_quants_tile.h with vpdpbusd on 256-bit vectors, AVX512VL).
// Entered only after UseAvx512Vnni().

#define KVSERVE_QUANTS_VNNI 1
#include "kernels/cpu/matmul_quants_tile.h"

namespace kvserve::kernels::internal {

void MatMulRowsExtendedVnni(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  ExtDispatch(w, acts, n_tokens, r0, r1, y, y_stride);
}

}  // namespace kvserve::kernels::internal
