// absl::Status to gRPC and HTTP, and the gRPC caller check (see status_map.h).
#include "server/frontend/status_map.h"

#include <string>

namespace kvserve {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(s.code());
  if (code < 0 || code > static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, std::string(s.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(s.message()));
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

absl::StatusOr<CallerAuth> AuthorizeGrpc(const Authenticator& auth,
                                         const grpc::ServerContextBase& ctx, bool admin_only) {
  if (auth.open()) return CallerAuth{};
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  const std::string_view value =
      it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  return auth.Check(value, admin_only);
}

}  // namespace kvserve
