// The response cache's request-side parsing, apart from the cache itself:
// the `response_cache` object of an OpenAI request (ParseResponseCacheJson,
// declared in response_cache_api.h) and the semantic mode names
// (ParseSemanticMode, response_cache.h). Depends only on JSON and abseil,
// so the pure OpenAI request parser links it without the engine (the
// fuzz target in tests/fuzz does).
#include "absl/strings/str_cat.h"
#include "server/frontend/response_cache_api.h"

namespace kvserve {

using json = nlohmann::json;

absl::StatusOr<SemanticMode> ParseSemanticMode(std::string_view name) {
  if (name == "off") return SemanticMode::kOff;
  if (name == "verified") return SemanticMode::kVerified;
  if (name == "approximate") return SemanticMode::kApproximate;
  return absl::InvalidArgumentError(absl::StrCat("response_cache.semantic: unknown mode '",
                                                 std::string(name),
                                                 "' (expected off, verified or approximate)"));
}

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

}  // namespace kvserve
