// kvserve: the engine's command-line entry. Subcommands:
//   generate    complete a prompt (or a chat turn) and stream the text
//   perplexity  perplexity of the model on a text file (any KV dtype)
//   kv-error    error of every KV codec on K/V captured from a real forward
//   bench       prefill and decode throughput at several batch sizes
//   loadtest    a request workload through the continuous-batching scheduler
//   plan        KV memory plan for a model and settings (reads metadata only)
//   info        model hyper-parameters and KV bytes per token
// Issue 4 adds `serve`, the gRPC/HTTP daemon, beside these.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <thread>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
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
#include "kernels/cuda/probe.h"
#include "model/backend.h"
#include "model/chat_template.h"
#include "model/llama.h"
#include "model/perplexity.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "cache/memory_planner.h"
#include "scheduler/engine.h"
#include "server/grpc_server.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/model_service.h"
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
    p.logprobs = false;  // the CLI prints no log-probabilities
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

// KV cache and scheduler settings shared by the subcommands that run the
// engine.
struct EngineFlags {
  int32_t block_size = 16;
  std::string kv_cache_memory = "1GiB";
  std::string kv_cache_dtype = "f16";
  int32_t max_batched_tokens = 512;
  int32_t max_seqs = 64;
  bool static_batching = false;
  bool prefix_cache = true;
  std::string schedule_policy = "fcfs";
  std::string device = "auto";
  // The forward's backend, made once per model (CUDA uploads the weights).
  mutable std::shared_ptr<ForwardBackend> backend;
  mutable const LlamaModel* backend_model = nullptr;

  void Add(CLI::App* app) {
    app->add_option("--device", device,
                    "Where the model and KV cache run: cpu, cuda, or auto (cuda when a GPU is "
                    "usable and supports the KV dtype, else cpu)")
        ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
        ->capture_default_str();
    app->add_option("--block-size", block_size, "Tokens per KV block")->capture_default_str();
    app->add_option("--kv-cache-memory", kv_cache_memory,
                    "KV cache budget: bytes (512MiB, 2GiB) or a fraction of available memory (0.5)")
        ->capture_default_str();
    app->add_option("--kv-cache-dtype", kv_cache_dtype,
                    "KV storage: " + std::string(kernels::KvDTypeList()))->capture_default_str();
    app->add_option("--max-batched-tokens", max_batched_tokens, "Token budget of one engine step")
        ->capture_default_str();
    app->add_option("--max-seqs", max_seqs, "Running sequences at most")->capture_default_str();
    app->add_flag("--static-batching", static_batching,
                  "Admit whole batches; no one joins until all finish (for comparison)");
    app->add_flag("--prefix-cache,!--no-prefix-cache", prefix_cache,
                  "Reuse the KV blocks of cached prompt prefixes (radix prefix cache)")
        ->capture_default_str();
    app->add_option("--schedule-policy", schedule_policy,
                    "Waiting-queue order: fcfs, or lpm (longest cached prefix first)")
        ->capture_default_str();
  }

  kernels::KvDType DType() const {
    kernels::KvDType t;
    if (kernels::ParseKvDType(kv_cache_dtype, &t)) return t;
    Die(absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-dtype must be one of ", std::string(kernels::KvDTypeList()), "; not '",
                     kv_cache_dtype, "'")));
  }

  MemoryPlan Plan(const LlamaConfig& c) const {
    auto budget = ParseMemoryBudget(kv_cache_memory);
    if (!budget.ok()) Die(budget.status());
    auto plan = PlanKvMemory({c.n_layers, c.n_kv_heads, c.head_dim, c.context_length}, block_size,
                             DType(), *budget);
    if (!plan.ok()) Die(plan.status());
    return *plan;
  }

  // Selects the backend (--device; model/backend.cc decides), or dies with
  // the reason: an unusable GPU or a combination it cannot run.
  std::shared_ptr<ForwardBackend> Backend(const Loaded& l) const {
    if (backend == nullptr || backend_model != l.model.get()) {
      auto b = CreateBackend(device, l.model.get(), DType(), block_size);
      if (!b.ok()) Die(b.status());
      backend = std::move(b).value();
      backend_model = l.model.get();
      spdlog::info("device: {} (--device {})", backend->name(), device);
    }
    return backend;
  }

  // Plans the KV memory, logs the plan, and creates the engine.
  std::unique_ptr<Engine> MakeEngine(const Loaded& l, ThreadPool* pool,
                                     KvEventSink* kv_events = nullptr,
                                     std::string model_identity = "") const {
    const MemoryPlan plan = Plan(l.model->config());
    spdlog::info("KV cache ({}): {} bytes/token, {} bytes/block of {} tokens, {} blocks, "
                 "{} tokens, {} sequences of the full context",
                 kv_cache_dtype, plan.kv_bytes_per_token, plan.block_bytes, plan.block_size,
                 plan.num_blocks, plan.token_capacity, plan.full_context_sequences);
    EngineOptions o;
    o.block_size = block_size;
    o.num_blocks = static_cast<int32_t>(std::min<int64_t>(plan.num_blocks, 1 << 30));
    o.kv_dtype = DType();
    o.max_batched_tokens = max_batched_tokens;
    o.max_seqs = max_seqs;
    o.static_batching = static_batching;
    o.prefix_cache = prefix_cache;
    auto policy = ParseSchedulePolicy(schedule_policy);
    if (!policy.ok()) Die(absl::InvalidArgumentError(absl::StrCat("--schedule-policy: ", policy.status().message())));
    o.schedule_policy = *policy;
    o.kv_events = kv_events;
    o.model_identity = std::move(model_identity);
    o.backend = Backend(l);
    auto e = Engine::Create(l.model.get(), l.tokenizer.get(), pool, o);
    if (!e.ok()) Die(e.status());
    return std::move(e).value();
  }
};

// Runs one request to completion on the caller's thread, streaming text.
struct GenerateResult {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::kNone;
};
GenerateResult RunOne(Engine& engine, EngineRequest req,
                      const std::function<void(const std::string&)>& on_text) {
  GenerateResult r;
  auto id = engine.Submit(std::move(req), [&](const SeqEvent& ev) {
    r.tokens.insert(r.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
    r.text += ev.text;
    if (on_text && !ev.text.empty()) on_text(ev.text);
    if (ev.finish != FinishReason::kNone) r.finish = ev.finish;
  });
  if (!id.ok()) Die(id.status());
  while (engine.Step()) {
  }
  return r;
}

// Daemon settings.
struct ServeFlags {
  std::string grpc_address = "127.0.0.1:50051";
  std::string http_host = "127.0.0.1";
  int http_port = 8000;
  std::string port_file;
  std::string api_key;
  std::string api_key_file;
  std::string tls_cert;
  std::string tls_key;
  int32_t max_queued = 1024;
  int64_t max_request_bytes = 1 << 20;
  double drain_timeout = 30;
  std::string served_model_name;
  int32_t max_n = 8;
  int32_t default_max_tokens = 256;
  int64_t kv_events_retain = 65536;

  void Add(CLI::App* app) {
    app->add_option("--grpc-address", grpc_address, "gRPC listen address (port 0: any free port)")
        ->capture_default_str();
    app->add_option("--http-host", http_host, "HTTP listen host")->capture_default_str();
    app->add_option("--http-port", http_port, "HTTP listen port (0: any free port)")
        ->capture_default_str();
    app->add_option("--port-file", port_file,
                    "Write {\"grpc\": N, \"http\": M} here once listening");
    app->add_option("--api-key", api_key, "Require this key (HTTP Bearer, gRPC metadata)");
    app->add_option("--api-key-file", api_key_file, "Read the API key from a file");
    app->add_option("--tls-cert", tls_cert, "PEM certificate: serve TLS (with --tls-key)");
    app->add_option("--tls-key", tls_key, "PEM private key");
    app->add_option("--max-queued", max_queued, "Waiting requests before RESOURCE_EXHAUSTED / 429")
        ->capture_default_str();
    app->add_option("--max-request-bytes", max_request_bytes, "Largest HTTP body (413 above)")
        ->capture_default_str();
    app->add_option("--drain-timeout", drain_timeout,
                    "Seconds in-flight requests get to finish on SIGTERM/SIGINT")
        ->capture_default_str();
    app->add_option("--served-model-name", served_model_name,
                    "Model id clients use (default: the file name without .gguf)");
    app->add_option("--max-n", max_n, "Samples per request at most")->capture_default_str();
    app->add_option("--default-max-tokens", default_max_tokens,
                    "max_tokens when a request gives none")->capture_default_str();
    app->add_option("--kv-events-retain", kv_events_retain,
                    "KV events kept for reconnecting subscribers (0: no event stream)")
        ->capture_default_str();
  }
};

// Every long option can also come from KVSERVE_<NAME> (--kv-cache-memory:
// KVSERVE_KV_CACHE_MEMORY); command-line flags win over the environment.
void SetEnvNames(CLI::App* app) {
  for (CLI::Option* opt : app->get_options()) {
    if (opt->get_lnames().empty() || opt->get_lnames()[0] == "help" ||
        opt->get_lnames()[0] == "config" || !opt->get_envname().empty()) {
      continue;
    }
    std::string env = "KVSERVE_" + opt->get_lnames()[0];
    for (char& ch : env) ch = ch == '-' ? '_' : static_cast<char>(std::toupper(ch));
    opt->envname(env);
  }
  for (CLI::App* sub : app->get_subcommands({})) SetEnvNames(sub);
}

std::string MaskSecrets(std::string config) {
  std::stringstream in(config), out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("api-key") != std::string::npos && line.find('=') != std::string::npos &&
        line.find("api-key-file") == std::string::npos) {
      line = line.substr(0, line.find('=') + 1) + " \"***\"";
    }
    out << line << "\n";
  }
  return out.str();
}

int RunServer(const Loaded& l, const std::string& model_path, const ServeFlags& f,
              const EngineFlags& engine_flags, ThreadPool* pool) {
  std::string api_key = f.api_key;
  if (!f.api_key_file.empty()) {
    api_key = ReadFileOrDie(f.api_key_file);
    while (!api_key.empty() && std::isspace(static_cast<unsigned char>(api_key.back()))) api_key.pop_back();
    if (api_key.empty()) Die(absl::InvalidArgumentError("--api-key-file is empty"));
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    Die(absl::InvalidArgumentError("--tls-cert and --tls-key go together"));
  }
  std::string name = f.served_model_name;
  if (name.empty()) {
    name = model_path.substr(model_path.find_last_of('/') + 1);
    if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
  }
  std::optional<ChatTemplate> chat;
  if (auto t = ChatTemplate::FromGguf(l.model->file()); t.ok()) {
    chat = *t;
  } else {
    spdlog::warn("chat disabled: {}", t.status().ToString());
  }
  if (f.kv_events_retain < 0) Die(absl::InvalidArgumentError("--kv-events-retain must be >= 0"));
  std::unique_ptr<KvEventLog> kv_events;
  if (f.kv_events_retain > 0 && engine_flags.prefix_cache) {
    kv_events = std::make_unique<KvEventLog>(static_cast<size_t>(f.kv_events_retain));
  }
  // Cached blocks are only valid for the weights that computed them. The
  // file's name and size stand for its identity: stable across restarts and
  // across replicas serving the same file, so routers see the same hashes.
  std::string identity = model_path.substr(model_path.find_last_of('/') + 1);
  {
    std::error_code ec;
    const auto size = std::filesystem::file_size(model_path, ec);
    absl::StrAppend(&identity, "/", ec ? 0 : size);
  }
  std::unique_ptr<Engine> engine = engine_flags.MakeEngine(l, pool, kv_events.get(), identity);
  Metrics metrics(name);
  ServiceLimits limits;
  limits.max_queued = f.max_queued;
  limits.max_n = f.max_n;
  limits.default_max_tokens = f.default_max_tokens;
  ModelService service(name, l.model.get(), l.tokenizer.get(), chat, engine.get(), limits, &metrics);
  service.set_kv_events(kv_events.get());
  engine->Start();

  GrpcServerOptions go;
  go.address = f.grpc_address;
  go.api_key = api_key;
  go.tls_cert = f.tls_cert;
  go.tls_key = f.tls_key;
  auto grpc = GrpcServer::Start(&service, go);
  if (!grpc.ok()) Die(grpc.status());
  HttpServerOptions ho;
  ho.host = f.http_host;
  ho.port = f.http_port;
  ho.api_key = api_key;
  ho.tls_cert = f.tls_cert;
  ho.tls_key = f.tls_key;
  ho.max_request_bytes = f.max_request_bytes;
  auto http = HttpServer::Start(&service, ho);
  if (!http.ok()) Die(http.status());
  spdlog::info("serving '{}': gRPC on {} (port {}), HTTP on {}:{}{}", name, f.grpc_address,
               (*grpc)->port(), f.http_host, (*http)->port(),
               api_key.empty() ? "" : ", API key required");
  if (!f.port_file.empty()) {
    const std::string tmp = f.port_file + ".tmp";
    std::ofstream(tmp) << "{\"grpc\": " << (*grpc)->port() << ", \"http\": " << (*http)->port()
                       << "}\n";
    std::rename(tmp.c_str(), f.port_file.c_str());
  }

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("{}: draining ({} in flight, {:.0f} s to finish)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
               service.in_flight(), f.drain_timeout);
  // New requests are refused from here on; in-flight ones may finish.
  service.BeginDrain();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(f.drain_timeout * 1000));
  while (service.in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (service.in_flight() > 0) {
    spdlog::warn("drain timeout: cancelling {} requests", service.in_flight());
    service.CancelAll();
    const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (service.in_flight() > 0 && std::chrono::steady_clock::now() < grace) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  // Subscribers' streams end first so the gRPC shutdown does not wait on them.
  if (kv_events) kv_events->Close();
  (*grpc)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  (*http)->Stop();
  engine->Stop();
  spdlog::info("stopped");
  return 0;
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
  ppl->add_option("--block-size", ppl_opts.block_size, "Tokens per KV block")->capture_default_str();
  std::string ppl_kv_dtype = "f32";
  ppl->add_option("--kv-cache-dtype", ppl_kv_dtype,
                  "KV storage while scoring: " + std::string(kernels::KvDTypeList()))
      ->capture_default_str();
  std::string ppl_compare_dtype;
  ppl->add_option("--compare-kv-dtype", ppl_compare_dtype,
                  "Also run with this KV dtype; report same-top-1 fraction and mean KL");

  // kv-error
  auto* kverr = app.add_subcommand(
      "kv-error", "Error of every KV codec and granularity on K/V captured from a real forward");
  std::string kverr_file;
  int32_t kverr_context = 512;
  kverr->add_option("-f,--file", kverr_file, "Plain text file")->required();
  kverr->add_option("-c,--context", kverr_context, "Tokens to run")->capture_default_str();

  // bench
  auto* bench = app.add_subcommand("bench", "Prefill and decode throughput at several batch sizes");
  std::vector<int> bench_batches = {1, 8, 32};
  int bench_prompt = 128, bench_gen = 64, bench_reps = 1;
  bench->add_option("-b,--batch", bench_batches, "Batch sizes")->delimiter(',')->capture_default_str();
  bench->add_option("--prompt-tokens", bench_prompt, "Prompt length per sequence")->capture_default_str();
  bench->add_option("--gen-tokens", bench_gen, "Generated tokens per sequence")->capture_default_str();
  bench->add_option("--repeat", bench_reps, "Runs per batch size (best is reported)")->capture_default_str();

  // loadtest
  auto* load = app.add_subcommand(
      "loadtest", "A mixed-length request workload through the continuous-batching scheduler");
  std::vector<int> load_conc = {1, 4, 16, 32, 64};
  int load_requests = 0, load_pmin = 16, load_pmax = 256, load_gmin = 16, load_gmax = 128;
  int64_t load_seed = 1;
  bool load_compare_static = false;
  load->add_option("-c,--concurrency", load_conc, "Requests in flight (closed loop); a sweep")
      ->delimiter(',')->capture_default_str();
  load->add_option("--requests", load_requests, "Requests per run (0 = 2 x concurrency, >= 16)")
      ->capture_default_str();
  load->add_option("--prompt-min", load_pmin)->capture_default_str();
  load->add_option("--prompt-max", load_pmax)->capture_default_str();
  load->add_option("--gen-min", load_gmin)->capture_default_str();
  load->add_option("--gen-max", load_gmax)->capture_default_str();
  load->add_option("--seed", load_seed, "Workload seed")->capture_default_str();
  load->add_flag("--compare-static", load_compare_static,
                 "Run every point with continuous and with static batching");

  // plan
  auto* plan_cmd = app.add_subcommand(
      "plan", "KV memory plan for a model and settings (reads metadata, not weights)");

  EngineFlags engine_flags;
  for (CLI::App* sub : {gen, bench, load, plan_cmd}) engine_flags.Add(sub);

  auto* info = app.add_subcommand("info", "Model hyper-parameters and KV bytes per token");

  auto* probe = app.add_subcommand(
      "probe", "GPU memory bandwidth: device copy and pinned host<->device (needs CUDA)");
  int64_t probe_mib = 1024;
  int probe_iters = 10;
  probe->add_option("--mib", probe_mib, "MiB per copy")->capture_default_str();
  probe->add_option("--iters", probe_iters, "timed copies each way (best is reported)")
      ->capture_default_str();

  // serve
  auto* serve = app.add_subcommand("serve", "Run the daemon: gRPC and OpenAI-compatible HTTP");
  ServeFlags serve_flags;
  serve_flags.Add(serve);
  engine_flags.Add(serve);
  std::string log_format = "text";
  app.add_option("--log-format", log_format, "text or json")->capture_default_str();
  app.set_config("--config", "", "Read options from a TOML/INI file (flags override it)");
  SetEnvNames(&app);

  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (log_format == "json") {
    spdlog::set_pattern(R"({"time":"%Y-%m-%dT%H:%M:%S.%e","level":"%l","msg":"%v"})");
  } else if (log_format != "text") {
    Die(absl::InvalidArgumentError("--log-format must be text or json"));
  }
  if (*serve) {
    // SIGTERM/SIGINT are taken by sigwait in the main thread: block them
    // before any thread exists so every thread inherits the mask.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    spdlog::info("configuration:\n{}", MaskSecrets(app.config_to_str(true, false)));
  }
  SetThreads(threads);

  if (*serve) {
    Loaded l = LoadModel(model_path);
    return RunServer(l, model_path, serve_flags, engine_flags, &ThreadPool::Global());
  }
  ThreadPool* pool = &ThreadPool::Global();

  if (*probe) {
    if (probe_mib < 1 || probe_iters < 1) {
      Die(absl::InvalidArgumentError("--mib and --iters must be >= 1"));
    }
    auto r = cuda::ProbeBandwidth(static_cast<size_t>(probe_mib) << 20, probe_iters);
    if (!r.ok()) Die(r.status());
    std::printf("%s", cuda::FormatBandwidthReport(*r).c_str());
    return 0;
  }

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
    // Per codec, scales included (the pool's own formula, per token of a
    // 16-token block: int4-kivi's key scales are per block).
    std::printf("KV bytes/token by --kv-cache-dtype:");
    for (kernels::KvDType t : kernels::kAllKvDTypes) {
      const int64_t bytes =
          2 * c.n_layers * kernels::PagedKvView::HalfLayerBytes(16, c.n_kv_heads, c.head_dim, t) /
          16;
      std::printf(" %s %lld", std::string(kernels::KvDTypeName(t)).c_str(),
                  static_cast<long long>(bytes));
    }
    std::printf("\n");
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
    EngineRequest req;
    req.prompt = l.tokenizer->Encode(text, l.tokenizer->add_bos_default() && !no_bos, parse_special);
    req.params = gen_flags.ToParams();
    const int64_t prompt_tokens = static_cast<int64_t>(req.prompt.size());
    std::unique_ptr<Engine> engine = engine_flags.MakeEngine(l, pool);
    const auto t0 = std::chrono::steady_clock::now();
    GenerateResult o = RunOne(*engine, std::move(req), [&](const std::string& delta) {
      if (json) return;
      std::fwrite(delta.data(), 1, delta.size(), stdout);
      std::fflush(stdout);
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (json) {
      std::printf("{\"text\":\"%s\",\"finish_reason\":\"%s\",\"prompt_tokens\":%lld,"
                  "\"completion_tokens\":%zu,\"token_ids\":[%s]}\n",
                  JsonEscape(o.text).c_str(), FinishReasonName(o.finish),
                  static_cast<long long>(prompt_tokens), o.tokens.size(),
                  absl::StrJoin(o.tokens, ",").c_str());
    } else {
      std::printf("\n");
    }
    spdlog::info("prompt {} tokens, generated {} tokens in {:.3f} s; finish: {}", prompt_tokens,
                 o.tokens.size(), secs, FinishReasonName(o.finish));
    return 0;
  }

  if (*kverr) {
    Loaded l = LoadModel(model_path);
    const std::string text = ReadFileOrDie(kverr_file);
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    auto rows = ComputeKvError(*l.model, tokens, kverr_context, pool);
    if (!rows.ok()) Die(rows.status());
    std::printf("| codec | granularity | K MSE | K max abs | K cosine | V MSE | V max abs | V cosine |\n"
                "|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (const KvErrorRow& r : *rows) {
      std::printf("| %s | %s | %.3g | %.3g | %.6f | %.3g | %.3g | %.6f |\n", r.codec.c_str(),
                  r.granularity.c_str(), r.k_mse, r.k_max_abs, r.k_cosine, r.v_mse, r.v_max_abs,
                  r.v_cosine);
    }
    return 0;
  }

  if (*ppl) {
    Loaded l = LoadModel(model_path);
    const std::string text = ReadFileOrDie(ppl_file);
    std::vector<int32_t> tokens = l.tokenizer->Encode(text, l.tokenizer->add_bos_default(), false);
    ppl_opts.bos_id = l.tokenizer->add_bos_default() ? l.tokenizer->bos_id() : -1;
    if (!kernels::ParseKvDType(ppl_kv_dtype, &ppl_opts.kv_dtype)) {
      Die(absl::InvalidArgumentError(
          absl::StrCat("--kv-cache-dtype: unknown KV dtype '", ppl_kv_dtype, "'")));
    }
    ppl_opts.compare = !ppl_compare_dtype.empty();
    if (ppl_opts.compare && !kernels::ParseKvDType(ppl_compare_dtype, &ppl_opts.compare_dtype)) {
      Die(absl::InvalidArgumentError(
          absl::StrCat("--compare-kv-dtype: unknown KV dtype '", ppl_compare_dtype, "'")));
    }
    spdlog::info("{}: {} tokens", ppl_file, tokens.size());
    auto r = ComputePerplexity(*l.model, tokens, ppl_opts, pool);
    if (!r.ok()) Die(r.status());
    for (size_t i = 0; i < r->window_perplexity.size(); ++i) {
      std::fprintf(stderr, "[%zu]%.4f ", i + 1, r->window_perplexity[i]);
    }
    std::fprintf(stderr, "\n");
    std::printf(
        "perplexity %.4f over %lld scored tokens in %d windows (context %d, stride %d, kv %s)\n",
        r->perplexity, static_cast<long long>(r->scored_tokens), r->windows, ppl_opts.context,
        ppl_opts.stride, ppl_kv_dtype.c_str());
    if (ppl_opts.compare) {
      std::printf("vs %s: same top-1 token %.2f%%, mean KL %.5f nats\n", ppl_compare_dtype.c_str(),
                  100.0 * r->same_top1, r->mean_kl);
    }
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
      EngineFlags flags = engine_flags;
      flags.max_seqs = std::max(flags.max_seqs, batch);
      flags.max_batched_tokens = std::max(flags.max_batched_tokens, bench_prompt);
      double best_prefill = 0, best_decode = 0, best_step = 1e30;
      for (int rep = 0; rep < std::max(1, bench_reps); ++rep) {
        std::unique_ptr<Engine> engine = flags.MakeEngine(l, pool);
        for (int i = 0; i < batch; ++i) {
          // Distinct deterministic prompts so no two sequences are identical.
          EngineRequest r;
          r.prompt.resize(bench_prompt);
          for (int j = 0; j < bench_prompt; ++j) {
            r.prompt[j] = 3 + static_cast<int32_t>((1000003LL * (i + 1) + 7919LL * j) %
                                                   (c.vocab_size - 3));
          }
          r.params.temperature = 0;
          r.params.max_tokens = bench_gen;
          r.params.ignore_eos = true;
          if (!engine->Submit(std::move(r), [](const SeqEvent&) {}).ok()) Die(absl::InternalError("submit"));
        }
        // Steps that carry prompt tokens are prefill; the rest decode.
        double prefill_s = 0, decode_s = 0;
        int64_t decode_steps = 0, decode_tokens = 0;
        for (;;) {
          const auto t0 = std::chrono::steady_clock::now();
          if (!engine->Step()) break;
          const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          const EngineStats st = engine->Stats();
          if (st.last_batch_tokens > st.last_batch_seqs) {
            prefill_s += dt;
          } else if (st.last_batch_tokens > 0) {
            decode_s += dt;
            ++decode_steps;
            decode_tokens += st.last_batch_tokens;
          }
        }
        best_prefill = std::max(best_prefill, batch * bench_prompt / std::max(1e-9, prefill_s));
        best_decode = std::max(best_decode, decode_tokens / std::max(1e-9, decode_s));
        best_step = std::min(best_step, 1000.0 * decode_s / std::max<int64_t>(1, decode_steps));
      }
      std::printf("| %5d | %10d | %7d | %13.1f | %12.1f | %14.2f |\n", batch, bench_prompt,
                  bench_gen, best_prefill, best_decode, best_step);
      std::fflush(stdout);
    }
    return 0;
  }

  if (*plan_cmd) {
    auto file = GgufFile::Open(model_path);
    if (!file.ok()) Die(file.status());
    auto cfg = LlamaConfig::FromGguf(**file);
    if (!cfg.ok()) Die(cfg.status());
    std::printf("model           %s (%s)\n", model_path.c_str(), cfg->name.c_str());
    const MemoryPlan plan = engine_flags.Plan(*cfg);  // dies on a bad dtype or budget
    std::printf("kv dtype        %s\n", engine_flags.kv_cache_dtype.c_str());
    std::printf("%s", plan.ToString().c_str());
    return 0;
  }

  if (*load) {
    Loaded l = LoadModel(model_path);
    const LlamaConfig& c = l.model->config();
    if (load_pmin < 1 || load_pmax < load_pmin || load_gmin < 1 || load_gmax < load_gmin ||
        load_pmax + load_gmax > c.context_length) {
      Die(absl::InvalidArgumentError("need 1 <= prompt-min <= prompt-max, 1 <= gen-min <= "
                                     "gen-max, prompt-max + gen-max within the context"));
    }
    std::printf("| mode | conc | requests | out tok/s | mean latency s | mean TTFT s | slot eff | "
                "contig (req max) | contig (ctx) | preempt |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int conc : load_conc) {
      if (conc < 1) continue;
      const int n_req = load_requests > 0 ? load_requests : std::max(16, 2 * conc);
      // The same workload for every mode: lengths drawn from the seed.
      std::mt19937_64 rng(static_cast<uint64_t>(load_seed));
      std::vector<EngineRequest> work(n_req);
      for (auto& r : work) {
        const int plen = load_pmin + static_cast<int>(rng() % (load_pmax - load_pmin + 1));
        r.prompt.resize(plen);
        for (auto& t : r.prompt) t = 3 + static_cast<int32_t>(rng() % (c.vocab_size - 3));
        r.params.temperature = 0;
        r.params.ignore_eos = true;
        r.params.max_tokens = load_gmin + static_cast<int>(rng() % (load_gmax - load_gmin + 1));
      }
      for (bool is_static : {false, true}) {
        if (is_static && !load_compare_static) continue;
        EngineFlags flags = engine_flags;
        flags.static_batching = is_static;
        flags.max_seqs = conc;
        std::unique_ptr<Engine> engine = flags.MakeEngine(l, pool);
        std::mutex mu;
        std::condition_variable cv;
        int next = 0, done = 0;
        int64_t out_tokens = 0;
        double sum_latency = 0, sum_ttft = 0;
        std::vector<std::chrono::steady_clock::time_point> start(n_req);
        std::vector<bool> got_first(n_req, false);
        auto on_event = [&](int i, const SeqEvent& ev) {
          std::lock_guard<std::mutex> lock(mu);
          const auto now = std::chrono::steady_clock::now();
          if (!ev.token_ids.empty() && !got_first[i]) {
            got_first[i] = true;
            sum_ttft += std::chrono::duration<double>(now - start[i]).count();
          }
          out_tokens += static_cast<int64_t>(ev.token_ids.size());
          if (ev.finish != FinishReason::kNone) {
            sum_latency += std::chrono::duration<double>(now - start[i]).count();
            ++done;
            cv.notify_all();
          }
        };
        const auto t0 = std::chrono::steady_clock::now();
        engine->Start();
        std::unique_lock<std::mutex> lock(mu);
        while (done < n_req) {
          // Closed loop: keep `conc` requests in flight.
          while (next < n_req && next - done < conc) {
            const int i = next++;
            start[i] = std::chrono::steady_clock::now();
            lock.unlock();
            auto id = engine->Submit(work[i], [&, i](const SeqEvent& ev) { on_event(i, ev); });
            if (!id.ok()) Die(id.status());
            lock.lock();
          }
          cv.wait(lock, [&] { return done == n_req || (next < n_req && next - done < conc); });
        }
        lock.unlock();
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        engine->Stop();
        const EngineStats st = engine->Stats();
        std::printf("| %s | %d | %d | %.1f | %.2f | %.3f | %.1f%% | %.1f%% | %.1f%% | %lld |\n",
                    is_static ? "static" : "continuous", conc, n_req, out_tokens / wall,
                    sum_latency / n_req, sum_ttft / n_req, 100 * st.mean_slot_efficiency,
                    100 * st.mean_contiguous_request_efficiency,
                    100 * st.mean_contiguous_context_efficiency,
                    static_cast<long long>(st.preemptions));
        std::fflush(stdout);
      }
    }
    return 0;
  }

  return 0;
}
