// The per-tier split of a response's cached prompt tokens, as kvserve's own
// field of an OpenAI usage object: "kv_cached_tokens_by_tier": {"primary":
// P, "host": H, "disk": D, "lossy": L}, with P + H + D = prompt_tokens_details.
// cached_tokens and L of them (any tier) K/V a tier re-encoded lossily
// (--kv-host-dtype). Present only when a KV tier served some tokens or
// some were lossy, so plain usage stays OpenAI's. The HTTP server adds it with one line in its usage
// builder: AddKvTierUsage(done, &usage).
//
// Thread-safety: a pure function.
#pragma once

#include <algorithm>

#include "server/service/completed_response.h"

namespace kvserve {

// Json: nlohmann::json (a template so this header needs no JSON library).
template <typename Json>
void AddKvTierUsage(const CompletedResponse& done, Json* usage) {
  const int32_t host = std::max(0, done.cached_host_tokens);
  const int32_t disk = std::max(0, done.cached_disk_tokens);
  const int32_t cached = std::clamp(done.cached_tokens, 0, done.prompt_tokens);
  const int32_t lossy = std::clamp(done.cached_lossy_tokens, 0, cached);
  if (host + disk + lossy == 0) return;
  (*usage)["kv_cached_tokens_by_tier"] = {{"primary", std::max(0, cached - host - disk)},
                                          {"host", host},
                                          {"disk", disk},
                                          {"lossy", lossy}};
}

}  // namespace kvserve
