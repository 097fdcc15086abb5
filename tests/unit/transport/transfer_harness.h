// Test support for multi-process transport tests: spawns a peer process
// (fork + exec of transport_test_peer, optionally inside a network
// namespace) that owns a target region, and drives random scatter-gather
// batches against it, checking every byte by checksum.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/oob_channel.h"
#include "transport/transport.h"

namespace kvserve::transport::testing {

// Content of the peer's region before any write.
inline uint8_t InitialByte(uint64_t index, uint64_t seed) {
  return static_cast<uint8_t>((index * 131 + seed * 7 + (index >> 9)) & 0xff);
}

// Word-at-a-time checksum: every byte counts, ~10x faster than FNV on
// hundreds of MiB of test traffic.
inline uint64_t Checksum(const void* data, size_t length) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x9e3779b97f4a7c15ull ^ length;
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, p + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 29;
  }
  for (; i < length; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

struct PeerConfig {
  std::string name = "peer";
  std::string tls;
  std::string net_devices;
  std::string netns;  // run inside `ip netns exec <netns>` when set
  uint64_t region_bytes = 4 << 20;
  uint64_t seed = 1;
  bool user_memory = false;  // register malloc'd memory instead of allocating
  bool staged = false;       // register as kCuda with forced staging
};

// A running peer. Closing the channel makes it exit; the destructor reaps it.
class PeerProcess {
 public:
  static absl::StatusOr<PeerProcess> Spawn(const PeerConfig& config);
  PeerProcess(PeerProcess&&) noexcept;
  PeerProcess& operator=(PeerProcess&&) = delete;
  ~PeerProcess();

  void Kill();  // SIGKILL and reap
  OobChannel& channel() { return channel_; }
  const std::string& address() const { return address_; }
  const std::string& descriptor() const { return descriptor_; }
  const PeerConfig& config() const { return config_; }

 private:
  PeerProcess(pid_t pid, OobChannel channel, PeerConfig config)
      : pid_(pid), channel_(std::move(channel)), config_(std::move(config)) {}
  pid_t pid_;
  OobChannel channel_;
  PeerConfig config_;
  std::string address_;
  std::string descriptor_;
};

// The initiator's view of one connected peer.
struct PeerSession {
  PeerId peer = 0;
  RemoteRegionId remote = 0;
  std::vector<uint8_t> shadow;  // what the peer's region must hold
};

absl::StatusOr<PeerSession> ConnectToPeer(Transport& transport,
                                          PeerProcess& process);

struct BatchStats {
  int write_batches = 0;
  int read_batches = 0;
  uint64_t bytes = 0;
  uint64_t pieces = 0;
};

// Runs random write/read batches of 1..16 pieces (a third of them exactly
// 64 KiB, KV-block sized). Each write batch carries a notification listing
// the checksum of every piece; the peer verifies them when the notification
// arrives and acks over the channel. Reads are checked against the shadow.
absl::Status RunRandomBatches(Transport& transport, const LocalRegion& local,
                              PeerSession& session, PeerProcess& process,
                              int batches, std::mt19937_64& rng,
                              BatchStats* stats);

// Asks the peer for a checksum of its whole region and compares it with the
// shadow: every byte, including the ones never written.
absl::Status VerifyWholeRegion(PeerSession& session, PeerProcess& process);

}  // namespace kvserve::transport::testing
