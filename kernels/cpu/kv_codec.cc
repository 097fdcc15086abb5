#include "kernels/cpu/kv_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/half.h"

namespace kvserve::kernels {
namespace {

// Decoding tables of the 256 codes, built once: decoding is a load, and the
// encoder searches the sorted positive half instead of re-deriving bit fields.
struct Fp8Format {
  int exp_bits;
  int man_bits;
  int bias;
  bool ieee_special;  // e5m2: exponent all-ones is inf/NaN; e4m3 only 0x7f/0xff is NaN
  std::array<float, 256> decode;
  int max_code;  // largest finite positive code

  Fp8Format(int e, int m, bool ieee) : exp_bits(e), man_bits(m), bias((1 << (e - 1)) - 1),
                                       ieee_special(ieee) {
    for (int c = 0; c < 256; ++c) {
      const int sign = c >> 7;
      const int ex = (c >> m) & ((1 << e) - 1);
      const int man = c & ((1 << m) - 1);
      float v;
      if (ieee && ex == (1 << e) - 1) {
        v = man == 0 ? std::numeric_limits<float>::infinity()
                     : std::numeric_limits<float>::quiet_NaN();
      } else if (!ieee && (c & 0x7f) == 0x7f) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (ex == 0) {
        v = std::ldexp(static_cast<float>(man), 1 - bias - m);
      } else {
        v = std::ldexp(1.0f + std::ldexp(static_cast<float>(man), -m), ex - bias);
      }
      decode[c] = sign ? -v : v;
    }
    max_code = ieee ? ((((1 << e) - 1) << m) - 1) : 0x7e;
  }

  uint8_t Encode(float f) const {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    const float a = std::fabs(f);
    // Nearest code among the monotonic positive codes [0, max_code];
    // saturate above the largest finite value.
    const float* lo = decode.data();
    const float* hi = decode.data() + max_code + 1;
    const float* it = std::lower_bound(lo, hi, a);
    int code;
    if (it == hi) {
      code = max_code;
    } else if (it == lo || *it == a) {
      code = static_cast<int>(it - lo);
    } else {
      const int up = static_cast<int>(it - lo);
      const float d_up = *it - a;
      const float d_down = a - *(it - 1);
      // Ties go to the even code (even mantissa), as IEEE rounding does.
      if (d_down < d_up || (d_down == d_up && ((up - 1) & 1) == 0)) {
        code = up - 1;
      } else {
        code = up;
      }
    }
    return static_cast<uint8_t>(sign | code);
  }
};

const Fp8Format& E4M3() {
  static const Fp8Format f(4, 3, false);
  return f;
}
const Fp8Format& E5M2() {
  static const Fp8Format f(5, 2, true);
  return f;
}

float LoadF32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void StoreF32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof(v)); }
uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

float AbsMax(const float* x, int32_t n) {
  float m = 0.0f;
  for (int32_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

void QuantizeFp8(const Fp8Format& fmt, float fmt_max, const float* src, int32_t n, uint8_t* data,
                 uint8_t* meta) {
  const float amax = AbsMax(src, n);
  const float scale = amax > 0.0f ? amax / fmt_max : 0.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  StoreF32(meta, scale);
  for (int32_t i = 0; i < n; ++i) data[i] = fmt.Encode(src[i] * inv);
}

void QuantizeInt4(const float* src, int32_t n, uint8_t* data, uint8_t* meta) {
  uint8_t codes[kInt4Group];
  std::memset(data, 0, static_cast<size_t>(KvRowBytes(KvDType::kInt4, n)));
  for (int32_t g0 = 0, g = 0; g0 < n; g0 += kInt4Group, ++g) {
    const int32_t len = std::min(kInt4Group, n - g0);
    float lo = src[g0], hi = src[g0];
    for (int32_t i = 1; i < len; ++i) {
      lo = std::min(lo, src[g0 + i]);
      hi = std::max(hi, src[g0 + i]);
    }
    // Scale and minimum are stored as f16; codes are chosen against the
    // rounded values so dequantization sees exactly what quantization used.
    const float min_h = Fp16ToFp32(Fp32ToFp16(lo));
    const float scale_h = Fp16ToFp32(Fp32ToFp16((hi - min_h) / 15.0f));
    const float inv = scale_h > 0.0f ? 1.0f / scale_h : 0.0f;
    StoreU16(meta + 4 * g, Fp32ToFp16(scale_h));
    StoreU16(meta + 4 * g + 2, Fp32ToFp16(min_h));
    for (int32_t i = 0; i < len; ++i) {
      const float q = std::nearbyint((src[g0 + i] - min_h) * inv);
      codes[i] = static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
    }
    // Groups start at even channels (kInt4Group is even), so each group
    // packs into whole bytes except an odd tail.
    PackInt4(codes, len, data + g0 / 2);
  }
}

void DequantizeInt4(const uint8_t* data, const uint8_t* meta, int32_t n, float* dst) {
  uint8_t codes[kInt4Group];
  for (int32_t g0 = 0, g = 0; g0 < n; g0 += kInt4Group, ++g) {
    const int32_t len = std::min(kInt4Group, n - g0);
    const float scale = Fp16ToFp32(LoadU16(meta + 4 * g));
    const float mn = Fp16ToFp32(LoadU16(meta + 4 * g + 2));
    UnpackInt4(data + g0 / 2, len, codes);
    for (int32_t i = 0; i < len; ++i) dst[g0 + i] = codes[i] * scale + mn;
  }
}

}  // namespace

const float* Fp8DecodeTable(KvDType t) {
  return t == KvDType::kFp8E5M2 ? E5M2().decode.data() : E4M3().decode.data();
}

uint8_t Fp32ToE4M3(float f) { return E4M3().Encode(f); }
float E4M3ToFp32(uint8_t b) { return E4M3().decode[b]; }
uint8_t Fp32ToE5M2(float f) { return E5M2().Encode(f); }
float E5M2ToFp32(uint8_t b) { return E5M2().decode[b]; }

void PackInt4(const uint8_t* codes, int32_t n, uint8_t* packed) {
  for (int32_t i = 0; i + 1 < n; i += 2) {
    packed[i / 2] = static_cast<uint8_t>((codes[i] & 0xf) | (codes[i + 1] << 4));
  }
  if (n % 2 != 0) packed[n / 2] = codes[n - 1] & 0xf;
}

void UnpackInt4(const uint8_t* packed, int32_t n, uint8_t* codes) {
  for (int32_t i = 0; i < n; ++i) codes[i] = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
}

void QuantizeRow(KvDType t, const float* src, int32_t n, uint8_t* data, uint8_t* meta) {
  switch (t) {
    case KvDType::kF32:
      std::memcpy(data, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case KvDType::kF16:
      for (int32_t i = 0; i < n; ++i) StoreU16(data + 2 * i, Fp32ToFp16(src[i]));
      return;
    case KvDType::kBF16:
      for (int32_t i = 0; i < n; ++i) StoreU16(data + 2 * i, Fp32ToBf16(src[i]));
      return;
    case KvDType::kFp8E4M3:
      return QuantizeFp8(E4M3(), kE4M3Max, src, n, data, meta);
    case KvDType::kFp8E5M2:
      return QuantizeFp8(E5M2(), kE5M2Max, src, n, data, meta);
    case KvDType::kInt8: {
      const float amax = AbsMax(src, n);
      const float scale = amax / 127.0f;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      StoreF32(meta, scale);
      for (int32_t i = 0; i < n; ++i) {
        const float q = std::clamp(std::nearbyint(src[i] * inv), -127.0f, 127.0f);
        data[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      return;
    }
    case KvDType::kInt4:
      return QuantizeInt4(src, n, data, meta);
  }
}

void DequantizeRow(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n, float* dst) {
  switch (t) {
    case KvDType::kF32:
      std::memcpy(dst, data, static_cast<size_t>(n) * sizeof(float));
      return;
    case KvDType::kF16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(LoadU16(data + 2 * i));
      return;
    case KvDType::kBF16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(LoadU16(data + 2 * i));
      return;
    case KvDType::kFp8E4M3: {
      const float scale = LoadF32(meta);
      const float* table = E4M3().decode.data();
      for (int32_t i = 0; i < n; ++i) dst[i] = table[data[i]] * scale;
      return;
    }
    case KvDType::kFp8E5M2: {
      const float scale = LoadF32(meta);
      const float* table = E5M2().decode.data();
      for (int32_t i = 0; i < n; ++i) dst[i] = table[data[i]] * scale;
      return;
    }
    case KvDType::kInt8: {
      const float scale = LoadF32(meta);
      for (int32_t i = 0; i < n; ++i) dst[i] = static_cast<int8_t>(data[i]) * scale;
      return;
    }
    case KvDType::kInt4:
      return DequantizeInt4(data, meta, n, dst);
  }
}

std::string_view KvDTypeName(KvDType t) {
  switch (t) {
    case KvDType::kF32: return "f32";
    case KvDType::kF16: return "f16";
    case KvDType::kBF16: return "bf16";
    case KvDType::kFp8E4M3: return "fp8-e4m3";
    case KvDType::kFp8E5M2: return "fp8-e5m2";
    case KvDType::kInt8: return "int8";
    case KvDType::kInt4: return "int4";
  }
  return "?";
}

bool ParseKvDType(std::string_view name, KvDType* out) {
  for (KvDType t : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kFp8E4M3,
                    KvDType::kFp8E5M2, KvDType::kInt8, KvDType::kInt4}) {
    if (name == KvDTypeName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

}  // namespace kvserve::kernels
