// Grammar-constrained decoding cost (grammar/, issue 44) on SmolLM2
// (49152-token vocabulary): per decode step, for a batch of B constrained
// samples, xgrammar's FillNextTokenBitmask plus the masked greedy draw and
// the AcceptToken after it (BM_ConstrainedSample), against the plain greedy
// draw alone (BM_FreeSample); and whole engine decode steps with none or
// half of the batch constrained (BM_DecodeStep: the mask's share of a real
// step, and the throughput). Needs models/SmolLM2-135M-Instruct.Q4_1.gguf
// (deploy/setup.sh) or $KVSERVE_MODEL_DIR, and a build with xgrammar.
//
//   build/bench/grammar_bench --benchmark_filter='Sample|DecodeStep'
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "grammar/structured_output.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "scheduler/engine.h"

namespace {

using namespace kvserve;

struct Loaded {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<GrammarCompiler> grammars;
};

const Loaded& Model() {
  static const Loaded* m = [] {
    const char* env = std::getenv("KVSERVE_MODEL_DIR");
    const std::string path =
        (env != nullptr ? std::string(env) : std::string(KVSERVE_SOURCE_DIR) + "/models") +
        "/SmolLM2-135M-Instruct.Q4_1.gguf";
    auto* out = new Loaded;
    auto model = LlamaModel::Load(path);
    if (!model.ok()) {
      std::fprintf(stderr, "grammar_bench: %s\n", std::string(model.status().message()).c_str());
      std::exit(1);
    }
    out->model = *std::move(model);
    out->tokenizer = Tokenizer::FromGguf(out->model->file()).value();
    auto g = GrammarCompiler::Create(*out->tokenizer, out->model->config().vocab_size);
    if (!g.ok()) {
      std::fprintf(stderr, "grammar_bench: %s\n", std::string(g.status().message()).c_str());
      std::exit(1);
    }
    out->grammars = *std::move(g);
    return out;
  }();
  return *m;
}

// A schema of the kind agents send, and a document that matches it, which
// the matchers walk token by token (wrapping around at its end).
constexpr char kSchema[] =
    R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},)"
    R"("email":{"type":"string"},"tags":{"type":"array","items":{"type":"string"}},)"
    R"("address":{"type":"object","properties":{"street":{"type":"string"},)"
    R"("city":{"type":"string"}},"required":["street","city"]}},)"
    R"("required":["name","age","email","tags","address"]})";
constexpr char kDocument[] =
    R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", )"
    R"("poetry", "engines"], "address": {"street": "12 St James's Square", "city": "London"}})";

std::vector<float> Logits(int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> out(static_cast<size_t>(vocab));
  for (float& x : out) x = d(rng);
  return out;
}

// One step of B constrained samples: fill the mask, draw greedily under it,
// accept the document's next token (the drawn one is what the model would
// say; the document keeps the matchers on a realistic path).
void BM_ConstrainedSample(benchmark::State& state) {
  const Loaded& m = Model();
  const int32_t batch = static_cast<int32_t>(state.range(0));
  const int32_t vocab = m.model->config().vocab_size;
  GrammarSpec spec;
  spec.kind = GrammarSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  auto g = m.grammars->Compile(spec).value();
  const std::vector<int32_t> doc = m.tokenizer->Encode(kDocument, false, false);
  std::vector<std::unique_ptr<TokenConstraint>> c;
  std::vector<size_t> pos(static_cast<size_t>(batch));
  for (int32_t b = 0; b < batch; ++b) {
    c.push_back(g->NewConstraint());
    // Spread the samples over the document.
    pos[static_cast<size_t>(b)] = static_cast<size_t>(b) * doc.size() / static_cast<size_t>(batch);
    for (size_t i = 0; i < pos[static_cast<size_t>(b)]; ++i) c.back()->Accept(doc[i]);
  }
  const std::vector<float> logits = Logits(vocab, 1);
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler(p);
  std::vector<uint32_t> mask(MaskWords(vocab));
  for (auto _ : state) {
    for (int32_t b = 0; b < batch; ++b) {
      TokenConstraint* t = c[static_cast<size_t>(b)].get();
      size_t& i = pos[static_cast<size_t>(b)];
      const bool apply = t->FillMask(absl::MakeSpan(mask));
      benchmark::DoNotOptimize(
          sampler.Sample(logits, {}, {}, apply ? absl::MakeConstSpan(mask) : absl::Span<const uint32_t>()));
      if (i == doc.size()) {
        state.PauseTiming();
        c[static_cast<size_t>(b)] = g->NewConstraint();
        i = 0;
        state.ResumeTiming();
        continue;
      }
      t->Accept(doc[i++]);
    }
  }
}
BENCHMARK(BM_ConstrainedSample)->Arg(1)->Arg(32)->Unit(benchmark::kMicrosecond);

void BM_FreeSample(benchmark::State& state) {
  const Loaded& m = Model();
  const int32_t batch = static_cast<int32_t>(state.range(0));
  const std::vector<float> logits = Logits(m.model->config().vocab_size, 1);
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler(p);
  for (auto _ : state) {
    for (int32_t b = 0; b < batch; ++b) benchmark::DoNotOptimize(sampler.Sample(logits, {}, {}));
  }
}
BENCHMARK(BM_FreeSample)->Arg(1)->Arg(32)->Unit(benchmark::kMicrosecond);

ThreadPool* Pool() {
  static ThreadPool pool(static_cast<int>(std::getenv("KVSERVE_BENCH_THREADS")
                                              ? std::atoi(std::getenv("KVSERVE_BENCH_THREADS"))
                                              : 2));
  return &pool;
}

// Engine decode steps of a batch of B greedy samples; range(1) of them (0 or
// B/2 or B) constrained. range(2) picks the grammar: 0, letters and
// punctuation (root ::= [a-zA-Z ,.']+, a cheap one: most tokens allowed); 1,
// the JSON schema above with its strings unbounded (what agents send; most
// tokens refused inside structure). One iteration = one engine step;
// tok_per_s counts the tokens the samples actually emitted (a constrained
// sample that reaches its grammar's end stops, shrinking the batch).
void BM_DecodeStep(benchmark::State& state) {
  const Loaded& m = Model();
  const int32_t batch = static_cast<int32_t>(state.range(0));
  const int32_t constrained = static_cast<int32_t>(state.range(1));
  GrammarSpec spec;
  if (state.range(2) == 0) {
    spec.kind = GrammarSpec::Kind::kEbnf;
    spec.text = "root ::= [a-zA-Z ,.']+";
  } else {
    spec.kind = GrammarSpec::Kind::kJsonSchema;
    spec.text = kSchema;
  }
  auto g = m.grammars->Compile(spec).value();
  EngineOptions o;
  o.num_blocks = 4096;
  o.max_batched_tokens = 2048;
  o.max_seqs = 64;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  auto tokens = std::make_shared<int64_t>(0);
  for (int32_t b = 0; b < batch; ++b) {
    EngineRequest r;
    r.prompt = m.tokenizer->Encode("<|im_start|>user\nWrite a long story about a ship, number " +
                                       std::to_string(b) + ".<|im_end|>\n<|im_start|>assistant\n",
                                   false, true);
    r.params.temperature = 0;
    r.params.max_tokens = 700;
    r.params.ignore_eos = true;
    if (b < constrained) r.grammar = g;
    auto cb = [tokens](const SeqEvent& ev) { *tokens += static_cast<int64_t>(ev.token_ids.size()); };
    if (!e->Submit(std::move(r), cb).ok()) std::exit(1);
  }
  // Prefill (and the first decode) out of the timing.
  for (int i = 0; i < 4; ++i) e->Step();
  const int64_t before = *tokens;
  for (auto _ : state) e->Step();
  state.counters["tok_per_s"] =
      benchmark::Counter(static_cast<double>(*tokens - before), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DecodeStep)
    ->Args({1, 0, 0})
    ->Args({1, 1, 0})
    ->Args({1, 1, 1})
    ->Args({32, 0, 0})
    ->Args({32, 16, 0})
    ->Args({32, 16, 1})
    ->Args({32, 32, 1})
    ->Iterations(60)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
