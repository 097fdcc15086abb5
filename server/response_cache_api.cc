#include "server/response_cache_api.h"

#include "absl/strings/str_cat.h"

namespace kvserve {

using json = nlohmann::json;

std::optional<std::string> ParseResponseCacheJson(const json& body, ResponseCacheControl* out) {
  auto it = body.find("response_cache");
  if (it == body.end() || it->is_null()) return std::nullopt;
  const json& v = *it;
  if (v.is_boolean()) {
    out->lookup = out->store = v.get<bool>();
    return std::nullopt;
  }
  if (!v.is_object()) {
    return "response_cache must be an object {lookup, store, semantic, min_similarity} or a "
           "boolean";
  }
  for (const auto& [key, value] : v.items()) {
    if (value.is_null()) continue;
    if (key == "lookup" || key == "store") {
      if (!value.is_boolean()) return absl::StrCat("response_cache.", key, " must be a boolean");
      (key == "lookup" ? out->lookup : out->store) = value.get<bool>();
    } else if (key == "semantic") {
      if (!value.is_string()) return "response_cache.semantic must be a string";
      absl::StatusOr<SemanticMode> mode = ParseSemanticMode(value.get<std::string>());
      if (!mode.ok()) return std::string(mode.status().message());
      out->semantic = *mode;
    } else if (key == "min_similarity") {
      if (!value.is_number()) return "response_cache.min_similarity must be a number";
      out->min_similarity = value.get<float>();
    } else {
      return absl::StrCat("response_cache: unknown field '", key,
                          "' (expected lookup, store, semantic, min_similarity)");
    }
  }
  return std::nullopt;
}

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
