// The implementation of serve_flags.h. What it owns and how it is used: the
// opening paragraph of server/app/serve_flags.h.

#include "server/app/serve_flags.h"

#include <cctype>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "kernels/kv_view.h"

namespace kvserve {

void AddEngineFlags(CLI::App* app, EngineFlags* f) {
  app->add_option("--device", f->device,
                  "Where the model and KV cache run: cpu, cuda, or auto (cuda when a GPU is "
                  "usable and supports the KV dtype, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  app->add_option("--block-size", f->block_size, "Tokens per KV block")->capture_default_str();
  app->add_option("--kv-cache-memory", f->kv_cache_memory,
                  "KV cache budget: bytes (512MiB, 2GiB) or a fraction of available memory (0.5)")
      ->capture_default_str();
  app->add_option("--kv-cache-dtype", f->kv_cache_dtype,
                  "KV storage: " + std::string(kernels::KvDTypeList()))
      ->capture_default_str();
  app->add_option("--max-batched-tokens", f->max_batched_tokens, "Token budget of one engine step")
      ->capture_default_str();
  app->add_option("--max-seqs", f->max_seqs, "Running sequences at most")->capture_default_str();
  app->add_flag("--static-batching", f->static_batching,
                "Admit whole batches; no one joins until all finish (for comparison)");
  app->add_option("--kv-layout", f->kv_layout,
                  "KV block layout of a hybrid-attention model (full and sliding-window "
                  "layers, e.g. Gemma 3): groups (one block table per group of layers, the "
                  "window groups keep only their window), or all-layers (one block holds every "
                  "layer; for comparison). A single-attention model has one layout")
      ->check(CLI::IsMember({"groups", "all-layers"}))
      ->capture_default_str();
  app->add_flag("--prefix-cache,!--no-prefix-cache", f->prefix_cache,
                "Reuse the KV blocks of cached prompt prefixes (radix prefix cache)")
      ->capture_default_str();
  app->add_option("--schedule-policy", f->schedule_policy,
                  "Waiting-queue order: fcfs, or lpm (longest cached prefix first)")
      ->capture_default_str();
  app->add_option("--eviction-policy", f->eviction_policy,
                  "Which cached prefix blocks the KV cache evicts first: lru (least recently "
                  "used), or cost (GreedyDual: what losing a block costs, recompute or reload "
                  "from a KV tier, times how often it was hit, aged)")
      ->check(CLI::IsMember({"lru", "cost"}))
      ->capture_default_str();
  app->add_option("--target-itl-ms", f->target_itl_ms,
                  "Stall-free steps: a step that carries decode tokens is sized (from measured "
                  "step times) to take at most this long; the rest of the prefill waits for "
                  "later steps (0: use --max-stall-factor)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--max-stall-factor", f->max_stall_factor,
                  "Without --target-itl-ms: a step that carries decode tokens takes at most this "
                  "many times what its decode tokens alone take (0: no limit, whole "
                  "--max-batched-tokens steps)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            double x = 0;
            if (!absl::SimpleAtod(v, &x) || !(x == 0 || x >= 1)) {
              return "must be 0 (off) or a factor >= 1, got " + v;
            }
            return "";
          },
          "0 or >= 1"))
      ->capture_default_str();
  app->add_option("--min-prefill-tokens", f->min_prefill_tokens,
                  "Prefill tokens a step with decoders still gets, whatever --target-itl-ms says")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--kv-host-memory", f->kv_host_memory,
                  "Host KV tier under the KV cache: blocks evicted from the cache are kept here "
                  "and loaded back on a prefix hit; bytes (1GiB) or a fraction of available "
                  "memory (0.25); 0: off")
      ->capture_default_str();
  app->add_option("--kv-disk-dir", f->kv_disk_dir,
                  "Disk KV tier: directory for blocks that left the host tier (or the cache) "
                  "after at least --kv-disk-min-hits hits; found again after a restart on the "
                  "same model (empty: off)");
  app->add_option("--kv-disk-bytes", f->kv_disk_bytes,
                  "Disk KV tier budget in bytes (64GiB), with --kv-disk-dir")
      ->capture_default_str();
  app->add_option("--kv-disk-min-hits", f->kv_disk_min_hits,
                  "Prefix hits a block needs before it is written to the disk KV tier")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--kv-host-dtype", f->kv_host_dtype,
                  "Codec of host and disk KV tier pages: same (the KV cache's bytes, exact) or "
                  "int8, fp8-e4m3, int4-kivi (re-encoded on demotion: more blocks per byte, "
                  "lossy; such tokens are reported and never stored by the response cache)")
      ->check(CLI::IsMember({"same", "int8", "fp8-e4m3", "int4-kivi"}))
      ->capture_default_str();
  AddSpeculativeFlags(app, &f->speculative);
}

void AddKvPolicyFlags(CLI::App* app, KvPolicyFlags* f) {
  app->add_option("--kv-policy", f->policy,
                  "Token eviction when a request names no kv_policy: which cached tokens a "
                  "sequence keeps (window: the --kv-window most recent; sinks: also the first "
                  "--kv-sinks; h2o: also heavy hitters, up to --kv-budget in all): none, window, "
                  "sinks, h2o")
      ->capture_default_str();
  app->add_option("--kv-sinks", f->sinks,
                  "Attention-sink tokens kept from the start (sinks, h2o), when a request's "
                  "kv_policy gives none")
      ->capture_default_str();
  app->add_option("--kv-window", f->window,
                  "Most recent tokens kept (window, sinks, h2o), when a request's kv_policy gives "
                  "none")
      ->capture_default_str();
  app->add_option("--kv-budget", f->budget,
                  "h2o: tokens kept in all, above sinks + window, when a request's kv_policy "
                  "gives none (0: 2 x (sinks + window))")
      ->capture_default_str();
}

void AddServeFlags(CLI::App* app, ServeFlags* f) {
  app->add_option("--grpc-address", f->grpc_address, "gRPC listen address (port 0: any free port)")
      ->capture_default_str();
  app->add_option("--http-host", f->http_host, "HTTP listen host")->capture_default_str();
  app->add_option("--http-port", f->http_port, "HTTP listen port (0: any free port)")
      ->capture_default_str();
  app->add_option("--port-file", f->port_file,
                  "Write {\"grpc\": N, \"http\": M} here once listening");
  app->add_option("--api-key", f->api_key, "Require this key (HTTP Bearer, gRPC metadata)");
  app->add_option("--api-key-file", f->api_key_file, "Read the API key from a file");
  app->add_option("--tls-cert", f->tls_cert, "PEM certificate: serve TLS (with --tls-key)");
  app->add_option("--tls-key", f->tls_key, "PEM private key");
  app->add_option("--max-queued", f->max_queued, "Waiting requests before RESOURCE_EXHAUSTED / 429")
      ->capture_default_str();
  app->add_option("--max-request-bytes", f->max_request_bytes, "Largest HTTP body (413 above)")
      ->capture_default_str();
  app->add_option("--http-threads", f->http_threads,
                  "HTTP I/O threads (and as many request-handler threads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app->add_option("--max-connections", f->max_connections,
                  "Open HTTP connections at most; at the limit the longest-idle one is closed, "
                  "or the new one gets 503")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--http-max-header-bytes", f->http_max_header_bytes,
                  "Largest HTTP request line + headers (431 above)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{256}, int64_t{1} << 24));
  app->add_option("--http-idle-timeout", f->http_idle_timeout,
                  "Seconds a connection may wait for a request's first byte (new or kept alive)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--http-header-timeout", f->http_header_timeout,
                  "Seconds from a request's first byte to the end of its headers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--http-body-timeout", f->http_body_timeout,
                  "Seconds from a request's headers to the end of its body")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--http-write-timeout", f->http_write_timeout,
                  "Seconds a response write may stall (a client that stops reading is "
                  "disconnected and its request cancelled)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--drain-timeout", f->drain_timeout,
                  "Seconds in-flight requests get to finish on SIGTERM/SIGINT")
      ->capture_default_str();
  app->add_option("--served-model-name", f->served_model_name,
                  "Model id clients use (default: the file name without .gguf)");
  app->add_option("--max-n", f->max_n, "Samples per request at most")->capture_default_str();
  app->add_option("--default-max-tokens", f->default_max_tokens,
                  "max_tokens when a request gives none")
      ->capture_default_str();
  app->add_option("--kv-events-retain", f->kv_events_retain,
                  "KV events kept for reconnecting subscribers (0: no event stream)")
      ->capture_default_str();
  app->add_option("--kv-events-endpoint", f->kv_events_endpoint,
                  "ZeroMQ PUB endpoint for KV events in vLLM's format (e.g. tcp://*:5557; "
                  "bound when it has '*', '::', ipc:// or inproc://, else connected; "
                  "default: off)");
  app->add_option("--kv-events-replay-endpoint", f->kv_events_replay_endpoint,
                  "ZeroMQ ROUTER endpoint (bound) answering an 8-byte big-endian start sequence "
                  "with the buffered event batches, then sequence -1 (default: no replay)");
  app->add_option("--kv-events-topic", f->kv_events_topic,
                  "Topic frame of every vLLM-format event message")
      ->capture_default_str();
  app->add_option("--kv-events-replay-batches", f->kv_events_replay_batches,
                  "vLLM-format event batches kept for replay")
      ->capture_default_str();
  app->add_option("--metrics-compat", f->metrics_compat,
                  "Extra names on /metrics: vllm adds vllm:num_requests_waiting, "
                  "vllm:kv_cache_usage_perc, vllm:cache_config_info ... for the inference "
                  "gateway's endpoint picker and vLLM dashboards")
      ->check(CLI::IsMember({"none", "vllm"}))
      ->capture_default_str();
  app->add_option("--metrics-auth", f->metrics_auth,
                  "Whether GET /metrics needs the API key: key, or none (for Prometheus)")
      ->check(CLI::IsMember({"key", "none"}))
      ->capture_default_str();
  app->add_option("--response-cache-bytes", f->response_cache_bytes,
                  "Bytes of completed deterministic replies kept for exact-match reuse "
                  "(0: no response cache; e.g. 64MiB)")
      ->capture_default_str();
  app->add_option("--response-cache-ttl", f->response_cache_ttl,
                  "Seconds a cached reply may be served (0: until evicted)")
      ->capture_default_str();
  app->add_option("--semantic-cache-model", f->semantic_cache_model,
                  "Sentence-encoder directory for the semantic response cache (empty: none)");
  app->add_option("--semantic-cache-threshold", f->semantic_cache_threshold,
                  "Cosine similarity a semantic candidate needs")
      ->capture_default_str();
  app->add_option("--semantic-cache-default", f->semantic_cache_default,
                  "Semantic mode of requests that name none: off, verified, approximate")
      ->capture_default_str();
  // Cache control (docs/cache-control.md).
  app->add_option("--api-keys-file", f->api_keys_file,
                  "File of 'KEY TENANT [BUDGET]' lines: each key authenticates as its tenant, "
                  "whose prefix-cache scope the server derives (--api-key stays the operator's)");
  app->add_option("--cache-retain-budget", f->cache_retain_budget,
                  "KV bytes a tenant may retain (pin) at once; a tenant's own figure in "
                  "--api-keys-file wins; 0 refuses retention")
      ->capture_default_str();
  app->add_option("--cache-retain-max-fraction", f->cache_retain_max_fraction,
                  "Fraction of the primary KV pool retention may pin, all tenants together")
      ->capture_default_str();
  app->add_option("--cache-retain-max-ttl", f->cache_retain_max_ttl,
                  "Longest retention TTL in seconds (longer asks are clipped)")
      ->capture_default_str();
  app->add_flag("--chat-canonicalize-history", f->chat_canonicalize_history,
                "When the chat template renders earlier turns differently from the cached "
                "turn, render the history as it was cached");
  app->add_option("--chat-template", f->chat_template_file,
                  "Jinja chat template file used instead of the model's tokenizer.chat_template");
  AddKvPolicyFlags(app, &f->kv_policy);
  AddPdFlags(app, &f->pd);
}

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

}  // namespace kvserve
