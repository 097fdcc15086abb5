// The implementation of pd_flags.h. What it owns and how it is used: the
// opening paragraph of server/pd/pd_flags.h.

#include "server/pd/pd_flags.h"

#include "CLI/CLI.hpp"

namespace kvserve {

void AddPdFlags(CLI::App* app, PdFlags* f) {
  app->add_option("--role", f->role,
                  "Node role: both (prefill and decode here), prefill (lease KV to decode "
                  "nodes) or decode (pull KV from prefill nodes)")
      ->check(CLI::IsMember({"both", "prefill", "decode"}))
      ->capture_default_str();
  app->add_option("--pd-node-id", f->node_id,
                  "Node id in prefill/decode disaggregation (empty: hostname:grpc-port)")
      ->capture_default_str();
  app->add_option("--pd-advertise-host", f->advertise_host,
                  "Host the router and peer nodes reach this node's gRPC port on")
      ->capture_default_str();
  app->add_option("--pd-ucx-tls", f->ucx_tls,
                  "UCX_TLS for KV transfers, e.g. posix,cma or tcp (empty: UCX's choice)")
      ->capture_default_str();
  app->add_option("--pd-ucx-net-devices", f->ucx_net_devices,
                  "UCX_NET_DEVICES for KV transfers, e.g. lo (empty: UCX's choice)")
      ->capture_default_str();
  app->add_option("--pd-lease-ttl", f->lease_ttl,
                  "Seconds a prefill node holds leased KV blocks no decode node released")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app->add_option("--pd-transfer-timeout", f->transfer_timeout,
                  "Seconds a decode node's pull of one lease may take before it recomputes")
      ->check(CLI::Range(0.1, 600.0))
      ->capture_default_str();
  app->add_option("--pd-admission-wait", f->admission_wait,
                  "Seconds a decode node keeps an attached lease alive (renewing it) while "
                  "requests wait for admission; past it the lease goes back and the request "
                  "recomputes")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app->add_option("--kv-wire-dtype", f->wire_dtype,
                  "Prefill: the codec leased KV blocks move in (same: the pool's own bytes; "
                  "int8, fp8-e4m3, int4-kivi: re-encoded smaller and lossy, for links where "
                  "bandwidth is the bottleneck; decode nodes decode them into their pool)")
      ->check(CLI::IsMember({"same", "int8", "fp8-e4m3", "int4-kivi"}))
      ->capture_default_str();
  app->add_flag("--pd-test-hooks", f->test_hooks,
                "Enable the DebugEarlyFree fault-injection RPC (tests only)");
  app->add_option("--pd-test-pull-delay", f->test_pull_delay,
                  "Seconds a decode node stalls before each pull, renewing the lease meanwhile "
                  "(a slow link; tests only)")
      ->check(CLI::Range(0.0, 600.0))
      ->capture_default_str();
  app->add_option("--pd-test-progress-delay", f->test_progress_delay,
                  "Seconds over which a prefill node reveals a progressive lease's blocks, "
                  "block i of n after (i + 1) / n of them (a slow prefill; tests only)")
      ->check(CLI::Range(0.0, 600.0))
      ->capture_default_str();
}

}  // namespace kvserve
