#include "model/jinja.h"

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/chat_template.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

// The instant tests/data/make_chat_template_reference.py gives strftime_now.
constexpr std::time_t kFixedNow = 1767323045;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TemplatePath(const std::string& name) {
  return std::string(KVSERVE_SOURCE_DIR) + "/tests/data/chat_templates/" + name + ".jinja";
}

absl::StatusOr<std::string> Render(const std::string& source, jinja::Object vars = {}) {
  auto t = jinja::Template::Parse(source);
  if (!t.ok()) return t.status();
  jinja::Context ctx;
  ctx.variables = std::move(vars);
  ctx.now = kFixedNow;
  return (*t)->Render(ctx);
}

std::string MustRender(const std::string& source, jinja::Object vars = {}) {
  absl::StatusOr<std::string> r = Render(source, std::move(vars));
  EXPECT_TRUE(r.ok()) << r.status() << "\nsource: " << source;
  return r.ok() ? *r : "<error>";
}

class JinjaReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // strftime_now formats local time; the reference was rendered in UTC.
    setenv("TZ", "UTC", 1);
    tzset();
  }
};

// Every rendering Python's jinja2 produced for the real templates of the
// families kvserve serves (tests/data/chat_template_reference.jsonl).
TEST_F(JinjaReferenceTest, RealTemplatesMatchJinja2) {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/chat_template_reference.jsonl");
  ASSERT_TRUE(in.good());
  std::string line;
  size_t checked = 0, errors = 0;
  std::set<std::string> templates;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string name = j.at("template").get<std::string>();
    templates.insert(name);
    auto t = ChatTemplate::FromTemplateString(ReadFile(TemplatePath(name)), /*allow_fallback=*/false,
                                              j.at("bos_token").get<std::string>(),
                                              j.at("eos_token").get<std::string>());
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    ASSERT_TRUE(t->interpreted()) << name;
    t->set_now_for_testing(kFixedNow);
    std::vector<ChatMessage> messages;
    for (const auto& m : j.at("messages")) {
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    }
    const bool gen = j.at("add_generation_prompt").get<bool>();
    absl::StatusOr<std::string> got = t->Render(messages, gen);
    if (j.contains("error")) {
      ++errors;
      ASSERT_FALSE(got.ok()) << name << " should raise: " << line;
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(got.status().message()), HasSubstr(j.at("error").get<std::string>()))
          << name;
    } else {
      ASSERT_TRUE(got.ok()) << name << ": " << got.status() << "\n" << line;
      EXPECT_EQ(*got, j.at("expected").get<std::string>()) << name << "\n" << line;
    }
    ++checked;
  }
  EXPECT_GE(templates.size(), 7u);
  EXPECT_GE(checked, 140u);
  EXPECT_GE(errors, 6u);  // raise_exception paths (alternation, system role) are exercised
}

TEST(JinjaTest, WhitespaceControlAndBlockTrimming) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: the
  // indentation before it goes; "-" strips all whitespace on its side.
  EXPECT_EQ(MustRender("{% if true %}\n  yes\n{% endif %}\n"), "  yes\n");
  EXPECT_EQ(MustRender("a  \n  {%- if true %}b{% endif -%}  \n c"), "abc");
  EXPECT_EQ(MustRender("x\n    {% if true %}y{% endif %}"), "x\ny");
  EXPECT_EQ(MustRender("{{ 'a' }}\n{{ 'b' }}"), "a\nb");  // no trimming after {{ }}
  EXPECT_EQ(MustRender("a{# comment #}\nb"), "ab");
  EXPECT_EQ(MustRender("a {{- ' b ' -}} c"), "a b c");
}

TEST(JinjaTest, LoopsAndLoopVariables) {
  jinja::Object vars = {{"xs", jinja::Value::MakeArray({jinja::Value::String("a"), jinja::Value::String("b"),
                                                        jinja::Value::String("c")})}};
  EXPECT_EQ(MustRender("{% for x in xs %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}", vars),
            "1a,2b,3c");
  EXPECT_EQ(MustRender("{% for x in xs %}{{ loop.index0 }}{{ loop.first }}{{ loop.revindex }}{% endfor %}", vars),
            "0True31False22False1");
  EXPECT_EQ(MustRender("{% for x in xs if x != 'b' %}{{ x }}{{ loop.length }}{% endfor %}", vars), "a2c2");
  EXPECT_EQ(MustRender("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(MustRender("{% for x in xs %}{% if x == 'b' %}{% break %}{% endif %}{{ x }}{% endfor %}", vars), "a");
  EXPECT_EQ(MustRender("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{{ x }}{% endfor %}", vars), "ac");
  EXPECT_EQ(MustRender("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  // A set inside a loop stays in the loop; a namespace carries it out.
  EXPECT_EQ(MustRender("{% set n = 0 %}{% for x in xs %}{% set n = n + 1 %}{% endfor %}{{ n }}", vars), "0");
  EXPECT_EQ(MustRender("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
                       vars),
            "3");
}

TEST(JinjaTest, ExpressionsFollowPythonSemantics) {
  EXPECT_EQ(MustRender("{{ 7 % 3 }} {{ -7 % 3 }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }}"),
            "1 2 3 3.5 1024 7");
  EXPECT_EQ(MustRender("{{ 'a' ~ 1 ~ none }} {{ 'ab' + 'cd' }} {{ [1] + [2] }}"), "a1None abcd [1, 2]");
  EXPECT_EQ(MustRender("{{ 'x' if false else 'y' }}{{ 'z' if true }}{{ 'w' if false }}"), "yz");
  EXPECT_EQ(MustRender("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}"),
            "True True True True");
  EXPECT_EQ(MustRender("{{ 1 < 2 and 'a' < 'b' }} {{ 1 == 1.0 }} {{ none or 'd' }} {{ 0 and 1 }}"),
            "True True d 0");
  EXPECT_EQ(MustRender("{{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3][-1] }} {{ 'hello'[1:3] }} {{ 'hello'[::-1] }}"),
            "[2, 3, 4] 3 el olleh");
  EXPECT_EQ(MustRender("{{ {'a': {'b': 'c'}}.a.b }}{{ {'a': 1}['a'] }}"), "c1");
  EXPECT_EQ(MustRender("{{ 'a' 'b' }}{{ \"q\\n\\\"\" }}"), "abq\n\"");
  EXPECT_EQ(MustRender("{{ x }}|{{ x is defined }}|{{ none is none }}|{{ 3 is odd }}|{{ 'a' is string }}"),
            "|False|True|True|True");
  EXPECT_EQ(MustRender("{{ x.y is defined }}", {{"x", jinja::Value::MakeObject()}}), "False");
}

TEST(JinjaTest, StringMethodsAndFilters) {
  EXPECT_EQ(MustRender("{{ '  a b  '.strip() }}|{{ '  a  '|trim }}|{{ 'xay'.strip('xy') }}|{{ ' a'.lstrip() }}"),
            "a b|a|a|a");
  EXPECT_EQ(MustRender("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith('bc') }} {{ 'AbC'.lower() }} {{ 'abc'|upper }}"),
            "True True abc ABC");
  EXPECT_EQ(MustRender("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'aXbX'.replace('X', '-') }}"),
            "['a', 'b', '', 'c'] ['a', 'b'] a-b-");
  EXPECT_EQ(MustRender("{{ 'héllo'|length }} {{ [1, 2]|length }} {{ [1, 2]|join('-') }} {{ [3, 4]|first }}{{ [3, 4]|last }}"),
            "5 2 1-2 34");
  EXPECT_EQ(MustRender("{{ x|default('d') }} {{ ''|default('e', true) }} {{ 'hi there'|title }} {{ 'hI'|capitalize }}"),
            "d e Hi There Hi");
  EXPECT_EQ(MustRender("{{ {'b': [1, 'x\"'], 'a': none, 'c': true}|tojson }}"),
            "{\"b\": [1, \"x\\\"\"], \"a\": null, \"c\": true}");
  EXPECT_EQ(MustRender("{{ {'a': [1]}|tojson(indent=2) }}"), "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(MustRender("{% set ms = [{'role': 'user'}, {'role': 'bot'}, {'role': 'user'}] %}"
                       "{{ ms|selectattr('role', 'equalto', 'user')|list|length }}"
                       "{{ ms|rejectattr('role', 'equalto', 'user')|map(attribute='role')|join }}"),
            "2bot");
  EXPECT_EQ(MustRender("{{ ['a', 'b', 'a']|reject('equalto', 'a')|join }}{{ [1, 2, 3]|select('odd')|list }}"),
            "b[1, 3]");
  EXPECT_EQ(MustRender("{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b', 'no') }} {{ {'a': 1}.get('b') }}"), "1 no None");
  EXPECT_EQ(MustRender("{{ 1.5 }} {{ 2.0 }} {{ 1|string ~ '' }} {{ '3'|int + 1 }} {{ range(3)|list }}"),
            "1.5 2.0 1 4 [0, 1, 2]");
  EXPECT_EQ(MustRender("{{ strftime_now('%Y-%m-%d') }}").size(), 10u);
}

TEST(JinjaTest, RaiseExceptionIsAnError) {
  absl::StatusOr<std::string> r = Render("ok{{ raise_exception('roles must alternate') }}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("roles must alternate"));
}

TEST(JinjaTest, RunTimeErrorsNameTheProblem) {
  absl::StatusOr<std::string> r = Render("{{ x.y.z }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'x' is undefined"));
  r = Render("{{ 'a' + 1 }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("unsupported operand"));
  r = Render("{{ 1 // 0 }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("division by zero"));
}

// The chat-template fuzzer's finding: 64-bit integer arithmetic overflowed
// (undefined behaviour) where Python's ints grow. Now an error naming it.
TEST(JinjaTest, IntegerOverflowIsAnErrorNotUndefinedBehaviour) {
  for (const char* t : {"{{ 9223372036854775807 + 222 }}", "{{ -9223372036854775807 - 2 }}",
                        "{{ 4611686018427387904 * 2 }}", "{{ (-9223372036854775807 - 1) // -1 }}",
                        "{{ (-9223372036854775807 - 1) % -1 }}", "{{ -(-9223372036854775807 - 1) }}",
                        "{{ 10 ** 30 }}"}) {
    absl::StatusOr<std::string> r = Render(t);
    ASSERT_FALSE(r.ok()) << t;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("integer overflow")) << t;
  }
  EXPECT_EQ(*Render("{{ 9223372036854775806 + 1 }}"), "9223372036854775807");
  EXPECT_EQ(*Render("{{ 2 ** 62 }}"), "4611686018427387904");
  EXPECT_EQ(*Render("{{ (10.0 ** 30) | int > 0 }}"), "True");
}

// Constructs outside the subset are refused at parse time, by name and line.
TEST(JinjaTest, UnsupportedConstructsAreRefusedByName) {
  struct Case {
    const char* source;
    const char* named;
  };
  const Case cases[] = {
      {"{% macro f(x) %}{{ x }}{% endmacro %}", "'{% macro %}'"},
      {"line1\n{% include 'other.jinja' %}", "line 2: unsupported construct '{% include %}'"},
      {"{% call f() %}x{% endcall %}", "'{% call %}'"},
      {"{% raw %}{{ x }}{% endraw %}", "'{% raw %}'"},
      {"{{ x|wordcount }}", "filter 'wordcount'"},
      {"{{ x is escaped }}", "test 'is escaped'"},
      {"{% set x %}block{% endset %}", "block 'set ... endset'"},
      {"{% for x in xs recursive %}{% endfor %}", "'for ... recursive'"},
  };
  for (const Case& c : cases) {
    auto t = jinja::Template::Parse(c.source);
    ASSERT_FALSE(t.ok()) << c.source;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.named)) << c.source;
  }
  // Syntax errors are errors too, not a partial rendering.
  EXPECT_FALSE(jinja::Template::Parse("{% if x %}no end").ok());
  EXPECT_FALSE(jinja::Template::Parse("{{ 'unterminated }}").ok());
  EXPECT_FALSE(jinja::Template::Parse("{{ x ").ok());
}

// A template is data from a model file: nesting, work and output are
// bounded, so a hostile one returns an error instead of exhausting the stack
// or memory.
TEST(JinjaTest, HostileTemplatesAreBounded) {
  EXPECT_FALSE(jinja::Template::Parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").ok());
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "{% if true %}";
  EXPECT_FALSE(jinja::Template::Parse(deep).ok());
  absl::StatusOr<std::string> r =
      Render("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("too long"));
  r = Render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("step limit"));
}

TEST(JinjaTest, ChatTemplateRefusesOutsideTheSubsetUnlessFallback) {
  const std::string with_macro =
      "{% macro turn(m) %}<{{ m.role }}>{{ m.content }}{% endmacro %}"
      "{% for m in messages %}{{ turn(m) }}{% endfor %}";
  auto t = ChatTemplate::FromTemplateString(with_macro);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("'{% macro %}'"));
  auto fallback = ChatTemplate::FromTemplateString(with_macro, /*allow_fallback=*/true);
  ASSERT_TRUE(fallback.ok());
  EXPECT_FALSE(fallback->interpreted());
  EXPECT_THAT(fallback->fallback_reason(), HasSubstr("macro"));
  auto r = fallback->Render({{"user", "Hi"}}, true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

}  // namespace
}  // namespace kvserve
