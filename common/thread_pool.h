// ThreadPool runs data-parallel loops with low dispatch latency: the engine
// issues a few hundred parallel regions per decoded token, so workers spin
// briefly on an atomic generation counter before sleeping, and the calling
// thread takes a share of the work itself.
//
// Workers are pinned, one CPU each, when the process may run on exactly as
// many CPUs as the pool has threads (worker i on the i-th allowed CPU, the
// caller left free to take the 0th): unpinned, the scheduler was seen to
// stack a spinning worker on the caller's CPU for milliseconds at a time (a
// 2-vCPU VM: 59% of one-token matmul regions began with both threads on one
// CPU, the worker ~40 us late on a 20 us region, ~2 ms late on the 5 ms
// output head), and since a region waits for its slowest thread, decode ran
// up to 2x slower. KVSERVE_PIN_THREADS=0 turns pinning off for Global().
//
// Thread-safety: Run/ParallelFor may be called from one thread at a time (the
// engine thread). Nested calls from inside a task run inline.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve {

class ThreadPool {
 public:
  // n_threads counts the caller: n_threads == 1 runs everything inline.
  // n_threads <= 0 picks the number of hardware threads.
  // pin_workers: pin each worker to its own CPU where the allowed CPUs are
  // allowed (see above); otherwise workers float.
  explicit ThreadPool(int n_threads = 0, bool pin_workers = true);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return n_threads_; }
  // The CPU worker `tid` (1..num_threads()-1) is pinned to, or -1 if it
  // floats (pinning off, too few CPUs allowed, or the pin refused).
  int worker_cpu(int tid) const { return worker_cpus_[tid]; }

  // Calls fn(thread_index, num_threads) once on each of num_threads threads
  // and returns when all have finished.
  template <typename Fn>
  void Run(Fn&& fn) {
    RunErased(
        [](void* ctx, int tid, int nt) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(tid, nt); },
        &fn);
  }

  // Splits [0, n) into contiguous ranges, at most one per thread, with range
  // sizes that are multiples of `grain` (except the last), and calls
  // fn(begin, end) for each non-empty range.
  template <typename Fn>
  void ParallelFor(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    if (n_threads_ == 1 || chunks == 1 || in_task()) {
      fn(int64_t{0}, n);
      return;
    }
    Run([&](int tid, int nt) {
      const int64_t per = (chunks + nt - 1) / nt;
      const int64_t begin = std::min<int64_t>(n, tid * per * grain);
      const int64_t end = std::min<int64_t>(n, (tid + 1) * per * grain);
      if (begin < end) fn(begin, end);
    });
  }

  // The process-wide pool used by kernels. Sized on first use from
  // KVSERVE_THREADS or the hardware; SetGlobalThreads before first use
  // overrides it.
  static ThreadPool& Global();
  static void SetGlobalThreads(int n_threads);

 private:
  using TaskFn = void (*)(void* ctx, int tid, int nt);
  void RunErased(TaskFn fn, void* ctx);
  void WorkerLoop(int tid);
  static bool& in_task();

  int n_threads_;
  std::vector<int> worker_cpus_;  // by tid; [0] (the caller) always -1
  std::vector<std::thread> workers_;
  TaskFn task_ = nullptr;
  void* task_ctx_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace kvserve
