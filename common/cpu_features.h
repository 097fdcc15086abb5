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

  // AVX2 + FMA + F16C: the level the vectorized kernels require.
  bool HasAvx2Fma() const { return avx2 && fma && f16c; }
  std::string ToString() const;
};

// Detected once; thread-safe. KVSERVE_DISABLE_SIMD=1 in the environment
// forces the plain-loop kernels (useful for tests and comparisons).
const CpuFeatures& GetCpuFeatures();

}  // namespace kvserve
