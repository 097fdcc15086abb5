#include "kernels/cpu/dispatch.h"

#include <cstdlib>
#include <cstring>

#include "common/cpu_features.h"

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

}  // namespace

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
