// GrpcServer: the kvserve.v1 gRPC API over the callback (reactor) API, so
// thousands of concurrent streams need no thread each. A client cancel or
// deadline cancels the request in the engine at once. Health checking and
// server reflection are on, so grpcurl works without the proto file.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/service/cache_control_service.h"
#include "server/service/model_service.h"
#include "server/service/tenants.h"

namespace grpc {
class Service;
}  // namespace grpc
namespace kvserve::v1 {
class GenerateRequest;
class ChatRequest;
}  // namespace kvserve::v1

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace kvserve {

// A request message's fields this build does not know (a newer client's,
// which protobuf keeps as unknown fields) are refused, InvalidArgument
// naming the field number and where, rather than silently ignored (issue
// 44). Walks nested messages.
absl::Status RefuseUnknownProtoFields(const google::protobuf::Message& m, const std::string& where);

struct GrpcServerOptions {
  std::string address = "127.0.0.1:50051";  // port 0 picks a free port
  std::string api_key;   // when set, required as metadata "authorization: Bearer <key>"
  std::string tls_cert;  // PEM files; both set enables TLS
  std::string tls_key;
  // Cache control (docs/cache-control.md): tenant keys and the CacheControl call.
  std::shared_ptr<const TenantKeys> tenant_keys;
  CacheControlService* cache_control = nullptr;
  // More services on the same port (the prefill/decode KvTransfer service);
  // not owned, they must outlive the server.
  std::vector<grpc::Service*> extra_services;
};

// The CompletionParams of a kvserve.v1 GenerateRequest, as Generate reads it
// (a prefill node prepares the prompt exactly as the decode node will).
[[nodiscard]] absl::StatusOr<CompletionParams> GenerateRequestToParams(
    const kvserve::v1::GenerateRequest& request);
// The same for a kvserve.v1 ChatRequest, as Chat reads it.
[[nodiscard]] absl::StatusOr<CompletionParams> ChatRequestToParams(
    const kvserve::v1::ChatRequest& request);

class GrpcServer {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(
      ModelService* service, const GrpcServerOptions& options);
  ~GrpcServer();
  int port() const;
  // Stops accepting RPCs; in-flight ones run until `deadline`, then are
  // cancelled. Returns when the server is down.
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  struct Impl;
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
