#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

#if defined(__linux__)
#include <sched.h>
#endif

namespace kvserve {
namespace {

class ThreadPoolTest : public ::testing::TestWithParam<int> {};

TEST_P(ThreadPoolTest, ParallelForCoversEveryIndexExactlyOnce) {
  ThreadPool pool(GetParam());
  for (int64_t n : {0, 1, 2, 3, 7, 64, 1000, 4097}) {
    for (int64_t grain : {0, 1, 3, 16, 1000, 5000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int> ranges{0};
      pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
        EXPECT_LT(begin, end);
        // Ranges start on grain boundaries, so each but the last is a
        // multiple of grain long.
        if (grain > 1) {
          EXPECT_EQ(begin % grain, 0);
        }
        for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
        ranges.fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " grain=" << grain << " i=" << i;
      }
      EXPECT_LE(ranges.load(), pool.num_threads());
    }
  }
}

TEST_P(ThreadPoolTest, RunGivesEachThreadADistinctIndex) {
  ThreadPool pool(GetParam());
  ASSERT_EQ(pool.num_threads(), GetParam());
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> seen(static_cast<size_t>(pool.num_threads()));
    std::atomic<int> bad_nt{0};
    pool.Run([&](int tid, int nt) {
      if (nt != pool.num_threads()) bad_nt.fetch_add(1);
      seen[tid].fetch_add(1);
    });
    EXPECT_EQ(bad_nt.load(), 0);
    for (auto& s : seen) ASSERT_EQ(s.load(), 1);
  }
}

TEST_P(ThreadPoolTest, NestedParallelForRunsInlineOnTheTaskThread) {
  ThreadPool pool(GetParam());
  std::atomic<int> total{0};
  std::atomic<int> off_thread{0};
  pool.Run([&](int tid, int nt) {
    const std::thread::id self = std::this_thread::get_id();
    pool.ParallelFor(100, 1, [&](int64_t begin, int64_t end) {
      if (std::this_thread::get_id() != self) off_thread.fetch_add(1);
      total.fetch_add(static_cast<int>(end - begin));
    });
  });
  EXPECT_EQ(total.load(), 100 * pool.num_threads());
  EXPECT_EQ(off_thread.load(), 0);
}

TEST_P(ThreadPoolTest, NestedRunCallsEveryIndexInline) {
  ThreadPool pool(GetParam());
  std::atomic<int> calls{0};
  pool.Run([&](int, int) { pool.Run([&](int, int) { calls.fetch_add(1); }); });
  EXPECT_EQ(calls.load(), pool.num_threads() * pool.num_threads());
}

// Sums, over `regions` back-to-back one-index-per-thread regions, values
// written by the workers; every region must be complete and visible when
// ParallelFor returns.
void RunTinyRegions(ThreadPool& pool, int regions) {
  const int nt = pool.num_threads();
  int64_t sum = 0;
  std::vector<int64_t> partial(static_cast<size_t>(nt));
  for (int iter = 0; iter < regions; ++iter) {
    pool.ParallelFor(nt, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) partial[i] = iter + i;
    });
    for (int i = 0; i < nt; ++i) sum += partial[i] - iter;
  }
  EXPECT_EQ(sum, int64_t{regions} * nt * (nt - 1) / 2);
}

TEST_P(ThreadPoolTest, ManyTinyBackToBackRegions) {
  ThreadPool pool(GetParam());
  RunTinyRegions(pool, 10000);
}

TEST_P(ThreadPoolTest, DestroyWhileIdle) {
  // Right after construction (workers may not have started yet) ...
  { ThreadPool pool(GetParam()); }
  // ... after work, while workers still spin ...
  {
    ThreadPool pool(GetParam());
    std::atomic<int> calls{0};
    pool.Run([&](int, int) { calls.fetch_add(1); });
    EXPECT_EQ(calls.load(), GetParam());
  }
  // ... and once they have gone to sleep on the condition variable.
  {
    ThreadPool pool(GetParam());
    pool.Run([](int, int) {});
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::atomic<int> calls{0};
    pool.Run([&](int, int) { calls.fetch_add(1); });  // sleepers wake up
    EXPECT_EQ(calls.load(), GetParam());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, ThreadPoolTest, ::testing::Values(1, 2, 3, 4, 8),
                         [](const auto& info) { return "T" + std::to_string(info.param); });

TEST(ThreadPoolSingleTest, OneThreadRunsInlineOnCaller) {
  ThreadPool pool(1);
  const std::thread::id self = std::this_thread::get_id();
  bool ran = false;
  pool.ParallelFor(1000, 1, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(std::this_thread::get_id(), self);
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 1000);
    ran = true;
  });
  EXPECT_TRUE(ran);
}

TEST(ThreadPoolStressTest, HundredThousandTinyRegions) {
  // Three threads oversubscribe a two-core test machine, which is where a
  // pool that spins without ever yielding crawls.
  ThreadPool pool(3);
  RunTinyRegions(pool, 100000);
}

TEST(ThreadPoolSingleTest, DefaultSizeIsPositive) {
  ThreadPool pool;
  EXPECT_GE(pool.num_threads(), 1);
}

#if defined(__linux__)
// The CPUs the calling thread may run on, in increasing order.
std::vector<int> ThisThreadCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// Each worker of a pool as large as the allowed CPUs is pinned to its own
// one (worker i to the i-th allowed CPU), as its own affinity mask says from
// inside a task; with pinning off, fewer threads than CPUs (a second process
// would pin to the same ones) or more, workers keep the caller's mask.
TEST(ThreadPoolPinningTest, WorkersPinnedToDistinctCpusWhenThePoolTakesThemAll) {
  const std::vector<int> allowed = ThisThreadCpus();
  if (allowed.size() < 2) GTEST_SKIP() << "needs 2 CPUs, the process may use " << allowed.size();
  if (allowed.size() > 256) GTEST_SKIP() << "a pool of " << allowed.size() << " threads";
  const int n = static_cast<int>(allowed.size());
  auto masks_of = [](ThreadPool& pool) {
    std::vector<std::vector<int>> masks(pool.num_threads());
    pool.Run([&](int tid, int) { masks[tid] = ThisThreadCpus(); });
    return masks;
  };
  {
    ThreadPool pool(n);
    const auto masks = masks_of(pool);
    EXPECT_EQ(pool.worker_cpu(0), -1);
    EXPECT_EQ(masks[0], allowed);  // the caller is never pinned
    for (int tid = 1; tid < n; ++tid) {
      EXPECT_EQ(pool.worker_cpu(tid), allowed[tid]) << "worker " << tid;
      EXPECT_EQ(masks[tid], std::vector<int>{allowed[tid]}) << "worker " << tid;
    }
  }
  {
    ThreadPool pool(n, /*pin_workers=*/false);
    const auto masks = masks_of(pool);
    for (int tid = 1; tid < n; ++tid) {
      EXPECT_EQ(pool.worker_cpu(tid), -1);
      EXPECT_EQ(masks[tid], allowed) << "worker " << tid;
    }
  }
  if (allowed.size() >= 3) {
    ThreadPool pool(2);
    const auto masks = masks_of(pool);
    EXPECT_EQ(pool.worker_cpu(1), -1);
    EXPECT_EQ(masks[1], allowed);
  }
  {
    ThreadPool pool(static_cast<int>(allowed.size()) + 1);
    const auto masks = masks_of(pool);
    for (int tid = 1; tid < pool.num_threads(); ++tid) {
      EXPECT_EQ(pool.worker_cpu(tid), -1);
      EXPECT_EQ(masks[tid], allowed) << "worker " << tid;
    }
  }
}
#endif

}  // namespace
}  // namespace kvserve
