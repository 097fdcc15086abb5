// HttpServer: the OpenAI-compatible HTTP API (/v1/completions,
// /v1/chat/completions with and without server-sent events, /v1/models) plus
// /health and /metrics, on its own port.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/model_service.h"

namespace kvserve {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0 picks a free port
  std::string api_key;              // when set, "Authorization: Bearer <key>" is required (not for /health)
  std::string tls_cert;             // PEM files; both set serves HTTPS
  std::string tls_key;
  int64_t max_request_bytes = 1 << 20;  // larger bodies get 413
};

class HttpServer {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      ModelService* service, const HttpServerOptions& options);
  ~HttpServer();
  int port() const;
  // Stops accepting connections and waits for the listener thread.
  void Stop();

 private:
  struct Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
