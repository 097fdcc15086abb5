// The implementation of PdNode. What it owns and how it is used: the
// opening paragraph of server/pd/pd_node.h.

#include "server/pd/pd_node.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "kernels/cpu/kv_transcode.h"
#include "kernels/cuda/runtime.h"
#include "proto/kvserve.pb.h"
#include "proto/pd.grpc.pb.h"
#include "server/service/auth.h"
#include "server/frontend/grpc_server.h"
#include "server/frontend/openai_request.h"
#include "server/service/response_cache.h"
#include "server/frontend/status_map.h"
#include "spdlog/spdlog.h"
#include "transport/ucx_transport.h"

namespace kvserve {

namespace pb = ::kvserve::pd::v1;
namespace kt = ::kvserve::transport;
using PdClock = std::chrono::steady_clock;

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

std::string KvLayoutDifference(const pb::KvLayout& a, const pb::KvLayout& b) {
  std::vector<std::string> d;
  auto cmp = [&](const char* name, const auto& x, const auto& y) {
    if (x != y) d.push_back(absl::StrCat(name, " ", x, " (here) vs ", y, " (peer)"));
  };
  cmp("model_fingerprint", a.model_fingerprint().substr(0, 16),
      b.model_fingerprint().substr(0, 16));
  cmp("kv_dtype", a.kv_dtype(), b.kv_dtype());
  cmp("block_size", a.block_size(), b.block_size());
  cmp("block_bytes", a.block_bytes(), b.block_bytes());
  cmp("n_layers", a.n_layers(), b.n_layers());
  cmp("n_kv_heads", a.n_kv_heads(), b.n_kv_heads());
  cmp("head_dim", a.head_dim(), b.head_dim());
  if (d.empty() && a.hash() != b.hash()) d.push_back("layout hash differs");
  return absl::StrJoin(d, "; ");
}

namespace {

uint64_t LayoutHash(const pb::KvLayout& l) {
  const std::string s = absl::StrCat(l.model_fingerprint(), "|", l.kv_dtype(), "|",
                                     l.block_size(), "|", l.block_bytes(), "|", l.n_layers(), "|",
                                     l.n_kv_heads(), "|", l.head_dim());
  return XXH3_64bits(s.data(), s.size());
}

template <typename Repeated>
void AppendRepeated(const Repeated& v, std::string* s) {
  s->append(std::to_string(v.size())).push_back(':');
  for (auto x : v) s->append(reinterpret_cast<const char*>(&x), sizeof(x));
}

// The digest of where a decode node's GETs go: the UCX worker address and
// the two region descriptors (length-prefixed, so no field bleeds into
// another).
uint64_t EndpointDigest(const std::string& ucx_address, const std::string& kv_region,
                        const std::string& generation_region) {
  const std::string s = absl::StrCat(ucx_address.size(), ":", ucx_address, "|", kv_region.size(),
                                     ":", kv_region, "|", generation_region.size(), ":",
                                     generation_region);
  return XXH3_64bits(s.data(), s.size());
}

uint64_t EndpointDigest(const pb::Lease& l) {
  return EndpointDigest(l.ucx_address(), l.kv_region(), l.generation_region());
}

// The prefill node's digest over everything a decode node acts on: the
// blocks it reads and where it reads them from.
uint64_t LeaseDigest(const pb::Lease& l) {
  std::string s = absl::StrCat(l.transfer_id(), "|", l.node_id(), "|", l.incarnation(), "|",
                               l.layout().hash(), "|", l.cache_salt().size(), ":",
                               l.cache_salt(), "|", l.ttl_ms(), "|", l.grpc_address(), "|",
                               EndpointDigest(l), "|");
  AppendRepeated(l.tokens(), &s);
  AppendRepeated(l.block_ids(), &s);
  AppendRepeated(l.generations(), &s);
  absl::StrAppend(&s, "|", l.wire_dtype().size(), ":", l.wire_dtype(), "|", l.wire_block_bytes(),
                  "|", l.progressive() ? "progressive" : "whole");
  return XXH3_64bits(s.data(), s.size());
}

uint64_t RandomNonZero() {
  static std::mutex mu;
  static std::mt19937_64 rng(std::random_device{}() ^
                             static_cast<uint64_t>(PdClock::now().time_since_epoch().count()));
  std::lock_guard<std::mutex> lock(mu);
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}

// A load the engine polls: done only once no transfer touches its blocks.
class PullLoad final : public KvLoad {
 public:
  bool Done() override { return done_.load(std::memory_order_acquire); }
  absl::Status status() override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  // lossy_tokens: of the loaded tokens, those decoded from a lossy wire
  // codec (--kv-wire-dtype): the radix nodes they enter are marked lossy.
  void Finish(absl::Status s, int32_t lossy_tokens = 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      lossy_tokens_ = lossy_tokens;
    }
    done_.store(true, std::memory_order_release);
  }
  KvLoadSources sources() override {
    std::lock_guard<std::mutex> lock(mu_);
    KvLoadSources src;
    src.lossy_tokens = lossy_tokens_;
    return src;
  }

 private:
  std::atomic<bool> done_{false};
  std::mutex mu_;
  absl::Status status_;
  int32_t lossy_tokens_ = 0;
};

}  // namespace

class PdNode::Impl final : public pb::KvTransfer::Service, public KvLoader {
  struct Progress;  // a progressive lease's prefill (below)
  struct Attached;

 public:
  Impl(const PdFlags& flags, PdRole role, std::string fingerprint, std::string api_key)
      : flags_(flags), role_(role), fingerprint_(std::move(fingerprint)),
        api_key_(std::move(api_key)), auth_(api_key_), incarnation_(RandomNonZero()) {}

  ~Impl() override { Shutdown(); }

  PdRole role() const { return role_; }

  absl::Status Attach(Engine* engine, ModelService* service) {
    engine_ = engine;
    service_ = service;
    const KvPool& pool = engine->kv_pool();
    const KvPoolOptions& o = pool.options();
    layout_.set_model_fingerprint(fingerprint_);
    layout_.set_kv_dtype(std::string(kernels::KvDTypeName(o.dtype)));
    layout_.set_block_size(o.block_size);
    layout_.set_block_bytes(pool.block_bytes());
    layout_.set_n_layers(o.n_layers);
    layout_.set_n_kv_heads(o.n_kv_heads);
    layout_.set_head_dim(o.head_dim);
    layout_.set_hash(LayoutHash(layout_));
    block_size_ = o.block_size;
    block_bytes_ = pool.block_bytes();
    num_blocks_ = pool.num_blocks();
    device_pool_ = pool.on_device();
    pool_dtype_ = o.dtype;
    shape_ = {o.n_layers, o.n_kv_heads, o.head_dim, o.block_size};
    pool_bytes_ = device_pool_ ? nullptr : pool.host_storage();
    if (role_ == PdRole::kBoth) return absl::OkStatus();
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
      ASSIGN_OR_RETURN(to.device_copier, CudaStagingCopier::Create());
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

  void SetGrpcPort(int port) {
    std::lock_guard<std::mutex> lock(mu_);
    grpc_address_ = absl::StrCat(flags_.advertise_host, ":", port);
    node_id_ = flags_.node_id;
    if (node_id_.empty()) {
      char host[256] = {};
      gethostname(host, sizeof(host) - 1);
      node_id_ = absl::StrCat(host, ":", port);
    }
  }

  void SetHttpPort(int port) {
    std::lock_guard<std::mutex> lock(mu_);
    http_address_ = absl::StrCat(flags_.advertise_host, ":", port);
  }

  void Shutdown() {
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

  // ---- KvTransfer service ----

  grpc::Status GetNodeInfo(grpc::ServerContext* ctx, const pb::GetNodeInfoRequest*,
                           pb::NodeInfo* out) override {
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

  grpc::Status Prefill(grpc::ServerContext* ctx, const pb::PrefillRequest* req,
                       pb::Lease* out) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    if (role_ != PdRole::kPrefill) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("Prefill: this node's role is ", PdRoleName(role_),
                                       ", not prefill"));
    }
    // The request in the form the decode node receives it, read by the same
    // code, so the prompt's tokens (a rendered chat template included) are
    // the same on both nodes.
    absl::StatusOr<CompletionParams> params;
    if (!req->chat_request().empty()) {
      v1::ChatRequest cr;
      if (!cr.ParseFromString(req->chat_request())) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "chat_request: not a serialized kvserve.v1.ChatRequest");
      }
      params = ChatRequestToParams(cr);
    } else if (!req->openai_chat_body().empty()) {
      OpenAiRequest o;
      if (std::optional<ApiError> err = ParseOpenAiRequest(req->openai_chat_body(), true, &o)) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("openai_chat_body: ", err->message));
      }
      params = std::move(o.params);
    } else {
      v1::GenerateRequest gr;
      if (!gr.ParseFromString(req->generate_request())) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "generate_request: not a serialized kvserve.v1.GenerateRequest");
      }
      params = GenerateRequestToParams(gr);
    }
    if (!params.ok()) return ToGrpc(params.status());
    params->tenant = TenantFromApiKey(api_key_);  // as the decode node's front ends set it
    absl::StatusOr<PreparedRequest> prepared = service_->Prepare(*params);
    if (!prepared.ok()) return ToGrpc(prepared.status());
    EngineRequest er = std::move(prepared->engine);
    const std::vector<int32_t> tokens = er.prompt;
    const std::string salt = er.cache_salt;
    er.params.max_tokens = 1;  // the prompt's KV is what this node makes
    er.n = 1;
    er.draft_tokens.clear();
    er.kv_policy = KvPolicy{};
    er.grammar = nullptr;  // the decode node samples, under its own Prepare's grammar
    const auto deadline = PdClock::now() + std::chrono::seconds(120);
    er.deadline = deadline;
    // Overlap: lease the blocks before they exist and report each as the
    // prefill commits it. Host pools moved in their own codec only (a
    // staged device pool or a wire codec needs a copy per block after its
    // write; those leases are granted whole).
    const int32_t full_blocks =
        block_size_ > 0 ? (static_cast<int32_t>(tokens.size()) - 1) / block_size_ : 0;
    if (req->progressive() && !device_pool_ && !wire_ && full_blocks >= 1) {
      return GrantProgressive(*req, std::move(er), tokens, salt, full_blocks, out);
    }
    auto finished = std::make_shared<std::promise<SeqEvent>>();
    auto fired = std::make_shared<std::atomic<bool>>(false);
    std::future<SeqEvent> fin = finished->get_future();
    absl::StatusOr<uint64_t> id = engine_->Submit(std::move(er), [finished, fired](const SeqEvent& e) {
      if (e.finish != FinishReason::kNone && !fired->exchange(true)) finished->set_value(e);
    });
    if (!id.ok()) return ToGrpc(id.status());
    while (fin.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
      if (ctx->IsCancelled() || PdClock::now() > deadline) {
        engine_->Cancel(*id);
        return grpc::Status(grpc::StatusCode::CANCELLED, "Prefill: cancelled before it finished");
      }
    }
    const SeqEvent done = fin.get();
    if (done.finish == FinishReason::kCancelled || done.finish == FinishReason::kDeadline) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          absl::StrCat("Prefill: the prompt's prefill ended ",
                                       FinishReasonName(done.finish)));
    }
    // Pin the prompt's full blocks (all but the last token's block: decode
    // computes the last token itself, its logits pick the first token),
    // once the device's writes to them landed.
    absl::StatusOr<PinnedPrefix> pinned =
        engine_->PinPrefix(salt, tokens, full_blocks * block_size_);
    if (absl::IsDeadlineExceeded(pinned.status())) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the engine did not answer");
    }
    if (!pinned.ok()) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("Prefill: ", pinned.status().message()));
    }
    PinnedPrefix& p = *pinned;
    if (absl::Status s = SyncStaging(p.blocks); !s.ok()) {
      engine_->Unpin(p.pin);
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("Prefill: copying the leased KV blocks to the transport's "
                                       "host staging failed: ",
                                       s.message()));
    }
    EncodeForWire(p.blocks);
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) {
      engine_->Unpin(p.pin);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the node is shutting down");
    }
    pb::Lease& l = *out;
    StartLease(salt, req->ttl_ms(), &l);
    const size_t leased_tokens = p.blocks.size() * static_cast<size_t>(block_size_);
    for (size_t i = 0; i < leased_tokens; ++i) l.add_tokens(tokens[i]);
    for (const BlockHandle& h : p.blocks) {
      l.add_block_ids(h.id);
      l.add_generations(h.generation);
    }
    l.set_prefill_cached_tokens(done.cached_tokens);
    if (wire_) {
      l.set_wire_dtype(std::string(kernels::KvDTypeName(wire_dtype_)));
      l.set_wire_block_bytes(wire_block_bytes_);
    }
    l.set_digest(LeaseDigest(l));
    Held h;
    h.pin = std::move(p.pin);
    h.held_blocks = p.held_blocks;
    h.digest = l.digest();
    h.ttl = std::chrono::milliseconds(l.ttl_ms());
    h.expiry = PdClock::now() + h.ttl;
    held_.emplace(l.transfer_id(), std::move(h));
    ++leases_granted_;
    return grpc::Status::OK;
  }

  // Prefill with PrefillRequest.progressive: submits the request and grants
  // the lease at once, with the prompt's full-block tokens and no blocks;
  // AnswerProgress reports the blocks as the prefill commits them.
  grpc::Status GrantProgressive(const pb::PrefillRequest& req, EngineRequest er,
                                const std::vector<int32_t>& tokens, const std::string& salt,
                                int32_t full_blocks, pb::Lease* out) {
    auto progress = std::make_shared<Progress>();
    progress->tokens.assign(tokens.begin(),
                            tokens.begin() + static_cast<int64_t>(full_blocks) * block_size_);
    progress->salt = salt;
    progress->full_blocks = full_blocks;
    // The request's end (engine thread): the next progress answer matches
    // once more and tells whether every block made it.
    std::weak_ptr<Progress> weak = progress;
    absl::StatusOr<uint64_t> id = engine_->Submit(std::move(er), [this, weak](const SeqEvent& e) {
      if (e.finish == FinishReason::kNone) return;
      std::shared_ptr<Progress> p = weak.lock();
      if (p == nullptr) return;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (p->finished) return;
        p->finished = true;
        if (e.finish == FinishReason::kCancelled || e.finish == FinishReason::kDeadline) {
          p->error = absl::AbortedError(
              absl::StrCat("the prompt's prefill ended ", FinishReasonName(e.finish)));
        }
      }
      cv_.notify_all();
    });
    if (!id.ok()) return ToGrpc(id.status());
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) {
      engine_->Cancel(*id);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the node is shutting down");
    }
    progress->request_id = *id;
    progress->granted = PdClock::now();
    pb::Lease& l = *out;
    StartLease(salt, req.ttl_ms(), &l);
    for (int32_t t : progress->tokens) l.add_tokens(t);
    l.set_progressive(true);
    l.set_digest(LeaseDigest(l));
    Held h;
    h.digest = l.digest();
    h.ttl = std::chrono::milliseconds(l.ttl_ms());
    h.expiry = PdClock::now() + h.ttl;
    h.progress = std::move(progress);
    held_.emplace(l.transfer_id(), std::move(h));
    ++leases_granted_;
    ++progressive_leases_;
    return grpc::Status::OK;
  }

  // The fields every lease of this node carries: a fresh transfer id, who
  // and where the node is, its KV layout, the salt, and the ttl asked for
  // (0: --pd-lease-ttl). REQUIRES: mu_ held.
  void StartLease(const std::string& salt, uint32_t ttl_ms, pb::Lease* l) const {
    l->set_transfer_id(RandomNonZero());
    l->set_node_id(node_id_);
    l->set_incarnation(incarnation_);
    l->set_grpc_address(grpc_address_);
    l->set_ucx_address(ucx_address_);
    l->set_kv_region(kv_descriptor_);
    l->set_generation_region(gen_descriptor_);
    *l->mutable_layout() = layout_;
    l->set_cache_salt(salt);
    const double ttl = ttl_ms > 0 ? ttl_ms / 1000.0 : flags_.lease_ttl;
    l->set_ttl_ms(static_cast<uint32_t>(ttl * 1000));
  }

  // REQUIRES: mu_ held.
  void PostRematch(uint64_t id, const std::shared_ptr<Progress>& p) {
    p->rematch_pending = true;
    p->next_rematch = PdClock::now() + std::chrono::milliseconds(2);
    auto finished = std::make_shared<bool>(false);  // as seen before the pin
    engine_->PinCachedBlocks(
        p->salt, p->tokens, p->full_blocks * block_size_,
        [this, p, finished] { return RematchBegin(p, finished.get()); },
        [this, id, p, finished](const absl::Status& s, std::vector<BlockHandle>* hs) {
          RematchEnd(id, p, *finished, s, hs);
        });
  }

  // Engine thread, before the re-match's pin: false when the lease is
  // gone (nothing to pin). *finished: whether the prefill had ended then.
  bool RematchBegin(const std::shared_ptr<Progress>& p, bool* finished) {
    std::lock_guard<std::mutex> lock(mu_);
    if (p->released || p->early_freed) {
      p->rematch_pending = false;
      cv_.notify_all();
      return false;
    }
    *finished = p->finished;
    return true;
  }

  // Engine thread: hs holds the full blocks of the prompt the prefix cache
  // holds now (the prefill commits its blocks there chunk by chunk), one
  // reference each; the lease keeps the new ones and leaves the rest in hs,
  // whose references go back when this returns. PrefixCache::Pin neither
  // touches nor counts them, so following a prefill does not make its
  // blocks look reused to the eviction policy or the disk tier. Blocks
  // already reported stay what they were: referenced, they cannot be
  // evicted or reused.
  void RematchEnd(uint64_t id, const std::shared_ptr<Progress>& p, bool finished,
                  const absl::Status& pinned, std::vector<BlockHandle>* hs) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->rematch_pending = false;
      if (!pinned.ok()) {
        if (p->error.ok()) {
          p->error = absl::AbortedError(
              "the prefill node has no prefix cache to follow the prefill in");
        }
      } else if (auto it = held_.find(id);
                 !p->released && !p->early_freed && it != held_.end() &&
                 it->second.progress == p && p->error.ok()) {
        const size_t have = p->blocks.size();
        bool same = hs->size() >= have;
        for (size_t i = 0; same && i < have; ++i) {
          same = (*hs)[i].id == p->blocks[i].id && (*hs)[i].generation == p->blocks[i].generation;
        }
        if (!same) {
          p->error = absl::InternalError(
              "the prefix cache no longer holds the lease's reported blocks");
        } else {
          // The earlier blocks' references are held already: this pin's go.
          p->blocks.insert(p->blocks.end(), hs->begin() + static_cast<int64_t>(have), hs->end());
          hs->resize(have);
        }
        if (finished && p->error.ok()) {
          p->final = true;
          if (static_cast<int32_t>(p->blocks.size()) < p->full_blocks) {
            p->error = absl::AbortedError(absl::StrCat(
                "the prefill finished with ", p->blocks.size(), " of the lease's ",
                p->full_blocks, " blocks in the prefix cache (the rest were evicted before "
                "they could be pinned)"));
          }
        }
      }
    }
    cv_.notify_all();
  }

  // RenewLease with progress: waits (up to wait_ms, at most 1 s) until the
  // lease holds more blocks than the decode node has, is complete, or
  // failed; the prefill's engine thread re-matches meanwhile (at most one
  // re-match in flight, 2 ms apart). REQUIRES: *lock holds mu_.
  grpc::Status AnswerProgress(std::unique_lock<std::mutex>* lock, uint64_t id,
                              std::shared_ptr<Progress> p, const pb::RenewLeaseRequest& req,
                              pb::RenewLeaseResponse* out) {
    const int32_t have = req.have_blocks();
    if (have < 0 || have > p->full_blocks) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("have_blocks: ", have, " of a lease of ", p->full_blocks,
                                       " blocks"));
    }
    const auto until =
        PdClock::now() + std::chrono::milliseconds(std::min<uint32_t>(req.wait_ms(), 1000));
    // --pd-test-progress-delay S (tests only): block i of n is shown from
    // (i + 1) / n of S after the grant, as a prefill that slow would.
    const double reveal = flags_.test_progress_delay;
    auto shown = [&](PdClock::time_point now) {
      if (reveal <= 0 || p->early_freed) return p->blocks.size();
      const double f = std::chrono::duration<double>(now - p->granted).count() / reveal;
      return std::min(p->blocks.size(), static_cast<size_t>(f * p->full_blocks));
    };
    size_t n = 0;
    bool complete = false;
    for (;;) {
      if (!p->error.ok()) {
        return grpc::Status(grpc::StatusCode::ABORTED,
                            absl::StrCat("transfer id ", id, ": ", p->error.message()));
      }
      if (p->released) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("transfer id ", id, " was released"));
      }
      const auto now = PdClock::now();
      n = shown(now);
      complete = (p->final || p->early_freed) && n == p->blocks.size();
      if (static_cast<int32_t>(n) > have || complete || now >= until) break;
      if (!p->rematch_pending && now >= p->next_rematch) PostRematch(id, p);
      auto wake = p->rematch_pending ? until : std::min(until, p->next_rematch);
      if (reveal > 0 && n < p->blocks.size()) {
        wake = std::min(wake, p->granted + std::chrono::duration_cast<PdClock::duration>(
                                               std::chrono::duration<double>(
                                                   reveal * static_cast<double>(n + 1) /
                                                   p->full_blocks)));
      }
      cv_.wait_until(*lock, wake);
    }
    for (size_t i = static_cast<size_t>(have); i < n; ++i) {
      out->add_block_ids(p->blocks[i].id);
      out->add_generations(p->blocks[i].generation);
    }
    out->set_complete(complete);
    ++progress_answers_;
    return grpc::Status::OK;
  }

  grpc::Status RenewLease(grpc::ServerContext* ctx, const pb::RenewLeaseRequest* req,
                          pb::RenewLeaseResponse* out) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    std::unique_lock<std::mutex> lock(mu_);
    if (grpc::Status s = CheckIncarnation(req->incarnation(), "RenewLease"); !s.ok()) return s;
    auto it = held_.find(req->transfer_id());
    if (it == held_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("unknown transfer id ", req->transfer_id(),
                                       " (released, expired, or never granted by node ", node_id_,
                                       ")"));
    }
    if (it->second.digest != req->digest() && req->endpoint_digest() != 0 &&
        req->endpoint_digest() != EndpointDigest(ucx_address_, kv_descriptor_, gen_descriptor_)) {
      ++forged_endpoints_;
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("lease digest mismatch for transfer id ", req->transfer_id(),
                       ": the lease's UCX worker address or KV/generation region descriptors "
                       "are not node ",
                       node_id_, "'s (the lease was altered or forged)"));
    }
    if (it->second.digest != req->digest()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("lease digest mismatch for transfer id ",
                                       req->transfer_id(),
                                       ": the lease was altered or forged (blocks, generations, "
                                       "tokens or salt differ from the grant)"));
    }
    it->second.expiry = PdClock::now() + it->second.ttl;
    out->set_ttl_ms(static_cast<uint32_t>(it->second.ttl.count()));
    if (req->progress()) {
      if (it->second.progress == nullptr) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("transfer id ", req->transfer_id(),
                                         " is a whole lease: its blocks are in the lease"));
      }
      return AnswerProgress(&lock, req->transfer_id(), it->second.progress, *req, out);
    }
    return grpc::Status::OK;
  }

  grpc::Status ReleaseLease(grpc::ServerContext* ctx, const pb::ReleaseLeaseRequest* req,
                            pb::ReleaseLeaseResponse* out) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    std::lock_guard<std::mutex> lock(mu_);
    if (grpc::Status s = CheckIncarnation(req->incarnation(), "ReleaseLease"); !s.ok()) {
      ++stale_releases_;
      return s;
    }
    auto it = held_.find(req->transfer_id());
    if (it == held_.end()) {
      if (std::find(gone_.begin(), gone_.end(), req->transfer_id()) != gone_.end()) {
        ++duplicate_releases_;
        out->set_released(false);
        return grpc::Status::OK;
      }
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("unknown transfer id ", req->transfer_id(),
                                       " (never granted by node ", node_id_, ")"));
    }
    ReleaseHeld(&it->second);
    held_.erase(it);
    RememberGone(req->transfer_id());
    ++leases_released_;
    out->set_released(true);
    return grpc::Status::OK;
  }

  // A staged device pool: brings the leased blocks' bytes to the host
  // buffer the decode node reads (runs of consecutive blocks in one copy).
  // Nothing to do for host pools and direct (GPUDirect) ones.
  absl::Status SyncStaging(const std::vector<BlockHandle>& blocks) {
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

  // --kv-wire-dtype: re-encodes the leased blocks into the wire region
  // (block i at i * wire_block_bytes_). A block's copy is made once per
  // generation: a block shared by several leases is encoded once, and a
  // copy is rewritten only for a later generation, which fails the fence of
  // any earlier lease still reading it. The leased blocks are full and
  // pinned, so the engine does not write them meanwhile.
  void EncodeForWire(const std::vector<BlockHandle>& blocks) {
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

  grpc::Status DebugEarlyFree(grpc::ServerContext* ctx, const pb::ReleaseLeaseRequest* req,
                              pb::ReleaseLeaseResponse* out) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    if (!flags_.test_hooks) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "DebugEarlyFree needs --pd-test-hooks");
    }
    std::shared_ptr<KvPin> pin;
    std::vector<BlockHandle> pinned;  // a progressive lease's references
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (grpc::Status s = CheckIncarnation(req->incarnation(), "DebugEarlyFree"); !s.ok()) {
        return s;
      }
      auto it = held_.find(req->transfer_id());
      const std::shared_ptr<Progress>& p = it != held_.end() ? it->second.progress : nullptr;
      if (it == held_.end() || (p == nullptr && it->second.pin == nullptr) ||
          (p != nullptr && p->early_freed)) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("unknown transfer id ", req->transfer_id()));
      }
      if (p != nullptr) {
        if (!p->final) {
          return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                              absl::StrCat("transfer id ", req->transfer_id(),
                                           ": the progressive lease is not complete yet"));
        }
        p->early_freed = true;  // its answers stay as they were
        pinned = p->blocks;
      }
      // The lease record stays (Renew still succeeds), as with a buggy
      // node that freed the blocks but kept answering for them.
      pin = std::move(it->second.pin);
      ++early_frees_;
    }
    // Free the blocks (drop the lease's pin and the prefix cache's), then
    // reuse every free block with other bytes: what a decode node reads
    // from them now is someone else's KV.
    (void)engine_->DiscardAndScribbleForTest(std::move(pin), std::move(pinned));
    out->set_released(true);
    return grpc::Status::OK;
  }

  grpc::Status AttachLease(grpc::ServerContext* ctx, const pb::Lease* lease,
                           pb::AttachLeaseResponse*) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    if (role_ != PdRole::kDecode) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("AttachLease: this node's role is ", PdRoleName(role_),
                                       ", not decode"));
    }
    if (absl::Status s = CheckLeaseShape(*lease); !s.ok()) return ToGrpc(s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Idempotent, keyed by (transfer_id, incarnation): a repeated attach
      // (a retried RPC) is a no-op, not a second claim on the lease.
      for (const auto& a : attached_) {
        if (a->lease.transfer_id() == lease->transfer_id() &&
            a->lease.incarnation() == lease->incarnation()) {
          ++duplicate_attaches_;
          return grpc::Status::OK;
        }
      }
      // Out of blocks for good: this pool could never hold the pull (a
      // transiently full pool only delays admission; the engine waits).
      if (LeaseBlocks(*lease) > num_blocks_) {
        ++leases_refused_no_blocks_;
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("AttachLease: the lease has ", LeaseBlocks(*lease),
                         " KV blocks; this decode node's pool has ", num_blocks_));
      }
    }
    // The prefill node confirms the lease is held exactly as described (a
    // forged or altered one fails here) and restarts its ttl.
    absl::StatusOr<uint32_t> ttl = RemoteRenew(*lease);
    if (!ttl.ok()) return ToGrpc(ttl.status());
    if (absl::Status s = EnsurePeer(*lease); !s.ok()) {
      RemoteRelease(*lease, "decode could not connect");
      return ToGrpc(s);
    }
    auto a = std::make_shared<Attached>();
    a->lease = *lease;
    a->attached = a->received = PdClock::now();
    a->ttl = std::chrono::milliseconds(*ttl);
    {
      std::lock_guard<std::mutex> lock(mu_);
      attached_.push_back(std::move(a));
      ++leases_attached_;
    }
    return grpc::Status::OK;
  }

  // ---- KvLoader (engine thread) ----

  // Pulls write whole blocks from a block boundary (FindLease).
  bool RematchWholeBlocks() const override { return true; }

  int32_t Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                 int32_t limit) override {
    std::lock_guard<std::mutex> lock(mu_);
    int32_t end = 0;
    FindLease(salt, tokens, from, limit, &end);
    return end > from ? end - from : 0;
  }

  // The decode node's tiers supplied these tokens: the lease for them goes
  // back now (housekeeping releases it), not after its ttl.
  void Forgo(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
             int32_t limit) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      int32_t end = 0;
      std::shared_ptr<Attached> a = FindLease(salt, tokens, from, limit, &end);
      if (a == nullptr) return;
      a->forgone = true;
    }
    cv_.notify_all();
  }

  std::shared_ptr<KvLoad> Start(const KvLoadTarget& t) override {
    std::shared_ptr<Attached> a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      int32_t end = 0;
      a = FindLease(t.salt, t.tokens, t.first_slot, t.first_slot + t.num_tokens, &end);
      if (a == nullptr || end != t.first_slot + t.num_tokens || shutdown_) return nullptr;
      a->consumed = true;
    }
    auto job = std::make_shared<Job>();
    job->lease = a;
    job->first_block = t.first_slot / block_size_;
    const int32_t n_blocks = (t.first_slot + t.num_tokens) / block_size_ - job->first_block;
    const int32_t* ids = t.view.block_ids + t.view.seq_block_offsets[0];
    for (int32_t k = 0; k < n_blocks; ++k) job->local_ids.push_back(ids[job->first_block + k]);
    job->load = std::make_shared<PullLoad>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(job);
    }
    cv_.notify_all();
    return job->load;
  }

 private:
  static constexpr size_t kMaxLeaseBlocks = 1 << 16;

  // A progressive lease's prefill, as the prefill node follows it. Guarded
  // by mu_; `blocks` (one pool reference each) grows only on the engine
  // thread (Rematch), under mu_.
  struct Progress {
    uint64_t request_id = 0;
    std::vector<int32_t> tokens;  // the prompt's full blocks' tokens
    std::string salt;
    int32_t full_blocks = 0;
    std::vector<BlockHandle> blocks;  // pinned so far, in prompt order
    bool finished = false;            // the engine request ended
    bool final = false;               // ... and a re-match after that ran
    absl::Status error;               // the prefill failed: the lease is void
    bool rematch_pending = false;
    PdClock::time_point next_rematch;  // re-matches at most every 2 ms
    PdClock::time_point granted;
    bool released = false;
    bool early_freed = false;  // test hook: the blocks are gone, keep answering
  };
  struct Held {
    std::shared_ptr<KvPin> pin;  // whole leases; null once early-freed (test hook)
    int32_t held_blocks = 0;     // blocks pin holds
    uint64_t digest = 0;
    std::chrono::milliseconds ttl{0};
    PdClock::time_point expiry;
    std::shared_ptr<Progress> progress;  // progressive leases only
  };
  struct Attached {
    pb::Lease lease;
    PdClock::time_point attached;  // when AttachLease accepted it
    // At attach, then at each renewal: by housekeeping while no request has
    // claimed it, by the pull thread once one has. Guarded by mu_.
    PdClock::time_point received;
    std::chrono::milliseconds ttl{0};
    bool consumed = false;
    bool renewing = false;  // a housekeeping renewal is in flight (mu_)
    bool forgone = false;   // the decode node's own tiers supplied its tokens (mu_)
  };
  struct Job {
    std::shared_ptr<Attached> lease;
    int32_t first_block = 0;
    std::vector<int32_t> local_ids;
    std::shared_ptr<PullLoad> load;
  };
  struct Peer {
    kt::PeerId id = 0;
    kt::RemoteRegionId kv = 0, gen = 0;
  };

  // The P/D node's calls take the operator's key (tenant keys are the
  // front ends' business): Authenticator's rule and wording.
  grpc::Status Authorize(grpc::ServerContext* ctx) const {
    absl::StatusOr<CallerAuth> caller = AuthorizeGrpc(auth_, *ctx, true);
    return caller.ok() ? grpc::Status::OK : ToGrpc(caller.status());
  }

  // REQUIRES: mu_ held.
  grpc::Status CheckIncarnation(uint64_t incarnation, const char* what) const {
    if (incarnation == incarnation_) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat(what, ": stale incarnation ", incarnation, "; node ",
                                     node_id_, " is incarnation ", incarnation_,
                                     " (it restarted: the old leases are gone)"));
  }

  // Drops a lease's hold: its pinned blocks go back on the engine thread,
  // and a progressive lease's prefill, if still running, is cancelled (its
  // own blocks are freed with it). REQUIRES: mu_ held.
  void ReleaseHeld(Held* h) {
    if (Progress* p = h->progress.get(); p != nullptr && !p->released) {
      p->released = true;
      if (!p->finished && engine_ != nullptr) engine_->Cancel(p->request_id);
      if (!p->early_freed && !p->blocks.empty() && engine_ != nullptr) {
        // Its references (RematchEnd's pins; the block list stays for
        // answers in flight, which see `released` first).
        engine_->ReleaseBlocks(p->blocks);
      }
    }
    if (engine_ != nullptr) engine_->Unpin(std::move(h->pin));
    h->pin = nullptr;
  }

  // REQUIRES: mu_ held.
  void RememberGone(uint64_t id) {
    gone_.push_back(id);
    if (gone_.size() > 4096) gone_.pop_front();
  }

  // The blocks a lease covers: a progressive one's grow to its tokens'.
  int32_t LeaseBlocks(const pb::Lease& l) const {
    return l.progressive() ? l.tokens_size() / block_size_ : l.block_ids_size();
  }

  absl::Status CheckLeaseShape(const pb::Lease& l) const {
    if (l.transfer_id() == 0) return absl::InvalidArgumentError("lease.transfer_id: missing (0)");
    if (l.incarnation() == 0) return absl::InvalidArgumentError("lease.incarnation: missing (0)");
    if (l.grpc_address().empty()) {
      return absl::InvalidArgumentError("lease.grpc_address: empty");
    }
    if (l.block_ids_size() != l.generations_size()) {
      return absl::InvalidArgumentError(absl::StrCat("lease.generations: ", l.generations_size(),
                                                     " entries for ", l.block_ids_size(),
                                                     " block_ids"));
    }
    if (static_cast<size_t>(l.block_ids_size()) > kMaxLeaseBlocks ||
        static_cast<size_t>(l.tokens_size()) > kMaxLeaseBlocks * block_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.block_ids: ", std::max(l.block_ids_size(), LeaseBlocks(l)),
                       " blocks, at most ", kMaxLeaseBlocks));
    }
    if (const std::string d = KvLayoutDifference(layout_, l.layout()); !d.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "KV layout mismatch with prefill node ", l.node_id(), ": ", d));
    }
    if (!l.wire_dtype().empty()) {
      kernels::KvDType w;
      if (!kernels::ParseKvDType(l.wire_dtype(), &w)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lease.wire_dtype: unknown codec '", l.wire_dtype(), "'"));
      }
      if (l.wire_block_bytes() != kernels::KvBlockBytes(w, shape_)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lease.wire_block_bytes: ", l.wire_block_bytes(), " for ", l.wire_dtype(),
                         " blocks of this layout, which take ", kernels::KvBlockBytes(w, shape_)));
      }
      if (device_pool_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "prefill node ", l.node_id(), " sends blocks re-encoded as ", l.wire_dtype(),
            " (--kv-wire-dtype), which this decode node decodes on the host; its KV pool is "
            "in device memory"));
      }
    } else if (l.wire_block_bytes() != 0) {
      return absl::InvalidArgumentError("lease.wire_block_bytes: set without lease.wire_dtype");
    }
    if (l.progressive()) {
      // Tokens of whole blocks; the blocks known at the grant, at most those.
      if (l.tokens_size() % block_size_ != 0 || l.block_ids_size() > LeaseBlocks(l)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lease.tokens: ", l.tokens_size(), " tokens of a progressive lease with ",
                         l.block_ids_size(), " blocks of ", block_size_,
                         " known (whole blocks, at least the known ones)"));
      }
      if (!l.wire_dtype().empty()) {
        return absl::InvalidArgumentError(
            "lease.wire_dtype: a progressive lease moves the pool's own bytes");
      }
    } else if (l.tokens_size() != l.block_ids_size() * block_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.tokens: ", l.tokens_size(), " tokens for ", l.block_ids_size(),
                       " blocks of ", block_size_));
    }
    for (int i = 0; i < l.block_ids_size(); ++i) {
      // Block ids index the prefill node's pool, which has the same layout
      // but maybe another size; the transport checks the range exactly.
      if (l.block_ids(i) < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("lease.block_ids[", i, "]: negative id ", l.block_ids(i)));
      }
    }
    if (LeaseBlocks(l) > 0 && (l.ucx_address().empty() || l.kv_region().empty() ||
                                   l.generation_region().empty())) {
      return absl::InvalidArgumentError(
          "lease.ucx_address/kv_region/generation_region: empty");
    }
    return absl::OkStatus();
  }

  std::shared_ptr<pb::KvTransfer::Stub> StubFor(const std::string& address) {
    std::lock_guard<std::mutex> lock(stub_mu_);
    auto& s = stubs_[address];
    if (s == nullptr) {
      s = pb::KvTransfer::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    }
    return s;
  }

  void AddAuth(grpc::ClientContext* c) const {
    if (!api_key_.empty()) c->AddMetadata("authorization", "Bearer " + api_key_);
  }

  absl::StatusOr<uint32_t> RemoteRenew(const pb::Lease& l) {
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    // A prefill node restarted on the same address: wait out the channel's
    // reconnect backoff (within the deadline) instead of failing at once.
    c.set_wait_for_ready(true);
    pb::RenewLeaseResponse resp;
    grpc::Status s = StubFor(l.grpc_address())->RenewLease(&c, RenewRequestFor(l), &resp);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("prefill node ", l.node_id(), " (", l.grpc_address(),
                                       "): ", s.error_message()));
    }
    return resp.ttl_ms();
  }

  // A RenewLease for lease l: its id, incarnation, and our own digests of
  // what we received (a lease altered on the way, or made up, does not
  // match the grant the prefill node recorded).
  static pb::RenewLeaseRequest RenewRequestFor(const pb::Lease& l) {
    pb::RenewLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    r.set_digest(LeaseDigest(l));
    r.set_endpoint_digest(EndpointDigest(l));
    return r;
  }

  void RemoteRelease(const pb::Lease& l, const std::string& reason) {
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    pb::ReleaseLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    r.set_reason(reason);
    pb::ReleaseLeaseResponse resp;
    grpc::Status s = StubFor(l.grpc_address())->ReleaseLease(&c, r, &resp);
    if (!s.ok()) {
      spdlog::debug("pd: release of transfer {} at {}: {}", l.transfer_id(), l.grpc_address(),
                    s.error_message());
    }
  }

  static std::string PeerKey(const pb::Lease& l) {
    return absl::StrCat(l.node_id(), "#", l.incarnation());
  }

  absl::Status EnsurePeer(const pb::Lease& l) {
    if (LeaseBlocks(l) == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(peer_mu_);
    if (peers_.count(PeerKey(l)) > 0) return absl::OkStatus();
    Peer p;
    absl::StatusOr<kt::PeerId> id = transport_->Connect(l.ucx_address());
    if (!id.ok()) {
      return absl::UnavailableError(absl::StrCat("prefill node ", l.node_id(),
                                                 ": UCX connect: ", id.status().message()));
    }
    p.id = *id;
    absl::StatusOr<kt::RemoteRegionId> kv = transport_->ImportRegion(p.id, l.kv_region());
    absl::StatusOr<kt::RemoteRegionId> gen =
        kv.ok() ? transport_->ImportRegion(p.id, l.generation_region()) : kv;
    if (!kv.ok() || !gen.ok()) {
      (void)transport_->Disconnect(p.id);
      return absl::InvalidArgumentError(
          absl::StrCat("lease.kv_region/generation_region of prefill node ", l.node_id(), ": ",
                       (kv.ok() ? gen : kv).status().message()));
    }
    p.kv = *kv;
    p.gen = *gen;
    peers_[PeerKey(l)] = p;
    return absl::OkStatus();
  }

  void DropPeer(const pb::Lease& l) {
    std::lock_guard<std::mutex> lock(peer_mu_);
    auto it = peers_.find(PeerKey(l));
    if (it == peers_.end()) return;
    (void)transport_->ReleaseRemoteRegion(it->second.kv);
    (void)transport_->ReleaseRemoteRegion(it->second.gen);
    (void)transport_->Disconnect(it->second.id);
    peers_.erase(it);
  }

  // REQUIRES: mu_ held. The unconsumed lease that supplies the most tokens
  // of tokens[from, limit) (whole blocks from a block boundary: a pull
  // writes whole blocks, and a block the sequence shares is never written);
  // *end is the slot its supply ends at.
  std::shared_ptr<Attached> FindLease(std::string_view salt, absl::Span<const int32_t> tokens,
                                      int32_t from, int32_t limit, int32_t* end) {
    *end = 0;
    if (block_size_ <= 0 || from % block_size_ != 0) return nullptr;
    std::shared_ptr<Attached> best;
    for (const auto& a : attached_) {
      if (a->consumed || a->lease.cache_salt() != salt) continue;
      int32_t e = std::min<int32_t>(a->lease.tokens_size(), limit);
      e = std::min<int32_t>(e, static_cast<int32_t>(tokens.size()));
      e -= e % block_size_;
      if (e <= from || e <= *end) continue;
      if (!std::equal(tokens.begin(), tokens.begin() + e, a->lease.tokens().begin())) continue;
      best = a;
      *end = e;
    }
    return best;
  }

  // Keeps a lease alive through a long pull: once a third of its ttl has
  // passed since the last renewal, the prefill node renews it. A refused
  // renewal (released, expired, restarted node) fails the pull.
  absl::Status KeepAlive(Attached* a) {
    const auto now = PdClock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (now < a->received + a->ttl / 3) return absl::OkStatus();
    }
    absl::StatusOr<uint32_t> ttl = RemoteRenew(a->lease);
    if (!ttl.ok()) {
      return absl::Status(ttl.status().code(),
                          absl::StrCat("lease renewal during the pull of transfer ",
                                       a->lease.transfer_id(), ": ", ttl.status().message()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    a->received = now;
    a->ttl = std::chrono::milliseconds(*ttl);
    ++lease_renewals_;
    return absl::OkStatus();
  }

  // Waits for transfer t until `deadline`, renewing the lease meanwhile.
  // A failed or timed-out transfer is cancelled and drained (the backend no
  // longer touches our blocks) before this returns.
  absl::Status WaitDrained(kt::TransferId t, Attached* a, PdClock::time_point deadline) {
    absl::Status s;
    for (;;) {
      const auto now = PdClock::now();
      if (now >= deadline) {
        s = absl::DeadlineExceededError(
            absl::StrCat("the pull took longer than --pd-transfer-timeout ",
                         flags_.transfer_timeout, " s"));
        break;
      }
      const auto slice = std::min<PdClock::duration>(deadline - now, std::chrono::milliseconds(100));
      s = transport_->Wait(t, absl::FromChrono(slice));
      if (!absl::IsDeadlineExceeded(s)) break;
      absl::StatusOr<bool> moving = transport_->Poll(t);
      if (!moving.ok()) {
        s = moving.status();  // the transfer itself failed (timed out, peer gone)
        break;
      }
      if (*moving) {
        s = absl::OkStatus();
        break;
      }
      s = KeepAlive(a);
      if (!s.ok()) break;
    }
    if (!s.ok()) {
      // A failed transfer has not necessarily stopped: cancel and wait
      // until the backend no longer touches our blocks before they go back.
      (void)transport_->Cancel(t);
      for (;;) {
        absl::StatusOr<bool> p = transport_->Poll(t);
        if (!p.ok() || *p) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    (void)transport_->ReleaseTransfer(t);
    return s;
  }

  // What a pull reports besides its status.
  struct PullStats {
    int32_t overlapped = 0;  // blocks read while the lease's prefill still ran
    PdClock::time_point complete_at{};  // when every block of the lease was known
    double active = 0;  // seconds spent reading (data and fence), not waiting on the prefill
  };

  // A progressive lease's blocks past the first `have`, as the prefill node
  // reports them (RenewLease with progress, which also renews the lease).
  struct ProgressAnswer {
    std::vector<int32_t> block_ids;
    std::vector<uint32_t> generations;
    bool complete = false;
  };
  absl::StatusOr<ProgressAnswer> RemoteProgress(Attached* a, int32_t have, uint32_t wait_ms) {
    const pb::Lease& l = a->lease;
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms) +
                   std::chrono::seconds(3));
    pb::RenewLeaseRequest r = RenewRequestFor(l);
    r.set_progress(true);
    r.set_have_blocks(have);
    r.set_wait_ms(wait_ms);
    pb::RenewLeaseResponse resp;
    const auto sent = PdClock::now();
    grpc::Status s = StubFor(l.grpc_address())->RenewLease(&c, r, &resp);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("progress of transfer ", l.transfer_id(), " from prefill node ",
                                       l.node_id(), " (", l.grpc_address(), "): ",
                                       s.error_message()));
    }
    if (resp.block_ids_size() != resp.generations_size() ||
        have + resp.block_ids_size() > l.tokens_size() / block_size_) {
      return absl::InternalError(absl::StrCat("progress of transfer ", l.transfer_id(), ": ",
                                              resp.block_ids_size(), " blocks past ", have,
                                              " for a lease of ", l.tokens_size() / block_size_));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      a->received = sent;
      a->ttl = std::chrono::milliseconds(resp.ttl_ms());
    }
    ProgressAnswer out;
    out.block_ids.assign(resp.block_ids().begin(), resp.block_ids().end());
    out.generations.assign(resp.generations().begin(), resp.generations().end());
    out.complete = resp.complete();
    return out;
  }

  // GETs the job's blocks [k0, k1) from the prefill node's blocks `remote`
  // (indexed by lease block) into their places: the pool's blocks, or in
  // order into the wire staging buffer.
  absl::Status ReadBlocks(const Job& job, const Peer& peer, const std::vector<int32_t>& remote,
                          int32_t k0, int32_t k1, bool wire, uint64_t read_bytes,
                          PdClock::time_point deadline) {
    const kt::RegionId local_region = wire ? wire_staging_.id : kv_region_.id;
    std::vector<kt::TransferOp> ops;
    for (int32_t k = k0; k < k1; ++k) {
      const uint64_t local = wire ? static_cast<uint64_t>(k) * read_bytes
                                  : static_cast<uint64_t>(job.local_ids[k]) * block_bytes_;
      const uint64_t rem = static_cast<uint64_t>(remote[job.first_block + k]) * read_bytes;
      if (!ops.empty() && ops.back().local_offset + ops.back().length == local &&
          ops.back().remote_offset + ops.back().length == rem) {
        ops.back().length += read_bytes;  // contiguous on both sides: one op
        continue;
      }
      ops.push_back({local_region, local, peer.kv, rem, read_bytes});
    }
    absl::StatusOr<kt::TransferId> t = transport_->PostTransfer(peer.id, kt::Direction::kRead, ops);
    if (!t.ok()) return t.status();
    return WaitDrained(*t, job.lease.get(), deadline);
  }

  absl::Status Pull(const Job& job, PullStats* st) {
    const pb::Lease& l = job.lease->lease;
    Attached* a = job.lease.get();
    if (flags_.test_pull_delay > 0) {
      // Test hook (--pd-test-pull-delay): a link slower than the lease's
      // ttl. The lease must stay alive meanwhile (not counted against
      // --pd-transfer-timeout).
      const auto until = PdClock::now() + std::chrono::duration_cast<PdClock::duration>(
                                              std::chrono::duration<double>(flags_.test_pull_delay));
      while (PdClock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        RETURN_IF_ERROR(KeepAlive(a));
      }
    }
    const auto timeout = std::chrono::duration_cast<PdClock::duration>(
        std::chrono::duration<double>(flags_.transfer_timeout));
    auto deadline = PdClock::now() + timeout;
    RETURN_IF_ERROR(KeepAlive(a));
    PdClock::time_point received;
    std::chrono::milliseconds ttl;
    {
      std::lock_guard<std::mutex> lock(mu_);
      received = a->received;
      ttl = a->ttl;
    }
    const auto margin = std::chrono::milliseconds(std::min<int64_t>(2000, ttl.count() / 4));
    if (PdClock::now() > received + ttl - margin) {
      return absl::DeadlineExceededError(
          absl::StrCat("lease of transfer ", l.transfer_id(), " too close to expiry to pull"));
    }
    Peer peer;
    {
      std::lock_guard<std::mutex> lock(peer_mu_);
      auto it = peers_.find(PeerKey(l));
      if (it == peers_.end()) {
        return absl::UnavailableError(absl::StrCat("no UCX endpoint to prefill node ",
                                                   l.node_id()));
      }
      peer = it->second;
    }
    const int32_t n = static_cast<int32_t>(job.local_ids.size());
    // Blocks re-encoded on the wire land in a staging buffer, in order, and
    // are decoded into the pool once the fence passed; others land in the
    // pool's blocks directly.
    kernels::KvDType wire_dtype = pool_dtype_;
    const bool wire = !l.wire_dtype().empty() && kernels::ParseKvDType(l.wire_dtype(), &wire_dtype);
    const uint64_t read_bytes = static_cast<uint64_t>(MovedBlockBytes(l));
    if (wire) RETURN_IF_ERROR(EnsureWireStaging(static_cast<size_t>(n) * read_bytes));
    // The lease's blocks as far as known: all of a whole lease's; a
    // progressive lease's grow as its prefill commits them, and each is read
    // as soon as it is known while the prefill computes the rest.
    std::vector<int32_t> remote(l.block_ids().begin(), l.block_ids().end());
    std::vector<uint32_t> gens(l.generations().begin(), l.generations().end());
    bool complete = !l.progressive();
    if (complete) st->complete_at = PdClock::now();
    const int32_t end = job.first_block + n;
    for (int32_t done = 0; done < n;) {
      const int32_t known = std::min<int32_t>(static_cast<int32_t>(remote.size()), end) -
                            job.first_block;
      if (known > done) {
        if (!complete) deadline = PdClock::now() + timeout;  // per read while it overlaps
        const auto r0 = PdClock::now();
        RETURN_IF_ERROR(ReadBlocks(job, peer, remote, done, known, wire, read_bytes, deadline));
        st->active += std::chrono::duration<double>(PdClock::now() - r0).count();
        if (!complete) st->overlapped += known - done;
        done = known;
        continue;
      }
      if (complete) {
        return absl::InternalError(absl::StrCat("transfer ", l.transfer_id(), ": the lease holds ",
                                                remote.size(), " blocks; the pull needs ", end));
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (shutdown_) return absl::UnavailableError("the node is shutting down");
      }
      // The prefill is still running: wait for its next committed blocks.
      // Each answer proves the prefill node alive and renews the lease; a
      // dead or stopped node fails the call within its deadline, a failed
      // prefill answers an error, and the prefill node gives a prefill 120 s.
      ASSIGN_OR_RETURN(ProgressAnswer pr,
                       RemoteProgress(a, static_cast<int32_t>(remote.size()), 200));
      remote.insert(remote.end(), pr.block_ids.begin(), pr.block_ids.end());
      gens.insert(gens.end(), pr.generations.begin(), pr.generations.end());
      if (pr.complete) {
        complete = true;
        st->complete_at = PdClock::now();
        deadline = st->complete_at + timeout;
      }
    }
    if (!complete) {
      // Every block this pull needs is in, but not the lease's last ones
      // (the decode node held some of the prompt itself): the fence below
      // still applies; the time after this point is what the request waits.
      st->complete_at = PdClock::now();
    }
    // The fence: only now, after every data read completed, read the
    // generations. A block freed at any time since the grant has advanced.
    // Progressive pulls run on threads of their own: their own buffer.
    kt::LocalRegion own_gen;
    if (l.progressive()) {
      ASSIGN_OR_RETURN(own_gen, transport_->AllocateRegion(static_cast<size_t>(std::max(n, 1)) * 4));
    }
    const kt::LocalRegion& gen_buf = l.progressive() ? own_gen : gen_buffer_;
    const auto f0 = PdClock::now();
    absl::Status fenced = [&]() -> absl::Status {
      std::vector<kt::TransferOp> gops;
      for (int32_t k = 0; k < n; ++k) {
        gops.push_back({gen_buf.id, static_cast<uint64_t>(k) * 4, peer.gen,
                        static_cast<uint64_t>(remote[job.first_block + k]) * 4, 4});
      }
      absl::StatusOr<kt::TransferId> t =
          transport_->PostTransfer(peer.id, kt::Direction::kRead, gops);
      if (!t.ok()) return t.status();
      RETURN_IF_ERROR(WaitDrained(*t, a, deadline));
      const auto* got = static_cast<const uint32_t*>(gen_buf.address);
      int32_t changed = 0;
      std::string first;
      for (int32_t k = 0; k < n; ++k) {
        const uint32_t want = gens[job.first_block + k];
        if (got[k] != want) {
          if (changed++ == 0) {
            first = absl::StrCat("block ", remote[job.first_block + k], " generation ", want,
                                 " -> ", got[k]);
          }
        }
      }
      if (changed > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        ++generation_mismatches_;
        return absl::DataLossError(absl::StrCat(
            "transfer ", l.transfer_id(), ": ", changed, " of ", n,
            " leased blocks were freed on the prefill node during the pull (", first,
            "); their KV is not committed"));
      }
      return absl::OkStatus();
    }();
    if (own_gen.address != nullptr) (void)transport_->DeregisterRegion(own_gen.id);
    st->active += std::chrono::duration<double>(PdClock::now() - f0).count();
    RETURN_IF_ERROR(fenced);
    if (wire) {
      const auto* staged = static_cast<const uint8_t*>(wire_staging_.address);
      for (int32_t k = 0; k < n; ++k) {
        kernels::TranscodeKvBlock(
            shape_, wire_dtype, staged + static_cast<uint64_t>(k) * read_bytes, pool_dtype_,
            pool_bytes_ + static_cast<int64_t>(job.local_ids[k]) * block_bytes_);
      }
      std::lock_guard<std::mutex> lock(mu_);
      wire_blocks_ += n;
    }
    return absl::OkStatus();
  }

  // Bytes one of the lease's blocks moves as: the pool's block, or its
  // re-encoded copy (--kv-wire-dtype on the prefill node).
  int64_t MovedBlockBytes(const pb::Lease& l) const {
    return l.wire_dtype().empty() ? block_bytes_ : l.wire_block_bytes();
  }

  // Pull thread: a staging buffer for re-encoded blocks of at least
  // `bytes`, grown (re-registered) when a lease needs more.
  absl::Status EnsureWireStaging(size_t bytes) {
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

  // Whole leases are pulled one after another on the pull thread; a
  // progressive lease waits on its prefill, so it gets a thread of its own
  // (counted in progressive_pulls_; Shutdown waits for them).
  void PullLoop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return shutdown_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // shutdown with nothing left
        job = jobs_.front();
        jobs_.pop_front();
        if (job->lease->lease.progressive()) ++progressive_pulls_;
      }
      if (job->lease->lease.progressive()) {
        std::thread([this, job] {
          RunJob(*job);
          std::lock_guard<std::mutex> lock(mu_);
          --progressive_pulls_;
          cv_.notify_all();
        }).detach();
      } else {
        RunJob(*job);
      }
    }
  }

  void RunJob(const Job& job) {
    const auto t0 = PdClock::now();
    PullStats st;
    absl::Status s = Pull(job, &st);
    const auto t1 = PdClock::now();
    // A progressive pull's wall time is mostly its prefill's: its rate (and
    // pull_seconds, which routers divide bytes by) counts only the reads.
    const double secs = job.lease->lease.progressive()
                            ? st.active
                            : std::chrono::duration<double>(t1 - t0).count();
    const pb::Lease& pl = job.lease->lease;
    const int64_t moved = static_cast<int64_t>(job.local_ids.size()) * MovedBlockBytes(pl);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (s.ok()) {
        const double exposed =
            std::chrono::duration<double>(t1 - std::max(st.complete_at, t0)).count();
        // One line per transfer: bench/pd/run.sh reads the pull rate from it.
        spdlog::info("pd: transfer {}: pulled {} blocks, {} bytes in {:.3f} ms ({:.1f} MB/s){}{}",
                     pl.transfer_id(), job.local_ids.size(), moved, secs * 1e3,
                     static_cast<double>(moved) / 1e6 / std::max(secs, 1e-9),
                     pl.wire_dtype().empty() ? "" : absl::StrCat(", as ", pl.wire_dtype()),
                     pl.progressive()
                         ? absl::StrFormat("; progressive: %d blocks during the prefill, "
                                           "%.3f ms after it, %.3f ms from the lease to done",
                                           st.overlapped, exposed * 1e3,
                                           std::chrono::duration<double>(t1 - t0).count() * 1e3)
                         : "");
        ++transfers_ok_;
        blocks_pulled_ += static_cast<int64_t>(job.local_ids.size());
        bytes_pulled_ += moved;
        pull_seconds_ += secs;
        overlapped_blocks_ += st.overlapped;
        exposed_pull_seconds_ += exposed;
      } else {
        ++transfers_failed_;
      }
      attached_.erase(std::remove(attached_.begin(), attached_.end(), job.lease), attached_.end());
    }
    if (!s.ok()) {
      spdlog::warn("pd: pull of transfer {} from {} failed, recomputing locally: {}",
                   pl.transfer_id(), pl.node_id(), s.ToString());
      // A transport failure (dead or wedged peer): reconnect next time. Not
      // for a fenced block or a prefill that failed or was released: the
      // peer itself is fine.
      if (s.code() != absl::StatusCode::kDataLoss && s.code() != absl::StatusCode::kAborted &&
          s.code() != absl::StatusCode::kNotFound) {
        DropPeer(pl);
      }
    }
    // The blocks are ours alone again; decoded wire blocks are lossy.
    job.load->Finish(s, s.ok() && !pl.wire_dtype().empty()
                            ? static_cast<int32_t>(job.local_ids.size()) * block_size_
                            : 0);
    RemoteRelease(pl, s.ok() ? "committed" : "failed");
  }

  // Renews the unclaimed attached leases a third of whose ttl has passed
  // (at most --pd-admission-wait after their attach). A refused renewal
  // (the prefill node let it go or restarted) drops the lease: its request
  // recomputes. REQUIRES: *lock holds mu_; released around the RPCs.
  void RenewWaitingLeases(std::unique_lock<std::mutex>* lock, PdClock::time_point now) {
    const auto max_wait = std::chrono::duration_cast<PdClock::duration>(
        std::chrono::duration<double>(flags_.admission_wait));
    std::vector<std::shared_ptr<Attached>> due;
    for (const auto& a : attached_) {
      if (!a->consumed && !a->renewing && now >= a->received + a->ttl / 3 &&
          now < a->attached + max_wait) {
        a->renewing = true;
        due.push_back(a);
      }
    }
    if (due.empty()) return;
    lock->unlock();
    std::vector<absl::StatusOr<uint32_t>> ttls;
    for (const auto& a : due) ttls.push_back(RemoteRenew(a->lease));
    lock->lock();
    for (size_t i = 0; i < due.size(); ++i) {
      Attached* a = due[i].get();
      a->renewing = false;
      if (ttls[i].ok()) {
        a->received = now;
        a->ttl = std::chrono::milliseconds(*ttls[i]);
        ++lease_renewals_;
        ++admission_renewals_;
      } else if (!a->consumed) {
        spdlog::info("pd: lease of transfer {} could not be renewed while its request waits "
                     "for admission ({}); it will be recomputed",
                     a->lease.transfer_id(), ttls[i].status().ToString());
        attached_.erase(std::remove(attached_.begin(), attached_.end(), due[i]),
                        attached_.end());
      }
    }
  }

  void HousekeepingLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!shutdown_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (shutdown_) break;
      const auto now = PdClock::now();
      for (auto it = held_.begin(); it != held_.end();) {
        if (now < it->second.expiry) {
          ++it;
          continue;
        }
        spdlog::info("pd: lease of transfer {} expired unreleased; freeing {} blocks", it->first,
                     it->second.pin ? it->second.held_blocks : 0);
        ReleaseHeld(&it->second);
        RememberGone(it->first);
        ++leases_expired_;
        it = held_.erase(it);
      }
      // Decode: while requests wait for admission (the pool or the seats
      // are full for now), an attached lease may belong to one of them:
      // renew it rather than let it lapse into a recompute, up to
      // --pd-admission-wait from its attach.
      if (role_ == PdRole::kDecode && !attached_.empty()) {
        lock.unlock();
        const int32_t waiting = engine_ != nullptr ? engine_->Stats().waiting : 0;
        lock.lock();
        if (waiting > 0) RenewWaitingLeases(&lock, now);
        if (shutdown_) break;
      }
      // Decode: leases no request claimed within their ttl go back.
      std::vector<std::shared_ptr<Attached>> unused;
      for (auto it = attached_.begin(); it != attached_.end();) {
        if (!(*it)->consumed && !(*it)->renewing &&
            ((*it)->forgone || now > (*it)->received + (*it)->ttl)) {
          unused.push_back(*it);
          it = attached_.erase(it);
        } else {
          ++it;
        }
      }
      leases_unused_ += static_cast<int64_t>(unused.size());
      if (!unused.empty()) {
        lock.unlock();
        for (const auto& a : unused) {
          RemoteRelease(a->lease, a->forgone ? "served from the decode node's KV tiers" : "unused");
        }
        lock.lock();
      }
    }
  }

  const PdFlags flags_;
  const PdRole role_;
  const std::string fingerprint_;
  const std::string api_key_;
  const Authenticator auth_;  // api_key_'s check of incoming calls
  const uint64_t incarnation_;
  Engine* engine_ = nullptr;
  ModelService* service_ = nullptr;
  pb::KvLayout layout_;
  int32_t block_size_ = 0;
  int64_t block_bytes_ = 0;
  int32_t num_blocks_ = 0;

  std::unique_ptr<kt::Transport> transport_;
  kernels::KvDType pool_dtype_ = kernels::KvDType::kF16;
  kernels::KvBlockShape shape_;
  uint8_t* pool_bytes_ = nullptr;  // host pools: the blocks (null on the device)
  // Prefill, --kv-wire-dtype: kv_region_ holds the re-encoded copies.
  bool wire_ = false;
  kernels::KvDType wire_dtype_ = kernels::KvDType::kF16;
  int64_t wire_block_bytes_ = 0;
  std::mutex wire_mu_;
  std::vector<int64_t> wire_gen_;  // guarded by wire_mu_: generation each copy holds (-1: none)
  // Decode: where re-encoded blocks land before they are decoded (pull thread).
  kt::LocalRegion wire_staging_;
  bool device_pool_ = false;  // the KV pool is CUDA memory
  bool staged_ = false;       // ... moved through host staging buffers
  std::string ucx_address_, kv_descriptor_, gen_descriptor_;
  kt::LocalRegion kv_region_, gen_region_, gen_buffer_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool shutdown_ = false;                 // guarded by mu_
  std::string node_id_, grpc_address_, http_address_;  // guarded by mu_
  std::map<uint64_t, Held> held_;         // prefill: leases, guarded by mu_
  std::deque<uint64_t> gone_;             // prefill: released/expired ids, guarded by mu_
  std::vector<std::shared_ptr<Attached>> attached_;  // decode, guarded by mu_
  std::deque<std::shared_ptr<Job>> jobs_;            // decode, guarded by mu_
  int64_t leases_granted_ = 0, leases_released_ = 0, leases_expired_ = 0;
  int64_t duplicate_releases_ = 0, stale_releases_ = 0, early_frees_ = 0;
  int64_t transfers_ok_ = 0, transfers_failed_ = 0, generation_mismatches_ = 0;
  int64_t blocks_pulled_ = 0, bytes_pulled_ = 0, leases_attached_ = 0, leases_unused_ = 0;
  int64_t duplicate_attaches_ = 0;
  int64_t admission_renewals_ = 0;  // of lease_renewals_, while requests waited to be admitted
  int64_t lease_renewals_ = 0, leases_refused_no_blocks_ = 0, forged_endpoints_ = 0;
  double pull_seconds_ = 0;
  int64_t staged_blocks_ = 0;
  int64_t progressive_leases_ = 0, progress_answers_ = 0;  // prefill
  int64_t overlapped_blocks_ = 0;                         // decode
  int32_t progressive_pulls_ = 0;  // decode: pull threads of progressive leases running
  double exposed_pull_seconds_ = 0;                       // decode
  int64_t wire_blocks_ = 0;  // re-encoded (prefill) or decoded (decode) for the wire  // prefill,
                             // staged device pool: blocks synced to staging

  std::mutex peer_mu_;
  std::map<std::string, Peer> peers_;  // guarded by peer_mu_
  std::mutex stub_mu_;
  std::map<std::string, std::shared_ptr<pb::KvTransfer::Stub>> stubs_;  // guarded by stub_mu_

  std::thread housekeeping_, pull_thread_;
};

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
