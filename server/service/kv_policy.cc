// The implementation of kv_policy.h. What it owns and how it is used: the
// opening paragraph of server/service/kv_policy.h.

#include "server/service/kv_policy.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvserve {
namespace {

// 2 x (sinks + window), saturated so that absurd inputs reach the validation
// (which names them) instead of overflowing.
int32_t DerivedBudget(int32_t sinks, int32_t window) {
  const int64_t b = 2 * (static_cast<int64_t>(sinks) + static_cast<int64_t>(window));
  return static_cast<int32_t>(std::clamp<int64_t>(b, 0, std::numeric_limits<int32_t>::max()));
}

}  // namespace

absl::StatusOr<KvPolicy> ResolveKvPolicy(const std::optional<KvPolicyParams>& request,
                                         const KvPolicyDefaults& defaults) {
  const KvPolicyParams none;
  const KvPolicyParams& r = request ? *request : none;
  KvPolicy p;
  p.kind = defaults.kind;
  if (r.policy) {
    absl::Status parsed = ParseKvPolicyKind(*r.policy, &p.kind);
    if (!parsed.ok()) return parsed;
  }
  p.sinks = r.sinks.value_or(defaults.sinks);
  p.window = r.window.value_or(defaults.window);
  if (r.budget) {
    p.budget = *r.budget;
  } else if (defaults.budget > 0) {
    p.budget = defaults.budget;
  } else {
    p.budget = DerivedBudget(p.sinks, p.window);
  }
  return p;
}

absl::StatusOr<KvPolicyDefaults> KvPolicyDefaultsFromFlags(const KvPolicyFlags& f) {
  KvPolicyDefaults d;
  if (absl::Status s = ParseKvPolicyKind(f.policy, &d.kind); !s.ok()) {
    // ParseKvPolicyKind speaks of the request field; here it is the flag.
    absl::string_view why = s.message();
    absl::ConsumePrefix(&why, "kv_policy");
    absl::ConsumePrefix(&why, ": ");
    return absl::InvalidArgumentError(absl::StrCat("--kv-policy: ", why));
  }
  if (f.sinks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-sinks must be >= 0 (got ", f.sinks, ")"));
  }
  if (f.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-window must be >= 1 (got ", f.window, ")"));
  }
  if (f.budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-budget must be >= 0 (0: 2 x (sinks + window); got ", f.budget, ")"));
  }
  // An explicit budget is checked against the default sinks and window even
  // when the default policy is not h2o: a request that names h2o alone
  // would get it.
  if (f.budget > 0 && static_cast<int64_t>(f.budget) <= static_cast<int64_t>(f.sinks) + f.window) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-budget (", f.budget, ") must be larger than --kv-sinks + --kv-window (",
                     f.sinks, " + ", f.window, "), or 0"));
  }
  d.sinks = f.sinks;
  d.window = f.window;
  d.budget = f.budget;
  return d;
}

absl::Status CheckKvPolicyDefaults(const KvPolicyDefaults& defaults, const RequestLimits& limits) {
  if (defaults.kind == KvPolicy::Kind::kNone) return absl::OkStatus();
  // The smallest request there is, carrying the default policy: whatever
  // ValidateEngineRequest finds wrong with it is the policy's fault.
  EngineRequest probe;
  probe.prompt = {0};
  probe.params.max_tokens = 1;
  absl::StatusOr<KvPolicy> policy = ResolveKvPolicy(std::nullopt, defaults);
  if (!policy.ok()) return policy.status();
  probe.kv_policy = *policy;
  RequestLimits l = limits;
  l.num_blocks = 0;
  absl::Status s = ValidateEngineRequest(probe, l);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-policy ", KvPolicyName(defaults.kind),
                   " (with --kv-sinks, --kv-window, --kv-budget): ", s.message()));
}

}  // namespace kvserve
