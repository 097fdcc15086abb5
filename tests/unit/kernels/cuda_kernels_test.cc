// CUDA kernels against the CPU reference. Skips with a message when no GPU is
// usable (build machines); the device tool runs it on a real GPU.
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve {
namespace {

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::UsableDeviceCount() == 0) GTEST_SKIP() << "no usable CUDA device; skipping";
  }
};

TEST_F(CudaKernelsTest, RmsNormMatchesCpuReference) {
  for (int64_t n : {8, 64, 576, 4097}) {
    const int64_t rows = 5;
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> x(rows * n), w(n), want(rows * n), got(rows * n);
    for (auto& v : x) v = dist(rng);
    for (auto& v : w) v = 1.f + 0.1f * dist(rng);
    kernels::RmsNormReference(x.data(), w.data(), rows, n, 1e-5f, want.data());
    auto dx = cuda::DeviceAlloc(x.size() * 4);
    auto dw = cuda::DeviceAlloc(w.size() * 4);
    auto dout = cuda::DeviceAlloc(x.size() * 4);
    ASSERT_TRUE(dx.ok() && dw.ok() && dout.ok());
    ASSERT_TRUE(cuda::CopyToDevice(*dx, x.data(), x.size() * 4).ok());
    ASSERT_TRUE(cuda::CopyToDevice(*dw, w.data(), w.size() * 4).ok());
    ASSERT_TRUE(cuda::RmsNorm(static_cast<float*>(*dx), static_cast<float*>(*dw), rows, n, 1e-5f,
                              static_cast<float*>(*dout))
                    .ok());
    ASSERT_TRUE(cuda::CopyToHost(got.data(), *dout, got.size() * 4).ok());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-4f * (1 + std::fabs(want[i])));
    EXPECT_TRUE(cuda::DeviceFree(*dx).ok());
    EXPECT_TRUE(cuda::DeviceFree(*dw).ok());
    EXPECT_TRUE(cuda::DeviceFree(*dout).ok());
  }
}

TEST(CudaDeviceTest, DeviceCountIsNonNegativeWithoutDriver) {
  // Must not throw or abort on machines with no driver.
  EXPECT_GE(cuda::UsableDeviceCount(), 0);
}

}  // namespace
}  // namespace kvserve
