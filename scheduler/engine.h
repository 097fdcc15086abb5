// Engine: the continuous-batching engine. Requests enter through a
// thread-safe Submit; one engine thread owns every sequence, the KV cache
// manager (block pool + radix index) and the model. One step is a straight
// line through four parts, each with one home:
//
//   Scheduler::Schedule      who runs, how many tokens each -> BatchPlan
//   ModelRunner::Run         the plan as one ragged forward (ForwardBackend)
//   OutputProcessor::Process commit K/V, fork, sample, emit, finish
//   PublishStats             snapshot for other threads
//
// Decode tokens of running sequences go first, then prefill chunks, under a
// token budget that keeps steps with decoders within --target-itl-ms (see
// scheduler.h). A sequence is admitted only when the pool can hold its
// prompt; when blocks run out the lowest-priority, most recently admitted
// sequence is preempted by recompute: its blocks are freed and it later
// re-prefills its prompt and generated tokens, continuing with the same
// sampler, so its output is exactly what it would have been.
//
// Thread-safety: Submit, Cancel, Stats, Start, Stop and the named KV
// operations (PinPrefix ... UnmarkPublic) may be called from any thread.
// Step runs on the engine thread (Start's thread, or the caller's when the
// engine is driven by hand in tests). Event callbacks run on the engine
// thread and must not block.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/kv_pool.h"
#include "cache/prefix_cache.h"
#include "common/thread_pool.h"
#include "model/backend.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "scheduler/kv_eviction.h"
#include "scheduler/batch_plan.h"
#include "scheduler/cache_control.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_loader.h"
#include "scheduler/kv_tiers.h"
#include "scheduler/request.h"
#include "scheduler/scheduler.h"
#include "scheduler/speculation.h"

namespace kvserve {

class ModelRunner;
class OutputProcessor;
struct SequenceGroup;

enum class EvictionPolicyKind { kLru, kCost };
const char* EvictionPolicyName(EvictionPolicyKind k);  // "lru", "cost"

struct EngineOptions {
  int32_t max_batched_tokens = 512;  // token budget of one step
  int32_t max_seqs = 64;             // running sequences at most
  int32_t block_size = 16;
  int32_t num_blocks = 0;            // KV pool size, from the memory planner
  kernels::KvDType kv_dtype = kernels::KvDType::kF16;
  int32_t max_n = 16;                // samples per request at most
  // Static batching: a batch is admitted together and no one joins until
  // every member has finished (for measuring what continuous batching buys).
  bool static_batching = false;
  // Radix prefix reuse: prompts start from the longest cached prefix, and
  // finished or preempted sequences leave their full blocks in the cache
  // until the pool needs them (evicted before any running sequence is
  // preempted).
  bool prefix_cache = true;
  // KV cache groups for hybrid attention (a model mixing full and
  // sliding-window layers, Gemma 3): each attention kind's layers form
  // groups of equal size, each with its own block table over one pool, so
  // the window groups keep only their window's blocks
  // (LlamaConfig::MakeKvGroups). false: the classic layout, every layer in
  // one block (--kv-layout all-layers; what the groups are compared
  // against). A model with one attention kind has one group either way.
  // num_blocks counts pages of the layout's block: see KvBlockLayers.
  bool kv_cache_groups = true;
  // Waiting-queue order within a priority: kFcfs (arrival) or kLpm (longest
  // cached prefix first, SGLang's policy; falls back to FCFS past
  // lpm_max_waiting waiting sequences, where matching each costs too much).
  using SchedulePolicy = kvserve::SchedulePolicy;  // scheduler/scheduler.h
  SchedulePolicy schedule_policy = SchedulePolicy::kFcfs;
  int32_t lpm_max_waiting = 128;
  // Which cached blocks the prefix cache evicts first: kLru, or kCost
  // (MakeCostAwarePolicy, priced by the engine: recompute from the measured
  // prefill rate and the model's shape, reload from the KV tiers' timings).
  EvictionPolicyKind eviction_policy = EvictionPolicyKind::kLru;
  std::string model_identity;            // seeds the prefix cache's hashes
  KvEventSink* kv_events = nullptr;      // optional: receives the cache's changes
  Clock* clock = nullptr;                // prefix-cache LRU clock (tests)
  // Device seam (model/backend.h): runs the forward and decides where the KV
  // pool's blocks live. Null: the CPU backend (model->Forward over host KV).
  std::shared_ptr<ForwardBackend> backend;
  // Stall-free steps (scheduler.h): a step that carries decode tokens is
  // sized so its predicted time stays within target_itl_ms, or when that is
  // 0, within max_stall_factor times what its decode tokens alone take. Both
  // 0: no limit; every step may take max_batched_tokens.
  double target_itl_ms = 0;
  double max_stall_factor = 0;
  // Prefill tokens a step with decoders gets at least, whatever the target.
  int32_t min_prefill_tokens = 16;
  // KV arriving from elsewhere (a prefill node); null: none.
  KvLoader* kv_loader = nullptr;
  // The host and disk tiers under the pool (scheduler/kv_tiers.h): the
  // prefix cache demotes evicted blocks into them and they load matches
  // back (they are the engine's KvLoader; with kv_loader too, a
  // ChainedKvLoader asks the tiers first and kv_loader for the rest).
  // Needs the prefix cache and host KV memory. Null: no tiers.
  std::shared_ptr<KvTiers> kv_tiers;
  // Testing and introspection: sees each step's plan before it runs (engine
  // thread; must not block or call back into the engine).
  std::function<void(const BatchPlan&)> plan_observer;
  // Retention leases and the cache-miss explainer (scheduler/cache_control.h):
  // sees every eviction, expires leases before each step, releases them
  // before the pool goes. Null: none.
  std::shared_ptr<CacheControl> cache_control;
  // Speculative decoding without a draft model (scheduler/speculation.h):
  // the default mode (requests may override it) and its knobs.
  SpeculationOptions speculation;
};

// Refuses, by name, the engine options that would move blocks without
// knowing the KV cache groups of a hybrid-attention model.
absl::Status CheckHybridKvOptions(const EngineOptions& o);

// "fcfs" or "lpm".
absl::StatusOr<SchedulePolicy> ParseSchedulePolicy(std::string_view name);


struct EngineStats {
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;  // held by running sequences
  int64_t blocks_free = 0;  // free, or cached and evictable at once
  double kv_utilization = 0;        // used / total
  double slot_efficiency = 1;       // live token slots / allocated slots, now
  double mean_slot_efficiency = 1;  // the same, averaged over steps with work
  // What contiguous reservations would have achieved on the same steps: live
  // tokens / slots reserved per running sequence for prompt + max_tokens,
  // and for the model's whole context (the classic static allocation).
  double mean_contiguous_request_efficiency = 1;
  double mean_contiguous_context_efficiency = 1;
  int64_t preemptions = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int64_t steps = 0;
  int64_t last_batch_seqs = 0;
  int64_t last_batch_tokens = 0;
  double mean_batch_seqs = 0;
  double mean_batch_tokens = 0;
  int64_t prompt_tokens_total = 0;      // computed prompt tokens (recompute included)
  int64_t generation_tokens_total = 0;
  int64_t requests_finished = 0;
  int64_t requests_cancelled = 0;
  // Prefix cache (all zero when it is off).
  bool prefix_cache_enabled = false;
  int64_t prefix_queries = 0;          // sequences matched at admission
  int64_t prefix_query_tokens = 0;     // prompt tokens looked up
  int64_t prefix_hit_tokens = 0;       // of those, served from the cache
  int64_t prefix_inserted_blocks = 0;
  int64_t prefix_evicted_blocks = 0;
  int64_t prefix_cached_blocks = 0;    // blocks held by the cache now
  // Sliding-window models (KvWindowStats): blocks sequences let go as their
  // window moved on, how many of those the prefix cache kept, and prefix
  // blocks that could not be cached because the window (and an eviction)
  // had dropped an earlier block of their prefix.
  int32_t sliding_window = 0;
  int64_t window_released_blocks = 0;
  int64_t window_kept_cached_blocks = 0;
  int64_t window_lost_prefix_blocks = 0;
  int64_t window_hollowed_blocks = 0;      // cached blocks the window gave back to the pool
  int64_t window_dropped_prefix_tokens = 0;  // matched tokens the window had dropped
  int32_t window_hollow_nodes = 0;          // prefix-cache nodes without K/V now
  int64_t prefix_evictable_blocks = 0; // of those, with no running sequence on them
  // Stall-free steps.
  int64_t last_batch_prefill_tokens = 0;
  int64_t last_token_budget = 0;       // the step's budget after the ITL target
  // The fitted step cost: fixed + decode_per_token * d + prefill_per_token * p.
  double step_fixed_ms = 0;
  double step_decode_ms_per_token = 0;
  double step_prefill_ms_per_token = 0;
  // KV arriving asynchronously (a KvLoader).
  int32_t kv_arriving = 0;
  int64_t kv_loads = 0;
  int64_t kv_load_failures = 0;
  // KV tiers (all zero without them).
  KvTiersStats tiers;
  // Token eviction (KV policies): tokens dropped and compactions so far.
  int64_t kv_evicted_tokens = 0;
  int64_t kv_compactions = 0;
  int64_t kv_rotated_keys = 0;  // slots re-rotated to positions within the cache (sinks)
  // Speculative decoding: drafts proposed and accepted, by position and source.
  SpeculationStats speculation;
};

// Blocks the engine holds for a holder off its thread (a prefill node's
// lease): made by Engine::PinPrefix, given back by Engine::Unpin. Opaque
// outside the engine (scheduler/engine_kv_ops.cc).
class KvPin;

struct PinnedPrefix {
  std::shared_ptr<KvPin> pin;       // give back with Engine::Unpin
  std::vector<BlockHandle> blocks;  // the whole blocks matched, in prompt order
  int32_t held_blocks = 0;          // blocks the pin holds (a last one may be partial)
  // KV cache groups (a hybrid-attention model): groups 1.. in order, each
  // its own table's blocks [first_block, blocks.size() of group 0) that a
  // continuation from the end of `blocks` reads: a full group's every
  // block, a window group's those its window reaches from there. Empty for
  // a model with one group.
  struct Group {
    int32_t first_block = 0;
    std::vector<BlockHandle> blocks;
  };
  std::vector<Group> groups;
};

struct PublicMarking {
  int32_t marked_blocks = 0;  // blocks newly or still marked public
  RetainAnswer retention;
};

// How long the named KV operations wait for the engine thread.
inline constexpr std::chrono::seconds kEngineOpTimeout{30};

class Engine {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Engine>> Create(LlamaModel* model,
                                                                      const Tokenizer* tokenizer,
                                                                      ThreadPool* pool,
                                                                      const EngineOptions& options);
  ~Engine();  // stops the engine thread; unfinished requests are cancelled

  // The limits Submit checks requests against (ValidateEngineRequest).
  RequestLimits limits() const;
  // What token eviction needs of the model and the pool (RoPE, the trained
  // context, whether keys can be re-rotated).
  KvEvictorOptions EvictorOptions() const;
  // Validates (InvalidArgument naming the field) and queues the request.
  // Events for it arrive on `callback`; the last one per sample carries a
  // finish reason.
  [[nodiscard]] absl::StatusOr<uint64_t> Submit(EngineRequest request, EventCallback callback);
  // Finishes the request with kCancelled and frees its blocks at the next
  // step. Unknown or finished ids are ignored.
  void Cancel(uint64_t request_id);
  // Cancels every request submitted so far (end of a drain).
  void CancelAll();
  // Empties the prefix cache at the next step (blocks running sequences use
  // stay with them). The future yields the number of cached blocks dropped;
  // -1 when the prefix cache is off.
  std::future<int32_t> ClearPrefixCache();

  // ---- Named KV operations (scheduler/engine_kv_ops.cc) ----
  // The only way code off the engine thread (server/: cache control, the
  // P/D node's leases) reaches blocks. Each runs on the engine thread
  // before its next step. Those returning a status wait for it, at most
  // kEngineOpTimeout: past it, DeadlineExceeded ("the engine did not answer
  // within 30 s"; the operation still runs later). Those returning void are
  // queued and return at once (safe to call under the caller's own locks,
  // which the engine thread may be waiting for).

  // P/D prefill: waits until the device's pending KV writes landed (a CUDA
  // pool; failing: Internal, "waiting for the device's KV writes failed:
  // ..."), then pins the longest cached prefix of tokens[0, max_tokens)
  // under salt the way a sequence would (max_tokens < one block: nothing).
  // A hybrid model's pin holds every group's blocks (PinnedPrefix::groups);
  // when a window group no longer holds a block its window needs at the
  // end of the whole blocks matched, nothing is offered (blocks empty).
  [[nodiscard]] absl::StatusOr<PinnedPrefix> PinPrefix(std::string salt,
                                                       std::vector<int32_t> tokens,
                                                       int32_t max_tokens);
  // Gives a PinPrefix's blocks back (queued). Null: nothing.
  void Unpin(std::shared_ptr<KvPin> pin);
  // P/D progressive lease: on the engine thread, runs `before` (null: as
  // if it said true; false: nothing more happens), then takes one pool
  // reference on each whole block of tokens[0, max_tokens) the prefix cache
  // holds under salt now, without touching or counting them for eviction
  // (PrefixCache::Pin), and hands them to `take`; the blocks `take` leaves
  // in the vector are released when it returns. Without a prefix cache
  // `take` gets FailedPrecondition and no blocks. Queued; neither callback
  // may block.
  void PinCachedBlocks(std::string salt, std::vector<int32_t> tokens, int32_t max_tokens,
                       std::function<bool()> before,
                       std::function<void(const absl::Status&, std::vector<BlockHandle>*)> take);
  // Drops one pool reference on each block (PinCachedBlocks's). Queued.
  void ReleaseBlocks(std::vector<BlockHandle> blocks);
  // Test hook (P/D --pd-test-hooks): gives back pin and refs, empties the
  // prefix cache and overwrites every free block with junk bytes, as a node
  // that freed leased blocks early and reused them would.
  absl::Status DiscardAndScribbleForTest(std::shared_ptr<KvPin> pin,
                                         std::vector<BlockHandle> refs);
  // Test hook: evicts every cached block, as pool pressure would (each is
  // demoted to the tiers when they are on), then waits for the tiers'
  // writes. Queued: the future is ready once it ran (drive with Step()).
  std::future<void> EvictAllCachedForTest();

  // Tokens of tokens[0, max_tokens) MatchPrefix would find cached under
  // salt now (0 with the prefix cache off).
  [[nodiscard]] absl::StatusOr<int32_t> PeekCachedPrefix(std::string salt,
                                                         std::vector<int32_t> tokens,
                                                         int32_t max_tokens);
  // The prefix cache's public namespace; "" with the prefix cache off.
  [[nodiscard]] absl::StatusOr<std::string> PublicSalt();

  // Retention leases and the cache report, on EngineOptions::cache_control
  // (FailedPrecondition without one): CacheControl's calls of the same
  // names, with the engine's KV cache manager and tiers.
  [[nodiscard]] absl::StatusOr<RetainAnswer> Retain(RetainRequest request);
  // Retain, queued: `then` gets the answer on the engine thread (must not
  // block).
  void RetainThen(RetainRequest request, std::function<void(absl::StatusOr<RetainAnswer>)> then);
  // nullopt: no lease with that id for tenant (nullopt tenant: any).
  [[nodiscard]] absl::StatusOr<std::optional<LeaseInfo>> RenewLease(
      uint64_t id, double ttl_s, std::optional<std::string> tenant);
  // false: no lease with that id for tenant.
  [[nodiscard]] absl::StatusOr<bool> ReleaseLease(uint64_t id, std::optional<std::string> tenant);
  [[nodiscard]] absl::StatusOr<std::vector<LeaseInfo>> ListLeases(
      std::optional<std::string> tenant);
  [[nodiscard]] absl::StatusOr<CacheReport> ExplainCache(
      std::string salt, std::vector<int32_t> tokens,
      std::function<bool(const std::string&)> may_see);
  // Marks request.tokens' full blocks public (PrefixCache::MarkPublic) and
  // retains them as `request` says, in one step.
  [[nodiscard]] absl::StatusOr<PublicMarking> MarkPublic(RetainRequest request);
  // Unmarks tokens' public blocks and releases every lease of lease_tenant
  // (the public prefixes' pins), in one step. Returns the blocks unmarked.
  [[nodiscard]] absl::StatusOr<int32_t> UnmarkPublic(std::vector<int32_t> tokens,
                                                     std::string lease_tenant);

  // One scheduling iteration. Returns false when there was nothing to do.
  bool Step();
  // Runs Step on a dedicated thread until Stop.
  void Start();
  void Stop();

  EngineStats Stats() const;
  const EngineOptions& options() const { return options_; }
  // REQUIRES: called from the engine thread or while it is stopped.
  const KvPool& kv_pool() const { return kv_->pool(); }
  // The KV cache manager (its groups, for tests). REQUIRES: as kv_pool().
  const KvCacheManager& kv_manager() const { return *kv_; }
  // The KV layout's groups for the serving layer (leases, KV events): empty
  // for a model with one group, else each group's sliding window (0: full
  // attention) in group order. Fixed at construction: any thread.
  std::vector<int32_t> KvGroupWindows() const;
  // nullptr when the prefix cache is off. REQUIRES: as kv_pool().
  const PrefixCache* prefix_cache() const { return kv_->prefix_cache(); }
  // REQUIRES: as kv_pool().
  const Scheduler& scheduler() const { return *scheduler_; }

 private:
  Engine(LlamaModel* model, const Tokenizer* tokenizer, const EngineOptions& options);
  void TakeInbox();
  void ExpireDeadlines();
  void RemoveFinished();
  void PublishStats(const BatchPlan* plan);
  void CheckInvariants() const;

  class EvictionCostsImpl;

  // Runs fn on the engine thread before its next step (with the KV cache
  // manager and the tiers, null without them): what the named KV
  // operations above are made of. The future is ready once fn ran.
  std::future<void> RunOnEngineThread(std::function<void(KvCacheManager*, KvTiers*)> fn);
  // RunOnEngineThread, waiting up to kEngineOpTimeout for fn's answer.
  template <typename T>
  absl::StatusOr<T> AskEngineThread(std::function<absl::StatusOr<T>(KvCacheManager*, KvTiers*)> fn);

  LlamaModel* model_;
  const Tokenizer* tokenizer_;
  EngineOptions options_;
  // Prices blocks for the cost-aware eviction policy; outlives kv_ (the
  // policy inside the prefix cache points at it).
  std::unique_ptr<EvictionCostsImpl> eviction_costs_;
  // The tiers then kv_loader, when both are given (the scheduler's loader).
  std::unique_ptr<ChainedKvLoader> chained_loader_;
  std::unique_ptr<KvCacheManager> kv_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<OutputProcessor> output_;
  std::unique_ptr<Speculator> speculator_;

  // Engine-thread state.
  std::map<uint64_t, std::unique_ptr<SequenceGroup>> groups_;
  int64_t steps_ = 0;
  double sum_batch_seqs_ = 0, sum_batch_tokens_ = 0, sum_slot_eff_ = 0;
  double sum_contig_request_eff_ = 0, sum_contig_context_eff_ = 0;
  int64_t finished_ = 0;
  bool last_step_ran_ = false;

  // Shared with other threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 1;                     // guarded by mu_
  std::vector<std::unique_ptr<SequenceGroup>> inbox_;  // guarded by mu_
  std::vector<uint64_t> cancels_;            // guarded by mu_
  bool cancel_all_ = false;                  // guarded by mu_
  std::vector<std::promise<int32_t>> clear_requests_;  // guarded by mu_
  struct EngineTask {
    std::function<void(KvCacheManager*, KvTiers*)> fn;
    std::promise<void> done;
  };
  std::vector<EngineTask> tasks_;            // guarded by mu_
  EngineStats stats_;                        // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::thread thread_;
};

}  // namespace kvserve
