// The one mapping from absl::Status (what every layer below the front ends
// returns) to what goes on the wire: the gRPC status and the HTTP status
// code, plus the gRPC front ends' one reading of the caller's key from call
// metadata. The HTTP, gRPC, P/D node and router front ends all use these.
//
// Thread-safety: pure functions.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "server/service/auth.h"

namespace kvserve {

// absl and gRPC share the canonical codes 0..16: one to one; a code outside
// that range (a bug) becomes UNKNOWN with the message kept.
grpc::Status ToGrpc(const absl::Status& s);

// The HTTP status an error answers with (400 for a bad request, 401/403,
// 404, 429 for exhaustion, 503 unavailable, 504 deadline, else 500).
int HttpStatusFor(absl::StatusCode code);

// The caller of a gRPC call: its "authorization" metadata checked by auth.
absl::StatusOr<CallerAuth> AuthorizeGrpc(const Authenticator& auth,
                                         const grpc::ServerContextBase& ctx, bool admin_only);

}  // namespace kvserve
