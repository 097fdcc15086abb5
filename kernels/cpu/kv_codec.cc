#include "kernels/cpu/kv_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/kv_codec_internal.h"

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
  float max_value;        // decode[max_code]
  float min_normal;       // 2^(1 - bias)
  float subnormal_scale;  // 1 / the smallest subnormal

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
    max_value = decode[max_code];
    min_normal = std::ldexp(1.0f, 1 - bias);
    subnormal_scale = std::ldexp(1.0f, bias - 1 + m);
  }

  // Round to nearest, ties to even, on the format's grid, by arithmetic: a
  // value's code is its exponent field times 2^man_bits plus its mantissa
  // rounded to man_bits (a carry out of the mantissa lands on the next
  // exponent's first code, which is the next code); below the smallest
  // normal the grid is uniform and the code is the value in units of the
  // smallest subnormal. Equals EncodeBySearch for every input (tested
  // against it on every code, every midpoint between codes and their
  // neighbours, and random floats); 5x faster, which is what the host
  // tier's fp8 re-encoding costs per block.
  uint8_t Encode(float f) const {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    const float a = std::fabs(f);
    if (a >= max_value) return static_cast<uint8_t>(sign | max_code);
    // x + 2^23 - 2^23 rounds x in [0, 2^22) to an integer, ties to even
    // (the FPU's default mode), without a libm call.
    constexpr float kRound = 8388608.0f;
    int code;
    if (a < min_normal) {
      code = static_cast<int>((a * subnormal_scale + kRound) - kRound);
    } else {
      uint32_t bits;
      std::memcpy(&bits, &a, sizeof(bits));
      const int ex = static_cast<int>(bits >> 23) - 127;  // a is a normal f32 here
      // 2^(man_bits - ex), built from its bits (man_bits - ex is within f32's range).
      const uint32_t pbits = static_cast<uint32_t>(man_bits - ex + 127) << 23;
      float p;
      std::memcpy(&p, &pbits, sizeof(p));
      const int mant = static_cast<int>((a * p + kRound) - kRound);  // in [2^m, 2^(m+1)]
      code = ((ex + bias) << man_bits) + mant - (1 << man_bits);
    }
    return static_cast<uint8_t>(sign | code);
  }

  // The reference: the nearest of the sorted positive codes by binary search.
  uint8_t EncodeBySearch(float f) const {
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

void QuantizeInt4(const float* src, int32_t n, int32_t group, uint8_t* data, uint8_t* meta) {
  uint8_t codes[kInt4G64Group];
  std::memset(data, 0, static_cast<size_t>((n + 1) / 2));
  for (int32_t g0 = 0, g = 0; g0 < n; g0 += group, ++g) {
    const int32_t len = std::min(group, n - g0);
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
    // Groups start at even channels (group sizes are even), so each group
    // packs into whole bytes except an odd tail.
    PackInt4(codes, len, data + g0 / 2);
  }
}

void DequantizeInt4(const uint8_t* data, const uint8_t* meta, int32_t n, int32_t group,
                    float* dst) {
  uint8_t codes[kInt4G64Group];
  for (int32_t g0 = 0, g = 0; g0 < n; g0 += group, ++g) {
    const int32_t len = std::min(group, n - g0);
    const float scale = Fp16ToFp32(LoadU16(meta + 4 * g));
    const float mn = Fp16ToFp32(LoadU16(meta + 4 * g + 2));
    UnpackInt4(data + g0 / 2, len, codes);
    for (int32_t i = 0; i < len; ++i) dst[g0 + i] = codes[i] * scale + mn;
  }
}

// int4-kivi keys (kv_view.h): the step ladder, built once so the encoder,
// the plain decoder and the SIMD decoder share every value.
struct KiviSteps {
  std::array<float, 256> step;
  KiviSteps() {
    for (int e = 0; e < 256; ++e) {
      step[e] = std::exp2(static_cast<float>(e - kKiviStepBias) / kKiviStepsPerOctave);
    }
  }
};
const KiviSteps& Steps() {
  static const KiviSteps s;
  return s;
}

int NibbleAt(const uint8_t* row, int32_t c) { return (row[c / 2] >> (4 * (c % 2))) & 0xf; }
void SetNibble(uint8_t* row, int32_t c, int q) {
  const int shift = 4 * (c % 2);
  row[c / 2] = static_cast<uint8_t>((row[c / 2] & ~(0xf << shift)) | (q << shift));
}

int KiviCode(float x, float s, int z) {
  const float q = std::nearbyint(x / s) - static_cast<float>(z);
  return static_cast<int>(std::clamp(q, 0.0f, 15.0f));
}

}  // namespace

namespace internal {

const float* KiviStepTable() { return Steps().step.data(); }

// Smallest step on the ladder (and its zero point) whose 16 codes cover
// [lo, hi]: z * step <= lo, (z + 15) * step >= hi, z in int8. Values beyond
// the largest step's reach saturate.
void ChooseKiviParams(float lo, float hi, uint8_t* e_out, int8_t* z_out) {
  const float* steps = KiviStepTable();
  float need = (hi - lo) / 15.0f;
  if (lo < 0.0f) need = std::max(need, -lo / 128.0f);
  if (hi > 0.0f) need = std::max(need, hi / 142.0f);
  int e = 0;
  if (!(need <= 2.0f * steps[255])) {
    e = 255;  // huge, infinite or NaN input: saturate
  } else if (need > 0.0f) {
    e = static_cast<int>(std::floor(std::log2(need) * kKiviStepsPerOctave)) + kKiviStepBias - 1;
    e = std::clamp(e, 0, 255);
  }
  for (;; ++e) {
    const float s = steps[e];
    float zf = std::floor(lo / s);
    if (zf * s > lo) zf -= 1.0f;  // guard the division's rounding
    zf = std::min(zf, 127.0f);
    if ((zf >= -128.0f && (zf + 15.0f) * s >= hi) || e == 255) {
      *e_out = static_cast<uint8_t>(e);
      *z_out = static_cast<int8_t>(std::clamp(zf, -128.0f, 127.0f));
      return;
    }
  }
}

}  // namespace internal

void KiviKeyChannelParams(const uint8_t* meta, int32_t head_dim, float* scale, float* offset) {
  const float* steps = Steps().step.data();
  for (int32_t c = 0; c < head_dim; ++c) {
    const float s = steps[meta[kKiviKeyMetaBytes * c]];
    scale[c] = s;
    offset[c] = static_cast<float>(static_cast<int8_t>(meta[kKiviKeyMetaBytes * c + 1])) * s;
  }
}

void DequantizeKiviKeyRow(const uint8_t* codes, const float* scale, const float* offset,
                          int32_t head_dim, float* dst) {
  for (int32_t c = 0; c < head_dim; ++c) dst[c] = NibbleAt(codes, c) * scale[c] + offset[c];
}

// Why requantize in place rather than keep a full-precision residual as
// KIVI does: a residual of up to block_size f32 keys per sequence would live
// outside the block (copy-on-write, prefix sharing and tier copies would have
// to know about it) or inside every block (8x the codes' bytes). Instead a
// channel's range only ever widens: a key outside the range re-encodes that
// channel's earlier codes of this block against the wider range (decode,
// re-round: at most half a new step of extra error each time; a block has at
// most block_size - 1 earlier keys, so the cost is bounded and small).
// Prefill appends a block's keys in one call, which sets every channel's
// range from all of them at once and re-encodes nothing.
// Measured on SmolLM2's keys (kvserve kv-error): appending one by one gives
// 1.7x the key MSE of appending a block at once (0.0106 vs 0.0063; int4 per
// token: 0.045). Two ways to re-encode less were tried and dropped: widening
// with headroom (an eighth to all of the new width: MSE 0.011 to 0.025,
// coarser steps cost more than the re-encodings they save) and starting a
// block from the previous block's ranges (no change).
void AppendKiviKeys(const float* src, int64_t src_stride, int32_t n, int32_t first_slot,
                    int32_t head_dim, uint8_t* codes, uint8_t* meta) {
  const int64_t row_bytes = KvRowBytes(KvDType::kInt4Kivi, head_dim);
  const float* steps = Steps().step.data();
  // The new rows may hold a previous owner's codes: clear them, so an odd
  // head_dim's last high nibble stays zero as with every other codec.
  std::memset(codes + first_slot * row_bytes, 0, static_cast<size_t>(row_bytes * n));
  for (int32_t c = 0; c < head_dim; ++c) {
    float lo = src[c], hi = src[c];
    for (int32_t j = 1; j < n; ++j) {
      lo = std::min(lo, src[j * src_stride + c]);
      hi = std::max(hi, src[j * src_stride + c]);
    }
    uint8_t* m = meta + kKiviKeyMetaBytes * c;
    if (first_slot == 0) {
      int8_t z;
      internal::ChooseKiviParams(lo, hi, &m[0], &z);
      m[1] = static_cast<uint8_t>(z);
    } else {
      const float s = steps[m[0]];
      const int z = static_cast<int8_t>(m[1]);
      if (lo < z * s || hi > (z + 15) * s) {
        // Widen to what the block holds now plus the new keys.
        for (int32_t r = 0; r < first_slot; ++r) {
          const float x = NibbleAt(codes + r * row_bytes, c) * s + z * s;
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        uint8_t e2;
        int8_t z2;
        internal::ChooseKiviParams(lo, hi, &e2, &z2);
        if (e2 != m[0] || z2 != z) {
          const float s2 = steps[e2];
          for (int32_t r = 0; r < first_slot; ++r) {
            uint8_t* row = codes + r * row_bytes;
            const float x = NibbleAt(row, c) * s + z * s;
            SetNibble(row, c, KiviCode(x, s2, z2));
          }
          m[0] = e2;
          m[1] = static_cast<uint8_t>(z2);
        }
      }
    }
    const float s = steps[m[0]];
    const int z = static_cast<int8_t>(m[1]);
    for (int32_t j = 0; j < n; ++j) {
      SetNibble(codes + (first_slot + j) * row_bytes, c, KiviCode(src[j * src_stride + c], s, z));
    }
  }
}

void ReadKvRow(const PagedKvView& kv, int32_t layer, int32_t seq, int32_t pos, int32_t head,
               bool value, float* dst) {
  if (KvIsKivi(kv.dtype) && !value) {
    const int32_t block = kv.block_ids[kv.seq_block_offsets[seq] + pos / kv.block_size];
    std::vector<float> scale(kv.head_dim), offset(kv.head_dim);
    KiviKeyChannelParams(kv.BlockHeadMeta(layer, block, head), kv.head_dim, scale.data(),
                         offset.data());
    DequantizeKiviKeyRow(kv.KeyAt(layer, seq, pos, head), scale.data(), offset.data(),
                         kv.head_dim, dst);
    return;
  }
  if (value) {
    DequantizeRow(kv.dtype, kv.ValueAt(layer, seq, pos, head),
                  kv.ValueMetaAt(layer, seq, pos, head), kv.head_dim, dst);
  } else {
    DequantizeRow(kv.dtype, kv.KeyAt(layer, seq, pos, head), kv.KeyMetaAt(layer, seq, pos, head),
                  kv.head_dim, dst);
  }
}

const float* Fp8DecodeTable(KvDType t) {
  return t == KvDType::kFp8E5M2 ? E5M2().decode.data() : E4M3().decode.data();
}

uint8_t Fp32ToE4M3(float f) { return E4M3().Encode(f); }
float E4M3ToFp32(uint8_t b) { return E4M3().decode[b]; }
uint8_t Fp32ToE5M2(float f) { return E5M2().Encode(f); }
uint8_t Fp32ToE4M3Reference(float f) { return E4M3().EncodeBySearch(f); }
uint8_t Fp32ToE5M2Reference(float f) { return E5M2().EncodeBySearch(f); }
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
    case KvDType::kInt4G64:
    case KvDType::kInt4Kivi:
    case KvDType::kInt4KiviG64:
      return QuantizeInt4(src, n, KvInt4GroupOf(t), data, meta);
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
    case KvDType::kInt4G64:
    case KvDType::kInt4Kivi:
    case KvDType::kInt4KiviG64:
      return DequantizeInt4(data, meta, n, KvInt4GroupOf(t), dst);
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
    case KvDType::kInt4G64: return "int4-g64";
    case KvDType::kInt4Kivi: return "int4-kivi";
    case KvDType::kInt4KiviG64: return "int4-kivi-g64";
  }
  return "?";
}

bool ParseKvDType(std::string_view name, KvDType* out) {
  for (KvDType t : kAllKvDTypes) {
    if (name == KvDTypeName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

std::string_view KvDTypeList() {
  static const std::string list = [] {
    std::string s;
    for (KvDType t : kAllKvDTypes) {
      if (!s.empty()) s += ", ";
      s += KvDTypeName(t);
    }
    return s;
  }();
  return list;
}

void RotateKvKeys(const PagedKvView& kv, int32_t n_layers, int32_t seq, const int32_t* slots,
                  const int32_t* deltas, int32_t n, const RopeParams& rope) {
  std::vector<float> row(static_cast<size_t>(kv.head_dim));
  for (int32_t i = 0; i < n; ++i) {
    if (deltas[i] == 0) continue;
    for (int32_t l = 0; l < n_layers; ++l) {
      for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
        ReadKvRow(kv, l, seq, slots[i], h, /*value=*/false, row.data());
        RopeReference(row.data(), 1, deltas[i], rope);
        QuantizeRow(kv.dtype, row.data(), kv.head_dim, kv.KeyAt(l, seq, slots[i], h),
                    kv.RowMetaBytes() > 0 ? kv.KeyMetaAt(l, seq, slots[i], h) : nullptr);
      }
    }
  }
}

void MoveKvRows(const PagedKvView& kv, int32_t n_layers, int32_t seq, const int32_t* from,
                const int32_t* to, int32_t n) {
  const int64_t row = kv.RowBytes();
  const int64_t meta = kv.RowMetaBytes();
  const int64_t half = kv.layer_bytes / 2;
  for (int32_t i = 0; i < n; ++i) {
    if (from[i] == to[i]) continue;
    for (int32_t l = 0; l < n_layers; ++l) {
      for (int32_t h = 0; h < kv.n_kv_heads; ++h) {
        uint8_t* kd = kv.KeyAt(l, seq, to[i], h);
        const uint8_t* ks = kv.KeyAt(l, seq, from[i], h);
        std::memmove(kd, ks, static_cast<size_t>(row));
        std::memmove(kd + half, ks + half, static_cast<size_t>(row));
        if (meta > 0) {
          uint8_t* md = kv.KeyMetaAt(l, seq, to[i], h);
          const uint8_t* ms = kv.KeyMetaAt(l, seq, from[i], h);
          std::memmove(md, ms, static_cast<size_t>(meta));
          std::memmove(md + half, ms + half, static_cast<size_t>(meta));
        }
      }
    }
  }
}

}  // namespace kvserve::kernels
