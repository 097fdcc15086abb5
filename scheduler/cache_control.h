// CacheControl: binding retention leases on the radix prefix cache and the
// cache-miss explainer (docs/cache-control.md).
//
// Retention. A lease pins the full blocks of a cached prefix the way a
// running sequence does: it holds one pool reference on each, so the prefix
// cache can never evict them (PrefixCache's pinning is the refcount). The
// answer is binding: granted (bytes, TTL, tier), clipped (only part of the
// asked range is cached, or the TTL was capped: what was kept is said), or
// refused (tenant_budget, pool_too_small, not_cached). When the TTL lapses
// the references go and the blocks are ordinary cached blocks again: the
// next eviction may take them, and with tiers configured it demotes them
// (write-back) rather than dropping them.
//
// Explain. What a prompt would get from the cache now, and why the rest
// misses: never seen, diverged from the nearest cached prefix at token N,
// scope mismatch (cached under another namespace), evicted (when, by which
// policy, where it went), or retained-but-expired. The explainer keeps a
// bounded history of evicted and of lease-expired block hashes for this.
//
// Threads: every method taking a KvCacheManager runs on the engine thread
// (through the Engine's named KV operations: Engine::Retain, RenewLease,
// ReleaseLease, ListLeases, ExplainCache, MarkPublic, UnmarkPublic; tests
// call them directly). stats() may be called from any thread
// (server/observe/metrics.h renders it).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "cache/prefix_cache.h"

namespace kvserve {

class KvCacheManager;
class KvTiers;

struct CacheControlOptions {
  // Retained bytes per tenant at most; a tenant named in tenant_budgets
  // gets its own figure. 0: retention refused (tenant_budget).
  int64_t default_tenant_budget_bytes = int64_t{256} << 20;
  std::map<std::string, int64_t> tenant_budgets;
  // Retained blocks (every tenant together) may hold at most this fraction
  // of the primary pool; past it: refused (pool_too_small).
  double max_pool_fraction = 0.5;
  double max_ttl_s = 3600;      // longer asks are clipped to it
  Clock* clock = nullptr;       // nullptr: SteadyClock() (expiry, history)
  size_t history_blocks = 65536;  // evicted / expired hashes remembered
};

struct RetainRequest {
  std::string tenant;              // "" without tenants
  std::string salt;                // the prefix cache namespace (derived by server/)
  std::vector<int32_t> tokens;     // the prompt
  int32_t max_tokens = 0;          // retain tokens[0, max_tokens); <= 0: all of them
  double ttl_s = 300;
};

struct LeaseInfo {
  uint64_t id = 0;
  std::string tenant;
  int32_t tokens = 0;              // retained (whole blocks)
  int32_t blocks = 0;
  int64_t bytes = 0;
  double ttl_s = 0;                // as granted (or renewed)
  double remaining_s = 0;
  std::string tier = "primary";
};

struct RetainAnswer {
  enum class Outcome { kGranted, kClipped, kRefused };
  Outcome outcome = Outcome::kRefused;
  std::string reason;              // refused: tenant_budget | pool_too_small | not_cached | bad_request
  std::string detail;              // a sentence saying what happened
  int32_t tokens_requested = 0;
  LeaseInfo lease;                 // granted / clipped
};
const char* RetainOutcomeName(RetainAnswer::Outcome o);  // granted | clipped | refused

struct CacheReport {
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
  int32_t primary_tokens = 0, host_tokens = 0, disk_tokens = 0;
  int32_t public_tokens = 0;       // of primary, from public-marked blocks
  // hit | never_seen | diverged | scope_mismatch | evicted | retained_expired
  // | window_dropped
  // (server/ turns diverged into template_drift when it knows better).
  std::string reason = "never_seen";
  std::optional<int32_t> diverged_at;
  std::vector<int32_t> cached_next;  // diverged: the cached path's next tokens
  std::string detail;
  // evicted / retained_expired
  double evicted_ago_s = 0;
  std::string evicted_policy;
  std::string evicted_to;          // none | host | disk
  int32_t other_scope_tokens = 0;  // scope_mismatch: what the other namespace holds
  std::string other_scope;         // scope_mismatch: that namespace (as the caller may see it)
  // window_dropped: prompt tokens past cached_tokens the prefix cache spells
  // but whose K/V a sliding window dropped (hollow blocks).
  int32_t window_dropped_tokens = 0;
};

struct CacheControlStats {
  std::map<std::string, int64_t> retained_bytes;  // per tenant, now
  int64_t leases = 0;
  int64_t grants = 0, clips = 0, refusals = 0, expiries = 0, releases = 0;
  std::map<std::string, int64_t> refusals_by_reason;
  int64_t explains = 0;
  int64_t template_drifts = 0;
};

class CacheControl {
 public:
  explicit CacheControl(CacheControlOptions options);
  ~CacheControl();

  // --- engine thread ---
  RetainAnswer Retain(KvCacheManager* kv, const RetainRequest& request);
  // NotFound-style answers are nullopt: no lease with that id for tenant
  // (tenant nullopt: any tenant, the operator).
  std::optional<LeaseInfo> Renew(KvCacheManager* kv, uint64_t id, double ttl_s,
                                 const std::optional<std::string>& tenant);
  bool Release(KvCacheManager* kv, uint64_t id, const std::optional<std::string>& tenant);
  std::vector<LeaseInfo> List(const std::optional<std::string>& tenant) const;
  // Releases the leases whose TTL lapsed (every engine step).
  void Expire(KvCacheManager* kv);
  // Releases every lease (before the pool goes).
  void ReleaseAll(KvCacheManager* kv);

  // Retention across a warm restart (with a disk tier). SaveRetention
  // writes every lease with TTL left (tenant, scope, tokens, bytes, the
  // absolute expiry on the wall clock) to the table kDiskTierRetentionFile
  // in the disk tier's fingerprint directory, atomically (a .tmp renamed);
  // at shutdown, before KvTiers::PersistForRestart writes the retained
  // blocks. RestoreRetention reads it at start: expired leases are
  // dropped, the rest are re-installed as disk-tier leases that pin their
  // blocks' files (a lease whose blocks are not all on disk is dropped);
  // a torn table or one written for another fingerprint is ignored with a
  // log line. A disk-tier lease moves to the primary pool (pins its blocks
  // there) once a request has loaded its whole range. Returns the leases
  // written / re-installed.
  int SaveRetention(KvTiers* tiers);
  int RestoreRetention(KvCacheManager* kv, KvTiers* tiers);
  // What the cache holds for tokens under salt now. Other namespaces are
  // looked at for scope_mismatch only when may_see(salt) says so (a tenant
  // sees its own salts, the operator all).
  CacheReport Explain(const KvCacheManager& kv, KvTiers* tiers, std::string_view salt,
                      absl::Span<const int32_t> tokens,
                      const std::function<bool(const std::string&)>& may_see);
  // True for a block a lease holds now or held until its TTL lapsed (the
  // bounded expiry history): KvTiers::SetRetainedPredicate.
  bool WasRetained(uint64_t hash) const;
  // PrefixCacheOptions::on_evict.
  void OnEvict(uint64_t hash, KvTier moved_to, const char* policy);

  // --- any thread ---
  void CountTemplateDrift();
  CacheControlStats stats() const;
  const CacheControlOptions& options() const { return options_; }
  int64_t BudgetFor(const std::string& tenant) const;

 private:
  struct Lease {
    uint64_t id = 0;
    std::string tenant;
    std::string salt;                // the scope it was retained in
    std::vector<int32_t> tokens_kept;  // the retained tokens (whole blocks)
    std::vector<BlockHandle> blocks;   // primary: one reference each
    std::vector<uint64_t> hashes;
    // KV cache groups (a hybrid model): of `blocks`, those of groups 1..
    // (after group 0's, which `hashes` name): each window group's blocks
    // its window reaches from the lease's end, each other full group's all.
    int32_t group_blocks = 0;
    KvTier tier = KvTier::kNone;       // kNone: the primary pool; kDisk: restored, files pinned
    int32_t tokens = 0;
    int64_t bytes = 0;
    double ttl_s = 0;
    int64_t expires_ns = 0;
  };
  struct Eviction {
    int64_t at_ns = 0;
    KvTier moved_to = KvTier::kNone;
    std::string policy;
  };
  LeaseInfo Info(const Lease& l, int64_t now) const;
  void Drop(KvCacheManager* kv, std::map<uint64_t, Lease>::iterator it, bool expired);
  void Publish();  // stats_ from leases_ (engine thread)
  // Disk-tier leases whose range a request loaded into the pool pin it
  // there instead (Expire).
  void PromoteRestored(KvCacheManager* kv);
  KvTiers* tiers_ = nullptr;  // RestoreRetention's (disk pins)
  int64_t restored_on_disk_ = 0;  // leases with tier kDisk
  int64_t Now() const;

  CacheControlOptions options_;
  Clock* clock_;
  // Engine thread.
  std::map<uint64_t, Lease> leases_;
  uint64_t next_id_ = 1;
  int64_t retained_blocks_ = 0;
  absl::flat_hash_map<uint64_t, int32_t> held_;     // block hash -> leases holding it
  absl::flat_hash_map<uint64_t, Eviction> evicted_;
  std::deque<uint64_t> evicted_order_;
  absl::flat_hash_map<uint64_t, int64_t> expired_;  // block hash -> when its lease lapsed
  std::deque<uint64_t> expired_order_;
  // Shared.
  mutable std::mutex mu_;
  CacheControlStats stats_;  // guarded by mu_
};

}  // namespace kvserve
