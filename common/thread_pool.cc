#include "common/thread_pool.h"

#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVSERVE_PAUSE() _mm_pause()
#else
#define KVSERVE_PAUSE() \
  do {                  \
  } while (0)
#endif

namespace kvserve {
namespace {

// Spin this many iterations waiting for new work before sleeping. Long
// enough to bridge the gap between consecutive kernels of one forward pass,
// short enough not to burn a core when the engine is idle.
constexpr int kSpinIterations = 1 << 16;

// Spinners yield their core now and then. Without it, an oversubscribed
// machine (more runnable threads than cores: other processes, or a pool
// larger than the machine) lets spinners burn whole scheduler slices while
// the thread they wait for is descheduled, and each region costs
// milliseconds instead of microseconds. The first kSpinBeforeYield
// iterations only pause, so back-to-back regions on free cores never pay for
// a syscall; afterwards one iteration in kYieldEvery yields, which keeps the
// idle spin about as long in time as kSpinIterations pauses.
constexpr int kSpinBeforeYield = 1 << 10;
constexpr int kYieldEvery = 64;

inline void SpinWait(int iteration) {
  if (iteration >= kSpinBeforeYield && iteration % kYieldEvery == 0) {
    std::this_thread::yield();
  } else {
    KVSERVE_PAUSE();
  }
}

// The CPUs the calling thread may run on, in increasing order (empty where
// this cannot be asked).
std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
#endif
  return cpus;
}

// Pins `t` to `cpu`; false if refused (e.g. a cgroup's cpuset changed).
bool PinThread(std::thread& t, int cpu) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(t.native_handle(), sizeof(set), &set) == 0;
#else
  (void)t;
  (void)cpu;
  return false;
#endif
}

std::unique_ptr<ThreadPool>& GlobalSlot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
int& GlobalRequested() {
  static int n = 0;
  return n;
}

}  // namespace

bool& ThreadPool::in_task() {
  thread_local bool flag = false;
  return flag;
}

ThreadPool::ThreadPool(int n_threads, bool pin_workers) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (n_threads <= 0) n_threads = 1;
  n_threads_ = n_threads;
  worker_cpus_.assign(n_threads_, -1);
  // Pinned only when the pool takes exactly the CPUs the process may use
  // (-t equal to the CPU count, or a cpuset / taskset of -t CPUs). A pool on
  // a subset would pin to the first CPUs of the mask, where a second process
  // doing the same (two daemons on one host, P/D on one box) would stack its
  // workers on ours; more threads than CPUs cannot spread at all.
  const std::vector<int> cpus =
      pin_workers && n_threads_ > 1 ? AllowedCpus() : std::vector<int>();
  const bool pin = static_cast<int>(cpus.size()) == n_threads_;
  for (int i = 1; i < n_threads_; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
    if (pin && PinThread(workers_.back(), cpus[i])) worker_cpus_[i] = cpus[i];
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::RunErased(TaskFn fn, void* ctx) {
  if (n_threads_ == 1 || in_task()) {
    for (int t = 0; t < n_threads_; ++t) fn(ctx, t, n_threads_);
    return;
  }
  task_ = fn;
  task_ctx_ = ctx;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    // Publishing under the mutex pairs with the sleepers' predicate check,
    // so no wake-up is lost.
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  in_task() = true;
  fn(ctx, 0, n_threads_);
  in_task() = false;
  for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) SpinWait(spin);
}

void ThreadPool::WorkerLoop(int tid) {
  uint64_t seen = 0;
  in_task() = true;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < kSpinIterations; ++spin) {
      SpinWait(spin);
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      sleepers_.fetch_sub(1);
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load()) return;
    task_(task_ctx_, tid, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

ThreadPool& ThreadPool::Global() {
  auto& slot = GlobalSlot();
  static std::once_flag once;
  std::call_once(once, [&] {
    int n = GlobalRequested();
    if (n <= 0) {
      if (const char* env = std::getenv("KVSERVE_THREADS")) n = std::atoi(env);
    }
    const char* pin = std::getenv("KVSERVE_PIN_THREADS");
    slot = std::make_unique<ThreadPool>(n, pin == nullptr || std::strcmp(pin, "0") != 0);
  });
  return *slot;
}

void ThreadPool::SetGlobalThreads(int n_threads) { GlobalRequested() = n_threads; }

}  // namespace kvserve
