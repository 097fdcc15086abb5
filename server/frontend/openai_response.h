// OpenAI's response shapes as bytes: error bodies, the non-streaming
// completion / chat completion body, and the server-sent-event stream of a
// streaming one (SseEncoder). Transport-free: the HTTP server decides when
// and where the bytes go; this file decides what they are, so the shapes are
// unit-tested without a socket.
//
// Thread-safety: the functions are pure; an SseEncoder belongs to one stream
// and is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/service/completed_response.h"
#include "server/service/response_cache.h"
#include "server/frontend/openai_request.h"
#include "server/service/tool_calls.h"

namespace kvserve {

// {"error": {...}} for `e`; type follows the status (401
// authentication_error, 404 not_found_error, 5xx server_error, ...).
std::string ErrorBody(const ApiError& e);

// A ModelService status as an HTTP error: the code's HTTP status, the
// message, param from the message's first word when it names a request
// field, and OpenAI's codes for 404 (model_not_found) and 429.
ApiError ApiErrorFromStatus(const absl::Status& s);

// Detokenizes one token (for log-probabilities); "" when it cannot.
using TokenPieceFn = std::function<std::string(int32_t)>;

// The envelope every body and chunk of one response shares.
struct ResponseMeta {
  std::string id;  // cmpl-... / chatcmpl-...
  int64_t created = 0;
  std::string model;
  bool chat = false;
  bool kv_policy = false;  // usage carries kv_dropped_tokens
  std::string echo_text;   // prepended to completions when the request echoes
  // The response cache's verdict (server/frontend/response_cache_api.h), reported as
  // the kvserve_cache object of the body (streams: of the usage chunk);
  // unset when the cache is off.
  std::optional<CacheOutcome> cache;
  // Cache control's notes (retention answer, cache report), reported as the
  // kvserve_cache_control object of the body (streams: of the usage chunk).
  std::shared_ptr<CacheNotes> cache_notes;

  // A fresh random id and the current time.
  static ResponseMeta New(bool chat, std::string model);
};

// The JSON body of a finished non-streaming response.
std::string CompletionBody(const ResponseMeta& meta, const HttpRequestOptions& opts,
                           const CompletedResponse& done, const TokenPieceFn& piece);

// Turns a request's engine events into its SSE bytes: the opening role/echo
// chunks, one chunk per delta, a finish chunk per choice, the usage chunk
// when asked, and "data: [DONE]". A choice that ends cancelled (the server
// is shutting down) ends the stream with an error event instead (the openai
// client raises it as an APIError).
class SseEncoder {
 public:
  SseEncoder(ResponseMeta meta, HttpRequestOptions opts, int32_t n, int32_t prompt_tokens,
             TokenPieceFn piece);

  // The bytes to send first (may be empty); once.
  std::string Open();
  // The bytes for `events`, in order; after the last one finished() is true.
  std::string Add(const std::vector<SeqEvent>& events);
  // [DONE] was produced (normally or after an error event).
  bool finished() const { return finished_; }
  // The stream ended with the shutdown error event.
  bool aborted() const { return aborted_; }
  // An SSE comment clients skip: sent while the stream is silent.
  static const std::string& Heartbeat();
  // The response cache's verdict, known only once the request started.
  // REQUIRES: before the first Add.
  void set_cache(const CacheOutcome& c) { meta_.cache = c; }

 private:
  ResponseMeta meta_;
  HttpRequestOptions opts_;
  int32_t n_;
  TokenPieceFn piece_;
  std::unique_ptr<ResponseAccumulator> response_;  // what has been streamed so far
  // Tool calling (opts.parse_tool_calls): per choice, the parser and the
  // number of calls sent.
  std::vector<ToolCallStreamer> tool_streams_;
  std::vector<int> tool_calls_sent_;
  bool opened_ = false;
  bool finished_ = false;
  bool aborted_ = false;
};

}  // namespace kvserve
