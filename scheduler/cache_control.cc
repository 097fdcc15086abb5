#include "scheduler/cache_control.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "cache/host_tier.h"
#include "cache/disk_tier.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_tiers.h"
#include "spdlog/spdlog.h"

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
  i.blocks = static_cast<int32_t>(l.hashes.size()) + l.group_blocks;
  i.bytes = l.bytes;
  i.ttl_s = l.ttl_s;
  i.remaining_s = std::max(0.0, static_cast<double>(l.expires_ns - now) * 1e-9);
  i.tier = l.tier == KvTier::kDisk ? "disk" : "primary";
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
  // How much the range needs, before pinning anything. KV cache groups (a
  // hybrid model): the longest prefix every group serves, and besides the
  // full group's blocks each other group's that a hit at its end reads.
  const int64_t block_bytes = kv->pool().block_bytes();
  const int32_t matched =
      (kv->hybrid() ? kv->PeekPrefix(r.salt, r.tokens, asked)
                    : cache->MatchLength(r.salt, r.tokens, asked)) / bs * bs;
  if (matched == 0) {
    return refuse("not_cached",
                  "nothing of the range is cached in this scope (send the prompt once, or "
                  "retain it on the request that computes it)");
  }
  std::vector<int32_t> group_first;  // per group 1..: its first retained block
  int64_t need_blocks = matched / bs;
  for (int32_t g = 1; g < kv->num_groups(); ++g) {
    const int32_t w = kv->group_window(g);
    group_first.push_back(std::min(matched / bs, w > 0 ? std::max(0, matched - w + 1) / bs : 0));
    need_blocks += matched / bs - group_first.back();
  }
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
  if (kv->hybrid()) {
    // Each other group's blocks from its first retained one (a window
    // group's earlier ones are its placeholder: their references go back
    // at once), kept in its index as a cached boundary's window is, so no
    // later sequence's window hollows them.
    std::vector<BlockHandle> extra;
    bool whole = m.num_tokens == matched;
    for (int32_t g = 1; g < kv->num_groups() && whole; ++g) {
      KvCacheManager* gm = kv->mutable_group_manager(g);
      const int32_t first = group_first[static_cast<size_t>(g - 1)];
      PrefixMatch gp = gm->mutable_prefix_cache()->Pin(r.salt, r.tokens, matched, nullptr);
      whole = gp.num_tokens == matched;
      for (int32_t b = 0; b < static_cast<int32_t>(gp.blocks.size()); ++b) {
        if (whole && b >= first && !kv->IsGroupPlaceholder(g, gp.blocks[b])) {
          extra.push_back(gp.blocks[b]);
        } else {
          whole &= b < first;
          kv->mutable_pool()->Release(gp.blocks[b]);
        }
      }
      if (whole) {
        gm->mutable_prefix_cache()->KeepWindow(
            r.salt, absl::MakeConstSpan(r.tokens).subspan(0, matched), first);
      }
    }
    if (!whole) {  // cannot happen (every group served `matched` just now)
      kv->mutable_pool()->Release(m.blocks);
      kv->mutable_pool()->Release(extra);
      return refuse("not_cached", "a KV cache group no longer holds the range's blocks");
    }
    l.group_blocks = static_cast<int32_t>(extra.size());
    m.blocks.insert(m.blocks.end(), extra.begin(), extra.end());
  }
  l.id = next_id_++;
  l.tenant = r.tenant;
  l.salt = r.salt;
  l.tokens_kept.assign(r.tokens.begin(), r.tokens.begin() + m.num_tokens);
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
  for (uint64_t h : l.hashes) ++held_[h];
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
  if (l.tier == KvTier::kDisk && tiers_ != nullptr && tiers_->disk() != nullptr) {
    for (uint64_t h : l.hashes) tiers_->disk()->Unpin(h);
  }
  if (l.tier == KvTier::kDisk) --restored_on_disk_;
  retained_blocks_ -= static_cast<int64_t>(l.blocks.size());
  for (uint64_t h : l.hashes) {
    auto held = held_.find(h);
    if (held != held_.end() && --held->second <= 0) held_.erase(held);
  }
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
  if (restored_on_disk_ > 0) PromoteRestored(kv);
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

bool CacheControl::WasRetained(uint64_t hash) const {
  return held_.contains(hash) || expired_.contains(hash);
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
  PrefixProbe p = cache->Probe(salt, tokens);
  if (kv.hybrid()) {
    // KV cache groups: the hit is what every group serves; what the full
    // group holds past it, the window groups dropped (their K/V for the
    // window before that end went hollow).
    const int32_t all = kv.PeekPrefix(salt, tokens, static_cast<int32_t>(tokens.size()));
    if (all < p.matched_tokens) {
      p.window_dropped_tokens = std::max(p.window_dropped_tokens, p.matched_tokens - all);
      p.matched_tokens = all;
      p.next_block_start = all;
      p.next_block_hashes.clear();
      p.diverged = false;
    }
    if (tiers != nullptr && p.matched_tokens % bs == 0) {
      // The tiers continue a hybrid match only as far as every group's
      // pages do (KvTiers::Lookup); the full group's pages name them.
      const int32_t cap = std::max(0, static_cast<int32_t>(tokens.size()) - 1);
      const int32_t n =
          p.matched_tokens < cap ? tiers->Lookup(salt, tokens, p.matched_tokens, cap) : 0;
      std::vector<uint64_t> chain;
      cache->ChainHashes(salt, tokens, (p.matched_tokens + n) / bs, &chain);
      p.next_block_start = p.matched_tokens;
      p.next_block_hashes.assign(chain.begin() + p.matched_tokens / bs, chain.end());
    }
  }
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

namespace {

constexpr char kRetentionMagic[] = "kvserve-retention 1";

int64_t WallNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Fields are hex with an 'x' in front, so an empty or binary string (a
// scope holds 0x1f and NULs) is one whitespace-free word.
std::string HexField(std::string_view s) {
  static const char* kHex = "0123456789abcdef";
  std::string out = "x";
  for (unsigned char c : s) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

bool UnhexField(const std::string& f, std::string* out) {
  if (f.empty() || f[0] != 'x' || f.size() % 2 == 0) return false;
  out->clear();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 1; i + 1 < f.size(); i += 2) {
    const int hi = nibble(f[i]), lo = nibble(f[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
  }
  return true;
}

std::string FingerprintOf(const std::string& disk_directory) {
  const size_t slash = disk_directory.find_last_of('/');
  return slash == std::string::npos ? disk_directory : disk_directory.substr(slash + 1);
}

}  // namespace

void CacheControl::PromoteRestored(KvCacheManager* kv) {
  PrefixCache* cache = kv->mutable_prefix_cache();
  if (cache == nullptr) return;
  for (auto& [id, l] : leases_) {
    if (l.tier != KvTier::kDisk) continue;
    const int32_t n = static_cast<int32_t>(l.tokens_kept.size());
    if (cache->MatchLength(l.salt, l.tokens_kept, n) < n) continue;
    std::vector<uint64_t> hashes;
    PrefixMatch m = cache->Pin(l.salt, l.tokens_kept, n, &hashes);
    if (m.num_tokens < n || hashes != l.hashes) {
      kv->mutable_pool()->Release(m.blocks);
      continue;
    }
    if (tiers_ != nullptr && tiers_->disk() != nullptr) {
      for (uint64_t h : l.hashes) tiers_->disk()->Unpin(h);
    }
    l.blocks = std::move(m.blocks);
    l.tier = KvTier::kNone;
    retained_blocks_ += static_cast<int64_t>(l.blocks.size());
    --restored_on_disk_;
  }
}

int CacheControl::SaveRetention(KvTiers* tiers) {
  if (tiers == nullptr || !tiers->disk_enabled()) return 0;
  const std::string dir = tiers->disk_directory();
  const int64_t now = Now();
  const int64_t wall = WallNanos();
  std::string body = absl::StrCat(kRetentionMagic, "\nfingerprint ", FingerprintOf(dir), "\n");
  int written = 0;
  for (const auto& [id, l] : leases_) {
    // A hybrid model's lease pins every KV cache group's blocks, which the
    // disk-tier restore (group 0's pages by hash) does not know: such
    // leases end with the process (their blocks stay cached on disk).
    if (l.expires_ns <= now || l.tokens_kept.empty() || l.group_blocks > 0) continue;
    absl::StrAppend(&body, "lease ", HexField(l.tenant), " ", HexField(l.salt), " ",
                    absl::StrFormat("%.17g", l.ttl_s), " ", wall + (l.expires_ns - now), " ",
                    l.bytes, " ", l.tokens_kept.size(), " ", absl::StrJoin(l.tokens_kept, ","),
                    " ", l.hashes.size(), " ");
    for (size_t i = 0; i < l.hashes.size(); ++i) {
      absl::StrAppend(&body, i == 0 ? "" : ",", absl::StrFormat("%016x", l.hashes[i]));
    }
    body.push_back('\n');
    ++written;
  }
  absl::StrAppend(&body, "end ", written, "\n");
  absl::StrAppend(&body, "checksum ",
                  absl::StrFormat("%016x", XXH3_64bits(body.data(), body.size())), "\n");
  const std::string path = absl::StrCat(dir, "/", kDiskTierRetentionFile);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << body;
    f.flush();
    if (!f) {
      spdlog::warn("KV retention table {}: cannot write; leases are not kept across the restart",
                   tmp);
      std::remove(tmp.c_str());
      return 0;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    spdlog::warn("KV retention table {}: cannot rename into place", path);
    std::remove(tmp.c_str());
    return 0;
  }
  if (written > 0) spdlog::info("KV retention: {} leases written to {} for the next start", written, path);
  return written;
}

int CacheControl::RestoreRetention(KvCacheManager* kv, KvTiers* tiers) {
  (void)kv;
  if (tiers == nullptr || tiers->disk() == nullptr) return 0;
  tiers_ = tiers;
  DiskTier* disk = tiers->disk();
  const std::string dir = tiers->disk_directory();
  const std::string path = absl::StrCat(dir, "/", kDiskTierRetentionFile);
  std::ifstream f(path, std::ios::binary);
  if (!f) return 0;  // none written (first start, or no leases then)
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string all = ss.str();
  auto ignore = [&](const std::string& why) {
    spdlog::warn("KV retention table {}: {}; ignored (no lease restored)", path, why);
    return 0;
  };
  // The checksum line covers everything before it.
  const size_t cut = all.rfind("checksum ");
  if (cut == std::string::npos || cut == 0 || all[cut - 1] != '\n') {
    return ignore("torn (no checksum line)");
  }
  uint64_t want = 0;
  if (std::sscanf(all.c_str() + cut, "checksum %16" SCNx64, &want) != 1 ||
      XXH3_64bits(all.data(), cut) != want) {
    return ignore("torn or altered (checksum mismatch)");
  }
  std::istringstream in(all.substr(0, cut));
  std::string line;
  if (!std::getline(in, line) || line != kRetentionMagic) return ignore("not a retention table");
  std::string word, fp;
  if (!std::getline(in, line) || !(std::istringstream(line) >> word >> fp) || word != "fingerprint") {
    return ignore("no fingerprint line");
  }
  if (fp != FingerprintOf(dir)) {
    return ignore(absl::StrCat("written for another model or KV layout (fingerprint ", fp,
                               ", this one ", FingerprintOf(dir), ")"));
  }
  struct Entry {
    std::string tenant, salt;
    double ttl_s = 0;
    int64_t expires_wall = 0, bytes = 0;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> hashes;
  };
  std::vector<Entry> entries;
  bool ended = false;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    ls >> word;
    if (word == "end") {
      size_t n = 0;
      if (!(ls >> n) || n != entries.size()) return ignore("lease count mismatch");
      ended = true;
      break;
    }
    if (word != "lease") return ignore(absl::StrCat("unexpected line '", line.substr(0, 40), "'"));
    Entry e;
    std::string tenant, salt, toks, hashes;
    size_t nt = 0, nh = 0;
    if (!(ls >> tenant >> salt >> e.ttl_s >> e.expires_wall >> e.bytes >> nt >> toks >> nh >>
          hashes) ||
        !UnhexField(tenant, &e.tenant) || !UnhexField(salt, &e.salt)) {
      return ignore("malformed lease line");
    }
    for (absl::string_view t : absl::StrSplit(toks, ',')) {
      int32_t v = 0;
      if (!absl::SimpleAtoi(t, &v)) return ignore("malformed token list");
      e.tokens.push_back(v);
    }
    for (absl::string_view h : absl::StrSplit(hashes, ',')) {
      uint64_t v = 0;
      if (!absl::SimpleHexAtoi(h, &v)) return ignore("malformed hash list");
      e.hashes.push_back(v);
    }
    if (e.tokens.size() != nt || e.hashes.size() != nh || nh == 0) {
      return ignore("malformed lease line (counts)");
    }
    entries.push_back(std::move(e));
  }
  if (!ended) return ignore("torn (no end line)");
  const int64_t wall = WallNanos();
  const int64_t now = Now();
  int restored = 0, expired = 0, missing = 0;
  for (Entry& e : entries) {
    if (e.expires_wall <= wall) {
      ++expired;
      continue;
    }
    std::vector<uint64_t> pinned;
    for (uint64_t h : e.hashes) {
      uint64_t checksum = 0;
      if (!disk->Pin(h, &checksum)) break;
      pinned.push_back(h);
    }
    if (pinned.size() != e.hashes.size()) {
      for (uint64_t h : pinned) disk->Unpin(h);
      ++missing;
      continue;
    }
    Lease l;
    l.id = next_id_++;
    l.tenant = std::move(e.tenant);
    l.salt = std::move(e.salt);
    l.tokens_kept = std::move(e.tokens);
    l.hashes = std::move(e.hashes);
    l.tokens = static_cast<int32_t>(l.tokens_kept.size());
    l.bytes = e.bytes;
    l.ttl_s = e.ttl_s;
    l.tier = KvTier::kDisk;
    l.expires_ns = now + (e.expires_wall - wall);
    for (uint64_t h : l.hashes) ++held_[h];
    ++restored_on_disk_;
    leases_.emplace(l.id, std::move(l));
    ++restored;
  }
  spdlog::info(
      "KV retention: {} leases restored from {} ({} expired while stopped, {} without their "
      "blocks on disk dropped)",
      restored, path, expired, missing);
  Publish();
  return restored;
}

}  // namespace kvserve
