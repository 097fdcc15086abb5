// Transport moves byte ranges between registered memory regions of two
// processes (or two agents in one process). It knows addresses, lengths and
// memory kinds; it knows nothing of KV blocks, sequences or requests — the
// scheduler turns block tables into TransferOp lists before calling in here.
//
// Every step is explicit and returns a Status, in the NIXL style:
//   register (or allocate) a region -> describe it (packed descriptor)
//   -> the peer imports the descriptor after connecting to our address
//   -> post a batch of ops -> poll / wait -> release the transfer
//   -> the target drains notifications that say a batch has fully landed.
//
// Thread safety: every method of a Transport may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvserve::transport {

enum class MemoryKind : uint8_t {
  kHost = 0,
  // CUDA device memory. Moved directly when the backend supports it
  // (GPUDirect), otherwise staged through host buffers; see capabilities.
  kCuda = 1,
};
const char* MemoryKindName(MemoryKind kind);

// Handles are opaque, never reused within one Transport instance, so a stale
// handle is detected (NotFound) instead of aliasing a newer object.
using RegionId = uint64_t;        // a local registered region
using PeerId = uint64_t;          // a connected peer
using RemoteRegionId = uint64_t;  // a peer's region imported from its descriptor
using TransferId = uint64_t;      // one posted batch

struct LocalRegion {
  RegionId id = 0;
  void* address = nullptr;
  size_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// One scatter-gather piece. For a write, bytes flow local -> remote; for a
// read, remote -> local.
struct TransferOp {
  RegionId local = 0;
  uint64_t local_offset = 0;
  RemoteRegionId remote = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

enum class Direction : uint8_t { kWrite, kRead };

// Delivered to the target once every byte of a batch that asked for it has
// landed (and, for staged GPU regions, been copied to the device).
struct Notification {
  std::string from;     // the sender's agent name (TransportOptions::name)
  std::string payload;  // opaque bytes chosen by the initiator
};

struct Capabilities {
  std::string backend;                  // "ucx" or "loopback"
  std::vector<MemoryKind> memory_kinds; // kinds RegisterRegion accepts
  bool cuda_direct = false;   // kCuda regions registered with the backend
  bool cuda_staged = false;   // kCuda regions staged through host buffers
  bool notifications = false;
  bool reads = false;
  std::string transports;     // e.g. the UCX_TLS in force
};

class Transport {
 public:
  virtual ~Transport() = default;

  [[nodiscard]] virtual Capabilities GetCapabilities() const = 0;

  // Opaque blob a peer passes to Connect(); exchanged out of band (socket,
  // gRPC). For UCX it carries the worker address, so peers on one host use
  // shared memory and peers across hosts use the network.
  [[nodiscard]] virtual absl::StatusOr<std::string> LocalAddress() = 0;

  // Registers caller-owned memory. REQUIRES: [address, address+length) stays
  // valid until DeregisterRegion.
  [[nodiscard]] virtual absl::StatusOr<LocalRegion> RegisterRegion(
      void* address, size_t length, MemoryKind kind) = 0;
  // Allocates host memory owned by the transport. With UCX this lets shared
  // memory transports map it directly into the peer (single copy), which
  // caller-owned memory cannot always do.
  [[nodiscard]] virtual absl::StatusOr<LocalRegion> AllocateRegion(
      size_t length) = 0;
  // Fails with FailedPrecondition while a posted transfer still uses it.
  [[nodiscard]] virtual absl::Status DeregisterRegion(RegionId region) = 0;
  // Packed descriptor of a local region for a peer's ImportRegion().
  [[nodiscard]] virtual absl::StatusOr<std::string> DescribeRegion(
      RegionId region) = 0;
  // For a kCuda region staged through host buffers (Capabilities::
  // cuda_staged): copies [offset, offset + length) of the device memory to
  // the host buffer peers' reads are served from. A staged region holds the
  // device's bytes as of its registration (and of peers' writes into it);
  // device writes made since are invisible to remote reads until synced.
  // Call it after the device work that wrote the range has completed and
  // before a peer reads it. A no-op for host regions and for kCuda regions
  // moved directly (GPUDirect). Thread-safe; the copy runs on the caller's
  // thread.
  [[nodiscard]] virtual absl::Status SyncStagingFromDevice(RegionId region, uint64_t offset,
                                                           uint64_t length) = 0;

  [[nodiscard]] virtual absl::StatusOr<PeerId> Connect(
      absl::string_view peer_address) = 0;
  // Fails with FailedPrecondition while transfers to the peer are pending.
  [[nodiscard]] virtual absl::Status Disconnect(PeerId peer) = 0;
  [[nodiscard]] virtual absl::StatusOr<RemoteRegionId> ImportRegion(
      PeerId peer, absl::string_view descriptor) = 0;
  [[nodiscard]] virtual absl::Status ReleaseRemoteRegion(
      RemoteRegionId region) = 0;

  // Posts a batch; returns at once. All ops must target regions of `peer`.
  // Offsets and lengths are checked against both regions before anything
  // moves (InvalidArgument / OutOfRange). A non-empty `notification` is
  // delivered to the peer after the whole batch has landed.
  [[nodiscard]] virtual absl::StatusOr<TransferId> PostTransfer(
      PeerId peer, Direction direction, absl::Span<const TransferOp> ops,
      absl::string_view notification = {}) = 0;
  // true: done; false: still moving; error: the transfer failed (the peer
  // died, it was cancelled, it timed out).
  [[nodiscard]] virtual absl::StatusOr<bool> Poll(TransferId transfer) = 0;
  // OK when done; the transfer's error if it failed; DeadlineExceeded if it is
  // still moving after `timeout` (it keeps moving).
  [[nodiscard]] virtual absl::Status Wait(TransferId transfer,
                                          absl::Duration timeout) = 0;
  // Best effort: ops not yet handed to the wire are skipped and no
  // notification is sent. The transfer ends as Cancelled (or OK if it had
  // already completed) once the backend no longer touches its memory.
  [[nodiscard]] virtual absl::Status Cancel(TransferId transfer) = 0;
  // Forgets a finished transfer. FailedPrecondition while still moving.
  [[nodiscard]] virtual absl::Status ReleaseTransfer(TransferId transfer) = 0;

  // Drains notifications received so far.
  [[nodiscard]] virtual std::vector<Notification> TakeNotifications() = 0;
  // Waits for one notification; DeadlineExceeded if none arrives in time.
  [[nodiscard]] virtual absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) = 0;
};

}  // namespace kvserve::transport
