// Tool calling (issue 44) without a model: the request fields (tools,
// tool_choice, the tool and developer roles, assistant tool_calls) parsed
// and refused by name; the conversation rendered through SmolLM2's own
// ChatML template (which knows nothing of tools, so kvserve writes them in
// the Hermes convention) and through a template that renders tools itself;
// the model's <tool_call> blocks parsed into OpenAI tool_calls whole and
// streamed, however the text is cut into deltas; and the response bodies
// and SSE chunks that carry them.
#include "server/service/tool_calls.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/frontend/openai_request.h"
#include "server/frontend/openai_response.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;

// SmolLM2-135M-Instruct's tokenizer.chat_template, as its GGUF carries it.
constexpr char kSmolLm2Template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

// A template that renders tools itself (the shape of Qwen's, cut down).
constexpr char kToolsTemplate[] =
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}</{{ m.role }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

constexpr char kWeatherTool[] =
    R"({"type": "function", "function": {"name": "get_weather", "description": "Weather now",)"
    R"( "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})";

OpenAiRequest ParseChat(const std::string& body) {
  OpenAiRequest r;
  std::optional<ApiError> err = ParseOpenAiRequest(body, /*chat=*/true, &r);
  EXPECT_FALSE(err.has_value()) << body << ": " << (err ? err->message : "");
  return r;
}

ApiError FailChat(const std::string& body) {
  OpenAiRequest r;
  std::optional<ApiError> err = ParseOpenAiRequest(body, /*chat=*/true, &r);
  EXPECT_TRUE(err.has_value()) << body;
  return err.value_or(ApiError{});
}

// A conversation with every tool-related turn: developer, user, the
// assistant's call, the tool's result.
std::string AgentBody(const std::string& extra) {
  return std::string(R"({"messages": [
      {"role": "developer", "content": "Answer in one line."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}],
      "tools": [)") + kWeatherTool + "]" + extra + "}";
}

TEST(ToolCallsRequestTest, FieldsAreParsed) {
  const OpenAiRequest r = ParseChat(AgentBody(R"(, "tool_choice": "auto")"));
  EXPECT_TRUE(r.options.parse_tool_calls);
  EXPECT_TRUE(r.options.parallel_tool_calls);
  EXPECT_THAT(r.params.tools_json, HasSubstr("get_weather"));
  const std::vector<ChatMessage>& m = *r.params.messages;
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0].role, "developer");
  EXPECT_THAT(m[2].tool_calls_json, HasSubstr("call_1"));
  EXPECT_EQ(m[3].tool_call_id, "call_1");
  // none: the model is not shown the tools and nothing is parsed.
  const OpenAiRequest none = ParseChat(AgentBody(R"(, "tool_choice": "none")"));
  EXPECT_TRUE(none.params.tools_json.empty());
  EXPECT_FALSE(none.options.parse_tool_calls);
}

TEST(ToolCallsRequestTest, ForcedChoicesBecomeAToolCallGrammar) {
  // required: a call of any tool; named: of that one, its parameters as
  // the client ordered them.
  const OpenAiRequest req = ParseChat(AgentBody(R"(, "tool_choice": "required")"));
  EXPECT_EQ(req.params.grammar.kind, GrammarSpec::Kind::kToolCall);
  EXPECT_EQ(req.params.grammar_field, "tool_choice");
  EXPECT_THAT(req.params.grammar.text, HasSubstr("\"name\":\"get_weather\""));
  EXPECT_TRUE(req.options.parse_tool_calls);
  const OpenAiRequest named = ParseChat(AgentBody(
      R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})"));
  EXPECT_EQ(named.params.grammar.kind, GrammarSpec::Kind::kToolCall);
  EXPECT_EQ(named.options.forced_tool, "get_weather");
  // strict: true is enforced under a forced choice.
  const OpenAiRequest strict = ParseChat(
      R"({"messages": [], "tool_choice": "required", "tools": [{"type": "function", "function": )"
      R"({"name": "f", "strict": true, "parameters": {"type": "object"}}}]})");
  EXPECT_EQ(strict.params.grammar.kind, GrammarSpec::Kind::kToolCall);
}

TEST(ToolCallsRequestTest, UnenforceableChoicesAndBadShapesAreRefusedByName) {
  ApiError e = FailChat(AgentBody(R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}})"));
  EXPECT_EQ(e.param, "tool_choice");
  EXPECT_THAT(e.message, HasSubstr("not among tools"));
  e = FailChat(R"({"messages": [], "tool_choice": "required"})");
  EXPECT_EQ(e.param, "tool_choice");
  EXPECT_THAT(e.message, HasSubstr("no tools"));
  e = FailChat(AgentBody(R"(, "tool_choice": "required", "response_format": {"type": "json_object"})"));
  EXPECT_EQ(e.param, "tool_choice");
  EXPECT_EQ(FailChat(AgentBody(R"(, "tool_choice": "sometimes")")).param, "tool_choice");
  // strict under auto: a grammar triggered by <tool_call>; with
  // response_format as well, two grammars: refused naming tools.
  const OpenAiRequest strict_auto = ParseChat(
      R"({"messages": [], "tools": [{"type": "function", "function": {"name": "f", "strict": true}}]})");
  EXPECT_EQ(strict_auto.params.grammar.kind, GrammarSpec::Kind::kToolCallAuto);
  e = FailChat(R"({"messages": [], "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f", "strict": true}}]})");
  EXPECT_EQ(e.param, "tools");
  EXPECT_THAT(e.message, HasSubstr("strict"));
  EXPECT_THAT(FailChat(R"({"messages": [], "tools": [{"type": "function", "function": {"name": "a b"}}]})").message,
              HasSubstr("function.name"));
  EXPECT_THAT(FailChat(R"({"messages": [], "tools": [{"type": "function", "function": {"description": "x"}}]})").message,
              HasSubstr("name is required"));
  // Message fields a role does not take, and names, are refused by name.
  EXPECT_THAT(FailChat(R"({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]})").message,
              HasSubstr("messages[0].tool_call_id is not supported"));
  EXPECT_THAT(FailChat(R"({"messages": [{"role": "user", "content": "x", "name": "bob"}]})").message,
              HasSubstr("messages[0].name"));
  EXPECT_THAT(FailChat(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]})").message,
              HasSubstr("arguments must be a string"));
}

TEST(ToolCallsRenderTest, ChatMlTemplateGetsTheHermesConvention) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateString(kSmolLm2Template);
  ASSERT_TRUE(t.ok()) << t.status();
  const OpenAiRequest r = ParseChat(AgentBody(""));
  absl::StatusOr<std::string> text = RenderChatWithTools(*t, *r.params.messages, r.params.tools_json);
  ASSERT_TRUE(text.ok()) << text.status();
  // developer is the system turn, with the catalogue after its text.
  EXPECT_THAT(*text, HasSubstr("<|im_start|>system\nAnswer in one line.\n\n# Tools"));
  EXPECT_THAT(*text, HasSubstr("<tools>\n{\"type\":\"function\",\"function\":{\"name\":"
                               "\"get_weather\",\"description\":\"Weather now\""));
  EXPECT_THAT(*text, HasSubstr("<|im_start|>assistant\n<tool_call>\n{\"name\":\"get_weather\","
                               "\"arguments\":{\"city\":\"Paris\"}}\n</tool_call><|im_end|>"));
  EXPECT_THAT(*text, HasSubstr("<|im_start|>tool\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>"));
  EXPECT_THAT(*text, Not(HasSubstr("developer")));
  EXPECT_THAT(*text, ::testing::EndsWith("<|im_start|>assistant\n"));
  // Without a system turn, the template's default prompt is kept above the catalogue.
  std::vector<ChatMessage> plain = {{"user", "hi"}};
  text = RenderChatWithTools(*t, plain, r.params.tools_json);
  ASSERT_TRUE(text.ok());
  EXPECT_THAT(*text, HasSubstr("named SmolLM, trained by Hugging Face\n\n# Tools"));
}

TEST(ToolCallsRenderTest, ToolAwareTemplateGetsToolsAsVariables) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateString(kToolsTemplate);
  ASSERT_TRUE(t.ok()) << t.status();
  const OpenAiRequest r = ParseChat(AgentBody(""));
  absl::StatusOr<std::string> text = RenderChatWithTools(*t, *r.params.messages, r.params.tools_json);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("<tools>get_weather;</tools>"));
  EXPECT_THAT(*text, HasSubstr("<system>Answer in one line.</system>"));
  EXPECT_THAT(*text, HasSubstr("[call get_weather {\"city\": \"Paris\"}]"));
  EXPECT_THAT(*text, HasSubstr("<tool>18C, sunny(for call_1)</tool>"));
  EXPECT_THAT(*text, Not(HasSubstr("<tool_call>")));
}

std::string ReadTemplate(const std::string& name) {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/chat_templates/" + name +
                   ".jinja");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Another family: Qwen2.5's own template renders the tools (Hermes, the
// format ParseToolCalls reads back), the call and the tool's result.
TEST(ToolCallsRenderTest, QwenTemplateRendersToolsItself) {
  const std::string source = ReadTemplate("Qwen-Qwen2.5-7B-Instruct");
  ASSERT_FALSE(source.empty());
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateString(source);
  ASSERT_TRUE(t.ok()) << t.status();
  const OpenAiRequest r = ParseChat(AgentBody(""));
  absl::StatusOr<std::string> text = RenderChatWithTools(*t, *r.params.messages, r.params.tools_json);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("<|im_start|>system\nAnswer in one line.\n\n# Tools"));
  EXPECT_THAT(*text, HasSubstr("<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
                               "\"get_weather\""));
  EXPECT_THAT(*text, HasSubstr("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                               "{\"city\": \"Paris\"}}\n</tool_call>"));
  EXPECT_THAT(*text, HasSubstr("<tool_response>\n18C, sunny\n</tool_response>"));
  EXPECT_THAT(*text, ::testing::EndsWith("<|im_start|>assistant\n"));
}

TEST(ToolCallsParseTest, BlocksBecomeCallsAndTheRestIsContent) {
  ParsedToolCalls p = ParseToolCalls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}"
      "</tool_call>",
      /*parallel=*/true);
  EXPECT_EQ(p.content, "Let me check.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"city", "Paris"}}));
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_THAT(p.calls[0].id, ::testing::StartsWith("call_"));
  EXPECT_NE(p.calls[0].id, p.calls[1].id);
  // parallel_tool_calls false: the first call only.
  EXPECT_EQ(ParseToolCalls("<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": "
                           "\"b\"}</tool_call>",
                           false)
                .calls.size(),
            1u);
  // An unclosed last block still counts when its JSON is whole.
  p = ParseToolCalls("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n", true);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.content, "");
  // Not a call: the model's text stays as it wrote it.
  p = ParseToolCalls("see <tool_call>{not json}</tool_call> there", true);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "see <tool_call>{not json}</tool_call> there");
  p = ParseToolCalls("a < b and <tool_ca", true);
  EXPECT_EQ(p.content, "a < b and <tool_ca");
}

TEST(ToolCallsParseTest, StreamingMatchesWholeParsingAtEveryCut) {
  const std::string text =
      "Sure <b>. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>\n";
  const ParsedToolCalls whole = ParseToolCalls(text, true);
  ASSERT_EQ(whole.calls.size(), 2u);
  for (size_t step = 1; step <= 7; ++step) {
    ToolCallStreamer s(true);
    std::vector<ToolCall> calls;
    std::string content;
    for (size_t i = 0; i < text.size(); i += step) {
      content += s.Feed(std::string_view(text).substr(i, step), &calls);
    }
    content += s.Finish(&calls);
    // Whitespace before a call is not content (held back when it arrives
    // alone; a delta that ends in it has gone out already): trimmed, the
    // streamed content is the whole parse's.
    EXPECT_EQ(absl::StripAsciiWhitespace(content), "Sure <b>.") << "step " << step;
    EXPECT_EQ(whole.content, "Sure <b>.");
    ASSERT_EQ(calls.size(), 2u) << "step " << step;
    EXPECT_EQ(calls[0].name, "get_weather");
    EXPECT_EQ(calls[0].arguments, whole.calls[0].arguments);
    EXPECT_EQ(calls[1].arguments, "{}");
  }
}

CompletedResponse OneSample(const std::string& text) {
  CompletedResponse done;
  CompletedSample s;
  s.text = text;
  s.finish = FinishReason::kStop;
  s.token_ids = {1, 2};
  s.completion_tokens = 2;
  done.samples.push_back(s);
  return done;
}

TEST(ToolCallsResponseTest, BodyCarriesToolCalls) {
  HttpRequestOptions opts;
  opts.chat = true;
  opts.parse_tool_calls = true;
  const ResponseMeta meta = ResponseMeta::New(true, "m");
  json body = json::parse(CompletionBody(
      meta, opts, OneSample("<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>"),
      nullptr));
  const json& choice = body["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], "{}");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["type"], "function");
  // No call: plain content and the engine's finish reason.
  body = json::parse(CompletionBody(meta, opts, OneSample("It is sunny."), nullptr));
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "It is sunny.");
  EXPECT_FALSE(body["choices"][0]["message"].contains("tool_calls"));
  // Without tools the same text is content, untouched.
  opts.parse_tool_calls = false;
  body = json::parse(CompletionBody(meta, opts, OneSample("<tool_call>{\"name\": \"f\"}</tool_call>"),
                                    nullptr));
  EXPECT_EQ(body["choices"][0]["message"]["content"], "<tool_call>{\"name\": \"f\"}</tool_call>");
}

TEST(ToolCallsResponseTest, StreamCarriesToolCallDeltas) {
  HttpRequestOptions opts;
  opts.chat = true;
  opts.parse_tool_calls = true;
  SseEncoder enc(ResponseMeta::New(true, "m"), opts, 1, 3, nullptr);
  std::string sse = enc.Open();
  const std::vector<std::string> pieces = {"Ok. <tool", "_call>{\"name\": \"f\", ",
                                           "\"arguments\": {\"a\": 1}}</tool_call>"};
  for (size_t i = 0; i < pieces.size(); ++i) {
    SeqEvent ev;
    ev.index = 0;
    ev.text = pieces[i];
    ev.token_ids = {static_cast<int32_t>(i)};
    ev.completion_tokens = static_cast<int32_t>(i + 1);
    if (i + 1 == pieces.size()) ev.finish = FinishReason::kStop;
    sse += enc.Add({ev});
  }
  ASSERT_TRUE(enc.finished());
  std::string content;
  json call;
  std::string finish;
  for (size_t pos = 0; (pos = sse.find("data: {", pos)) != std::string::npos; ++pos) {
    const json chunk = json::parse(sse.substr(pos + 6, sse.find("\n\n", pos) - pos - 6));
    if (chunk["choices"].empty()) continue;
    const json& c = chunk["choices"][0];
    if (c["delta"].contains("content") && c["delta"]["content"].is_string()) {
      content += c["delta"]["content"].get<std::string>();
    }
    if (c["delta"].contains("tool_calls")) call = c["delta"]["tool_calls"][0];
    if (c["finish_reason"].is_string()) finish = c["finish_reason"];
  }
  EXPECT_EQ(content, "Ok. ");
  EXPECT_EQ(call["index"], 0);
  EXPECT_EQ(call["function"]["name"], "f");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json({{"a", 1}}));
  EXPECT_EQ(finish, "tool_calls");
}

}  // namespace
}  // namespace kvserve
