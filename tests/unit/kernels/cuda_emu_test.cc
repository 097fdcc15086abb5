// The CUDA emulator itself (kernels/cuda/emu): that it runs kernels with CUDA's
// semantics, and that it catches what it promises to catch -- a missing
// __syncthreads, shuffles that can never complete, writes past a device
// allocation, host reads before a synchronize, launch shapes a GPU refuses,
// copies whose device side is not device memory. Built only with
// -DKVSERVE_CUDA_EMULATOR=ON; the kernels here are CUDA C++ compiled through
// emu/device.h.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <signal.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/emu/device.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/runtime.h"

namespace {

// ---- kernels ---------------------------------------------------------------

// Block-wide sum through shared memory and shuffles over a 2-D block; block b
// writes out[b].
__global__ void BlockSumKernel(const int* in, int n_per_block, int* out) {
  __shared__ int warp_sums[32];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int threads = blockDim.x * blockDim.y;
  int v = 0;
  for (int i = t; i < n_per_block; i += threads) v += in[blockIdx.x * n_per_block + i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (t % 32 == 0) warp_sums[t / 32] = v;
  __syncthreads();
  if (t == 0) {
    int s = 0;
    for (int w = 0; w < (threads + 31) / 32; ++w) s += warp_sums[w];
    out[blockIdx.x] = s;
  }
}

// Each thread writes its slot of shared memory and reads its neighbour's. With
// the barrier the result is exact; without it, a reader that runs before its
// neighbour has written sees the previous block's value.
template <bool kSync>
__global__ void NeighbourKernel(int* out) {
  __shared__ int slots[256];
  const int t = threadIdx.x;
  slots[t] = static_cast<int>(blockIdx.x) * 1000 + t;
  if (kSync) __syncthreads();
  out[blockIdx.x * blockDim.x + t] = slots[(t + 1) % blockDim.x];
}

// __shfl_sync broadcast and __shfl_down_sync over segments of `width` lanes.
__global__ void ShuffleKernel(int* bcast, int* down, int width) {
  const int lane = threadIdx.x;
  bcast[lane] = __shfl_sync(0xffffffffu, lane * 10, 3, width);
  down[lane] = __shfl_down_sync(0xffffffffu, lane, 1, width);
}

// Lane 0 waits at __syncthreads while the other lanes wait for it in a shuffle.
__global__ void DeadlockKernel(int* out) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
  }
}

// Lane 1 exits; lane 0 then shuffles with it.
__global__ void ExitedLaneKernel(int* out) {
  if (threadIdx.x == 1) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void CopyKernel(const int* in, int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}

__global__ void WriteKernel(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i;
}

__global__ void UncheckedWriteKernel(int* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// ---- helpers ---------------------------------------------------------------

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// ---- tests -----------------------------------------------------------------

TEST(CudaEmuTest, BlockReductionsAreExactForManyShapes) {
  std::mt19937 rng(7);
  for (const dim3 block : {dim3(32), dim3(64), dim3(256), dim3(1024), dim3(32, 4), dim3(16, 8)}) {
    const int blocks = 5, per_block = 3000;
    std::vector<int> in(blocks * per_block);
    for (int& v : in) v = static_cast<int>(rng() % 1000) - 500;
    int* d_in = DeviceAlloc<int>(in.size());
    int* d_out = DeviceAlloc<int>(blocks);
    ASSERT_EQ(cudaMemcpy(d_in, in.data(), in.size() * sizeof(int), cudaMemcpyHostToDevice),
              cudaSuccess);
    KVSERVE_CUDA_LAUNCH(blocks, block, 0, nullptr, BlockSumKernel)(d_in, per_block, d_out);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<int> out = Download(d_out, blocks);
    for (int b = 0; b < blocks; ++b) {
      EXPECT_EQ(out[b], std::accumulate(in.begin() + b * per_block,
                                        in.begin() + (b + 1) * per_block, 0))
          << "block " << block.x << "x" << block.y << ", grid block " << b;
    }
    cudaFree(d_in);
    cudaFree(d_out);
  }
}

TEST(CudaEmuTest, AMissingSyncthreadsIsVisible) {
  const int blocks = 4, threads = 256;
  int* d_out = DeviceAlloc<int>(blocks * threads);
  auto expected = [&](int b, int t) { return b * 1000 + (t + 1) % threads; };

  KVSERVE_CUDA_LAUNCH(blocks, threads, 0, nullptr, NeighbourKernel<true>)(d_out);
  std::vector<int> out = Download(d_out, blocks * threads);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) ASSERT_EQ(out[b * threads + t], expected(b, t));
  }

  KVSERVE_CUDA_LAUNCH(blocks, threads, 0, nullptr, NeighbourKernel<false>)(d_out);
  out = Download(d_out, blocks * threads);
  int stale = 0;
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) stale += out[b * threads + t] != expected(b, t);
  }
  EXPECT_GT(stale, 0) << "threads ran in an order that hid the missing barrier";
  cudaFree(d_out);
}

TEST(CudaEmuTest, ShufflesFollowCudaLaneRules) {
  int* d_bcast = DeviceAlloc<int>(32);
  int* d_down = DeviceAlloc<int>(32);
  for (int width : {32, 8}) {
    KVSERVE_CUDA_LAUNCH(1, 32, 0, nullptr, ShuffleKernel)(d_bcast, d_down, width);
    const std::vector<int> bcast = Download(d_bcast, 32), down = Download(d_down, 32);
    for (int lane = 0; lane < 32; ++lane) {
      const int seg = lane / width * width;
      EXPECT_EQ(bcast[lane], (seg + 3) * 10) << "width " << width << " lane " << lane;
      // Past the end of a segment, a lane gets its own value back.
      const int want = lane + 1 < seg + width ? lane + 1 : lane;
      EXPECT_EQ(down[lane], want) << "width " << width << " lane " << lane;
    }
  }
  cudaFree(d_bcast);
  cudaFree(d_down);
}

TEST(CudaEmuTest, BadLaunchShapesSetTheLastErrorAndRunNothing) {
  int* d = DeviceAlloc<int>(2048);
  ASSERT_EQ(cudaMemset(d, 0, 2048 * sizeof(int)), cudaSuccess);
  KVSERVE_CUDA_LAUNCH(1, 1025, 0, nullptr, WriteKernel)(d, 2048);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaGetLastError clears the error";
  KVSERVE_CUDA_LAUNCH(0, 32, 0, nullptr, WriteKernel)(d, 2048);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int> out = Download(d, 2048);
  EXPECT_EQ(std::count(out.begin(), out.end(), 0), 2048) << "a refused launch ran";
  cudaFree(d);
}

TEST(CudaEmuTest, DeviceWorkRunsAtSynchronizeNotBefore) {
  const int n = 1000;
  int* d = DeviceAlloc<int>(n);
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, n * sizeof(int), cudaHostAllocDefault), cudaSuccess);
  auto* host = static_cast<int*>(pinned);
  std::fill(host, host + n, -1);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  KVSERVE_CUDA_LAUNCH((n + 127) / 128, 128, 0, s, WriteKernel)(d, n);
  ASSERT_EQ(cudaMemcpyAsync(host, d, n * sizeof(int), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(host[5], -1) << "a pinned buffer is written when the stream runs, not at the call";
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(host[i], i);

  // From pageable memory the source is taken at the call.
  std::vector<int> pageable(n, 7);
  ASSERT_EQ(cudaMemcpyAsync(d, pageable.data(), n * sizeof(int), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  std::fill(pageable.begin(), pageable.end(), 8);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(Download(d, n)[17], 7);

  cudaEvent_t a = nullptr, b = nullptr;
  ASSERT_EQ(cudaEventCreate(&a), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&b), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(a, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(b, s), cudaSuccess);
  float ms = 0;
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaErrorNotReady);
  ASSERT_EQ(cudaEventSynchronize(b), cudaSuccess);
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaSuccess);
  EXPECT_GE(ms, 0.0f);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  cudaFreeHost(pinned);
  cudaFree(d);
}

// A synchronous cudaMemcpy from pageable memory returns before its DMA has
// landed, on the legacy stream; a non-blocking stream does not wait for it
// (on an H200 a kernel read the tail of such an upload stale). The emulator
// lands those bytes only when the legacy stream is ordered before the
// reader; cuda::CopyToDevice waits for it.
TEST(CudaEmuTest, APageableUploadIsNotOrderedBeforeANonBlockingStream) {
  const int n = 256;
  int* in = DeviceAlloc<int>(n);
  int* out = DeviceAlloc<int>(n);
  ASSERT_EQ(cudaMemset(in, 0, n * sizeof(int)), cudaSuccess);
  cudaStream_t nb = nullptr, blocking = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  auto run = [&](cudaStream_t s) {
    EXPECT_EQ(cudaMemsetAsync(out, 0xff, n * sizeof(int), s), cudaSuccess);
    KVSERVE_CUDA_LAUNCH(n / 128, 128, 0, s, CopyKernel)(in, out, n);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return Download(out, n)[n - 1];
  };

  auto upload = [&](int v) {
    const std::vector<int> values(n, v);
    ASSERT_EQ(cudaMemcpy(in, values.data(), n * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  };
  upload(1);
  EXPECT_EQ(run(nb), 0) << "a non-blocking stream ran before the legacy stream's DMA";
  upload(2);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(run(nb), 2) << "a device synchronize lands it";
  upload(3);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  EXPECT_EQ(run(nb), 3) << "a legacy-stream synchronize lands it";
  upload(4);
  EXPECT_EQ(run(blocking), 4) << "a blocking stream waits for the legacy stream";
  const std::vector<int> fives(n, 5);
  ASSERT_TRUE(kvserve::cuda::CopyToDevice(in, fives.data(), n * sizeof(int)).ok());
  EXPECT_EQ(run(nb), 5) << "CopyToDevice's bytes are on the device when it returns";

  cudaStreamDestroy(nb);
  cudaStreamDestroy(blocking);
  cudaFree(in);
  cudaFree(out);
}

TEST(CudaEmuTest, CopiesCheckTheirDeviceSide) {
  int* d = DeviceAlloc<int>(16);
  std::vector<int> h(32);
  EXPECT_EQ(cudaMemcpy(h.data(), h.data() + 16, 16, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue)
      << "a host pointer passed as the device side";
  EXPECT_EQ(cudaMemcpy(d, h.data(), 32 * sizeof(int), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue)
      << "a copy past the end of the allocation";
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16 * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaEmuTest, DeviceMemoryIsAccountedAndBounded) {
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_EQ(free0 - free1, size_t{1} << 20);
  void* huge = nullptr;
  EXPECT_EQ(cudaMalloc(&huge, total + 1), cudaErrorMemoryAllocation);
  EXPECT_EQ(huge, nullptr);
  cudaGetLastError();
  cudaFree(p);
}

TEST(CudaEmuTest, GemmExMatchesANaiveProductForEveryTransposition) {
  const int m = 5, n = 3, k = 37;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Column-major op(A) m x k, op(B) k x n.
      const int lda = (ta ? k : m) + 1, ldb = (tb ? n : k) + 2, ldc = m + 3;
      std::vector<float> A(lda * (ta ? m : k)), B(ldb * (tb ? k : n)), C(ldc * n, 5.0f);
      for (float& v : A) v = u(rng);
      for (float& v : B) v = u(rng);
      float* dA = DeviceAlloc<float>(A.size());
      float* dB = DeviceAlloc<float>(B.size());
      float* dC = DeviceAlloc<float>(C.size());
      cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(dC, C.data(), C.size() * 4, cudaMemcpyHostToDevice);
      const float alpha = 2.0f, beta = 0.5f;
      ASSERT_EQ(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m,
                             n, k, &alpha, dA, CUDA_R_32F, lda, dB, CUDA_R_32F, ldb, &beta, dC,
                             CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                CUBLAS_STATUS_SUCCESS);
      const std::vector<float> got = Download(dC, C.size());
      for (int c = 0; c < n; ++c) {
        for (int r = 0; r < m; ++r) {
          double want = 0;
          for (int i = 0; i < k; ++i) {
            const float a = ta ? A[i + r * lda] : A[r + i * lda];
            const float b = tb ? B[c + i * ldb] : B[i + c * ldb];
            want += static_cast<double>(a) * b;
          }
          want = alpha * want + beta * 5.0;
          EXPECT_NEAR(got[r + c * ldc], want, 1e-4) << ta << tb << " r" << r << " c" << c;
        }
      }
      cudaFree(dA);
      cudaFree(dB);
      cudaFree(dC);
    }
  }
  EXPECT_EQ(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, nullptr, nullptr, CUDA_R_32F, 2,
                         nullptr, CUDA_R_32F, 4, nullptr, nullptr, CUDA_R_32F, 4,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_INVALID_VALUE)
      << "lda below m";
  cublasDestroy(h);
}

using CudaEmuDeathTest = ::testing::Test;

TEST_F(CudaEmuDeathTest, AShuffleThatCanNeverCompleteAbortsNamingTheKernel) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = DeviceAlloc<int>(32);
        KVSERVE_CUDA_LAUNCH(1, 32, 0, nullptr, DeadlockKernel)(d);
        cudaDeviceSynchronize();
      },
      "deadlock.*DeadlockKernel");
}

TEST_F(CudaEmuDeathTest, AShuffleWithAnExitedLaneAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = DeviceAlloc<int>(32);
        KVSERVE_CUDA_LAUNCH(1, 32, 0, nullptr, ExitedLaneKernel)(d);
        cudaDeviceSynchronize();
      },
      "lane 1 that has exited.*ExitedLaneKernel");
}

TEST_F(CudaEmuDeathTest, AWritePastADeviceAllocationFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        // 64 ints fill the 256-byte granule exactly: element 64 is the guard page.
        int* d = DeviceAlloc<int>(64);
        KVSERVE_CUDA_LAUNCH(1, 65, 0, nullptr, UncheckedWriteKernel)(d);
        cudaDeviceSynchronize();
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
