// The model families through a real daemon: /v1/chat/completions renders
// the GGUF's own chat template (here Llama 3.2's and Mistral Nemo's, on
// tiny fixture models), a template outside the interpreter's subset leaves
// chat off with the construct named, and a sliding-window model serves a
// repeated long prompt from the prefix cache with the same greedy answer
// and reports its window in /metrics.
#include <httplib.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string ReadTemplate(const std::string& name) {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/chat_templates/" + name + ".jinja");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string WriteModel(const testing::TinyLlamaOptions& o, const std::string& name) {
  const std::string path = testing::TempDir() + "/" + name + ".gguf";
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  return path;
}

struct Served {
  std::unique_ptr<testing::Daemon> daemon;
  std::unique_ptr<httplib::Client> client;
};

Served Serve(const std::string& model, const std::vector<std::string>& flags = {}) {
  Served s;
  auto d = testing::Daemon::Start(KVSERVE_BINARY, {"--log-level", "info", "-m", model}, flags);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return s;
  s.daemon = std::move(d).value();
  s.client = std::make_unique<httplib::Client>("127.0.0.1", s.daemon->http_port());
  s.client->set_read_timeout(120, 0);
  return s;
}

std::pair<int, json> Chat(httplib::Client& c, const json& messages, int max_tokens = 8) {
  const json body = {{"model", "m"}, {"messages", messages}, {"max_tokens", max_tokens},
                     {"temperature", 0}};
  auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
  if (!res) return {-1, json()};
  json j = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  return {res->status, j};
}

TEST(ModelFamiliesE2eTest, ChatUsesTheModelsOwnTemplate) {
  for (const char* name : {"meta-llama-Llama-3.2-3B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407",
                           "Qwen-Qwen2.5-7B-Instruct"}) {
    testing::TinyLlamaOptions o;
    o.chat_template = ReadTemplate(name);
    Served s = Serve(WriteModel(o, std::string("chat-") + name));
    ASSERT_NE(s.client, nullptr);
    auto [status, j] =
        Chat(*s.client, {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi"}}});
    ASSERT_EQ(status, 200) << name << ": " << j.dump() << "\n" << s.daemon->Log();
    // The rendered prompt is long (Llama 3.2's system header, Mistral's
    // [INST] markers): far more tokens than the two words alone.
    EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 10) << name;
    EXPECT_THAT(s.daemon->Log(), ::testing::Not(HasSubstr("chat disabled"))) << name;
    // raise_exception reaches the client as a 400 naming the template's message.
    if (std::string(name).find("Mistral") != std::string::npos) {
      auto [bad, e] = Chat(*s.client, {{{"role", "assistant"}, {"content", "first"}}});
      EXPECT_EQ(bad, 400) << e.dump();
      EXPECT_THAT(e.dump(), HasSubstr("roles must alternate")) << e.dump();
    }
  }
}

TEST(ModelFamiliesE2eTest, TemplateOutsideTheSubsetIsNamed) {
  testing::TinyLlamaOptions o;
  o.chat_template = "{% macro turn(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ turn(m) }}{% endfor %}";
  Served s = Serve(WriteModel(o, "chat-macro"));
  ASSERT_NE(s.client, nullptr);
  auto [status, j] = Chat(*s.client, {{{"role", "user"}, {"content", "Hi"}}});
  EXPECT_EQ(status, 400) << j.dump();
  EXPECT_THAT(s.daemon->Log(), HasSubstr("'{% macro %}'"));
  // Plain completions still work.
  auto res = s.client->Post("/v1/completions", R"({"model":"m","prompt":"Once","max_tokens":4})",
                            "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

TEST(ModelFamiliesE2eTest, SlidingWindowModelKeepsPrefixCaching) {
  testing::TinyLlamaOptions o;
  o.architecture = "mistral";
  o.sliding_window = 32;
  o.context_length = 512;
  o.chat_template = ReadTemplate("mistralai-Mistral-Nemo-Instruct-2407");
  Served s = Serve(WriteModel(o, "window-e2e"), {"--block-size", "16"});
  ASSERT_NE(s.client, nullptr);
  std::string text;
  for (int i = 0; i < 40; ++i) text += "word" + std::to_string(i) + " ";
  const json body = {{"model", "m"}, {"prompt", text}, {"max_tokens", 16}, {"temperature", 0}};
  auto a = s.client->Post("/v1/completions", body.dump(), "application/json");
  auto b = s.client->Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(a && b);
  ASSERT_EQ(a->status, 200) << a->body;
  ASSERT_EQ(b->status, 200) << b->body;
  const json ja = json::parse(a->body), jb = json::parse(b->body);
  EXPECT_GT(ja["usage"]["prompt_tokens"].get<int>(), 2 * 32);
  EXPECT_EQ(ja["choices"][0]["text"], jb["choices"][0]["text"]);
  EXPECT_GE(jb["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 2 * 32);
  auto m = s.client->Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_THAT(m->body, HasSubstr("kvserve:kv_window_released_blocks_total"));
  EXPECT_THAT(m->body, HasSubstr("kvserve:prefix_cache_window_lost_blocks_total"));
}

}  // namespace
}  // namespace kvserve
