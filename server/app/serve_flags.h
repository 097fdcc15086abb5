// The command-line flags of the engine and of the daemon, as plain structs of
// values plus the functions that register them on a CLI11 (sub)command. This
// file only defines flags (names, defaults, help texts); turning the values
// into an engine lives in server/app/engine_builder.h and into the daemon's
// services in server/app/daemon.h, so neither knows CLI11. Every long option can
// also come from the environment (KVSERVE_<FLAG>, see SetEnvNames) and from
// the --config file.
//
// Thread-safety: plain data; registration happens once, on the main thread,
// before parsing.
#pragma once

#include <cstdint>
#include <string>

#include "server/pd/pd_flags.h"
#include "server/app/spec_flags.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvserve {

// KV cache and scheduler settings shared by the subcommands that run the
// engine (generate, bench, loadtest, plan, serve).
struct EngineFlags {
  int32_t block_size = 16;
  std::string kv_cache_memory = "1GiB";
  std::string kv_cache_dtype = "f16";
  // groups: KV cache groups on a hybrid-attention model (the window layers
  // keep only their window); all-layers: one block holds every layer.
  std::string kv_layout = "groups";
  int32_t max_batched_tokens = 512;
  int32_t max_seqs = 64;
  bool static_batching = false;
  bool prefix_cache = true;
  std::string schedule_policy = "fcfs";
  // Prefix-cache eviction order: "lru" or "cost" (cache/prefix_cache.h).
  std::string eviction_policy = "lru";
  std::string device = "auto";
  // Stall-free steps (scheduler/scheduler.h): 0 turns the limit off.
  double target_itl_ms = 0;
  double max_stall_factor = 2.5;
  int32_t min_prefill_tokens = 16;
  // KV tiers under the primary pool (scheduler/kv_tiers.h): "0" / "" off.
  std::string kv_host_memory = "0";
  std::string kv_disk_dir;
  std::string kv_disk_bytes = "8GiB";
  int32_t kv_disk_min_hits = 2;
  // Codec of host/disk tier pages: "same" (the KV cache's own bytes) or a
  // narrower, lossy one (int8, fp8-e4m3, int4-kivi).
  std::string kv_host_dtype = "same";
  // Speculative decoding (server/app/spec_flags.h).
  SpeculativeFlags speculative;
};

// Registers --device, --block-size, --kv-cache-memory, --kv-cache-dtype,
// --max-batched-tokens, --max-seqs, --static-batching, --[no-]prefix-cache,
// --schedule-policy, --target-itl-ms, --max-stall-factor,
// --min-prefill-tokens and the KV tier flags (--kv-host-memory,
// --kv-disk-dir, --kv-disk-bytes, --kv-disk-min-hits, --kv-host-dtype) on `app`, bound to `flags` (which must outlive it).
void AddEngineFlags(CLI::App* app, EngineFlags* flags);

// The default token-eviction policy (`serve` and `generate`): what a request
// that names no kv_policy, or leaves some of its fields out, runs with.
// Interpreted and checked by server/service/kv_policy.h.
struct KvPolicyFlags {
  std::string policy = "none";
  int32_t sinks = 4;
  int32_t window = 256;
  int32_t budget = 0;  // h2o; 0: 2 x (sinks + window)
};

// Registers --kv-policy, --kv-sinks, --kv-window and --kv-budget on `app`,
// bound to `flags` (which must outlive it).
void AddKvPolicyFlags(CLI::App* app, KvPolicyFlags* flags);

// The daemon's own settings (`kvserve serve`).
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
  // The HTTP front end's transport (server/frontend/http_server.h).
  int32_t http_threads = 2;
  int64_t max_connections = 16384;
  int64_t http_max_header_bytes = 16384;
  double http_idle_timeout = 60;    // seconds
  double http_header_timeout = 10;  // seconds
  double http_body_timeout = 30;    // seconds
  double http_write_timeout = 30;   // seconds
  double drain_timeout = 30;
  std::string served_model_name;
  int32_t max_n = 8;
  int32_t default_max_tokens = 256;
  int64_t kv_events_retain = 65536;
  // KV events in vLLM's wire format (server/observe/kv_events_zmq.h): a ZeroMQ PUB
  // endpoint ("": off) and a ROUTER replay endpoint ("": no replay).
  std::string kv_events_endpoint;
  std::string kv_events_replay_endpoint;
  std::string kv_events_topic;
  int64_t kv_events_replay_batches = 10000;
  // /metrics: "vllm" adds vLLM's names (Metrics::EnableVllmNames); "none"
  // lets Prometheus scrape /metrics without the API key.
  std::string metrics_compat = "none";
  std::string metrics_auth = "key";
  KvPolicyFlags kv_policy;
  // The response cache (server/service/response_cache.h): off by default (see
  // docs/response-cache.md: benchmarks replay identical greedy prompts, and
  // storing users' replies is the operator's choice).
  std::string response_cache_bytes = "0";
  double response_cache_ttl = 3600;  // seconds; 0: no expiry (LRU only)
  // The semantic cache (server/service/semantic_cache.h): the sentence-encoder
  // directory (empty: none), the similarity threshold, and the mode of a
  // request that names none.
  std::string semantic_cache_model;
  double semantic_cache_threshold = 0.92;
  std::string semantic_cache_default = "off";
  // Cache control (docs/cache-control.md): tenant keys, retention budgets,
  // template-drift canonicalization.
  std::string api_keys_file;
  std::string cache_retain_budget = "256MiB";
  double cache_retain_max_fraction = 0.5;
  double cache_retain_max_ttl = 3600;
  bool chat_canonicalize_history = false;
  std::string chat_template_file;  // --chat-template: replaces the model's template
  PdFlags pd;  // --role and --pd-* (server/pd/pd_flags.h)
};

// Registers the daemon's flags (the kv-policy ones included) on `app`, bound
// to `flags` (which must outlive it).
void AddServeFlags(CLI::App* app, ServeFlags* flags);

// Gives every long option of `app` and of its subcommands (recursively) the
// environment variable KVSERVE_<NAME> (--kv-cache-memory:
// KVSERVE_KV_CACHE_MEMORY), except --help, --config and options that name
// their own; command-line flags win over the environment.
// REQUIRES: every option is registered.
void SetEnvNames(CLI::App* app);

}  // namespace kvserve
