// The field-by-field walk of OpenAI's request schemas (issue 44): every
// top-level field of the current API reference for POST /v1/chat/completions
// and POST /v1/completions is listed here once per endpoint, each either
// honoured (the parse succeeds and the value lands somewhere the request
// uses: the evidence is checked) or refused (a 400 whose param names the
// field). A field the parser would take and drop fails this test, and so
// does a field of the reference that the list forgets (the list is the
// reference's, checked against the parser's own rule table by walking both
// directions: no rule without a row, no row without a rule). Unknown fields
// and fields of the other endpoint are refused by name too.
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/kvserve.pb.h"
#include "server/frontend/grpc_server.h"
#include "server/frontend/openai_request.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

using Evidence = std::function<bool(const OpenAiRequest&)>;

struct Row {
  std::string field;
  std::string value;  // a JSON value that asks for something
  Evidence honoured;  // null: refused by name
};

// The base body of each endpoint (the required fields only).
std::string Body(bool chat, const std::string& field, const std::string& value) {
  std::string body = chat ? R"({"messages": [{"role": "user", "content": "hi"}])"
                          : R"({"prompt": "hi")";
  if (field == "messages" || field == "prompt") {
    body = "{";
  } else {
    body += ", ";
  }
  return body + "\"" + field + "\": " + value + "}";
}

// OpenAI's chat completion request body, field by field (API reference,
// "Create chat completion", every field including the deprecated ones).
std::vector<Row> ChatRows() {
  return {
      {"messages", R"([{"role": "user", "content": "yo"}])",
       [](const OpenAiRequest& r) { return (*r.params.messages)[0].content == "yo"; }},
      {"model", R"("m1")", [](const OpenAiRequest& r) { return r.params.model == "m1"; }},
      {"audio", R"({"voice": "alloy", "format": "wav"})", nullptr},
      {"frequency_penalty", "0.5",
       [](const OpenAiRequest& r) { return r.params.frequency_penalty == 0.5f; }},
      {"function_call", R"("auto")", nullptr},
      {"functions", R"([{"name": "f"}])", nullptr},
      {"logit_bias", R"({"50256": -100})", nullptr},
      {"logprobs", "true", [](const OpenAiRequest& r) { return r.params.logprobs; }},
      {"max_completion_tokens", "7",
       [](const OpenAiRequest& r) { return r.params.max_tokens == 7; }},
      {"max_tokens", "6", [](const OpenAiRequest& r) { return r.params.max_tokens == 6; }},
      {"metadata", R"({"k": "v"})", nullptr},
      {"modalities", R"(["text", "audio"])", nullptr},
      {"n", "2", [](const OpenAiRequest& r) { return r.params.n == 2; }},
      {"parallel_tool_calls", "false",
       [](const OpenAiRequest& r) { return !r.options.parallel_tool_calls; }},
      {"prediction", R"({"type": "content", "content": "x"})", nullptr},
      {"presence_penalty", "0.25",
       [](const OpenAiRequest& r) { return r.params.presence_penalty == 0.25f; }},
      {"prompt_cache_key", R"("k")", nullptr},
      {"prompt_cache_retention", R"("24h")", nullptr},
      {"reasoning_effort", R"("low")", nullptr},
      {"response_format", R"({"type": "json_object"})",
       [](const OpenAiRequest& r) {
         return r.params.grammar.kind == GrammarSpec::Kind::kJsonObject &&
                r.params.grammar_field == "response_format";
       }},
      {"safety_identifier", R"("u1")", nullptr},
      {"seed", "11", [](const OpenAiRequest& r) { return r.params.seed == 11; }},
      {"service_tier", R"("flex")", nullptr},
      {"stop", R"(["x"])", [](const OpenAiRequest& r) { return r.params.stop.size() == 1; }},
      {"store", "true", nullptr},
      {"stream", "true", [](const OpenAiRequest& r) { return r.options.stream; }},
      {"stream_options", R"({"include_usage": true})",
       [](const OpenAiRequest& r) { return r.options.include_usage; }},
      {"temperature", "0.3", [](const OpenAiRequest& r) { return r.params.temperature == 0.3f; }},
      // required and named choices are grammar-enforced calls of the given
      // tools; this body has none, so the choice is refused by name
      // (tool_calls_test covers it with tools).
      {"tool_choice", R"("required")", nullptr},
      {"tools", R"([{"type": "function", "function": {"name": "f"}}])",
       [](const OpenAiRequest& r) {
         return r.options.parse_tool_calls && r.params.tools_json.find("\"f\"") != std::string::npos;
       }},
      {"top_logprobs", "2", nullptr},
      {"top_p", "0.5", [](const OpenAiRequest& r) { return r.params.top_p == 0.5f; }},
      {"user", R"("u1")", nullptr},
      {"verbosity", R"("low")", nullptr},
      {"web_search_options", "{}", nullptr},
  };
}

// OpenAI's (legacy) completion request body, field by field.
std::vector<Row> CompletionRows() {
  return {
      {"model", R"("m1")", [](const OpenAiRequest& r) { return r.params.model == "m1"; }},
      {"prompt", R"("yo")", [](const OpenAiRequest& r) { return r.params.prompt_text == "yo"; }},
      {"best_of", "3", nullptr},
      {"echo", "true", [](const OpenAiRequest& r) { return r.options.echo; }},
      {"frequency_penalty", "0.5",
       [](const OpenAiRequest& r) { return r.params.frequency_penalty == 0.5f; }},
      {"logit_bias", R"({"50256": -100})", nullptr},
      {"logprobs", "1", [](const OpenAiRequest& r) { return r.params.logprobs; }},
      {"max_tokens", "6", [](const OpenAiRequest& r) { return r.params.max_tokens == 6; }},
      {"n", "2", [](const OpenAiRequest& r) { return r.params.n == 2; }},
      {"presence_penalty", "0.25",
       [](const OpenAiRequest& r) { return r.params.presence_penalty == 0.25f; }},
      {"seed", "11", [](const OpenAiRequest& r) { return r.params.seed == 11; }},
      {"stop", R"("x")", [](const OpenAiRequest& r) { return r.params.stop.size() == 1; }},
      {"stream", "true", [](const OpenAiRequest& r) { return r.options.stream; }},
      {"stream_options", R"({"include_usage": true})",
       [](const OpenAiRequest& r) { return r.options.include_usage; }},
      {"suffix", R"("end")", nullptr},
      {"temperature", "0.3", [](const OpenAiRequest& r) { return r.params.temperature == 0.3f; }},
      {"top_p", "0.5", [](const OpenAiRequest& r) { return r.params.top_p == 0.5f; }},
      {"user", R"("u1")", nullptr},
  };
}

void Walk(bool chat, const std::vector<Row>& rows) {
  for (const Row& row : rows) {
    const std::string body = Body(chat, row.field, row.value);
    OpenAiRequest r;
    std::optional<ApiError> err = ParseOpenAiRequest(body, chat, &r);
    if (row.honoured) {
      ASSERT_FALSE(err.has_value()) << body << ": " << err->message;
      EXPECT_TRUE(row.honoured(r)) << row.field << " parsed but its value landed nowhere: " << body;
    } else {
      ASSERT_TRUE(err.has_value()) << row.field << " was accepted but is not honoured: " << body;
      EXPECT_EQ(err->status, 400) << body;
      EXPECT_EQ(err->param, row.field) << body;
      EXPECT_THAT(err->message, HasSubstr(row.field)) << body;
    }
    // An explicit null is an absent field, whatever the field.
    if (row.field != "messages" && row.field != "prompt") {
      EXPECT_FALSE(ParseOpenAiRequest(Body(chat, row.field, "null"), chat, &r).has_value())
          << row.field;
    }
  }
}

TEST(OpenAiFieldsTest, ChatCompletionSchemaFieldByField) { Walk(/*chat=*/true, ChatRows()); }

TEST(OpenAiFieldsTest, CompletionSchemaFieldByField) { Walk(/*chat=*/false, CompletionRows()); }

// kvserve's and vLLM's extensions (tested where they are implemented).
const std::set<std::string> kExtensions = {
    "top_k",          "min_p",         "repetition_penalty", "ignore_eos",
    "stop_token_ids", "priority",      "cache_salt",         "kv_policy",
    "cache_control",  "cache_report",  "speculative",        "response_cache",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern"};

// The parser's rule table and this reference list agree both ways.
TEST(OpenAiFieldsTest, EveryKnownFieldIsWalked) {
  for (bool chat : {true, false}) {
    std::set<std::string> walked;
    for (const Row& row : chat ? ChatRows() : CompletionRows()) walked.insert(row.field);
    std::set<std::string> known;
    for (const std::string& f : KnownOpenAiFields(chat)) {
      known.insert(f);
      EXPECT_TRUE(walked.count(f) || kExtensions.count(f)) << f << " has no row (chat " << chat << ")";
    }
    for (const std::string& f : walked) EXPECT_TRUE(known.count(f)) << f << " has no rule";
  }
}

TEST(OpenAiFieldsTest, UnknownFieldsAreRefusedByName) {
  for (bool chat : {true, false}) {
    for (const char* value : {"1", "\"x\"", "true", "{}", "[]", "{\"a\": 1}"}) {
      OpenAiRequest r;
      const std::string body = Body(chat, "guided_jsonish", value);
      std::optional<ApiError> err = ParseOpenAiRequest(body, chat, &r);
      ASSERT_TRUE(err.has_value()) << body;
      EXPECT_EQ(err->param, "guided_jsonish");
      EXPECT_EQ(err->code, "unknown_parameter");
      EXPECT_THAT(err->message, HasSubstr("unknown field"));
    }
    // vLLM's older guided_* fields: refused, pointing at structured_outputs.
    OpenAiRequest r;
    std::optional<ApiError> err = ParseOpenAiRequest(Body(chat, "guided_json", "{}"), chat, &r);
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(err->param, "guided_json");
    EXPECT_THAT(err->message, HasSubstr("structured_outputs"));
  }
  // A field of the other endpoint is refused, naming it.
  OpenAiRequest r;
  std::optional<ApiError> err =
      ParseOpenAiRequest(R"({"prompt": "x", "max_completion_tokens": 3})", false, &r);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->param, "max_completion_tokens");
  EXPECT_THAT(err->message, HasSubstr("not a field of /v1/completions"));
  err = ParseOpenAiRequest(R"({"messages": [], "suffix": "x"})", true, &r);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->param, "suffix");
}

TEST(OpenAiFieldsTest, RefusedFieldsAtTheirNoOpValueAreAccepted) {
  for (const char* body : {R"({"messages": [], "response_format": {"type": "text"}})",
                           R"({"messages": [], "store": false})",
                           R"({"messages": [], "modalities": ["text"]})",
                           R"({"messages": [], "service_tier": "auto"})"}) {
    OpenAiRequest r;
    std::optional<ApiError> err = ParseOpenAiRequest(body, true, &r);
    EXPECT_FALSE(err.has_value()) << body << ": " << err->message;
  }
  OpenAiRequest r;
  EXPECT_FALSE(ParseOpenAiRequest(R"({"prompt": "x", "best_of": 1})", false, &r).has_value());
  EXPECT_FALSE(ParseOpenAiRequest(R"({"prompt": "x", "n": 2, "best_of": 2})", false, &r).has_value());
}

TEST(OpenAiFieldsTest, NestedFieldsAreRefusedByName) {
  OpenAiRequest r;
  std::optional<ApiError> err = ParseOpenAiRequest(
      R"({"prompt": "x", "stream_options": {"include_usage": true, "include_obfuscation": true}})",
      false, &r);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->param, "stream_options");
  EXPECT_THAT(err->message, HasSubstr("include_obfuscation"));
  err = ParseOpenAiRequest(
      R"({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]})", true, &r);
  ASSERT_TRUE(err.has_value());
  EXPECT_THAT(err->message, HasSubstr("messages[0].audio"));
}

// gRPC has no field kvserve drops; a newer client's field (unknown to this
// build, kept by protobuf as an unknown field) is refused, not ignored.
TEST(OpenAiFieldsTest, GrpcUnknownFieldsAreRefusedByNumber) {
  v1::ChatRequest r;
  r.add_messages()->set_content("hi");
  EXPECT_TRUE(RefuseUnknownProtoFields(r, "ChatRequest").ok());
  r.mutable_messages(0)->GetReflection()->MutableUnknownFields(r.mutable_messages(0))->AddVarint(
      42, 1);
  absl::Status st = RefuseUnknownProtoFields(r, "ChatRequest");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("ChatRequest.messages[0]: field number 42"));
  v1::GenerateRequest g;
  g.mutable_sampling()->GetReflection()->MutableUnknownFields(g.mutable_sampling())->AddVarint(99, 1);
  EXPECT_THAT(std::string(RefuseUnknownProtoFields(g, "GenerateRequest").message()),
              HasSubstr("GenerateRequest.sampling: field number 99"));
}

// Structured outputs (issue 44): response_format and vLLM's
// structured_outputs parsed into a grammar spec, bad shapes refused by name.
TEST(OpenAiFieldsTest, StructuredOutputShapes) {
  OpenAiRequest r;
  // The schema keeps the client's property order (the grammar writes them so).
  ASSERT_FALSE(ParseOpenAiRequest(
                   R"({"messages": [], "response_format": {"type": "json_schema", "json_schema": )"
                   R"({"name": "p", "strict": true, "schema": {"type": "object", "properties": )"
                   R"({"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}})",
                   true, &r)
                   .has_value());
  EXPECT_EQ(r.params.grammar.kind, GrammarSpec::Kind::kJsonSchema);
  EXPECT_TRUE(r.params.grammar.strict);
  EXPECT_LT(r.params.grammar.text.find("zeta"), r.params.grammar.text.find("alpha"));
  struct Case {
    bool chat;
    const char* body;
    GrammarSpec::Kind kind;
  };
  for (const Case& c : std::vector<Case>{
           {false, R"({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}})",
            GrammarSpec::Kind::kRegex},
           {false, R"({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})",
            GrammarSpec::Kind::kChoice},
           {true, R"({"messages": [], "structured_outputs": {"grammar": "root ::= \"a\""}})",
            GrammarSpec::Kind::kEbnf},
           {true, R"({"messages": [], "structured_outputs": {"json": "{\"type\": \"object\"}"}})",
            GrammarSpec::Kind::kJsonSchema},
           {false, R"({"prompt": "x", "structured_outputs": {"json_object": true}})",
            GrammarSpec::Kind::kJsonObject}}) {
    std::optional<ApiError> err = ParseOpenAiRequest(c.body, c.chat, &r);
    ASSERT_FALSE(err.has_value()) << c.body << ": " << err->message;
    EXPECT_EQ(r.params.grammar.kind, c.kind) << c.body;
    EXPECT_EQ(r.params.grammar_field, "structured_outputs");
  }
  struct Bad {
    bool chat;
    const char* body;
    const char* param;
    const char* says;
  };
  for (const Bad& b : std::vector<Bad>{
           {true, R"({"messages": [], "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})",
            "response_format", "name is required"},
           {true, R"({"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 3}}})",
            "response_format", "schema must be"},
           {true, R"({"messages": [], "response_format": {"type": "xml"}})", "response_format", "xml"},
           {true, R"({"messages": [], "response_format": {"type": "json_object", "schema": {}}})",
            "response_format", "response_format.schema"},
           {false, R"({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}})",
            "structured_outputs", "one of"},
           {false, R"({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}})",
            "structured_outputs", "structural_tag"},
           {false, R"({"prompt": "x", "structured_outputs": {"json": "{not json"}})",
            "structured_outputs", "JSON schema"},
           {true, R"({"messages": [], "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})",
            "structured_outputs", "both"},
           {false, R"({"prompt": "x", "response_format": {"type": "json_object"}})",
            "response_format", "not a field"}}) {
    std::optional<ApiError> err = ParseOpenAiRequest(b.body, b.chat, &r);
    ASSERT_TRUE(err.has_value()) << b.body;
    EXPECT_EQ(err->param, b.param) << b.body;
    EXPECT_THAT(err->message, HasSubstr(b.says)) << b.body;
  }
}

// gRPC: SamplingParams.structured_output becomes the same grammar spec.
TEST(OpenAiFieldsTest, GrpcStructuredOutput) {
  v1::GenerateRequest g;
  g.set_prompt("x");
  g.mutable_sampling()->mutable_structured_output()->set_regex("[0-9]+");
  absl::StatusOr<CompletionParams> p = GenerateRequestToParams(g);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->grammar.kind, GrammarSpec::Kind::kRegex);
  EXPECT_EQ(p->grammar.text, "[0-9]+");
  EXPECT_EQ(p->grammar_field, "structured_output");
  v1::GenerateRequest c;
  c.set_prompt("x");
  auto* so = c.mutable_sampling()->mutable_structured_output();
  so->mutable_choice()->add_values("yes");
  so->mutable_choice()->add_values("no");
  p = GenerateRequestToParams(c);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->grammar.kind, GrammarSpec::Kind::kChoice);
  EXPECT_EQ(p->grammar.choices, (std::vector<std::string>{"yes", "no"}));
  v1::GenerateRequest j;
  j.set_prompt("x");
  j.mutable_sampling()->mutable_structured_output()->set_json_schema(R"({"type":"object"})");
  j.mutable_sampling()->mutable_structured_output()->set_strict(false);
  p = GenerateRequestToParams(j);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->grammar.kind, GrammarSpec::Kind::kJsonSchema);
  EXPECT_FALSE(p->grammar.strict);
}

}  // namespace
}  // namespace kvserve
