// Token eviction as the APIs see it: the server's default policy (the --kv-*
// flags of `serve` and `generate`), a request's partial kv_policy (any of
// name, sinks, window, budget may be left out), and the one place that merges
// the two into the EngineRequest's KvPolicy. The rules on the merged policy
// stay ValidateEngineRequest's (scheduler/request.h); this file only fills
// fields, parses the name and checks the flags at start-up, so a bad default
// stops the process with a message naming the flag rather than failing every
// request later.
//
// Thread-safety: plain data and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "scheduler/request.h"
#include "server/app/serve_flags.h"

namespace kvserve {

// What a request takes for each kv_policy field it leaves unset.
struct KvPolicyDefaults {
  KvPolicy::Kind kind = KvPolicy::Kind::kNone;
  int32_t sinks = 4;
  int32_t window = 256;
  // h2o's budget; 0: 2 x (sinks + window), from the request's own sinks and
  // window when it sets them.
  int32_t budget = 0;
};

// A request's kv_policy as both protocols express it: every part optional.
struct KvPolicyParams {
  std::optional<std::string> policy;  // "none", "window", "sinks", "h2o"
  std::optional<int32_t> sinks;
  std::optional<int32_t> window;
  std::optional<int32_t> budget;
};

// The policy a request runs with: each field from `request` when set there,
// else from `defaults` (no request kv_policy at all: the defaults whole).
// InvalidArgument starting with "kv_policy" and naming the valid names for an
// unknown policy; the numbers are left for ValidateEngineRequest.
[[nodiscard]] absl::StatusOr<KvPolicy> ResolveKvPolicy(const std::optional<KvPolicyParams>& request,
                                                       const KvPolicyDefaults& defaults);

// --kv-policy, --kv-sinks, --kv-window, --kv-budget as defaults.
// InvalidArgument naming the flag for an unknown policy or a number out of
// range (sinks < 0, window < 1, budget < 0, or an h2o budget not above
// sinks + window).
[[nodiscard]] absl::StatusOr<KvPolicyDefaults> KvPolicyDefaultsFromFlags(
    const KvPolicyFlags& flags);

// Whether the default policy can run on an engine with `limits` (context
// length, eviction supported by its KV codec): InvalidArgument naming
// --kv-policy otherwise. A default of none always can.
[[nodiscard]] absl::Status CheckKvPolicyDefaults(const KvPolicyDefaults& defaults,
                                                 const RequestLimits& limits);

}  // namespace kvserve
