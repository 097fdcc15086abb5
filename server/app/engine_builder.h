// From EngineFlags to a running configuration: the KV memory plan, the
// EngineOptions, the forward backend and the Engine itself. The flags' names
// and help texts live in server/app/serve_flags.h; this file only interprets the
// values, and answers a bad one with InvalidArgument naming the flag.
// EngineBuilder makes the backend once (CUDA uploads the weights then) and
// reuses it for every engine it builds over the same model.
//
// Thread-safety: the functions are pure; an EngineBuilder is used by one
// thread at a time.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cache/memory_planner.h"
#include "cache/prefix_cache.h"
#include "common/thread_pool.h"
#include "kernels/kv_view.h"
#include "model/backend.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "scheduler/engine.h"
#include "server/app/serve_flags.h"

namespace kvserve {

// --kv-cache-dtype as a KvDType.
[[nodiscard]] absl::StatusOr<kernels::KvDType> KvDTypeFromFlags(const EngineFlags& flags);

// The KV memory plan for `config` under --kv-cache-memory, --block-size and
// --kv-cache-dtype.
// The KV shape the memory planner and the advisor work from: the model's
// dimensions and, with `groups` (--kv-layout groups, the default), its KV
// cache groups (hybrid attention: full and sliding-window groups).
KvShape KvShapeOf(const LlamaConfig& c, bool groups);

[[nodiscard]] absl::StatusOr<MemoryPlan> PlanFromFlags(const EngineFlags& flags,
                                                       const LlamaConfig& config);

// The engine's options for `plan`; backend, KV event sink and model identity
// are left for the caller (EngineBuilder sets them).
[[nodiscard]] absl::StatusOr<EngineOptions> EngineOptionsFromFlags(const EngineFlags& flags,
                                                                   const MemoryPlan& plan);

// The KV tiers --kv-host-memory / --kv-disk-dir ask for (null: none); the
// disk tier's fingerprint hashes the model file at model_path.
[[nodiscard]] absl::StatusOr<std::shared_ptr<KvTiers>> KvTiersFromFlags(
    const EngineFlags& flags, const std::string& model_path);

class EngineBuilder {
 public:
  // `model` and `tokenizer` must outlive the builder and its engines.
  EngineBuilder(const EngineFlags& flags, LlamaModel* model, const Tokenizer* tokenizer);

  // Plans the KV memory, logs the plan, selects the backend on first use
  // (--device; model/backend.cc decides, and the choice is logged) and
  // creates the engine.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<Engine>> Build(ThreadPool* pool,
                                                              KvEventSink* kv_events = nullptr,
                                                              std::string model_identity = "",
                                                              std::shared_ptr<CacheControl> cache_control = nullptr,
                                                              KvLoader* kv_loader = nullptr);

  const EngineFlags& flags() const { return flags_; }

 private:
  const EngineFlags flags_;
  LlamaModel* model_;
  const Tokenizer* tokenizer_;
  std::shared_ptr<ForwardBackend> backend_;
};

}  // namespace kvserve
