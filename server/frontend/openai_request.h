// The OpenAI request bodies (/v1/completions, /v1/chat/completions) parsed
// into ModelService's CompletionParams, as one pure function of the body's
// bytes: no I/O, no model, so it is unit-tested and fuzzed on its own. Field
// types and shapes are checked here; value ranges (temperature >= 0, the
// context length) are ModelService::Prepare's business, so both protocols
// share them. ApiError is OpenAI's error shape, which every HTTP error reply
// uses (see openai_response.h for its JSON).
//
// Thread-safety: pure functions and plain data.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/service/model_service.h"

namespace kvserve {

// An HTTP error in OpenAI's shape: {"error": {"message", "type", "param",
// "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // empty: null
  std::string code;   // empty: null
};

// What the HTTP layer needs beyond CompletionParams.
struct HttpRequestOptions {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  bool logprobs = false;  // per-token log-probabilities in the response
  bool max_completion_tokens_alias = false;  // for naming the field in errors
  // Tool calling: the reply's <tool_call> blocks become tool_calls
  // (server/service/tool_calls.h); parallel false keeps the first call only.
  bool parse_tool_calls = false;
  bool parallel_tool_calls = true;
  // tool_choice "required" (forced_tool empty) or a named function: the
  // reply is grammar-constrained to one call (CompletionParams::grammar).
  bool force_tool_call = false;
  std::string forced_tool;
  // tool_choice auto with strict tools: text is free, but each <tool_call>
  // the model opens is grammar-constrained (CompletionParams::grammar).
  bool strict_auto_tools = false;
};

struct OpenAiRequest {
  CompletionParams params;
  HttpRequestOptions options;
};

// Parses a completion (`chat` false) or chat completion body. On failure the
// error names the field (param) and says what is wrong; 400 for every
// parsing error. Null fields count as absent (OpenAI clients send explicit
// nulls).
[[nodiscard]] std::optional<ApiError> ParseOpenAiRequest(std::string_view body, bool chat,
                                                         OpenAiRequest* out);

// The top-level fields the parser knows for an endpoint (honoured or refused
// by name); any other field is refused as unknown. For the schema walk test.
std::vector<std::string> KnownOpenAiFields(bool chat);

}  // namespace kvserve
