// Tenants: the API-key -> tenant map (--api-keys-file) and the prefix-cache
// scope derived from it (docs/cache-control.md). With tenant keys the cache
// namespace of a request is derived on the server from the key that
// authenticated it; a client's cache_salt only narrows that tenant's scope
// (tenant:NAME + 0x1f + salt), so no field a client sends can reach another
// tenant's blocks.
//
// File format: one "KEY TENANT" pair a line (whitespace separated); blank
// lines and lines starting with '#' are skipped. A tenant may have several
// keys; a key names one tenant. Optional third column: the tenant's
// retention budget in bytes (as --cache-retain-budget takes it).
//
// Thread-safety: immutable after Parse.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve {

class TenantKeys {
 public:
  [[nodiscard]] static absl::StatusOr<TenantKeys> Parse(std::string_view text);
  [[nodiscard]] static absl::StatusOr<TenantKeys> FromFile(const std::string& path);

  // The tenant of an "Authorization: Bearer KEY" value (constant-time
  // comparison against every key), nullopt when none matches.
  std::optional<std::string> TenantForAuthorization(std::string_view authorization) const;
  std::optional<std::string> TenantForKey(std::string_view key) const;
  bool empty() const { return keys_.empty(); }
  size_t size() const { return keys_.size(); }
  // Budgets named in the file's third column.
  const std::map<std::string, int64_t>& budgets() const { return budgets_; }

 private:
  std::vector<std::pair<std::string, std::string>> keys_;  // key, tenant
  std::map<std::string, int64_t> budgets_;
};

// The prefix-cache salt of a tenant's request: the tenant's own namespace,
// narrowed by the client's cache_salt. Empty tenant: the salt as given.
std::string TenantCacheScope(std::string_view tenant, std::string_view cache_salt);
// The tenant a scope belongs to ("" for an unscoped salt).
std::string TenantOfScope(std::string_view scope);

}  // namespace kvserve
