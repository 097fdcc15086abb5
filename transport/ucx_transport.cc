#include "transport/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <unistd.h>

#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status.h"
#include "spdlog/spdlog.h"
#include "transport/descriptor.h"

namespace kvserve::transport {
namespace {

constexpr char kUcxName[] = "ucx";
// Active-message id of batch-completion notifications.
constexpr unsigned kNotifyAmId = 0x4b;

absl::Status UcsError(ucs_status_t status, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", ucs_status_string(status)));
}

std::string DurationToUcx(absl::Duration d) {
  return absl::StrCat(absl::ToInt64Microseconds(d), "us");
}

// A byte range of one of our own regions, named by handle; carried in
// notifications so the target copies staged bytes to the device.
struct RangeRef {
  RegionId region;
  uint64_t offset;
  uint64_t length;
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(UcxTransportOptions options)
      : options_(std::move(options)) {
    if (!options_.device_copier) {
      options_.device_copier = std::make_shared<HostStandInCopier>();
    }
    std::random_device rd;
    agent_id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  ~UcxTransport() override { Shutdown(); }

  absl::Status Init();

  Capabilities GetCapabilities() const override { return capabilities_; }
  absl::StatusOr<std::string> LocalAddress() override { return packed_address_; }

  absl::StatusOr<LocalRegion> RegisterRegion(void* address, size_t length,
                                             MemoryKind kind) override {
    return RunOnWorker([&] { return DoRegister(address, length, kind); });
  }
  absl::StatusOr<LocalRegion> AllocateRegion(size_t length) override {
    return RunOnWorker(
        [&] { return DoRegister(nullptr, length, MemoryKind::kHost); });
  }
  absl::Status DeregisterRegion(RegionId region) override {
    return RunOnWorker([&] { return DoDeregister(region); });
  }
  absl::StatusOr<std::string> DescribeRegion(RegionId region) override {
    return RunOnWorker([&] { return DoDescribe(region); });
  }
  absl::Status SyncStagingFromDevice(RegionId region, uint64_t offset, uint64_t length) override;
  absl::StatusOr<PeerId> Connect(absl::string_view peer_address) override {
    return RunOnWorker([&] { return DoConnect(peer_address); });
  }
  absl::Status Disconnect(PeerId peer) override {
    return RunOnWorker([&] { return DoDisconnect(peer); });
  }
  absl::StatusOr<RemoteRegionId> ImportRegion(
      PeerId peer, absl::string_view descriptor) override {
    return RunOnWorker([&] { return DoImport(peer, descriptor); });
  }
  absl::Status ReleaseRemoteRegion(RemoteRegionId region) override {
    return RunOnWorker([&] { return DoReleaseRemote(region); });
  }
  absl::StatusOr<TransferId> PostTransfer(
      PeerId peer, Direction direction, absl::Span<const TransferOp> ops,
      absl::string_view notification) override {
    return RunOnWorker(
        [&] { return DoPost(peer, direction, ops, notification); });
  }
  absl::StatusOr<bool> Poll(TransferId transfer) override;
  absl::Status Wait(TransferId transfer, absl::Duration timeout) override;
  absl::Status Cancel(TransferId transfer) override {
    return RunOnWorker([&] { return DoCancel(transfer); });
  }
  absl::Status ReleaseTransfer(TransferId transfer) override;
  std::vector<Notification> TakeNotifications() override;
  absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) override;

 private:
  struct Region {
    LocalRegion info;    // what the caller sees (device address if staged)
    ucp_mem_h memh = nullptr;
    bool staged = false;
    void* wire_address = nullptr;  // registered bytes: staging if staged
    std::string rkey;              // packed once
    int users = 0;                 // pending transfers using it
  };
  struct Peer {
    std::string name;
    ucp_ep_h ep = nullptr;
    absl::Status failure;  // non-OK once the peer is dead
    int pending = 0;
    absl::flat_hash_set<RemoteRegionId> remote_regions;
    // Set when this peer runs on our host and PID namespace: liveness is
    // checked through /proc, for transports (posix, sysv) without UCX peer
    // failure support.
    uint64_t pid = 0;
    uint64_t start_time = 0;
    uint64_t agent_id = 0;  // descriptors must come from this agent
    // Argument of the endpoint error handler; heap-held so its address stays
    // put while peers_ rehashes.
    std::unique_ptr<std::pair<UcxTransport*, PeerId>> error_arg;
  };
  struct RemoteRegion {
    PeerId peer;
    RegionDescriptor descriptor;
    ucp_rkey_h rkey = nullptr;
  };
  // kDone: every step issued and completed; kFinished: Finish() ran.
  enum class Phase { kOps, kFlush, kNotify, kDone, kFinished };
  struct Transfer {
    TransferId id;
    PeerId peer;
    Direction direction;
    Phase phase = Phase::kOps;
    absl::Status error;  // first error seen
    bool cancelled = false;
    absl::Time deadline;
    absl::flat_hash_set<void*> outstanding;  // live UCX requests
    std::vector<RegionId> local_regions;     // refs to drop when done
    std::vector<RangeRef> staged_reads;      // local staging -> device on done
    std::string notify_message;              // AM body; must outlive the send
    bool notify = false;
    // Guarded by owner->mu_: read by API threads.
    bool done = false;
    absl::Status final_status;
    UcxTransport* owner;
  };

  template <typename F>
  auto RunOnWorker(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    std::optional<R> result;
    absl::Notification finished;
    {
      absl::MutexLock lock(&cmd_mu_);
      if (stopping_) return R(absl::CancelledError("transport is shutting down"));
      commands_.push_back([&] {
        result.emplace(fn());
        finished.Notify();
      });
    }
    finished.WaitForNotification();
    return *std::move(result);
  }

  void ProgressLoop();
  void Shutdown();

  absl::StatusOr<LocalRegion> DoRegister(void* address, size_t length,
                                         MemoryKind kind);
  absl::Status DoDeregister(RegionId region);
  absl::StatusOr<std::string> DoDescribe(RegionId region);
  absl::StatusOr<PeerId> DoConnect(absl::string_view blob);
  absl::Status DoDisconnect(PeerId peer);
  absl::StatusOr<RemoteRegionId> DoImport(PeerId peer,
                                          absl::string_view descriptor);
  absl::Status DoReleaseRemote(RemoteRegionId region);
  absl::StatusOr<TransferId> DoPost(PeerId peer, Direction direction,
                                    absl::Span<const TransferOp> ops,
                                    absl::string_view notification);
  absl::Status DoCancel(TransferId transfer);

  absl::StatusOr<ucp_mem_h> MapMemory(void* address, size_t length,
                                      ucs_memory_type_t type);
  void UnmapRegion(Region& region);
  // Runs the worker until `request` (a UCX status pointer) completes.
  ucs_status_t WaitRequest(ucs_status_ptr_t request);
  void CloseEndpoint(Peer& peer, bool force);

  bool MayUseSharedMemory() const {
    const std::string& tls = capabilities_.transports;
    for (const char* shm : {"all", "posix", "sysv", "shm", "sm", "mm"}) {
      if (tls.find(shm) != std::string::npos) return true;
    }
    return false;
  }
  void Advance(Transfer* t);
  void Finish(Transfer* t);
  void FailPeer(PeerId peer_id, absl::Status why);
  void CheckDeadlines();
  void ProcessDeferredFailures();

  static void OnRequestDone(void* request, ucs_status_t status,
                            void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnNotify(void* arg, const void* header,
                               size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  void HandleNotify(const char* data, size_t length);

  UcxTransportOptions options_;
  uint64_t agent_id_ = 0;
  Capabilities capabilities_;
  bool cuda_direct_ = false;
  std::string packed_address_;
  std::string local_host_id_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::thread progress_thread_;

  absl::Mutex cmd_mu_;
  std::deque<std::function<void()>> commands_ ABSL_GUARDED_BY(cmd_mu_);
  bool stopping_ ABSL_GUARDED_BY(cmd_mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(cmd_mu_) = false;

  // Owned by the progress thread.
  uint64_t next_id_ = 1;
  absl::flat_hash_map<RegionId, Region> regions_;
  absl::flat_hash_map<PeerId, Peer> peers_;
  absl::flat_hash_map<RemoteRegionId, RemoteRegion> remote_regions_;
  absl::flat_hash_map<TransferId, Transfer*> active_;  // not yet finished
  std::vector<std::pair<PeerId, absl::Status>> deferred_failures_;
  absl::Time next_deadline_check_ = absl::InfinitePast();
  absl::Time next_liveness_check_ = absl::InfinitePast();

  // Shared with API threads.
  absl::Mutex mu_;
  absl::flat_hash_map<TransferId, std::shared_ptr<Transfer>> transfers_
      ABSL_GUARDED_BY(mu_);
  std::deque<Notification> notifications_ ABSL_GUARDED_BY(mu_);
  // Finished transfers whose UCX requests never completed (dead peer).
  std::vector<std::shared_ptr<Transfer>> abandoned_ ABSL_GUARDED_BY(mu_);
};

absl::Status UcxTransport::Init() {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsError(st, "ucp_config_read");
  auto modify = [&](const char* key, const std::string& value) -> absl::Status {
    if (value.empty()) return absl::OkStatus();
    ucs_status_t s = ucp_config_modify(config, key, value.c_str());
    if (s != UCS_OK) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX option ", key, "=", value, ": ", ucs_status_string(s)));
    }
    return absl::OkStatus();
  };
  absl::Status config_status = modify("TLS", options_.tls);
  if (config_status.ok()) {
    config_status = modify("NET_DEVICES", options_.net_devices);
  }
  if (config_status.ok()) {
    config_status = modify("KEEPALIVE_INTERVAL",
                           DurationToUcx(options_.keepalive_interval));
  }
  if (!config_status.ok()) {
    ucp_config_release(config);
    return config_status;
  }

  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  params.name = options_.name.c_str();
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) return UcsError(st, "ucp_init (check UCX_TLS)");

  ucp_context_attr_t attr = {};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  st = ucp_context_query(context_, &attr);
  if (st != UCS_OK) return UcsError(st, "ucp_context_query");
  cuda_direct_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0 &&
                 !options_.force_cuda_staging;

  ucp_worker_params_t wparams = {};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Only the progress thread ever touches the worker.
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) return UcsError(st, "ucp_worker_create");

  ucp_am_handler_param_t am = {};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                  UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kNotifyAmId;
  am.cb = &UcxTransport::OnNotify;
  am.arg = this;
  st = ucp_worker_set_am_recv_handler(worker_, &am);
  if (st != UCS_OK) return UcsError(st, "ucp_worker_set_am_recv_handler");

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(worker_, &address, &address_length);
  if (st != UCS_OK) return UcsError(st, "ucp_worker_get_address");
  PeerAddress peer_address;
  peer_address.backend = kUcxName;
  peer_address.agent_id = agent_id_;
  peer_address.name = options_.name;
  peer_address.address.assign(reinterpret_cast<const char*>(address),
                              address_length);
  peer_address.host_id = LocalHostId();
  peer_address.pid = static_cast<uint64_t>(getpid());
  peer_address.start_time = ProcessStartTime(peer_address.pid);
  local_host_id_ = peer_address.host_id;
  ucp_worker_release_address(worker_, address);
  packed_address_ = PackPeerAddress(peer_address);

  capabilities_.backend = kUcxName;
  capabilities_.memory_kinds = {MemoryKind::kHost, MemoryKind::kCuda};
  capabilities_.cuda_direct = cuda_direct_;
  capabilities_.cuda_staged = !cuda_direct_;
  capabilities_.notifications = true;
  capabilities_.reads = true;
  const char* env_tls = std::getenv("UCX_TLS");
  capabilities_.transports =
      !options_.tls.empty() ? options_.tls : (env_tls ? env_tls : "all");
  spdlog::info(
      "transport[{}]: UCX {} tls={} memory types=0x{:x}; CUDA memory {}",
      options_.name, ucp_get_version_string(), capabilities_.transports,
      attr.memory_types,
      cuda_direct_ ? "registered directly with UCX (GPUDirect)"
                   : "staged through host buffers (UCX has no CUDA support"
                     " or staging forced)");

  progress_thread_ = std::thread([this] { ProgressLoop(); });
  return absl::OkStatus();
}

void UcxTransport::ProgressLoop() {
  absl::Time last_activity = absl::Now();
  while (true) {
    std::deque<std::function<void()>> commands;
    bool stop;
    {
      absl::MutexLock lock(&cmd_mu_);
      commands.swap(commands_);
      stop = stop_requested_;
    }
    for (auto& command : commands) command();
    if (stop && commands.empty()) break;

    unsigned events = 0;
    while (unsigned n = ucp_worker_progress(worker_)) events += n;
    ProcessDeferredFailures();
    absl::Time now = absl::Now();
    if (now >= next_deadline_check_) {
      CheckDeadlines();
      next_deadline_check_ = now + absl::Milliseconds(5);
    }
    if (events > 0 || !commands.empty() || !active_.empty()) {
      last_activity = now;
      continue;
    }
    if (now - last_activity < options_.spin_after_activity) continue;
    // Idle: nap, but wake at once for a command. Incoming notifications wait
    // at most one nap.
    absl::MutexLock lock(&cmd_mu_);
    cmd_mu_.AwaitWithTimeout(absl::Condition(
                                 +[](std::deque<std::function<void()>>* q) {
                                   return !q->empty();
                                 },
                                 &commands_),
                             options_.idle_nap);
  }
}

void UcxTransport::Shutdown() {
  if (!worker_) {
    if (context_) ucp_cleanup(context_);
    context_ = nullptr;
    return;
  }
  if (progress_thread_.joinable()) {
    absl::Status ignored = RunOnWorker([&]() -> absl::Status {
      // Failing every peer force-closes its endpoint and finishes (or
      // abandons) its transfers, in bounded time even if peers are dead.
      std::vector<PeerId> ids;
      for (auto& [id, peer] : peers_) ids.push_back(id);
      for (PeerId id : ids) {
        FailPeer(id, absl::CancelledError("transport shutting down"));
        Peer& peer = peers_[id];
        for (RemoteRegionId r : peer.remote_regions) {
          ucp_rkey_destroy(remote_regions_[r].rkey);
          remote_regions_.erase(r);
        }
        peer.remote_regions.clear();
      }
      for (auto& [id, region] : regions_) UnmapRegion(region);
      regions_.clear();
      return absl::OkStatus();
    });
    {
      absl::MutexLock lock(&cmd_mu_);
      stopping_ = true;
      stop_requested_ = true;
    }
    progress_thread_.join();
  }
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  ucp_cleanup(context_);
  context_ = nullptr;
}

absl::StatusOr<ucp_mem_h> UcxTransport::MapMemory(void* address, size_t length,
                                                  ucs_memory_type_t type) {
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                      UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = length;
  params.memory_type = type;
  // Memory UCX allocates itself can be exported by posix/sysv shared memory,
  // so a peer on this host writes it with one copy.
  params.flags = address == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_, &params, &memh);
  if (st != UCS_OK) return UcsError(st, "ucp_mem_map");
  return memh;
}

void UcxTransport::UnmapRegion(Region& region) {
  if (region.memh) ucp_mem_unmap(context_, region.memh);
  region.memh = nullptr;
}

absl::StatusOr<LocalRegion> UcxTransport::DoRegister(void* address,
                                                     size_t length,
                                                     MemoryKind kind) {
  if (length == 0) {
    return absl::InvalidArgumentError("RegisterRegion: zero length");
  }
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return absl::InvalidArgumentError("RegisterRegion: unknown memory kind");
  }
  Region region;
  region.info.length = length;
  region.info.kind = kind;
  const bool allocate = address == nullptr;
  region.staged = kind == MemoryKind::kCuda && !cuda_direct_;
  ucs_memory_type_t type =
      kind == MemoryKind::kCuda && cuda_direct_ ? UCS_MEMORY_TYPE_CUDA
                                                : UCS_MEMORY_TYPE_HOST;
  // A staged region registers a UCX-allocated host buffer of the same size;
  // peers only ever see that buffer.
  ASSIGN_OR_RETURN(region.memh,
                   MapMemory(region.staged || allocate ? nullptr : address,
                             length, type));
  ucp_mem_attr_t attr = {};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
  ucs_status_t st = ucp_mem_query(region.memh, &attr);
  if (st != UCS_OK) {
    UnmapRegion(region);
    return UcsError(st, "ucp_mem_query");
  }
  region.wire_address = attr.address;
  region.info.address = allocate ? attr.address : address;
  if (region.staged) {
    // Peers may read before any write: start with the device contents.
    absl::Status copied = options_.device_copier->CopyDeviceToHost(
        region.wire_address, address, length);
    if (!copied.ok()) {
      UnmapRegion(region);
      return copied;
    }
  }
  void* rkey = nullptr;
  size_t rkey_length = 0;
  st = ucp_rkey_pack(context_, region.memh, &rkey, &rkey_length);
  if (st != UCS_OK) {
    UnmapRegion(region);
    return UcsError(st, "ucp_rkey_pack");
  }
  region.rkey.assign(static_cast<const char*>(rkey), rkey_length);
  ucp_rkey_buffer_release(rkey);

  region.info.id = next_id_++;
  LocalRegion info = region.info;
  regions_.emplace(info.id, std::move(region));
  return info;
}

absl::Status UcxTransport::DoDeregister(RegionId id) {
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no local region ", id));
  }
  if (it->second.users > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region ", id, " is used by ", it->second.users, " pending transfers"));
  }
  UnmapRegion(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::Status UcxTransport::SyncStagingFromDevice(RegionId id, uint64_t offset, uint64_t length) {
  struct Range {
    bool staged = false;
    char* device = nullptr;
    char* wire = nullptr;
  };
  // Look the region up on the worker (regions_ is its); copy here, so a
  // large copy does not stall the progress thread.
  absl::StatusOr<Range> range = RunOnWorker([&]() -> absl::StatusOr<Range> {
    auto it = regions_.find(id);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("no local region ", id));
    }
    const Region& r = it->second;
    if (offset > r.info.length || length > r.info.length - offset) {
      return absl::OutOfRangeError(absl::StrCat("SyncStagingFromDevice: [", offset, ", +", length,
                                                ") is outside region ", id, " of ", r.info.length,
                                                " bytes"));
    }
    Range out;
    out.staged = r.staged;
    out.device = static_cast<char*>(r.info.address) + offset;
    out.wire = static_cast<char*>(r.wire_address) + offset;
    return out;
  });
  if (!range.ok()) return range.status();
  if (!range->staged || length == 0) return absl::OkStatus();
  return options_.device_copier->CopyDeviceToHost(range->wire, range->device, length);
}

absl::StatusOr<std::string> UcxTransport::DoDescribe(RegionId id) {
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no local region ", id));
  }
  const Region& r = it->second;
  RegionDescriptor d;
  d.backend = kUcxName;
  d.agent_id = agent_id_;
  d.region = id;
  d.kind = r.info.kind;
  d.staged = r.staged;
  d.remote_address = reinterpret_cast<uint64_t>(r.wire_address);
  d.length = r.info.length;
  d.rkey = r.rkey;
  return PackRegionDescriptor(d);
}

absl::StatusOr<PeerId> UcxTransport::DoConnect(absl::string_view blob) {
  ASSIGN_OR_RETURN(PeerAddress address, UnpackPeerAddress(blob));
  if (address.backend != kUcxName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peer address is for backend '", address.backend, "', not ucx"));
  }
  if (address.address.empty()) {
    return absl::InvalidArgumentError("peer address: empty worker address");
  }
  PeerId id = next_id_++;
  Peer peer;
  peer.name = address.name;
  peer.error_arg = std::make_unique<std::pair<UcxTransport*, PeerId>>(this, id);
  if (!address.host_id.empty() && address.host_id == local_host_id_) {
    peer.pid = address.pid;
    peer.start_time = address.start_time;
  }
  peer.agent_id = address.agent_id;
  ucp_ep_params_t params = {};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address =
      reinterpret_cast<const ucp_address_t*>(address.address.data());
  params.err_handler.cb = &UcxTransport::OnEndpointError;
  params.err_handler.arg = peer.error_arg.get();
  // Peer mode makes UCX report a dead peer instead of hanging, but UCX
  // 1.13's shared memory transports (posix, sysv) lack peer-failure support
  // and peer mode would exclude them. On one host we keep shared memory and
  // detect death through /proc instead; elsewhere we ask UCX.
  const bool same_host = peer.pid != 0;
  const bool prefer_shm = same_host && MayUseSharedMemory();
  params.err_mode =
      prefer_shm ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
  ucs_status_t st = ucp_ep_create(worker_, &params, &peer.ep);
  if (st == UCS_ERR_UNREACHABLE &&
      params.err_mode == UCP_ERR_HANDLING_MODE_PEER && same_host) {
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(worker_, &params, &peer.ep);
  }
  if (st == UCS_OK) {
    // Flush once so wireup finishes inside Connect: an unreachable peer fails
    // here, and a half-wired endpoint cannot stall later behind the failure
    // of another peer (seen with shared memory and no UCX error handling).
    ucp_request_param_t flush = {};
    ucs_status_t flushed = WaitRequest(ucp_ep_flush_nbx(peer.ep, &flush));
    if (flushed != UCS_OK) {
      CloseEndpoint(peer, /*force=*/true);
      return absl::UnavailableError(absl::StrCat(
          "connecting to '", peer.name, "': ", ucs_status_string(flushed)));
    }
    spdlog::info("transport[{}]: connected to '{}'; failure detection: {}",
                 options_.name, peer.name,
                 params.err_mode == UCP_ERR_HANDLING_MODE_PEER
                     ? "UCX peer error handling + transfer deadline"
                     : "process liveness + transfer deadline");
  }
  if (st != UCS_OK) return UcsError(st, "ucp_ep_create");
  peers_.emplace(id, std::move(peer));
  return id;
}

void UcxTransport::CloseEndpoint(Peer& peer, bool force) {
  if (!peer.ep) return;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(peer.ep, &param);
  peer.ep = nullptr;
  ucs_status_t st = WaitRequest(request);
  if (st != UCS_OK && !force) {
    spdlog::debug("transport[{}]: closing endpoint to {}: {}", options_.name,
                  peer.name, ucs_status_string(st));
  }
}

ucs_status_t UcxTransport::WaitRequest(ucs_status_ptr_t request) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  // Bounded: closing an endpoint to a dead shared-memory peer may never
  // finish; the request is then left to the worker's destruction.
  absl::Time give_up = absl::Now() + absl::Seconds(1);
  ucs_status_t st;
  while ((st = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (absl::Now() > give_up) return UCS_ERR_TIMED_OUT;
    ucp_worker_progress(worker_);
  }
  ucp_request_free(request);
  return st;
}

absl::Status UcxTransport::DoDisconnect(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", id));
  Peer& peer = it->second;
  if (peer.pending > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "peer ", peer.name, " has ", peer.pending, " pending transfers"));
  }
  for (RemoteRegionId r : peer.remote_regions) {
    ucp_rkey_destroy(remote_regions_[r].rkey);
    remote_regions_.erase(r);
  }
  CloseEndpoint(peer, /*force=*/!peer.failure.ok());
  peers_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<RemoteRegionId> UcxTransport::DoImport(
    PeerId peer_id, absl::string_view blob) {
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
  }
  Peer& peer = it->second;
  if (!peer.failure.ok()) return peer.failure;
  ASSIGN_OR_RETURN(RegionDescriptor d, UnpackRegionDescriptor(blob));
  if (d.backend != kUcxName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region descriptor is for backend '", d.backend, "', not ucx"));
  }
  // UCX trusts remote keys blindly (a forged one can crash rkey unpack), so
  // only keys minted by the agent behind this endpoint are accepted.
  if (d.agent_id != peer.agent_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region descriptor belongs to another agent, not peer '", peer.name,
        "'"));
  }
  if (d.rkey.empty()) {
    return absl::InvalidArgumentError("region descriptor: empty remote key");
  }
  RemoteRegion remote;
  remote.peer = peer_id;
  ucs_status_t st = ucp_ep_rkey_unpack(peer.ep, d.rkey.data(), &remote.rkey);
  if (st != UCS_OK) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region descriptor: remote key rejected by UCX: ",
        ucs_status_string(st)));
  }
  remote.descriptor = std::move(d);
  RemoteRegionId id = next_id_++;
  remote_regions_.emplace(id, std::move(remote));
  peer.remote_regions.insert(id);
  return id;
}

absl::Status UcxTransport::DoReleaseRemote(RemoteRegionId id) {
  auto it = remote_regions_.find(id);
  if (it == remote_regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no remote region ", id));
  }
  auto peer = peers_.find(it->second.peer);
  if (peer != peers_.end()) {
    if (peer->second.pending > 0) {
      // Cheap conservative rule: an rkey may be in use by any pending op.
      return absl::FailedPreconditionError(
          "remote region's peer has pending transfers");
    }
    peer->second.remote_regions.erase(id);
  }
  ucp_rkey_destroy(it->second.rkey);
  remote_regions_.erase(it);
  return absl::OkStatus();
}

// Notification wire format (AM body):
//   u32 name length, name, u8 deliver, u32 range count,
//   ranges {u64 region, u64 offset, u64 length}..., payload (rest).
absl::StatusOr<TransferId> UcxTransport::DoPost(
    PeerId peer_id, Direction direction, absl::Span<const TransferOp> ops,
    absl::string_view notification) {
  auto pit = peers_.find(peer_id);
  if (pit == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
  }
  Peer& peer = pit->second;
  if (!peer.failure.ok()) return peer.failure;
  if (ops.empty() && notification.empty()) {
    return absl::InvalidArgumentError("PostTransfer: empty batch");
  }
  // Validate everything before moving a byte, so a bad op cannot leave a
  // half-posted batch behind.
  std::vector<RangeRef> staged_remote;
  for (size_t i = 0; i < ops.size(); ++i) {
    const TransferOp& op = ops[i];
    auto l = regions_.find(op.local);
    if (l == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("op ", i, ": no local region ", op.local));
    }
    auto r = remote_regions_.find(op.remote);
    if (r == remote_regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("op ", i, ": no remote region ", op.remote));
    }
    if (r->second.peer != peer_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "op ", i, ": remote region ", op.remote, " belongs to another peer"));
    }
    absl::Status range = CheckOpRanges(i, op, l->second.info.length, r->second.descriptor.length);
    if (!range.ok()) return range;
    if (direction == Direction::kWrite && r->second.descriptor.staged) {
      staged_remote.push_back(
          {r->second.descriptor.region, op.remote_offset, op.length});
    }
  }

  auto owned = std::make_shared<Transfer>();
  Transfer* t = owned.get();
  t->owner = this;
  t->id = next_id_++;
  t->peer = peer_id;
  t->direction = direction;
  t->deadline = absl::Now() + options_.transfer_timeout;
  t->notify = !notification.empty() || !staged_remote.empty();
  if (t->notify) {
    std::string& m = t->notify_message;
    auto put32 = [&m](uint32_t v) { m.append(reinterpret_cast<char*>(&v), 4); };
    auto put64 = [&m](uint64_t v) { m.append(reinterpret_cast<char*>(&v), 8); };
    put32(static_cast<uint32_t>(options_.name.size()));
    m.append(options_.name);
    m.push_back(notification.empty() ? 0 : 1);
    put32(static_cast<uint32_t>(staged_remote.size()));
    for (const RangeRef& range : staged_remote) {
      put64(range.region);
      put64(range.offset);
      put64(range.length);
    }
    m.append(notification.data(), notification.size());
  }

  // Writes from a staged GPU region: bring the device bytes to staging first.
  for (const TransferOp& op : ops) {
    Region& local = regions_[op.local];
    if (local.staged && direction == Direction::kWrite) {
      RETURN_IF_ERROR(options_.device_copier->CopyDeviceToHost(
          static_cast<char*>(local.wire_address) + op.local_offset,
          static_cast<char*>(local.info.address) + op.local_offset, op.length));
    }
  }

  {
    absl::MutexLock lock(&mu_);
    transfers_.emplace(t->id, std::move(owned));
  }
  active_.emplace(t->id, t);
  ++peer.pending;
  for (const TransferOp& op : ops) {
    Region& local = regions_[op.local];
    ++local.users;
    t->local_regions.push_back(op.local);
    const RemoteRegion& remote = remote_regions_[op.remote];
    if (local.staged && direction == Direction::kRead) {
      t->staged_reads.push_back({op.local, op.local_offset, op.length});
    }
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    param.cb.send = &UcxTransport::OnRequestDone;
    param.user_data = t;
    param.memh = local.memh;
    void* buffer = static_cast<char*>(local.wire_address) + op.local_offset;
    uint64_t remote_address = remote.descriptor.remote_address + op.remote_offset;
    ucs_status_ptr_t request =
        direction == Direction::kWrite
            ? ucp_put_nbx(peer.ep, buffer, op.length, remote_address,
                          remote.rkey, &param)
            : ucp_get_nbx(peer.ep, buffer, op.length, remote_address,
                          remote.rkey, &param);
    if (UCS_PTR_IS_ERR(request)) {
      t->error = UcsError(UCS_PTR_STATUS(request),
                          direction == Direction::kWrite ? "ucp_put_nbx"
                                                         : "ucp_get_nbx");
      break;
    }
    if (request != nullptr) t->outstanding.insert(request);
  }
  TransferId id = t->id;  // t may be released by its owner once finished
  Advance(t);
  return id;
}

void UcxTransport::OnRequestDone(void* request, ucs_status_t status,
                                 void* user_data) {
  auto* t = static_cast<Transfer*>(user_data);
  t->outstanding.erase(request);
  ucp_request_free(request);
  if (status != UCS_OK && t->error.ok()) {
    absl::Status peer_failure;
    auto it = t->owner->peers_.find(t->peer);
    if (it != t->owner->peers_.end()) peer_failure = it->second.failure;
    t->error = !peer_failure.ok()
                   ? peer_failure
                   : absl::UnavailableError(absl::StrCat(
                         "transfer ", t->id, " failed: ",
                         ucs_status_string(status)));
  }
  t->owner->Advance(t);
}

void UcxTransport::Advance(Transfer* t) {
  if (t->phase == Phase::kFinished) return;  // abandoned requests draining
  while (t->outstanding.empty()) {
    if (!t->error.ok() || t->cancelled || t->phase == Phase::kDone) {
      Finish(t);
      return;
    }
    Peer& peer = peers_[t->peer];
    if (!peer.failure.ok() || peer.ep == nullptr) {
      t->error = peer.failure.ok() ? absl::UnavailableError("peer closed")
                                   : peer.failure;
      continue;
    }
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxTransport::OnRequestDone;
    param.user_data = t;
    ucs_status_ptr_t request = nullptr;
    if (t->phase == Phase::kOps) {
      // Puts complete locally; the flush is what proves they landed remotely,
      // so the notification sent after it cannot overtake the data.
      t->phase = Phase::kFlush;
      request = ucp_ep_flush_nbx(peer.ep, &param);
    } else if (t->phase == Phase::kFlush && t->notify) {
      t->phase = Phase::kNotify;
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      // Eager keeps the message in one piece in the receive callback.
      param.flags = UCP_AM_SEND_FLAG_EAGER;
      request = ucp_am_send_nbx(peer.ep, kNotifyAmId, nullptr, 0,
                                t->notify_message.data(),
                                t->notify_message.size(), &param);
    } else {
      t->phase = Phase::kDone;
      continue;
    }
    if (UCS_PTR_IS_ERR(request)) {
      t->error = absl::UnavailableError(
          absl::StrCat("transfer ", t->id, ": ",
                       ucs_status_string(UCS_PTR_STATUS(request))));
    } else if (request != nullptr) {
      t->outstanding.insert(request);
    }
  }
}

void UcxTransport::Finish(Transfer* t) {
  absl::Status status = t->error;
  if (status.ok() && t->cancelled) {
    status = absl::CancelledError(absl::StrCat("transfer ", t->id, " cancelled"));
  }
  if (status.ok()) {
    for (const RangeRef& range : t->staged_reads) {
      Region& region = regions_[range.region];
      absl::Status copied = options_.device_copier->CopyHostToDevice(
          static_cast<char*>(region.info.address) + range.offset,
          static_cast<char*>(region.wire_address) + range.offset, range.length);
      if (!copied.ok()) {
        status = copied;
        break;
      }
    }
  }
  for (RegionId id : t->local_regions) --regions_[id].users;
  auto peer = peers_.find(t->peer);
  if (peer != peers_.end()) --peer->second.pending;
  active_.erase(t->id);
  absl::MutexLock lock(&mu_);
  t->phase = Phase::kFinished;
  t->final_status = std::move(status);
  t->done = true;
}

void UcxTransport::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto [self, id] = *static_cast<std::pair<UcxTransport*, PeerId>*>(arg);
  // The endpoint is closed outside this callback, from the progress loop.
  self->deferred_failures_.emplace_back(
      id, absl::UnavailableError(absl::StrCat(
              "peer connection failed: ", ucs_status_string(status))));
}

void UcxTransport::FailPeer(PeerId id, absl::Status why) {
  auto it = peers_.find(id);
  if (it == peers_.end() || !it->second.failure.ok()) return;
  Peer& peer = it->second;
  peer.failure = absl::Status(
      why.code(), absl::StrCat("peer '", peer.name, "': ", why.message()));
  if (!absl::IsCancelled(why)) {
    spdlog::warn("transport[{}]: {}", options_.name, peer.failure.ToString());
  }
  // Force-close completes every outstanding request on the endpoint with an
  // error, which finishes the transfers through OnRequestDone.
  CloseEndpoint(peer, /*force=*/true);
  std::vector<Transfer*> stuck;
  for (auto& [tid, t] : active_) {
    if (t->peer == id) stuck.push_back(t);
  }
  for (Transfer* t : stuck) {
    if (t->error.ok()) t->error = peer.failure;
    Advance(t);
  }
  // Without UCX peer error handling (shared memory), a force close does not
  // complete requests that wait on the dead peer. Give them a moment, then
  // finish their transfers anyway; the Transfer objects stay alive in
  // abandoned_ in case UCX calls back later. The peer is gone, so nothing
  // will land in their buffers.
  absl::Time give_up = absl::Now() + absl::Milliseconds(50);
  auto any_stuck = [&] {
    for (Transfer* t : stuck) {
      if (t->phase != Phase::kFinished) return true;
    }
    return false;
  };
  while (any_stuck() && absl::Now() < give_up) ucp_worker_progress(worker_);
  for (Transfer* t : stuck) {
    if (t->phase == Phase::kFinished) continue;
    {
      absl::MutexLock lock(&mu_);
      abandoned_.push_back(transfers_[t->id]);
    }
    spdlog::warn("transport[{}]: abandoning {} requests of transfer {} to '{}'",
                 options_.name, t->outstanding.size(), t->id, peer.name);
    Finish(t);
  }
}

void UcxTransport::ProcessDeferredFailures() {
  while (!deferred_failures_.empty()) {
    auto [id, why] = std::move(deferred_failures_.back());
    deferred_failures_.pop_back();
    FailPeer(id, std::move(why));
  }
}

void UcxTransport::CheckDeadlines() {
  absl::Time now = absl::Now();
  if (now >= next_liveness_check_) {
    next_liveness_check_ = now + options_.keepalive_interval;
    std::vector<PeerId> dead;
    for (auto& [id, peer] : peers_) {
      if (peer.pid != 0 && peer.failure.ok() &&
          ProcessStartTime(peer.pid) != peer.start_time) {
        dead.push_back(id);
      }
    }
    for (PeerId id : dead) {
      FailPeer(id, absl::UnavailableError(absl::StrCat(
                       "process ", peers_[id].pid, " exited")));
    }
  }
  std::vector<std::pair<PeerId, std::string>> late;
  for (auto& [id, t] : active_) {
    if (now > t->deadline) {
      static constexpr const char* kPhaseNames[] = {"data", "flush", "notification",
                                                    "done", "finished"};
      late.emplace_back(t->peer, absl::StrCat(
                                     "transfer ", id, " exceeded ",
                                     absl::FormatDuration(options_.transfer_timeout),
                                     " waiting on ", t->outstanding.size(), " ",
                                     kPhaseNames[static_cast<int>(t->phase)],
                                     " requests; peer presumed dead"));
    }
  }
  for (auto& [peer, why] : late) FailPeer(peer, absl::DeadlineExceededError(why));
}

absl::Status UcxTransport::DoCancel(TransferId id) {
  auto it = active_.find(id);
  if (it == active_.end()) {
    absl::MutexLock lock(&mu_);
    if (!transfers_.contains(id)) {
      return absl::NotFoundError(absl::StrCat("no transfer ", id));
    }
    return absl::OkStatus();  // already finished; Poll reports how
  }
  Transfer* t = it->second;
  t->cancelled = true;
  // RMA requests may not be cancellable; they then finish normally and the
  // transfer still ends Cancelled without sending its notification.
  std::vector<void*> requests(t->outstanding.begin(), t->outstanding.end());
  for (void* request : requests) ucp_request_cancel(worker_, request);
  Advance(t);
  return absl::OkStatus();
}

absl::StatusOr<bool> UcxTransport::Poll(TransferId id) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return absl::NotFoundError(absl::StrCat("no transfer ", id));
  }
  Transfer* t = it->second.get();
  if (!t->done) return false;
  if (!t->final_status.ok()) return t->final_status;
  return true;
}

absl::Status UcxTransport::Wait(TransferId id, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return absl::NotFoundError(absl::StrCat("no transfer ", id));
  }
  Transfer* t = it->second.get();
  auto done = [t]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return t->done; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "transfer ", id, " still pending after ", absl::FormatDuration(timeout)));
  }
  return t->final_status;
}

absl::Status UcxTransport::ReleaseTransfer(TransferId id) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return absl::NotFoundError(absl::StrCat("no transfer ", id));
  }
  if (!it->second->done) {
    return absl::FailedPreconditionError(
        absl::StrCat("transfer ", id, " is still pending; cancel it first"));
  }
  transfers_.erase(it);
  return absl::OkStatus();
}

ucs_status_t UcxTransport::OnNotify(void* arg, const void* header,
                                    size_t header_length, void* data,
                                    size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Senders always use eager; a rendezvous message is not ours.
    spdlog::error("transport[{}]: unexpected rendezvous notification dropped",
                  self->options_.name);
    return UCS_OK;
  }
  self->HandleNotify(static_cast<const char*>(data), length);
  return UCS_OK;
}

void UcxTransport::HandleNotify(const char* data, size_t length) {
  absl::string_view in(data, length);
  auto take = [&in](void* out, size_t n) {
    if (in.size() < n) return false;
    std::memcpy(out, in.data(), n);
    in.remove_prefix(n);
    return true;
  };
  uint32_t name_length = 0, ranges = 0;
  uint8_t deliver = 0;
  Notification note;
  if (!take(&name_length, 4) || in.size() < name_length) {
    spdlog::error("transport[{}]: malformed notification", options_.name);
    return;
  }
  note.from.assign(in.data(), name_length);
  in.remove_prefix(name_length);
  if (!take(&deliver, 1) || !take(&ranges, 4) || in.size() / 24 < ranges) {
    spdlog::error("transport[{}]: malformed notification", options_.name);
    return;
  }
  for (uint32_t i = 0; i < ranges; ++i) {
    RangeRef range{};
    take(&range.region, 8);
    take(&range.offset, 8);
    take(&range.length, 8);
    auto it = regions_.find(range.region);
    if (it == regions_.end() || !it->second.staged ||
        !InRange(range.offset, range.length, it->second.info.length)) {
      spdlog::error("transport[{}]: notification names a bad staged range",
                    options_.name);
      continue;
    }
    Region& region = it->second;
    absl::Status copied = options_.device_copier->CopyHostToDevice(
        static_cast<char*>(region.info.address) + range.offset,
        static_cast<char*>(region.wire_address) + range.offset, range.length);
    if (!copied.ok()) {
      spdlog::error("transport[{}]: staging to device failed: {}",
                    options_.name, copied.ToString());
    }
  }
  if (!deliver) return;
  note.payload.assign(in.data(), in.size());
  absl::MutexLock lock(&mu_);
  notifications_.push_back(std::move(note));
}

std::vector<Notification> UcxTransport::TakeNotifications() {
  absl::MutexLock lock(&mu_);
  std::vector<Notification> out(std::make_move_iterator(notifications_.begin()),
                                std::make_move_iterator(notifications_.end()));
  notifications_.clear();
  return out;
}

absl::StatusOr<Notification> UcxTransport::WaitNotification(
    absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !notifications_.empty();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&any), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no notification within ", absl::FormatDuration(timeout)));
  }
  Notification note = std::move(notifications_.front());
  notifications_.pop_front();
  return note;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(
    UcxTransportOptions options) {
  auto transport = std::make_unique<UcxTransport>(std::move(options));
  RETURN_IF_ERROR(transport->Init());
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace kvserve::transport
