// API-key checks shared by the gRPC and the HTTP front ends (see auth.h).
#include "server/auth.h"

#include "absl/strings/match.h"

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

}  // namespace kvserve
