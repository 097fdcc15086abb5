// Block re-encoding on the wire (--kv-wire-dtype), PdNode::Impl's members
// of this role (the node: server/pd/pd_node.h, its members:
// server/pd/pd_node_impl.h). A prefill node whose wire codec is smaller than
// its pool's keeps a re-encoded copy of each leased block in the region
// peers read (ConfigureWire, EncodeForWire: once per block generation, so a
// later generation fails an older lease's fence); a decode node reads such
// blocks into a staging buffer (EnsureWireStaging) and decodes them into its
// pool once the fence passed (DecodeWireBlocks). The codecs themselves are
// kernels/cpu/kv_transcode.h's.

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/frontend/status_map.h"
#include "server/pd/pd_node_impl.h"
#include "spdlog/spdlog.h"

namespace kvserve {

absl::Status PdNode::Impl::ConfigureWire() {
  if (flags_.wire_dtype != "same" && role_ == PdRole::kPrefill) {
    kernels::KvDType w;
    if (!kernels::ParseKvDType(flags_.wire_dtype, &w)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv-wire-dtype: unknown codec '", flags_.wire_dtype, "'"));
    }
    if (w != pool_dtype_) {
      if (device_pool_) {
        return absl::InvalidArgumentError(
            "--kv-wire-dtype re-encodes leased blocks on the host: it needs a host KV pool "
            "(--device cpu)");
      }
      const int64_t wbb = kernels::KvBlockBytes(w, shape_);
      if (wbb >= block_bytes_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--kv-wire-dtype ", flags_.wire_dtype, ": ", wbb, " bytes a block, not smaller than ",
            "the pool's ", std::string(kernels::KvDTypeName(pool_dtype_)), " (", block_bytes_,
            "); use same"));
      }
      if (kernels::KvBlockBytes(pool_dtype_, shape_) != block_bytes_) {
        return absl::InternalError("--kv-wire-dtype: the pool's block layout is not the codec's");
      }
      wire_ = true;
      wire_dtype_ = w;
      wire_block_bytes_ = wbb;
      wire_gen_.assign(static_cast<size_t>(num_blocks_), -1);
    }
  }
  if (role_ == PdRole::kDecode && flags_.wire_dtype != "same") {
    spdlog::warn(
        "pd: --kv-wire-dtype {} is a prefill node's flag; a decode node decodes "
        "whatever codec each lease names",
        flags_.wire_dtype);
  }
  return absl::OkStatus();
}

void PdNode::Impl::EncodeForWire(const std::vector<BlockHandle>& blocks) {
  if (!wire_ || blocks.empty()) return;
  auto* wire = static_cast<uint8_t*>(kv_region_.address);
  int64_t encoded = 0;
  {
    std::lock_guard<std::mutex> lock(wire_mu_);
    for (const BlockHandle& h : blocks) {
      int64_t& g = wire_gen_[static_cast<size_t>(h.id)];
      if (g == static_cast<int64_t>(h.generation)) continue;
      kernels::TranscodeKvBlock(
          shape_, pool_dtype_, pool_bytes_ + static_cast<int64_t>(h.id) * block_bytes_,
          wire_dtype_, wire + static_cast<int64_t>(h.id) * wire_block_bytes_);
      g = h.generation;
      ++encoded;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  wire_blocks_ += encoded;
}

int64_t PdNode::Impl::MovedBlockBytes(const pb::Lease& l) const {
  return l.wire_dtype().empty() ? block_bytes_ : l.wire_block_bytes();
}

absl::Status PdNode::Impl::EnsureWireStaging(size_t bytes) {
  if (wire_staging_.address != nullptr && wire_staging_.length >= bytes) return absl::OkStatus();
  if (wire_staging_.address != nullptr) {
    RETURN_IF_ERROR(transport_->DeregisterRegion(wire_staging_.id));
    wire_staging_ = {};
  }
  size_t want = 1 << 20;
  while (want < bytes) want *= 2;
  ASSIGN_OR_RETURN(wire_staging_, transport_->AllocateRegion(want));
  return absl::OkStatus();
}

void PdNode::Impl::DecodeWireBlocks(const Job& job, kernels::KvDType wire_dtype,
                                    uint64_t read_bytes) {
  const int32_t n = static_cast<int32_t>(job.local_ids.size());
  const auto* staged = static_cast<const uint8_t*>(wire_staging_.address);
  for (int32_t k = 0; k < n; ++k) {
    kernels::TranscodeKvBlock(
        shape_, wire_dtype, staged + static_cast<uint64_t>(k) * read_bytes, pool_dtype_,
        pool_bytes_ + static_cast<int64_t>(job.local_ids[k]) * block_bytes_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  wire_blocks_ += n;
}

}  // namespace kvserve
