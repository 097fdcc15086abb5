// The CUDA emulator's scheduler: the device work queue, and grids run as
// blocks of fibers (device.h has the model).
//
// Fibers are hand-rolled rather than taken from a library: what is needed is
// a few hundred lines of cooperative switching with barrier and warp-shuffle
// semantics that no fiber library provides, and Boost.Context would be a new
// dependency for a test-only build. On x86-64 the switch is a few
// instructions of assembly (callee-saved registers, MXCSR and the x87 control
// word); elsewhere it falls back to ucontext, which is slower because it
// saves the signal mask on every switch.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "kernels/cuda/emu/device.h"
#include "kernels/cuda/emu/queue.h"

#if defined(__x86_64__)
// void kvserve_emu_switch(void** save_sp, void* load_sp)
asm(R"(
  .text
  .globl kvserve_emu_switch
  .type kvserve_emu_switch, @function
kvserve_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvserve_emu_switch, .-kvserve_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
extern "C" void kvserve_emu_switch(void** save_sp, void* load_sp);
#endif

namespace kvserve::cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned kMaxThreadsPerBlock = 1024;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "kvserve CUDA emulator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

uint32_t SeedFromEnv() {
  const char* s = std::getenv("KVSERVE_CUDA_EMU_SEED");
  return s != nullptr ? static_cast<uint32_t>(std::strtoul(s, nullptr, 10)) : 1u;
}

enum class Wait { kRunnable, kBlockBarrier, kShuffle, kDone };

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  char* stack = nullptr;  // lowest usable byte; a guard page lies below
  ThreadCoords coords{};
  unsigned linear = 0;  // thread index within the block
  Wait wait = Wait::kRunnable;
  // The pending shuffle.
  unsigned mask = 0;
  const void* in = nullptr;
  void* out = nullptr;
  size_t bytes = 0;
  int src_lane = 0;
};

// Everything one OS thread needs to run blocks. Only the thread that holds
// the execution lock (Drain) runs grids, but thread_local keeps the fibers'
// view of "current" free of races by construction.
struct Runner {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler_ctx;
#endif
  const std::function<void()>* body = nullptr;
  const char* kernel = "";
  std::mt19937 rng{SeedFromEnv()};

  ~Runner() {
    for (Fiber& f : fibers) {
      if (f.stack != nullptr) munmap(f.stack - getpagesize(), kStackBytes + getpagesize());
    }
  }
};

thread_local Runner t_runner;

void SwitchToScheduler(Fiber* f) {
#if defined(__x86_64__)
  kvserve_emu_switch(&f->sp, t_runner.scheduler_sp);
#else
  swapcontext(&f->ctx, &t_runner.scheduler_ctx);
#endif
}

void SwitchToFiber(Fiber* f) {
  t_runner.current = f;
#if defined(__x86_64__)
  kvserve_emu_switch(&t_runner.scheduler_sp, f->sp);
#else
  swapcontext(&t_runner.scheduler_ctx, &f->ctx);
#endif
  t_runner.current = nullptr;
}

[[noreturn]] void FiberEntry() {
  Fiber* f = t_runner.current;
  (*t_runner.body)();
  f->wait = Wait::kDone;
  SwitchToScheduler(f);
  Fail("a finished fiber was resumed");
}

char* NewStack() {
  const size_t page = static_cast<size_t>(getpagesize());
  void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) Fail("mmap of a fiber stack failed");
  mprotect(p, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
  return static_cast<char*>(p) + page;
}

void ResetFiber(Fiber* f) {
  if (f->stack == nullptr) f->stack = NewStack();
  f->wait = Wait::kRunnable;
#if defined(__x86_64__)
  // Initial frame, from the top: a null return address for FiberEntry (which
  // never returns), FiberEntry's address for kvserve_emu_switch's `ret`, six
  // callee-saved registers and the MXCSR/x87 control words. After the `ret`,
  // rsp is 8 mod 16, as the ABI wants at a function's entry.
  auto top = reinterpret_cast<uintptr_t>(f->stack + kStackBytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;
  *--slot = reinterpret_cast<uint64_t>(&FiberEntry);
  for (int i = 0; i < 6; ++i) *--slot = 0;
  --slot;
  uint32_t mxcsr = 0;
  uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  std::memcpy(reinterpret_cast<char*>(slot), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(slot) + 4, &fpcw, 2);
  f->sp = slot;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = kStackBytes;
  f->ctx.uc_link = nullptr;
  makecontext(&f->ctx, reinterpret_cast<void (*)()>(&FiberEntry), 0);
#endif
}

std::string Where(const Fiber& f) {
  const ThreadCoords& c = f.coords;
  return std::string(t_runner.kernel) + " block (" + std::to_string(c.block_idx.x) + "," +
         std::to_string(c.block_idx.y) + "," + std::to_string(c.block_idx.z) + ") thread (" +
         std::to_string(c.thread_idx.x) + "," + std::to_string(c.thread_idx.y) + "," +
         std::to_string(c.thread_idx.z) + ")";
}

// Opens the shuffles whose lanes have all arrived. Returns whether any did.
bool ResolveShuffles(unsigned n_threads) {
  std::vector<Fiber>& fs = t_runner.fibers;
  bool any = false;
  for (unsigned w = 0; w * 32 < n_threads; ++w) {
    const unsigned base = w * 32;
    const unsigned lanes = std::min(32u, n_threads - base);
    const Fiber* first = nullptr;
    for (unsigned l = 0; l < lanes && first == nullptr; ++l) {
      if (fs[base + l].wait == Wait::kShuffle) first = &fs[base + l];
    }
    if (first == nullptr) continue;
    const unsigned mask = first->mask;
    bool ready = true;
    for (unsigned l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) == 0) continue;
      if (l >= lanes) {
        Fail("shuffle mask names lane " + std::to_string(l) + " that the block lacks, at " +
             Where(*first));
      }
      const Fiber& o = fs[base + l];
      if (o.wait == Wait::kDone) {
        Fail("shuffle waits on lane " + std::to_string(l) + " that has exited, at " +
             Where(*first));
      }
      if (o.wait != Wait::kShuffle) {
        ready = false;
        break;
      }
      if (o.mask != mask || o.bytes != first->bytes) {
        Fail("lanes of one warp shuffle with different masks or widths, at " + Where(o));
      }
    }
    if (!ready) continue;
    for (unsigned l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) == 0) continue;
      Fiber& o = fs[base + l];
      const unsigned src = static_cast<unsigned>(o.src_lane);
      if (src >= lanes || (mask >> src & 1u) == 0) {
        Fail("shuffle reads lane " + std::to_string(src) + " outside its mask, at " + Where(o));
      }
      std::memcpy(o.out, fs[base + src].in, o.bytes);
    }
    for (unsigned l = 0; l < 32; ++l) {
      if (mask >> l & 1u) fs[base + l].wait = Wait::kRunnable;
    }
    any = true;
  }
  return any;
}

void RunBlock(unsigned n_threads) {
  std::vector<Fiber>& fs = t_runner.fibers;
  std::vector<unsigned> order(n_threads);
  for (unsigned i = 0; i < n_threads; ++i) order[i] = i;
  for (unsigned i = 0; i < n_threads; ++i) ResetFiber(&fs[i]);
  for (;;) {
    std::shuffle(order.begin(), order.end(), t_runner.rng);
    for (unsigned i : order) {
      if (fs[i].wait == Wait::kRunnable) SwitchToFiber(&fs[i]);
    }
    // Every fiber now waits or is done.
    if (ResolveShuffles(n_threads)) continue;
    unsigned done = 0, at_barrier = 0;
    const Fiber* odd = nullptr;
    for (unsigned i = 0; i < n_threads; ++i) {
      if (fs[i].wait == Wait::kDone) {
        ++done;
      } else if (fs[i].wait == Wait::kBlockBarrier) {
        ++at_barrier;
      } else if (odd == nullptr) {
        odd = &fs[i];
      }
    }
    if (done == n_threads) return;
    if (odd != nullptr) {
      Fail("deadlock: a shuffle can never complete (" + std::to_string(at_barrier) +
           " threads wait at __syncthreads), at " + Where(*odd));
    }
    // Exited threads count as arrived, as on current GPUs.
    for (unsigned i = 0; i < n_threads; ++i) {
      if (fs[i].wait == Wait::kBlockBarrier) fs[i].wait = Wait::kRunnable;
    }
  }
}

void RunGrid(dim3 grid, dim3 block, const char* name, const std::function<void()>& body) {
  const unsigned n_threads = block.x * block.y * block.z;
  Runner& r = t_runner;
  if (r.fibers.size() < n_threads) r.fibers.resize(n_threads);
  r.body = &body;
  r.kernel = name;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        for (unsigned t = 0; t < n_threads; ++t) {
          Fiber& f = r.fibers[t];
          f.linear = t;
          f.coords.thread_idx =
              make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          f.coords.block_idx = make_uint3(bx, by, bz);
          f.coords.block_dim = block;
          f.coords.grid_dim = grid;
        }
        RunBlock(n_threads);
      }
    }
  }
  r.body = nullptr;
}

// ---------------------------------------------------------------------------
// The queue.

std::mutex g_queue_mu;
std::deque<std::function<void()>> g_queue;
std::recursive_mutex g_exec_mu;  // one drainer at a time; ops never re-enter
thread_local cudaError_t t_last_error = cudaSuccess;

}  // namespace

const ThreadCoords& Coords() {
  Fiber* f = t_runner.current;
  if (f == nullptr) Fail("threadIdx/blockIdx read outside a kernel");
  return f->coords;
}

void SyncThreads() {
  Fiber* f = t_runner.current;
  if (f == nullptr) Fail("__syncthreads() outside a kernel");
  f->wait = Wait::kBlockBarrier;
  SwitchToScheduler(f);
}

void WarpShuffle(unsigned mask, const void* in, void* out, size_t bytes, int src_lane) {
  Fiber* f = t_runner.current;
  if (f == nullptr) Fail("warp shuffle outside a kernel");
  if ((mask >> (f->linear % 32) & 1u) == 0) {
    Fail("a lane shuffles with a mask that leaves it out, at " + Where(*f));
  }
  f->wait = Wait::kShuffle;
  f->mask = mask;
  f->in = in;
  f->out = out;
  f->bytes = bytes;
  f->src_lane = src_lane;
  SwitchToScheduler(f);
}

void SubmitGrid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                const char* name, std::function<void()> body) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 ||
      threads > kMaxThreadsPerBlock || block.z > 64 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 0x7fffffffu || shared_bytes > 48 * 1024) {
    SetLastError(cudaErrorInvalidConfiguration);
    return;
  }
  std::string kernel = name;
  OrderAfterLegacy(stream);
  Enqueue([grid, block, kernel = std::move(kernel), body = std::move(body)] {
    RunGrid(grid, block, kernel.c_str(), body);
  });
}

void Enqueue(std::function<void()> op) {
  std::lock_guard<std::mutex> lock(g_queue_mu);
  g_queue.push_back(std::move(op));
}

void Drain() {
  std::lock_guard<std::recursive_mutex> exec(g_exec_mu);
  for (;;) {
    std::function<void()> op;
    {
      std::lock_guard<std::mutex> lock(g_queue_mu);
      if (g_queue.empty()) return;
      op = std::move(g_queue.front());
      g_queue.pop_front();
    }
    op();
  }
}

void SetLastError(cudaError_t e) { t_last_error = e; }

}  // namespace kvserve::cuda_emu

// The last-error pair lives here beside the launch check that sets it.
extern "C" cudaError_t cudaGetLastError(void) {
  const cudaError_t e = kvserve::cuda_emu::t_last_error;
  kvserve::cuda_emu::t_last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return kvserve::cuda_emu::t_last_error; }
