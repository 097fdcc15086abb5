#include "scheduler/model_runner.h"

#include <algorithm>
#include <utility>

#include "scheduler/sequence.h"

namespace kvserve {

ModelRunner::ModelRunner(std::shared_ptr<ForwardBackend> backend, KvCacheManager* kv,
                         ThreadPool* pool)
    : backend_(std::move(backend)), kv_(kv), pool_(pool) {}

absl::StatusOr<StepResult> ModelRunner::Run(const BatchPlan& plan) {
  tokens_.clear();
  token_seq_.clear();
  positions_.clear();
  slots_.clear();
  logit_rows_.clear();
  row_offsets_.assign(1, 0);
  row_positions_.clear();
  block_ids_.clear();
  block_offsets_.assign(1, 0);
  const int32_t n_groups = kv_->num_groups();
  group_ids_.resize(n_groups > 1 ? n_groups : 0);
  group_offsets_.resize(group_ids_.size());
  for (size_t g = 0; g < group_ids_.size(); ++g) {
    group_ids_[g].clear();
    group_offsets_[g].assign(1, 0);
  }
  // Plain sequences (slot == position) send no slot array: the kernels then
  // use the positions, and the bytes and speed are exactly the old ones.
  bool shifted = false;
  int64_t mass_stride = 0;  // slots per mass row; 0: nobody needs attention mass
  mass_wanted_.assign(plan.chunks.size(), 0);
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    shifted |= c.seq->kv.position_shift != 0;
    if (c.seq->group()->request.kv_policy.kind == KvPolicy::Kind::kH2O) {
      mass_stride = std::max<int64_t>(mass_stride, c.seq->kv.table.num_tokens());
      mass_wanted_[i] = 1;
    }
  }
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    const Sequence& s = *c.seq;
    const int32_t shift = s.kv.position_shift;
    for (int32_t j = 0; j < c.num_tokens; ++j) {
      const int32_t slot = c.first_slot + j;
      tokens_.push_back(s.input_token(slot + shift));
      token_seq_.push_back(static_cast<int32_t>(i));
      positions_.push_back(s.kv.rope_position(slot));
      if (shifted) slots_.push_back(slot);
    }
    const int32_t chunk_end = static_cast<int32_t>(tokens_.size());
    if (s.num_speculative() > 0) {
      // Verification needs the logits of every position from the last
      // verified token on (a drafted sequence keeps every slot: shift 0).
      const int32_t from = std::max(c.first_slot, s.num_tokens() - 1);
      row_positions_.push_back(from);
      for (int32_t p = from; p < c.first_slot + c.num_tokens; ++p) {
        logit_rows_.push_back(chunk_end - c.num_tokens + (p - c.first_slot));
      }
    } else {
      row_positions_.push_back(c.first_slot + c.num_tokens - 1 + shift);
      if (c.sample) logit_rows_.push_back(chunk_end - 1);
    }
    row_offsets_.push_back(static_cast<int32_t>(logit_rows_.size()));
    s.kv.table.AppendIds(&block_ids_);
    block_offsets_.push_back(static_cast<int32_t>(block_ids_.size()));
    for (size_t g = 0; g < group_ids_.size(); ++g) {
      // KV cache groups: each group's table (window groups' released slots
      // point at the placeholder block, which the window never reads).
      kv_->group_table(s.kv, static_cast<int32_t>(g)).AppendIds(&group_ids_[g]);
      group_offsets_[g].push_back(static_cast<int32_t>(group_ids_[g].size()));
    }
  }
  const int32_t vocab = vocab_size();
  logits_.resize(logit_rows_.size() * static_cast<size_t>(vocab));
  const kernels::PagedKvView view = kv_->View(block_ids_.data(), block_offsets_.data(),
                                              static_cast<int32_t>(plan.chunks.size()));
  ForwardBatch batch;
  batch.tokens = tokens_;
  batch.token_seq = token_seq_;
  batch.positions = positions_;
  batch.slots = slots_;
  batch.logit_rows = logit_rows_;
  group_views_.clear();
  for (size_t g = 0; g < group_ids_.size(); ++g) {
    group_views_.push_back(kv_->View(group_ids_[g].data(), group_offsets_[g].data(),
                                     static_cast<int32_t>(plan.chunks.size())));
  }
  if (!group_views_.empty()) {
    batch.group_kv = group_views_;
    batch.layer_group = kv_->layer_group();
    batch.layer_index = kv_->layer_index();
  }
  const int32_t n_kv_heads = backend_->config().n_kv_heads;
  if (mass_stride > 0) {
    mass_.assign(plan.chunks.size() * static_cast<size_t>(n_kv_heads * mass_stride), 0.0f);
    batch.attention_mass = mass_.data();
    batch.attention_mass_stride = mass_stride;
    batch.attention_mass_seqs = mass_wanted_;  // only the h2o sequences pay
  }
  absl::Status st = backend_->Forward(batch, view, logits_.data(), pool_);
  if (!st.ok()) return st;
  StepResult r;
  r.logits = absl::MakeConstSpan(logits_);
  r.row_offsets = absl::MakeConstSpan(row_offsets_);
  r.row_positions = absl::MakeConstSpan(row_positions_);
  r.vocab_size = vocab;
  if (mass_stride > 0) {
    r.attention_mass = mass_.data();
    r.mass_stride = mass_stride;
    r.n_kv_heads = n_kv_heads;
  }
  return r;
}

}  // namespace kvserve
