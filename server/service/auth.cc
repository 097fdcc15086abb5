// Who is calling, for every front end (see auth.h).
#include "server/service/auth.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "server/service/tenants.h"

namespace kvserve {

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool BearerTokenMatches(std::string_view authorization, std::string_view api_key) {
  if (api_key.empty()) return true;
  constexpr std::string_view kBearer = "Bearer ";
  // absl's string_view is its own type in Debian's build.
  if (!absl::StartsWithIgnoreCase(absl::string_view(authorization.data(), authorization.size()),
                                  absl::string_view(kBearer.data(), kBearer.size()))) {
    return false;
  }
  return ConstantTimeEquals(authorization.substr(kBearer.size()), api_key);
}

Authenticator::Authenticator(std::string api_key, std::shared_ptr<const TenantKeys> tenant_keys)
    : api_key_(std::move(api_key)), tenant_keys_(std::move(tenant_keys)) {}

bool Authenticator::has_tenants() const {
  return tenant_keys_ != nullptr && !tenant_keys_->empty();
}

absl::StatusOr<CallerAuth> Authenticator::Check(std::string_view authorization,
                                                bool admin_only) const {
  if (open()) return CallerAuth{};
  if (!api_key_.empty() && BearerTokenMatches(authorization, api_key_)) return CallerAuth{};
  if (has_tenants()) {
    if (std::optional<std::string> tenant = tenant_keys_->TenantForAuthorization(authorization)) {
      if (admin_only) {
        return absl::PermissionDeniedError("this admin call takes the operator's key (--api-key)");
      }
      return CallerAuth{false, *tenant};
    }
  }
  return absl::UnauthenticatedError(
      authorization.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                            : "invalid API key: send 'Authorization: Bearer <key>'");
}

}  // namespace kvserve
