// The kv_policy a request runs with: each field the request leaves out comes
// from the server's defaults, an h2o budget left at 0 everywhere is derived
// from the sinks and window in force, an unknown name is refused naming the
// valid ones; and the --kv-* flags are refused naming the flag.
#include "server/service/kv_policy.h"

#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

TEST(KvPolicyTest, NoRequestPolicyTakesTheDefaultsWhole) {
  KvPolicyDefaults d;
  d.kind = KvPolicy::Kind::kSinks;
  d.sinks = 2;
  d.window = 32;
  absl::StatusOr<KvPolicy> p = ResolveKvPolicy(std::nullopt, d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kind, KvPolicy::Kind::kSinks);
  EXPECT_EQ(p->sinks, 2);
  EXPECT_EQ(p->window, 32);
  EXPECT_EQ(p->budget, 2 * (2 + 32));
}

TEST(KvPolicyTest, EachFieldTheRequestSetsWinsAndTheRestAreDefaults) {
  KvPolicyDefaults d;  // none, 4, 256, 0
  KvPolicyParams r;
  r.policy = "h2o";
  r.window = 16;
  absl::StatusOr<KvPolicy> p = ResolveKvPolicy(r, d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kind, KvPolicy::Kind::kH2O);
  EXPECT_EQ(p->sinks, 4);
  EXPECT_EQ(p->window, 16);
  EXPECT_EQ(p->budget, 2 * (4 + 16));  // derived from the window in force

  r.sinks = 0;  // 0 is a value, not "unset"
  r.budget = 100;
  p = ResolveKvPolicy(r, d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->sinks, 0);
  EXPECT_EQ(p->budget, 100);

  // An explicit server budget stands for requests that give none.
  d.budget = 600;
  r.budget.reset();
  p = ResolveKvPolicy(r, d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->budget, 600);

  // A request may turn a server default off.
  d.kind = KvPolicy::Kind::kWindow;
  KvPolicyParams off;
  off.policy = "none";
  p = ResolveKvPolicy(off, d);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kind, KvPolicy::Kind::kNone);
}

TEST(KvPolicyTest, UnknownNameIsRefusedNamingTheField) {
  KvPolicyParams r;
  r.policy = "lru";
  absl::StatusOr<KvPolicy> p = ResolveKvPolicy(r, {});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("kv_policy"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("h2o"));
}

TEST(KvPolicyTest, DerivedBudgetSaturatesInsteadOfOverflowing) {
  KvPolicyParams r;
  r.policy = "h2o";
  r.sinks = std::numeric_limits<int32_t>::max();
  r.window = std::numeric_limits<int32_t>::max();
  absl::StatusOr<KvPolicy> p = ResolveKvPolicy(r, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->budget, std::numeric_limits<int32_t>::max());
}

TEST(KvPolicyTest, FlagsAreCheckedNamingTheFlag) {
  struct Case {
    KvPolicyFlags flags;
    const char* flag;
  };
  const Case cases[] = {
      {{"bogus", 4, 256, 0}, "--kv-policy"}, {{"none", -1, 256, 0}, "--kv-sinks"},
      {{"none", 4, 0, 0}, "--kv-window"},    {{"none", 4, 256, -5}, "--kv-budget"},
      {{"h2o", 4, 256, 100}, "--kv-budget"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flag);
    absl::StatusOr<KvPolicyDefaults> d = KvPolicyDefaultsFromFlags(c.flags);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(d.status().message()), HasSubstr(c.flag));
  }
  absl::StatusOr<KvPolicyDefaults> d = KvPolicyDefaultsFromFlags({"h2o", 2, 64, 0});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kind, KvPolicy::Kind::kH2O);
  EXPECT_EQ(d->budget, 0);  // derived per request
}

TEST(KvPolicyTest, DefaultsAreCheckedAgainstTheEngine) {
  RequestLimits limits;
  limits.vocab_size = 32;
  limits.context_length = 128;
  KvPolicyDefaults d;
  d.kind = KvPolicy::Kind::kSinks;  // 4 + 256 > 128
  absl::Status s = CheckKvPolicyDefaults(d, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--kv-policy"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("context length"));
  d.window = 64;
  EXPECT_TRUE(CheckKvPolicyDefaults(d, limits).ok());
  limits.kv_eviction_unsupported = "int4 keeps per-block scales";
  s = CheckKvPolicyDefaults(d, limits);
  EXPECT_THAT(std::string(s.message()), HasSubstr("per-block scales"));
  // none needs nothing from the engine.
  EXPECT_TRUE(CheckKvPolicyDefaults({}, limits).ok());
}

}  // namespace
}  // namespace kvserve
