// Scheduler: decides each engine step. It owns the waiting and running
// queues (of the engine's Sequences), admission (FCFS or longest cached
// prefix first, static batching for comparison), preemption by recompute
// when blocks run out, and the step's token budget — and returns the
// decision as a plain-data BatchPlan. Every block it needs it asks of the
// KvCacheManager; it never runs the model and never samples.
//
// Stall-free steps (Sarathi-Serve's idea, sized by measurement): decode
// tokens of running sequences are scheduled first, then prefill chunks. While
// any sequence is decoding, the step's prefill is capped so that the step's
// predicted time stays within the inter-token-latency target: a StepCostModel
// fitted online to the steps the engine actually ran (seconds = a + b *
// tokens) turns the target into a token budget. Without decoders (nobody to
// stall) a step takes the whole max_batched_tokens.
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "scheduler/batch_plan.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_loader.h"
#include "scheduler/sequence.h"

namespace kvserve {

// Seconds one step takes, learned from the steps the engine ran. A step is
// its decode tokens (one per decoding sequence, each with an output-head row
// and a sample) plus its prefill tokens:
//   seconds = decode(d) + (p > 0 ? prefill(p) : 0)
// decode(d) = a + b * d is a line fitted by exponentially weighted least
// squares to the steps without prefill (proportional until it has seen two
// different d); prefill(p) = c + s * p is a second line, fitted the same way
// to what prefill added to the other steps beyond decode(d) (proportional,
// c = 0, until their chunk sizes differ). The intercept c is what a step
// pays for carrying any prefill at all (on a GPU: the prefill kernels'
// launches and shapes); priced per token instead, it is spread thin over
// whole prompts run while nobody decodes, and the chunks sized beside
// decodes then overshoot the stall-free bound. Recent steps count most (the
// machine and the batch's context lengths drift). Before any decode-only
// step, every token is priced at the mean seconds per token seen so far.
class StepCostModel {
 public:
  explicit StepCostModel(double decay = 0.97) : decay_(decay) {}
  void Observe(int32_t decode_tokens, int32_t prefill_tokens, double seconds);
  bool ready() const { return all_tokens_ > 0; }
  // Predicted seconds of a step with d decode tokens and no prefill.
  double PredictDecode(int32_t d) const;
  double Predict(int32_t d, int32_t p) const {
    return PredictDecode(d) +
           (p > 0 ? prefill_fixed_seconds() + p * prefill_seconds_per_token() : 0);
  }
  // The prefill line's slope s (what one more prompt token costs) and
  // intercept c (what carrying any prefill costs a step).
  double prefill_seconds_per_token() const;
  double prefill_fixed_seconds() const;
  // The most prefill tokens a step with d decode tokens can take within
  // `seconds` (>= 0).
  int32_t PrefillTokensWithin(int32_t d, double seconds) const;
  double fixed_seconds() const { return a_; }
  double decode_seconds_per_token() const { return b_; }

 private:
  // Exponentially weighted sums of (x, y) points.
  struct WeightedLine {
    double w = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    void Add(double x, double y, double decay);
    // Proportional (intercept 0) until the points' x clearly differ; then
    // the least-squares line, if its slope is positive and its intercept not
    // negative (time never falls as a step grows).
    void Fit(double* intercept, double* slope) const;
  };
  // Refits both lines from the sums (once per observation, not per query).
  void Fit();
  double decay_;
  // Decode-only steps (x = decode tokens, y = seconds) and their line a + b x.
  WeightedLine decode_;
  double a_ = 0, b_ = 0;
  // Steps with prefill (x = prefill tokens, y = the seconds they added
  // beyond the decode line) and their line pc_ + ps_ x.
  WeightedLine prefill_;
  double pc_ = 0, ps_ = 0;
  // Every step: tokens and seconds (the fallback price).
  double all_tokens_ = 0, all_seconds_ = 0;
};

// Waiting-queue order within a priority: kFcfs (arrival) or kLpm (longest
// cached prefix first, SGLang's policy).
enum class SchedulePolicy { kFcfs, kLpm };

struct SchedulerOptions {
  int32_t max_batched_tokens = 512;
  int32_t max_seqs = 64;
  bool static_batching = false;
  SchedulePolicy policy = SchedulePolicy::kFcfs;
  int32_t lpm_max_waiting = 128;
  // Stall-free steps: a step that carries decode tokens is predicted to take
  // at most target_itl_ms, or when that is 0, at most max_stall_factor times
  // what its decode tokens alone would take (0 and 0: no limit; every step
  // may use max_batched_tokens).
  double target_itl_ms = 0;
  double max_stall_factor = 0;
  // Prefill tokens a step with decoders still gets, whatever the target, so a
  // prompt always progresses.
  int32_t min_prefill_tokens = 16;
};

class Scheduler {
 public:
  // REQUIRES: kv (and loader, if any) outlive the scheduler.
  Scheduler(const SchedulerOptions& options, KvCacheManager* kv, KvLoader* loader);

  // A new sequence, or one the engine resubmits: joins the waiting queue.
  void AddWaiting(Sequence* s);
  // A forked sample: runs from the next step with its parent's blocks.
  void AddRunning(Sequence* s);
  // Drops finished sequences from every queue.
  void RemoveFinished();
  // s (kKvArriving) is finishing before its load completed: its KV and the
  // load move here, and the blocks return to the pool only once the load is
  // done (a late write never lands in a reused block).
  void AbandonLoad(Sequence* s);

  // Decides the next step: polls KV loads, orders the queues, schedules
  // decodes, then prefill chunks of running sequences, then admits waiting
  // ones, preempting (recompute) when blocks run out. Slots for every
  // scheduled token are allocated when this returns.
  BatchPlan Schedule();
  // The step ran in `seconds` (feeds the stall-free budget).
  void ObserveStep(const BatchPlan& plan, double seconds);

  const std::vector<Sequence*>& running() const { return running_; }
  const std::vector<Sequence*>& waiting() const { return waiting_; }
  const std::vector<Sequence*>& arriving() const { return arriving_; }
  bool idle() const { return running_.empty() && waiting_.empty() && !loads_pending(); }
  // Whether the next step will carry prompt chunks: a running sequence
  // still has prompt to compute, or a waiting one could be admitted (fewer
  // than max_seqs run).
  bool prompts_pending() const;
  // Loads in flight (parked sequences and abandoned ones): the engine polls.
  bool loads_pending() const { return !arriving_.empty() || !abandoned_.empty(); }
  const StepCostModel& cost_model() const { return cost_; }

  int64_t preemptions() const { return preemptions_; }
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  int64_t prompt_tokens_total() const { return prompt_tokens_total_; }
  int64_t kv_loads() const { return kv_loads_; }
  int64_t kv_load_failures() const { return kv_load_failures_; }

 private:
  int32_t StepBudget(int32_t decode_tokens, bool decoders) const;
  void PollArrivals();
  void OrderWaiting();
  // Slots for `take` more tokens of s, preempting later-admitted sequences
  // (or s itself) while blocks are short. False when s was preempted or
  // cannot get them.
  bool Reserve(Sequence* s, int32_t take, BatchPlan* plan);
  void Preempt(Sequence* s, BatchPlan* plan);
  void Schedule(Sequence* s, int32_t take, BatchPlan* plan);
  // Admission of waiting sequences while budget and blocks allow.
  void Admit(BatchPlan* plan);
  // Parks s in kKvArriving when the loader supplies tokens past its match.
  bool StartLoad(Sequence* s);

  SchedulerOptions options_;
  KvCacheManager* kv_;
  KvLoader* loader_;
  StepCostModel cost_;
  std::vector<Sequence*> running_;   // sorted: priority desc, admission asc
  std::vector<Sequence*> waiting_;   // sorted: priority desc, arrival asc (or LPM)
  std::vector<Sequence*> arriving_;  // kKvArriving, in admission order
  struct Abandoned {
    SeqKv kv;
    std::shared_ptr<KvLoad> load;
  };
  std::vector<Abandoned> abandoned_;
  int64_t admit_counter_ = 0;
  int64_t preemptions_ = 0;
  int64_t prefix_queries_ = 0, prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0;
  int64_t prompt_tokens_total_ = 0;
  int64_t kv_loads_ = 0, kv_load_failures_ = 0;
};

}  // namespace kvserve
