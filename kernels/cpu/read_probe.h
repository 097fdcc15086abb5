// The machine's memory-read bandwidth, measured the way a batch-1 decode
// reads its weights: every thread of the pool streams its own contiguous
// share of one large buffer once, on huge pages where the OS gives them (the
// weight panels ask for them too, kernels::PackWeight). `kvserve probe
// --cpu` prints it and `kvserve bench --bandwidth` measures it right after
// each decode run, so "decode reads N% of what this machine can read" is a
// ratio of two figures taken seconds apart, on the same threads and page
// size. On the 2-vCPU development VM (a shared host) a 2-thread read of
// 512 MiB-1 GiB on huge pages (100% granted, workers pinned) gives ~60 GB/s
// in some minutes and ~35 in others, ~33 on 4 KB pages, ~30 on one thread:
// the 28.8 GB/s once quoted for this machine was one of the low figures.
//
// Thread-safety: a ReadProbe is used by one caller at a time; Pass() runs
// on the pool it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kvserve {
class ThreadPool;
}

namespace kvserve::kernels {

// Wrapping sum of the 64-bit words of p[0, bytes) (bytes a multiple of 8):
// a checksum whose computation must read every byte. The AVX2 path and the
// plain loop give the same value (integer addition is associative).
uint64_t SumWords(const void* p, size_t bytes);
uint64_t SumWordsReference(const void* p, size_t bytes);

class ReadProbe {
 public:
  // A buffer of `bytes` (rounded up to 2 MiB), 2 MiB-aligned, huge pages
  // advised, filled (so every page is resident before the first pass).
  explicit ReadProbe(size_t bytes);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  size_t bytes() const { return bytes_; }

  // One pass: every pool thread SumWords its contiguous share; returns
  // bytes / seconds of the whole pass. The checksum of the last pass is
  // kept in checksum() so no read can be elided.
  double PassBytesPerSecond(ThreadPool* pool);
  // Best of `passes` passes, in GB/s (1e9 bytes).
  double BestGbps(ThreadPool* pool, int passes);
  uint64_t checksum() const { return checksum_; }
  // Share (0-1) of the buffer the kernel backs with transparent huge pages
  // now (the AnonHugePages of its mapping in /proc/self/smaps); -1 where
  // that cannot be read. A 2-thread read here moves from ~33 to ~60 GB/s
  // with it, so a figure is only read together with this share.
  double HugePageShare() const;
  // HugePageShare for a report: "N% granted", or "share unknown".
  std::string HugePageNote() const;
  // The buffer's contents, for tests: word i holds i * 0x9E3779B97F4A7C15.
  const void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  uint64_t checksum_ = 0;
};

}  // namespace kvserve::kernels
