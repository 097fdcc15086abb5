// /v1/embeddings, /tokenize and /detokenize (see openai_utility.h).
#include "server/frontend/openai_utility.h"

#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/frontend/openai_request.h"
#include "server/frontend/openai_response.h"

namespace kvserve {

namespace {

using json = nlohmann::json;

UtilityReply Error(int status, std::string message, std::string param, std::string code) {
  return {status, ErrorBody(ApiError{status, std::move(message), std::move(param), std::move(code)})};
}

UtilityReply Error(const ApiError& e) { return {e.status, ErrorBody(e)}; }

UtilityReply Ok(const json& j) {
  return {200, j.dump(-1, ' ', false, json::error_handler_t::replace)};
}

std::optional<UtilityReply> ParseObject(std::string_view body, json* out) {
  *out = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) return Error(400, "the request body is not valid JSON", "", "invalid_json");
  if (!out->is_object()) return Error(400, "the request body must be a JSON object", "", "invalid_json");
  return std::nullopt;
}

// Refuses the first non-null field outside `known`.
std::optional<UtilityReply> RefuseUnknown(const json& body, std::initializer_list<const char*> known,
                                          const char* endpoint) {
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) {
      return Error(400, absl::StrCat(key, ": not a field this server honours on ", endpoint), key,
                   "unknown_parameter");
    }
  }
  return std::nullopt;
}

// The body's float32 values, little-endian, base64 (what the openai client
// decodes with numpy.frombuffer(..., dtype="float32")).
std::string Base64Floats(const std::vector<float>& v) {
  std::string bytes(v.size() * sizeof(float), '\0');
  static_assert(sizeof(float) == 4);
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    for (int b = 0; b < 4; ++b) bytes[i * 4 + b] = static_cast<char>((u >> (8 * b)) & 0xff);
  }
  return absl::Base64Escape(bytes);
}

}  // namespace

UtilityReply EmbeddingsHttp(const TextEmbedder* embedder, const std::string& model_name,
                            std::string_view body) {
  if (embedder == nullptr) {
    return Error(404,
                 "this server serves no embedding model (start it with --semantic-cache-model)",
                 "", "not_found");
  }
  json j;
  if (auto e = ParseObject(body, &j)) return *e;
  if (auto e = RefuseUnknown(j, {"input", "model", "encoding_format", "dimensions"},
                             "/v1/embeddings")) {
    return *e;
  }
  // model: required by OpenAI; it must name the embedding model.
  auto model = j.find("model");
  if (model == j.end() || model->is_null()) {
    return Error(400, "model is required", "model", "invalid_type");
  }
  if (!model->is_string()) return Error(400, "model must be a string", "model", "invalid_type");
  if (model->get<std::string>() != model_name) {
    return Error(404,
                 absl::StrCat("model '", model->get<std::string>(),
                              "' does not exist; this server embeds with '", model_name, "'"),
                 "model", "model_not_found");
  }
  bool base64 = false;
  if (auto f = j.find("encoding_format"); f != j.end() && !f->is_null()) {
    if (*f == "base64") {
      base64 = true;
    } else if (*f != "float") {
      return Error(400, "encoding_format must be \"float\" or \"base64\"", "encoding_format",
                   "invalid_value");
    }
  }
  if (auto d = j.find("dimensions"); d != j.end() && !d->is_null()) {
    if (!d->is_number_integer() || d->get<int64_t>() != embedder->dim()) {
      return Error(400,
                   absl::StrCat("dimensions is not supported: this model's embeddings have ",
                                embedder->dim(), " dimensions and are not shortened"),
                   "dimensions", "unsupported_parameter");
    }
  }
  // input: a string or an array of strings (token-id inputs are the LLM's
  // vocabulary in OpenAI's API, not the encoder's: refused).
  auto in = j.find("input");
  if (in == j.end() || in->is_null()) return Error(400, "input is required", "input", "invalid_type");
  std::vector<std::string> inputs;
  if (in->is_string()) {
    inputs.push_back(in->get<std::string>());
  } else if (in->is_array() && !in->empty()) {
    for (const json& s : *in) {
      if (!s.is_string()) {
        return Error(400,
                     "input must be a string or an array of strings (token-id inputs are not "
                     "supported by this embedding model)",
                     "input", "invalid_type");
      }
      inputs.push_back(s.get<std::string>());
    }
  } else {
    return Error(400, "input must be a non-empty string or array of strings", "input",
                 "invalid_type");
  }
  if (inputs.size() > kMaxEmbeddingInputs) {
    return Error(400,
                 absl::StrCat("input: ", inputs.size(), " inputs exceed the limit of ",
                              kMaxEmbeddingInputs, " per request"),
                 "input", "invalid_value");
  }
  // Every input is checked before any is embedded.
  int64_t tokens = 0;
  const int32_t limit = embedder->max_tokens();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].empty()) {
      return Error(400, absl::StrCat("input[", i, "] is empty"), "input", "invalid_value");
    }
    absl::StatusOr<int32_t> n = embedder->CountTokens(inputs[i]);
    if (!n.ok()) {
      return Error(400, absl::StrCat("input[", i, "]: ", n.status().message()), "input",
                   "invalid_value");
    }
    if (limit > 0 && *n > limit) {
      return Error(400,
                   absl::StrCat("input[", i, "] is ", *n, " tokens, over the model's limit of ",
                                limit, " tokens per input"),
                   "input", "context_length_exceeded");
    }
    tokens += *n;
  }
  json data = json::array();
  for (size_t i = 0; i < inputs.size(); ++i) {
    absl::StatusOr<std::vector<float>> v = embedder->Embed(inputs[i]);
    if (!v.ok()) {
      return Error(400, absl::StrCat("input[", i, "]: ", v.status().message()), "input",
                   "invalid_value");
    }
    json e = {{"object", "embedding"}, {"index", i}};
    e["embedding"] = base64 ? json(Base64Floats(*v)) : json(*v);
    data.push_back(std::move(e));
  }
  return Ok({{"object", "list"},
             {"data", std::move(data)},
             {"model", model_name},
             {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}});
}

UtilityReply TokenizeHttp(ModelService* service, std::string_view body) {
  json j;
  if (auto e = ParseObject(body, &j)) return *e;
  if (auto e = RefuseUnknown(j, {"model", "prompt", "messages", "tools", "add_special_tokens",
                                 "add_generation_prompt", "return_token_strs"},
                             "/tokenize")) {
    return *e;
  }
  if (auto m = j.find("model"); m != j.end() && !m->is_null()) {
    if (!m->is_string()) return Error(400, "model must be a string", "model", "invalid_type");
    if (m->get<std::string>() != service->model_name()) {
      return Error(404,
                   absl::StrCat("model '", m->get<std::string>(), "' does not exist; this server "
                                "serves '", service->model_name(), "'"),
                   "model", "model_not_found");
    }
  }
  auto flag = [&](const char* key, bool def, std::optional<UtilityReply>* err) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_boolean()) *err = Error(400, absl::StrCat(key, " must be a boolean"), key, "invalid_type");
    return it->is_boolean() ? it->get<bool>() : def;
  };
  std::optional<UtilityReply> err;
  const bool has_prompt = j.contains("prompt") && !j["prompt"].is_null();
  const bool has_messages = j.contains("messages") && !j["messages"].is_null();
  // vLLM's defaults: special tokens for a prompt, none added around a chat.
  const bool add_special = flag("add_special_tokens", has_prompt, &err);
  const bool add_generation_prompt = flag("add_generation_prompt", true, &err);
  const bool token_strs = flag("return_token_strs", false, &err);
  if (err) return *err;
  if (has_prompt == has_messages) {
    return Error(400, "send exactly one of prompt and messages", has_prompt ? "messages" : "prompt",
                 "invalid_value");
  }
  std::vector<int32_t> ids;
  if (has_prompt) {
    if (!j["prompt"].is_string()) return Error(400, "prompt must be a string", "prompt", "invalid_type");
    if (j.contains("tools") && !j["tools"].is_null()) {
      return Error(400, "tools needs messages", "tools", "invalid_value");
    }
    absl::StatusOr<std::vector<int32_t>> t =
        service->Tokenize(j["prompt"].get<std::string>(), add_special, /*parse_special=*/false);
    if (!t.ok()) return Error(ApiErrorFromStatus(t.status()));
    ids = *std::move(t);
  } else {
    if (!add_generation_prompt) {
      return Error(400,
                   "add_generation_prompt false is not supported: chats are rendered with the "
                   "assistant's opening, as completions send them",
                   "add_generation_prompt", "unsupported_parameter");
    }
    if (add_special) {
      return Error(400,
                   "add_special_tokens true is not supported with messages: the chat template "
                   "writes the special tokens",
                   "add_special_tokens", "unsupported_parameter");
    }
    // Exactly what a chat completion would run: its parser and Prepare.
    // Key order kept: the tool catalogue is rendered as the client wrote it.
    nlohmann::ordered_json ordered =
        nlohmann::ordered_json::parse(body.begin(), body.end(), nullptr, false);
    nlohmann::ordered_json chat = {{"messages", ordered["messages"]}, {"max_tokens", 1}};
    if (j.contains("tools") && !j["tools"].is_null()) chat["tools"] = ordered["tools"];
    OpenAiRequest parsed;
    if (auto e = ParseOpenAiRequest(chat.dump(), /*chat=*/true, &parsed)) return Error(*e);
    absl::StatusOr<PreparedRequest> prepared = service->Prepare(parsed.params);
    if (!prepared.ok()) return Error(ApiErrorFromStatus(prepared.status()));
    ids = prepared->engine.prompt;
  }
  json out = {{"count", ids.size()},
              {"max_model_len", service->Info().config.context_length},
              {"tokens", ids},
              {"token_strs", nullptr}};
  if (token_strs) {
    json strs = json::array();
    for (int32_t t : ids) strs.push_back(service->Detokenize({t}).value_or(""));
    out["token_strs"] = std::move(strs);
  }
  return Ok(out);
}

UtilityReply DetokenizeHttp(ModelService* service, std::string_view body) {
  json j;
  if (auto e = ParseObject(body, &j)) return *e;
  if (auto e = RefuseUnknown(j, {"model", "tokens"}, "/detokenize")) return *e;
  if (auto m = j.find("model"); m != j.end() && !m->is_null()) {
    if (!m->is_string() || m->get<std::string>() != service->model_name()) {
      return Error(404, absl::StrCat("model does not exist; this server serves '",
                                     service->model_name(), "'"),
                   "model", "model_not_found");
    }
  }
  auto t = j.find("tokens");
  if (t == j.end() || !t->is_array()) {
    return Error(400, "tokens must be an array of token ids", "tokens", "invalid_type");
  }
  std::vector<int32_t> ids;
  for (const json& v : *t) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return Error(400, "tokens must be an array of token ids", "tokens", "invalid_type");
    }
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  absl::StatusOr<std::string> text = service->Detokenize(ids);
  if (!text.ok()) {
    return Error(400, absl::StrCat("tokens: ", text.status().message()), "tokens", "invalid_value");
  }
  return Ok({{"prompt", *text}});
}

}  // namespace kvserve
