// Internal to kernels/cuda: the KV codecs of kernels/kv_view.h on the device.
//
// Write side: QuantizeRowWarp, one warp per (token, KV head) row, produces
// the same bytes as kernels::QuantizeRow (kernels/cpu/kv_codec.cc). It
// follows the CPU code step by step: the same float operations in the same
// order, written with the IEEE-rounded intrinsics (__fdiv_rn, __fmul_rn,
// __fsub_rn: never contracted into an FMA, never approximated whatever the
// nvcc flags), rintf for std::nearbyint (round half to even), the CPU's
// std::min/std::max/std::clamp comparisons spelled out (same NaN behavior),
// the fp8 encoder as the same lower_bound over the same exactly-computed code
// values, and __float2half_rn for kernels::Fp32ToFp16 (both IEEE round to
// nearest even with overflow to infinity). The only reduction done in
// parallel is the max |x| of int8/fp8 rows, which is exact in any order.
//
// Read side: KvCodec* types, one per family of codecs the attention kernels
// are instantiated for. Each loads Raw (a lane's slice of a row: 16 bytes
// for f32/f16/bf16, 8 for the byte codecs, 4 for int4) and the row's (or
// group's) scale and offset, and turns them into kElems floats in registers:
// dequantization happens as K/V are read, the cache is never expanded.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/kv_device.cuh"
#include "kernels/kv_view.h"

namespace kvserve::cuda::internal {

// ---- write side ----

__device__ __forceinline__ void StoreU16Bytes(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ __forceinline__ void StoreF32Bytes(uint8_t* p, float f) {
  const uint32_t v = __float_as_uint(f);
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>((v >> 8) & 0xffu);
  p[2] = static_cast<uint8_t>((v >> 16) & 0xffu);
  p[3] = static_cast<uint8_t>(v >> 24);
}

// std::min(a, b), std::max(a, b), std::clamp(v, lo, hi) as libstdc++ spells
// them (the comparisons decide NaN and signed-zero cases the same way).
__device__ __forceinline__ float StdMin(float a, float b) { return b < a ? b : a; }
__device__ __forceinline__ float StdMax(float a, float b) { return a < b ? b : a; }
__device__ __forceinline__ float StdClamp(float v, float lo, float hi) {
  return v < lo ? lo : (hi < v ? hi : v);
}

// The positive fp8 code c (c <= max code) as a float: exactly the CPU's
// decode table entry (ldexp of small integers there, bit fields here; both
// exact). man_bits 3 / bias 7: e4m3; 2 / 15: e5m2.
__device__ __forceinline__ float Fp8CodeValue(int c, int man_bits, int bias) {
  const int ex = c >> man_bits;
  const int man = c & ((1 << man_bits) - 1);
  if (ex == 0) {
    // man * 2^(1 - bias - man_bits): a small integer times a power of two.
    return __fmul_rn(static_cast<float>(man), __int_as_float((1 - bias - man_bits + 127) << 23));
  }
  return __int_as_float(((ex - bias + 127) << 23) | (man << (23 - man_bits)));
}

// Fp8Format::Encode: nearest code among the monotonic positive codes
// [0, max_code] (std::lower_bound, then the closer neighbor; ties to the even
// code), saturating above the largest finite value; NaN -> 0x7f.
__device__ __forceinline__ uint8_t EncodeFp8(float f, int man_bits, int bias, int max_code) {
  if (isnan(f)) return 0x7f;
  const int sign = signbit(f) ? 0x80 : 0;
  const float a = fabsf(f);
  int first = 0, count = max_code + 1;
  while (count > 0) {  // std::lower_bound: first code whose value is not < a
    const int step = count / 2;
    const int it = first + step;
    if (Fp8CodeValue(it, man_bits, bias) < a) {
      first = it + 1;
      count -= step + 1;
    } else {
      count = step;
    }
  }
  int code;
  if (first == max_code + 1) {
    code = max_code;
  } else if (first == 0 || Fp8CodeValue(first, man_bits, bias) == a) {
    code = first;
  } else {
    const float d_up = __fsub_rn(Fp8CodeValue(first, man_bits, bias), a);
    const float d_down = __fsub_rn(a, Fp8CodeValue(first - 1, man_bits, bias));
    code = (d_down < d_up || (d_down == d_up && ((first - 1) & 1) == 0)) ? first - 1 : first;
  }
  return static_cast<uint8_t>(sign | code);
}

__device__ __forceinline__ float WarpAbsMax(const float* src, int32_t n) {
  // AbsMax: m = std::max(m, |x|) from 0. The values are >= 0 (or NaN, which
  // std::max(m, NaN) and fmaxf both skip), so any order gives the same max.
  float m = 0.0f;
  for (int32_t i = threadIdx.x % 32; i < n; i += 32) m = fmaxf(m, fabsf(src[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// kernels::QuantizeRow for kInt8, kFp8E4M3, kFp8E5M2, kInt4, kInt4G64 (and
// int4-kivi values), by the whole warp (all 32 lanes must call it).
__device__ __forceinline__ void QuantizeRowWarp(kernels::KvDType t, const float* src, int32_t n,
                                                uint8_t* data, uint8_t* meta) {
  const int lane = threadIdx.x % 32;
  switch (t) {
    case kernels::KvDType::kInt8: {
      const float amax = WarpAbsMax(src, n);
      const float scale = __fdiv_rn(amax, 127.0f);
      const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
      if (lane == 0) StoreF32Bytes(meta, scale);
      for (int32_t i = lane; i < n; i += 32) {
        const float q = StdClamp(rintf(__fmul_rn(src[i], inv)), -127.0f, 127.0f);
        data[i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q)));
      }
      return;
    }
    case kernels::KvDType::kFp8E4M3:
    case kernels::KvDType::kFp8E5M2: {
      const bool e4m3 = t == kernels::KvDType::kFp8E4M3;
      const float fmt_max = e4m3 ? kernels::kE4M3Max : kernels::kE5M2Max;
      const int man_bits = e4m3 ? 3 : 2;
      const int bias = e4m3 ? 7 : 15;
      const int max_code = e4m3 ? 0x7e : (((1 << 5) - 1) << 2) - 1;
      const float amax = WarpAbsMax(src, n);
      const float scale = amax > 0.0f ? __fdiv_rn(amax, fmt_max) : 0.0f;
      const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
      if (lane == 0) StoreF32Bytes(meta, scale);
      for (int32_t i = lane; i < n; i += 32) {
        data[i] = EncodeFp8(__fmul_rn(src[i], inv), man_bits, bias, max_code);
      }
      return;
    }
    default: {  // int4 rows: one lane per group, the CPU's serial loops
      const int32_t group = (t == kernels::KvDType::kInt4G64 || t == kernels::KvDType::kInt4KiviG64)
                                ? kernels::kInt4G64Group
                                : kernels::kInt4Group;  // kernels::KvInt4GroupOf
      for (int32_t g = lane; g * group < n; g += 32) {
        const int32_t g0 = g * group;
        const int32_t len = min(group, n - g0);
        float lo = src[g0], hi = src[g0];
        for (int32_t i = 1; i < len; ++i) {
          lo = StdMin(lo, src[g0 + i]);
          hi = StdMax(hi, src[g0 + i]);
        }
        const __half min_hh = __float2half_rn(lo);
        const float min_h = __half2float(min_hh);
        const __half scale_hh = __float2half_rn(__fdiv_rn(__fsub_rn(hi, min_h), 15.0f));
        const float scale_h = __half2float(scale_hh);
        const float inv = scale_h > 0.0f ? __fdiv_rn(1.0f, scale_h) : 0.0f;
        StoreU16Bytes(meta + 4 * g, __half_as_ushort(scale_hh));
        StoreU16Bytes(meta + 4 * g + 2, __half_as_ushort(min_hh));
        // PackInt4: even channel in the low nibble; an odd tail leaves the
        // high nibble zero (groups start at even channels).
        for (int32_t i = 0; i < len; i += 2) {
          int byte = 0;
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            if (i + k >= len) break;
            const float q = rintf(__fmul_rn(__fsub_rn(src[g0 + i + k], min_h), inv));
            byte |= static_cast<int>(StdClamp(q, 0.0f, 15.0f)) << (4 * k);
          }
          data[(g0 + i) / 2] = static_cast<uint8_t>(byte);
        }
      }
      return;
    }
  }
}

// ---- read side ----

struct RowMeta {
  float scale;
  float offset;
};

// Start of head `head`'s scale area of block `block` (values: + v_offset).
__device__ __forceinline__ const uint8_t* HeadMeta(const KvLayout& kv, int32_t block,
                                                   int32_t head) {
  return kv.pool + static_cast<int64_t>(block) * kv.block_bytes + kv.layer_offset +
         kv.meta_offset + static_cast<int64_t>(head) * kv.head_meta_bytes;
}

// Plain floats (no scale area): Vec16 of attention_common.cuh.
template <typename T, bool kF16Query>
struct KvCodecFloat {
  using Raw = uint4;
  static constexpr int kElems = Vec16<T>::kElems;
  static constexpr int kRawBytes = 16;
  static constexpr bool kHasMeta = false;
  __device__ __forceinline__ static float Query(float q) {
    return kF16Query ? __half2float(__float2half_rn(q)) : q;
  }
  __device__ __forceinline__ static Raw Load(const uint8_t* p) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ static Raw LoadPlain(const uint8_t* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
  __device__ __forceinline__ static Raw Zero() { return make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ static RowMeta LoadMeta(const KvLayout&, const uint8_t*, int) {
    return RowMeta{1.0f, 0.0f};
  }
  __device__ __forceinline__ static void ToFloat(const Raw& u, RowMeta, const KvLayout&,
                                                 float* f) {
    Vec16<T>::ToFloat(u, f);
  }
};
using KvCodecF32 = KvCodecFloat<float, false>;
using KvCodecF16 = KvCodecFloat<__half, true>;
using KvCodecBF16 = KvCodecFloat<__nv_bfloat16, false>;

// One byte a value and one f32 scale per row: int8 (value = int8 * scale)
// and fp8 (value = fp8 * scale). fp8 decodes through f16 bits, exactly:
// e5m2 is the upper byte of an f16; e4m3's exponent and mantissa fields
// moved into an f16's give its value times 2^-8 (subnormals included), the
// 2^8 folded into the scale (exact: a power of two). The encoder never
// produces e4m3's NaN code from finite input. kv.codec_variant: 0 int8,
// 1 e4m3, 2 e5m2.
struct KvCodecByte {
  using Raw = uint2;
  static constexpr int kElems = 8;
  static constexpr int kRawBytes = 8;
  static constexpr bool kHasMeta = true;
  __device__ __forceinline__ static float Query(float q) { return q; }
  __device__ __forceinline__ static Raw Load(const uint8_t* p) {
    return __ldcs(reinterpret_cast<const uint2*>(p));
  }
  __device__ __forceinline__ static Raw LoadPlain(const uint8_t* p) {
    return *reinterpret_cast<const uint2*>(p);
  }
  __device__ __forceinline__ static Raw Zero() { return make_uint2(0, 0); }
  // row_meta: the row's scale-area row.
  __device__ __forceinline__ static RowMeta LoadMeta(const KvLayout& kv, const uint8_t* row_meta,
                                                     int) {
    const float s = *reinterpret_cast<const float*>(row_meta);
    return RowMeta{kv.codec_variant == 1 ? s * 256.0f : s, 0.0f};
  }
  __device__ __forceinline__ static void ToFloat(const Raw& u, RowMeta m, const KvLayout& kv,
                                                 float* f) {
    const uint32_t w[2] = {u.x, u.y};
    if (kv.codec_variant == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int8_t c = static_cast<int8_t>((w[i / 4] >> (8 * (i % 4))) & 0xffu);
        f[i] = static_cast<float>(c) * m.scale;
      }
      return;
    }
    const bool e4m3 = kv.codec_variant == 1;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = (w[i / 4] >> (8 * (i % 4))) & 0xffu;
      const uint32_t h = e4m3 ? ((b & 0x80u) << 8) | ((b & 0x7fu) << 7) : b << 8;
      f[i] = __half2float(__ushort_as_half(static_cast<unsigned short>(h))) * m.scale;
    }
  }
};

// int4 rows: 8 values (4 bytes) per lane, inside one group (groups of 32 or
// 64 channels start at multiples of 8); value = code * scale + minimum, the
// group's f16 pair. kv.codec_variant: log2 of the group size.
struct KvCodecInt4 {
  using Raw = uint32_t;
  static constexpr int kElems = 8;
  static constexpr int kRawBytes = 4;
  static constexpr bool kHasMeta = true;
  __device__ __forceinline__ static float Query(float q) { return q; }
  __device__ __forceinline__ static Raw Load(const uint8_t* p) {
    return __ldcs(reinterpret_cast<const unsigned int*>(p));
  }
  __device__ __forceinline__ static Raw LoadPlain(const uint8_t* p) {
    return *reinterpret_cast<const uint32_t*>(p);
  }
  __device__ __forceinline__ static Raw Zero() { return 0u; }
  // lane_slice: which kElems-channel slice of the row the lane reads.
  __device__ __forceinline__ static RowMeta LoadMeta(const KvLayout& kv, const uint8_t* row_meta,
                                                     int lane_slice) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(
        row_meta + 4 * ((lane_slice * kElems) >> kv.codec_variant));
    return RowMeta{__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))),
                   __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)))};
  }
  __device__ __forceinline__ static void ToFloat(const Raw& u, RowMeta m, const KvLayout&,
                                                 float* f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      f[i] = fmaf(static_cast<float>((u >> (4 * i)) & 0xfu), m.scale, m.offset);
    }
  }
};

}  // namespace kvserve::cuda::internal

// Turns the runtime (dtype, head_dim) into template constants in one place:
// C is the codec (above), HD the head dim. Byte codecs and int4 codecs share
// one instantiation each (kv.codec_variant tells them apart at run time).
#define KVSERVE_DISPATCH_KV(dtype, head_dim, ...)                                        \
  [&]() -> absl::Status {                                                                \
    if ((head_dim) != 64 && (head_dim) != 128) {                                         \
      return absl::UnimplementedError(absl::StrCat(                                      \
          "CUDA attention: head_dim ", (head_dim), " is not supported (64, 128)"));      \
    }                                                                                    \
    switch (dtype) {                                                                     \
      case kernels::KvDType::kF32:                                                       \
        if ((head_dim) == 64) { using C = internal::KvCodecF32; constexpr int HD = 64; __VA_ARGS__ } \
        else { using C = internal::KvCodecF32; constexpr int HD = 128; __VA_ARGS__ }     \
        break;                                                                           \
      case kernels::KvDType::kF16:                                                       \
        if ((head_dim) == 64) { using C = internal::KvCodecF16; constexpr int HD = 64; __VA_ARGS__ } \
        else { using C = internal::KvCodecF16; constexpr int HD = 128; __VA_ARGS__ }     \
        break;                                                                           \
      case kernels::KvDType::kBF16:                                                      \
        if ((head_dim) == 64) { using C = internal::KvCodecBF16; constexpr int HD = 64; __VA_ARGS__ } \
        else { using C = internal::KvCodecBF16; constexpr int HD = 128; __VA_ARGS__ }    \
        break;                                                                           \
      case kernels::KvDType::kInt8:                                                      \
      case kernels::KvDType::kFp8E4M3:                                                   \
      case kernels::KvDType::kFp8E5M2:                                                   \
        if ((head_dim) == 64) { using C = internal::KvCodecByte; constexpr int HD = 64; __VA_ARGS__ } \
        else { using C = internal::KvCodecByte; constexpr int HD = 128; __VA_ARGS__ }    \
        break;                                                                           \
      case kernels::KvDType::kInt4:                                                      \
      case kernels::KvDType::kInt4G64:                                                   \
        if ((head_dim) == 64) { using C = internal::KvCodecInt4; constexpr int HD = 64; __VA_ARGS__ } \
        else { using C = internal::KvCodecInt4; constexpr int HD = 128; __VA_ARGS__ }    \
        break;                                                                           \
      default:                                                                           \
        return absl::UnimplementedError(absl::StrCat(                                    \
            "CUDA attention: KV dtype ", std::string(kernels::KvDTypeName(dtype)),       \
            " is not supported"));                                                       \
    }                                                                                    \
    return absl::OkStatus();                                                             \
  }()

namespace kvserve::cuda::internal {

// The attention kernels load raw_bytes-wide slices of K/V rows: every block,
// layer and V half must start on that alignment (byte codecs: 8, int4: 4,
// floats: 16). A view built from a pool allocation meets it except for odd
// shapes (e.g. int8 with block size 1 and one KV head: V halves 4 bytes off).
inline absl::Status CheckKvAlignment(const kernels::PagedKvView& kv, int64_t raw_bytes,
                                     const char* who) {
  const int64_t bits = static_cast<int64_t>(reinterpret_cast<uintptr_t>(kv.pool)) |
                       kv.block_bytes | kv.layer_bytes | (kv.layer_bytes / 2);
  if (bits % raw_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": KV blocks, layers and V halves must be ", raw_bytes, "-byte aligned for ",
        std::string(kernels::KvDTypeName(kv.dtype)), " (block_bytes ", kv.block_bytes,
        ", layer_bytes ", kv.layer_bytes, ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvserve::cuda::internal
