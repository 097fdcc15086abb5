// `kvserve generate`: completes one prompt (or one chat turn with the model's
// template) on an engine driven by hand on the main thread, streaming the text
// to stdout as it becomes final, or printing one JSON object (--json); the
// --kv-* flags (the daemon's kv-policy defaults) choose its token eviction. The
// events are gathered by the same ResponseAccumulator the daemon's front ends
// use (server/service/completed_response.h).
//
// Thread-safety: runs on the main thread; the engine is stepped here, so its
// event callback runs here too.
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/thread_pool.h"
#include "model/chat_template.h"
#include "model/sampler.h"
#include "scheduler/engine.h"
#include "server/app/command.h"
#include "server/service/completed_response.h"
#include "server/app/engine_builder.h"
#include "server/service/kv_policy.h"
#include "server/app/serve_flags.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

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
    app->add_option("-n,--max-tokens", max_tokens, "Tokens to generate at most")
        ->capture_default_str();
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
    p.logprobs = false;  // the CLI prints no log-probabilities
    return p;
  }
};

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
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

// Runs one request to completion on the caller's thread, streaming text.
CompletedResponse RunOne(Engine& engine, EngineRequest req,
                         const std::function<void(const std::string&)>& on_text) {
  ResponseAccumulator acc(req.n, static_cast<int32_t>(req.prompt.size()));
  auto id = engine.Submit(std::move(req), [&](const SeqEvent& ev) {
    acc.Add(ev);
    if (on_text && !ev.text.empty()) on_text(ev.text);
  });
  if (!id.ok()) Die(id.status());
  while (engine.Step()) {
  }
  return acc.Take();
}

class GenerateCommand final : public Command {
 public:
  GenerateCommand(CLI::App* root, EngineFlags* engine_flags)
      : Command(root->add_subcommand("generate", "Complete a prompt, streaming the text")),
        engine_flags_(engine_flags) {
    app_->add_option("-p,--prompt", prompt_, "Prompt text (or a user message with --chat)")
        ->required();
    app_->add_flag("--chat", chat_,
                   "Wrap the prompt as a user turn with the model's chat template");
    app_->add_option("--system", system_prompt_, "System message for --chat");
    app_->add_flag("--no-bos", no_bos_, "Do not prepend BOS even if the model asks for it");
    app_->add_flag("--special", raw_special_,
                   "Parse special-token text (e.g. <|im_start|>) in the prompt");
    app_->add_flag("--json", json_, "Print one JSON object instead of streaming text");
    sampling_.Add(app_);
    AddKvPolicyFlags(app_, &kv_policy_flags_);
    AddEngineFlags(app_, engine_flags_);
  }

  int Run(const GlobalFlags& global) override {
    // The --kv-* flags are this request's policy, checked as the daemon
    // checks its defaults.
    const KvPolicyDefaults kv_defaults = ValueOrDie(KvPolicyDefaultsFromFlags(kv_policy_flags_));
    LoadedModel l = LoadModelOrDie(global.model_path);
    std::string text = prompt_;
    bool parse_special = raw_special_;
    if (chat_) {
      auto tmpl = ValueOrDie(ChatTemplate::FromGguf(l.model->file()));
      std::vector<ChatMessage> msgs;
      if (!system_prompt_.empty()) msgs.push_back({"system", system_prompt_});
      msgs.push_back({"user", prompt_});
      text = ValueOrDie(tmpl.Render(msgs, /*add_generation_prompt=*/true));
      parse_special = true;
    }
    EngineRequest req;
    req.prompt =
        l.tokenizer->Encode(text, l.tokenizer->add_bos_default() && !no_bos_, parse_special);
    req.params = sampling_.ToParams();
    req.kv_policy = ValueOrDie(ResolveKvPolicy(std::nullopt, kv_defaults));
    const bool kv_policy = req.kv_policy.kind != KvPolicy::Kind::kNone;
    const int64_t prompt_tokens = static_cast<int64_t>(req.prompt.size());
    EngineBuilder builder(*engine_flags_, l.model.get(), l.tokenizer.get());
    std::unique_ptr<Engine> engine = ValueOrDie(builder.Build(&ThreadPool::Global()));
    if (absl::Status s = CheckKvPolicyDefaults(kv_defaults, engine->limits()); !s.ok()) Die(s);
    const auto t0 = std::chrono::steady_clock::now();
    const CompletedResponse r = RunOne(*engine, std::move(req), [&](const std::string& delta) {
      if (json_) return;
      std::fwrite(delta.data(), 1, delta.size(), stdout);
      std::fflush(stdout);
    });
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const CompletedSample& o = r.samples[0];
    if (json_) {
      // dropped_tokens only under a kv policy, so plain output stays as it was.
      const std::string dropped =
          kv_policy ? absl::StrFormat(",\"dropped_tokens\":%d", o.dropped_tokens) : "";
      std::printf(
          "{\"text\":\"%s\",\"finish_reason\":\"%s\",\"prompt_tokens\":%lld,"
          "\"completion_tokens\":%zu,\"token_ids\":[%s]%s}\n",
          JsonEscape(o.text).c_str(), FinishReasonName(o.finish),
          static_cast<long long>(prompt_tokens), o.token_ids.size(),
          absl::StrJoin(o.token_ids, ",").c_str(), dropped.c_str());
    } else {
      std::printf("\n");
    }
    spdlog::info("prompt {} tokens, generated {} tokens in {:.3f} s; finish: {}", prompt_tokens,
                 o.token_ids.size(), secs, FinishReasonName(o.finish));
    return 0;
  }

 private:
  std::string prompt_;
  bool chat_ = false;
  bool json_ = false;
  bool no_bos_ = false;
  bool raw_special_ = false;
  std::string system_prompt_;
  SamplingFlags sampling_;
  KvPolicyFlags kv_policy_flags_;
  EngineFlags* engine_flags_;
};

}  // namespace

std::unique_ptr<Command> NewGenerateCommand(CLI::App* root, EngineFlags* engine_flags) {
  return std::make_unique<GenerateCommand>(root, engine_flags);
}

}  // namespace kvserve
