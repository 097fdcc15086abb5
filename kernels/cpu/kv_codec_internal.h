// The pieces of the plain KV codecs (kv_codec.cc) that the SIMD codecs
// (attention_avx2.cc) call, so both compute every parameter the same way.
#pragma once

#include <cstdint>

namespace kvserve::kernels::internal {

// int4-kivi keys: the step ladder (256 steps, kv_view.h's kKiviStep*), and
// the smallest step (and its zero point) whose 16 codes cover [lo, hi].
const float* KiviStepTable();
void ChooseKiviParams(float lo, float hi, uint8_t* e_out, int8_t* z_out);

}  // namespace kvserve::kernels::internal
