// The CUDA emulator's device side: what a .cu file needs in order to compile
// as plain C++ and run its kernels on the CPU.
//
// The emulator exists so that every kernel and the whole CUDA forward run in
// CI, which has no GPU, against the same CPU references the GPU tests use.
// It is a test build (KVSERVE_CUDA_EMULATOR), never the product: speed means
// nothing here, and passing here does not replace a run on a real device.
//
// Model. A grid runs one block at a time; a block's threads are fibers on one
// OS thread. A fiber runs until it reaches __syncthreads() or a warp shuffle,
// then yields; a barrier opens when every live thread of the block (or every
// lane the shuffle's mask names) has reached it. Between barriers the fibers
// run in a shuffled order (seeded, KVSERVE_CUDA_EMU_SEED), so a read of shared
// memory that is missing its __syncthreads() sees stale data here as it might
// on a GPU. Divergent barriers, shuffles naming exited or missing lanes, and
// block shapes a GPU would refuse are reported and abort, naming the kernel.
// __shared__ variables are function statics: blocks never overlap, so one
// copy serves every block in turn.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvserve::cuda_emu {

// The running thread's coordinates, as a kernel sees them.
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The coordinates of the emulated thread running on this OS thread; only
// valid inside a kernel.
const ThreadCoords& Coords();

// __syncthreads(): waits for every live thread of the block.
void SyncThreads();

// One lane's part of a warp shuffle: publishes `bytes` bytes at `in`, waits
// for every lane in `mask`, then copies lane `src_lane`'s bytes to `out`.
void WarpShuffle(unsigned mask, const void* in, void* out, size_t bytes, int src_lane);

// Queues a grid on `stream` (nullptr = the legacy default stream). The body
// runs once per thread. Bad shapes set the thread's last error, as a launch
// would, and queue nothing.
void SubmitGrid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                const char* name, std::function<void()> body);

template <typename... P>
class KernelLaunch {
 public:
  using Kernel = void (*)(P...);
  KernelLaunch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
               const char* name, Kernel kernel)
      : grid_(grid),
        block_(block),
        shared_bytes_(shared_bytes),
        stream_(stream),
        name_(name),
        kernel_(kernel) {}

  // Arguments are copied at launch, as the driver copies kernel parameters.
  template <typename... A>
  void operator()(A&&... args) const {
    auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
    const Kernel kernel = kernel_;
    SubmitGrid(grid_, block_, shared_bytes_, stream_, name_,
               [kernel, params] { std::apply(kernel, *params); });
  }

 private:
  dim3 grid_, block_;
  size_t shared_bytes_;
  cudaStream_t stream_;
  const char* name_;
  Kernel kernel_;
};

template <typename... P>
KernelLaunch<P...> Launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                          const char* name, void (*kernel)(P...)) {
  return KernelLaunch<P...>(grid, block, shared_bytes, stream, name, kernel);
}

template <typename To, typename From>
inline To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

}  // namespace kvserve::cuda_emu

// Execution-space and memory-space keywords mean nothing on the CPU.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

#define threadIdx (::kvserve::cuda_emu::Coords().thread_idx)
#define blockIdx (::kvserve::cuda_emu::Coords().block_idx)
#define blockDim (::kvserve::cuda_emu::Coords().block_dim)
#define gridDim (::kvserve::cuda_emu::Coords().grid_dim)

inline void __syncthreads() { ::kvserve::cuda_emu::SyncThreads(); }

namespace kvserve::cuda_emu {
// The shuffles below differ only in which lane they read.
template <typename T>
inline T ShuffleFrom(unsigned mask, T v, int src_lane) {
  T out;
  WarpShuffle(mask, &v, &out, sizeof(T), src_lane);
  return out;
}
inline int Lane() { return static_cast<int>(Coords().thread_idx.x % 32); }
}  // namespace kvserve::cuda_emu

// A source lane past the caller's group of `width` lanes returns the caller's
// own value, as in CUDA.
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::kvserve::cuda_emu::Lane();
  const int src = lane ^ lane_mask;
  return ::kvserve::cuda_emu::ShuffleFrom(mask, v, src >= (lane / width + 1) * width ? lane : src);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const int lane = ::kvserve::cuda_emu::Lane();
  return ::kvserve::cuda_emu::ShuffleFrom(mask, v, (lane / width) * width + (src_lane % width));
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::kvserve::cuda_emu::Lane();
  const int src = lane + static_cast<int>(delta);
  return ::kvserve::cuda_emu::ShuffleFrom(mask, v, src >= (lane / width + 1) * width ? lane : src);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::kvserve::cuda_emu::Lane();
  const int src = lane - static_cast<int>(delta);
  return ::kvserve::cuda_emu::ShuffleFrom(mask, v, src < (lane / width) * width ? lane : src);
}

// Device math. The _rn forms are single IEEE operations; the emulator's
// sources are built with -ffp-contract=off so that no multiply-add is fused
// behind their back. __expf is the fast approximation on a GPU; the exact
// expf stands in (GPU tests compare against references with tolerances).
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint_as_float(unsigned v) { return ::kvserve::cuda_emu::BitCast<float>(v); }
inline float __int_as_float(int v) { return ::kvserve::cuda_emu::BitCast<float>(v); }
inline unsigned __float_as_uint(float v) { return ::kvserve::cuda_emu::BitCast<unsigned>(v); }
inline int __float_as_int(float v) { return ::kvserve::cuda_emu::BitCast<int>(v); }

// CUDA's math library puts the classification functions in the global namespace.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// Four signed byte products summed into c.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) {
    c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) *
         static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
  }
  return c;
}

template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline T __ldg(const T* p) { return *p; }

// CUDA's integer min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
