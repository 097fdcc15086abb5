#include "kernels/cpu/dispatch.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/cpu_features.h"
#include "spdlog/spdlog.h"

namespace kvserve::kernels {
namespace {

bool& ForcedOff() {
  static bool off = false;
  return off;
}

bool& Avx512ForcedOff() {
  static bool off = false;
  return off;
}

bool EnvSet(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// -1: not overridden by a test scope.
int& AmxKernelOverride() {
  static int kernel = -1;
  return kernel;
}

int64_t& AmxMinTokensOverride() {
  static int64_t n = -1;
  return n;
}

// Linux's permission for the tile data (XFEATURE_XTILEDATA), without which
// the first tile instruction faults: asked once per process.
bool RequestTileData() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return true;
  spdlog::warn("AMX: the kernel refused the tile data (arch_prctl: {}); matmuls stay on AVX-512 VNNI",
               std::strerror(errno));
  return false;
#else
  return false;
#endif
}

}  // namespace

bool UseAmx() {
  static const bool ok = [] {
    const CpuFeatures& f = GetCpuFeatures();
    if (!f.amx_tile || !f.amx_int8 || EnvSet("KVSERVE_DISABLE_AMX")) return false;
    return RequestTileData();
  }();
  return ok && UseAvx512Vnni();
}

int64_t AmxMinTokens() {
  if (AmxMinTokensOverride() >= 0) return AmxMinTokensOverride();
  static const int64_t n = [] {
    const char* v = std::getenv("KVSERVE_AMX_MIN_TOKENS");
    if (v == nullptr || v[0] == '\0') return int64_t{16};
    char* end = nullptr;
    const long long parsed = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || parsed < 1) {
      spdlog::warn("KVSERVE_AMX_MIN_TOKENS={} is not a positive integer; using 16", v);
      return int64_t{16};
    }
    return static_cast<int64_t>(parsed);
  }();
  return n;
}

AmxKernel ActiveAmxKernel() {
  if (AmxKernelOverride() >= 0) {
    return UseAvx512Vnni() ? static_cast<AmxKernel>(AmxKernelOverride()) : AmxKernel::kOff;
  }
  return UseAmx() ? AmxKernel::kHardware : AmxKernel::kOff;
}

ScopedAmxForTesting::ScopedAmxForTesting(AmxKernel kernel, int64_t min_tokens)
    : saved_kernel_(AmxKernelOverride()), saved_min_tokens_(AmxMinTokensOverride()) {
  if (kernel == AmxKernel::kHardware && !UseAmx()) std::abort();
  AmxKernelOverride() = static_cast<int>(kernel);
  AmxMinTokensOverride() = min_tokens;
}

ScopedAmxForTesting::~ScopedAmxForTesting() {
  AmxKernelOverride() = saved_kernel_;
  AmxMinTokensOverride() = saved_min_tokens_;
}

bool UseAvx2() {
  static const bool has = GetCpuFeatures().HasAvx2Fma();
  return has && !ForcedOff();
}

bool UseAvx512Vnni() {
  static const bool has = [] {
    const CpuFeatures& f = GetCpuFeatures();
    return f.HasAvx2Fma() && f.avx512f && f.avx512bw && f.avx512vnni &&
           !EnvSet("KVSERVE_DISABLE_AVX512");
  }();
  return has && UseAvx2() && !Avx512ForcedOff();
}

ScopedDisableSimdForTesting::ScopedDisableSimdForTesting() : saved_(ForcedOff()) {
  ForcedOff() = true;
}
ScopedDisableSimdForTesting::~ScopedDisableSimdForTesting() { ForcedOff() = saved_; }

ScopedDisableAvx512ForTesting::ScopedDisableAvx512ForTesting() : saved_(Avx512ForcedOff()) {
  Avx512ForcedOff() = true;
}
ScopedDisableAvx512ForTesting::~ScopedDisableAvx512ForTesting() { Avx512ForcedOff() = saved_; }

}  // namespace kvserve::kernels
