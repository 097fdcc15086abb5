// Run-time choice between the plain and the AVX2 kernels. GetCpuFeatures()
// already honours KVSERVE_DISABLE_SIMD; tests additionally force the portable
// path in-process so both paths are checked on one machine.
#pragma once

#include <cstdint>

namespace kvserve::kernels {

// True when the AVX2/FMA/F16C kernels may run.
bool UseAvx2();

// True when the AVX-512 VNNI matmul kernels may run (implies UseAvx2()).
// KVSERVE_DISABLE_AVX512=1 turns them off alone, for comparisons.
bool UseAvx512Vnni();

// True when the AMX int8 kernel may run for packed weights: the CPU and OS
// have AMX-INT8, UseAvx512Vnni() holds, KVSERVE_DISABLE_AMX is unset, and
// the kernel granted this process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once; a refusal is logged and leaves VNNI).
bool UseAmx();

// Tokens from which a matmul against a packed weight runs on AMX rather
// than VNNI (the two give the same bits, so this only trades speed): 16, one
// full tile of tokens, unless KVSERVE_AMX_MIN_TOKENS says otherwise.
int64_t AmxMinTokens();

// Which AMX kernel MatMulMany uses: kOff (VNNI for everything), the
// hardware tiles, or their software model (tests on CPUs without AMX).
enum class AmxKernel { kOff, kHardware, kEmulated };
AmxKernel ActiveAmxKernel();

// Makes MatMulMany use `kernel` from `min_tokens` tokens while alive. Same
// caveats as the scopes below; kHardware REQUIRES UseAmx() at construction.
class ScopedAmxForTesting {
 public:
  ScopedAmxForTesting(AmxKernel kernel, int64_t min_tokens);
  ~ScopedAmxForTesting();
  ScopedAmxForTesting(const ScopedAmxForTesting&) = delete;
  ScopedAmxForTesting& operator=(const ScopedAmxForTesting&) = delete;

 private:
  int saved_kernel_;
  int64_t saved_min_tokens_;
};

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
