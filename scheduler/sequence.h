// Sequence: one sample of a request as the engine tracks it, with an explicit
// lifecycle state and its token counters in one place; SequenceGroup: the
// request that owns its samples (n > 1 samples share the prompt's blocks and
// fork when the prompt is in). The engine thread owns both; nothing here is
// thread-safe.
//
// Lifecycle (every transition goes through Sequence::set_state, which checks
// it):
//
//   kWaiting ──admit──> kRunning ──finish──> kFinished
//      │  ^               │   ^  │
//      │  └──preempt─ kPreempted │ (recompute: blocks freed, queued again)
//      │                  │      │
//      └──admit with KV arriving──> kKvArriving ──KV landed──> kRunning
//
// Any state may go to kFinished (cancel, deadline, error). A kKvArriving
// sequence holds blocks that a tier load or a remote transfer is filling;
// the scheduler never puts it in a batch until the load completes, then it
// runs from the loaded tokens on (or, if the load failed, recomputes them).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "grammar/structured_output.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/request.h"

namespace kvserve {

enum class SeqState { kWaiting, kRunning, kPreempted, kKvArriving, kFinished };
const char* SeqStateName(SeqState s);

struct SequenceGroup;
class KvLoad;

class Sequence {
 public:
  // `tokens`: the prompt, or a parent's tokens at a fork.
  Sequence(SequenceGroup* group, int32_t index, std::vector<int32_t> tokens, KvPool* pool,
           const Tokenizer* tokenizer);

  SequenceGroup* group() const { return group_; }
  int32_t index() const { return index_; }
  SeqState state() const { return state_; }
  // REQUIRES: the transition is one the diagram above allows (CHECKed).
  void set_state(SeqState next);
  bool finished() const { return state_ == SeqState::kFinished; }
  bool waiting() const { return state_ == SeqState::kWaiting || state_ == SeqState::kPreempted; }

  // Token counters. Invariants (CheckInvariants):
  //   tokens() = prompt, then every committed sampled token;
  //   0 <= kv.num_committed <= kv.num_computed <= kv.table.num_tokens();
  //   num_computed_tokens() = kv.num_computed + kv.position_shift: tokens
  //     whose K/V were computed (slots hold them, less what a KV policy
  //     dropped) <= num_tokens() + num_speculative (the forward writes K/V
  //     only of tokens it was given);
  //   num_cached_prompt <= num_prompt (fixed at the first admission);
  //   a running sequence's uncomputed input is num_tokens() -
  //     num_computed_tokens().
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t num_prompt() const { return num_prompt_; }
  int32_t num_generated() const { return num_tokens() - num_prompt_; }
  int32_t num_computed_tokens() const { return kv.num_computed + kv.position_shift; }
  // Input: tokens() then the unverified draft.
  int32_t num_input_tokens() const { return num_tokens() + num_speculative(); }
  int32_t input_token(int32_t i) const {
    return i < num_tokens() ? tokens_[static_cast<size_t>(i)]
                            : draft_[static_cast<size_t>(i - num_tokens())];
  }
  int32_t remaining_input() const { return num_input_tokens() - num_computed_tokens(); }
  bool decoding() const { return remaining_input() == 1 && num_generated() > 0; }
  absl::Span<const int32_t> prompt() const {
    return absl::MakeConstSpan(tokens_).first(static_cast<size_t>(num_prompt_));
  }
  absl::Span<const int32_t> generated() const {
    return absl::MakeConstSpan(tokens_).subspan(static_cast<size_t>(num_prompt_));
  }
  // Appends one committed sampled token.
  void AppendToken(int32_t token) { tokens_.push_back(token); }
  // Draft tokens (EngineRequest::draft_tokens) not yet verified: scheduled
  // and computed past tokens(), never committed. The output processor pops
  // the accepted ones (they become sampled tokens) and drops the rest.
  const std::vector<int32_t>& draft() const { return draft_; }
  int32_t num_speculative() const { return static_cast<int32_t>(draft_.size()); }
  // speculative: the draft is a proposer's guess (scheduler/speculation.h),
  // not the request's draft_tokens; its kept tokens count in spec_accepted.
  void SetDraft(std::vector<int32_t> draft, bool speculative = false) {
    draft_ = std::move(draft);
    draft_speculative_ = speculative && !draft_.empty();
  }
  void PopDraftFront() {
    draft_.erase(draft_.begin());
    if (draft_.empty()) draft_speculative_ = false;
  }
  void ClearDraft() {
    draft_.clear();
    draft_speculative_ = false;
  }
  bool draft_speculative() const { return draft_speculative_; }
  int32_t draft_accepted = 0;  // of the request's draft_tokens, verified and kept
  int32_t spec_accepted = 0;   // of speculative drafts, verified and kept
  // The sequence-level invariants above (the KV counters' own are
  // KvCacheManager::CheckInvariants'); aborts naming the broken one.
  void CheckInvariants() const;

  // The sequence's KV state; only KvCacheManager changes it.
  SeqKv kv;
  int32_t num_cached_prompt = 0;  // prompt tokens the first admission found cached
  // Of those, loaded from the host and the disk tier (the rest: the primary pool).
  int32_t num_cached_host = 0;
  int32_t num_cached_disk = 0;
  // Of num_cached_prompt, K/V a tier re-encoded lossily (--kv-host-dtype):
  // matched from lossy radix nodes or loaded from a lossy tier.
  int32_t num_cached_lossy = 0;
  // Ever ran on K/V a tier re-encoded lossily (also after a preemption's
  // re-admission): its output is not what exact K/V gives.
  bool lossy_kv = false;
  bool ever_admitted = false;
  int64_t admit_order = 0;        // admission counter: later admitted, preempted first
  // Token eviction (group's request kv_policy): per slot, the attention mass
  // it received (h2o) and the query tokens that could attend it since it was
  // written (the age that normalises the mass). Reset with the KV.
  std::vector<float> attention_score;
  std::vector<int32_t> attention_age;
  // Set while kKvArriving: the load filling tokens [kv.num_computed,
  // kv.num_computed + arriving_tokens).
  std::shared_ptr<KvLoad> arriving;
  int32_t arriving_tokens = 0;

  Sampler& sampler() { return *sampler_; }
  StreamingDetokenizer& detok() { return *detok_; }
  StopStringMatcher& stops() { return *stops_; }
  // The request's grammar as this sample has followed it; null without one.
  TokenConstraint* constraint() { return constraint_.get(); }

 private:
  SequenceGroup* group_;
  int32_t index_;
  SeqState state_ = SeqState::kWaiting;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> draft_;
  bool draft_speculative_ = false;
  int32_t num_prompt_;
  std::unique_ptr<Sampler> sampler_;
  std::unique_ptr<StreamingDetokenizer> detok_;
  std::unique_ptr<StopStringMatcher> stops_;
  std::unique_ptr<TokenConstraint> constraint_;
};

// A request: n samples of one prompt. Until the fork, seqs holds only the
// parent (sample 0); the fork adds samples 1..n-1 sharing its blocks.
struct SequenceGroup {
  uint64_t id = 0;
  int64_t arrival = 0;
  EngineRequest request;
  EventCallback callback;
  std::vector<std::unique_ptr<Sequence>> seqs;
  bool forked = false;
  bool done = false;  // the group was finished as a whole (cancel, deadline, error)
  int32_t num_finished = 0;

  int32_t priority() const { return request.priority; }
  const std::string& salt() const { return request.cache_salt; }
  // Every sample has finished (an unforked n > 1 request has samples to come).
  bool complete() const {
    return num_finished >= static_cast<int32_t>(seqs.size()) && (forked || request.n == 1);
  }
};

}  // namespace kvserve
