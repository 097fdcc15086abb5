// HttpServer: the OpenAI-compatible HTTP API (/v1/completions,
// /v1/chat/completions with and without server-sent events, /v1/models) plus
// /health, /metrics and /admin/clear_prefix_cache, on its own port.
//
// Event-driven (Boost.Beast on Asio): a fixed number of I/O threads serve
// every connection, idle or streaming; no thread belongs to a connection or
// a stream. Requests that may block (tokenizing a long prompt, clearing the
// prefix cache) run on a pool of the same fixed size.
//
// Thread-safety: Start, port and Stop from one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/service/cache_control_service.h"
#include "embed/embedder.h"
#include "server/service/model_service.h"
#include "server/service/tenants.h"

namespace kvserve {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0 picks a free port
  std::string api_key;              // when set, "Authorization: Bearer <key>" is required (not for /health)
  std::string tls_cert;             // PEM files; both set serves HTTPS
  std::string tls_key;
  int64_t max_request_bytes = 1 << 20;  // larger bodies get 413
  int32_t io_threads = 2;               // I/O threads (and as many handler threads)
  // Open connections at most. At the limit the longest-idle keep-alive
  // connection is closed to make room; when none is idle the new one gets
  // 503 and is closed.
  int64_t max_connections = 16384;
  int64_t max_header_bytes = 16384;  // request line + headers; 431 above
  // --metrics-auth none: GET /metrics is answered without the API key (like
  // /health), for a Prometheus that holds no secret.
  bool metrics_without_key = false;
  // A connection waiting for a request's first byte (new, or kept alive
  // after a response) is closed after idle_timeout; a request's headers must
  // arrive within header_timeout of its first byte, its body within
  // body_timeout of the headers; a response write that makes no progress for
  // write_timeout disconnects the client and cancels its request.
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds header_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds body_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds write_timeout{std::chrono::seconds(30)};
  // Cache control (docs/cache-control.md): tenant keys (--api-keys-file;
  // each authenticates as its tenant, api_key stays the operator's) and the
  // /admin/cache/... calls. Null: none.
  std::shared_ptr<const TenantKeys> tenant_keys;
  CacheControlService* cache_control = nullptr;
  // POST /v1/embeddings (server/frontend/openai_utility.h): the semantic cache's
  // sentence encoder and the model name clients send; null: 404.
  const TextEmbedder* embedder = nullptr;
  std::string embedding_model;
};

class HttpServer {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      ModelService* service, const HttpServerOptions& options);
  ~HttpServer();
  int port() const;
  // Stops accepting, cancels the requests still in flight (their clients get
  // the shutdown 503 or error event when it can still be written), closes
  // every connection and joins the threads.
  void Stop();

 private:
  struct Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
