#include "scheduler/scheduler.h"

#include "scheduler/kv_tiers.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace kvserve {

// ---- StepCostModel ----

void StepCostModel::WeightedLine::Add(double x, double y, double decay) {
  w = decay * w + 1;
  sx = decay * sx + x;
  sy = decay * sy + y;
  sxx = decay * sxx + x * x;
  sxy = decay * sxy + x * y;
}

void StepCostModel::WeightedLine::Fit(double* intercept, double* slope) const {
  *intercept = 0;
  *slope = sx > 0 ? sy / sx : 0;
  const double var = sxx * w - sx * sx;
  // Only trust a line through points of clearly different sizes (relative
  // spread, so one odd step does not tilt it).
  if (var > 1e-3 * sxx * w) {
    const double b = (sxy * w - sx * sy) / var;
    const double a = (sy - b * sx) / w;
    if (b > 0 && a >= 0) {
      *intercept = a;
      *slope = b;
    }
  }
}

void StepCostModel::Observe(int32_t decode_tokens, int32_t prefill_tokens, double seconds) {
  if (decode_tokens < 0 || prefill_tokens < 0 || decode_tokens + prefill_tokens == 0 ||
      !(seconds >= 0) || !std::isfinite(seconds)) {
    return;
  }
  if (prefill_tokens == 0) {
    decode_.Add(decode_tokens, seconds, decay_);
  } else {
    // What the prefill added: the step minus its decode tokens' share
    // (priced by the line so far; the fallback price without one). Never
    // negative: noise must not make prefill look free.
    prefill_.Add(prefill_tokens, std::max(0.0, seconds - PredictDecode(decode_tokens)), decay_);
  }
  all_tokens_ = decay_ * all_tokens_ + decode_tokens + prefill_tokens;
  all_seconds_ = decay_ * all_seconds_ + seconds;
  Fit();
}

void StepCostModel::Fit() {
  prefill_.Fit(&pc_, &ps_);
  if (decode_.w == 0) {
    a_ = 0;
    b_ = all_tokens_ > 0 ? all_seconds_ / all_tokens_ : 0;
    return;
  }
  decode_.Fit(&a_, &b_);
}

double StepCostModel::PredictDecode(int32_t d) const { return a_ + b_ * d; }

double StepCostModel::prefill_seconds_per_token() const {
  if (ps_ > 0) return ps_;
  return all_tokens_ > 0 ? all_seconds_ / all_tokens_ : 0;
}

double StepCostModel::prefill_fixed_seconds() const { return pc_; }

int32_t StepCostModel::PrefillTokensWithin(int32_t d, double seconds) const {
  const double per = prefill_seconds_per_token();
  if (per <= 0) return INT32_MAX;
  // The epsilon keeps an exact fit (50 ms at 1 ms a token) from flooring to 49.
  const double n =
      std::floor((seconds - PredictDecode(d) - prefill_fixed_seconds()) / per + 1e-9);
  if (n <= 0) return 0;
  return n >= INT32_MAX ? INT32_MAX : static_cast<int32_t>(n);
}

// ---- Scheduler ----

Scheduler::Scheduler(const SchedulerOptions& options, KvCacheManager* kv, KvLoader* loader)
    : options_(options), kv_(kv), loader_(loader) {}

void Scheduler::AddWaiting(Sequence* s) { waiting_.push_back(s); }

void Scheduler::AddRunning(Sequence* s) { running_.push_back(s); }

void Scheduler::RemoveFinished() {
  auto gone = [](Sequence* s) { return s->finished(); };
  running_.erase(std::remove_if(running_.begin(), running_.end(), gone), running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), gone), waiting_.end());
  arriving_.erase(std::remove_if(arriving_.begin(), arriving_.end(), gone), arriving_.end());
}

int32_t Scheduler::StepBudget(int32_t decode_tokens, bool decoders) const {
  const int32_t cap = options_.max_batched_tokens;
  // Nobody to stall, no limit asked for, or nothing measured yet: the whole
  // budget.
  if (!decoders || !cost_.ready()) return cap;
  double target_s;
  if (options_.target_itl_ms > 0) {
    target_s = options_.target_itl_ms / 1000.0;
  } else if (options_.max_stall_factor > 0) {
    target_s = options_.max_stall_factor * cost_.PredictDecode(decode_tokens);
  } else {
    return cap;
  }
  const int64_t prefill = std::max(cost_.PrefillTokensWithin(decode_tokens, target_s),
                                   options_.min_prefill_tokens);
  return static_cast<int32_t>(std::min<int64_t>(cap, decode_tokens + prefill));
}

void Scheduler::AbandonLoad(Sequence* s) {
  abandoned_.push_back(Abandoned{std::move(s->kv), std::move(s->arriving)});
  kv_->Discard(&s->kv);  // the moved-from table is empty; reset its counters
  s->arriving_tokens = 0;
}

void Scheduler::PollArrivals() {
  for (auto it = abandoned_.begin(); it != abandoned_.end();) {
    if (!it->load->Done()) {
      ++it;
      continue;
    }
    kv_->Discard(&it->kv);  // never cached: nobody checked what arrived
    it = abandoned_.erase(it);
  }
  for (auto it = arriving_.begin(); it != arriving_.end();) {
    Sequence* s = *it;
    if (!s->arriving->Done()) {
      ++it;
      continue;
    }
    const absl::Status st = s->arriving->status();
    if (st.ok()) {
      // Before Commit: the loaded blocks enter the radix index marked lossy.
      if (s->arriving->sources().lossy_tokens > 0) {
        kv_->MarkReencoded(&s->kv);
        s->lossy_kv = true;
      }
      kv_->MarkComputed(&s->kv, s->arriving_tokens);
      kv_->Commit(&s->kv, s->group()->salt(), s->tokens(), s->arriving_tokens);
      if (s->num_cached_prompt < s->num_prompt()) {
        const int32_t before = s->num_cached_prompt;
        s->num_cached_prompt = std::min(s->num_prompt(), s->kv.num_computed);
        // Loaded prompt tokens count as cached (the total over every tier)
        // and, split by tier, in the sequence's own counters.
        const int32_t gained = s->num_cached_prompt - before;
        const KvLoadSources src = s->arriving->sources();
        const int32_t host = std::min(gained, src.host_tokens);
        s->num_cached_host += host;
        s->num_cached_disk += std::min(gained - host, src.disk_tokens);
        s->num_cached_lossy += std::min(gained, src.lossy_tokens);
        if (kv_->prefix_cache_enabled()) prefix_hit_tokens_ += gained;
      }
    } else {
      // Recompute what did not arrive; its slots are dropped.
      ++kv_load_failures_;
      kv_->Truncate(&s->kv, s->kv.num_computed);
    }
    s->arriving.reset();
    s->arriving_tokens = 0;
    s->set_state(SeqState::kRunning);
    running_.push_back(s);
    it = arriving_.erase(it);
  }
}

namespace {

// Draft tokens (EngineRequest::draft_tokens) verified per step at most: a
// draft rejected at its first token wastes at most this many positions of
// forward and output-head rows (every draft position needs its logits), and a
// right one still turns N decode steps into N / 16.
constexpr int32_t kDraftTokensPerStep = 16;

// The input `s` may compute this step: all of it, but a draft in pieces.
int32_t InputThisStep(const Sequence* s) {
  const int32_t rest = s->remaining_input();
  if (s->num_speculative() == 0) return rest;
  const int32_t verified_left = std::max(0, s->num_tokens() - s->num_computed_tokens());
  return std::min(rest, verified_left + kDraftTokensPerStep);
}

}  // namespace

bool Scheduler::prompts_pending() const {
  if (!waiting_.empty() && static_cast<int32_t>(running_.size()) < options_.max_seqs) return true;
  for (const Sequence* s : running_) {
    if (s->state() == SeqState::kRunning && !s->decoding()) return true;
  }
  return false;
}

void Scheduler::Schedule(Sequence* s, int32_t take, BatchPlan* plan) {
  ScheduledChunk c;
  c.seq = s;
  c.request_id = s->group()->id;
  c.sample_index = s->index();
  c.first_slot = s->kv.num_computed;
  c.num_tokens = take;
  c.sample = take == s->remaining_input();
  // A lone last token costs what a decode token costs (an output-head row
  // and a sample), whether it follows a sampled token or ends a prompt.
  c.prefill = !(take == 1 && c.sample);
  plan->chunks.push_back(c);
  plan->num_tokens += take;
  (c.prefill ? plan->num_prefill_tokens : plan->num_decode_tokens) += take;
  if (s->num_computed_tokens() < s->num_prompt()) {
    prompt_tokens_total_ += std::min(take, s->num_prompt() - s->num_computed_tokens());
  }
}

void Scheduler::Preempt(Sequence* s, BatchPlan* plan) {
  // Recompute: drop every block (the prefix cache keeps what it can); the
  // prompt and the tokens generated so far are prefilled again when the
  // sequence is readmitted, with the same sampler, so its output is exactly
  // what it would have been.
  kv_->Free(&s->kv, s->group()->salt(), s->tokens());
  s->attention_score.clear();  // the eviction state goes with the KV
  s->attention_age.clear();
  s->set_state(SeqState::kPreempted);
  running_.erase(std::find(running_.begin(), running_.end(), s));
  waiting_.push_back(s);
  ++preemptions_;
  plan->preempted.push_back(s->group()->id);
}

bool Scheduler::Reserve(Sequence* s, int32_t take, BatchPlan* plan) {
  for (;;) {
    const absl::Status st = kv_->AllocateSlots(&s->kv, take);
    if (st.ok()) return true;
    if (!absl::IsResourceExhausted(st)) return false;
    // Cached blocks no running sequence uses go before any preemption.
    if (kv_->EnsureFree(kv_->BlocksNeeded(s->kv, take))) continue;
    Sequence* victim = nullptr;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      const bool in_batch = std::any_of(plan->chunks.begin(), plan->chunks.end(),
                                        [&](const ScheduledChunk& c) { return c.seq == *it; });
      if (!in_batch) {
        victim = *it;
        break;
      }
    }
    if (victim == nullptr) return false;
    Preempt(victim, plan);
    if (victim == s) return false;
  }
}

void Scheduler::OrderWaiting() {
  std::unordered_map<const Sequence*, int32_t> cached_len;
  const bool lpm = kv_->prefix_cache_enabled() && options_.policy == SchedulePolicy::kLpm &&
                   static_cast<int32_t>(waiting_.size()) <= options_.lpm_max_waiting;
  if (lpm) {
    for (const Sequence* w : waiting_) {
      cached_len[w] = kv_->PeekPrefix(w->group()->salt(), w->tokens(), w->num_tokens() - 1);
    }
  }
  std::stable_sort(waiting_.begin(), waiting_.end(), [&](const Sequence* a, const Sequence* b) {
    if (a->group()->priority() != b->group()->priority()) {
      return a->group()->priority() > b->group()->priority();
    }
    if (lpm && cached_len[a] != cached_len[b]) return cached_len[a] > cached_len[b];
    return a->group()->arrival < b->group()->arrival;
  });
}

bool Scheduler::StartLoad(Sequence* s) {
  if (loader_ == nullptr) return false;
  int32_t from = s->kv.num_computed;
  const int32_t limit = s->num_tokens() - 1;  // the last token is computed here: its logits
  if (from >= limit) return false;
  int32_t n =
      std::min(loader_->LookupWorthLoading(s->group()->salt(), s->tokens(), from, limit,
                                           cost_.prefill_seconds_per_token()),
               limit - from);
  const int32_t bs = kv_->block_size();
  if (n <= 0 && from % bs != 0 && loader_->RematchWholeBlocks()) {
    // The radix match ended inside a block (a resident block that shares
    // only its first tokens: a BOS, a template header) and loaders supply
    // whole blocks: when one supplies more from the block boundary below,
    // match only whole blocks and load from there.
    const int32_t aligned = from - from % bs;
    n = std::min(loader_->LookupWorthLoading(s->group()->salt(), s->tokens(), aligned, limit,
                                             cost_.prefill_seconds_per_token()),
                 limit - aligned);
    if (aligned + n <= from) return false;  // no more from there: keep the partial match
    kv_->DropPartialMatch(&s->kv);
    from = s->kv.num_computed;
  }
  if (n <= 0) return false;
  if (!kv_->AllocateSlots(&s->kv, 0, 0, n).ok()) return false;
  // One table per KV cache group (one for a single-attention model); a
  // window group's blocks before the window of the load's end are parked.
  const std::vector<int32_t> group_first =
      kv_->hybrid() ? kv_->PrepareGroupLoad(&s->kv, from, from + n) : std::vector<int32_t>();
  auto block_ids = std::make_shared<std::vector<std::vector<int32_t>>>(kv_->num_groups());
  auto offsets = std::make_shared<std::vector<std::vector<int32_t>>>(kv_->num_groups());
  KvLoadTarget t;
  t.salt = s->group()->salt();
  t.tokens = s->tokens();
  t.first_slot = from;
  t.num_tokens = n;
  for (int32_t g = 0; g < kv_->num_groups(); ++g) {
    std::vector<int32_t>& ids = (*block_ids)[g];
    kv_->group_table(s->kv, g).AppendIds(&ids);
    (*offsets)[g] = {0, static_cast<int32_t>(ids.size())};
    const kernels::PagedKvView view = kv_->View(ids.data(), (*offsets)[g].data(), 1);
    if (g == 0) {
      t.view = view;
    } else {
      t.groups.push_back(KvLoadTarget::Group{view, group_first[g - 1]});
    }
  }
  std::shared_ptr<KvLoad> load = loader_->Start(t);
  if (load == nullptr) {
    kv_->Truncate(&s->kv, from);
    return false;
  }
  // The view's block table must outlive the load: keep it with the handle.
  struct Holder : KvLoad {
    std::shared_ptr<KvLoad> inner;
    std::shared_ptr<std::vector<std::vector<int32_t>>> ids, offsets;
    bool Done() override { return inner->Done(); }
    absl::Status status() override { return inner->status(); }
    KvLoadSources sources() override { return inner->sources(); }
  };
  auto h = std::make_shared<Holder>();
  h->inner = std::move(load);
  h->ids = std::move(block_ids);
  h->offsets = std::move(offsets);
  s->arriving = std::move(h);
  s->arriving_tokens = n;
  ++kv_loads_;
  return true;
}

void Scheduler::Admit(BatchPlan* plan) {
  OrderWaiting();
  const bool may_admit = !options_.static_batching || (running_.empty() && arriving_.empty());
  // Blocks that admitted sequences will still claim for input they have not
  // reserved yet (their remaining prompt chunks).
  int32_t pending_blocks = 0;
  for (Sequence* r : running_) {
    const int32_t unreserved = r->num_input_tokens() - r->kv.table.num_tokens();
    if (unreserved > 1) {
      // The full group reserves the rest of the prompt; a window group at
      // most its window and one chunk (it lets go as the chunks commit).
      pending_blocks += kv_->PeakBlocksNeeded(r->kv, r->num_input_tokens() - r->kv.num_computed,
                                              options_.max_batched_tokens);
    }
  }
  // Seats: running sequences count one each, and a request that has not
  // forked yet also holds seats for the n - 1 samples it forks at its first
  // token, so max_seqs bounds the samples that ever run together.
  auto seats_of = [](const Sequence* s) {
    const SequenceGroup* g = s->group();
    return !g->forked && g->request.n > 1 ? g->request.n : 1;
  };
  int32_t seats = 0;
  for (const Sequence* r : running_) seats += seats_of(r);
  for (const Sequence* r : arriving_) seats += seats_of(r);
  size_t admitted = 0;
  int32_t budget = plan->token_budget - plan->num_tokens;
  // Continuous batching admits while this step has token budget left; a
  // static batch is admitted whole (up to max_seqs) and prefills over the
  // next steps.
  while (may_admit && (budget > 0 || options_.static_batching) && admitted < waiting_.size() &&
         seats + seats_of(waiting_[admitted]) <= options_.max_seqs) {
    Sequence* s = waiting_[admitted];
    // Start from the longest cached prefix (at least the last token is
    // computed: its logits pick the next token), then admit only what the
    // pool can hold in full: the rest of the prompt plus what the sequence
    // generated before a preemption. FCFS: no overtaking.
    kv_->MatchPrefix(&s->kv, s->group()->salt(), s->tokens(), s->num_tokens() - 1);
    if (s->kv.reencoded) s->lossy_kv = true;
    const int32_t need = kv_->PeakBlocksNeeded(
        s->kv, s->num_input_tokens() - s->kv.num_computed, options_.max_batched_tokens);
    const int32_t free_before = kv_->num_free_blocks();
    if (!kv_->EnsureFree(need + pending_blocks)) {
      kv_->Discard(&s->kv);  // unpin the match; it is looked up again next time
      break;
    }
    bool parked = StartLoad(s);
    const int32_t take = parked ? 0 : std::min(budget, InputThisStep(s));
    if (!parked && !kv_->AllocateSlots(&s->kv, take).ok()) {
      kv_->Discard(&s->kv);
      break;
    }
    pending_blocks += need - (free_before - kv_->num_free_blocks());
    if (!s->ever_admitted) {
      s->ever_admitted = true;
      s->num_cached_prompt = std::min(s->kv.num_computed, s->num_prompt());
      s->num_cached_lossy = std::min(s->kv.num_lossy_matched, s->num_cached_prompt);
      if (kv_->prefix_cache_enabled()) {
        ++prefix_queries_;
        prefix_query_tokens_ += s->num_prompt();
        prefix_hit_tokens_ += s->num_cached_prompt;
      }
    }
    s->admit_order = admit_counter_++;
    seats += seats_of(s);
    ++admitted;
    ++plan->admitted;
    if (parked) {
      s->set_state(SeqState::kKvArriving);
      arriving_.push_back(s);
      continue;
    }
    s->set_state(SeqState::kRunning);
    running_.push_back(s);
    if (take > 0) {
      Schedule(s, take, plan);
      budget -= take;
    }
  }
  waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<int64_t>(admitted));
}

BatchPlan Scheduler::Schedule() {
  PollArrivals();
  BatchPlan plan;
  // Scheduling order: priority first, then the oldest admission. Victims for
  // preemption come from the back (lowest priority, most recently admitted).
  std::stable_sort(running_.begin(), running_.end(), [](const Sequence* a, const Sequence* b) {
    if (a->group()->priority() != b->group()->priority()) {
      return a->group()->priority() > b->group()->priority();
    }
    return a->admit_order < b->admit_order;
  });
  // Decode tokens go first; a step carries one per running sequence with one
  // token of input left (streams waiting for their next token, and prompts
  // whose last token is all that is left).
  int32_t decode_tokens = 0;
  bool decoders = false;
  for (const Sequence* s : running_) {
    decode_tokens += s->remaining_input() == 1 ? 1 : 0;
    decoders |= s->decoding();
  }
  plan.token_budget = StepBudget(decode_tokens, decoders);

  // 1. Running sequences: decode tokens first, then prefill chunks.
  for (int pass = 0; pass < 2 && plan.num_tokens < plan.token_budget; ++pass) {
    const std::vector<Sequence*> order = running_;
    for (Sequence* s : order) {
      const int32_t budget = plan.token_budget - plan.num_tokens;
      if (budget <= 0) break;
      if (s->state() != SeqState::kRunning) continue;  // preempted by an earlier reservation
      const bool one_token = s->remaining_input() == 1;
      if (one_token != (pass == 0)) continue;
      const int32_t take = std::min(budget, InputThisStep(s));
      if (Reserve(s, take, &plan)) Schedule(s, take, &plan);
    }
  }
  // 2. Admission.
  Admit(&plan);
  return plan;
}

void Scheduler::ObserveStep(const BatchPlan& plan, double seconds) {
  cost_.Observe(plan.num_decode_tokens, plan.num_prefill_tokens, seconds);
}

}  // namespace kvserve
