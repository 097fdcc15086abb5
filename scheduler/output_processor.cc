#include "scheduler/output_processor.h"

#include <algorithm>
#include <string>
#include <utility>

namespace kvserve {

OutputProcessor::OutputProcessor(KvCacheManager* kv, Scheduler* scheduler,
                                 const Tokenizer* tokenizer, KvEvictorOptions eviction)
    : kv_(kv), scheduler_(scheduler), tokenizer_(tokenizer), evictor_(kv, eviction) {}

std::unique_ptr<Sequence> OutputProcessor::NewSample(SequenceGroup* g, int32_t index,
                                                     const std::vector<int32_t>& tokens) const {
  return std::make_unique<Sequence>(g, index, tokens, kv_->mutable_pool(), tokenizer_);
}

SeqEvent OutputProcessor::Event(const Sequence& s) const {
  SeqEvent ev;
  ev.request_id = s.group()->id;
  ev.index = s.index();
  ev.prompt_tokens = s.num_prompt();
  ev.completion_tokens = s.num_generated();
  ev.cached_tokens = s.num_cached_prompt;
  ev.cached_host_tokens = s.num_cached_host;
  ev.cached_disk_tokens = s.num_cached_disk;
  ev.cached_lossy_tokens = s.num_cached_lossy;
  ev.lossy_kv = s.lossy_kv;
  ev.dropped_tokens = s.kv.position_shift;
  ev.draft_accepted = s.draft_accepted;
  return ev;
}

void OutputProcessor::Process(const BatchPlan& plan, const StepResult& result) {
  const absl::Span<const float> logits = result.logits;
  const int32_t vocab_size = result.vocab_size;
  // Every scheduled input token but a draft's is a committed token: the
  // K/V the forward wrote are final, and blocks they complete become
  // shareable at once — a request with the same prefix arriving now reuses
  // them even while this one still runs. Draft tokens commit once accepted.
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    Sequence* s = c.seq;
    kv_->MarkComputed(&s->kv, c.num_tokens);
    CommitFinal(s);
    if (result.attention_mass != nullptr &&
        s->group()->request.kv_policy.kind == KvPolicy::Kind::kH2O) {
      evictor_.AddAttention(s, result.attention_mass + i * result.n_kv_heads * result.mass_stride,
                            result.n_kv_heads, result.mass_stride, c.first_slot, c.num_tokens);
    }
  }
  auto row_at = [&](int32_t row) {
    return logits.subspan(static_cast<size_t>(row) * static_cast<size_t>(vocab_size),
                          static_cast<size_t>(vocab_size));
  };
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    Sequence* s = plan.chunks[i].seq;
    const int32_t first_row = result.row_offsets[i], end_row = result.row_offsets[i + 1];
    if (first_row == end_row) continue;
    if (s->finished()) continue;  // e.g. cancelled by a callback during this step
    if (s->num_speculative() > 0) {
      Verify(s, result.row_positions[i], first_row, end_row, row_at);
      continue;
    }
    const absl::Span<const float> r = row_at(first_row);
    SequenceGroup* g = s->group();
    // A request with n > 1 forks when its prompt is in: the samples share
    // every prompt block and copy only the partial last one.
    const size_t first_child = g->seqs.size();
    if (!g->forked && g->request.n > 1) Fork(s);
    std::vector<Sequence*> targets = {s};
    for (size_t j = first_child; j < g->seqs.size(); ++j) targets.push_back(g->seqs[j].get());
    for (Sequence* t : targets) {
      const SampleResult res = SampleNext(t, r);
      EmitToken(t, res.token, res.logprob);
    }
  }
  // Token eviction, once this step's K/V are in and its tokens out.
  for (const ScheduledChunk& c : plan.chunks) {
    Sequence* s = c.seq;
    if (!s->finished() && s->group()->request.kv_policy.kind != KvPolicy::Kind::kNone) {
      evictor_.MaybeCompact(s);
    }
  }
}

void OutputProcessor::CommitFinal(Sequence* s) {
  // Slots past tokens() hold draft tokens: computed, not final.
  const int32_t final_slots = std::min(s->kv.num_computed, s->num_tokens());
  if (final_slots > s->kv.num_committed) {
    kv_->Commit(&s->kv, s->group()->salt(), s->tokens(), final_slots - s->kv.num_committed);
  }
}

void OutputProcessor::Verify(Sequence* s, int32_t first_position, int32_t first_row,
                             int32_t end_row,
                             const std::function<absl::Span<const float>(int32_t)>& row_at) {
  // Row k holds the logits at position first_position + k, which decide the
  // token at the next position. Each one the sampler would pick is kept as
  // if decoded (EmitToken: stop strings, EOS and max_tokens apply); the
  // first disagreement keeps the sampler's token instead and drops the rest
  // of the draft with its KV.
  for (int32_t row = first_row; row < end_row && !s->finished(); ++row) {
    const int32_t position = first_position + (row - first_row);
    if (position != s->num_tokens() - 1) break;  // the draft was rejected before this row
    // Every token so far has its K/V computed and is final: commit them
    // before emitting (which may finish the sequence), so a finished
    // sequence caches exactly what it would have without a draft — not the
    // K/V of an accepted token that a plain decode would not have computed yet.
    CommitFinal(s);
    // A draft token the grammar forbids is never the masked sample: the
    // grammar checks the draft here, one accepted token at a time.
    const SampleResult res = SampleNext(s, row_at(row));
    if (s->num_speculative() == 0) {
      EmitToken(s, res.token, res.logprob);  // the draft is all in: the next token
      break;
    }
    if (res.token == s->draft().front()) {
      ++(s->draft_speculative() ? s->spec_accepted : s->draft_accepted);
      s->PopDraftFront();
      EmitToken(s, res.token, res.logprob);
      continue;
    }
    s->ClearDraft();
    kv_->Truncate(&s->kv, s->num_tokens());
    EmitToken(s, res.token, res.logprob);
    break;
  }
  if (!s->finished()) CommitFinal(s);
}

void OutputProcessor::Fork(Sequence* parent) {
  SequenceGroup* g = parent->group();
  for (int32_t i = 1; i < g->request.n; ++i) {
    std::unique_ptr<Sequence> child = NewSample(g, i, parent->tokens());
    child->kv = kv_->Fork(parent->kv);
    child->num_cached_prompt = parent->num_cached_prompt;
    child->num_cached_host = parent->num_cached_host;
    child->num_cached_disk = parent->num_cached_disk;
    child->num_cached_lossy = parent->num_cached_lossy;
    child->lossy_kv = parent->lossy_kv;
    child->ever_admitted = true;
    child->admit_order = parent->admit_order;
    child->set_state(SeqState::kRunning);
    scheduler_->AddRunning(child.get());
    g->seqs.push_back(std::move(child));
  }
  g->forked = true;
}

SampleResult OutputProcessor::SampleNext(Sequence* s, absl::Span<const float> row) {
  TokenConstraint* c = s->constraint();
  if (c == nullptr) return s->sampler().Sample(row, s->prompt(), s->generated());
  mask_.resize(MaskWords(static_cast<int32_t>(row.size())));
  const bool apply = c->FillMask(absl::MakeSpan(mask_));
  return s->sampler().Sample(row, s->prompt(), s->generated(),
                             apply ? absl::MakeConstSpan(mask_) : absl::Span<const uint32_t>());
}

void OutputProcessor::EmitToken(Sequence* s, int32_t token, float logprob) {
  const SamplingParams& p = s->group()->request.params;
  if (TokenConstraint* c = s->constraint()) {
    // The token came from the grammar's mask, so it is accepted; a stop
    // token is allowed only where the grammar is complete, and ends the
    // sample (whatever ignore_eos says: the grammar has nothing after it).
    // A token the grammar refuses (never, short of a bug) ends it too
    // rather than emit text outside the grammar.
    if (!c->Accept(token) || c->IsTerminated()) {
      FinishSequence(s, FinishReason::kStop);
      return;
    }
  }
  const bool is_stop_id =
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
  if ((!p.ignore_eos && tokenizer_->IsEndOfGeneration(token)) || is_stop_id) {
    FinishSequence(s, FinishReason::kStop);
    return;
  }
  s->AppendToken(token);
  ++generation_tokens_total_;
  SeqEvent ev = Event(*s);
  ev.token_ids.push_back(token);
  if (p.logprobs) ev.logprobs.push_back(logprob);
  ev.text = s->stops().Push(s->detok().Push(token));
  s->group()->callback(ev);
  if (s->stops().stopped()) {
    FinishSequence(s, FinishReason::kStop);
  } else if (s->num_generated() >= p.max_tokens) {
    FinishSequence(s, FinishReason::kLength);
  }
}

void OutputProcessor::FinishSequence(Sequence* s, FinishReason reason) {
  if (s->finished()) return;
  s->ClearDraft();  // unverified: never cached (Free keeps committed slots only)
  if (reason == FinishReason::kStop || reason == FinishReason::kLength) {
    // Release what the detokenizer and the stop matcher held back.
    if (!s->stops().stopped()) {
      std::string tail = s->stops().Push(s->detok().Flush());
      tail += s->stops().Flush();
      if (!tail.empty()) {
        SeqEvent ev = Event(*s);
        ev.text = std::move(tail);
        s->group()->callback(ev);
      }
    }
  }
  if (s->state() == SeqState::kKvArriving) {
    // A load is still writing into its blocks: they stay pinned, with the
    // scheduler, until it completes.
    scheduler_->AbandonLoad(s);
  } else {
    kv_->Free(&s->kv, s->group()->salt(), s->tokens());
  }
  s->set_state(SeqState::kFinished);
  ++s->group()->num_finished;
  SeqEvent ev = Event(*s);
  ev.finish = reason;
  s->group()->callback(ev);
}

void OutputProcessor::FinishGroup(SequenceGroup* g, FinishReason reason) {
  if (g->done) return;
  g->done = true;
  if (reason == FinishReason::kCancelled || reason == FinishReason::kDeadline) {
    ++requests_cancelled_;
  }
  // Samples not yet forked finish too: a request reports n results.
  if (!g->forked && g->request.n > 1 && !g->seqs.empty()) {
    Sequence* parent = g->seqs[0].get();
    for (int32_t i = 1; i < g->request.n; ++i) {
      g->seqs.push_back(NewSample(g, i, parent->tokens()));
    }
    g->forked = true;
  }
  for (auto& s : g->seqs) FinishSequence(s.get(), reason);
}

}  // namespace kvserve
