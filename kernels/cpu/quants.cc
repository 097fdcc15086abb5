// Plain-loop dequantizers of the ggml formats beyond Q8_0/Q4_0/Q4_1: Q5_0,
// Q5_1, IQ4_NL and the 256-element super-block formats Q2_K..Q6_K and
// IQ4_XS. These are the reference every fast kernel (CPU and CUDA) is tested
// against; each value is computed with the same float operations, in the
// same order, as ggml's dequantize_row_* so the results are bit-identical
// (checked against an independent implementation by quants_test's fixture).
// This file is compiled with -ffp-contract=off: a fused multiply-add would
// round `d * q - m` differently.

#include <cstring>

#include "common/half.h"
#include "kernels/cpu/matmul_internal.h"

namespace kvserve::kernels::internal {
namespace {

float H(uint16_t h) { return Fp16ToFp32(h); }

void DequantQ5_0(const BlockQ5_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = H(x[b].d);
    uint32_t qh;
    std::memcpy(&qh, x[b].qh, sizeof(qh));
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[b].qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (x[b].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = static_cast<float>(lo - 16) * d;
      y[j + kQK / 2] = static_cast<float>(hi - 16) * d;
    }
  }
}

void DequantQ5_1(const BlockQ5_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = H(x[b].d);
    const float m = H(x[b].m);
    uint32_t qh;
    std::memcpy(&qh, x[b].qh, sizeof(qh));
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[b].qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (x[b].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = static_cast<float>(lo) * d + m;
      y[j + kQK / 2] = static_cast<float>(hi) * d + m;
    }
  }
}

void DequantIQ4_NL(const BlockIQ4_NL* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = H(x[b].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * static_cast<float>(kIq4nlValues[x[b].qs[j] & 0x0F]);
      y[j + kQK / 2] = d * static_cast<float>(kIq4nlValues[x[b].qs[j] >> 4]);
    }
  }
}

void DequantQ2_K(const BlockQ2_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    const float dmin = H(x[b].dmin);
    for (int i = 0; i < 16; ++i) {  // sub-block i: elements 16i..16i+15
      const int half = i / 8;       // which 128-element half
      const int k = (i % 8) / 2;    // bit pair within the byte
      const int l0 = (i % 2) * 16;  // first or second 16 bytes of the 32
      const float dl = d * static_cast<float>(x[b].scales[i] & 0x0F);
      const float ml = dmin * static_cast<float>(x[b].scales[i] >> 4);
      for (int l = 0; l < 16; ++l) {
        const int q = (x[b].qs[32 * half + l0 + l] >> (2 * k)) & 3;
        *y++ = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

// The 16 6-bit scales of Q3_K, unpacked (still offset by 32).
void Q3KScales(const uint8_t* s, int* out) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = low | (high << 4);
  }
}

void DequantQ3_K(const BlockQ3_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    int sc[16];
    Q3KScales(x[b].scales, sc);
    for (int i = 0; i < 16; ++i) {
      const int half = i / 8;
      const int k = (i % 8) / 2;
      const int l0 = (i % 2) * 16;
      const float dl = d * static_cast<float>(sc[i] - 32);
      const int hbit = 4 * half + k;  // bit of hmask[l0 + l]
      for (int l = 0; l < 16; ++l) {
        const int lo = (x[b].qs[32 * half + l0 + l] >> (2 * k)) & 3;
        const int q = lo - ((x[b].hmask[l0 + l] >> hbit) & 1 ? 0 : 4);
        *y++ = dl * static_cast<float>(q);
      }
    }
  }
}

void DequantQ4_K(const BlockQ4_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    const float dmin = H(x[b].dmin);
    for (int j = 0; j < 8; ++j) {  // sub-block j: elements 32j..32j+31
      int sc;
      int m;
      KQuantScaleMin(x[b].scales, j, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* q = x[b].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        *y++ = dl * static_cast<float>((q[l] >> shift) & 0x0F) - ml;
      }
    }
  }
}

void DequantQ5_K(const BlockQ5_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    const float dmin = H(x[b].dmin);
    for (int j = 0; j < 8; ++j) {
      int sc;
      int m;
      KQuantScaleMin(x[b].scales, j, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* q = x[b].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 0x0F) | (((x[b].qh[l] >> j) & 1) << 4);
        *y++ = dl * static_cast<float>(v) - ml;
      }
    }
  }
}

void DequantQ6_K(const BlockQ6_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    for (int i = 0; i < 16; ++i) {  // sub-block i: elements 16i..16i+15
      const int half = i / 8;       // 128-element half: ql + 64 half, qh + 32 half
      const int k = (i % 8) / 2;    // quarter of the half: 0..3
      const int l0 = (i % 2) * 16;
      const uint8_t* ql = x[b].ql + 64 * half + 32 * (k % 2);
      const uint8_t* qh = x[b].qh + 32 * half;
      const int lshift = 4 * (k / 2);
      const float dl = d * static_cast<float>(x[b].scales[i]);
      for (int l = l0; l < l0 + 16; ++l) {
        const int q = (((ql[l] >> lshift) & 0x0F) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
        *y++ = dl * static_cast<float>(q);
      }
    }
  }
}

void DequantIQ4_XS(const BlockIQ4_XS* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = H(x[b].d);
    for (int j = 0; j < 8; ++j) {
      const int ls = IQ4XSScale(x[b], j);
      const float dl = d * static_cast<float>(ls - 32);
      const uint8_t* q = x[b].qs + 16 * j;
      for (int l = 0; l < 16; ++l) y[l] = dl * static_cast<float>(kIq4nlValues[q[l] & 0x0F]);
      for (int l = 0; l < 16; ++l) y[l + 16] = dl * static_cast<float>(kIq4nlValues[q[l] >> 4]);
      y += 32;
    }
  }
}

}  // namespace

bool DequantizeRowExtended(DType type, const void* src, float* dst, int64_t n) {
  const int64_t nb = n / BlockElems(type);
  switch (type) {
    case DType::kQ5_0:
      DequantQ5_0(static_cast<const BlockQ5_0*>(src), dst, nb);
      return true;
    case DType::kQ5_1:
      DequantQ5_1(static_cast<const BlockQ5_1*>(src), dst, nb);
      return true;
    case DType::kIQ4_NL:
      DequantIQ4_NL(static_cast<const BlockIQ4_NL*>(src), dst, nb);
      return true;
    case DType::kQ2_K:
      DequantQ2_K(static_cast<const BlockQ2_K*>(src), dst, nb);
      return true;
    case DType::kQ3_K:
      DequantQ3_K(static_cast<const BlockQ3_K*>(src), dst, nb);
      return true;
    case DType::kQ4_K:
      DequantQ4_K(static_cast<const BlockQ4_K*>(src), dst, nb);
      return true;
    case DType::kQ5_K:
      DequantQ5_K(static_cast<const BlockQ5_K*>(src), dst, nb);
      return true;
    case DType::kQ6_K:
      DequantQ6_K(static_cast<const BlockQ6_K*>(src), dst, nb);
      return true;
    case DType::kIQ4_XS:
      DequantIQ4_XS(static_cast<const BlockIQ4_XS*>(src), dst, nb);
      return true;
    default:
      return false;
  }
}

}  // namespace kvserve::kernels::internal
