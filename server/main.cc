// kvserve: the engine's command-line entry. Subcommands:
//   generate    complete a prompt (or a chat turn) and stream the text
//   perplexity  perplexity of the model on a text file
//   bench       prefill and decode throughput at several batch sizes
//   info        model hyper-parameters and KV bytes per token
// Issue 4 adds `serve`, the gRPC/HTTP daemon, beside these.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "model/chat_template.h"
#include "model/llama.h"
#include "model/perplexity.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "scheduler/batch_generator.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

std::string DefaultModelPath() {
  if (const char* m = std::getenv("KVSERVE_MODEL")) return m;
  std::string dir = "models";
  if (const char* d = std::getenv("KVSERVE_MODEL_DIR")) dir = d;
  return dir + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

struct Loaded {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

// Prints the error and exits 1: the CLI's single failure path.
[[noreturn]] void Die(const absl::Status& s) {
  std::fprintf(stderr, "kvserve: error: %s\n", s.ToString().c_str());
  std::exit(1);
}

Loaded LoadModel(const std::string& path) {
  Loaded l;
  auto model = LlamaModel::Load(path);
  if (!model.ok()) Die(model.status());
  l.model = std::move(model).value();
  auto tok = Tokenizer::FromGguf(l.model->file());
  if (!tok.ok()) Die(tok.status());
  l.tokenizer = std::move(tok).value();
  const LlamaConfig& c = l.model->config();
  spdlog::info("model {}: {} layers, dim {}, heads {}/{} (q/kv), head_dim {}, ffn {}, vocab {}, ctx {}",
               path, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim,
               c.vocab_size, c.context_length);
  return l;
}

void SetThreads(int threads) {
  ThreadPool::SetGlobalThreads(threads);
  spdlog::info("threads: {}, cpu: {}", ThreadPool::Global().num_threads(),
               GetCpuFeatures().ToString());
}

struct SamplingFlags {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int64_t seed = -1;
  int max_tokens = 128;
  std::vector<std::string> stop;
  bool ignore_eos = false;

  void Add(CLI::App* app) {
    app->add_option("-n,--max-tokens", max_tokens, "Tokens to generate at most")->capture_default_str();
    app->add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
    app->add_option("--top-k", top_k, "0 = off")->capture_default_str();
    app->add_option("--top-p", top_p, "Nucleus probability (1 = off)")->capture_default_str();
    app->add_option("--min-p", min_p, "0 = off")->capture_default_str();
    app->add_option("--repetition-penalty", repetition_penalty)->capture_default_str();
    app->add_option("--presence-penalty", presence_penalty)->capture_default_str();
    app->add_option("--frequency-penalty", frequency_penalty)->capture_default_str();
    app->add_option("--seed", seed, "Random seed (-1 = random)")->capture_default_str();
    app->add_option("--stop", stop, "Stop string (repeatable)");
    app->add_flag("--ignore-eos", ignore_eos, "Keep generating past end-of-generation tokens");
  }
  SamplingParams ToParams() const {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = repetition_penalty;
    p.presence_penalty = presence_penalty;
    p.frequency_penalty = frequency_penalty;
    p.has_seed = seed >= 0;
    p.seed = static_cast<uint64_t>(seed < 0 ? 0 : seed);
    p.max_tokens = max_tokens;
    p.stop = stop;
    p.ignore_eos = ignore_eos;
    p.logprobs = true;
    return p;
  }
};

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Die(absl::NotFoundError(absl::StrCat("cannot read ", path)));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

}  // namespace
}  // namespace kvserve

int main(int argc, char** argv) {
  using namespace kvserve;
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvserve"));

  CLI::App app{"kvserve: an LLM inference engine and serving daemon built around KV-cache management"};
  app.require_subcommand(1);
  std::string model_path = DefaultModelPath();
  int threads = 0;
  std::string log_level = "info";
  app.add_option("-m,--model", model_path, "GGUF model file (env KVSERVE_MODEL)")->capture_default_str();
  app.add_option("-t,--threads", threads, "Compute threads (0 = all cores; env KVSERVE_THREADS)");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")->capture_default_str();

  // generate
  auto* gen = app.add_subcommand("generate", "Complete a prompt, streaming the text");
  std::string prompt;
  bool chat = false, json = false, no_bos = false, raw_special = false;
  std::string system_prompt;
  SamplingFlags gen_flags;
  gen->add_option("-p,--prompt", prompt, "Prompt text (or a user message with --chat)")->required();
  gen->add_flag("--chat", chat, "Wrap the prompt as a user turn with the model's chat template");
  gen->add_option("--system", system_prompt, "System message for --chat");
  gen->add_flag("--no-bos", no_bos, "Do not prepend BOS even if the model asks for it");
  gen->add_flag("--special", raw_special, "Parse special-token text (e.g. <|im_start|>) in the prompt");
  gen->add_flag("--json", json, "Print one JSON object instead of streaming text");
  gen_flags.Add(gen);

  // perplexity
  auto* ppl = app.add_subcommand("perplexity", "Perplexity of the model on a text file");
  std::string ppl_file;
  PerplexityOptions ppl_opts;
  ppl->add_option("-f,--file", ppl_file, "Plain text file")->required();
  ppl->add_option("-c,--context", ppl_opts.context, "Tokens per window")->capture_default_str();
  ppl->add_option("--stride", ppl_opts.stride,
                  "0 = llama.cpp method (score second half of each window); >0 = sliding windows")
      ->capture_default_str();
  ppl->add_option("--max-windows", ppl_opts.max_windows, "0 = all")->capture_default_str();
  ppl->add_option("--batch", ppl_opts.batch_tokens, "Tokens per forward call")->capture_default_str();

  // bench
  auto* bench = app.add_subcommand("bench", "Prefill and decode throughput at several batch sizes");
  std::vector<int> bench_batches = {1, 8, 32};
  int bench_prompt = 128, bench_gen = 64, bench_reps = 1;
  bench->add_option("-b,--batch", bench_batches, "Batch sizes")->delimiter(',')->capture_default_str();
  bench->add_option("--prompt-tokens", bench_prompt, "Prompt length per sequence")->capture_default_str();
  bench->add_option("--gen-tokens", bench_gen, "Generated tokens per sequence")->capture_default_str();
  bench->add_option("--repeat", bench_reps, "Runs per batch size (best is reported)")->capture_default_str();

  // info
  auto* info = app.add_subcommand("info", "Model hyper-parameters and KV bytes per token");

  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));
  SetThreads(threads);
  ThreadPool* pool = &ThreadPool::Global();

  if (*info) {
    Loaded l = LoadModel(model_path);
    const LlamaConfig& c = l.model->config();
    std::printf("name            %s\narchitecture    %s\nlayers          %d\ndim             %d\n"
                "heads (q/kv)    %d/%d\nhead_dim        %d\nffn             %d\nvocab           %d\n"
                "context         %d\nrope            base %.0f, dims %d\ntied output     %s\n"
                "weights read    %.1f MiB per token\nKV bytes/token  %lld (f32), %lld (f16)\n",
                c.name.c_str(), c.architecture.c_str(), c.n_layers, c.dim, c.n_heads, c.n_kv_heads,
                c.head_dim, c.ffn_dim, c.vocab_size, c.context_length, c.rope_freq_base, c.rope_dim,
                c.tied_output ? "yes" : "no", l.model->weight_bytes() / 1048576.0,
                static_cast<long long>(c.KvBytesPerToken(4)),
                static_cast<long long>(c.KvBytesPerToken(2)));
    return 0;
  }

  if (*gen) {
    Loaded l = LoadModel(model_path);
    std::string text = prompt;
    bool parse_special = raw_special;
    if (chat) {
      auto tmpl = ChatTemplate::FromGguf(l.model->file());
      if (!tmpl.ok()) Die(tmpl.status());
      std::vector<ChatMessage> msgs;
      if (!system_prompt.empty()) msgs.push_back({"system", system_prompt});
      msgs.push_back({"user", prompt});
      auto rendered = tmpl->Render(msgs, /*add_generation_prompt=*/true);
      if (!rendered.ok()) Die(rendered.status());
      text = *rendered;
      parse_special = true;
    }
    GenerationRequest req;
    req.prompt = l.tokenizer->Encode(text, l.tokenizer->add_bos_default() && !no_bos, parse_special);
    req.params = gen_flags.ToParams();
    BatchGenerator generator(l.model.get(), l.tokenizer.get(), pool, BatchGenerator::Options{});
    GenerationStats stats;
    auto out = generator.Generate(
        {req},
        [&](size_t, std::string_view delta) {
          if (json) return;
          std::fwrite(delta.data(), 1, delta.size(), stdout);
          std::fflush(stdout);
        },
        &stats);
    if (!out.ok()) Die(out.status());
    const GenerationOutput& o = (*out)[0];
    if (json) {
      std::printf("{\"text\":\"%s\",\"finish_reason\":\"%s\",\"prompt_tokens\":%lld,"
                  "\"completion_tokens\":%zu,\"token_ids\":[%s]}\n",
                  JsonEscape(o.text).c_str(), o.finish_reason.c_str(),
                  static_cast<long long>(stats.prompt_tokens), o.tokens.size(),
                  absl::StrJoin(o.tokens, ",").c_str());
    } else {
      std::printf("\n");
    }
    spdlog::info("prompt {} tokens in {:.3f} s ({:.1f} tok/s); generated {} tokens in {:.3f} s "
                 "({:.1f} tok/s); finish: {}",
                 stats.prompt_tokens, stats.prefill_seconds,
                 stats.prompt_tokens / std::max(1e-9, stats.prefill_seconds), o.tokens.size(),
                 stats.decode_seconds,
                 std::max<int64_t>(0, stats.generated_tokens - 1) / std::max(1e-9, stats.decode_seconds),
                 o.finish_reason);
    return 0;
  }

  if (*ppl) {
    Loaded l = LoadModel(model_path);
    const std::string text = ReadFileOrDie(ppl_file);
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    ppl_opts.bos_id = l.tokenizer->add_bos_default() ? l.tokenizer->bos_id() : -1;
    spdlog::info("{}: {} tokens", ppl_file, tokens.size());
    auto r = ComputePerplexity(*l.model, tokens, ppl_opts, pool);
    if (!r.ok()) Die(r.status());
    for (size_t i = 0; i < r->window_perplexity.size(); ++i) {
      std::fprintf(stderr, "[%zu]%.4f ", i + 1, r->window_perplexity[i]);
    }
    std::fprintf(stderr, "\n");
    std::printf("perplexity %.4f over %lld scored tokens in %d windows (context %d, stride %d)\n",
                r->perplexity, static_cast<long long>(r->scored_tokens), r->windows,
                ppl_opts.context, ppl_opts.stride);
    return 0;
  }

  if (*bench) {
    Loaded l = LoadModel(model_path);
    const LlamaConfig& c = l.model->config();
    if (bench_prompt < 1 || bench_gen < 2 || bench_prompt + bench_gen > c.context_length) {
      Die(absl::InvalidArgumentError("need prompt-tokens >= 1, gen-tokens >= 2 and their sum "
                                     "within the context length"));
    }
    std::printf("| batch | prompt tok | gen tok | prefill tok/s | decode tok/s | decode ms/step |\n");
    std::printf("|------:|-----------:|--------:|--------------:|-------------:|---------------:|\n");
    for (int batch : bench_batches) {
      if (batch < 1) continue;
      std::vector<GenerationRequest> reqs(batch);
      for (int i = 0; i < batch; ++i) {
        // Distinct deterministic prompts so no two sequences are identical.
        reqs[i].prompt.resize(bench_prompt);
        for (int j = 0; j < bench_prompt; ++j) {
          reqs[i].prompt[j] = 3 + static_cast<int32_t>((1000003LL * (i + 1) + 7919LL * j) %
                                                       (c.vocab_size - 3));
        }
        reqs[i].params.temperature = 0;
        reqs[i].params.max_tokens = bench_gen;
        reqs[i].params.ignore_eos = true;
      }
      BatchGenerator::Options gopts;
      gopts.max_batched_tokens = std::max(512, bench_prompt);
      BatchGenerator generator(l.model.get(), l.tokenizer.get(), pool, gopts);
      double best_prefill = 0, best_decode = 0, best_step = 1e30;
      for (int rep = 0; rep < std::max(1, bench_reps); ++rep) {
        GenerationStats st;
        auto out = generator.Generate(reqs, nullptr, &st);
        if (!out.ok()) Die(out.status());
        // The first token of each sequence is sampled from the prefill step.
        const int64_t decode_tokens = st.generated_tokens - batch;
        const int64_t decode_steps = bench_gen - 1;
        best_prefill = std::max(best_prefill, st.prompt_tokens / std::max(1e-9, st.prefill_seconds));
        best_decode = std::max(best_decode, decode_tokens / std::max(1e-9, st.decode_seconds));
        best_step = std::min(best_step, 1000.0 * st.decode_seconds / decode_steps);
      }
      std::printf("| %5d | %10d | %7d | %13.1f | %12.1f | %14.2f |\n", batch, bench_prompt,
                  bench_gen, best_prefill, best_decode, best_step);
      std::fflush(stdout);
    }
    return 0;
  }
  return 0;
}
