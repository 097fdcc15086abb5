#include "model/chat_template.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

// SmolLM2-135M-Instruct's tokenizer.chat_template, verbatim.
constexpr char kSmolLM2Template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

constexpr char kSmolLM2DefaultSystem[] =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

// Expected renderings were produced by jinja2 3.1.6 from kSmolLM2Template
// (messages=..., add_generation_prompt=...).
TEST(ChatTemplateTest, SmolLM2InjectsDefaultSystemPrompt) {
  auto t = ChatTemplate::FromTemplateString(kSmolLM2Template);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->family(), ChatTemplate::Family::kChatML);
  EXPECT_EQ(t->default_system(), kSmolLM2DefaultSystem);
  auto r = t->Render({{"user", "Hello!"}}, /*add_generation_prompt=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, SmolLM2KeepsCallerSystemPrompt) {
  auto t = ChatTemplate::FromTemplateString(kSmolLM2Template);
  ASSERT_TRUE(t.ok()) << t.status();
  auto r =
      t->Render({{"system", "Be terse."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}},
                /*add_generation_prompt=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r,
            "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n");
}

TEST(ChatTemplateTest, SmolLM2EdgeCases) {
  auto t = ChatTemplate::FromTemplateString(kSmolLM2Template);
  ASSERT_TRUE(t.ok()) << t.status();
  // A conversation opening with the assistant still gets the default system.
  EXPECT_EQ(*t->Render({{"assistant", "x"}}, false),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n");
  // No messages: the loop never runs, so no default system either.
  EXPECT_EQ(*t->Render({}, true), "<|im_start|>assistant\n");
  EXPECT_EQ(t->Render({{"", "x"}}, true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, DefaultSystemWrittenWithJinjaEscapes) {
  // The same template as stored by converters that keep "\n" escaped.
  const std::string jinja =
      "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou\\'re helpful."
      "<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{'<|im_start|>' + m['role'] + "
      "'\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}";
  auto t = ChatTemplate::FromTemplateString(jinja);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->default_system(), "You're helpful.");
}

TEST(ChatTemplateTest, PlainChatMLHasNoDefaultSystem) {
  const std::string jinja =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\n' }}{% endif %}";
  auto t = ChatTemplate::FromTemplateString(jinja);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->default_system(), "");
  EXPECT_EQ(*t->Render({{"user", "Hi"}}, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, UnknownTemplateIsAnErrorUnlessFallbackAllowed) {
  const std::string llama2 = "{% for message in messages %}[INST] {{ message['content'] }} [/INST]";
  auto t = ChatTemplate::FromTemplateString(llama2);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("[INST]"));

  auto fallback = ChatTemplate::FromTemplateString(llama2, /*allow_fallback=*/true);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ(fallback->family(), ChatTemplate::Family::kChatML);
  EXPECT_EQ(fallback->default_system(), "");
  EXPECT_EQ(*fallback->Render({{"user", "Hi"}}, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, MissingTemplateIsAnErrorUnlessFallbackAllowed) {
  testing::GgufWriter w;
  w.SetString("general.architecture", "llama");
  const std::string bytes = w.Serialize();
  auto file = GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE(file.ok()) << file.status();
  auto t = ChatTemplate::FromGguf(**file);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("chat_template"));
  auto fallback = ChatTemplate::FromGguf(**file, /*allow_fallback=*/true);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ(fallback->family(), ChatTemplate::Family::kChatML);
}

TEST(ChatTemplateTest, ReadsSmolLM2TemplateFromModel) {
  const std::string path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(path, "SmolLM2 GGUF");
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  // The constant the other tests use is the model's template, verbatim.
  EXPECT_EQ((*file)->GetString("tokenizer.chat_template").value_or(""), kSmolLM2Template);
  auto t = ChatTemplate::FromGguf(**file);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->default_system(), kSmolLM2DefaultSystem);
}

}  // namespace
}  // namespace kvserve
