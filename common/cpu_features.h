// Run-time CPU feature detection, so one binary picks its vectorized kernels
// on the machine it runs on.
#pragma once

#include <string>

namespace kvserve {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vnni = false;
  bool avxvnni = false;
  // AMX: CPUID leaf 7 EDX bits 24 (tile), 25 (int8), 22 (bf16), each only
  // when the OS enables the tile state in XCR0 (bits 17, 18). The process
  // must still ask for the tile data (kernels/cpu/dispatch.cc).
  bool amx_tile = false;
  bool amx_int8 = false;
  bool amx_bf16 = false;

  // AVX2 + FMA + F16C: the level the vectorized kernels require.
  bool HasAvx2Fma() const { return avx2 && fma && f16c; }
  std::string ToString() const;
};

// Detected once; thread-safe. KVSERVE_DISABLE_SIMD=1 in the environment
// forces the plain-loop kernels (useful for tests and comparisons).
const CpuFeatures& GetCpuFeatures();

}  // namespace kvserve
