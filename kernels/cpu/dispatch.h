// Run-time choice between the plain and the AVX2 kernels. GetCpuFeatures()
// already honours KVSERVE_DISABLE_SIMD; tests additionally force the portable
// path in-process so both paths are checked on one machine.
#pragma once

namespace kvserve::kernels {

// True when the AVX2/FMA/F16C kernels may run.
bool UseAvx2();

// True when the AVX-512 VNNI matmul kernels may run (implies UseAvx2()).
// KVSERVE_DISABLE_AVX512=1 turns them off alone, for comparisons.
bool UseAvx512Vnni();

// Forces the portable kernels while alive. Not thread-safe: tests only, with
// no kernel running concurrently.
class ScopedDisableSimdForTesting {
 public:
  ScopedDisableSimdForTesting();
  ~ScopedDisableSimdForTesting();
  ScopedDisableSimdForTesting(const ScopedDisableSimdForTesting&) = delete;
  ScopedDisableSimdForTesting& operator=(const ScopedDisableSimdForTesting&) = delete;

 private:
  bool saved_;
};

// Keeps AVX2 but turns the AVX-512 kernels off while alive, so tests cover
// the AVX2 path on machines that have both. Same caveats as above.
class ScopedDisableAvx512ForTesting {
 public:
  ScopedDisableAvx512ForTesting();
  ~ScopedDisableAvx512ForTesting();
  ScopedDisableAvx512ForTesting(const ScopedDisableAvx512ForTesting&) = delete;
  ScopedDisableAvx512ForTesting& operator=(const ScopedDisableAvx512ForTesting&) = delete;

 private:
  bool saved_;
};

}  // namespace kvserve::kernels
