// The implementation of engine_builder.h. What it owns and how it is used: the
// opening paragraph of server/app/engine_builder.h.

#include "server/app/engine_builder.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/kv_view.h"
#include "spdlog/spdlog.h"

namespace kvserve {

absl::StatusOr<kernels::KvDType> KvDTypeFromFlags(const EngineFlags& flags) {
  kernels::KvDType t;
  if (kernels::ParseKvDType(flags.kv_cache_dtype, &t)) return t;
  return absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtype must be one of ",
                                                 std::string(kernels::KvDTypeList()), "; not '",
                                                 flags.kv_cache_dtype, "'"));
}

KvShape KvShapeOf(const LlamaConfig& c, bool groups) {
  KvShape shape{c.n_layers,       c.n_kv_heads,     c.head_dim,
                c.context_length, c.sliding_window, c.n_windowed_layers()};
  const LlamaConfig::KvGroups g = c.MakeKvGroups(groups);
  if (g.num_groups() > 1) {
    shape.layers_per_block = g.layers_per_group;
    for (int32_t w : g.group_window) ++(w > 0 ? shape.window_groups : shape.full_groups);
  }
  return shape;
}

absl::StatusOr<MemoryPlan> PlanFromFlags(const EngineFlags& flags, const LlamaConfig& c) {
  ASSIGN_OR_RETURN(const int64_t budget, ParseMemoryBudget(flags.kv_cache_memory));
  ASSIGN_OR_RETURN(const kernels::KvDType dtype, KvDTypeFromFlags(flags));
  return PlanKvMemory(KvShapeOf(c, flags.kv_layout != "all-layers"), flags.block_size, dtype,
                      budget);
}

absl::StatusOr<EngineOptions> EngineOptionsFromFlags(const EngineFlags& flags,
                                                     const MemoryPlan& plan) {
  EngineOptions o;
  o.block_size = flags.block_size;
  o.num_blocks = static_cast<int32_t>(std::min<int64_t>(plan.num_blocks, 1 << 30));
  ASSIGN_OR_RETURN(o.kv_dtype, KvDTypeFromFlags(flags));
  o.max_batched_tokens = flags.max_batched_tokens;
  o.max_seqs = flags.max_seqs;
  o.static_batching = flags.static_batching;
  o.prefix_cache = flags.prefix_cache;
  o.kv_cache_groups = flags.kv_layout != "all-layers";
  o.target_itl_ms = flags.target_itl_ms;
  o.max_stall_factor = flags.max_stall_factor;
  o.min_prefill_tokens = flags.min_prefill_tokens;
  auto policy = ParseSchedulePolicy(flags.schedule_policy);
  if (!policy.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--schedule-policy: ", policy.status().message()));
  }
  o.schedule_policy = *policy;
  if (flags.eviction_policy == "lru") {
    o.eviction_policy = EvictionPolicyKind::kLru;
  } else if (flags.eviction_policy == "cost") {
    o.eviction_policy = EvictionPolicyKind::kCost;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--eviction-policy: unknown policy '",
                                                   flags.eviction_policy, "' (lru, cost)"));
  }
  ASSIGN_OR_RETURN(o.speculation, SpeculationOptionsFromFlags(flags.speculative));
  return o;
}

absl::StatusOr<std::shared_ptr<KvTiers>> KvTiersFromFlags(const EngineFlags& flags,
                                                           const std::string& model_path) {
  const bool host = !flags.kv_host_memory.empty() && flags.kv_host_memory != "0";
  const bool disk = !flags.kv_disk_dir.empty();
  std::optional<kernels::KvDType> host_dtype;
  if (flags.kv_host_dtype != "same") {
    kernels::KvDType d;
    if (flags.kv_host_dtype != "int8" && flags.kv_host_dtype != "fp8-e4m3" &&
        flags.kv_host_dtype != "int4-kivi") {
      return absl::InvalidArgumentError(absl::StrCat("--kv-host-dtype: unknown codec '",
                                                     flags.kv_host_dtype,
                                                     "' (same, int8, fp8-e4m3, int4-kivi)"));
    }
    kernels::ParseKvDType(flags.kv_host_dtype, &d);
    if (!host && !disk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-host-dtype ", flags.kv_host_dtype,
          " re-encodes KV tier pages, but no tier is on (--kv-host-memory, --kv-disk-dir)"));
    }
    // The pool's own codec: the bytes as they are (`same`).
    if (flags.kv_cache_dtype != flags.kv_host_dtype) host_dtype = d;
  }
  if (!host && !disk) return std::shared_ptr<KvTiers>();
  KvTiersOptions t;
  t.host_dtype = host_dtype;
  if (host) {
    auto bytes = ParseMemoryBudget(flags.kv_host_memory);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-host-memory: ", bytes.status().message()));
    }
    t.host_bytes = *bytes;
  }
  if (disk) {
    auto bytes = ParseMemoryBudget(flags.kv_disk_bytes);
    if (!bytes.ok() || *bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-disk-bytes: ", bytes.ok() ? "must be > 0" : bytes.status().message()));
    }
    t.disk_dir = flags.kv_disk_dir;
    t.disk_bytes = *bytes;
    t.disk_min_hits = flags.kv_disk_min_hits;
    // The weights' and tokenizer's content (both live in the GGUF file), not
    // its name: a renamed copy finds its blocks, an edited file does not.
    auto content = FileContentHash(model_path);
    if (!content.ok()) {
      return absl::Status(content.status().code(),
                          absl::StrCat("--kv-disk-dir: cannot fingerprint the model: ",
                                       content.status().message()));
    }
    t.model_fingerprint = *content;
  }
  if (flags.prefix_cache == false) {
    return absl::InvalidArgumentError(
        "--kv-host-memory and --kv-disk-dir need the prefix cache (drop --no-prefix-cache)");
  }
  return KvTiers::Create(std::move(t));
}

EngineBuilder::EngineBuilder(const EngineFlags& flags, LlamaModel* model,
                             const Tokenizer* tokenizer)
    : flags_(flags), model_(model), tokenizer_(tokenizer) {}

absl::StatusOr<std::unique_ptr<Engine>> EngineBuilder::Build(ThreadPool* pool,
                                                             KvEventSink* kv_events,
                                                             std::string model_identity,
                                                             std::shared_ptr<CacheControl> cache_control,
                                                             KvLoader* kv_loader) {
  ASSIGN_OR_RETURN(const MemoryPlan plan, PlanFromFlags(flags_, model_->config()));
  spdlog::info(
      "KV cache ({}): {} bytes/token, {} bytes/block of {} tokens, {} blocks, "
      "{} tokens, {} sequences of the full context",
      flags_.kv_cache_dtype, plan.kv_bytes_per_token, plan.block_bytes, plan.block_size,
      plan.num_blocks, plan.token_capacity, plan.full_context_sequences);
  ASSIGN_OR_RETURN(EngineOptions o, EngineOptionsFromFlags(flags_, plan));
  o.kv_events = kv_events;
  o.cache_control = std::move(cache_control);
  o.model_identity = std::move(model_identity);
  ASSIGN_OR_RETURN(o.kv_tiers, KvTiersFromFlags(flags_, model_->file().path()));
  if (o.kv_tiers != nullptr && o.kv_tiers->disk_enabled_requested()) {
    // Blocks on disk outlive the process: their hashes must not depend on
    // the model's file name.
    o.model_identity = "content:" + o.kv_tiers->model_fingerprint();
  }
  if (o.kv_tiers != nullptr) {
    spdlog::info("KV tiers: host {} bytes, disk {}", o.kv_tiers->host_bytes(),
                 flags_.kv_disk_dir.empty() ? std::string("off") : flags_.kv_disk_dir);
  }
  // A decode node's pulls; with tiers the engine asks its tiers first.
  o.kv_loader = kv_loader;
  if (backend_ == nullptr) {
    ASSIGN_OR_RETURN(backend_, CreateBackend(flags_.device, model_, o.kv_dtype, flags_.block_size));
    spdlog::info("device: {} (--device {})", backend_->name(), flags_.device);
  }
  o.backend = backend_;
  return Engine::Create(model_, tokenizer_, pool, o);
}

}  // namespace kvserve
