#include "scheduler/engine.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvserve {

struct Engine::Group {
  uint64_t id = 0;
  int64_t arrival = 0;
  EngineRequest request;
  EventCallback callback;
  std::vector<std::unique_ptr<Sequence>> seqs;  // [0] is the parent until the fork
  bool forked = false;
  bool done = false;  // FinishGroup ran
  int32_t n_finished = 0;
};

struct Engine::Sequence {
  Group* group = nullptr;
  int32_t index = 0;
  BlockTable table;
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int32_t n_prompt = 0;
  int32_t n_computed = 0;       // tokens whose K/V are in the cache
  int32_t n_cached_blocks = 0;  // leading full blocks offered to the prefix cache
  int32_t cached_prompt_tokens = 0;  // prompt tokens the first admission matched
  bool ever_admitted = false;
  int64_t admit_order = 0;
  bool running = false;
  bool finished = false;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamingDetokenizer> detok;
  std::unique_ptr<StopStringMatcher> stops;

  explicit Sequence(KvPool* pool) : table(pool) {}
  int32_t n_generated() const { return static_cast<int32_t>(tokens.size()) - n_prompt; }
  int32_t remaining_input() const { return static_cast<int32_t>(tokens.size()) - n_computed; }
  absl::Span<const int32_t> generated() const {
    return absl::MakeConstSpan(tokens).subspan(n_prompt);
  }
};

namespace {

// Per-sample seeds: sample i of a seeded request draws from seed + i, so
// every sample is reproducible on its own.
SamplingParams ForSample(const SamplingParams& p, int32_t index) {
  SamplingParams q = p;
  if (q.has_seed) q.seed += static_cast<uint64_t>(index);
  return q;
}

}  // namespace

absl::StatusOr<EngineOptions::SchedulePolicy> ParseSchedulePolicy(std::string_view name) {
  if (name == "fcfs") return EngineOptions::SchedulePolicy::kFcfs;
  if (name == "lpm") return EngineOptions::SchedulePolicy::kLpm;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown schedule policy '", std::string(name), "' (expected fcfs or lpm)"));
}

Engine::Engine(LlamaModel* model, const Tokenizer* tokenizer, ThreadPool* pool,
               const EngineOptions& options)
    : model_(model), tokenizer_(tokenizer), pool_(pool), options_(options) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(LlamaModel* model,
                                                       const Tokenizer* tokenizer,
                                                       ThreadPool* pool,
                                                       const EngineOptions& o) {
  if (o.max_batched_tokens < 1) return absl::InvalidArgumentError("max_batched_tokens must be >= 1");
  if (o.max_seqs < 1) return absl::InvalidArgumentError("max_seqs must be >= 1");
  if (o.max_n < 1) return absl::InvalidArgumentError("max_n must be >= 1");
  const LlamaConfig& c = model->config();
  KvPoolOptions po;
  po.n_layers = c.n_layers;
  po.n_kv_heads = c.n_kv_heads;
  po.head_dim = c.head_dim;
  po.block_size = o.block_size;
  po.n_blocks = o.num_blocks;
  po.dtype = o.kv_dtype;
  if (o.backend != nullptr) {
    RETURN_IF_ERROR(o.backend->CheckKvLayout(o.kv_dtype, o.block_size));
    po.device_memory = o.backend->kv_device_memory();  // null: host blocks
    po.device_stream = o.backend->kv_stream();
  }
  std::unique_ptr<Engine> e(new Engine(model, tokenizer, pool, o));
  ASSIGN_OR_RETURN(e->kv_pool_, KvPool::Create(po));
  if (o.prefix_cache) {
    PrefixCacheOptions pc;
    pc.model_identity = o.model_identity;
    pc.clock = o.clock;
    pc.events = o.kv_events;
    e->prefix_cache_ = std::make_unique<PrefixCache>(e->kv_pool_.get(), std::move(pc));
  }
  e->PublishStats(0, 0);
  return e;
}

Engine::~Engine() {
  Stop();
  // Cancel whatever is left so callers waiting on events are released.
  TakeInbox();
  std::vector<Group*> left;
  for (auto& [id, g] : groups_) left.push_back(g.get());
  for (Group* g : left) FinishGroup(g, FinishReason::kCancelled);
  RemoveFinished();
  // Running sequences are gone; drop the cache's blocks before the pool.
  prefix_cache_.reset();
}

RequestLimits Engine::limits() const {
  const LlamaConfig& c = model_->config();
  RequestLimits l;
  l.vocab_size = c.vocab_size;
  l.context_length = c.context_length;
  l.max_n = options_.max_n;
  l.block_size = options_.block_size;
  l.num_blocks = kv_pool_->num_blocks();
  return l;
}

absl::StatusOr<uint64_t> Engine::Submit(EngineRequest request, EventCallback callback) {
  RETURN_IF_ERROR(ValidateEngineRequest(request, limits()));
  auto g = std::make_unique<Group>();
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

std::unique_ptr<Engine::Sequence> Engine::NewSample(Group* g, int32_t index,
                                                    const std::vector<int32_t>& tokens) {
  auto s = std::make_unique<Sequence>(kv_pool_.get());
  s->group = g;
  s->index = index;
  s->tokens = tokens;
  s->n_prompt = static_cast<int32_t>(g->request.prompt.size());
  s->sampler = std::make_unique<Sampler>(ForSample(g->request.params, index));
  s->detok = std::make_unique<StreamingDetokenizer>(tokenizer_);
  s->stops = std::make_unique<StopStringMatcher>(g->request.params.stop);
  return s;
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

void Engine::CancelAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_all_ = true;
  }
  cv_.notify_one();
}

void Engine::TakeInbox() {
  std::vector<std::unique_ptr<Group>> inbox;
  std::vector<uint64_t> cancels;
  bool cancel_all;
  std::vector<std::promise<int32_t>> clears;
  {
    std::lock_guard<std::mutex> lock(mu_);
    clears.swap(clear_requests_);
    inbox.swap(inbox_);
    cancels.swap(cancels_);
    cancel_all = cancel_all_;
    cancel_all_ = false;
  }
  for (auto& p : clears) p.set_value(prefix_cache_ ? prefix_cache_->Clear() : -1);
  for (auto& g : inbox) {
    std::unique_ptr<Sequence> s = NewSample(g.get(), 0, g->request.prompt);
    waiting_.push_back(s.get());
    g->seqs.push_back(std::move(s));
    const uint64_t id = g->id;
    groups_[id] = std::move(g);
  }
  if (cancel_all) {
    for (auto& [id, g] : groups_) cancels.push_back(id);
  }
  for (uint64_t id : cancels) {
    auto it = groups_.find(id);
    if (it != groups_.end()) FinishGroup(it->second.get(), FinishReason::kCancelled);
  }
}

void Engine::FinishSequence(Sequence* s, FinishReason reason) {
  if (s->finished) return;
  if (reason == FinishReason::kStop || reason == FinishReason::kLength) {
    // Release what the detokenizer and the stop matcher held back.
    if (!s->stops->stopped()) {
      std::string tail = s->stops->Push(s->detok->Flush());
      tail += s->stops->Flush();
      if (!tail.empty()) {
        SeqEvent ev;
        ev.request_id = s->group->id;
        ev.index = s->index;
        ev.text = std::move(tail);
        ev.prompt_tokens = s->n_prompt;
        ev.completion_tokens = s->n_generated();
        ev.cached_tokens = s->cached_prompt_tokens;
        s->group->callback(ev);
      }
    }
  }
  s->finished = true;
  s->running = false;
  CacheTail(s);
  s->table.Release();
  ++s->group->n_finished;
  SeqEvent ev;
  ev.request_id = s->group->id;
  ev.index = s->index;
  ev.finish = reason;
  ev.prompt_tokens = s->n_prompt;
  ev.completion_tokens = s->n_generated();
  ev.cached_tokens = s->cached_prompt_tokens;
  s->group->callback(ev);
}

void Engine::FinishGroup(Group* g, FinishReason reason) {
  if (g->done) return;
  g->done = true;
  if (reason == FinishReason::kCancelled || reason == FinishReason::kDeadline) ++cancelled_;
  // Samples not yet forked finish too: a request reports n results.
  if (!g->forked && g->request.n > 1 && !g->seqs.empty()) {
    Sequence* parent = g->seqs[0].get();
    for (int32_t i = 1; i < g->request.n; ++i) {
      g->seqs.push_back(NewSample(g, i, parent->tokens));
    }
    g->forked = true;
  }
  for (auto& s : g->seqs) FinishSequence(s.get(), reason);
}

void Engine::Preempt(Sequence* s) {
  // Recompute: drop every block; the prompt and the tokens generated so far
  // are prefilled again when the sequence is readmitted.
  CacheTail(s);
  s->table.Release();  // its blocks stay in the prefix cache, if on
  s->n_computed = 0;
  s->n_cached_blocks = 0;
  s->running = false;
  running_.erase(std::find(running_.begin(), running_.end(), s));
  waiting_.push_back(s);
  ++preemptions_;
}

void Engine::EmitToken(Sequence* s, int32_t token, float logprob) {
  const SamplingParams& p = s->group->request.params;
  const bool is_stop_id =
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
  if ((!p.ignore_eos && tokenizer_->IsEndOfGeneration(token)) || is_stop_id) {
    FinishSequence(s, FinishReason::kStop);
    return;
  }
  s->tokens.push_back(token);
  ++generation_tokens_total_;
  SeqEvent ev;
  ev.request_id = s->group->id;
  ev.index = s->index;
  ev.token_ids.push_back(token);
  if (p.logprobs) ev.logprobs.push_back(logprob);
  ev.text = s->stops->Push(s->detok->Push(token));
  ev.prompt_tokens = s->n_prompt;
  ev.completion_tokens = s->n_generated();
  ev.cached_tokens = s->cached_prompt_tokens;
  s->group->callback(ev);
  if (s->stops->stopped()) {
    FinishSequence(s, FinishReason::kStop);
  } else if (s->n_generated() >= p.max_tokens) {
    FinishSequence(s, FinishReason::kLength);
  }
}

void Engine::RemoveFinished() {
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [](Sequence* s) { return s->finished; }),
                 running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [](Sequence* s) { return s->finished; }),
                 waiting_.end());
  for (auto it = groups_.begin(); it != groups_.end();) {
    Group* g = it->second.get();
    // Done when every sample has finished (an unforked n > 1 request has
    // samples still to come).
    if (g->n_finished >= static_cast<int32_t>(g->seqs.size()) &&
        (g->forked || g->request.n == 1)) {
      ++finished_;
      it = groups_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Engine::Step() {
  TakeInbox();
  const auto now = std::chrono::steady_clock::now();
  for (auto& [id, g] : groups_) {
    if (now > g->request.deadline) FinishGroup(g.get(), FinishReason::kDeadline);
  }
  RemoveFinished();
  if (running_.empty() && waiting_.empty()) {
    PublishStats(0, 0);
    return false;
  }

  // Scheduling order: priority first, then the oldest admission. Victims for
  // preemption come from the back (lowest priority, most recently admitted).
  auto by_priority_then_age = [](const Sequence* a, const Sequence* b) {
    if (a->group->request.priority != b->group->request.priority) {
      return a->group->request.priority > b->group->request.priority;
    }
    return a->admit_order < b->admit_order;
  };
  std::stable_sort(running_.begin(), running_.end(), by_priority_then_age);

  std::vector<int32_t> tokens, token_seq, positions, logit_rows;
  std::vector<Sequence*> batch_seqs;  // index = sequence slot in the KV view
  std::vector<int32_t> batch_take;
  int32_t budget = options_.max_batched_tokens;

  auto schedule = [&](Sequence* s, int32_t take) {
    batch_seqs.push_back(s);
    batch_take.push_back(take);
    budget -= take;
  };
  // Makes room for `take` more tokens of s, preempting later sequences (or
  // s itself) while blocks are short. Returns false if s was preempted.
  auto reserve = [&](Sequence* s, int32_t take) {
    const int32_t extra = std::max(0, s->n_computed + take - s->table.num_tokens());
    for (;;) {
      const absl::Status st = s->table.Reserve(extra);
      if (st.ok()) break;
      if (!absl::IsResourceExhausted(st)) return false;
      // Cached blocks no running sequence uses go before any preemption.
      if (EnsureFree(s->table.BlocksNeeded(extra))) continue;
      Sequence* victim = nullptr;
      for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
        if (std::find(batch_seqs.begin(), batch_seqs.end(), *it) == batch_seqs.end()) {
          victim = *it;
          break;
        }
      }
      if (victim == nullptr) return false;
      Preempt(victim);
      if (victim == s) return false;
    }
    return true;
  };

  // 1. Running sequences: decode tokens first, then prefill chunks.
  for (int pass = 0; pass < 2 && budget > 0; ++pass) {
    std::vector<Sequence*> order = running_;
    for (Sequence* s : order) {
      if (budget <= 0) break;
      if (!s->running) continue;  // preempted by an earlier reservation
      const bool decoding = s->remaining_input() == 1;
      if (decoding != (pass == 0)) continue;
      const int32_t take = std::min(budget, s->remaining_input());
      if (reserve(s, take)) schedule(s, take);
    }
  }

  // 2. Admission, in priority then arrival order (or, under LPM, longest
  // cached prefix before arrival). Static batching admits only into an empty
  // engine.
  std::unordered_map<const Sequence*, int32_t> cached_len;
  const bool lpm = prefix_cache_ != nullptr &&
                   options_.schedule_policy == EngineOptions::SchedulePolicy::kLpm &&
                   static_cast<int32_t>(waiting_.size()) <= options_.lpm_max_waiting;
  if (lpm) {
    for (const Sequence* w : waiting_) {
      cached_len[w] = prefix_cache_->MatchLength(w->group->request.cache_salt, w->tokens,
                                                 static_cast<int32_t>(w->tokens.size()) - 1);
    }
  }
  std::stable_sort(waiting_.begin(), waiting_.end(), [&](const Sequence* a, const Sequence* b) {
    if (a->group->request.priority != b->group->request.priority) {
      return a->group->request.priority > b->group->request.priority;
    }
    if (lpm && cached_len[a] != cached_len[b]) return cached_len[a] > cached_len[b];
    return a->group->arrival < b->group->arrival;
  });
  const bool may_admit = !options_.static_batching || running_.empty();
  // Blocks that admitted sequences will still claim for input they have not
  // reserved yet (their remaining prompt chunks).
  int32_t pending_blocks = 0;
  for (Sequence* r : running_) {
    const int32_t unreserved = static_cast<int32_t>(r->tokens.size()) - r->table.num_tokens();
    if (unreserved > 1) pending_blocks += r->table.BlocksNeeded(unreserved);
  }
  size_t admitted = 0;
  // Continuous batching admits while this step has token budget left; a
  // static batch is admitted whole (up to max_seqs) and prefills over the
  // next steps.
  while (may_admit && (budget > 0 || options_.static_batching) && admitted < waiting_.size() &&
         static_cast<int32_t>(running_.size()) < options_.max_seqs) {
    Sequence* s = waiting_[admitted];
    // Start from the longest cached prefix, then admit only what the pool
    // can hold in full: the rest of the prompt plus what the sequence
    // generated before a preemption. FCFS: no overtaking.
    MatchPrefix(s);
    const int32_t need = s->table.BlocksNeeded(static_cast<int32_t>(s->tokens.size()) -
                                               s->table.num_tokens());
    const int32_t take = std::min(budget, s->remaining_input());
    const int32_t free_before = kv_pool_->num_free_blocks();
    if (!EnsureFree(need + pending_blocks) || !s->table.Reserve(take).ok()) {
      s->table.Release();  // unpin the match; it is looked up again next time
      s->n_computed = 0;
      s->n_cached_blocks = 0;
      break;
    }
    pending_blocks += need - (free_before - kv_pool_->num_free_blocks());
    if (!s->ever_admitted) {
      s->ever_admitted = true;
      s->cached_prompt_tokens = std::min(s->n_computed, s->n_prompt);
      if (prefix_cache_) {
        ++prefix_queries_;
        prefix_query_tokens_ += s->n_prompt;
        prefix_hit_tokens_ += s->cached_prompt_tokens;
      }
    }
    s->running = true;
    s->admit_order = admit_counter_++;
    running_.push_back(s);
    ++admitted;
    if (take > 0) schedule(s, take);
  }
  waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<int64_t>(admitted));
  if (batch_seqs.empty()) {
    PublishStats(0, 0);
    return !running_.empty() || !waiting_.empty();
  }

  // 3. Build the ragged batch and the CSR block table of its sequences.
  std::vector<int32_t> block_ids, block_offsets = {0};
  std::vector<Sequence*> sampled;
  for (size_t i = 0; i < batch_seqs.size(); ++i) {
    Sequence* s = batch_seqs[i];
    const int32_t take = batch_take[i];
    for (int32_t j = 0; j < take; ++j) {
      tokens.push_back(s->tokens[s->n_computed + j]);
      token_seq.push_back(static_cast<int32_t>(i));
      positions.push_back(s->n_computed + j);
    }
    if (s->n_computed < s->n_prompt) {
      prompt_tokens_total_ += std::min(take, s->n_prompt - s->n_computed);
    }
    s->n_computed += take;
    if (s->remaining_input() == 0) {
      logit_rows.push_back(static_cast<int32_t>(tokens.size()) - 1);
      sampled.push_back(s);
    }
    s->table.AppendIds(&block_ids);
    block_offsets.push_back(static_cast<int32_t>(block_ids.size()));
  }
  const LlamaConfig& c = model_->config();
  logits_.resize(logit_rows.size() * static_cast<size_t>(c.vocab_size));
  const kernels::PagedKvView view = kv_pool_->View(block_ids.data(), block_offsets.data(),
                                                   static_cast<int32_t>(batch_seqs.size()));
  const ForwardBatch batch{tokens, token_seq, positions, logit_rows};
  absl::Status st = options_.backend != nullptr
                        ? options_.backend->Forward(batch, view, logits_.data(), pool_)
                        : model_->Forward(batch, view, logits_.data(), pool_);
  if (!st.ok()) {
    // Inputs were validated at Submit, so this is an engine bug; fail the
    // affected requests rather than the process. This step's K/V were not
    // written: nothing of it may reach the prefix cache.
    for (size_t i = 0; i < batch_seqs.size(); ++i) batch_seqs[i]->n_computed -= batch_take[i];
    for (Sequence* s : batch_seqs) FinishGroup(s->group, FinishReason::kCancelled);
    RemoveFinished();
    PublishStats(0, 0);
    return true;
  }
  // Blocks this step filled become shareable at once, so a request with the
  // same prefix arriving now reuses them even while this one still runs.
  for (Sequence* s : batch_seqs) OfferBlocks(s);

  // 4. Sample. A request with n > 1 forks when its prompt is in: the
  // samples share every prompt block and copy only the partial last one.
  for (size_t r = 0; r < sampled.size(); ++r) {
    Sequence* s = sampled[r];
    const absl::Span<const float> row(logits_.data() + r * c.vocab_size, c.vocab_size);
    Group* g = s->group;
    std::vector<Sequence*> targets = {s};
    if (!g->forked && g->request.n > 1) {
      for (int32_t i = 1; i < g->request.n; ++i) {
        std::unique_ptr<Sequence> child = NewSample(g, i, s->tokens);
        child->table = s->table.Fork();
        child->n_computed = s->n_computed;
        child->n_cached_blocks = s->n_cached_blocks;
        child->cached_prompt_tokens = s->cached_prompt_tokens;
        child->ever_admitted = true;
        child->admit_order = s->admit_order;
        child->running = true;
        running_.push_back(child.get());
        targets.push_back(child.get());
        g->seqs.push_back(std::move(child));
      }
      g->forked = true;
    }
    for (Sequence* t : targets) {
      const SampleResult res = t->sampler->Sample(row, absl::MakeConstSpan(t->tokens).first(t->n_prompt),
                                                  t->generated());
      EmitToken(t, res.token, res.logprob);
    }
  }
  const int64_t n_batch_seqs = static_cast<int64_t>(batch_seqs.size());
  const int64_t n_batch_tokens = static_cast<int64_t>(tokens.size());
  RemoveFinished();
  ++steps_;
  PublishStats(n_batch_seqs, n_batch_tokens);
  return true;
}

void Engine::MatchPrefix(Sequence* s) {
  if (prefix_cache_ == nullptr || s->table.num_blocks() > 0) return;
  // At least the last token is computed: its logits pick the next token.
  const int32_t len = static_cast<int32_t>(s->tokens.size());
  PrefixMatch m = prefix_cache_->Match(s->group->request.cache_salt, s->tokens, len - 1);
  if (m.num_tokens == 0) return;  // no blocks either
  s->table.Adopt(std::move(m.blocks), m.num_tokens);
  s->n_computed = m.num_tokens;
  s->n_cached_blocks = m.num_tokens / options_.block_size;
}

void Engine::OfferBlocks(Sequence* s) {
  if (prefix_cache_ == nullptr) return;
  const int32_t bs = options_.block_size;
  const int32_t full = s->n_computed / bs;
  if (full <= s->n_cached_blocks) return;
  prefix_cache_->Insert(s->group->request.cache_salt,
                        absl::MakeConstSpan(s->tokens).first(static_cast<size_t>(full) * bs),
                        absl::MakeConstSpan(s->table.blocks()).first(full));
  s->n_cached_blocks = full;
}

void Engine::CacheTail(Sequence* s) {
  if (prefix_cache_ == nullptr || s->n_computed == 0) return;
  // The sequence writes no more: its partly filled last block can be shared
  // too (copied by whoever writes into it next).
  prefix_cache_->InsertFinished(s->group->request.cache_salt,
                                absl::MakeConstSpan(s->tokens).first(s->n_computed),
                                s->table.blocks());
}

bool Engine::EnsureFree(int32_t blocks) {
  const int32_t short_by = blocks - kv_pool_->num_free_blocks();
  if (short_by <= 0) return true;
  if (prefix_cache_ == nullptr) return false;
  prefix_cache_->Evict(short_by);
  return kv_pool_->num_free_blocks() >= blocks;
}

void Engine::PublishStats(int64_t batch_seqs, int64_t batch_tokens) {
  // Live slots: for each block in use, the highest fill any table gives it
  // (forked samples share blocks; count each once).
  std::unordered_map<int32_t, int32_t> fill;
  const int32_t bs = options_.block_size;
  for (const Sequence* s : running_) {
    const auto& blocks = s->table.blocks();
    for (size_t j = 0; j < blocks.size(); ++j) {
      const int32_t f = std::min<int32_t>(bs, s->n_computed - static_cast<int32_t>(j) * bs);
      int32_t& slot = fill[blocks[j].id];
      slot = std::max(slot, std::max(0, f));
    }
  }
  int64_t live = 0;
  for (const auto& [id, f] : fill) live += f;
  int64_t live_per_seq = 0, reserved_request = 0;
  for (const Sequence* s : running_) {
    live_per_seq += s->n_computed;
    reserved_request += s->n_prompt + s->group->request.params.max_tokens;
  }
  const int64_t reserved_context =
      static_cast<int64_t>(running_.size()) * model_->config().context_length;
  // Cached blocks no sequence holds count as free, as they are to admission:
  // taking one costs an eviction, not a wait.
  const int64_t evictable = prefix_cache_ ? prefix_cache_->num_evictable_blocks() : 0;
  const int64_t available = kv_pool_->num_free_blocks() + evictable;
  const int64_t used = kv_pool_->num_blocks() - available;
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
  st.blocks_total = kv_pool_->num_blocks();
  st.blocks_free = available;
  st.blocks_used = used;
  st.kv_utilization = st.blocks_total > 0 ? static_cast<double>(used) / st.blocks_total : 0;
  st.slot_efficiency = slot_eff;
  st.mean_slot_efficiency = steps_ > 0 ? sum_slot_eff_ / steps_ : 1.0;
  st.mean_contiguous_request_efficiency = steps_ > 0 ? sum_contig_request_eff_ / steps_ : 1.0;
  st.mean_contiguous_context_efficiency = steps_ > 0 ? sum_contig_context_eff_ / steps_ : 1.0;
  st.preemptions = preemptions_;
  st.running = static_cast<int32_t>(running_.size());
  st.waiting = static_cast<int32_t>(waiting_.size());
  st.steps = steps_;
  st.last_batch_seqs = batch_seqs;
  st.last_batch_tokens = batch_tokens;
  st.mean_batch_seqs = steps_ > 0 ? sum_batch_seqs_ / steps_ : 0;
  st.mean_batch_tokens = steps_ > 0 ? sum_batch_tokens_ / steps_ : 0;
  st.prompt_tokens_total = prompt_tokens_total_;
  st.generation_tokens_total = generation_tokens_total_;
  st.requests_finished = finished_;
  st.requests_cancelled = cancelled_;
  if (prefix_cache_) {
    const PrefixCacheStats pc = prefix_cache_->stats();
    st.prefix_cache_enabled = true;
    st.prefix_queries = prefix_queries_;
    st.prefix_query_tokens = prefix_query_tokens_;
    st.prefix_hit_tokens = prefix_hit_tokens_;
    st.prefix_inserted_blocks = pc.inserted_blocks;
    st.prefix_evicted_blocks = pc.evicted_blocks;
    st.prefix_cached_blocks = pc.cached_blocks;
    st.prefix_evictable_blocks = evictable;
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
      if (!Step()) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock,
                 [&] {
          return stop_ || !inbox_.empty() || !cancels_.empty() || cancel_all_ ||
                 !clear_requests_.empty();
        });
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

}  // namespace kvserve
