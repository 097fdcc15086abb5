// The CUDA emulator's host side (internal): the device work queue and the
// per-thread last error. See device.h for the execution model.
//
// Device work is lazy, as on a GPU: launches, async copies, memsets, event
// records and GEMMs queue in issue order across all streams (a valid order
// for any program that is correct on a GPU) and run only when the host
// synchronizes: stream, event or device synchronize, a synchronous copy, or
// cudaFree. A host that reads a pinned buffer before synchronizing therefore
// reads stale bytes here too.
#pragma once

#include <cuda_runtime.h>

#include <functional>

namespace kvserve::cuda_emu {

void Enqueue(std::function<void()> op);
// Runs every queued op, oldest first. Safe to call from any host thread.
void Drain();

void SetLastError(cudaError_t e);

}  // namespace kvserve::cuda_emu
