// ReadProbe and SumWords (kernels/cpu/read_probe.h).
#include "kernels/cpu/read_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/matmul_internal.h"

namespace kvserve::kernels {
namespace internal {
uint64_t SumWordsAvx2(const void* p, size_t bytes);
}  // namespace internal

uint64_t SumWordsReference(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t sum = 0;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    sum += w;
  }
  return sum;
}

uint64_t SumWords(const void* p, size_t bytes) {
  return UseAvx2() ? internal::SumWordsAvx2(p, bytes) : SumWordsReference(p, bytes);
}

namespace {
constexpr size_t kHuge = size_t{2} << 20;
}  // namespace

ReadProbe::ReadProbe(size_t bytes)
    : bytes_((std::max<size_t>(bytes, 1) + kHuge - 1) / kHuge * kHuge) {
  data_ = std::aligned_alloc(kHuge, bytes_);
  if (data_ == nullptr) throw std::bad_alloc();
  internal::AdviseHugePages(data_, bytes_);  // as the weight panels ask
  auto* w = static_cast<uint64_t*>(data_);
  for (size_t i = 0; i < bytes_ / 8; ++i) w[i] = i * 0x9E3779B97F4A7C15ull;
}

ReadProbe::~ReadProbe() { std::free(data_); }

double ReadProbe::PassBytesPerSecond(ThreadPool* pool) {
  const int nt = pool == nullptr ? 1 : pool->num_threads();
  // Shares in whole 4 KB pages; the last thread takes the rest.
  const size_t pages = bytes_ / 4096;
  std::vector<uint64_t> sums(nt, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto body = [&](int tid, int n) {
    const size_t b = pages * tid / n * 4096, e = pages * (tid + 1) / n * 4096;
    sums[tid] = SumWords(static_cast<const uint8_t*>(data_) + b, e - b);
  };
  if (pool == nullptr) {
    body(0, 1);
  } else {
    pool->Run(body);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t sum = 0;
  for (uint64_t v : sums) sum += v;
  checksum_ = sum;
  return static_cast<double>(bytes_) / std::max(s, 1e-9);
}

double ReadProbe::HugePageShare() const {
#if defined(__linux__)
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return -1;
  const auto begin = reinterpret_cast<uintptr_t>(data_);
  char line[512];
  bool inside = false;
  double huge_kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    // A mapping's header line: "lo-hi perms offset dev inode [path]".
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, ':') != nullptr &&
        std::strncmp(line, "AnonHugePages", 13) != 0) {
      if (inside) break;
      inside = lo <= begin && begin < hi;
      continue;
    }
    unsigned long kb = 0;
    if (inside && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) {
      huge_kb = static_cast<double>(kb);
      break;
    }
  }
  std::fclose(f);
  if (huge_kb < 0) return -1;
  return std::min(1.0, huge_kb * 1024.0 / static_cast<double>(bytes_));
#else
  return -1;
#endif
}

std::string ReadProbe::HugePageNote() const {
  const double huge = HugePageShare();
  if (huge < 0) return "share unknown";
  return std::to_string(static_cast<int>(100 * huge + 0.5)) + "% granted";
}

double ReadProbe::BestGbps(ThreadPool* pool, int passes) {
  double best = 0;
  for (int i = 0; i < std::max(1, passes); ++i) best = std::max(best, PassBytesPerSecond(pool));
  return best / 1e9;
}

}  // namespace kvserve::kernels
