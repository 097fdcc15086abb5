// Router: `kvserve route`, the front door of a set of kvserve nodes. It
// speaks the nodes' own kvserve.v1 gRPC API (Generate, Chat, Tokenize,
// Detokenize, GetModelInfo) and, on HTTP (server/router/router_http.h), the
// OpenAI completion routes, /health, /v1/models and /metrics, so clients
// and kvserve-bench point at it unchanged.
//
// Membership: a static list of node addresses (--nodes) and/or a DNS name
// (--nodes-dns, e.g. a Kubernetes headless Service) resolved every second.
// Each node registers through its KvTransfer.GetNodeInfo (id, incarnation,
// role, UCX address, KV regions, KV layout): a node whose layout differs from
// the others' is refused, with the difference named in the log and /health;
// a new incarnation on a known address resets what the router knows of it.
// The router replicates each node's radix prefix index from its
// SubscribeKvEvents stream and polls its load (GetStats).
//
// Placement by predicted seconds (docs/disaggregation.md):
//   T_local(D)  = queue(D) + uncached(D) x prefill_rate(D) + decode_load(D)
//   T_remote    = queue(P) + uncached(P) x prefill_rate(P)
//                 + uncached(D) x bytes_per_token / bandwidth(P->D) + control
//                 + decode_load(D)
// with uncached(X) = prompt tokens past X's cached prefix (from the replica),
// the rates from each node's fitted step cost, the bandwidth from the decode
// nodes' measured pulls. A request runs entirely on a decode node when its
// uncached part there is short (--pd-min-remote-tokens) or T_local wins
// (conditional disaggregation); otherwise the chosen prefill node prefills
// and leases, the decode node pulls, and the router streams the decode
// node's reply back (Generate, Chat and both OpenAI completion routes; the
// prefill node receives a chat request as sent and renders it itself). A
// Prefill that fails node-side is retried on the next-best prefill node
// within the request's deadline. Whatever happens, the router releases the lease when
// the request ends. With only role-both nodes the router is a cache-aware
// balancer (--policy kv) or round-robin (--policy round-robin).
//
// Thread-safety: RPC handlers run on gRPC's sync threads; HTTP on the front
// end's fixed I/O and handler threads; membership, stats and event
// subscriptions on their own threads; shared state under mutexes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve {

struct RouterOptions {
  std::string grpc_address = "127.0.0.1:50050";
  int http_port = 0;  // OpenAI routes, /health, /v1/models, /metrics; -1: none
  std::string http_host = "127.0.0.1";
  std::string port_file;
  std::vector<std::string> nodes;  // host:port of the nodes' gRPC
  std::string nodes_dns;           // name:port, every A record is a node
  std::string policy = "kv";       // kv | round-robin
  std::string pd_mode = "auto";    // auto | always | never
  int32_t pd_min_remote_tokens = 256;
  uint32_t lease_ttl_ms = 0;  // 0: the prefill node's --pd-lease-ttl
  // Ask prefill nodes for progressive leases, so decode nodes pull each
  // block while the rest of the prompt is computed (--pd-overlap; off by
  // default: no gain measured on CPU pools, docs/disaggregation.md).
  bool overlap = false;
  std::string api_key;        // sent to nodes, required from clients when set
  // --metrics-auth none: GET /metrics needs no API key (for Prometheus), as
  // on a node; every other route still does.
  bool metrics_without_key = false;
  int poll_ms = 300;          // how often each node's NodeInfo and stats are polled
  // Fault-injection tests only: the request thread stops (until the router
  // is killed) once the lease is "granted" (before AttachLease) or
  // "attached" (before Generate).
  std::string test_stall;
};

class Router {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Router>> Start(RouterOptions options);
  ~Router();
  int grpc_port() const;
  int http_port() const;
  // Blocks until SIGTERM/SIGINT (REQUIRES: blocked before threads started).
  void WaitForSignal();
  void Shutdown();

 private:
  struct Impl;
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
