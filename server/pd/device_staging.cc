// CUDA KV pools and the P/D transport (server/pd/device_staging.h says what
// this owns): the copier UCX uses to move a device pool's blocks through
// host staging buffers, and PdNode::Impl::SyncStaging, which brings a
// lease's blocks to staging before the lease is granted.

#include "server/pd/device_staging.h"

#include <algorithm>

#include "common/status.h"
#include "kernels/cuda/runtime.h"
#include "server/pd/pd_node_impl.h"

namespace kvserve {

namespace {

// Copies between a CUDA KV pool and the transport's host staging buffers,
// on a stream of its own, each copy waited for before it returns: a staged
// read has landed on the device when the transfer reports done, and a
// staging sync holds the device's bytes when it returns. Thread-safe (the
// transport's progress thread and gRPC threads share it; one stream, so a
// wait may also cover another thread's copy).
class CudaStagingCopier final : public kt::DeviceCopier {
 public:
  static absl::StatusOr<std::shared_ptr<CudaStagingCopier>> Create() {
    ASSIGN_OR_RETURN(cuda::CudaStream stream, cuda::CudaStream::Create());
    return std::shared_ptr<CudaStagingCopier>(new CudaStagingCopier(std::move(stream)));
  }
  absl::Status CopyDeviceToHost(void* host_dst, const void* device_src, size_t length) override {
    RETURN_IF_ERROR(cuda::CopyToHostAsync(host_dst, device_src, length, stream_.get()));
    return stream_.Synchronize();
  }
  absl::Status CopyHostToDevice(void* device_dst, const void* host_src, size_t length) override {
    RETURN_IF_ERROR(cuda::CopyToDeviceAsync(device_dst, host_src, length, stream_.get()));
    return stream_.Synchronize();
  }

 private:
  explicit CudaStagingCopier(cuda::CudaStream stream) : stream_(std::move(stream)) {}
  cuda::CudaStream stream_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<kt::DeviceCopier>> CreateCudaStagingCopier() {
  ASSIGN_OR_RETURN(std::shared_ptr<CudaStagingCopier> c, CudaStagingCopier::Create());
  return std::shared_ptr<kt::DeviceCopier>(std::move(c));
}

absl::Status PdNode::Impl::SyncStaging(const std::vector<BlockHandle>& blocks) {
  if (!staged_ || blocks.empty()) return absl::OkStatus();
  std::vector<int32_t> ids;
  for (const BlockHandle& h : blocks) ids.push_back(h.id);
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size();) {
    size_t j = i + 1;
    while (j < ids.size() && ids[j] <= ids[j - 1] + 1) ++j;
    const uint64_t first = static_cast<uint64_t>(ids[i]);
    const uint64_t count = static_cast<uint64_t>(ids[j - 1]) - first + 1;
    RETURN_IF_ERROR(transport_->SyncStagingFromDevice(kv_region_.id, first * block_bytes_,
                                                      count * block_bytes_));
    i = j;
  }
  std::lock_guard<std::mutex> lock(mu_);
  staged_blocks_ += static_cast<int64_t>(ids.size());
  return absl::OkStatus();
}

}  // namespace kvserve
