// Kernel launch spelling shared by nvcc and the CPU emulator (emu/).
//
//   KVSERVE_CUDA_LAUNCH(grid, block, shared_bytes, stream, Kernel<T>)(args...);
//
// With nvcc this is the triple-chevron launch. When the .cu files are built as
// plain C++ for the emulator (KVSERVE_CUDA_EMULATOR), it queues the grid on
// the emulated stream instead; the kernel goes last because template
// arguments may contain commas.
#pragma once

#if defined(KVSERVE_CUDA_EMULATOR)
#include "kernels/cuda/emu/device.h"
#define KVSERVE_CUDA_LAUNCH(grid, block, shared_bytes, stream, ...)                   \
  ::kvserve::cuda_emu::Launch(grid, block, shared_bytes, stream, #__VA_ARGS__, \
                              __VA_ARGS__)
#else
#define KVSERVE_CUDA_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif
