// OpenAI's response shapes without a socket: error bodies and their types,
// status mapping, the non-streaming body, and the SSE stream SseEncoder
// writes for a request's events (deltas, finish chunks, usage, [DONE], the
// shutdown error event).
#include "server/frontend/openai_response.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

SeqEvent Token(int32_t index, const std::string& text, int32_t k) {
  SeqEvent ev;
  ev.request_id = 1;
  ev.index = index;
  ev.token_ids = {100 + k};
  ev.logprobs = {-0.25f};
  ev.text = text;
  ev.prompt_tokens = 3;
  ev.completion_tokens = k + 1;
  return ev;
}

SeqEvent Finish(int32_t index, int32_t tokens, FinishReason why) {
  SeqEvent ev;
  ev.request_id = 1;
  ev.index = index;
  ev.finish = why;
  ev.prompt_tokens = 3;
  ev.completion_tokens = tokens;
  return ev;
}

// The JSON payloads of "data: ..." lines, [DONE] as the string "[DONE]".
std::vector<json> Events(const std::string& sse) {
  std::vector<json> out;
  size_t pos = 0;
  while ((pos = sse.find("data: ", pos)) != std::string::npos) {
    const size_t end = sse.find("\n\n", pos);
    const std::string data = sse.substr(pos + 6, end - pos - 6);
    out.push_back(data == "[DONE]" ? json("[DONE]") : json::parse(data));
    pos = end;
  }
  return out;
}

TEST(OpenAiResponseTest, ErrorBodyHasOpenAisShape) {
  const json j = json::parse(ErrorBody({401, "no key", "", "invalid_api_key"}));
  EXPECT_EQ(j["error"]["message"], "no key");
  EXPECT_EQ(j["error"]["type"], "authentication_error");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "invalid_api_key");
  EXPECT_EQ(json::parse(ErrorBody({503, "x", "", ""}))["error"]["type"], "service_unavailable");
  EXPECT_EQ(json::parse(ErrorBody({413, "x", "", ""}))["error"]["type"], "invalid_request_error");
}

TEST(OpenAiResponseTest, StatusesMapToHttpCodesAndNameTheField) {
  ApiError e = ApiErrorFromStatus(absl::InvalidArgumentError("temperature must be >= 0"));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "temperature");
  e = ApiErrorFromStatus(absl::InvalidArgumentError("the prompt is too long"));
  EXPECT_EQ(e.param, "");  // "the" names no field
  e = ApiErrorFromStatus(absl::NotFoundError("model 'x' does not exist"));
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(e.code, "model_not_found");
  EXPECT_EQ(ApiErrorFromStatus(absl::ResourceExhaustedError("full")).status, 429);
  EXPECT_EQ(ApiErrorFromStatus(absl::UnavailableError("draining")).status, 503);
  EXPECT_EQ(ApiErrorFromStatus(absl::InternalError("?")).status, 500);
}

TEST(OpenAiResponseTest, CompletionBodyEchoesAndCountsUsage) {
  ResponseAccumulator acc(1, 3);
  acc.Add(Token(0, " there", 0));
  acc.Add(Finish(0, 1, FinishReason::kLength));
  ResponseMeta meta = ResponseMeta::New(false, "m");
  meta.echo_text = "Hi";
  const json j = json::parse(CompletionBody(meta, HttpRequestOptions{}, acc.Take(), nullptr));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_THAT(j["id"].get<std::string>(), HasSubstr("cmpl-"));
  EXPECT_EQ(j["choices"][0]["text"], "Hi there");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(j["usage"]["completion_tokens"], 1);
  EXPECT_FALSE(j["usage"].contains("kv_dropped_tokens"));
}

TEST(OpenAiResponseTest, ChatStreamOpensWithRoleAndEndsWithUsageAndDone) {
  HttpRequestOptions opts;
  opts.chat = true;
  opts.stream = true;
  opts.include_usage = true;
  SseEncoder enc(ResponseMeta::New(true, "m"), opts, /*n=*/2, /*prompt_tokens=*/3, nullptr);
  std::string sse = enc.Open();
  sse += enc.Add({Token(0, "a", 0), Token(1, "b", 0)});
  EXPECT_FALSE(enc.finished());
  sse += enc.Add({Finish(0, 1, FinishReason::kStop)});
  EXPECT_FALSE(enc.finished());
  sse += enc.Add({Token(1, "c", 1), Finish(1, 2, FinishReason::kLength)});
  EXPECT_TRUE(enc.finished());
  EXPECT_FALSE(enc.aborted());
  const std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 9u) << sse;
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ev[1]["choices"][0]["index"], 1);
  EXPECT_EQ(ev[2]["choices"][0]["delta"]["content"], "a");
  EXPECT_EQ(ev[2]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[4]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ev[6]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[7]["usage"]["completion_tokens"], 3);
  EXPECT_EQ(ev[8], "[DONE]");
  EXPECT_EQ(enc.Add({Token(0, "late", 5)}), "");  // nothing after [DONE]
}

TEST(OpenAiResponseTest, CancelledChoiceEndsTheStreamWithAnErrorEvent) {
  HttpRequestOptions opts;
  opts.stream = true;
  SseEncoder enc(ResponseMeta::New(false, "m"), opts, 1, 3, nullptr);
  EXPECT_EQ(enc.Open(), "");  // completions without echo open with nothing
  const std::string sse = enc.Add({Token(0, "x", 0), Finish(0, 1, FinishReason::kCancelled)});
  EXPECT_TRUE(enc.finished());
  EXPECT_TRUE(enc.aborted());
  const std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 3u) << sse;
  EXPECT_EQ(ev[0]["choices"][0]["text"], "x");
  EXPECT_THAT(ev[1]["error"]["message"].get<std::string>(), HasSubstr("shutting down"));
  EXPECT_EQ(ev[2], "[DONE]");
}

TEST(OpenAiResponseTest, StreamedLogprobsCarryTextOffsets) {
  HttpRequestOptions opts;
  opts.stream = true;
  opts.logprobs = true;
  SseEncoder enc(ResponseMeta::New(false, "m"), opts, 1, 3,
                 [](int32_t t) { return "t" + std::to_string(t); });
  const std::vector<json> ev = Events(enc.Add({Token(0, "ab", 0), Token(0, "cd", 1)}));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["choices"][0]["logprobs"]["tokens"][0], "t100");
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["text_offset"][0], 2);
}

}  // namespace
}  // namespace kvserve
