// SumWords (the read-bandwidth probe's loop) against its plain loop, on both
// paths, and ReadProbe's buffer and checksum.
#include "kernels/cpu/read_probe.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/dispatch.h"

namespace kvserve::kernels {
namespace {

TEST(SumWordsTest, MatchesPlainLoopOnEveryPath) {
  std::mt19937_64 rng(7);
  std::vector<uint64_t> words(4099);
  for (uint64_t& w : words) w = rng();
  // Lengths around the 128-byte main loop, odd word counts, and offsets that
  // leave the buffer unaligned.
  for (size_t offset_words : {0, 1, 3}) {
    for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 1000, 4096}) {
      const void* p = words.data() + offset_words;
      const uint64_t want = SumWordsReference(p, n * 8);
      uint64_t plain = 0;
      for (size_t i = 0; i < n; ++i) plain += words[offset_words + i];
      ASSERT_EQ(want, plain) << n;
      EXPECT_EQ(SumWords(p, n * 8), want) << "n=" << n << " offset=" << offset_words;
      ScopedDisableSimdForTesting portable;
      EXPECT_EQ(SumWords(p, n * 8), want) << "portable n=" << n;
    }
  }
}

TEST(ReadProbeTest, ReadsEveryByteOfItsBufferOnEveryThread) {
  ThreadPool pool(2);
  ReadProbe probe(3 << 20);  // rounds up to 4 MiB
  ASSERT_EQ(probe.bytes(), size_t{4} << 20);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(probe.data()) % (2 << 20), 0u);
  const uint64_t want = SumWordsReference(probe.data(), probe.bytes());
  const auto* w = static_cast<const uint64_t*>(probe.data());
  EXPECT_EQ(w[12345], 12345 * 0x9E3779B97F4A7C15ull);
  for (ThreadPool* p : {&pool, static_cast<ThreadPool*>(nullptr)}) {
    const double bps = probe.PassBytesPerSecond(p);
    EXPECT_GT(bps, 0);
    EXPECT_EQ(probe.checksum(), want) << "threads=" << (p ? p->num_threads() : 1);
  }
  EXPECT_GT(probe.BestGbps(&pool, 2), 0);
  EXPECT_EQ(probe.checksum(), want);
  // Its mapping is found in /proc/self/smaps (whether the kernel granted
  // huge pages depends on the machine).
  const double huge = probe.HugePageShare();
#if defined(__linux__)
  EXPECT_GE(huge, 0.0);
#endif
  EXPECT_LE(huge, 1.0);
}

}  // namespace
}  // namespace kvserve::kernels
