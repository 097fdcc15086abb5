// The P/D node's gRPC glue (what the node does: server/pd/pd_node.h; its
// member list by role: server/pd/pd_node_impl.h). This file owns start-up
// (the KV layout, the UCX transport and the regions peers read), the node's
// identity and counters (GetNodeInfo), the operator-key check every call
// makes, the peer stubs, shutdown, and the housekeeping thread that drives
// lease expiry (prefill_leases.cc) and the attached leases' renewals and
// returns (decode_pulls.cc). PdNode forwards to Impl.

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "server/frontend/status_map.h"
#include "server/pd/device_staging.h"
#include "server/pd/pd_node_impl.h"
#include "spdlog/spdlog.h"

namespace kvserve {

absl::StatusOr<PdRole> ParsePdRole(const std::string& name) {
  if (name == "both") return PdRole::kBoth;
  if (name == "prefill") return PdRole::kPrefill;
  if (name == "decode") return PdRole::kDecode;
  return absl::InvalidArgumentError(
      absl::StrCat("--role: '", name, "' is not one of both, prefill, decode"));
}

const char* PdRoleName(PdRole role) {
  switch (role) {
    case PdRole::kBoth: return "both";
    case PdRole::kPrefill: return "prefill";
    case PdRole::kDecode: return "decode";
  }
  return "?";
}

absl::Status PdNode::Impl::Attach(Engine* engine, ModelService* service) {
  engine_ = engine;
  service_ = service;
  admission_ = std::make_unique<Admission>(service, api_key_);
  const KvPool& pool = engine->kv_pool();
  const KvPoolOptions& o = pool.options();
  layout_.set_model_fingerprint(fingerprint_);
  layout_.set_kv_dtype(std::string(kernels::KvDTypeName(o.dtype)));
  layout_.set_block_size(o.block_size);
  layout_.set_block_bytes(pool.block_bytes());
  layout_.set_n_layers(o.n_layers);
  layout_.set_n_kv_heads(o.n_kv_heads);
  layout_.set_head_dim(o.head_dim);
  // KV cache groups: leases name each group's blocks, and a peer with
  // other groups (another --kv-layout, another model) has another layout.
  group_windows_ = engine->KvGroupWindows();
  for (int32_t w : group_windows_) layout_.add_group_windows(w);
  layout_.set_hash(LayoutHash(layout_));
  block_size_ = o.block_size;
  block_bytes_ = pool.block_bytes();
  num_blocks_ = pool.num_blocks();
  device_pool_ = pool.on_device();
  pool_dtype_ = o.dtype;
  shape_ = {o.n_layers, o.n_kv_heads, o.head_dim, o.block_size};
  pool_bytes_ = device_pool_ ? nullptr : pool.host_storage();
  if (role_ == PdRole::kBoth) return absl::OkStatus();
  RETURN_IF_ERROR(ConfigureWire());
  if (role_ == PdRole::kPrefill && !engine->options().prefix_cache) {
    return absl::InvalidArgumentError(
        "--role prefill needs the prefix cache (leases pin the prompt's cached blocks)");
  }
  kt::UcxTransportOptions to;
  to.name = absl::StrCat("kvserve-", PdRoleName(role_));
  to.tls = flags_.ucx_tls;
  to.net_devices = flags_.ucx_net_devices;
  to.transfer_timeout = absl::Seconds(flags_.transfer_timeout);
  // A CUDA pool is registered as CUDA memory: UCX moves it directly where
  // it has CUDA support (GPUDirect), else through host staging buffers
  // with this copier (the prefill node syncs a lease's blocks to staging
  // before granting; the decode node's reads land on the device before
  // the pull completes).
  if (device_pool_) {
    ASSIGN_OR_RETURN(to.device_copier, CreateCudaStagingCopier());
  }
  ASSIGN_OR_RETURN(transport_, kt::CreateUcxTransport(to));
  ASSIGN_OR_RETURN(ucx_address_, transport_->LocalAddress());
  staged_ = device_pool_ && transport_->GetCapabilities().cuda_staged;
  if (wire_) {
    // Peers read the re-encoded copies, block i at i * wire_block_bytes_.
    ASSIGN_OR_RETURN(kv_region_, transport_->AllocateRegion(static_cast<size_t>(num_blocks_) *
                                                            wire_block_bytes_));
  } else {
    ASSIGN_OR_RETURN(kv_region_,
                     transport_->RegisterRegion(
                         pool.storage(), static_cast<size_t>(num_blocks_) * block_bytes_,
                         device_pool_ ? kt::MemoryKind::kCuda : kt::MemoryKind::kHost));
  }
  ASSIGN_OR_RETURN(kv_descriptor_, transport_->DescribeRegion(kv_region_.id));
  if (role_ == PdRole::kPrefill) {
    ASSIGN_OR_RETURN(gen_region_,
                     transport_->RegisterRegion(const_cast<uint32_t*>(pool.generation_table()),
                                                static_cast<size_t>(num_blocks_) * 4,
                                                kt::MemoryKind::kHost));
    ASSIGN_OR_RETURN(gen_descriptor_, transport_->DescribeRegion(gen_region_.id));
  } else {
    ASSIGN_OR_RETURN(gen_buffer_, transport_->AllocateRegion(kMaxLeaseBlocks * 4));
    pull_thread_ = std::thread([this] { PullLoop(); });
  }
  housekeeping_ = std::thread([this] { HousekeepingLoop(); });
  const kt::Capabilities caps = transport_->GetCapabilities();
  spdlog::info("pd: role {} incarnation {:016x}, UCX transports '{}', {} blocks of {} bytes{}",
               PdRoleName(role_), incarnation_, caps.transports, num_blocks_, block_bytes_,
               !device_pool_ ? " in host memory"
               : staged_     ? " in device memory, moved through host staging buffers"
                             : " in device memory, moved directly (UCX CUDA support)");
  if (wire_) {
    spdlog::info(
        "pd: leased blocks move re-encoded as {} ({} bytes a block instead of {}; "
        "lossy)",
        kernels::KvDTypeName(wire_dtype_), wire_block_bytes_, block_bytes_);
  }
  return absl::OkStatus();
}

void PdNode::Impl::SetGrpcPort(int port) {
  std::lock_guard<std::mutex> lock(mu_);
  grpc_address_ = absl::StrCat(flags_.advertise_host, ":", port);
  node_id_ = flags_.node_id;
  if (node_id_.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    node_id_ = absl::StrCat(host, ":", port);
  }
}

void PdNode::Impl::SetHttpPort(int port) {
  std::lock_guard<std::mutex> lock(mu_);
  http_address_ = absl::StrCat(flags_.advertise_host, ":", port);
}

void PdNode::Impl::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return;
    shutdown_ = true;
    // Every held lease's blocks go back on the engine thread (run by the
    // engine's destructor at the latest).
    for (auto& [id, h] : held_) ReleaseHeld(&h);
    held_.clear();
    for (auto& a : attached_) {
      if (!a->consumed) a->consumed = true;
    }
  }
  cv_.notify_all();
  if (housekeeping_.joinable()) housekeeping_.join();
  if (pull_thread_.joinable()) pull_thread_.join();
  {
    // Progressive pulls see shutdown_ at their next wait for progress.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return progressive_pulls_ == 0; });
  }
}

grpc::Status PdNode::Impl::GetNodeInfo(grpc::ServerContext* ctx, const pb::GetNodeInfoRequest*,
                                       pb::NodeInfo* out) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  std::lock_guard<std::mutex> lock(mu_);
  out->set_node_id(node_id_);
  out->set_incarnation(incarnation_);
  out->set_role(PdRoleName(role_));
  out->set_ucx_address(ucx_address_);
  out->set_kv_region(kv_descriptor_);
  out->set_generation_region(gen_descriptor_);
  out->set_num_blocks(num_blocks_);
  *out->mutable_layout() = layout_;
  out->set_grpc_address(grpc_address_);
  out->set_http_address(http_address_);
  out->set_leases_granted(leases_granted_);
  out->set_leases_active(static_cast<int64_t>(held_.size()));
  out->set_leases_released(leases_released_);
  out->set_leases_expired(leases_expired_);
  out->set_duplicate_releases(duplicate_releases_);
  out->set_stale_releases(stale_releases_);
  out->set_early_frees(early_frees_);
  out->set_transfers_ok(transfers_ok_);
  out->set_transfers_failed(transfers_failed_);
  out->set_generation_mismatches(generation_mismatches_);
  out->set_blocks_pulled(blocks_pulled_);
  out->set_bytes_pulled(bytes_pulled_);
  out->set_leases_attached(leases_attached_);
  out->set_leases_unused(leases_unused_);
  out->set_pull_seconds(pull_seconds_);
  out->set_lease_renewals(lease_renewals_);
  out->set_admission_renewals(admission_renewals_);
  out->set_kv_memory(!device_pool_           ? "host"
                     : transport_ == nullptr ? "device"
                     : staged_               ? "device-staged"
                                             : "device-direct");
  out->set_staged_blocks(staged_blocks_);
  out->set_wire_dtype(wire_ ? std::string(kernels::KvDTypeName(wire_dtype_)) : "same");
  out->set_wire_blocks(wire_blocks_);
  out->set_leases_refused_no_blocks(leases_refused_no_blocks_);
  out->set_forged_endpoints(forged_endpoints_);
  out->set_duplicate_attaches(duplicate_attaches_);
  out->set_progressive_leases(progressive_leases_);
  out->set_progress_answers(progress_answers_);
  out->set_overlapped_blocks(overlapped_blocks_);
  out->set_exposed_pull_seconds(exposed_pull_seconds_);
  return grpc::Status::OK;
}

grpc::Status PdNode::Impl::Authorize(grpc::ServerContext* ctx) const {
  absl::StatusOr<CallerAuth> caller = AuthorizeGrpc(auth_, *ctx, true);
  return caller.ok() ? grpc::Status::OK : ToGrpc(caller.status());
}

grpc::Status PdNode::Impl::CheckIncarnation(uint64_t incarnation, const char* what) const {
  if (incarnation == incarnation_) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      absl::StrCat(what, ": stale incarnation ", incarnation, "; node ",
                                   node_id_, " is incarnation ", incarnation_,
                                   " (it restarted: the old leases are gone)"));
}

std::shared_ptr<pb::KvTransfer::Stub> PdNode::Impl::StubFor(const std::string& address) {
  std::lock_guard<std::mutex> lock(stub_mu_);
  auto& s = stubs_[address];
  if (s == nullptr) {
    s = pb::KvTransfer::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return s;
}

void PdNode::Impl::AddAuth(grpc::ClientContext* c) const {
  if (!api_key_.empty()) c->AddMetadata("authorization", "Bearer " + api_key_);
}

void PdNode::Impl::HousekeepingLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!shutdown_) {
    cv_.wait_for(lock, std::chrono::milliseconds(50));
    if (shutdown_) break;
    const auto now = PdClock::now();
    ExpireLeases(now);
    TendAttachedLeases(&lock, now);
  }
}

absl::StatusOr<std::unique_ptr<PdNode>> PdNode::Create(const PdFlags& flags,
                                                       std::string model_fingerprint,
                                                       std::string api_key) {
  ASSIGN_OR_RETURN(const PdRole role, ParsePdRole(flags.role));
  return std::unique_ptr<PdNode>(new PdNode(std::make_unique<Impl>(
      flags, role, std::move(model_fingerprint), std::move(api_key))));
}

PdNode::PdNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PdNode::~PdNode() = default;
PdRole PdNode::role() const { return impl_->role(); }
KvLoader* PdNode::kv_loader() { return impl_->role() == PdRole::kDecode ? impl_.get() : nullptr; }
absl::Status PdNode::Attach(Engine* engine, ModelService* service) {
  return impl_->Attach(engine, service);
}
void PdNode::SetGrpcPort(int port) { impl_->SetGrpcPort(port); }
void PdNode::SetHttpPort(int port) { impl_->SetHttpPort(port); }
grpc::Service* PdNode::service() { return impl_.get(); }
void PdNode::Shutdown() { impl_->Shutdown(); }

}  // namespace kvserve
