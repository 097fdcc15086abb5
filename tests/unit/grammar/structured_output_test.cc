// Grammar-constrained decoding (grammar/structured_output.h) on the real
// SmolLM2 vocabulary and model: the mask xgrammar fills equals a plain
// reference (token t allowed iff the matcher accepts t; and, for a choice
// grammar, iff t's bytes are a prefix of a choice, computed from the
// vocabulary alone); the sampler never draws a masked token, greedy or
// sampled; in an engine batch that mixes constrained and free requests every
// constrained output matches its grammar and every free output is exactly
// what it is alone; drafts (the request's and ngram speculation's) change
// nothing; bad schemas are InvalidArgument; compiles are cached by spec.
// Skips without the SmolLM2 model or in a build without xgrammar.
#include <map>
#include <regex>
#include <set>

#include "gtest/gtest.h"
#include "grammar/structured_output.h"
#include "nlohmann/json.hpp"
#include "scheduler/engine.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

struct Model {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<GrammarCompiler> grammars;
};

const Model* SmolLM2() {
  static const Model* m = [] () -> const Model* {
    const std::string path = testing::SmolLM2Path();
    if (path.empty() || !GrammarCompiler::Available()) return nullptr;
    auto* out = new Model;
    out->model = LlamaModel::Load(path).value();
    out->tokenizer = Tokenizer::FromGguf(out->model->file()).value();
    out->grammars =
        GrammarCompiler::Create(*out->tokenizer, out->model->config().vocab_size).value();
    return out;
  }();
  return m;
}

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

class GrammarTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GrammarCompiler::Available()) GTEST_SKIP() << GrammarCompiler::UnavailableReason();
    if (SmolLM2() == nullptr) GTEST_SKIP() << "SmolLM2 not found; skipping (see README)";
    m_ = SmolLM2();
  }
  std::shared_ptr<const CompiledGrammar> Compile(const GrammarSpec& spec) {
    auto g = m_->grammars->Compile(spec);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? *g : nullptr;
  }
  int32_t vocab() const { return m_->model->config().vocab_size; }
  const Model* m_ = nullptr;
};

GrammarSpec Spec(GrammarSpec::Kind kind, std::string text) {
  GrammarSpec s;
  s.kind = kind;
  s.text = std::move(text);
  return s;
}

// The plain reference: token t is allowed iff the matcher accepts it.
std::vector<bool> ReferenceAllowed(TokenConstraint* c, int32_t vocab) {
  std::vector<bool> out(static_cast<size_t>(vocab));
  for (int32_t t = 0; t < vocab; ++t) {
    if (c->Accept(t)) {
      out[static_cast<size_t>(t)] = true;
      c->Rollback(1);
    }
  }
  return out;
}

std::vector<bool> MaskAllowed(TokenConstraint* c, int32_t vocab) {
  std::vector<uint32_t> words(MaskWords(vocab));
  const bool apply = c->FillMask(absl::MakeSpan(words));
  std::vector<bool> out(static_cast<size_t>(vocab));
  for (int32_t t = 0; t < vocab; ++t) out[static_cast<size_t>(t)] = !apply || MaskAllows(words, t);
  return out;
}

TEST_F(GrammarTest, MaskEqualsAcceptanceAlongAJsonSchema) {
  auto g = Compile(Spec(GrammarSpec::Kind::kJsonSchema,
                        R"({"type":"object","properties":{"city":{"type":"string"},)"
                        R"("n":{"type":"integer"}},"required":["city","n"]})"));
  ASSERT_NE(g, nullptr);
  std::unique_ptr<TokenConstraint> c = g->NewConstraint();
  // Walk a valid output token by token; at several points (start, inside a
  // key, inside a string, inside the number, at the end) compare the mask
  // with the reference over the whole vocabulary.
  const std::vector<int32_t> text =
      m_->tokenizer->Encode(R"({"city": "Paris", "n": 42})", false, false);
  ASSERT_GE(text.size(), 8u);
  const std::set<size_t> at = {0, 2, text.size() / 2, text.size() - 2, text.size()};
  for (size_t i = 0; i <= text.size(); ++i) {
    if (at.count(i)) {
      EXPECT_EQ(MaskAllowed(c.get(), vocab()), ReferenceAllowed(c.get(), vocab())) << "at " << i;
    }
    if (i < text.size()) {
      ASSERT_TRUE(c->Accept(text[i])) << "token " << i;
    }
  }
  // Complete: only the end-of-generation tokens remain, and one ends it.
  const std::vector<bool> end = MaskAllowed(c.get(), vocab());
  for (int32_t t = 0; t < vocab(); ++t) {
    EXPECT_EQ(end[static_cast<size_t>(t)], m_->tokenizer->IsEndOfGeneration(t)) << t;
  }
  EXPECT_FALSE(c->IsTerminated());
  ASSERT_TRUE(c->Accept(m_->tokenizer->eos_id()));
  EXPECT_TRUE(c->IsTerminated());
}

TEST_F(GrammarTest, ChoiceMaskIsThePrefixSetOfTheVocabulary) {
  GrammarSpec s;
  s.kind = GrammarSpec::Kind::kChoice;
  s.choices = {"yes", "no", "maybe so"};
  auto g = Compile(s);
  ASSERT_NE(g, nullptr);
  std::unique_ptr<TokenConstraint> c = g->NewConstraint();
  const std::vector<bool> got = MaskAllowed(c.get(), vocab());
  int32_t allowed = 0;
  for (int32_t t = 0; t < vocab(); ++t) {
    const std::string bytes =
        m_->tokenizer->IsControl(t) ? std::string() : m_->tokenizer->TokenToBytes(t);
    bool want = false;
    for (const std::string& choice : s.choices) {
      want |= !bytes.empty() && choice.compare(0, bytes.size(), bytes) == 0;
    }
    EXPECT_EQ(got[static_cast<size_t>(t)], want) << "token " << t << " '" << bytes << "'";
    allowed += want;
  }
  EXPECT_GE(allowed, 4);  // "y", "yes", "n", "no", "m", ...
}

TEST_F(GrammarTest, SamplerDrawsOnlyAllowedTokens) {
  // A mask allowing a handful of low-logit tokens: greedy takes the best of
  // them, sampling never leaves them.
  std::vector<float> logits(static_cast<size_t>(vocab()));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 97) * 0.1f;
  std::vector<uint32_t> words(MaskWords(vocab()), 0u);
  const std::vector<int32_t> allowed = {5, 77, 1000, 4242};
  for (int32_t t : allowed) words[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
  SamplingParams greedy;
  greedy.temperature = 0;
  Sampler g(greedy);
  const int32_t best = g.Sample(logits, {}, {}, words).token;
  EXPECT_EQ(best, 77);  // 77 % 97 = 77 is the highest logit among them
  for (uint64_t seed = 0; seed < 200; ++seed) {
    SamplingParams p;
    p.temperature = 1.5f;
    p.top_k = seed % 2 ? 40 : 0;
    p.top_p = seed % 3 ? 0.9f : 1.0f;
    p.seed = seed;
    p.has_seed = true;
    Sampler s(p);
    const int32_t t = s.Sample(logits, {}, {}, words).token;
    EXPECT_NE(std::find(allowed.begin(), allowed.end(), t), allowed.end()) << "seed " << seed;
  }
}

struct Out {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::kNone;
};

// Submits every request to one engine (they batch together), steps it on
// this thread until idle.
std::vector<Out> RunAll(const Model* m, const std::vector<EngineRequest>& reqs,
                     SpecMode spec = SpecMode::kOff) {
  EngineOptions o;
  o.num_blocks = 2048;
  o.max_batched_tokens = 1024;
  o.max_seqs = 64;
  o.speculation.mode = spec;
  o.speculation.adaptive = false;
  o.speculation.ngram_min = 1;
  o.speculation.ngram_max = 3;
  auto e = Engine::Create(m->model.get(), m->tokenizer.get(), Pool(), o).value();
  std::vector<Out> out(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto id = e->Submit(reqs[i], [&out, i](const SeqEvent& ev) {
      out[i].tokens.insert(out[i].tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
      out[i].text += ev.text;
      if (ev.finish != FinishReason::kNone) out[i].finish = ev.finish;
    });
    EXPECT_TRUE(id.ok()) << id.status();
  }
  while (e->Step()) {
  }
  return out;
}

EngineRequest Chat(const Model* m, const std::string& user, int32_t max_tokens) {
  EngineRequest r;
  r.prompt = m->tokenizer->Encode(
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + user +
          "<|im_end|>\n<|im_start|>assistant\n",
      false, true);
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  return r;
}

TEST_F(GrammarTest, MixedBatchConstrainedAndFree) {
  const std::string schema =
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":20},)"
      R"("age":{"type":"integer","minimum":0,"maximum":150},"pets":{"type":"array",)"
      R"("items":{"type":"string","enum":["cat","dog","fish"]},"maxItems":3}},)"
      R"("required":["name","age","pets"]})";
  const auto json_g = Compile(Spec(GrammarSpec::Kind::kJsonSchema, schema));
  const auto regex_g = Compile(Spec(GrammarSpec::Kind::kRegex, "[A-Z][a-z]{2,8}-[0-9]{3}"));
  GrammarSpec choice;
  choice.kind = GrammarSpec::Kind::kChoice;
  choice.choices = {"Paris", "London", "Rome"};
  const auto choice_g = Compile(choice);
  ASSERT_TRUE(json_g && regex_g && choice_g);

  std::vector<EngineRequest> free = {Chat(m_, "Tell me about cats.", 24),
                                     Chat(m_, "What is 2+2?", 16)};
  std::vector<EngineRequest> reqs;
  reqs.push_back(free[0]);
  reqs.push_back(Chat(m_, "Describe a person as JSON.", 96));
  reqs.back().grammar = json_g;
  reqs.push_back(Chat(m_, "Give me a product code.", 32));
  reqs.back().grammar = regex_g;
  reqs.push_back(free[1]);
  reqs.push_back(Chat(m_, "What is the capital of France?", 16));
  reqs.back().grammar = choice_g;
  // A sampled constrained request too.
  reqs.push_back(Chat(m_, "Describe another person as JSON.", 96));
  reqs.back().grammar = json_g;
  reqs.back().params.temperature = 0.9f;
  reqs.back().params.seed = 7;
  reqs.back().params.has_seed = true;

  const std::vector<Out> got = RunAll(m_, reqs);
  const std::vector<Out> alone = RunAll(m_, free);
  // Free rows are untouched by their constrained neighbours.
  EXPECT_EQ(got[0].tokens, alone[0].tokens);
  EXPECT_EQ(got[3].tokens, alone[1].tokens);
  for (int i : {1, 5}) {
    SCOPED_TRACE(got[i].text);
    EXPECT_EQ(got[i].finish, FinishReason::kStop);
    nlohmann::json j = nlohmann::json::parse(got[i].text, nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    ASSERT_TRUE(j.is_object());
    EXPECT_TRUE(j["name"].is_string());
    EXPECT_LE(j["name"].get<std::string>().size(), 20u);
    ASSERT_TRUE(j["age"].is_number_integer());
    EXPECT_GE(j["age"].get<int>(), 0);
    EXPECT_LE(j["age"].get<int>(), 150);
    ASSERT_TRUE(j["pets"].is_array());
    EXPECT_LE(j["pets"].size(), 3u);
    for (const auto& p : j["pets"]) EXPECT_TRUE(p == "cat" || p == "dog" || p == "fish") << p;
    EXPECT_EQ(j.size(), 3u);  // strict: no other properties
  }
  EXPECT_TRUE(std::regex_match(got[2].text, std::regex("[A-Z][a-z]{2,8}-[0-9]{3}"))) << got[2].text;
  EXPECT_EQ(got[2].finish, FinishReason::kStop);
  EXPECT_TRUE(got[4].text == "Paris" || got[4].text == "London" || got[4].text == "Rome")
      << got[4].text;
}

TEST_F(GrammarTest, DraftsAndSpeculationChangeNothing) {
  const auto g = Compile(Spec(GrammarSpec::Kind::kJsonSchema,
                              R"({"type":"object","properties":{"list":{"type":"array",)"
                              R"("items":{"type":"integer"},"maxItems":12}},"required":["list"]})"));
  ASSERT_NE(g, nullptr);
  std::vector<EngineRequest> reqs = {Chat(m_, "Count from 1 to 10 as a JSON list.", 80),
                                     Chat(m_, "List some even numbers.", 80)};
  for (auto& r : reqs) r.grammar = g;
  const std::vector<Out> plain = RunAll(m_, reqs);
  ASSERT_EQ(plain[0].finish, FinishReason::kStop);
  // The request's own draft: the right answer's first half, then tokens the
  // grammar refuses (free text).
  std::vector<EngineRequest> drafted = reqs;
  const size_t half = plain[0].tokens.size() / 2;
  drafted[0].draft_tokens.assign(plain[0].tokens.begin(), plain[0].tokens.begin() + half);
  for (int32_t t : m_->tokenizer->Encode(" hello world", false, false)) {
    drafted[0].draft_tokens.push_back(t);
  }
  const std::vector<Out> with_draft = RunAll(m_, drafted);
  EXPECT_EQ(with_draft[0].tokens, plain[0].tokens);
  EXPECT_EQ(with_draft[1].tokens, plain[1].tokens);
  // ngram speculation, every proposal verified in full (cut to the grammar).
  const std::vector<Out> spec = RunAll(m_, reqs, SpecMode::kNgram);
  EXPECT_EQ(spec[0].tokens, plain[0].tokens);
  EXPECT_EQ(spec[1].tokens, plain[1].tokens);
  EXPECT_EQ(spec[0].text, plain[0].text);
}

TEST_F(GrammarTest, ValidPrefixCutsAtTheFirstRefusedTokenAndKeepsState) {
  auto g = Compile(Spec(GrammarSpec::Kind::kRegex, "[0-9]+"));
  ASSERT_NE(g, nullptr);
  std::unique_ptr<TokenConstraint> c = g->NewConstraint();
  std::vector<int32_t> draft = m_->tokenizer->Encode("123", false, false);
  const size_t digits = draft.size();
  for (int32_t t : m_->tokenizer->Encode("abc", false, false)) draft.push_back(t);
  EXPECT_EQ(c->ValidPrefix(draft), static_cast<int32_t>(digits));
  // Unchanged: a letter is still refused and a digit accepted at the start.
  EXPECT_FALSE(c->Accept(m_->tokenizer->Encode("a", false, false)[0]));
  EXPECT_TRUE(c->Accept(draft[0]));
}

TEST_F(GrammarTest, BadSpecsAreInvalidArgumentAndCompilesAreCached) {
  for (const GrammarSpec& bad :
       {Spec(GrammarSpec::Kind::kJsonSchema, "{not json"),
        Spec(GrammarSpec::Kind::kJsonSchema, R"({"type":"no-such-type"})"),
        Spec(GrammarSpec::Kind::kRegex, "[unclosed"),
        Spec(GrammarSpec::Kind::kEbnf, "root ::= undefined_rule")}) {
    auto r = m_->grammars->Compile(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad.text;
  }
  const GrammarSpec s = Spec(GrammarSpec::Kind::kRegex, "cached-[a-z]+");
  const int64_t compiles = m_->grammars->compiles();
  const int64_t hits = m_->grammars->cache_hits();
  auto a = m_->grammars->Compile(s);
  auto b = m_->grammars->Compile(s);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(m_->grammars->compiles(), compiles + 1);
  EXPECT_EQ(m_->grammars->cache_hits(), hits + 1);
  // Distinct specs have distinct keys.
  GrammarSpec loose = s;
  loose.strict = false;
  EXPECT_NE(loose.Key(), s.Key());
}

TEST_F(GrammarTest, ToolCallGrammarForcesOneHermesCallWithValidArguments) {
  GrammarSpec s;
  s.kind = GrammarSpec::Kind::kToolCall;
  s.text = R"([{"name":"get_weather","parameters":{"type":"object","properties":{)"
           R"("city":{"type":"string","maxLength":30},"unit":{"type":"string","enum":["c","f"]}},)"
           R"("required":["city","unit"]}},{"name":"add","parameters":{"type":"object",)"
           R"("properties":{"a":{"type":"integer"},"b":{"type":"integer"}},"required":["a","b"]}}])";
  auto g = Compile(s);
  ASSERT_NE(g, nullptr);
  std::vector<EngineRequest> reqs = {Chat(m_, "What is the weather in Paris?", 80),
                                     Chat(m_, "Add 2 and 3.", 80)};
  for (auto& r : reqs) r.grammar = g;
  const std::vector<Out> got = RunAll(m_, reqs);
  for (const Out& o : got) {
    SCOPED_TRACE(o.text);
    const std::string open = "<tool_call>\n", close = "\n</tool_call>";
    ASSERT_EQ(o.text.rfind(open, 0), 0u);
    ASSERT_GE(o.text.size(), open.size() + close.size());
    ASSERT_EQ(o.text.substr(o.text.size() - close.size()), close);
    nlohmann::json call = nlohmann::json::parse(
        o.text.substr(open.size(), o.text.size() - open.size() - close.size()), nullptr, false);
    ASSERT_TRUE(call.is_object());
    ASSERT_TRUE(call["arguments"].is_object());
    if (call["name"] == "get_weather") {
      EXPECT_TRUE(call["arguments"]["city"].is_string());
      EXPECT_TRUE(call["arguments"]["unit"] == "c" || call["arguments"]["unit"] == "f");
    } else {
      ASSERT_EQ(call["name"], "add");
      EXPECT_TRUE(call["arguments"]["a"].is_number_integer());
      EXPECT_TRUE(call["arguments"]["b"].is_number_integer());
    }
  }
}

// Accepts `text`'s tokens in turn; false at the first one refused.
bool AcceptText(const Model* m, TokenConstraint* c, const std::string& text) {
  for (int32_t t : m->tokenizer->Encode(text, false, false)) {
    if (!c->Accept(t)) return false;
  }
  return true;
}

TEST_F(GrammarTest, StrictToolsUnderAutoConstrainOnlyTheCallsTheModelOpens) {
  GrammarSpec s;
  s.kind = GrammarSpec::Kind::kToolCallAuto;
  s.text = R"([{"name":"add","strict":true,"parameters":{"type":"object","properties":{)"
           R"("a":{"type":"integer"},"b":{"type":"integer"}},"required":["a","b"]}}])";
  auto g = Compile(s);
  ASSERT_NE(g, nullptr);
  // Free text, then a valid call, then text again, then the end.
  std::unique_ptr<TokenConstraint> c = g->NewConstraint();
  EXPECT_TRUE(AcceptText(m_, c.get(), "Sure, let me add them. "));
  EXPECT_TRUE(AcceptText(m_, c.get(),
                         "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"));
  EXPECT_TRUE(AcceptText(m_, c.get(), " Done."));
  EXPECT_TRUE(c->Accept(m_->tokenizer->eos_id()));
  EXPECT_TRUE(c->IsTerminated());
  // Inside a call, arguments that break the schema, or another tool's
  // name, are refused.
  std::unique_ptr<TokenConstraint> bad = g->NewConstraint();
  EXPECT_FALSE(AcceptText(m_, bad.get(),
                          "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": \"one\""));
  std::unique_ptr<TokenConstraint> other = g->NewConstraint();
  EXPECT_FALSE(AcceptText(m_, other.get(), "<tool_call>\n{\"name\": \"sub\""));
}

}  // namespace
}  // namespace kvserve
