// The `kvserve serve` flags of prefill/decode disaggregation (one block, so
// the rest of serve_flags stays untouched). docs/disaggregation.md explains
// them; docs/serving.md lists them.
//
// Plain data.
#pragma once

#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace kvserve {

struct PdFlags {
  std::string role = "both";  // prefill | decode | both
  std::string node_id;        // empty: <hostname>:<grpc port>
  // The host peers and the router reach this node's gRPC port on.
  std::string advertise_host = "127.0.0.1";
  std::string ucx_tls;          // UCX_TLS for KV transfers; empty: UCX's choice
  std::string ucx_net_devices;  // UCX_NET_DEVICES; empty: UCX's choice
  double lease_ttl = 30;         // seconds a prefill node holds unclaimed blocks
  double transfer_timeout = 10;  // seconds a decode node's pull may take
  // Seconds a decode node keeps renewing an attached lease that no request
  // has claimed yet while requests wait for admission (a transiently full
  // pool or seat limit), counted from the attach.
  double admission_wait = 120;
  // Prefill: the codec leased blocks travel in (same: the pool's bytes;
  // int8, fp8-e4m3, int4-kivi: re-encoded, smaller, lossy), for links
  // where bandwidth is the bottleneck.
  std::string wire_dtype = "same";
  bool test_hooks = false;       // DebugEarlyFree (fault-injection tests only)
  double test_pull_delay = 0;    // seconds a decode node stalls each pull (tests only)
  // Seconds over which a prefill node reveals a progressive lease's blocks,
  // block i of n after (i + 1) / n of them (tests only).
  double test_progress_delay = 0;
};

void AddPdFlags(CLI::App* app, PdFlags* flags);

}  // namespace kvserve
