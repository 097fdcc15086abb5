// The implementation of response_cache_api.h. What it owns and how it is used: the
// opening paragraph of server/frontend/response_cache_api.h.

#include "server/frontend/response_cache_api.h"

#include "absl/strings/str_cat.h"

namespace kvserve {

using json = nlohmann::json;


json CacheOutcomeJson(const CacheOutcome& o, const CompletedResponse& done) {
  if (o.kind == CacheHitKind::kOff) return nullptr;
  json j = {{"kind", CacheHitKindName(o.kind)}};
  if (o.kind == CacheHitKind::kSemanticVerified || o.kind == CacheHitKind::kApproximate) {
    j["similarity"] = o.similarity;
  }
  if (o.kind == CacheHitKind::kSemanticVerified) {
    j["draft_tokens"] = o.draft_tokens;
    j["accepted_tokens"] = done.draft_accepted;
  }
  return j;
}

PurgeAnswer PurgeResponseCacheHttp(ModelService* service, const std::string& tenant,
                                   const std::string& request_body) {
  auto error = [](int status, const std::string& message, const char* code) {
    return PurgeAnswer{status, json{{"error",
                                     {{"message", message},
                                      {"type", status == 400 ? "invalid_request_error" : "error"},
                                      {"param", nullptr},
                                      {"code", code}}}}};
  };
  json body = request_body.empty() ? json::object()
                                   : json::parse(request_body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return error(400, "the request body must be a JSON object", "invalid_json");
  }
  bool all = false;
  std::optional<std::string> salt;
  for (const auto& [key, value] : body.items()) {
    if (key == "all") {
      if (!value.is_boolean()) return error(400, "all must be a boolean", "invalid_value");
      all = value.get<bool>();
    } else if (key == "cache_salt") {
      if (!value.is_string()) return error(400, "cache_salt must be a string", "invalid_value");
      salt = value.get<std::string>();
    } else {
      return error(400, absl::StrCat("unknown field '", key, "' (expected all, cache_salt)"),
                   "invalid_value");
    }
  }
  if (all && salt) return error(400, "give all or cache_salt, not both", "invalid_value");
  absl::StatusOr<int64_t> purged =
      service->PurgeResponseCache(all ? std::nullopt : std::optional<std::string>(tenant), salt);
  if (!purged.ok()) {
    return error(409, std::string(purged.status().message()), "response_cache_disabled");
  }
  return PurgeAnswer{200, json{{"purged", *purged}}};
}

}  // namespace kvserve
