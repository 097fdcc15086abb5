#include "transport/loopback_transport.h"

#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "transport/descriptor.h"

namespace kvserve::transport {
namespace {

constexpr char kLoopbackName[] = "loopback";

class LoopbackTransport;

// One lock for every loopback agent in the process: loopback exists for
// tests, and a single lock makes "the peer vanished mid-copy" impossible.
absl::Mutex& FabricMutex() {
  static auto* mu = new absl::Mutex;  // never destroyed: used at exit
  return *mu;
}
absl::flat_hash_map<uint64_t, LoopbackTransport*>& Agents() {
  static auto* agents = new absl::flat_hash_map<uint64_t, LoopbackTransport*>;
  return *agents;
}

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(LoopbackTransportOptions options)
      : options_(std::move(options)) {
    if (!options_.device_copier) {
      options_.device_copier = std::make_shared<HostStandInCopier>();
    }
    std::random_device rd;
    absl::MutexLock lock(&FabricMutex());
    do {
      agent_id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    } while (agent_id_ == 0 || Agents().contains(agent_id_));
    Agents()[agent_id_] = this;
  }
  ~LoopbackTransport() override {
    absl::MutexLock lock(&FabricMutex());
    Agents().erase(agent_id_);
    for (auto& [id, block] : owned_) delete[] block;
  }

  Capabilities GetCapabilities() const override {
    Capabilities c;
    c.backend = kLoopbackName;
    c.memory_kinds = {MemoryKind::kHost, MemoryKind::kCuda};
    c.cuda_staged = true;
    c.notifications = true;
    c.reads = true;
    c.transports = "memcpy";
    return c;
  }

  absl::StatusOr<std::string> LocalAddress() override {
    PeerAddress a;
    a.backend = kLoopbackName;
    a.agent_id = agent_id_;
    a.name = options_.name;
    return PackPeerAddress(a);
  }

  absl::StatusOr<LocalRegion> RegisterRegion(void* address, size_t length,
                                             MemoryKind kind) override {
    if (address == nullptr || length == 0) {
      return absl::InvalidArgumentError(
          "RegisterRegion: null address or zero length");
    }
    if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
      return absl::InvalidArgumentError("RegisterRegion: unknown memory kind");
    }
    absl::MutexLock lock(&FabricMutex());
    LocalRegion r{next_id_++, address, length, kind};
    regions_[r.id] = r;
    return r;
  }

  absl::StatusOr<LocalRegion> AllocateRegion(size_t length) override {
    if (length == 0) return absl::InvalidArgumentError("zero length");
    char* block = new char[length]();
    absl::StatusOr<LocalRegion> r =
        RegisterRegion(block, length, MemoryKind::kHost);
    absl::MutexLock lock(&FabricMutex());
    owned_[r->id] = block;
    return r;
  }

  absl::Status DeregisterRegion(RegionId region) override {
    absl::MutexLock lock(&FabricMutex());
    if (regions_.erase(region) == 0) {
      return absl::NotFoundError(absl::StrCat("no local region ", region));
    }
    if (auto it = owned_.find(region); it != owned_.end()) {
      delete[] it->second;
      owned_.erase(it);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> DescribeRegion(RegionId region) override {
    absl::MutexLock lock(&FabricMutex());
    auto it = regions_.find(region);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("no local region ", region));
    }
    RegionDescriptor d;
    d.backend = kLoopbackName;
    d.agent_id = agent_id_;
    d.region = region;
    d.kind = it->second.kind;
    d.remote_address = reinterpret_cast<uint64_t>(it->second.address);
    d.length = it->second.length;
    return PackRegionDescriptor(d);
  }

  // Transfers copy from the device memory itself (through the copier), so
  // there is no staging to refresh; the range is still checked.
  absl::Status SyncStagingFromDevice(RegionId region, uint64_t offset, uint64_t length) override {
    absl::MutexLock lock(&FabricMutex());
    auto it = regions_.find(region);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("no local region ", region));
    }
    if (offset > it->second.length || length > it->second.length - offset) {
      return absl::OutOfRangeError(absl::StrCat("SyncStagingFromDevice: [", offset, ", +", length,
                                                ") is outside region ", region, " of ",
                                                it->second.length, " bytes"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<PeerId> Connect(absl::string_view blob) override {
    ASSIGN_OR_RETURN(PeerAddress a, UnpackPeerAddress(blob));
    if (a.backend != kLoopbackName) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peer address is for backend '", a.backend, "', not loopback"));
    }
    absl::MutexLock lock(&FabricMutex());
    if (!Agents().contains(a.agent_id)) {
      return absl::UnavailableError(
          absl::StrCat("loopback peer '", a.name, "' does not exist"));
    }
    PeerId id = next_id_++;
    peers_[id] = {a.agent_id, a.name};
    return id;
  }

  absl::Status Disconnect(PeerId peer) override {
    absl::MutexLock lock(&FabricMutex());
    if (peers_.erase(peer) == 0) {
      return absl::NotFoundError(absl::StrCat("no peer ", peer));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<RemoteRegionId> ImportRegion(PeerId peer,
                                              absl::string_view blob) override {
    ASSIGN_OR_RETURN(RegionDescriptor d, UnpackRegionDescriptor(blob));
    if (d.backend != kLoopbackName) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region descriptor is for backend '", d.backend, "', not loopback"));
    }
    absl::MutexLock lock(&FabricMutex());
    auto p = peers_.find(peer);
    if (p == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    if (d.agent_id != p->second.agent_id) {
      return absl::InvalidArgumentError(
          "region descriptor belongs to a different peer");
    }
    RemoteRegionId id = next_id_++;
    remote_[id] = {peer, d};
    return id;
  }

  absl::Status ReleaseRemoteRegion(RemoteRegionId region) override {
    absl::MutexLock lock(&FabricMutex());
    if (remote_.erase(region) == 0) {
      return absl::NotFoundError(absl::StrCat("no remote region ", region));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TransferId> PostTransfer(PeerId peer, Direction direction,
                                          absl::Span<const TransferOp> ops,
                                          absl::string_view notification) override {
    absl::MutexLock lock(&FabricMutex());
    auto p = peers_.find(peer);
    if (p == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    auto agent = Agents().find(p->second.agent_id);
    if (agent == Agents().end()) {
      return absl::UnavailableError(
          absl::StrCat("peer '", p->second.name, "' is gone"));
    }
    LoopbackTransport* target = agent->second;
    if (ops.empty() && notification.empty()) {
      return absl::InvalidArgumentError("PostTransfer: empty batch");
    }
    struct Resolved {
      const LocalRegion* local;
      const LocalRegion* remote;
    };
    std::vector<Resolved> resolved;
    for (size_t i = 0; i < ops.size(); ++i) {
      const TransferOp& op = ops[i];
      auto l = regions_.find(op.local);
      if (l == regions_.end()) {
        return absl::NotFoundError(
            absl::StrCat("op ", i, ": no local region ", op.local));
      }
      auto r = remote_.find(op.remote);
      if (r == remote_.end()) {
        return absl::NotFoundError(
            absl::StrCat("op ", i, ": no remote region ", op.remote));
      }
      if (r->second.peer != peer) {
        return absl::InvalidArgumentError(absl::StrCat(
            "op ", i, ": remote region ", op.remote, " belongs to another peer"));
      }
      auto owner = target->regions_.find(r->second.descriptor.region);
      if (owner == target->regions_.end()) {
        return absl::UnavailableError(absl::StrCat(
            "op ", i, ": remote region ", op.remote, " was deregistered"));
      }
      absl::Status range = CheckOpRanges(i, op, l->second.length, r->second.descriptor.length);
      if (!range.ok()) return range;
      resolved.push_back({&l->second, &owner->second});
    }
    absl::Status status;
    for (size_t i = 0; i < ops.size() && status.ok(); ++i) {
      const TransferOp& op = ops[i];
      const LocalRegion* src = resolved[i].local;
      const LocalRegion* dst = resolved[i].remote;
      uint64_t src_offset = op.local_offset, dst_offset = op.remote_offset;
      if (direction == Direction::kRead) {
        std::swap(src, dst);
        std::swap(src_offset, dst_offset);
      }
      status = Copy(static_cast<char*>(dst->address) + dst_offset, dst->kind,
                    static_cast<const char*>(src->address) + src_offset,
                    src->kind, op.length);
    }
    if (status.ok() && !notification.empty()) {
      target->notifications_.push_back(
          {options_.name, std::string(notification)});
    }
    TransferId id = next_id_++;
    transfers_[id] = status;
    return id;
  }

  absl::StatusOr<bool> Poll(TransferId transfer) override {
    absl::MutexLock lock(&FabricMutex());
    auto it = transfers_.find(transfer);
    if (it == transfers_.end()) {
      return absl::NotFoundError(absl::StrCat("no transfer ", transfer));
    }
    if (!it->second.ok()) return it->second;
    return true;
  }
  absl::Status Wait(TransferId transfer, absl::Duration) override {
    return Poll(transfer).status();
  }
  absl::Status Cancel(TransferId transfer) override {
    return Poll(transfer).status().code() == absl::StatusCode::kNotFound
               ? absl::NotFoundError(absl::StrCat("no transfer ", transfer))
               : absl::OkStatus();
  }
  absl::Status ReleaseTransfer(TransferId transfer) override {
    absl::MutexLock lock(&FabricMutex());
    if (transfers_.erase(transfer) == 0) {
      return absl::NotFoundError(absl::StrCat("no transfer ", transfer));
    }
    return absl::OkStatus();
  }

  std::vector<Notification> TakeNotifications() override {
    absl::MutexLock lock(&FabricMutex());
    std::vector<Notification> out(notifications_.begin(), notifications_.end());
    notifications_.clear();
    return out;
  }
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout) override {
    absl::MutexLock lock(&FabricMutex());
    auto any = [this] { return !notifications_.empty(); };
    if (!FabricMutex().AwaitWithTimeout(absl::Condition(&any), timeout)) {
      return absl::DeadlineExceededError("no notification");
    }
    Notification n = std::move(notifications_.front());
    notifications_.pop_front();
    return n;
  }

 private:
  struct PeerInfo {
    uint64_t agent_id;
    std::string name;
  };
  struct Remote {
    PeerId peer;
    RegionDescriptor descriptor;
  };

  absl::Status Copy(char* dst, MemoryKind dst_kind, const char* src,
                    MemoryKind src_kind, size_t n) {
    DeviceCopier& copier = *options_.device_copier;
    if (src_kind == MemoryKind::kHost && dst_kind == MemoryKind::kHost) {
      std::memmove(dst, src, n);
      return absl::OkStatus();
    }
    if (src_kind == MemoryKind::kHost) return copier.CopyHostToDevice(dst, src, n);
    if (dst_kind == MemoryKind::kHost) return copier.CopyDeviceToHost(dst, src, n);
    // Device to device: stage through host, as a peer without P2P would.
    std::string staging(n, '\0');
    RETURN_IF_ERROR(copier.CopyDeviceToHost(staging.data(), src, n));
    return copier.CopyHostToDevice(dst, staging.data(), n);
  }

  LoopbackTransportOptions options_;
  uint64_t agent_id_ = 0;
  // All guarded by FabricMutex().
  uint64_t next_id_ = 1;
  absl::flat_hash_map<RegionId, LocalRegion> regions_;
  absl::flat_hash_map<RegionId, char*> owned_;
  absl::flat_hash_map<PeerId, PeerInfo> peers_;
  absl::flat_hash_map<RemoteRegionId, Remote> remote_;
  absl::flat_hash_map<TransferId, absl::Status> transfers_;
  std::deque<Notification> notifications_;
};

}  // namespace

std::unique_ptr<Transport> CreateLoopbackTransport(
    LoopbackTransportOptions options) {
  return std::make_unique<LoopbackTransport>(std::move(options));
}

}  // namespace kvserve::transport
