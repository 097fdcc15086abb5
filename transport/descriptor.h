// Wire formats exchanged out of band: the packed region descriptor and the
// packed peer address. Both are versioned, length-checked and checksummed so a
// truncated or corrupted blob is rejected with a message instead of being
// turned into a wild remote address.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace kvserve::transport {

struct RegionDescriptor {
  std::string backend;         // "ucx" / "loopback": must match the importer
  uint64_t agent_id = 0;       // random id of the owning Transport instance
  RegionId region = 0;         // the owner's handle
  MemoryKind kind = MemoryKind::kHost;
  // The owner exposes a host staging buffer for a GPU region: writes land
  // there and are copied to the device before the notification is delivered.
  bool staged = false;
  uint64_t remote_address = 0; // address the peer targets (staging if staged)
  uint64_t length = 0;
  std::string rkey;            // backend-specific remote key, may be empty
};

std::string PackRegionDescriptor(const RegionDescriptor& descriptor);
absl::StatusOr<RegionDescriptor> UnpackRegionDescriptor(absl::string_view blob);

struct PeerAddress {
  std::string backend;
  uint64_t agent_id = 0;
  std::string name;     // agent name, for logs and notifications
  std::string address;  // backend-specific (UCX worker address)
  // Identifies the process so a peer on the same host (same boot and PID
  // namespace) can check it is alive where the transport cannot tell.
  std::string host_id;          // boot id + PID namespace; empty: unknown
  uint64_t pid = 0;
  uint64_t start_time = 0;      // /proc/<pid>/stat start time, beats PID reuse
};

std::string PackPeerAddress(const PeerAddress& address);
absl::StatusOr<PeerAddress> UnpackPeerAddress(absl::string_view blob);

// This process's host_id / start time as used in PeerAddress.
std::string LocalHostId();
uint64_t ProcessStartTime(uint64_t pid);  // 0: no such (live) process

// 64-bit FNV-1a; also used by tests and the benchmark to checksum bytes.
uint64_t Fnv1a64(const void* data, size_t length, uint64_t seed = 0);

// [offset, offset + length) lies inside a region of `size` bytes (no
// overflow).
bool InRange(uint64_t offset, uint64_t length, uint64_t size);

// The byte-range checks every backend applies to op `index` of a batch
// before moving anything: a non-zero length inside both regions. Messages
// name the op and the region.
[[nodiscard]] absl::Status CheckOpRanges(size_t index, const TransferOp& op,
                                         uint64_t local_length, uint64_t remote_length);

}  // namespace kvserve::transport
