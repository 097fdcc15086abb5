// The router's HTTP front end (`kvserve route --http-port`): OpenAI
// /v1/completions and /v1/chat/completions proxied to the decode node the
// router places each request on, /health, /v1/models and /metrics, on
// Boost.Beast / Asio like the node's own server (server/frontend/http_server.cc).
//
// Threads: `io_threads` threads run one io_context; each client connection
// is a session on its own strand (a socket, a buffer and a parser, never a
// thread). The blocking step of a completion (placement, and on a
// disaggregated request the prefill and AttachLease gRPC calls) and the
// lease's release run on a fixed handler pool of `handler_threads`.
//
// Upstream: one pool of keep-alive connections per decode node (host:port),
// reused across requests and sessions, at most `upstream_idle_per_node`
// idle ones kept. A connection that fails is discarded; the request is
// retried once on a fresh connection if nothing was sent to the client yet.
// A streamed reply is relayed chunk by chunk as it arrives (async reads
// upstream, async writes to the client). A client that goes away closes the
// upstream connection, which cancels the request on the node, and the
// request's `done` (the lease's release) runs whatever happened.
//
// This file owns the transport only; what a request means (auth, placement,
// the lease, the node list) is RouterHttpBackend's (server/router/router.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvserve {

struct RouterHttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0 picks a free port
  int io_threads = 2;
  int handler_threads = 4;
  int64_t max_request_bytes = 1 << 20;  // larger bodies get 413
  int64_t max_header_bytes = 16384;     // request line + headers; 431 above
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(60)};  // keep-alive wait
  std::chrono::milliseconds read_timeout{std::chrono::seconds(30)};  // a request's bytes
  std::chrono::milliseconds write_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(10)};
  // The longest a node may stay silent (a non-streamed reply is silent
  // until it is done; streams carry heartbeats every 2 s).
  std::chrono::milliseconds upstream_timeout{std::chrono::seconds(600)};
  int upstream_idle_per_node = 8;
  // GET /metrics answered without the API key (--metrics-auth none).
  bool metrics_without_key = false;
};

// Where a placed completion goes and what ends it.
struct UpstreamTarget {
  std::string http_address;  // host:port of the decode node's HTTP API
  // Runs once when the exchange ends, however it ends (may block: it
  // releases the lease); on the handler pool.
  std::function<void()> done;
};

// What the front end asks of the router. Every method may be called from
// any I/O or handler thread.
class RouterHttpBackend {
 public:
  virtual ~RouterHttpBackend() = default;
  // The `Authorization` header's check (OK, or UNAUTHENTICATED naming why).
  virtual absl::Status Authenticate(std::string_view authorization) = 0;
  // Places one completion (`path` is the route, `body` the client's JSON).
  // Blocks (prefill, AttachLease); runs on the handler pool.
  virtual absl::StatusOr<UpstreamTarget> Place(const std::string& path,
                                               const std::string& body) = 0;
  // /health's JSON; *ready when a decode-capable node is registered.
  virtual std::string Health(bool* ready) = 0;
  // /v1/models's `data` entries (a JSON array).
  virtual std::string ModelsJson() = 0;
  // The router's own Prometheus samples (nodes, placements).
  virtual std::string MetricsText() = 0;
};

class RouterHttp {
 public:
  // Listens on options.host:port and serves until Stop.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<RouterHttp>> Start(
      RouterHttpOptions options, RouterHttpBackend* backend);
  ~RouterHttp();
  int port() const;
  // Closes the listener and every connection; joins the threads.
  void Stop();

 private:
  struct Impl;
  explicit RouterHttp(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
