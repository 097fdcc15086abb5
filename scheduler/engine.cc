#include "scheduler/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "scheduler/model_runner.h"
#include "scheduler/output_processor.h"
#include "scheduler/scheduler.h"
#include "scheduler/sequence.h"

namespace kvserve {

absl::StatusOr<SchedulePolicy> ParseSchedulePolicy(std::string_view name) {
  if (name == "fcfs") return SchedulePolicy::kFcfs;
  if (name == "lpm") return SchedulePolicy::kLpm;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown schedule policy '", std::string(name), "' (expected fcfs or lpm)"));
}

const char* EvictionPolicyName(EvictionPolicyKind k) {
  return k == EvictionPolicyKind::kCost ? "cost" : "lru";
}

// The cost-aware eviction policy's prices (cache/prefix_cache.h). Recompute:
// the scheduler's measured prefill seconds per token, times a block's
// tokens, scaled by how much more a token costs deep in a context (its
// attention reads every earlier position: per token, 4 * n_layers * q_dim
// flops per context position against 2 * the layers' weights). Reload: the
// KV tiers' timed estimate. Engine thread, like the policy.
class Engine::EvictionCostsImpl final : public EvictionCosts {
 public:
  EvictionCostsImpl(const LlamaConfig& c, int32_t block_size, const KvTiers* tiers)
      : block_size_(block_size), tiers_(tiers) {
    const double q_dim = static_cast<double>(c.n_heads) * c.head_dim;
    const double kv_dim = static_cast<double>(c.n_kv_heads) * c.head_dim;
    const double layer_weights =
        c.dim * (q_dim + 2 * kv_dim) + q_dim * c.dim + 3.0 * c.dim * c.ffn_dim;
    attention_per_position_ = layer_weights > 0 ? (2.0 * q_dim) / layer_weights : 0;
  }
  void set_scheduler(const Scheduler* s) { scheduler_ = s; }

  double RecomputeSeconds(const CachedBlockInfo& b) const override {
    double per_token = 0;
    if (scheduler_ != nullptr && scheduler_->cost_model().ready()) {
      per_token = scheduler_->cost_model().prefill_seconds_per_token();
    }
    // Before the first step is timed every block is priced alike.
    if (!(per_token > 0)) per_token = kUnmeasuredSecondsPerToken;
    const double context = (std::max(1, b.depth) - 0.5) * block_size_;
    return per_token * block_size_ * (1.0 + attention_per_position_ * context);
  }
  double ReloadSeconds(const CachedBlockInfo& b) const override {
    return tiers_ != nullptr ? tiers_->PredictReloadSeconds(b.hits) : -1;
  }

 private:
  static constexpr double kUnmeasuredSecondsPerToken = 1e-3;
  int32_t block_size_;
  const KvTiers* tiers_;
  const Scheduler* scheduler_ = nullptr;
  double attention_per_position_ = 0;
};

absl::Status CheckHybridKvOptions(const EngineOptions& o) {
  // What moves blocks without knowing the groups yet is refused by name on
  // a hybrid model, never run half right: nothing is left at this level.
  // (The KV tiers know them: each group's blocks are pages of their own.
  // A KV loader gets each group's table in KvLoadTarget::groups and refuses
  // a target whose groups it does not know, as the P/D node's does.)
  (void)o;
  return absl::OkStatus();
}

Engine::Engine(LlamaModel* model, const Tokenizer* tokenizer, const EngineOptions& options)
    : model_(model), tokenizer_(tokenizer), options_(options) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(LlamaModel* model,
                                                       const Tokenizer* tokenizer,
                                                       ThreadPool* pool,
                                                       const EngineOptions& o) {
  if (o.max_batched_tokens < 1) return absl::InvalidArgumentError("max_batched_tokens must be >= 1");
  if (o.max_seqs < 1) return absl::InvalidArgumentError("max_seqs must be >= 1");
  if (o.max_n < 1) return absl::InvalidArgumentError("max_n must be >= 1");
  if (!(o.target_itl_ms >= 0)) return absl::InvalidArgumentError("target_itl_ms must be >= 0");
  if (!(o.max_stall_factor == 0 || o.max_stall_factor >= 1)) {
    return absl::InvalidArgumentError("max_stall_factor must be 0 (off) or >= 1");
  }
  if (o.min_prefill_tokens < 1) return absl::InvalidArgumentError("min_prefill_tokens must be >= 1");
  RETURN_IF_ERROR(ValidateSpeculationOptions(o.speculation));
  const LlamaConfig& c = model->config();
  // One forward path: without a device backend the CPU backend runs it.
  std::shared_ptr<ForwardBackend> backend = o.backend;
  if (backend == nullptr) backend = MakeCpuBackend(model);
  const LlamaConfig::KvGroups groups = c.MakeKvGroups(o.kv_cache_groups);
  if (groups.num_groups() > 1) RETURN_IF_ERROR(CheckHybridKvOptions(o));
  KvCacheManagerOptions ko;
  ko.pool.n_layers = groups.layers_per_group;
  ko.pool.n_kv_heads = c.n_kv_heads;
  ko.pool.head_dim = c.head_dim;
  ko.pool.block_size = o.block_size;
  ko.pool.n_blocks = o.num_blocks;
  ko.pool.dtype = o.kv_dtype;
  RETURN_IF_ERROR(backend->CheckKvLayout(o.kv_dtype, o.block_size));
  ko.pool.device_memory = backend->kv_device_memory();  // null: host blocks
  ko.pool.device_stream = backend->kv_stream();
  ko.prefix_cache = o.prefix_cache;
  // Blocks are one region for all layers: only when every layer is windowed
  // can a block leave the sequence (a per-layer pattern keeps them all for
  // its global layers; the windowed layers just read less).
  ko.sliding_window = c.n_windowed_layers() == c.n_layers ? c.sliding_window : 0;
  if (groups.num_groups() > 1) {
    ko.sliding_window = 0;
    ko.group_windows = groups.group_window;
    ko.layer_group = groups.layer_group;
    ko.layer_index = groups.layer_index;
  }
  ko.prefix.model_identity = o.model_identity;
  ko.prefix.clock = o.clock;
  ko.prefix.events = o.kv_events;
  std::unique_ptr<EvictionCostsImpl> costs;
  if (o.eviction_policy == EvictionPolicyKind::kCost) {
    costs = std::make_unique<EvictionCostsImpl>(c, o.block_size, o.kv_tiers.get());
    ko.prefix.policy = MakeCostAwarePolicy(costs.get());
    const EvictionCosts* cp = costs.get();
    ko.group_policy = [cp] { return MakeCostAwarePolicy(cp); };
  } else {
    ko.prefix.policy = MakeLruPolicy();
  }
  if (o.cache_control != nullptr) {
    CacheControl* cc = o.cache_control.get();
    const char* policy = EvictionPolicyName(o.eviction_policy);
    ko.prefix.on_evict = [cc, policy](uint64_t hash, KvTier to) { cc->OnEvict(hash, to, policy); };
  }
  KvLoader* loader = o.kv_loader;
  std::unique_ptr<ChainedKvLoader> chained;
  if (o.kv_tiers != nullptr) {
    if (!o.prefix_cache) {
      return absl::InvalidArgumentError(
          "KV tiers (--kv-host-memory, --kv-disk-dir) need the prefix cache (drop --no-prefix-cache)");
    }
    ko.prefix.demotion = o.kv_tiers.get();
    // Every group demotes its own blocks, keyed by group (none: one group).
    o.kv_tiers->SetGroups(groups.num_groups() > 1 ? groups.group_window : std::vector<int32_t>());
    if (groups.num_groups() > 1) {
      ko.group_demotion.assign(1, nullptr);
      for (int32_t g = 1; g < groups.num_groups(); ++g) {
        ko.group_demotion.push_back(o.kv_tiers->group_demotion(g));
      }
    }
    loader = o.kv_tiers.get();
    if (o.kv_loader != nullptr) {
      // A decode node with tiers: its own tiers first, then the pull.
      chained = std::make_unique<ChainedKvLoader>(o.kv_tiers.get(), o.kv_loader);
      loader = chained.get();
    }
  }
  // The cache and its tiers are complete before the Engine exists (its
  // destructor assumes a whole engine).
  ASSIGN_OR_RETURN(std::unique_ptr<KvCacheManager> kv, KvCacheManager::Create(std::move(ko)));
  if (o.kv_tiers != nullptr) {
    o.kv_tiers->SetEventSink(o.kv_events);  // the log KvEventLog is thread-safe
    RETURN_IF_ERROR(o.kv_tiers->Attach(kv->pool(), kv->prefix_cache()));
  }
  if (o.kv_tiers != nullptr && o.cache_control != nullptr) {
    // Retained prefixes are demoted, never dropped, while a tier can take them.
    CacheControl* cc = o.cache_control.get();
    o.kv_tiers->SetRetainedPredicate([cc](uint64_t hash) { return cc->WasRetained(hash); });
    // Leases a previous run left with their blocks on the disk tier.
    cc->RestoreRetention(kv.get(), o.kv_tiers.get());
  }
  std::unique_ptr<Engine> e(new Engine(model, tokenizer, o));
  e->eviction_costs_ = std::move(costs);
  e->chained_loader_ = std::move(chained);
  e->kv_ = std::move(kv);
  SchedulerOptions so;
  so.max_batched_tokens = o.max_batched_tokens;
  so.max_seqs = o.max_seqs;
  so.static_batching = o.static_batching;
  so.policy = o.schedule_policy;
  so.lpm_max_waiting = o.lpm_max_waiting;
  so.target_itl_ms = o.target_itl_ms;
  so.max_stall_factor = o.max_stall_factor;
  so.min_prefill_tokens = o.min_prefill_tokens;
  e->scheduler_ = std::make_unique<Scheduler>(so, e->kv_.get(), loader);
  if (e->eviction_costs_ != nullptr) e->eviction_costs_->set_scheduler(e->scheduler_.get());
  e->runner_ = std::make_unique<ModelRunner>(std::move(backend), e->kv_.get(), pool);
  e->output_ = std::make_unique<OutputProcessor>(e->kv_.get(), e->scheduler_.get(), tokenizer,
                                                 e->EvictorOptions());
  e->speculator_ = std::make_unique<Speculator>(o.speculation);
  e->PublishStats(nullptr);
  return e;
}

Engine::~Engine() {
  Stop();
  // Cancel whatever is left so callers waiting on events are released.
  TakeInbox();
  std::vector<SequenceGroup*> left;
  for (auto& [id, g] : groups_) left.push_back(g.get());
  for (SequenceGroup* g : left) output_->FinishGroup(g, FinishReason::kCancelled);
  // Loads still writing into blocks finish before the pool goes.
  while (scheduler_->loads_pending()) {
    scheduler_->Schedule();
    RemoveFinished();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  RemoveFinished();
  {
    // Tasks posted after the thread stopped still get their answer.
    std::vector<EngineTask> tasks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(tasks_);
    }
    for (EngineTask& t : tasks) {
      t.fn(kv_.get(), options_.kv_tiers.get());
      t.done.set_value();
    }
  }
  // The disk tier outlives the process: leave the hot prefixes there, and
  // the retention leases with TTL left (their blocks count as hot).
  if (options_.kv_tiers != nullptr && options_.cache_control != nullptr) {
    options_.cache_control->SaveRetention(options_.kv_tiers.get());
  }
  if (options_.kv_tiers != nullptr && kv_->prefix_cache() != nullptr) {
    // Every KV cache group's index (one for a single-attention model).
    for (int32_t g = 0; g < kv_->num_groups(); ++g) {
      const PrefixCache* c = kv_->group_manager(g).prefix_cache();
      if (c != nullptr) options_.kv_tiers->PersistForRestart(*c, g);
    }
  }
  // Leases hold pool references: they go before the pool (the disk tier got
  // their blocks above, as cached blocks).
  if (options_.cache_control != nullptr) options_.cache_control->ReleaseAll(kv_.get());
  // The scheduler goes before the cache whose policy asks it for prices.
  if (eviction_costs_ != nullptr) eviction_costs_->set_scheduler(nullptr);
  output_.reset();
  runner_.reset();
  scheduler_.reset();
  kv_.reset();  // the radix index's blocks, then the pool
}

KvEvictorOptions Engine::EvictorOptions() const {
  const LlamaConfig& c = model_->config();
  KvEvictorOptions eo;
  eo.rope = c.Rope();
  eo.context_length = c.context_length;
  // A step adds at most max_batched_tokens to a sequence, and a compaction
  // waits for a block's worth of droppable slots.
  eo.switch_margin = options_.max_batched_tokens + options_.block_size;
  eo.can_rotate = (kv_ == nullptr || !kv_->pool().on_device()) &&
                  !kernels::KvIsKivi(options_.kv_dtype);
  return eo;
}

RequestLimits Engine::limits() const {
  const LlamaConfig& c = model_->config();
  RequestLimits l;
  l.vocab_size = c.vocab_size;
  l.context_length = c.context_length;
  // All n samples run at once: n above max_seqs could never be admitted.
  l.max_n = std::min(options_.max_n, options_.max_seqs);
  l.block_size = options_.block_size;
  // A sequence holds its blocks in every full KV cache group and at most its
  // window and one prefill chunk in each window group (PeakBlocksNeeded).
  l.num_blocks = kv_->num_blocks();
  if (kv_->hybrid()) {
    l.full_groups = 0;
    for (int32_t g = 0; g < kv_->num_groups(); ++g) {
      ++(kv_->group_window(g) > 0 ? l.window_groups : l.full_groups);
    }
    l.window_group_blocks = kv_->WindowGroupPeakBlocks(options_.max_batched_tokens);
  }
  // StreamingLLM past the trained context needs keys re-rotated on the host.
  l.kv_past_context = !kv_->pool().on_device() && !kernels::KvIsKivi(options_.kv_dtype);
  l.kv_switch_margin = EvictorOptions().switch_margin;
  if (kernels::KvIsKivi(options_.kv_dtype)) {
    l.kv_eviction_unsupported = absl::StrCat(
        "--kv-cache-dtype ", std::string(kernels::KvDTypeName(options_.kv_dtype)),
        " shares key scales across a block, so slots cannot move; use a per-token codec");
  }
  if (kv_->hybrid()) {
    l.kv_eviction_unsupported =
        "token eviction does not know the KV cache groups of a hybrid-attention model (its "
        "window layers already keep only their window); run with --kv-layout all-layers";
  }
  return l;
}

absl::StatusOr<uint64_t> Engine::Submit(EngineRequest request, EventCallback callback) {
  RETURN_IF_ERROR(ValidateEngineRequest(request, limits()));
  auto g = std::make_unique<SequenceGroup>();
  g->request = std::move(request);
  g->callback = std::move(callback);
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    g->id = id;
    g->arrival = static_cast<int64_t>(id);
    inbox_.push_back(std::move(g));
  }
  cv_.notify_one();
  return id;
}

void Engine::Cancel(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(request_id);
  }
  cv_.notify_one();
}

std::future<int32_t> Engine::ClearPrefixCache() {
  std::promise<int32_t> p;
  std::future<int32_t> f = p.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    clear_requests_.push_back(std::move(p));
  }
  cv_.notify_one();
  return f;
}

std::future<void> Engine::RunOnEngineThread(
    std::function<void(KvCacheManager*, KvTiers*)> fn) {
  EngineTask t;
  t.fn = std::move(fn);
  std::future<void> f = t.done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(t));
  }
  cv_.notify_one();
  return f;
}

void Engine::CancelAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_all_ = true;
  }
  cv_.notify_one();
}

void Engine::TakeInbox() {
  std::vector<std::unique_ptr<SequenceGroup>> inbox;
  std::vector<uint64_t> cancels;
  bool cancel_all;
  std::vector<std::promise<int32_t>> clears;
  std::vector<EngineTask> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(tasks_);
    clears.swap(clear_requests_);
    inbox.swap(inbox_);
    cancels.swap(cancels_);
    cancel_all = cancel_all_;
    cancel_all_ = false;
  }
  for (auto& p : clears) {
    // An empty cache means no retained prefix either: a lease would keep
    // its blocks pinned but unreachable (their radix nodes are gone) until
    // its TTL. Released first, so their blocks are cleared and counted.
    if (options_.cache_control != nullptr) options_.cache_control->ReleaseAll(kv_.get());
    p.set_value(kv_->ClearPrefixCache());
  }
  if (options_.cache_control != nullptr) options_.cache_control->Expire(kv_.get());
  for (EngineTask& t : tasks) {
    t.fn(kv_.get(), options_.kv_tiers.get());
    t.done.set_value();
  }
  for (auto& g : inbox) {
    std::unique_ptr<Sequence> s = output_->NewSample(g.get(), 0, g->request.prompt);
    s->SetDraft(g->request.draft_tokens);
    scheduler_->AddWaiting(s.get());
    g->seqs.push_back(std::move(s));
    const uint64_t id = g->id;
    groups_[id] = std::move(g);
  }
  if (cancel_all) {
    for (auto& [id, g] : groups_) cancels.push_back(id);
  }
  for (uint64_t id : cancels) {
    auto it = groups_.find(id);
    if (it != groups_.end()) output_->FinishGroup(it->second.get(), FinishReason::kCancelled);
  }
}

void Engine::ExpireDeadlines() {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [id, g] : groups_) {
    if (now > g->request.deadline) output_->FinishGroup(g.get(), FinishReason::kDeadline);
  }
}

void Engine::RemoveFinished() {
  scheduler_->RemoveFinished();
  for (auto it = groups_.begin(); it != groups_.end();) {
    if (it->second->complete()) {
      for (const auto& s : it->second->seqs) speculator_->OnDestroy(s.get());
      ++finished_;
      it = groups_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Engine::Step() {
  // parse -> validate -> submit happened on the caller's thread (Submit);
  // here: schedule -> plan -> forward -> sample -> emit.
  TakeInbox();
  ExpireDeadlines();
  RemoveFinished();
  last_step_ran_ = false;
  if (scheduler_->idle()) {
    PublishStats(nullptr);
    return false;
  }
  // Drafts first: a sequence with one token to decode may contribute 1 + k.
  // Not while prompts wait for their chunks (a running sequence still
  // prefilling, or a waiting one that could be admitted): that step is
  // compute-bound, so every verify token costs a prompt token's full price
  // and takes budget from the chunks, delaying first tokens.
  speculator_->Propose(scheduler_->running(), scheduler_->prompts_pending());
  const BatchPlan plan = scheduler_->Schedule();
  if (plan.empty()) {
    PublishStats(nullptr);
    return !scheduler_->idle();
  }
  if (options_.plan_observer) options_.plan_observer(plan);
  const auto t0 = std::chrono::steady_clock::now();
  const absl::StatusOr<StepResult> result = runner_->Run(plan);
  if (!result.ok()) {
    // Inputs were validated at Submit, so this is an engine bug; fail the
    // affected requests rather than the process. This step's K/V were not
    // written: nothing of it may reach the prefix cache (it was never marked
    // computed, so Free caches only what earlier steps committed).
    std::fprintf(stderr, "engine: forward failed: %s\n", result.status().ToString().c_str());
    for (const ScheduledChunk& c : plan.chunks) {
      kv_->Truncate(&c.seq->kv, c.seq->kv.num_computed);
      output_->FinishGroup(c.seq->group(), FinishReason::kCancelled);
    }
    RemoveFinished();
    PublishStats(nullptr);
    return true;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  scheduler_->ObserveStep(plan, seconds);
  output_->Process(plan, *result);
  // Speculation prices the whole step: verifying k drafts also samples k rows.
  speculator_->AfterStep(
      plan, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  RemoveFinished();
  ++steps_;
  last_step_ran_ = true;
  PublishStats(&plan);
#ifndef NDEBUG
  CheckInvariants();
#endif
  return true;
}

void Engine::CheckInvariants() const {
  for (const auto& [id, g] : groups_) {
    for (const auto& s : g->seqs) {
      s->CheckInvariants();
      kv_->CheckInvariants(s->kv);
    }
  }
}

void Engine::PublishStats(const BatchPlan* plan) {
  const int64_t batch_seqs = plan ? static_cast<int64_t>(plan->chunks.size()) : 0;
  const int64_t batch_tokens = plan ? plan->num_tokens : 0;
  const std::vector<Sequence*>& running = scheduler_->running();
  // Live slots: for each block in use, the highest fill any table gives it
  // (forked samples share blocks; count each once).
  std::unordered_map<int32_t, int32_t> fill;
  const int32_t bs = options_.block_size;
  for (const Sequence* s : running) {
    // Every KV cache group's table; a window group's released leading
    // entries (the placeholder) hold nothing of the sequence's.
    for (int32_t g = 0; g < kv_->num_groups(); ++g) {
      if (g > 0 && s->kv.groups.size() < static_cast<size_t>(g)) break;
      const SeqKv& k = g == 0 ? s->kv : s->kv.groups[g - 1];
      const auto& blocks = k.table.blocks();
      const size_t first = g > 0 ? static_cast<size_t>(k.num_window_released) : 0;
      for (size_t j = first; j < blocks.size(); ++j) {
        const int32_t f = std::min<int32_t>(bs, k.num_computed - static_cast<int32_t>(j) * bs);
        int32_t& slot = fill[blocks[j].id];
        slot = std::max(slot, std::max(0, f));
      }
    }
  }
  int64_t live = 0;
  for (const auto& [id, f] : fill) live += f;
  int64_t live_per_seq = 0, reserved_request = 0;
  for (const Sequence* s : running) {
    live_per_seq += s->kv.num_computed;
    reserved_request += s->num_prompt() + s->group()->request.params.max_tokens;
  }
  const int64_t reserved_context =
      static_cast<int64_t>(running.size()) * model_->config().context_length;
  // Cached blocks no sequence holds count as free, as they are to admission:
  // taking one costs an eviction, not a wait.
  const int64_t evictable = kv_->num_evictable_blocks();
  const int64_t available = kv_->num_free_blocks() + evictable;
  const int64_t used = kv_->num_blocks() - available;
  // Slots of the blocks running sequences hold (the prefix cache's idle
  // blocks are reusable, not waste).
  const int64_t held = static_cast<int64_t>(fill.size());
  const double slot_eff = held > 0 ? static_cast<double>(live) / (held * bs) : 1.0;
  if (batch_seqs > 0) {
    sum_batch_seqs_ += static_cast<double>(batch_seqs);
    sum_batch_tokens_ += static_cast<double>(batch_tokens);
    sum_slot_eff_ += slot_eff;
    if (reserved_request > 0) {
      sum_contig_request_eff_ += static_cast<double>(live_per_seq) / reserved_request;
      sum_contig_context_eff_ += static_cast<double>(live_per_seq) / reserved_context;
    }
  }
  EngineStats st;
  st.blocks_total = kv_->num_blocks();
  st.blocks_free = available;
  st.blocks_used = used;
  st.kv_utilization = st.blocks_total > 0 ? static_cast<double>(used) / st.blocks_total : 0;
  st.slot_efficiency = slot_eff;
  st.mean_slot_efficiency = steps_ > 0 ? sum_slot_eff_ / steps_ : 1.0;
  st.mean_contiguous_request_efficiency = steps_ > 0 ? sum_contig_request_eff_ / steps_ : 1.0;
  st.mean_contiguous_context_efficiency = steps_ > 0 ? sum_contig_context_eff_ / steps_ : 1.0;
  st.preemptions = scheduler_->preemptions();
  st.running = static_cast<int32_t>(running.size());
  st.waiting = static_cast<int32_t>(scheduler_->waiting().size());
  st.steps = steps_;
  st.last_batch_seqs = batch_seqs;
  st.last_batch_tokens = batch_tokens;
  st.last_batch_prefill_tokens = plan ? plan->num_prefill_tokens : 0;
  st.last_token_budget = plan ? plan->token_budget : 0;
  st.step_fixed_ms = scheduler_->cost_model().fixed_seconds() * 1e3;
  st.step_decode_ms_per_token = scheduler_->cost_model().decode_seconds_per_token() * 1e3;
  st.step_prefill_ms_per_token = scheduler_->cost_model().prefill_seconds_per_token() * 1e3;
  st.kv_arriving = static_cast<int32_t>(scheduler_->arriving().size());
  st.kv_loads = scheduler_->kv_loads();
  st.kv_load_failures = scheduler_->kv_load_failures();
  if (options_.kv_tiers != nullptr) st.tiers = options_.kv_tiers->stats();
  st.kv_evicted_tokens = output_->evictor().evicted_tokens();
  st.kv_compactions = output_->evictor().compactions();
  st.kv_rotated_keys = output_->evictor().rotated_keys();
  st.speculation = speculator_->stats();
  st.mean_batch_seqs = steps_ > 0 ? sum_batch_seqs_ / steps_ : 0;
  st.mean_batch_tokens = steps_ > 0 ? sum_batch_tokens_ / steps_ : 0;
  st.prompt_tokens_total = scheduler_->prompt_tokens_total();
  st.generation_tokens_total = output_->generation_tokens_total();
  st.requests_finished = finished_;
  st.requests_cancelled = output_->requests_cancelled();
  if (const PrefixCache* pc = kv_->prefix_cache()) {
    const PrefixCacheStats ps = pc->stats();
    st.prefix_cache_enabled = true;
    st.prefix_queries = scheduler_->prefix_queries();
    st.prefix_query_tokens = scheduler_->prefix_query_tokens();
    st.prefix_hit_tokens = scheduler_->prefix_hit_tokens();
    st.prefix_inserted_blocks = ps.inserted_blocks;
    st.prefix_evicted_blocks = ps.evicted_blocks;
    st.prefix_cached_blocks = ps.cached_blocks;
    st.prefix_evictable_blocks = evictable;
  }
  st.sliding_window = kv_->sliding_window();
  st.window_released_blocks = kv_->window_stats().blocks_released;
  st.window_kept_cached_blocks = kv_->window_stats().blocks_kept_cached;
  st.window_lost_prefix_blocks = kv_->window_stats().prefix_blocks_lost;
  st.window_hollowed_blocks = kv_->window_stats().blocks_hollowed;
  if (const PrefixCache* pc = kv_->prefix_cache(); pc != nullptr) {
    st.window_dropped_prefix_tokens = pc->stats().window_dropped_tokens;
    st.window_hollow_nodes = pc->num_hollow_blocks();
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = st;
}

EngineStats Engine::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (thread_.joinable()) return;
    stop_ = false;
  }
  thread_ = std::thread([this] {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (stop_) return;
      }
      const bool more = Step();
      if (more && !last_step_ran_) {
        // Only KV loads are in flight (or nothing fits yet): poll, not spin.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::microseconds(500));
      } else if (!more) {
        std::unique_lock<std::mutex> lock(mu_);
        auto woken = [&] {
          return stop_ || !inbox_.empty() || !cancels_.empty() || cancel_all_ ||
                 !clear_requests_.empty() || !tasks_.empty();
        };
        if (options_.cache_control != nullptr) {
          // Idle, leases still lapse on time (a step runs Expire).
          cv_.wait_for(lock, std::chrono::seconds(1), woken);
        } else {
          cv_.wait(lock, woken);
        }
      }
    }
  });
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<int32_t> Engine::KvGroupWindows() const {
  std::vector<int32_t> windows;
  if (!kv_->hybrid()) return windows;
  for (int32_t g = 0; g < kv_->num_groups(); ++g) windows.push_back(kv_->group_window(g));
  return windows;
}

}  // namespace kvserve
