// Retention leases and the cache-miss explainer over a real KV cache
// manager: a retained prefix survives pressure that evicts everything else
// and becomes evictable when its TTL lapses; over-budget and too-big asks
// are refused with their reason; the explainer names divergence (at the
// exact token), eviction, lapsed retention and scope mismatch; public
// prefixes are shared across salts while what follows stays private. With
// the tiers: a lapsed retained prefix reaches the disk tier though nothing
// hit it, a demoted public prefix is found by every scope (and the private
// part by its own only), and leases round-trip through the retention table.
#include "scheduler/cache_control.h"

#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_tiers.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

constexpr int32_t kBlock = 4;

class FakeClock : public Clock {
 public:
  int64_t NowNanos() override { return now; }
  int64_t now = 1'000'000'000;
};

struct Fixture {
  FakeClock clock;
  std::unique_ptr<CacheControl> cc;
  std::unique_ptr<KvCacheManager> kv;

  explicit Fixture(int32_t blocks, CacheControlOptions co = {}, int32_t window = 0) {
    co.clock = &clock;
    cc = std::make_unique<CacheControl>(co);
    KvCacheManagerOptions o;
    o.pool.n_layers = 1;
    o.pool.n_kv_heads = 1;
    o.pool.head_dim = 8;
    o.pool.block_size = kBlock;
    o.pool.n_blocks = blocks;
    o.pool.dtype = kernels::KvDType::kF32;
    o.prefix.model_identity = "test";
    o.prefix.clock = &clock;
    CacheControl* raw = cc.get();
    o.prefix.on_evict = [raw](uint64_t h, KvTier t) { raw->OnEvict(h, t, "lru"); };
    o.sliding_window = window;
    kv = KvCacheManager::Create(std::move(o)).value();
  }
  ~Fixture() { cc->ReleaseAll(kv.get()); }

  // A sequence that computed `tokens` and finished: its blocks are cached.
  void Run(const std::vector<int32_t>& tokens, std::string_view salt = "") {
    clock.now += 1000;
    SeqKv s(kv->mutable_pool());
    const int32_t hit = kv->MatchPrefix(&s, salt, tokens, static_cast<int32_t>(tokens.size()));
    const int32_t rest = static_cast<int32_t>(tokens.size()) - hit;
    ASSERT_TRUE(kv->EnsureFree(kv->BlocksNeeded(s, rest)));
    ASSERT_TRUE(kv->AllocateSlots(&s, rest).ok());
    kv->MarkComputed(&s, rest);
    kv->Commit(&s, salt, tokens, rest);
    kv->Free(&s, salt, tokens);
  }
  int32_t Cached(const std::vector<int32_t>& tokens, std::string_view salt = "") {
    return kv->PeekPrefix(salt, tokens, static_cast<int32_t>(tokens.size()));
  }
  RetainAnswer Retain(const std::vector<int32_t>& tokens, double ttl, std::string tenant = "t",
                      std::string salt = "") {
    RetainRequest r;
    r.tenant = std::move(tenant);
    r.salt = std::move(salt);
    r.tokens = tokens;
    r.ttl_s = ttl;
    return cc->Retain(kv.get(), r);
  }
  CacheReport Explain(const std::vector<int32_t>& tokens, std::string_view salt = "") {
    return cc->Explain(*kv, nullptr, salt, tokens, [](const std::string&) { return true; });
  }
};

std::vector<int32_t> Tokens(int32_t n, int32_t first) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(CacheControlTest, RetainedPrefixSurvivesPressureThenLapses) {
  Fixture f(16);
  const std::vector<int32_t> keep = Tokens(16, 1000);  // 4 blocks
  f.Run(keep);
  const RetainAnswer a = f.Retain(keep, 60);
  ASSERT_EQ(a.outcome, RetainAnswer::Outcome::kGranted) << a.detail;
  EXPECT_EQ(a.lease.tokens, 16);
  EXPECT_EQ(a.lease.bytes, 4 * f.kv->pool().block_bytes());
  EXPECT_EQ(a.lease.tier, "primary");
  // Pressure: 6 other prompts of 3 blocks each through a pool of 16 (4 of
  // them retained): everything unretained gets evicted along the way.
  for (int i = 0; i < 6; ++i) f.Run(Tokens(12, 100 * (i + 1)));
  EXPECT_EQ(f.Cached(Tokens(12, 100)), 0) << "the first of the others was evicted";
  EXPECT_EQ(f.Cached(keep), 16) << "the retained prefix survived";
  // Everything but the retained blocks can be freed; they cannot.
  EXPECT_TRUE(f.kv->EnsureFree(12));
  EXPECT_FALSE(f.kv->EnsureFree(13));
  EXPECT_EQ(f.Cached(keep), 16);
  // The TTL lapses: the blocks are ordinary cached blocks again.
  f.clock.now += static_cast<int64_t>(61e9);
  f.cc->Expire(f.kv.get());
  EXPECT_TRUE(f.cc->List(std::nullopt).empty());
  EXPECT_TRUE(f.kv->EnsureFree(16)) << "evictable after the TTL";
  EXPECT_EQ(f.Cached(keep), 0);
  const CacheReport r = f.Explain(keep);
  EXPECT_EQ(r.reason, "retained_expired") << r.detail;
  EXPECT_EQ(r.evicted_policy, "lru");
  const CacheControlStats s = f.cc->stats();
  EXPECT_EQ(s.grants, 1);
  EXPECT_EQ(s.expiries, 1);
  EXPECT_EQ(s.retained_bytes.at("t"), 0);
  EXPECT_EQ(f.kv->num_free_blocks(), 16) << "no reference left behind";
}

TEST(CacheControlTest, OverBudgetAndTooBigAreRefusedWithTheReason) {
  CacheControlOptions co;
  co.max_pool_fraction = 0.25;  // 4 of 16 blocks
  Fixture probe(16);
  const int64_t bb = probe.kv->pool().block_bytes();
  co.default_tenant_budget_bytes = 3 * bb;
  co.tenant_budgets["big"] = 100 * bb;
  Fixture f(16, co);
  const std::vector<int32_t> p = Tokens(16, 1);  // 4 blocks
  f.Run(p);
  RetainAnswer a = f.Retain(p, 10, "small");
  EXPECT_EQ(a.outcome, RetainAnswer::Outcome::kRefused);
  EXPECT_EQ(a.reason, "tenant_budget") << a.detail;
  EXPECT_NE(a.detail.find("budget"), std::string::npos);
  const std::vector<int32_t> q = Tokens(20, 500);  // 5 blocks > 4 allowed
  f.Run(q);
  a = f.Retain(q, 10, "big");
  EXPECT_EQ(a.outcome, RetainAnswer::Outcome::kRefused);
  EXPECT_EQ(a.reason, "pool_too_small") << a.detail;
  a = f.Retain(p, 10, "big");
  EXPECT_EQ(a.outcome, RetainAnswer::Outcome::kGranted) << a.detail;
  // Not cached at all.
  a = f.Retain(Tokens(16, 9000), 10, "big");
  EXPECT_EQ(a.reason, "not_cached");
  const CacheControlStats s = f.cc->stats();
  EXPECT_EQ(s.refusals, 3);
  EXPECT_EQ(s.refusals_by_reason.at("tenant_budget"), 1);
  EXPECT_EQ(s.refusals_by_reason.at("pool_too_small"), 1);
}

TEST(CacheControlTest, ClippedRenewRelease) {
  Fixture f(16);
  const std::vector<int32_t> p = Tokens(8, 1);
  f.Run(p);
  std::vector<int32_t> longer = p;
  for (int i = 0; i < 8; ++i) longer.push_back(700 + i);
  RetainAnswer a = f.Retain(longer, 1e9);
  ASSERT_EQ(a.outcome, RetainAnswer::Outcome::kClipped);
  EXPECT_EQ(a.lease.tokens, 8) << "kept what is cached";
  EXPECT_DOUBLE_EQ(a.lease.ttl_s, f.cc->options().max_ttl_s);
  // Another tenant can neither renew nor release it.
  EXPECT_FALSE(f.cc->Release(f.kv.get(), a.lease.id, std::string("other")));
  EXPECT_FALSE(f.cc->Renew(f.kv.get(), a.lease.id, 5, std::string("other")).has_value());
  auto renewed = f.cc->Renew(f.kv.get(), a.lease.id, 5, std::string("t"));
  ASSERT_TRUE(renewed.has_value());
  EXPECT_DOUBLE_EQ(renewed->ttl_s, 5);
  EXPECT_TRUE(f.cc->Release(f.kv.get(), a.lease.id, std::string("t")));
  EXPECT_TRUE(f.kv->EnsureFree(16));
}

TEST(CacheControlTest, ExplainNamesTheDivergenceTokenEvictionAndScope) {
  Fixture f(32);
  const std::vector<int32_t> first = Tokens(14, 1);
  f.Run(first);
  // Same first 9 tokens, then different: diverged at 9 (mid-block).
  std::vector<int32_t> second(first.begin(), first.begin() + 9);
  for (int i = 0; i < 6; ++i) second.push_back(900 + i);
  CacheReport r = f.Explain(second);
  EXPECT_EQ(r.reason, "diverged") << r.detail;
  ASSERT_TRUE(r.diverged_at.has_value());
  EXPECT_EQ(*r.diverged_at, 9);
  EXPECT_EQ(r.cached_tokens, 9);
  ASSERT_FALSE(r.cached_next.empty());
  EXPECT_EQ(r.cached_next[0], first[9]);
  // Never seen.
  r = f.Explain(Tokens(10, 5000));
  EXPECT_EQ(r.reason, "never_seen");
  EXPECT_EQ(r.cached_tokens, 0);
  // All cached: a hit. Extending past: still a hit (the rest is new).
  r = f.Explain(first);
  EXPECT_EQ(r.reason, "hit");
  EXPECT_EQ(r.cached_tokens, 13) << "the last prompt token is always computed";
  // Cached under another salt only.
  r = f.Explain(first, "salt-b");
  EXPECT_EQ(r.reason, "scope_mismatch") << r.detail;
  EXPECT_EQ(r.other_scope_tokens, 14);
  // Sharing a few leading tokens only is no divergence.
  std::vector<int32_t> stranger(first.begin(), first.begin() + 2);
  for (int i = 0; i < 10; ++i) stranger.push_back(4000 + i);
  r = f.Explain(stranger);
  EXPECT_EQ(r.reason, "never_seen") << r.detail;
  // A caller who may not see other scopes gets never_seen.
  r = f.cc->Explain(*f.kv, nullptr, "salt-b", first, [](const std::string&) { return false; });
  EXPECT_EQ(r.reason, "never_seen");
  // Evicted.
  ASSERT_TRUE(f.kv->EnsureFree(32));
  r = f.Explain(first);
  EXPECT_EQ(r.reason, "evicted") << r.detail;
  EXPECT_EQ(r.evicted_to, "none");
}

// Sliding window: a prompt the tree spells whose window the cache dropped
// is reported as window_dropped (how many tokens), not as a plain miss.
TEST(CacheControlTest, ExplainNamesTheWindowDroppedPrefix) {
  Fixture f(64, {}, /*window=*/8);
  const std::vector<int32_t> t = Tokens(40, 100);
  f.Run(t);  // a 40-token prompt: only its last window keeps its K/V
  EXPECT_EQ(f.Explain(t).reason, "hit");
  std::vector<int32_t> q(t.begin(), t.begin() + 24);
  for (int32_t i = 0; i < 8; ++i) q.push_back(900 + i);
  const CacheReport r = f.Explain(q);
  EXPECT_EQ(r.reason, "window_dropped") << r.detail;
  EXPECT_EQ(r.cached_tokens, 0);
  EXPECT_EQ(r.window_dropped_tokens, 24);
  EXPECT_NE(r.detail.find("sliding window"), std::string::npos) << r.detail;
}

TEST(CacheControlTest, PublicPrefixIsSharedAndTheRestStaysPrivate) {
  Fixture f(64);
  PrefixCache* pc = f.kv->mutable_prefix_cache();
  const std::vector<int32_t> sys = Tokens(8, 1);  // the public system prompt: 2 blocks
  f.Run(sys, pc->public_salt());
  EXPECT_EQ(pc->MarkPublic(sys), 2);
  std::vector<int32_t> a_prompt = sys;
  for (int i = 0; i < 8; ++i) a_prompt.push_back(300 + i);
  f.Run(a_prompt, "tenant-a");
  EXPECT_EQ(f.Cached(a_prompt, "tenant-a"), 16) << "A hits its own private part";
  EXPECT_EQ(f.Cached(a_prompt, "tenant-b"), 8) << "B hits only the public part";
  const CacheReport rb = f.Explain(a_prompt, "tenant-b");
  EXPECT_EQ(rb.public_tokens, 8);
  EXPECT_EQ(rb.cached_tokens, 8);
  // The private part of A never shows as B's: B cannot see A's scope.
  const CacheReport rb2 = f.cc->Explain(*f.kv, nullptr, "tenant-b", a_prompt,
                                        [](const std::string& s) { return s == "tenant-b"; });
  EXPECT_NE(rb2.reason, "scope_mismatch");
  EXPECT_EQ(rb2.cached_tokens, 8);
  // Unmarked: the public blocks are nobody's prefix any more.
  EXPECT_EQ(pc->UnmarkPublic(sys), 2);
  EXPECT_EQ(f.Cached(a_prompt, "tenant-b"), 0);
}

// The fixture over KV tiers (a host tier of host_bytes, a disk tier in
// dir), wired as the engine wires them.
struct TieredFixture {
  FakeClock clock;
  std::unique_ptr<CacheControl> cc;
  std::shared_ptr<KvTiers> tiers;
  std::unique_ptr<KvCacheManager> kv;

  TieredFixture(int32_t blocks, int64_t host_bytes, const std::string& dir) {
    CacheControlOptions co;
    co.clock = &clock;
    cc = std::make_unique<CacheControl>(co);
    KvTiersOptions to;
    to.host_bytes = host_bytes;
    to.disk_dir = dir;
    to.disk_bytes = dir.empty() ? 0 : int64_t{16} << 20;
    to.model_fingerprint = "test-model";
    tiers = KvTiers::Create(to).value();
    KvCacheManagerOptions o;
    o.pool.n_layers = 1;
    o.pool.n_kv_heads = 1;
    o.pool.head_dim = 8;
    o.pool.block_size = kBlock;
    o.pool.n_blocks = blocks;
    o.pool.dtype = kernels::KvDType::kF32;
    o.prefix.model_identity = "test";
    o.prefix.clock = &clock;
    o.prefix.demotion = tiers.get();
    CacheControl* raw = cc.get();
    o.prefix.on_evict = [raw](uint64_t h, KvTier t) { raw->OnEvict(h, t, "lru"); };
    kv = KvCacheManager::Create(std::move(o)).value();
    EXPECT_TRUE(tiers->Attach(kv->pool(), kv->prefix_cache()).ok());
    tiers->SetRetainedPredicate([raw](uint64_t h) { return raw->WasRetained(h); });
  }
  ~TieredFixture() {
    tiers->Flush();
    cc->ReleaseAll(kv.get());
  }
  void Run(const std::vector<int32_t>& tokens, std::string_view salt = "") {
    clock.now += 1000;
    SeqKv s(kv->mutable_pool());
    const int32_t hit = kv->MatchPrefix(&s, salt, tokens, static_cast<int32_t>(tokens.size()));
    const int32_t rest = static_cast<int32_t>(tokens.size()) - hit;
    ASSERT_TRUE(kv->EnsureFree(kv->BlocksNeeded(s, rest)));
    ASSERT_TRUE(kv->AllocateSlots(&s, rest).ok());
    kv->MarkComputed(&s, rest);
    kv->Commit(&s, salt, tokens, rest);
    kv->Free(&s, salt, tokens);
  }
  RetainAnswer Retain(const std::vector<int32_t>& tokens, double ttl) {
    RetainRequest r;
    r.tenant = "t";
    r.tokens = tokens;
    r.ttl_s = ttl;
    return cc->Retain(kv.get(), r);
  }
  // The report for tokens plus one more (the last token is never cached).
  CacheReport Explain(std::vector<int32_t> tokens, std::string_view salt = "") {
    tiers->Flush();
    tokens.push_back(7);
    return cc->Explain(*kv, tiers.get(), salt, tokens, nullptr);
  }
};

std::string FreshDir(const std::string& name) {
  const std::string d = testing::TempDir() + "/cache-control-" + name;
  std::filesystem::remove_all(d);
  return d;
}

TEST(CacheControlTiersTest, ALapsedRetainedPrefixReachesTheDiskTierThoughNeverHit) {
  TieredFixture f(16, /*host_bytes=*/0, FreshDir("demote"));
  const std::vector<int32_t> keep = Tokens(16, 1000);   // 4 blocks, computed once
  const std::vector<int32_t> other = Tokens(16, 5000);  // the same, not retained
  f.Run(keep);
  f.Run(other);
  ASSERT_EQ(f.Retain(keep, 1).outcome, RetainAnswer::Outcome::kGranted);
  f.clock.now += 2'000'000'000;
  f.cc->Expire(f.kv.get());
  for (int i = 0; i < 6; ++i) f.Run(Tokens(16, 10000 + 100 * i));  // evicts both
  const CacheReport k = f.Explain(keep);
  EXPECT_EQ(k.primary_tokens, 0);
  EXPECT_EQ(k.disk_tokens, 16) << "demoted, not dropped: " << k.detail;
  const CacheReport o = f.Explain(other);
  EXPECT_EQ(o.disk_tokens, 0) << "a once-used prefix does not qualify for the disk";
}

TEST(CacheControlTiersTest, ADemotedPublicPrefixIsFoundByEveryScopeThePrivatePartByItsOwn) {
  TieredFixture f(16, /*host_bytes=*/1 << 20, "");
  PrefixCache* pc = f.kv->mutable_prefix_cache();
  const std::vector<int32_t> sys = Tokens(8, 1);  // 2 public blocks
  f.Run(sys, pc->public_salt());
  ASSERT_EQ(pc->MarkPublic(sys), 2);
  std::vector<int32_t> a_prompt = sys;
  for (int i = 0; i < 8; ++i) a_prompt.push_back(300 + i);
  f.Run(a_prompt, "tenant-a");
  for (int i = 0; i < 6; ++i) f.Run(Tokens(16, 10000 + 100 * i), "tenant-c");
  ASSERT_EQ(f.kv->PeekPrefix("tenant-b", a_prompt, 16), 0) << "all of it left the pool";
  const CacheReport b = f.Explain(a_prompt, "tenant-b");
  EXPECT_EQ(b.host_tokens, 8) << "B finds the public part in the host tier: " << b.detail;
  const CacheReport a = f.Explain(a_prompt, "tenant-a");
  EXPECT_EQ(a.host_tokens, 16) << "A finds its private part too: " << a.detail;
  EXPECT_EQ(f.tiers->Lookup("tenant-b", a_prompt, 0, 16), 8);
  EXPECT_EQ(f.tiers->Lookup("tenant-a", a_prompt, 0, 16), 16);
  // Computed again (as a load would commit it) the public blocks are
  // public in the pool again, and A's part hangs behind them.
  f.Run(a_prompt, "tenant-a");
  EXPECT_EQ(pc->num_public_blocks(), 2);
  EXPECT_EQ(f.kv->PeekPrefix("tenant-b", a_prompt, 16), 8);
  EXPECT_EQ(f.kv->PeekPrefix("tenant-a", a_prompt, 16), 16);
}

TEST(CacheControlTiersTest, LeasesRoundTripThroughTheRetentionTable) {
  const std::string dir = FreshDir("restart");
  const std::vector<int32_t> keep = Tokens(16, 1000);
  const std::vector<int32_t> brief = Tokens(8, 3000);
  std::string table;
  {
    TieredFixture a(16, 0, dir);
    a.Run(keep);
    a.Run(brief);
    ASSERT_EQ(a.Retain(keep, 600).outcome, RetainAnswer::Outcome::kGranted);
    ASSERT_EQ(a.Retain(brief, 0.05).outcome, RetainAnswer::Outcome::kGranted);
    EXPECT_EQ(a.cc->SaveRetention(a.tiers.get()), 2);
    EXPECT_EQ(a.tiers->PersistForRestart(*a.kv->prefix_cache()), 6) << "retained blocks, unhit";
    table = a.tiers->disk_directory() + "/" + kDiskTierRetentionFile;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(120));  // brief's lease lapses
  std::string good;
  {
    std::ifstream in(table, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_FALSE(good.empty());
  {
    TieredFixture b(16, 0, dir);
    EXPECT_EQ(b.cc->RestoreRetention(b.kv.get(), b.tiers.get()), 1);
    const std::vector<LeaseInfo> l = b.cc->List(std::nullopt);
    ASSERT_EQ(l.size(), 1u);
    EXPECT_EQ(l[0].tier, "disk");
    EXPECT_EQ(l[0].tokens, 16);
    EXPECT_EQ(l[0].tenant, "t");
    EXPECT_GT(l[0].remaining_s, 590);
    EXPECT_LE(l[0].remaining_s, 600);
    EXPECT_EQ(b.Explain(keep).disk_tokens, 16);
    // Released: the pins on its files go.
    EXPECT_TRUE(b.cc->Release(b.kv.get(), l[0].id, std::nullopt));
  }
  // Torn, altered, and well formed but of another fingerprint.
  std::string foreign = "kvserve-retention 1\nfingerprint 0000000000000000\nend 0\n";
  char sum[40];
  std::snprintf(sum, sizeof(sum), "checksum %016llx\n",
                static_cast<unsigned long long>(XXH3_64bits(foreign.data(), foreign.size())));
  foreign += sum;
  for (const std::string& bad :
       {good.substr(0, good.size() / 2), good.substr(0, good.size() - 3) + "0\n", foreign}) {
    std::ofstream(table, std::ios::binary | std::ios::trunc) << bad;
    TieredFixture c(16, 0, dir);
    EXPECT_EQ(c.cc->RestoreRetention(c.kv.get(), c.tiers.get()), 0);
    EXPECT_TRUE(c.cc->List(std::nullopt).empty());
  }
}

}  // namespace
}  // namespace kvserve
