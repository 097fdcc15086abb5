// Who is calling, decided once for every front end (HTTP, gRPC, the P/D
// node, the router): one constant-time comparison, one reading of
// "Authorization: Bearer <key>", one rule for operator and tenant keys, and
// one wording of the refusals. The front ends only fetch the header (or the
// gRPC metadata) and map the status (server/frontend/status_map.h).
//
// Thread-safety: pure functions; an Authenticator is immutable after
// construction and may be shared between threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvserve {

// Compares in time independent of where the strings differ, so the key
// cannot be guessed byte by byte from response times (the length is not
// secret).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// Whether an Authorization header value (HTTP) or metadata value (gRPC)
// carries `api_key` as a bearer token. The scheme is case-insensitive
// (RFC 7235); an empty `api_key` means no key is required and always matches.
bool BearerTokenMatches(std::string_view authorization, std::string_view api_key);

class TenantKeys;

// Who is calling: the operator (admin) or a tenant.
struct CallerAuth {
  bool admin = true;
  std::string tenant;  // "" without tenant keys, or for the operator
};

class Authenticator {
 public:
  // api_key: the operator's key (--api-key; empty: none). tenant_keys
  // (optional, may be empty): keys that each name a tenant.
  explicit Authenticator(std::string api_key,
                         std::shared_ptr<const TenantKeys> tenant_keys = nullptr);

  // Whether any key is required at all.
  bool open() const { return api_key_.empty() && !has_tenants(); }

  // The caller an Authorization value (HTTP header or gRPC metadata; absent:
  // empty) names. UNAUTHENTICATED for no or a wrong key; PERMISSION_DENIED
  // when admin_only and the key is a tenant's. The operator's key, or no key
  // where none is configured, is the admin.
  absl::StatusOr<CallerAuth> Check(std::string_view authorization, bool admin_only) const;

  const std::string& api_key() const { return api_key_; }

 private:
  bool has_tenants() const;

  std::string api_key_;
  std::shared_ptr<const TenantKeys> tenant_keys_;
};

}  // namespace kvserve
