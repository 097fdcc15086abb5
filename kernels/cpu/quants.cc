// Plain-loop dequantizers of the ggml formats beyond Q8_0/Q4_0/Q4_1: Q5_0,
// Q5_1, IQ4_NL and the 256-element super-block formats Q2_K..Q6_K and
// IQ4_XS. These are the reference every fast kernel (CPU and CUDA) is tested
// against; each value is computed with the same float operations, in the
// same order, as ggml's dequantize_row_* so the results are bit-identical
// (checked against an independent implementation by quants_test's fixture).
// This file is compiled with -ffp-contract=off: a fused multiply-add would
// round `d * q - m` differently.
//
// Also here: the Q8_K activation quantizer (ggml's quantize_row_q8_K) and
// the plain-loop reference of the K-quant / IQ4_XS dot products on it, the
// integer-exact sums llama.cpp's vec_dot_*_q8_K compute.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

bool DecodeKSuperBlock(DType type, const void* block, KSuperBlockInts* out) {
  KSuperBlockInts& k = *out;
  k.dmin = 0.0f;
  for (int i = 0; i < 16; ++i) k.mn[i] = 0;
  switch (type) {
    case DType::kQ2_K: {
      const auto& x = *static_cast<const BlockQ2_K*>(block);
      k.d = H(x.d);
      k.dmin = H(x.dmin);
      for (int i = 0; i < 16; ++i) {
        const int half = i / 8;
        const int sh = 2 * ((i % 8) / 2);
        const int l0 = (i % 2) * 16;
        k.sc[i] = x.scales[i] & 0x0F;
        k.mn[i] = x.scales[i] >> 4;
        for (int l = 0; l < 16; ++l) {
          k.q[16 * i + l] = static_cast<int8_t>((x.qs[32 * half + l0 + l] >> sh) & 3);
        }
      }
      return true;
    }
    case DType::kQ3_K: {
      const auto& x = *static_cast<const BlockQ3_K*>(block);
      k.d = H(x.d);
      int sc[16];
      Q3KScales(x.scales, sc);
      for (int i = 0; i < 16; ++i) {
        const int half = i / 8;
        const int kk = (i % 8) / 2;
        const int l0 = (i % 2) * 16;
        k.sc[i] = sc[i] - 32;
        for (int l = 0; l < 16; ++l) {
          const int lo = (x.qs[32 * half + l0 + l] >> (2 * kk)) & 3;
          const int hb = (x.hmask[l0 + l] >> (4 * half + kk)) & 1;
          k.q[16 * i + l] = static_cast<int8_t>(lo - (hb ? 0 : 4));
        }
      }
      return true;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool five = type == DType::kQ5_K;
      const uint8_t* scales;
      const uint8_t* qs;
      const uint8_t* qh = nullptr;
      if (five) {
        const auto& x = *static_cast<const BlockQ5_K*>(block);
        k.d = H(x.d);
        k.dmin = H(x.dmin);
        scales = x.scales;
        qs = x.qs;
        qh = x.qh;
      } else {
        const auto& x = *static_cast<const BlockQ4_K*>(block);
        k.d = H(x.d);
        k.dmin = H(x.dmin);
        scales = x.scales;
        qs = x.qs;
      }
      for (int j = 0; j < 8; ++j) {
        int sc;
        int m;
        KQuantScaleMin(scales, j, &sc, &m);
        k.sc[2 * j] = k.sc[2 * j + 1] = sc;
        k.mn[2 * j] = k.mn[2 * j + 1] = m;
        for (int l = 0; l < 32; ++l) {
          int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
          if (five) v |= ((qh[l] >> j) & 1) << 4;
          k.q[32 * j + l] = static_cast<int8_t>(v);
        }
      }
      return true;
    }
    case DType::kQ6_K: {
      const auto& x = *static_cast<const BlockQ6_K*>(block);
      k.d = H(x.d);
      for (int i = 0; i < 16; ++i) {
        const int half = i / 8;
        const int kk = (i % 8) / 2;
        const int l0 = (i % 2) * 16;
        const uint8_t* ql = x.ql + 64 * half + 32 * (kk % 2);
        const uint8_t* qh = x.qh + 32 * half;
        const int lshift = 4 * (kk / 2);
        k.sc[i] = x.scales[i];
        for (int l = 0; l < 16; ++l) {
          const int v = ((ql[l0 + l] >> lshift) & 0x0F) | (((qh[l0 + l] >> (2 * kk)) & 3) << 4);
          k.q[16 * i + l] = static_cast<int8_t>(v - 32);
        }
      }
      return true;
    }
    case DType::kIQ4_XS: {
      const auto& x = *static_cast<const BlockIQ4_XS*>(block);
      k.d = H(x.d);
      for (int j = 0; j < 8; ++j) {
        k.sc[2 * j] = k.sc[2 * j + 1] = IQ4XSScale(x, j) - 32;
        const uint8_t* q = x.qs + 16 * j;
        for (int l = 0; l < 16; ++l) {
          k.q[32 * j + l] = kIq4nlValues[q[l] & 0x0F];
          k.q[32 * j + 16 + l] = kIq4nlValues[q[l] >> 4];
        }
      }
      return true;
    }
    default:
      return false;
  }
}

void QuantizeActsQ8KScalar(const float* x, int64_t n, int8_t* qs, float* ds, int16_t* bsums) {
  for (int64_t sb = 0; sb < n / kQK_K; ++sb) {
    const float* xb = x + sb * kQK_K;
    int8_t* q = qs + sb * kQK_K;
    float amax = 0.0f;
    for (int j = 0; j < kQK_K; ++j) amax = std::max(amax, std::fabs(xb[j]));
    float d = 0.0f;
    if (amax > 0.0f) {
      const float iscale = 127.0f / amax;
      for (int j = 0; j < kQK_K; ++j) q[j] = static_cast<int8_t>(std::nearbyint(iscale * xb[j]));
      d = 1.0f / iscale;
    } else {
      std::memset(q, 0, kQK_K);
    }
    for (int i = 0; i < kQK_K / 16; ++i) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += q[16 * i + l];
      bsums[sb * 16 + i] = static_cast<int16_t>(sum);
    }
    for (int c = 0; c < kQK_K / kQK; ++c) {
      const int64_t b = sb * (kQK_K / kQK) + c;
      ds[2 * b] = d;
      ds[2 * b + 1] = d * static_cast<float>(bsums[sb * 16 + 2 * c] + bsums[sb * 16 + 2 * c + 1]);
    }
  }
}

void MatMulRowsQ8KReference(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                            int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t nsb = w.cols / kQK_K;
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  const int64_t block_bytes = BlockBytes(w.type);
  std::vector<KSuperBlockInts> row(nsb);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* src = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t sb = 0; sb < nsb; ++sb) DecodeKSuperBlock(w.type, src + sb * block_bytes, &row[sb]);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = acts.qs + t * acts.n_blocks * kQK;
      const float* xds = acts.ds + t * 2 * acts.n_blocks;
      const int16_t* bs = acts.bsums + t * acts.n_blocks * 2;
      float sum = 0.0f;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const KSuperBlockInts& k = row[sb];
        const int8_t* x = xq + sb * kQK_K;
        int32_t isum = 0;
        int32_t msum = 0;
        for (int i = 0; i < 16; ++i) {
          int32_t s = 0;
          for (int l = 0; l < 16; ++l) s += k.q[16 * i + l] * x[16 * i + l];
          isum += k.sc[i] * s;
          msum += k.mn[i] * bs[sb * 16 + i];
        }
        const float da = xds[2 * sb * (kQK_K / kQK)];
        sum += (da * k.d) * static_cast<float>(isum);
        sum -= (da * k.dmin) * static_cast<float>(msum);
      }
      y[t * y_stride + r] = sum;
    }
  }
}

void MatMulRowsBlock32Reference(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                                int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / kQK;
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  std::vector<int8_t> q(w.cols);
  std::vector<float> d(nb), m(nb);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* src = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qs;
      uint32_t qh = 0;
      int offset = 0;
      m[b] = 0.0f;
      if (w.type == DType::kQ5_0) {
        const auto& x = reinterpret_cast<const BlockQ5_0*>(src)[b];
        d[b] = H(x.d);
        std::memcpy(&qh, x.qh, 4);
        qs = x.qs;
        offset = 16;
      } else if (w.type == DType::kQ5_1) {
        const auto& x = reinterpret_cast<const BlockQ5_1*>(src)[b];
        d[b] = H(x.d);
        m[b] = H(x.m);
        std::memcpy(&qh, x.qh, 4);
        qs = x.qs;
      } else {  // IQ4_NL
        const auto& x = reinterpret_cast<const BlockIQ4_NL*>(src)[b];
        d[b] = H(x.d);
        qs = x.qs;
      }
      for (int j = 0; j < kQK / 2; ++j) {
        int lo = qs[j] & 0x0F;
        int hi = qs[j] >> 4;
        if (w.type == DType::kIQ4_NL) {
          lo = kIq4nlValues[lo];
          hi = kIq4nlValues[hi];
        } else {
          lo |= ((qh >> j) & 1) << 4;
          hi |= ((qh >> (j + 16)) & 1) << 4;
        }
        q[b * kQK + j] = static_cast<int8_t>(lo - offset);
        q[b * kQK + j + kQK / 2] = static_cast<int8_t>(hi - offset);
      }
    }
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = acts.qs + t * acts.n_blocks * kQK;
      const float* xds = acts.ds + t * 2 * acts.n_blocks;
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < kQK; ++j) isum += q[b * kQK + j] * xq[b * kQK + j];
        sum += (d[b] * xds[2 * b]) * static_cast<float>(isum) + m[b] * xds[2 * b + 1];
      }
      y[t * y_stride + r] = sum;
    }
  }
}

}  // namespace kvserve::kernels::internal
