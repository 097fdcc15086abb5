// The response cache as the HTTP front end speaks it, kept out of
// http_server.cc so the server's call sites stay a few lines (and survive a
// rewrite of the HTTP layer): the request's `response_cache` object, the
// reply's `x-kvserve-cache` header value and `kvserve_cache` extension
// object, and the admin purge route's body and answer.
//
// Request (all fields optional; kvserve's extension to OpenAI's schema):
//   "response_cache": {"lookup": true, "store": true,
//                      "semantic": "off" | "verified" | "approximate",
//                      "min_similarity": 0.92}
//   or "response_cache": false   (= lookup and store off)
// Admin: POST /admin/response_cache/purge with {} (the caller's tenant, every
// salt), {"cache_salt": "s"} (the caller's tenant, that salt) or
// {"all": true} (every entry) -> {"purged": N}.
//
// Thread-safety: free functions over their arguments.
#pragma once

#include <optional>
#include <string>

#include "nlohmann/json.hpp"
#include "server/service/model_service.h"
#include "server/service/response_cache.h"

namespace kvserve {

// The header that carries the hit kind.
inline constexpr char kCacheHeader[] = "x-kvserve-cache";

// Reads body["response_cache"] into *out; an error message naming the field
// when it is malformed (the caller answers 400 with param response_cache).
std::optional<std::string> ParseResponseCacheJson(const nlohmann::json& body,
                                                  ResponseCacheControl* out);

// {"kind": "exact", "similarity": s, "draft_tokens": d, "accepted_tokens": a}
// (the semantic fields only for semantic hits; accepted_tokens from the
// completed reply); null when the cache is off.
nlohmann::json CacheOutcomeJson(const CacheOutcome& outcome, const CompletedResponse& done);

// The purge route: the HTTP status and the JSON answer.
struct PurgeAnswer {
  int status = 200;
  nlohmann::json body;
};
PurgeAnswer PurgeResponseCacheHttp(ModelService* service, const std::string& tenant,
                                   const std::string& request_body);

}  // namespace kvserve
