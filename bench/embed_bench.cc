// Sentence encoder throughput (embed/, issue 19): sentences/s of
// SentenceEncoder::Embed on all-MiniLM-L6-v2 for a short, a medium and a
// truncated (256-token) input, one thread per benchmark thread; and the
// tokenizer alone; F32 vs F16 layer weights side by side. Needs models/all-MiniLM-L6-v2
// (deploy/setup.sh) or $KVSERVE_MODEL_DIR/all-MiniLM-L6-v2.
//
//   build/bench/embed_bench --benchmark_filter=Embed
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "embed/sentence_encoder.h"

namespace {

using kvserve::embed::SentenceEncoder;

const SentenceEncoder* LoadOrDie(bool f16) {
  const char* env = std::getenv("KVSERVE_MODEL_DIR");
  const std::string dir =
      (env != nullptr ? std::string(env) : std::string(KVSERVE_SOURCE_DIR) + "/models") +
      "/all-MiniLM-L6-v2";
  kvserve::embed::SentenceEncoderOptions options;
  if (f16) options.weight_type = kvserve::kernels::DType::kF16;
  auto loaded = SentenceEncoder::Load(dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "embed_bench: %s\n", std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  return loaded->release();
}

// Thread-safe lazy loading (function-local statics).
const SentenceEncoder* Encoder(bool f16) {
  if (f16) {
    static const SentenceEncoder* e = LoadOrDie(true);
    return e;
  }
  static const SentenceEncoder* e = LoadOrDie(false);
  return e;
}

std::string Text(int which) {
  switch (which) {
    case 0:
      return "How do I enable 2FA on my account?";  // 12 tokens
    case 1:
      return "The response cache sits at the front door of the serving daemon; a semantic hit is "
             "verified by the model before it is served, so greedy answers never change.";
    default: {
      std::string s;
      for (int i = 0; i < 60; ++i) s += "Semantic caching is great. ";
      return s;  // truncated to 256 tokens
    }
  }
}

// range(0): which text; range(1): 1 for F16 weights.
void BM_Embed(benchmark::State& state) {
  const SentenceEncoder* e = Encoder(state.range(1) != 0);
  const std::string text = Text(static_cast<int>(state.range(0)));
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(e->Tokenize(text)->size()),
                                                benchmark::Counter::kAvgThreads);
  for (auto _ : state) {
    auto v = e->Embed(text);
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());  // items/s = sentences/s
}
BENCHMARK(BM_Embed)
    ->ArgsProduct({{0, 1, 2}, {0, 1}})
    ->ArgNames({"text", "f16"})
    ->Unit(benchmark::kMillisecond)
    ->MeasureProcessCPUTime()
    ->UseRealTime();
BENCHMARK(BM_Embed)->Args({0, 0})->Threads(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Tokenize(benchmark::State& state) {
  const SentenceEncoder* e = Encoder(false);
  const std::string text = Text(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    auto ids = e->Tokenize(text);
    benchmark::DoNotOptimize(ids);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Tokenize)->Arg(0)->Arg(2)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
