// End-to-end checks of the model families through a real `kvserve serve`:
// fixture GGUFs in the Llama 3 (llama3 RoPE scaling), Qwen2 (Q/K/V biases)
// and Mistral (sliding window) layouts, written by the tests' GGUF writer,
// each carrying its family's real chat template. /v1/chat/completions must
// render the template exactly as Python's jinja2 does (the prefix cache is
// the oracle: the reference rendering's token ids, sent back as a prompt,
// are cached in full only if the daemon's prompt had the same ids), and the
// sliding-window fixture serves a repeated 2 x W-token prompt from the
// prefix cache with the same greedy output, frees the blocks its window
// leaves, reports a prefix the window dropped, and shows it in /metrics.
// The jinja2 reference runs at test time (tests/data/render_chat_template.py,
// python3-jinja2); the test skips without it.
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

constexpr int32_t kWindow = 16;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool HaveJinja2() {
  return testing::RunCommand("python3 -c 'import jinja2' 2>/dev/null").exit_code == 0;
}

// jinja2's rendering of `tmpl` (Hugging Face's environment), or the error
// it raised as {"error": ...}.
json RenderReference(const std::string& tmpl, const json& messages, const std::string& bos,
                     const std::string& eos) {
  const std::string in = testing::TempDir() + "/render-in.json";
  std::ofstream(in, std::ios::binary)
      << json{{"template", tmpl}, {"messages", messages}, {"bos_token", bos},
              {"eos_token", eos}, {"add_generation_prompt", true}}
             .dump();
  const testing::CommandResult r = testing::RunCommand(
      std::string("python3 ") + KVSERVE_SOURCE_DIR + "/tests/data/render_chat_template.py < " + in);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  return json::parse(r.out, nullptr, false);
}

using Reply = testing::HttpReply;
using testing::HttpPost;

// The value of an unlabelled-or-labelled sample `name` in /metrics (-1 when
// absent).
double Metric(int port, const std::string& name) { return testing::MetricSample(port, name); }

struct Family {
  std::string name;
  std::string template_file;  // under tests/data/chat_templates/
  testing::TinyLlamaOptions options;
};

std::vector<Family> Families() {
  std::vector<Family> f;
  {
    Family l{"llama3", "meta-llama-Llama-3.1-8B-Instruct.jinja", {}};
    l.options.rope_scaling = "llama3";
    f.push_back(l);
  }
  {
    Family q{"qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja", {}};
    q.options.architecture = "qwen2";
    f.push_back(q);
  }
  {
    Family m{"mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", {}};
    m.options.architecture = "mistral";
    m.options.sliding_window = kWindow;
    f.push_back(m);
  }
  {
    // Gemma 3 (QK-norm, post-norms, GELU, local layers with their own RoPE
    // base) with the instruction-tuned Gemma 3 template.
    Family g{"gemma3", "google-gemma-3-270m-it.jinja", {}};
    g.options.architecture = "gemma3";
    g.options.head_dim = 32;
    g.options.tied_output = true;
    g.options.rope_freq_base = 1e6f;
    g.options.sliding_window = kWindow;
    f.push_back(g);
  }
  {
    // Qwen3 (QK-norm, no biases, wide heads); the forward is what this case
    // adds, so it carries the Qwen2.5 template (Qwen3's own is not in
    // tests/data/chat_templates).
    Family q{"qwen3", "Qwen-Qwen2.5-7B-Instruct.jinja", {}};
    q.options.architecture = "qwen3";
    q.options.head_dim = 32;
    f.push_back(q);
  }
  for (Family& x : f) {
    x.options.context_length = 2048;  // the rendered templates are long in byte tokens
    x.options.seed = 11;
  }
  return f;
}

struct Fixture {
  std::string path;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string tmpl;
};

Fixture Write(const Family& family) {
  Fixture fx;
  fx.tmpl = ReadFile(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/chat_templates/" +
                     family.template_file);
  testing::TinyLlamaOptions o = family.options;
  o.chat_template = fx.tmpl;
  fx.path = testing::TempDir() + "/" + family.name + "-fixture.gguf";
  std::ofstream(fx.path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  fx.model = LlamaModel::Load(fx.path).value();
  fx.tokenizer = Tokenizer::FromGguf(fx.model->file()).value();
  return fx;
}

std::unique_ptr<testing::Daemon> StartDaemon(const std::string& model,
                                             const std::vector<std::string>& extra = {}) {
  return testing::StartServe(
      KVSERVE_BINARY, model, "warn",
      {"--kv-cache-memory", "8MiB", "--block-size", "4", "--drain-timeout", "2"}, extra);
}

json Conversations() {
  return json::array({
      json::array({{{"role", "user"}, {"content", "Hello"}}}),
      json::array({{{"role", "system"}, {"content", "You are terse."}},
                   {{"role", "user"}, {"content", "What is 2+2?"}}}),
      json::array({{{"role", "user"}, {"content", "Good morning"}},
                   {{"role", "assistant"}, {"content", "Bonjour"}},
                   {{"role", "user"}, {"content", "Grüße, 世界 🙂 {{ not a tag }}"}}}),
  });
}

class ModelFamiliesE2eTest : public ::testing::TestWithParam<int> {};

// Each family's template, rendered by the daemon on the chat path, gives
// exactly the token ids of jinja2's rendering.
TEST_P(ModelFamiliesE2eTest, ChatRendersTheGgufTemplateAsJinja2Does) {
  if (!HaveJinja2()) GTEST_SKIP() << "python3 jinja2 not found; skipping (deploy/setup.sh)";
  const Family family = Families()[static_cast<size_t>(GetParam())];
  Fixture fx = Write(family);
  auto d = StartDaemon(fx.path);
  ASSERT_TRUE(d);
  // The token texts the daemon passes as bos_token / eos_token.
  const std::string bos = fx.tokenizer->Piece(fx.tokenizer->bos_id());
  const std::string eos = fx.tokenizer->Piece(fx.tokenizer->eos_id());
  for (const json& messages : Conversations()) {
    SCOPED_TRACE(family.name + " " + messages.dump());
    const json ref = RenderReference(fx.tmpl, messages, bos, eos);
    ASSERT_TRUE(ref.contains("text")) << ref.dump();
    const std::vector<int32_t> ids =
        fx.tokenizer->Encode(ref["text"].get<std::string>(), /*add_bos=*/false,
                             /*parse_special=*/true);
    const Reply chat = HttpPost(d->http_port(), "/v1/chat/completions",
                                {{"messages", messages}, {"max_tokens", 3}, {"temperature", 0}});
    ASSERT_EQ(chat.status, 200) << chat.raw;
    EXPECT_EQ(chat.body["usage"]["prompt_tokens"], ids.size());
    // The chat's prompt is in the prefix cache now: jinja2's ids match it in
    // full (all but the last token, which is always computed) only if the
    // daemon rendered and tokenized the same ids.
    const Reply again = HttpPost(d->http_port(), "/v1/completions",
                                 {{"prompt", ids}, {"max_tokens", 1}, {"temperature", 0}});
    ASSERT_EQ(again.status, 200) << again.raw;
    EXPECT_EQ(again.body["usage"]["prompt_tokens_details"]["cached_tokens"], ids.size() - 1)
        << again.raw;
  }
  // A conversation the template refuses (Mistral's roles must alternate;
  // the others accept it): the template's own message, a 400 for the
  // daemon, which keeps serving.
  const json bad = json::array({{{"role", "assistant"}, {"content", "first"}},
                                {{"role", "assistant"}, {"content", "twice"}}});
  const json ref = RenderReference(fx.tmpl, bad, bos, eos);
  const Reply r = HttpPost(d->http_port(), "/v1/chat/completions",
                           {{"messages", bad}, {"max_tokens", 2}, {"temperature", 0}});
  if (ref.contains("error")) {
    EXPECT_EQ(r.status, 400) << r.raw;
    EXPECT_NE(r.raw.find(ref["error"].get<std::string>()), std::string::npos) << r.raw;
  } else {
    EXPECT_EQ(r.status, 200) << r.raw;
  }
  const Reply ok = HttpPost(d->http_port(), "/v1/chat/completions",
                            {{"messages", Conversations()[0]}, {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.raw;
}

INSTANTIATE_TEST_SUITE_P(Families, ModelFamiliesE2eTest, ::testing::Values(0, 1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return Families()[static_cast<size_t>(info.param)].name;
                         });

std::vector<int32_t> PromptIds(int32_t n, int32_t salt) {
  std::vector<int32_t> p = {1};
  for (int32_t i = 1; i < n; ++i) p.push_back(3 + (i * 31 + salt * 17) % 250);
  return p;
}

json Greedy(const std::vector<int32_t>& ids, int32_t max_tokens) {
  return {{"prompt", ids},         {"max_tokens", max_tokens}, {"temperature", 0},
          {"ignore_eos", true},    {"cache_report", true}};
}

// The sliding-window fixture over HTTP: a repeated 2 x W-token prompt is
// served from the prefix cache with the same greedy output as a daemon
// without a prefix cache; blocks the window left go back to the pool
// (hollowed in the cache); a prompt that shares a prefix whose window was
// dropped is reported window_dropped and counted in /metrics, and its output
// is still the uncached one.
TEST(SlidingWindowE2eTest, RepeatedLongPromptIsServedFromTheCacheOverHttp) {
  Fixture fx = Write(Families()[2]);
  ASSERT_EQ(fx.model->config().sliding_window, kWindow);
  auto d = StartDaemon(fx.path);
  auto plain = StartDaemon(fx.path, {"--no-prefix-cache"});
  ASSERT_TRUE(d && plain);
  const std::vector<int32_t> prompt = PromptIds(2 * kWindow + 1, 5);

  const Reply ref = HttpPost(plain->http_port(), "/v1/completions", Greedy(prompt, 48));
  ASSERT_EQ(ref.status, 200) << ref.raw;
  const Reply first = HttpPost(d->http_port(), "/v1/completions", Greedy(prompt, 48));
  ASSERT_EQ(first.status, 200) << first.raw << d->Log();
  EXPECT_EQ(first.body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(first.body["choices"][0]["text"], ref.body["choices"][0]["text"]);
  const Reply second = HttpPost(d->http_port(), "/v1/completions", Greedy(prompt, 48));
  ASSERT_EQ(second.status, 200) << second.raw << d->Log();
  EXPECT_GE(second.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 2 * kWindow);
  EXPECT_EQ(second.body["kvserve_cache_control"]["report"]["reason"], "hit") << second.raw;
  EXPECT_EQ(second.body["choices"][0]["text"], first.body["choices"][0]["text"]);

  EXPECT_GT(Metric(d->http_port(), "kvserve:kv_window_released_blocks_total"), 0);
  EXPECT_GT(Metric(d->http_port(), "kvserve:kv_window_hollowed_blocks_total"), 0);
  EXPECT_GT(Metric(d->http_port(), "kvserve:kv_window_kept_cached_blocks_total"), 0);
  EXPECT_EQ(Metric(d->http_port(), "kvserve:prefix_cache_window_dropped_tokens_total"), 0);

  // A 60-token prompt, then one sharing its first 40 tokens: the cache
  // spells them, but only the 60-token boundary's window kept its K/V.
  const std::vector<int32_t> a = PromptIds(60, 9);
  std::vector<int32_t> b(a.begin(), a.begin() + 40);
  for (int32_t i = 0; i < 8; ++i) b.push_back(200 + i);
  ASSERT_EQ(HttpPost(d->http_port(), "/v1/completions", Greedy(a, 4)).status, 200);
  const Reply cut = HttpPost(d->http_port(), "/v1/completions", Greedy(b, 16));
  ASSERT_EQ(cut.status, 200) << cut.raw << d->Log();
  const json& report = cut.body["kvserve_cache_control"]["report"];
  EXPECT_EQ(report["reason"], "window_dropped") << cut.raw;
  EXPECT_GT(report["window_dropped_tokens"].get<int>(), 0) << cut.raw;
  EXPECT_LT(cut.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 40);
  const Reply cut_ref = HttpPost(plain->http_port(), "/v1/completions", Greedy(b, 16));
  ASSERT_EQ(cut_ref.status, 200) << cut_ref.raw;
  EXPECT_EQ(cut.body["choices"][0]["text"], cut_ref.body["choices"][0]["text"]);
  EXPECT_GT(Metric(d->http_port(), "kvserve:prefix_cache_window_dropped_tokens_total"), 0);
  EXPECT_GT(Metric(d->http_port(), "kvserve:prefix_cache_hollow_blocks"), 0);
}

// `kvserve plan` on the windowed fixture counts the window.
TEST(SlidingWindowE2eTest, PlanCountsTheWindow) {
  Fixture fx = Write(Families()[2]);
  const testing::CommandResult plan = testing::RunCommand(
      std::string(KVSERVE_BINARY) + " --log-level warn -m " + fx.path +
      " plan --kv-cache-memory 64MiB --block-size 4 2>&1");
  ASSERT_EQ(plan.exit_code, 0) << plan.out;
  EXPECT_NE(plan.out.find("sliding window: 16 tokens on 2 of 2 layers"), std::string::npos)
      << plan.out;
  EXPECT_NE(plan.out.find("per cached prompt boundary"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("32k-token sequences: "), std::string::npos) << plan.out;
}

// Gemma 3 270M Q4_K_M (deploy/setup.sh --models all) through the daemon:
// greedy completions of 10 prompts equal llama.cpp's token for token, except
// from a step where llama.cpp's two best logits were a near-tie (then the
// engines may rightly part). The reference
// (tests/data/gemma3_greedy_reference.jsonl, tests/data/make_gemma3_reference.py)
// holds llama.cpp's prompt ids, greedy ids and top-2 margins per step.
TEST(Gemma3RealE2eTest, GreedyCompletionsMatchLlamaCpp) {
  const std::string model = testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf");
  KVSERVE_SKIP_IF_MISSING(model, "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
  auto loaded = LlamaModel::Load(model);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto tok = Tokenizer::FromGguf((*loaded)->file());
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto d = testing::StartServe(KVSERVE_BINARY, model, "warn",
                               {"--kv-cache-memory", "64MiB", "--drain-timeout", "2"}, {});
  ASSERT_TRUE(d);
  // Below this top-2 logit gap at a step, the two engines' rounding
  // (activations quantized per block, f16 K/V) may pick either token.
  constexpr double kNearTie = 0.1;
  // On a file whose activations are rounded to 8 bits, llama.cpp's own
  // arg-max moves at 3-5% of positions after a last-bit change (flash
  // attention on/off, an RMSNorm epsilon moved by 1e-4: docs/model-families.md,
  // "What bounds top-1 agreement on quantized-activation files"), not only at
  // gaps below kNearTie. Teacher-forced on 3 windows of GPL-3, kvserve
  // agrees with llama.cpp at 96.5% of positions and 11 of its 27 misses
  // fall at gaps of 0.1 or more (bench/top1_vs_llamacpp.py), so of the ~6
  // completions that part, ~2.4 are expected to part at such a gap: up to
  // four may, each below kWide; a fifth, or any gap of kWide or more, fails.
  // (Moving Q5_0 and Q4_K weights to the panel kernels, which regroup float
  // sums, moved which completions part: 1, then 2, then 3 at gaps of 0.10 to
  // 0.31, while the teacher-forced agreement went from 96.21% to 96.47%.)
  constexpr double kWide = 0.5;
  constexpr int kWideAllowed = 4;
  int wide = 0;
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/tests/data/gemma3_greedy_reference.jsonl");
  ASSERT_TRUE(in.good());
  std::string line;
  int prompts = 0, identical = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json ref = json::parse(line);
    const std::string prompt = ref["prompt"].get<std::string>();
    SCOPED_TRACE(prompt);
    const std::vector<int32_t> prompt_ids = ref["prompt_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = ref["ids"].get<std::vector<int32_t>>();
    const std::vector<double> margins = ref["margins"].get<std::vector<double>>();
    // llama.cpp stopped at an end-of-generation token after `ids` (its
    // margin is the last one) or ran to the step limit.
    const bool eog = ref["eog"].get<bool>();
    ASSERT_EQ(margins.size(), want.size() + (eog ? 1 : 0));
    // The prompt as text: the daemon's tokenizer must give llama.cpp's ids.
    EXPECT_EQ((*tok)->Encode(prompt, true, false), prompt_ids);
    const Reply r = HttpPost(d->http_port(), "/v1/completions",
                             {{"prompt", prompt},
                              {"max_tokens", want.size() + (eog ? 1 : 0)},
                              {"temperature", 0},
                              {"logprobs", 1}});
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.body["usage"]["prompt_tokens"], prompt_ids.size());
    const json pieces = r.body["choices"][0]["logprobs"]["tokens"];
    size_t i = 0;
    for (; i < want.size() && i < pieces.size(); ++i) {
      if (pieces[i].get<std::string>() != (*tok)->TokenToBytes(want[i])) break;
    }
    // Same tokens, and kvserve stopped where llama.cpp did (an EOG token is
    // not shown; at the step limit both run out).
    if (i == want.size() && pieces.size() == want.size()) {
      ++identical;
    } else {
      // Parted at step i: only where llama.cpp itself had a near-tie (or,
      // once, a gap its own last-bit changes also flip).
      ASSERT_LT(i, margins.size());
      if (margins[i] >= kNearTie && margins[i] < kWide) ++wide;
      EXPECT_LT(margins[i], wide <= kWideAllowed ? kWide : kNearTie)
          << "step " << i << ": kvserve "
          << (i < pieces.size() ? pieces[i].dump() : std::string("(stopped)")) << ", llama.cpp "
          << (i < want.size() ? "'" + (*tok)->TokenToBytes(want[i]) + "'" : std::string("(stopped)"))
          << ", margin " << margins[i];
    }
    ++prompts;
  }
  EXPECT_EQ(prompts, 10);
  EXPECT_LE(wide, kWideAllowed);
  RecordProperty("identical_completions", identical);
  std::printf("gemma3 greedy: %d of %d completions identical to llama.cpp's\n", identical, prompts);
}

}  // namespace
}  // namespace kvserve
