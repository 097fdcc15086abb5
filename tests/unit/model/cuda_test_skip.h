// KVSERVE_SKIP_WITHOUT_GPU(): skips a CUDA test, naming the reason, where no
// CUDA device is usable (build machines, CI without the emulator);
// deploy/gpu-check.sh runs such tests on a GPU machine, where a skip counts
// as a failure.
#pragma once

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/runtime.h"

#define KVSERVE_SKIP_WITHOUT_GPU()                                                          \
  do {                                                                                      \
    const absl::Status usable = ::kvserve::cuda::CudaUsable();                              \
    if (!usable.ok()) {                                                                     \
      GTEST_SKIP() << "no usable CUDA device (" << usable.message()                         \
                   << "); GPU test skipped (deploy/gpu-check.sh runs it on a GPU machine)"; \
    }                                                                                       \
  } while (0)
