// Daemon: `kvserve serve` as an object. It owns the daemon's start-up (API
// key, served name, chat template, KV event log, engine, ModelService, the
// gRPC and HTTP servers, the port file), waits for SIGTERM/SIGINT, and owns
// the drain: new requests are refused, in-flight ones get --drain-timeout
// seconds, the rest are cancelled, then the servers and the engine stop.
// Also here: how ServeFlags become the services' options.
//
// Thread-safety: Start, WaitForSignalAndDrain and Drain are called from the
// main thread; the servers' and the engine's own threads run inside. Signals
// arrive through sigwait, so BlockShutdownSignals must run before any thread
// exists.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "cache/kv_event_log.h"
#include "common/thread_pool.h"
#include "scheduler/engine.h"
#include "server/app/command.h"
#include "server/frontend/grpc_server.h"
#include "server/frontend/http_server.h"
#include "server/observe/kv_events_zmq.h"
#include "server/observe/metrics.h"
#include "server/service/model_service.h"
#include "server/pd/pd_node.h"
#include "server/service/response_cache.h"
#include "server/service/semantic_cache.h"
#include "server/app/serve_flags.h"

namespace kvserve {

// --api-key, or the trimmed contents of --api-key-file (InvalidArgument when
// it is empty, NotFound when unreadable); InvalidArgument unless --tls-cert
// and --tls-key come together.
[[nodiscard]] absl::StatusOr<std::string> ApiKeyFromFlags(const ServeFlags& flags);
// --served-model-name, or the model's file name without ".gguf".
std::string ServedModelName(const ServeFlags& flags, const std::string& model_path);
// --max-queued, --max-n, --default-max-tokens and the --kv-* defaults;
// InvalidArgument naming the flag for a bad kv-policy default.
[[nodiscard]] absl::StatusOr<ServiceLimits> ServiceLimitsFromFlags(const ServeFlags& flags);
GrpcServerOptions GrpcOptionsFromFlags(const ServeFlags& flags, const std::string& api_key);
HttpServerOptions HttpOptionsFromFlags(const ServeFlags& flags, const std::string& api_key);
// --response-cache-bytes and --response-cache-ttl (InvalidArgument naming the
// flag); max_bytes 0 turns the cache off.
[[nodiscard]] absl::StatusOr<ResponseCacheOptions> ResponseCacheOptionsFromFlags(
    const ServeFlags& flags);

// Health answers while the model loads (before Daemon::Start can build the
// real servers, which need the model): on --http-port, GET /health/live is
// 200 and every other path 503 "loading"; on --grpc-address the standard
// gRPC health service reports NOT_SERVING (overall and for kvserve.v1.Kvserve).
// A listener whose port is 0 (ephemeral) is not opened: nobody could probe
// it, and the real server would get another port. Stop() frees the ports
// for the real servers; the gap is milliseconds.
class LoadingProbes {
 public:
  // Failing to listen is not fatal (logged): the real servers report it.
  static std::unique_ptr<LoadingProbes> Start(const ServeFlags& flags);
  ~LoadingProbes();
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class Daemon {
 public:
  // Blocks SIGTERM and SIGINT for the calling thread and every thread it
  // creates later, so that only WaitForSignalAndDrain's sigwait takes them.
  // REQUIRES: called on the main thread before any other thread exists.
  static void BlockShutdownSignals();

  // Builds everything and starts serving; on return both ports listen and
  // the port file (if any) is written. `model` must outlive the daemon.
  // `probes` (optional) are stopped just before the real servers start.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const LoadedModel& model, const std::string& model_path, const ServeFlags& flags,
      const EngineFlags& engine_flags, ThreadPool* pool, LoadingProbes* probes = nullptr);

  // Stops whatever still runs (without a drain).
  ~Daemon();

  // Blocks until SIGTERM or SIGINT, then Drain()s; a second one during the
  // drain exits the process at once with status 1.
  // REQUIRES: BlockShutdownSignals() ran before any thread was created.
  void WaitForSignalAndDrain();

  // Refuses new requests, waits up to --drain-timeout for the in-flight
  // ones, cancels the rest, then stops the KV event stream, the servers and
  // the engine. `reason` starts the log line ("SIGTERM").
  void Drain(const std::string& reason);

  int grpc_port() const { return grpc_->port(); }
  int http_port() const { return http_->port(); }

 private:
  Daemon() = default;

  ServeFlags flags_;
  // Declared in construction order; destroyed in reverse (servers first).
  std::unique_ptr<KvEventLog> kv_events_;
  // --kv-events-endpoint: the log in vLLM's format (null when off).
  std::unique_ptr<VllmEventPublisher> vllm_events_;
  // Before the engine: a decode node's KvLoader must outlive it (Shutdown()
  // releases the leases first).
  std::unique_ptr<PdNode> pd_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ResponseCache> response_cache_;  // null when off
  std::unique_ptr<TextEmbedder> embedder_;         // null without --semantic-cache-model
  std::unique_ptr<SemanticIndex> semantic_;
  std::unique_ptr<ModelService> service_;
  // Cache control (docs/cache-control.md).
  std::shared_ptr<const TenantKeys> tenant_keys_;
  std::unique_ptr<TemplateDriftGuard> drift_;
  std::unique_ptr<CacheControlService> cache_control_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<HttpServer> http_;
  bool stopped_ = false;
};

}  // namespace kvserve
