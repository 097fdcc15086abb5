// ParseOpenAiRequest: the OpenAI bodies as CompletionParams, without a model
// or a socket. Each accepted shape lands in the right field; each wrong type
// or shape is a 400 naming the field (param) with a message that says what
// is wrong; explicit nulls count as absent.
#include "server/frontend/openai_request.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

OpenAiRequest MustParse(const std::string& body, bool chat = false) {
  OpenAiRequest r;
  std::optional<ApiError> err = ParseOpenAiRequest(body, chat, &r);
  EXPECT_FALSE(err.has_value()) << body << ": " << (err ? err->message : "");
  return r;
}

ApiError MustFail(const std::string& body, bool chat = false) {
  OpenAiRequest r;
  std::optional<ApiError> err = ParseOpenAiRequest(body, chat, &r);
  EXPECT_TRUE(err.has_value()) << body;
  return err.value_or(ApiError{});
}

TEST(OpenAiRequestTest, CompletionFieldsLandInParams) {
  const OpenAiRequest r = MustParse(R"({
      "model": "m", "prompt": "Once", "max_tokens": 12, "temperature": 0.5, "top_p": 0.9,
      "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.2,
      "frequency_penalty": 0.3, "seed": 7, "n": 2, "stop": ["a", "b"],
      "stop_token_ids": [3, 4], "ignore_eos": true, "priority": 5, "cache_salt": "t1",
      "stream": true, "stream_options": {"include_usage": true}, "echo": true,
      "logprobs": 1})");
  const CompletionParams& p = r.params;
  EXPECT_EQ(p.model, "m");
  EXPECT_EQ(p.prompt_text, "Once");
  EXPECT_EQ(p.max_tokens, 12);
  EXPECT_FLOAT_EQ(p.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.top_p, 0.9f);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_FLOAT_EQ(p.min_p, 0.05f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(p.presence_penalty, 0.2f);
  EXPECT_FLOAT_EQ(p.frequency_penalty, 0.3f);
  EXPECT_EQ(p.seed, 7);
  EXPECT_EQ(p.n, 2);
  EXPECT_THAT(p.stop, ElementsAre("a", "b"));
  EXPECT_THAT(p.stop_token_ids, ElementsAre(3, 4));
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.priority, 5);
  EXPECT_EQ(p.cache_salt, "t1");
  EXPECT_TRUE(p.logprobs);
  EXPECT_TRUE(r.options.stream);
  EXPECT_TRUE(r.options.include_usage);
  EXPECT_TRUE(r.options.echo);
  EXPECT_TRUE(r.options.logprobs);
  EXPECT_FALSE(r.options.chat);
}

TEST(OpenAiRequestTest, PromptShapes) {
  EXPECT_THAT(*MustParse(R"({"prompt": [1, 2, 3]})").params.prompt_ids, ElementsAre(1, 2, 3));
  EXPECT_EQ(MustParse(R"({"prompt": ["one"]})").params.prompt_text, "one");
  EXPECT_THAT(*MustParse(R"({"prompt": [[5, 6]]})").params.prompt_ids, ElementsAre(5, 6));
  // 3.0 is an integer; 3.5 is not.
  EXPECT_THAT(*MustParse(R"({"prompt": [3.0]})").params.prompt_ids, ElementsAre(3));
  ApiError e = MustFail(R"({"prompt": [3.5]})");
  EXPECT_EQ(e.param, "prompt");
  e = MustFail(R"({"prompt": ["a", "b"]})");
  EXPECT_EQ(e.status, 400);
  EXPECT_THAT(e.message, HasSubstr("batch of several prompts"));
  e = MustFail(R"({"prompt": {"x": 1}})");
  EXPECT_EQ(e.param, "prompt");
  e = MustFail(R"({"max_tokens": 4})");
  EXPECT_EQ(e.param, "prompt");
  EXPECT_THAT(e.message, HasSubstr("prompt is required"));
  // Beyond int32: not a token id.
  e = MustFail(R"({"prompt": [4294967296]})");
  EXPECT_EQ(e.param, "prompt");
}

TEST(OpenAiRequestTest, NullsCountAsAbsent) {
  const OpenAiRequest r = MustParse(
      R"({"prompt": "x", "max_tokens": null, "temperature": null, "stop": null, "seed": null,
          "stream": null, "kv_policy": null, "stream_options": null})");
  EXPECT_FALSE(r.params.max_tokens.has_value());
  EXPECT_FLOAT_EQ(r.params.temperature, 1.0f);
  EXPECT_TRUE(r.params.stop.empty());
  EXPECT_FALSE(r.params.seed.has_value());
  EXPECT_FALSE(r.params.kv_policy.has_value());
  EXPECT_FALSE(r.options.stream);
}

TEST(OpenAiRequestTest, WrongTypesNameTheField) {
  struct Case {
    const char* body;
    const char* param;
    const char* message_part;
  };
  const Case cases[] = {
      {R"({"prompt": "x", "temperature": "hot"})", "temperature", "temperature must be a number"},
      {R"({"prompt": "x", "max_tokens": 2.5})", "max_tokens", "max_tokens must be an integer"},
      {R"({"prompt": "x", "n": 1e20})", "n", "n must be an integer"},
      {R"({"prompt": "x", "stream": "yes"})", "stream", "stream must be a boolean"},
      {R"({"prompt": "x", "stop": 7})", "stop", "stop must be a string"},
      {R"({"prompt": "x", "stop": ["a", 1]})", "stop", "stop must be a string"},
      {R"({"prompt": "x", "stop_token_ids": "1"})", "stop_token_ids", "array of integers"},
      {R"({"prompt": "x", "stop_token_ids": [1, "2"]})", "stop_token_ids", "array of integers"},
      {R"({"prompt": "x", "model": 3})", "model", "model must be a string"},
      {R"({"prompt": "x", "cache_salt": 3})", "cache_salt", "cache_salt must be a string"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs", "between 0 and 20"},
      {R"({"prompt": "x", "logprobs": "a"})", "logprobs", "logprobs must be an integer"},
      {R"({"prompt": "x", "echo": 1})", "echo", "echo must be a boolean"},
      {R"({"prompt": "x", "stream_options": 1})", "stream_options", "must be an object"},
      {R"({"prompt": "x", "stream_options": {"include_usage": 1}})", "stream_options",
       "include_usage must be a boolean"},
      {R"({"prompt": "x", "kv_policy": 3})", "kv_policy", "kv_policy must be a policy name"},
      {R"({"prompt": "x", "kv_policy": {"window": "a"}})", "kv_policy",
       "kv_policy.window must be an integer"},
      {R"({"prompt": "x", "kv_policy": {"size": 1}})", "kv_policy", "unknown field 'size'"},
      {R"({"prompt": "x", "kv_policy": {"policy": 1}})", "kv_policy", "policy must be a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    const ApiError e = MustFail(c.body);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, c.param);
    EXPECT_THAT(e.message, HasSubstr(c.message_part));
  }
}

TEST(OpenAiRequestTest, BodyMustBeAJsonObject) {
  ApiError e = MustFail(R"({"prompt": "hi", )");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_THAT(e.message, HasSubstr("not valid JSON"));
  e = MustFail("[1, 2]");
  EXPECT_THAT(e.message, HasSubstr("JSON object"));
  e = MustFail("");
  EXPECT_THAT(e.message, HasSubstr("not valid JSON"));
  e = MustFail(std::string("{\"prompt\": \"a\0b\"}", 16));
  EXPECT_EQ(e.status, 400);
}

TEST(OpenAiRequestTest, KvPolicyAsNameOrObject) {
  OpenAiRequest r = MustParse(R"({"prompt": "x", "kv_policy": "sinks"})");
  ASSERT_TRUE(r.params.kv_policy.has_value());
  EXPECT_EQ(r.params.kv_policy->policy, "sinks");
  r = MustParse(R"({"prompt": "x", "kv_policy": {"policy": "h2o", "sinks": 2, "budget": null}})");
  ASSERT_TRUE(r.params.kv_policy.has_value());
  EXPECT_EQ(r.params.kv_policy->policy, "h2o");
  EXPECT_EQ(r.params.kv_policy->sinks, 2);
  EXPECT_FALSE(r.params.kv_policy->budget.has_value());
}

TEST(OpenAiRequestTest, ChatMessagesAndItsOwnFields) {
  const OpenAiRequest r = MustParse(
      R"({"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                    {"type": "text", "text": "there"}]},
                       {"role": "assistant", "content": null}],
          "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 0, "tools": []})",
      /*chat=*/true);
  ASSERT_TRUE(r.params.messages.has_value());
  ASSERT_EQ(r.params.messages->size(), 3u);
  EXPECT_EQ((*r.params.messages)[1].content, "Hi there");
  EXPECT_EQ((*r.params.messages)[2].content, "");
  EXPECT_EQ(r.params.max_tokens, 9);
  EXPECT_TRUE(r.options.max_completion_tokens_alias);
  EXPECT_TRUE(r.options.chat);
  EXPECT_TRUE(r.params.logprobs);

  EXPECT_EQ(MustFail(R"({"max_tokens": 8})", true).param, "messages");
  EXPECT_EQ(MustFail(R"({"messages": "hi"})", true).param, "messages");
  EXPECT_THAT(MustFail(R"({"messages": [1]})", true).message, HasSubstr("messages[0] must be"));
  EXPECT_THAT(MustFail(R"({"messages": [{"content": "x"}]})", true).message,
              HasSubstr("messages[0].role"));
  EXPECT_THAT(
      MustFail(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", true)
          .message,
      HasSubstr("only text parts"));
  EXPECT_EQ(MustFail(R"({"messages": [], "tools": [{"type": "function"}]})", true).param, "tools");
  EXPECT_EQ(MustFail(R"({"messages": [], "tools": [{"type": "web"}]})", true).param, "tools");
  EXPECT_EQ(MustFail(R"({"messages": [], "logprobs": 1})", true).param, "logprobs");
  EXPECT_EQ(MustFail(R"({"messages": [], "top_logprobs": 21})", true).param, "top_logprobs");
}

TEST(OpenAiRequestTest, FloatsBeyondFloatRangeAreRefused) {
  // A double that does not fit a float is refused rather than converted:
  // the conversion is undefined behaviour in C++ ([conv.double]); x86 gives
  // inf, and clang's UBSan does not report double-to-float overflow, so the
  // fuzzer cannot catch it and this test does.
  const ApiError e = MustFail(R"({"prompt": "x", "temperature": 1e300})");
  EXPECT_EQ(e.param, "temperature");
  EXPECT_THAT(e.message, HasSubstr("temperature must be a finite number"));
  EXPECT_FLOAT_EQ(MustParse(R"({"prompt": "x", "top_p": 3e38})").params.top_p, 3e38f);
}

// The request fuzzer's finding: an integer field given a float beyond int64
// (1.9e85) was cast before its range was checked (undefined behaviour).
TEST(OpenAiRequestTest, IntegerFieldsRefuseFloatsBeyondTheirRange) {
  for (const char* body : {R"({"prompt": "x", "max_tokens": 1.88889e85})",
                           R"({"prompt": "x", "max_tokens": -1e19})",
                           R"({"prompt": "x", "max_tokens": 2147483648.0})",
                           R"({"prompt": "x", "max_tokens": 9.223372036854775808e18})",
                           R"({"prompt": "x", "max_tokens": 2.5})"}) {
    const ApiError e = MustFail(body);
    EXPECT_EQ(e.param, "max_tokens") << body;
    EXPECT_THAT(e.message, HasSubstr("must be an integer")) << body;
  }
  EXPECT_EQ(MustParse(R"({"prompt": "x", "max_tokens": 7.0})").params.max_tokens, 7);
}

}  // namespace
}  // namespace kvserve
