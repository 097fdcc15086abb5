// UCX backend of Transport: one ucp context and one worker, progressed by a
// dedicated thread that is the only thread touching UCX objects (API calls are
// marshalled to it), so the worker runs in single-thread mode without locks.
//
// Endpoints are created from worker addresses exchanged out of band, which
// lets UCX pick shared memory (posix/sysv/cma) between processes of one host
// and tcp/IB across hosts; the sockaddr listener path would only ever use tcp.
// Every endpoint has a peer error handler: a dead peer fails all its pending
// transfers, and a transfer older than `transfer_timeout` declares its peer
// dead, so nothing waits forever.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace kvserve::transport {

struct UcxTransportOptions {
  std::string name = "kvserve";  // agent name, seen by peers in notifications
  std::string tls;               // UCX_TLS, e.g. "posix,cma" or "tcp"; empty:
                                 // environment / UCX default
  std::string net_devices;       // UCX_NET_DEVICES, e.g. "lo"; empty: default
  // Bound on how long any transfer may stay pending; past it the peer is
  // declared failed and all its transfers fail with DeadlineExceeded.
  absl::Duration transfer_timeout = absl::Seconds(10);
  // UCX keepalive; detects a silent peer death without any traffic.
  absl::Duration keepalive_interval = absl::Milliseconds(500);
  // How long the progress thread keeps spinning after the last event before
  // it sleeps in short naps (latency vs. CPU on shared machines).
  absl::Duration spin_after_activity = absl::Milliseconds(2);
  absl::Duration idle_nap = absl::Microseconds(200);
  // Copies for staged GPU regions; default: HostStandInCopier.
  std::shared_ptr<DeviceCopier> device_copier;
  // Stage kCuda regions even when UCX could register them directly (tests).
  bool force_cuda_staging = false;
};

[[nodiscard]] absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(
    UcxTransportOptions options);

}  // namespace kvserve::transport
