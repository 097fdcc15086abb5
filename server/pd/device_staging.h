// Device staging for the P/D node: when the KV pool lives in CUDA memory and
// UCX has no CUDA support of its own, leased blocks move through the
// transport's host staging buffers. This file gives the transport its
// copier (CreateCudaStagingCopier: device<->host copies on a stream of its
// own, each waited for); device_staging.cc also holds
// PdNode::Impl::SyncStaging, the prefill node's copy of a lease's blocks to
// staging before the grant. Host pools and GPUDirect transports need
// neither.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/ucx_transport.h"

namespace kvserve {

[[nodiscard]] absl::StatusOr<std::shared_ptr<transport::DeviceCopier>> CreateCudaStagingCopier();

}  // namespace kvserve
