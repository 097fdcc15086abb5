// In-process Transport: agents created in one process find each other through
// a process-wide registry and move bytes with memcpy (kCuda regions through
// the DeviceCopier). Same contract as the UCX backend, no threads, no
// sockets: the fake that modules above transport/ test against.
//
// Transfers complete inside PostTransfer. Destroying an agent makes its peers'
// later transfers fail with Unavailable, like a dead process would.
#pragma once

#include <memory>
#include <string>

#include "transport/device_memory.h"
#include "transport/transport.h"

namespace kvserve::transport {

struct LoopbackTransportOptions {
  std::string name = "loopback";
  std::shared_ptr<DeviceCopier> device_copier;  // default: HostStandInCopier
};

std::unique_ptr<Transport> CreateLoopbackTransport(
    LoopbackTransportOptions options = {});

}  // namespace kvserve::transport
