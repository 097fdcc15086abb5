#include "scheduler/cache_control.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/host_tier.h"
#include "cache/disk_tier.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_tiers.h"

namespace kvserve {

const char* RetainOutcomeName(RetainAnswer::Outcome o) {
  switch (o) {
    case RetainAnswer::Outcome::kGranted:
      return "granted";
    case RetainAnswer::Outcome::kClipped:
      return "clipped";
    case RetainAnswer::Outcome::kRefused:
      break;
  }
  return "refused";
}

CacheControl::CacheControl(CacheControlOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : SteadyClock()) {}

CacheControl::~CacheControl() = default;

int64_t CacheControl::Now() const { return clock_->NowNanos(); }

int64_t CacheControl::BudgetFor(const std::string& tenant) const {
  auto it = options_.tenant_budgets.find(tenant);
  return it != options_.tenant_budgets.end() ? it->second : options_.default_tenant_budget_bytes;
}

LeaseInfo CacheControl::Info(const Lease& l, int64_t now) const {
  LeaseInfo i;
  i.id = l.id;
  i.tenant = l.tenant;
  i.tokens = l.tokens;
  i.blocks = static_cast<int32_t>(l.blocks.size());
  i.bytes = l.bytes;
  i.ttl_s = l.ttl_s;
  i.remaining_s = std::max(0.0, static_cast<double>(l.expires_ns - now) * 1e-9);
  return i;
}

void CacheControl::Publish() {
  std::map<std::string, int64_t> bytes;
  for (const auto& [id, l] : leases_) bytes[l.tenant] += l.bytes;
  std::lock_guard<std::mutex> lock(mu_);
  // Tenants that held leases before keep a 0 line (a gauge that drops to 0).
  for (auto& [t, b] : stats_.retained_bytes) b = 0;
  for (const auto& [t, b] : bytes) stats_.retained_bytes[t] = b;
  stats_.leases = static_cast<int64_t>(leases_.size());
}

RetainAnswer CacheControl::Retain(KvCacheManager* kv, const RetainRequest& r) {
  RetainAnswer a;
  const int32_t n = static_cast<int32_t>(r.tokens.size());
  const int32_t asked = r.max_tokens <= 0 ? n : std::min(n, r.max_tokens);
  a.tokens_requested = asked;
  auto refuse = [&](std::string reason, std::string detail) {
    a.outcome = RetainAnswer::Outcome::kRefused;
    a.reason = std::move(reason);
    a.detail = std::move(detail);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.refusals;
    ++stats_.refusals_by_reason[a.reason];
    return a;
  };
  if (!(r.ttl_s > 0) || !std::isfinite(r.ttl_s)) {
    return refuse("bad_request", "ttl_s must be a positive number of seconds");
  }
  PrefixCache* cache = kv->mutable_prefix_cache();
  if (cache == nullptr) return refuse("not_cached", "the prefix cache is off (--no-prefix-cache)");
  const int32_t bs = kv->block_size();
  if (asked < bs) {
    return refuse("not_cached", absl::StrCat("a lease holds whole blocks of ", bs,
                                             " tokens; the range asked has ", asked));
  }
  // How much the range needs, before pinning anything.
  const int64_t block_bytes = kv->pool().block_bytes();
  const int32_t matched = cache->MatchLength(r.salt, r.tokens, asked) / bs * bs;
  if (matched == 0) {
    return refuse("not_cached",
                  "nothing of the range is cached in this scope (send the prompt once, or "
                  "retain it on the request that computes it)");
  }
  const int64_t need_blocks = matched / bs;
  const int64_t need_bytes = need_blocks * block_bytes;
  const int64_t budget = BudgetFor(r.tenant);
  int64_t held = 0;
  for (const auto& [id, l] : leases_) {
    if (l.tenant == r.tenant) held += l.bytes;
  }
  if (held + need_bytes > budget) {
    return refuse("tenant_budget",
                  absl::StrCat("retaining ", need_bytes, " bytes (", need_blocks,
                               " blocks) would bring tenant '", r.tenant, "' to ",
                               held + need_bytes, " bytes; its budget is ", budget,
                               " (--cache-retain-budget)"));
  }
  const int64_t pool_limit =
      static_cast<int64_t>(std::floor(options_.max_pool_fraction * kv->num_blocks()));
  if (retained_blocks_ + need_blocks > pool_limit) {
    return refuse("pool_too_small",
                  absl::StrCat("retaining ", need_blocks, " more blocks would pin ",
                               retained_blocks_ + need_blocks, " of the pool's ",
                               kv->num_blocks(), " blocks; at most ", pool_limit,
                               " may be retained (--cache-retain-max-fraction ",
                               options_.max_pool_fraction, ")"));
  }
  Lease l;
  PrefixMatch m = cache->Pin(r.salt, r.tokens, matched, &l.hashes);
  l.id = next_id_++;
  l.tenant = r.tenant;
  l.blocks = std::move(m.blocks);
  l.tokens = m.num_tokens;
  l.bytes = static_cast<int64_t>(l.blocks.size()) * block_bytes;
  double ttl = r.ttl_s;
  std::vector<std::string> clipped;
  if (ttl > options_.max_ttl_s) {
    ttl = options_.max_ttl_s;
    clipped.push_back(absl::StrCat("ttl capped at ", ttl, " s (--cache-retain-max-ttl)"));
  }
  // Whole blocks only: a range's partly filled last block is never
  // retained, and leaving it out is no clip.
  if (l.tokens < asked / bs * bs) {
    clipped.push_back(absl::StrCat("kept tokens [0, ", l.tokens, ") of the ", asked,
                                   " asked (whole cached blocks)"));
  }
  l.ttl_s = ttl;
  const int64_t now = Now();
  l.expires_ns = now + static_cast<int64_t>(ttl * 1e9);
  retained_blocks_ += static_cast<int64_t>(l.blocks.size());
  a.outcome = clipped.empty() ? RetainAnswer::Outcome::kGranted : RetainAnswer::Outcome::kClipped;
  a.lease = Info(l, now);
  a.detail = clipped.empty()
                 ? absl::StrCat("retained ", l.tokens, " tokens (", l.bytes, " bytes, whole blocks of ",
                                bs, ") for ", ttl, " s in the primary pool")
                 : absl::StrJoin(clipped, "; ");
  leases_.emplace(l.id, std::move(l));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (a.outcome == RetainAnswer::Outcome::kGranted) {
      ++stats_.grants;
    } else {
      ++stats_.clips;
    }
  }
  Publish();
  return a;
}

std::optional<LeaseInfo> CacheControl::Renew(KvCacheManager* /*kv*/, uint64_t id, double ttl_s,
                                             const std::optional<std::string>& tenant) {
  auto it = leases_.find(id);
  if (it == leases_.end() || (tenant && it->second.tenant != *tenant)) return std::nullopt;
  if (!(ttl_s > 0) || !std::isfinite(ttl_s)) ttl_s = it->second.ttl_s;
  ttl_s = std::min(ttl_s, options_.max_ttl_s);
  const int64_t now = Now();
  it->second.ttl_s = ttl_s;
  it->second.expires_ns = now + static_cast<int64_t>(ttl_s * 1e9);
  return Info(it->second, now);
}

void CacheControl::Drop(KvCacheManager* kv, std::map<uint64_t, Lease>::iterator it, bool expired) {
  Lease& l = it->second;
  if (expired) {
    const int64_t now = Now();
    for (uint64_t h : l.hashes) {
      if (expired_.insert_or_assign(h, now).second) expired_order_.push_back(h);
    }
    while (expired_order_.size() > options_.history_blocks) {
      expired_.erase(expired_order_.front());
      expired_order_.pop_front();
    }
  }
  retained_blocks_ -= static_cast<int64_t>(l.blocks.size());
  kv->mutable_pool()->Release(l.blocks);
  leases_.erase(it);
  std::lock_guard<std::mutex> lock(mu_);
  if (expired) {
    ++stats_.expiries;
  } else {
    ++stats_.releases;
  }
}

bool CacheControl::Release(KvCacheManager* kv, uint64_t id,
                           const std::optional<std::string>& tenant) {
  auto it = leases_.find(id);
  if (it == leases_.end() || (tenant && it->second.tenant != *tenant)) return false;
  Drop(kv, it, /*expired=*/false);
  Publish();
  return true;
}

std::vector<LeaseInfo> CacheControl::List(const std::optional<std::string>& tenant) const {
  std::vector<LeaseInfo> out;
  const int64_t now = Now();
  for (const auto& [id, l] : leases_) {
    if (!tenant || l.tenant == *tenant) out.push_back(Info(l, now));
  }
  return out;
}

void CacheControl::Expire(KvCacheManager* kv) {
  if (leases_.empty()) return;
  const int64_t now = Now();
  bool any = false;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (it->second.expires_ns <= now) {
      Drop(kv, it, /*expired=*/true);
      any = true;
    }
    it = next;
  }
  if (any) Publish();
}

void CacheControl::ReleaseAll(KvCacheManager* kv) {
  while (!leases_.empty()) Drop(kv, leases_.begin(), /*expired=*/false);
  Publish();
}

void CacheControl::OnEvict(uint64_t hash, KvTier moved_to, const char* policy) {
  Eviction e;
  e.at_ns = Now();
  e.moved_to = moved_to;
  e.policy = policy;
  if (evicted_.insert_or_assign(hash, std::move(e)).second) evicted_order_.push_back(hash);
  while (evicted_order_.size() > options_.history_blocks) {
    evicted_.erase(evicted_order_.front());
    evicted_order_.pop_front();
  }
}

CacheReport CacheControl::Explain(const KvCacheManager& kv, KvTiers* tiers, std::string_view salt,
                                  absl::Span<const int32_t> tokens,
                                  const std::function<bool(const std::string&)>& may_see) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.explains;
  }
  // Sharing a BOS and a token or two with some cached prompt is no cached
  // prefix to speak of: that is never_seen.
  constexpr int32_t kMinDivergedTokens = 4;
  CacheReport r;
  r.prompt_tokens = static_cast<int32_t>(tokens.size());
  const PrefixCache* cache = kv.prefix_cache();
  if (cache == nullptr) {
    r.reason = "never_seen";
    r.detail = "the prefix cache is off (--no-prefix-cache)";
    return r;
  }
  const int32_t bs = kv.block_size();
  const PrefixProbe p = cache->Probe(salt, tokens);
  r.primary_tokens = p.matched_tokens;
  r.public_tokens = p.public_tokens;
  // The tiers continue a match from a block boundary only (KvLoader).
  size_t next = 0;  // first block of p.next_block_hashes nobody holds
  if (p.matched_tokens == p.next_block_start && tiers != nullptr) {
    HostTier* host = tiers->host();
    DiskTier* disk = tiers->disk();
    for (; next < p.next_block_hashes.size(); ++next) {
      const uint64_t h = p.next_block_hashes[next];
      if (host != nullptr && host->Contains(h)) {
        r.host_tokens += bs;
      } else if (disk != nullptr && disk->Contains(h)) {
        r.disk_tokens += bs;
      } else {
        break;
      }
    }
  } else if (p.matched_tokens > p.next_block_start) {
    next = 1;  // the partly matched block
  }
  // The engine computes a prompt's last token whatever is cached (its
  // logits pick the next one): what a request gets is capped there.
  const int32_t cap = std::max(0, r.prompt_tokens - 1);
  r.primary_tokens = std::min(r.primary_tokens, cap);
  r.host_tokens = std::min(r.host_tokens, cap - r.primary_tokens);
  r.disk_tokens = std::min(r.disk_tokens, cap - r.primary_tokens - r.host_tokens);
  r.cached_tokens = r.primary_tokens + r.host_tokens + r.disk_tokens;
  const int32_t uncached = r.prompt_tokens - r.cached_tokens;
  if (uncached <= 1 && p.matched_tokens >= cap) {
    r.reason = "hit";
    r.detail = absl::StrCat("all ", r.prompt_tokens,
                            " prompt tokens are cached (the last is computed anyway)");
    return r;
  }
  r.window_dropped_tokens = std::max(0, std::min(p.window_dropped_tokens, cap - r.cached_tokens));
  if (r.window_dropped_tokens > 0) {
    r.reason = "window_dropped";
    r.detail = absl::StrCat(
        "tokens ", r.cached_tokens, " to ", r.cached_tokens + r.window_dropped_tokens,
        " are in the prefix cache, but the sliding window dropped K/V a continuation from there "
        "needs (only each cached prefix boundary keeps its last window); ",
        uncached, " tokens uncached");
    return r;
  }
  if (p.diverged && p.matched_tokens >= kMinDivergedTokens && r.host_tokens + r.disk_tokens == 0) {
    r.reason = "diverged";
    r.diverged_at = p.matched_tokens;
    r.cached_next = p.cached_next;
    r.detail = absl::StrCat("the prompt leaves the nearest cached prefix at token ",
                            p.matched_tokens, " (", uncached, " tokens uncached)");
    return r;
  }
  // The first uncached full block: evicted earlier, under a lapsed lease?
  if (next < p.next_block_hashes.size()) {
    const uint64_t h = p.next_block_hashes[next];
    if (auto it = evicted_.find(h); it != evicted_.end()) {
      const int64_t now = Now();
      r.evicted_ago_s = static_cast<double>(now - it->second.at_ns) * 1e-9;
      r.evicted_policy = it->second.policy;
      r.evicted_to = KvTierName(it->second.moved_to);
      const int32_t at = p.next_block_start + static_cast<int32_t>(next) * bs;
      auto ex = expired_.find(h);
      if (ex != expired_.end() && ex->second <= it->second.at_ns) {
        r.reason = "retained_expired";
        r.detail = absl::StrCat("tokens from ", at, " were retained; the lease lapsed ",
                                static_cast<double>(now - ex->second) * 1e-9,
                                " s ago and the blocks were evicted ", r.evicted_ago_s,
                                " s ago by the ", r.evicted_policy, " policy (moved to ",
                                r.evicted_to, ")");
      } else {
        r.reason = "evicted";
        r.detail = absl::StrCat("tokens from ", at, " were cached and evicted ", r.evicted_ago_s,
                                " s ago by the ", r.evicted_policy, " policy (moved to ",
                                r.evicted_to, ")");
      }
      return r;
    }
  }
  // Cached elsewhere: another namespace the caller may see holds more.
  if (may_see) {
    std::vector<std::string> bases;
    for (std::string other : cache->Salts()) {
      // A namespace derived from a public prefix belongs to the salt after it.
      if (other.size() >= 22 && other.compare(0, 5, std::string("\0pub:", 5)) == 0) {
        other = other.substr(22);
      }
      if (other == salt || other == cache->public_salt()) continue;
      if (std::find(bases.begin(), bases.end(), other) == bases.end()) bases.push_back(other);
    }
    for (const std::string& other : bases) {
      if (!may_see(other)) continue;
      const int32_t m = cache->MatchLength(other, tokens, r.prompt_tokens);
      if (m > r.cached_tokens && m >= kMinDivergedTokens && m > r.other_scope_tokens) {
        r.other_scope_tokens = m;
        r.other_scope = other;
      }
    }
    if (r.other_scope_tokens > 0) {
      r.reason = "scope_mismatch";
      r.detail = absl::StrCat(r.other_scope_tokens,
                              " tokens of this prompt are cached under another scope "
                              "(cache_salt or tenant); this one has ",
                              r.cached_tokens);
      return r;
    }
  }
  if (r.cached_tokens >= kMinDivergedTokens) {
    r.reason = "hit";
    r.detail = absl::StrCat(r.cached_tokens, " tokens cached; the remaining ", uncached,
                            " extend past everything cached (never seen)");
  } else {
    r.reason = "never_seen";
    r.detail = r.cached_tokens == 0
                   ? "no prefix of this prompt was cached in this scope"
                   : absl::StrCat("only the first ", r.cached_tokens,
                                  " tokens are shared with anything cached in this scope");
  }
  return r;
}

void CacheControl::CountTemplateDrift() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.template_drifts;
}

CacheControlStats CacheControl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::string CacheControl::RenderMetrics() const {
  const CacheControlStats s = stats();
  std::string out;
  absl::StrAppend(&out,
                  "# HELP kvserve_cache_retained_bytes KV bytes pinned by retention leases, per tenant.\n"
                  "# TYPE kvserve_cache_retained_bytes gauge\n");
  if (s.retained_bytes.empty()) {
    absl::StrAppend(&out, "kvserve_cache_retained_bytes{tenant=\"\"} 0\n");
  }
  for (const auto& [t, b] : s.retained_bytes) {
    std::string esc;
    for (char c : t) {
      if (c == '"' || c == '\\') esc.push_back('\\');
      if (c == '\n') {
        esc += "\\n";
        continue;
      }
      esc.push_back(c);
    }
    absl::StrAppend(&out, "kvserve_cache_retained_bytes{tenant=\"", esc, "\"} ", b, "\n");
  }
  auto counter = [&](const char* name, const char* help, int64_t v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ", v,
                    "\n");
  };
  absl::StrAppend(&out, "# HELP kvserve_cache_retention_leases Retention leases held now.\n",
                  "# TYPE kvserve_cache_retention_leases gauge\nkvserve_cache_retention_leases ",
                  s.leases, "\n");
  counter("kvserve_cache_retention_grants_total", "Retention requests granted whole.", s.grants);
  counter("kvserve_cache_retention_clips_total", "Retention requests granted in part.", s.clips);
  counter("kvserve_cache_retention_expiries_total", "Retention leases whose TTL lapsed.",
          s.expiries);
  counter("kvserve_cache_retention_releases_total", "Retention leases released early.",
          s.releases);
  absl::StrAppend(&out,
                  "# HELP kvserve_cache_retention_refusals_total Retention requests refused, by reason.\n"
                  "# TYPE kvserve_cache_retention_refusals_total counter\n");
  for (const char* reason : {"tenant_budget", "pool_too_small", "not_cached", "bad_request"}) {
    auto it = s.refusals_by_reason.find(reason);
    absl::StrAppend(&out, "kvserve_cache_retention_refusals_total{reason=\"", reason, "\"} ",
                    it == s.refusals_by_reason.end() ? 0 : it->second, "\n");
  }
  counter("kvserve_cache_explains_total", "Cache reports computed (explain calls and requests).",
          s.explains);
  counter("kvserve_cache_template_drift_total",
          "Chat requests whose history the template rendered differently from the cached turn.",
          s.template_drifts);
  return out;
}

}  // namespace kvserve
