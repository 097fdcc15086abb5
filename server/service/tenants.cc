// The implementation of Tenants. What it owns and how it is used: the
// opening paragraph of server/service/tenants.h.

#include "server/service/tenants.h"

#include <cctype>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "cache/memory_planner.h"
#include "server/service/auth.h"

namespace kvserve {

absl::StatusOr<TenantKeys> TenantKeys::Parse(std::string_view text) {
  TenantKeys t;
  std::istringstream in{std::string(text)};
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::istringstream fields(line);
    std::string key, tenant, budget, extra;
    if (!(fields >> key) || key[0] == '#') continue;
    if (!(fields >> tenant)) {
      return absl::InvalidArgumentError(
          absl::StrCat("api keys file line ", n, ": expected 'KEY TENANT [BUDGET]'"));
    }
    if (fields >> budget) {
      absl::StatusOr<int64_t> b = ParseMemoryBudget(budget);
      if (!b.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("api keys file line ", n, ": budget '",
                                                       budget, "': ", b.status().message()));
      }
      t.budgets_[tenant] = *b;
    }
    if (fields >> extra) {
      return absl::InvalidArgumentError(
          absl::StrCat("api keys file line ", n, ": expected 'KEY TENANT [BUDGET]'"));
    }
    for (const auto& [k, other] : t.keys_) {
      if (k == key) {
        return absl::InvalidArgumentError(
            absl::StrCat("api keys file line ", n, ": the key is given twice"));
      }
    }
    t.keys_.emplace_back(key, tenant);
  }
  if (t.keys_.empty()) return absl::InvalidArgumentError("api keys file names no key");
  return t;
}

absl::StatusOr<TenantKeys> TenantKeys::FromFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read --api-keys-file ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  absl::StatusOr<TenantKeys> t = Parse(ss.str());
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--api-keys-file ", path, ": ", t.status().message()));
  }
  return t;
}

std::optional<std::string> TenantKeys::TenantForKey(std::string_view key) const {
  std::optional<std::string> found;
  // Every key is compared (no early exit), each in constant time.
  for (const auto& [k, tenant] : keys_) {
    if (ConstantTimeEquals(key, k) && !found) found = tenant;
  }
  return found;
}

std::optional<std::string> TenantKeys::TenantForAuthorization(std::string_view authorization) const {
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() < kBearer.size()) return std::nullopt;
  for (size_t i = 0; i < kBearer.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(authorization[i])) !=
        std::tolower(static_cast<unsigned char>(kBearer[i]))) {
      return std::nullopt;
    }
  }
  return TenantForKey(authorization.substr(kBearer.size()));
}

std::string TenantCacheScope(std::string_view tenant, std::string_view cache_salt) {
  if (tenant.empty()) return std::string(cache_salt);
  std::string s = "tenant:";
  s.append(tenant);
  s.push_back('\x1f');
  s.append(cache_salt);
  return s;
}

std::string TenantOfScope(std::string_view scope) {
  constexpr std::string_view kPrefix = "tenant:";
  if (scope.substr(0, kPrefix.size()) != kPrefix) return "";
  const size_t end = scope.find('\x1f');
  return std::string(scope.substr(kPrefix.size(), end == std::string_view::npos
                                                      ? std::string_view::npos
                                                      : end - kPrefix.size()));
}

}  // namespace kvserve
