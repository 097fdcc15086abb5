#include "common/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace kvserve {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
  const char* off = std::getenv("KVSERVE_DISABLE_SIMD");
  if (off != nullptr && std::strcmp(off, "0") != 0 && off[0] != '\0') return f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  // F16C and AVX-VNNI are not known to every GCC's __builtin_cpu_supports;
  // read CPUID leaf 1 ECX bit 29 and leaf 7.1 EAX bit 4 directly.
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  f.f16c = (c >> 29) & 1;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  f.avxvnni = (a >> 4) & 1;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
  const unsigned max_leaf = a;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  const bool osxsave = (c >> 27) & 1;
  if (max_leaf >= 7 && osxsave) {
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    const bool os_tiles = ((xcr0_lo >> 17) & 3) == 3;  // XTILECFG and XTILEDATA
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    f.amx_tile = os_tiles && ((d >> 24) & 1);
    f.amx_int8 = f.amx_tile && ((d >> 25) & 1);
    f.amx_bf16 = f.amx_tile && ((d >> 22) & 1);
  }
#endif
  return f;
}

}  // namespace

std::string CpuFeatures::ToString() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vnni, "avx512vnni");
  add(avxvnni, "avxvnni");
  add(amx_tile, "amx_tile");
  add(amx_int8, "amx_int8");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "none" : s;
}

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

}  // namespace kvserve
