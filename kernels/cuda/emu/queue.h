// The CUDA emulator's host side (internal): the device work queue and the
// per-thread last error. See device.h for the execution model.
//
// Device work is lazy, as on a GPU: launches, async copies, memsets, event
// records and GEMMs queue in issue order across all streams (a valid order
// for any program that is correct on a GPU) and run only when the host
// synchronizes: stream, event or device synchronize, a synchronous copy, or
// cudaFree. A host that reads a pinned buffer before synchronizing therefore
// reads stale bytes here too.
//
// One exception to "issue order": a synchronous cudaMemcpy from pageable
// host memory to the device returns once the driver has staged the bytes,
// and the DMA runs on the legacy default stream, which work on a stream
// created with cudaStreamNonBlocking does not wait for. Such a copy's bytes
// land here only when the legacy stream is ordered before something: a
// device or legacy-stream synchronize, the next synchronous copy or memset,
// cudaFree, or work issued on the legacy stream or a blocking stream. A
// non-blocking stream's kernel that reads them without that sees stale
// bytes, the worst case of the race on a GPU.
#pragma once

#include <cuda_runtime.h>

#include <functional>

namespace kvserve::cuda_emu {

void Enqueue(std::function<void()> op);
// Runs every queued op, oldest first. Safe to call from any host thread.
void Drain();

void SetLastError(cudaError_t e);

// Lands the pending legacy-stream copies (see above).
void SyncLegacyStream();
// Queues SyncLegacyStream() ahead of work issued on `stream` when that
// stream waits for the legacy stream (the legacy stream itself, the
// per-thread default stream, or a stream created without
// cudaStreamNonBlocking).
void OrderAfterLegacy(cudaStream_t stream);

}  // namespace kvserve::cuda_emu
