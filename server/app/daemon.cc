// The implementation of Daemon. What it owns and how it is used: the
// opening paragraph of server/app/daemon.h.

#include "server/app/daemon.h"

#include <pthread.h>
#include <signal.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "cache/memory_planner.h"
#include "common/status.h"
#include "model/chat_template.h"
#include "server/app/engine_builder.h"
#include "httplib.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

sigset_t ShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

// Cached blocks are only valid for the weights that computed them. The
// file's name and size stand for its identity: stable across restarts and
// across replicas serving the same file, so routers see the same hashes.
std::string ModelIdentity(const std::string& model_path) {
  std::string identity = model_path.substr(model_path.find_last_of('/') + 1);
  std::error_code ec;
  const auto size = std::filesystem::file_size(model_path, ec);
  absl::StrAppend(&identity, "/", ec ? 0 : size);
  return identity;
}

}  // namespace

absl::StatusOr<std::string> ApiKeyFromFlags(const ServeFlags& f) {
  std::string api_key = f.api_key;
  if (!f.api_key_file.empty()) {
    ASSIGN_OR_RETURN(api_key, ReadFileToString(f.api_key_file));
    while (!api_key.empty() && std::isspace(static_cast<unsigned char>(api_key.back()))) {
      api_key.pop_back();
    }
    if (api_key.empty()) return absl::InvalidArgumentError("--api-key-file is empty");
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  return api_key;
}

std::string ServedModelName(const ServeFlags& f, const std::string& model_path) {
  std::string name = f.served_model_name;
  if (name.empty()) {
    name = model_path.substr(model_path.find_last_of('/') + 1);
    if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
  }
  return name;
}

absl::StatusOr<ServiceLimits> ServiceLimitsFromFlags(const ServeFlags& f) {
  ServiceLimits limits;
  limits.max_queued = f.max_queued;
  limits.max_n = f.max_n;
  limits.default_max_tokens = f.default_max_tokens;
  ASSIGN_OR_RETURN(limits.kv_policy, KvPolicyDefaultsFromFlags(f.kv_policy));
  return limits;
}

absl::StatusOr<ResponseCacheOptions> ResponseCacheOptionsFromFlags(const ServeFlags& f) {
  ResponseCacheOptions o;
  // "0" is the off switch (ParseMemoryBudget wants a positive budget).
  const absl::string_view text = absl::StripAsciiWhitespace(f.response_cache_bytes);
  if (text == "0") return o;
  absl::StatusOr<int64_t> bytes = ParseMemoryBudget(f.response_cache_bytes);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--response-cache-bytes: ", bytes.status().message()));
  }
  o.max_bytes = *bytes;
  if (!(f.response_cache_ttl >= 0) || f.response_cache_ttl > 1e9) {
    return absl::InvalidArgumentError("--response-cache-ttl must be seconds >= 0 (0: no expiry)");
  }
  o.ttl_ns = static_cast<int64_t>(f.response_cache_ttl * 1e9);
  return o;
}

GrpcServerOptions GrpcOptionsFromFlags(const ServeFlags& f, const std::string& api_key) {
  GrpcServerOptions o;
  o.address = f.grpc_address;
  o.api_key = api_key;
  o.tls_cert = f.tls_cert;
  o.tls_key = f.tls_key;
  return o;
}

HttpServerOptions HttpOptionsFromFlags(const ServeFlags& f, const std::string& api_key) {
  HttpServerOptions o;
  o.host = f.http_host;
  o.port = f.http_port;
  o.api_key = api_key;
  o.tls_cert = f.tls_cert;
  o.tls_key = f.tls_key;
  o.max_request_bytes = f.max_request_bytes;
  o.io_threads = f.http_threads;
  o.max_connections = f.max_connections;
  o.max_header_bytes = f.http_max_header_bytes;
  o.metrics_without_key = f.metrics_auth == "none";
  auto ms = [](double seconds) {
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  };
  o.idle_timeout = ms(f.http_idle_timeout);
  o.header_timeout = ms(f.http_header_timeout);
  o.body_timeout = ms(f.http_body_timeout);
  o.write_timeout = ms(f.http_write_timeout);
  return o;
}

struct LoadingProbes::Impl {
  std::unique_ptr<httplib::Server> http;
  std::thread http_thread;
  std::unique_ptr<grpc::Server> grpc;
};

std::unique_ptr<LoadingProbes> LoadingProbes::Start(const ServeFlags& f) {
  std::unique_ptr<LoadingProbes> p(new LoadingProbes());
  p->impl_ = std::make_unique<Impl>();
  Impl& m = *p->impl_;
  if (f.http_port != 0) {
    if (f.tls_cert.empty()) {
      m.http = std::make_unique<httplib::Server>();
    } else {
      m.http = std::make_unique<httplib::SSLServer>(f.tls_cert.c_str(), f.tls_key.c_str());
    }
    m.http->Get("/health/live", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("alive", "text/plain");
    });
    m.http->set_error_handler([](const httplib::Request&, httplib::Response& res) {
      if (res.status == 404 || res.status == 405) res.status = 503;
      res.set_content("loading", "text/plain");
    });
    if (m.http->is_valid() && m.http->bind_to_port(f.http_host, f.http_port)) {
      m.http_thread = std::thread([server = m.http.get()] { server->listen_after_bind(); });
      spdlog::info("while loading: HTTP {}:{} answers /health 503, /health/live 200", f.http_host,
                   f.http_port);
    } else {
      spdlog::warn("while loading: cannot listen on {}:{} for health probes", f.http_host,
                   f.http_port);
      m.http.reset();
    }
  }
  const bool ephemeral = absl::EndsWith(f.grpc_address, ":0");
  if (!ephemeral && f.tls_cert.empty()) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(f.grpc_address, grpc::InsecureServerCredentials(), &port);
    m.grpc = builder.BuildAndStart();
    if (m.grpc != nullptr && port != 0) {
      if (grpc::HealthCheckServiceInterface* health = m.grpc->GetHealthCheckService()) {
        health->SetServingStatus(false);
        health->SetServingStatus("kvserve.v1.Kvserve", false);
      }
      spdlog::info("while loading: gRPC health on {} reports NOT_SERVING", f.grpc_address);
    } else {
      spdlog::warn("while loading: cannot listen on {} for gRPC health", f.grpc_address);
      m.grpc.reset();
    }
  }
  return p;
}

LoadingProbes::~LoadingProbes() { Stop(); }

void LoadingProbes::Stop() {
  if (impl_ == nullptr) return;
  if (impl_->grpc) impl_->grpc->Shutdown(std::chrono::system_clock::now());
  if (impl_->http) impl_->http->stop();
  if (impl_->http_thread.joinable()) impl_->http_thread.join();
  impl_.reset();
}

void Daemon::BlockShutdownSignals() {
  const sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const LoadedModel& l,
                                                      const std::string& model_path,
                                                      const ServeFlags& f,
                                                      const EngineFlags& engine_flags,
                                                      ThreadPool* pool, LoadingProbes* probes) {
  std::unique_ptr<Daemon> d(new Daemon());
  d->flags_ = f;
  ASSIGN_OR_RETURN(const std::string api_key, ApiKeyFromFlags(f));
  const std::string name = ServedModelName(f, model_path);
  std::optional<ChatTemplate> chat;
  if (!f.chat_template_file.empty()) {
    std::ifstream in(f.chat_template_file, std::ios::binary);
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("--chat-template: cannot read ", f.chat_template_file));
    }
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<ChatTemplate> t = ChatTemplate::FromGgufWithTemplate(l.model->file(), text.str());
    if (!t.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--chat-template ", f.chat_template_file, ": ",
                                                     t.status().message()));
    }
    chat = *std::move(t);
  } else if (auto t = ChatTemplate::FromGguf(l.model->file()); t.ok()) {
    chat = *t;
  } else {
    spdlog::warn("chat disabled: {}; chat requests are refused, --chat-template FILE supplies a "
                 "template",
                 std::string(t.status().message()));
  }
  if (f.kv_events_retain < 0) {
    return absl::InvalidArgumentError("--kv-events-retain must be >= 0");
  }
  if (f.kv_events_retain > 0 && engine_flags.prefix_cache) {
    d->kv_events_ = std::make_unique<KvEventLog>(static_cast<size_t>(f.kv_events_retain));
  }
  if (d->kv_events_ == nullptr &&
      (!f.kv_events_endpoint.empty() || !f.kv_events_replay_endpoint.empty())) {
    return absl::InvalidArgumentError(
        "--kv-events-endpoint needs the KV event log: the prefix cache on and "
        "--kv-events-retain > 0");
  }
  if (f.kv_events_endpoint.empty() && !f.kv_events_replay_endpoint.empty()) {
    return absl::InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint");
  }
  if (f.kv_events_replay_batches < 1) {
    return absl::InvalidArgumentError("--kv-events-replay-batches must be >= 1");
  }
  // Checked before the engine is built (a typo should not wait for the KV
  // plan), and against the engine once it is.
  ASSIGN_OR_RETURN(const ServiceLimits limits, ServiceLimitsFromFlags(f));
  // Cache control: tenant keys, retention budgets (docs/cache-control.md).
  CacheControlOptions cco;
  {
    absl::StatusOr<int64_t> budget = ParseMemoryBudget(f.cache_retain_budget);
    if (!budget.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cache-retain-budget: ", budget.status().message()));
    }
    cco.default_tenant_budget_bytes = *budget;
  }
  if (!(f.cache_retain_max_fraction >= 0 && f.cache_retain_max_fraction <= 1)) {
    return absl::InvalidArgumentError("--cache-retain-max-fraction must be in [0, 1]");
  }
  if (!(f.cache_retain_max_ttl > 0)) {
    return absl::InvalidArgumentError("--cache-retain-max-ttl must be > 0 seconds");
  }
  cco.max_pool_fraction = f.cache_retain_max_fraction;
  cco.max_ttl_s = f.cache_retain_max_ttl;
  if (!f.api_keys_file.empty()) {
    ASSIGN_OR_RETURN(TenantKeys keys, TenantKeys::FromFile(f.api_keys_file));
    cco.tenant_budgets = keys.budgets();
    d->tenant_keys_ = std::make_shared<const TenantKeys>(std::move(keys));
    spdlog::info("tenant keys: {} keys from {}; prefix-cache scopes derived per tenant",
                 d->tenant_keys_->size(), f.api_keys_file);
  }
  std::shared_ptr<CacheControl> cache_control;
  if (engine_flags.prefix_cache) cache_control = std::make_shared<CacheControl>(cco);
  EngineBuilder builder(engine_flags, l.model.get(), l.tokenizer.get());
  // Prefill/decode disaggregation (server/pd/pd_node.h): a decode node's engine
  // loads leased KV through the node's KvLoader.
  ASSIGN_OR_RETURN(const std::string pd_fingerprint,
                   ModelFingerprint(model_path, int64_t{64} << 20));
  ASSIGN_OR_RETURN(d->pd_, PdNode::Create(f.pd, pd_fingerprint, api_key));
  ASSIGN_OR_RETURN(d->engine_, builder.Build(pool, d->kv_events_.get(), ModelIdentity(model_path),
                                             cache_control, d->pd_->kv_loader()));
  RETURN_IF_ERROR(CheckKvPolicyDefaults(limits.kv_policy, d->engine_->limits()));
  if (limits.kv_policy.kind != KvPolicy::Kind::kNone) {
    spdlog::info("token eviction by default: --kv-policy {} (sinks {}, window {}, budget {})",
                 KvPolicyName(limits.kv_policy.kind), limits.kv_policy.sinks,
                 limits.kv_policy.window, limits.kv_policy.budget);
  }
  d->metrics_ = std::make_unique<Metrics>(name);
  if (f.metrics_compat == "vllm") d->metrics_->EnableVllmNames(d->engine_->options().block_size);
  d->service_ = std::make_unique<ModelService>(name, l.model.get(), l.tokenizer.get(), chat,
                                               d->engine_.get(), limits, d->metrics_.get());
  d->service_->set_kv_events(d->kv_events_.get());
  d->drift_ = std::make_unique<TemplateDriftGuard>(f.chat_canonicalize_history);
  if (cache_control != nullptr) {
    d->service_->EnableCacheControl(cache_control, d->drift_.get());
    d->cache_control_ = std::make_unique<CacheControlService>(d->service_.get(), d->engine_.get(),
                                                              cache_control);
  }
  RETURN_IF_ERROR(d->pd_->Attach(d->engine_.get(), d->service_.get()));
  ASSIGN_OR_RETURN(const ResponseCacheOptions cache_options, ResponseCacheOptionsFromFlags(f));
  absl::StatusOr<SemanticMode> semantic_mode = ParseSemanticMode(f.semantic_cache_default);
  if (!semantic_mode.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--semantic-cache-default: ", semantic_mode.status().message()));
  }
  const SemanticMode semantic_default = *semantic_mode;
  if (!(f.semantic_cache_threshold >= -1 && f.semantic_cache_threshold <= 1)) {
    return absl::InvalidArgumentError("--semantic-cache-threshold must be in [-1, 1]");
  }
  if (!f.semantic_cache_model.empty() && cache_options.max_bytes == 0) {
    return absl::InvalidArgumentError(
        "--semantic-cache-model needs the response cache: give --response-cache-bytes too");
  }
  if (f.semantic_cache_model.empty() && semantic_default != SemanticMode::kOff) {
    return absl::InvalidArgumentError(
        "--semantic-cache-default other than off needs --semantic-cache-model");
  }
  if (cache_options.max_bytes > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    CacheIdentity identity;
    ASSIGN_OR_RETURN(identity.model_fingerprint, ModelFingerprint(model_path));
    // Anything that changes the bits of a reply for the same request.
    const EngineOptions& eo = d->engine_->options();
    identity.numerics = absl::StrCat(
        "kv=", std::string(kernels::KvDTypeName(eo.kv_dtype)), ";block=", eo.block_size,
        ";device=", eo.backend != nullptr ? eo.backend->name() : "cpu");
    d->response_cache_ = std::make_unique<ResponseCache>(cache_options);
    d->service_->EnableResponseCache(d->response_cache_.get(), identity);
    if (!f.semantic_cache_model.empty()) {
      absl::StatusOr<std::unique_ptr<TextEmbedder>> embedder = MakeEmbedder(f.semantic_cache_model);
      if (!embedder.ok()) {
        return absl::Status(embedder.status().code(),
                            absl::StrCat("--semantic-cache-model ", f.semantic_cache_model, ": ",
                                         embedder.status().message()));
      }
      d->embedder_ = std::move(embedder).value();
      SemanticIndexOptions so;
      // About one indexed query per 2 KiB of cached replies.
      so.max_entries = std::max<int64_t>(1024, cache_options.max_bytes / 2048);
      d->semantic_ =
          std::make_unique<SemanticIndex>(d->embedder_->dim(), d->response_cache_.get(), so);
      d->service_->EnableSemanticCache(d->semantic_.get(), d->embedder_.get(),
                                       static_cast<float>(f.semantic_cache_threshold),
                                       semantic_default);
      spdlog::info("semantic cache: {} (dim {}), threshold {}, default mode {}",
                   d->embedder_->fingerprint(), d->embedder_->dim(), f.semantic_cache_threshold,
                   f.semantic_cache_default);
    }
    spdlog::info(
        "response cache: {} bytes, ttl {} s (model {}, {}; fingerprint in {:.0f} ms)",
        cache_options.max_bytes, f.response_cache_ttl, identity.model_fingerprint.substr(0, 16),
        identity.numerics,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (!f.kv_events_endpoint.empty()) {
    VllmEventPublisherOptions vo;
    vo.endpoint = f.kv_events_endpoint;
    vo.replay_endpoint = f.kv_events_replay_endpoint;
    vo.topic = f.kv_events_topic;
    vo.replay_batches = static_cast<size_t>(f.kv_events_replay_batches);
    vo.format.block_size = d->engine_->options().block_size;
    // Media by tier, as vLLM names them: the KV pool is "GPU" wherever it
    // lives (vLLM's block pool says so on every platform; the CPU engine's
    // pool would otherwise share "CPU" with the host tier's pages), the
    // host tier "CPU", the disk tier "Disk" (VllmEventFormat).
    // KV cache groups: every group publishes its own index, each event
    // tagged with its group_idx and that group's spec, as vLLM tags a
    // hybrid model's groups (docs/kubernetes.md). Empty for one group.
    vo.format.group_windows = d->engine_->KvGroupWindows();
    ASSIGN_OR_RETURN(d->vllm_events_, VllmEventPublisher::Start(d->kv_events_.get(), vo));
  }
  d->engine_->Start();

  if (probes != nullptr) probes->Stop();
  ASSIGN_OR_RETURN(d->grpc_,
                   GrpcServer::Start(d->service_.get(), [&] {
                     GrpcServerOptions o = GrpcOptionsFromFlags(f, api_key);
                     o.tenant_keys = d->tenant_keys_;
                     o.cache_control = d->cache_control_.get();
                     o.extra_services.push_back(d->pd_->service());
                     return o;
                   }()));
  d->pd_->SetGrpcPort(d->grpc_->port());
  ASSIGN_OR_RETURN(d->http_,
                   HttpServer::Start(d->service_.get(), [&] {
                     HttpServerOptions o = HttpOptionsFromFlags(f, api_key);
                     o.tenant_keys = d->tenant_keys_;
                     o.cache_control = d->cache_control_.get();
                     o.embedder = d->embedder_.get();  // /v1/embeddings (issue 44)
                     o.embedding_model =
                         std::filesystem::path(f.semantic_cache_model).filename().string();
                     if (o.embedding_model.empty()) {  // a directory given with a trailing /
                       o.embedding_model = std::filesystem::path(f.semantic_cache_model)
                                               .parent_path().filename().string();
                     }
                     return o;
                   }()));
  d->pd_->SetHttpPort(d->http_->port());
  spdlog::info("serving '{}': gRPC on {} (port {}), HTTP on {}:{}{}", name, f.grpc_address,
               d->grpc_->port(), f.http_host, d->http_->port(),
               api_key.empty() ? "" : ", API key required");
  if (!f.port_file.empty()) {
    // Written aside and renamed, so a reader never sees half a file.
    const std::string tmp = f.port_file + ".tmp";
    std::ofstream(tmp) << "{\"grpc\": " << d->grpc_->port() << ", \"http\": " << d->http_->port()
                       << "}\n";
    std::rename(tmp.c_str(), f.port_file.c_str());
  }
  return d;
}

Daemon::~Daemon() {
  // Leased blocks go back before the engine (and its pool) does.
  if (pd_) pd_->Shutdown();
  if (stopped_) return;
  if (vllm_events_) vllm_events_->Stop();
  if (kv_events_) kv_events_->Close();
  if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now());
  if (http_) http_->Stop();
  if (engine_) engine_->Stop();
}

void Daemon::WaitForSignalAndDrain() {
  const sigset_t signals = ShutdownSignals();
  int sig = 0;
  sigwait(&signals, &sig);
  // A second SIGTERM/SIGINT during the drain exits at once (exit code 1),
  // for an operator who will not wait for --drain-timeout.
  std::thread([signals] {
    int again = 0;
    sigwait(&signals, &again);
    spdlog::warn("{} during the drain: exiting now", again == SIGTERM ? "SIGTERM" : "SIGINT");
    std::_Exit(1);
  }).detach();
  Drain(sig == SIGTERM ? "SIGTERM" : "SIGINT");
}

void Daemon::Drain(const std::string& reason) {
  spdlog::info("{}: draining ({} in flight, {:.0f} s to finish)", reason, service_->in_flight(),
               flags_.drain_timeout);
  // New requests are refused from here on; in-flight ones may finish.
  service_->BeginDrain();
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(flags_.drain_timeout * 1000));
  while (service_->in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (service_->in_flight() > 0) {
    spdlog::warn("drain timeout: cancelling {} requests", service_->in_flight());
    service_->CancelAll();
    const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (service_->in_flight() > 0 && std::chrono::steady_clock::now() < grace) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  // Subscribers' streams end first so the gRPC shutdown does not wait on them
  // (the vLLM-format publisher flushes what the log holds before that).
  if (vllm_events_) vllm_events_->Stop();
  if (kv_events_) kv_events_->Close();
  grpc_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  http_->Stop();
  pd_->Shutdown();
  engine_->Stop();
  stopped_ = true;
  spdlog::info("stopped");
}

}  // namespace kvserve
