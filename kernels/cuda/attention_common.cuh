// Internal to kernels/cuda: 16-byte KV loads and dtype dispatch shared by the
// attention kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace kvserve::cuda::internal {

// Converts one 16-byte vector of K/V elements to floats.
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void ToFloat(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
};
template <>
struct Vec16<__half> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void ToFloat(const uint4& u, float* f) {
    // Bit operations on the words keep everything in registers (taking an
    // address would put the vector on the stack).
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
};
template <>
struct Vec16<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void ToFloat(const uint4& u, float* f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // bf16 is the upper half of an f32.
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

// The query as the cache's element type meets it: an f16 cache sees an f16
// query (kernels::PagedAttentionReference does the same rounding).
template <typename T>
__device__ __forceinline__ float QueryElem(float q) {
  return q;
}
template <>
__device__ __forceinline__ float QueryElem<__half>(float q) {
  return __half2float(__float2half_rn(q));
}

// Block-wide reduction (max or sum) of one float per thread through shared
// memory `red` (at least kThreads / 32 floats); every thread gets the result.
// REQUIRES: all kThreads threads of the block call it.
template <int kThreads, bool kMax>
__device__ float BlockReduce(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red may still be read by a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? red[lane] : (kMax ? -FLT_MAX : 0.0f);
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, w) : v + w;
  }
  return v;
}

}  // namespace kvserve::cuda::internal

// KVSERVE_DISPATCH_KV (the dtype -> codec dispatch) lives in kv_codec.cuh.
