#include "scheduler/kv_policy_eval.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_eviction.h"

namespace kvserve {

namespace {

// log-softmax of one row, in double.
void LogSoftmax(const float* row, int32_t n, std::vector<double>* out) {
  out->resize(static_cast<size_t>(n));
  double mx = row[0];
  for (int32_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += std::exp(row[i] - mx);
  const double lse = mx + std::log(sum);
  for (int32_t i = 0; i < n; ++i) (*out)[static_cast<size_t>(i)] = row[i] - lse;
}

int32_t Argmax(const float* row, int32_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

struct Stream {
  std::unique_ptr<KvCacheManager> kv;
  std::unique_ptr<SeqKv> seq;
  std::vector<float> logits, mass, score;
  std::vector<int32_t> age;
};

}  // namespace

absl::StatusOr<KvPolicyEvalResult> EvaluateKvPolicy(LlamaModel* model,
                                                    absl::Span<const int32_t> tokens,
                                                    const KvPolicyEvalOptions& o,
                                                    ThreadPool* pool) {
  const LlamaConfig& c = model->config();
  const int32_t n = static_cast<int32_t>(tokens.size());
  if (n < 2) return absl::InvalidArgumentError("need at least 2 tokens");
  if (o.chunk < 1) return absl::InvalidArgumentError("chunk must be >= 1");
  // The engine's rules: the same limits a request of this length meets.
  KvEvictorOptions eo;
  eo.rope = c.Rope();
  eo.context_length = c.context_length;
  eo.switch_margin = o.chunk + o.block_size;
  eo.can_rotate = !kernels::KvIsKivi(o.kv_dtype);
  RequestLimits limits;
  limits.vocab_size = c.vocab_size;
  limits.context_length = c.context_length;
  limits.block_size = o.block_size;
  limits.kv_past_context = eo.can_rotate;
  limits.kv_switch_margin = eo.switch_margin;
  if (kernels::KvIsKivi(o.kv_dtype)) limits.kv_eviction_unsupported = "int4-kivi* codecs";
  EngineRequest probe;
  probe.prompt = {tokens[0]};
  probe.params.max_tokens = n - 1;
  probe.kv_policy = o.policy;
  RETURN_IF_ERROR(ValidateEngineRequest(probe, limits));
  const bool reference = n <= c.context_length;

  // Slots each stream can hold at once: every token for the reference (one
  // block when it does not run), the policy's share plus a chunk and a
  // block of slack under a policy.
  auto make = [&](Stream* s, int64_t slots) -> absl::Status {
    KvCacheManagerOptions ko;
    ko.pool.n_layers = c.n_layers;
    ko.pool.n_kv_heads = c.n_kv_heads;
    ko.pool.head_dim = c.head_dim;
    ko.pool.block_size = o.block_size;
    ko.pool.n_blocks = static_cast<int32_t>((slots + o.block_size - 1) / o.block_size + 2);
    ko.pool.dtype = o.kv_dtype;
    ko.prefix_cache = false;
    ASSIGN_OR_RETURN(s->kv, KvCacheManager::Create(std::move(ko)));
    s->seq = std::make_unique<SeqKv>(s->kv->mutable_pool());
    return absl::OkStatus();
  };
  Stream full, pol;
  RETURN_IF_ERROR(make(&full, reference ? n : 1));
  RETURN_IF_ERROR(make(
      &pol, o.policy.kind == KvPolicy::Kind::kNone
                ? int64_t{n}
                : std::min<int64_t>(n, int64_t{o.policy.capacity()} + o.chunk + 2 * o.block_size)));
  KvEvictor evictor(pol.kv.get(), eo);
  const bool h2o = o.policy.kind == KvPolicy::Kind::kH2O;

  KvPolicyEvalResult r;
  double nll_full = 0, nll_pol = 0, kl = 0, segment_nll = 0;
  int32_t segment_n = 0;
  int64_t same = 0;
  std::vector<double> lf, lp;
  std::vector<int32_t> seq_ids, pos, slots, rows, ids;
  for (int32_t start = 0; start < n - 1; start += o.chunk) {
    const int32_t take = std::min(o.chunk, n - 1 - start);
    const absl::Span<const int32_t> chunk =
        tokens.subspan(static_cast<size_t>(start), static_cast<size_t>(take));
    seq_ids.assign(static_cast<size_t>(take), 0);
    pos.resize(static_cast<size_t>(take));
    rows.resize(static_cast<size_t>(take));
    for (int32_t j = 0; j < take; ++j) {
      pos[static_cast<size_t>(j)] = start + j;
      rows[static_cast<size_t>(j)] = j;
    }
    for (Stream* s : {&full, &pol}) {
      if (s == &full && !reference) continue;
      SeqKv& kv = *s->seq;
      RETURN_IF_ERROR(s->kv->AllocateSlots(&kv, take));
      slots.resize(static_cast<size_t>(take));
      for (int32_t j = 0; j < take; ++j) slots[static_cast<size_t>(j)] = kv.num_computed + j;
      ids.clear();
      kv.table.AppendIds(&ids);
      const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
      // The policy stream's positions as the engine gives them.
      std::vector<int32_t> spos = pos;
      if (s == &pol) {
        for (int32_t j = 0; j < take; ++j) {
          spos[static_cast<size_t>(j)] = kv.rope_position(kv.num_computed + j);
        }
      }
      ForwardBatch b{chunk, seq_ids, spos, rows};
      b.slots = slots;
      const bool want_mass = s == &pol && h2o;
      const int64_t stride = kv.table.num_tokens();
      if (want_mass) {
        s->mass.assign(static_cast<size_t>(c.n_kv_heads * stride), 0.0f);
        b.attention_mass = s->mass.data();
        b.attention_mass_stride = stride;
      }
      s->logits.resize(static_cast<size_t>(take) * c.vocab_size);
      RETURN_IF_ERROR(
          model->Forward(b, s->kv->View(ids.data(), offsets, 1), s->logits.data(), pool));
      const int32_t first = kv.num_computed;
      s->kv->MarkComputed(&kv, take);
      s->kv->Commit(&kv, "", {}, take);  // no prefix cache: nothing is offered
      if (want_mass) {
        KvEvictor::AddAttention(&s->score, &s->age, s->mass.data(), c.n_kv_heads, stride, first,
                                take);
      }
    }
    for (int32_t j = 0; j < take; ++j) {
      const float* rp = pol.logits.data() + static_cast<size_t>(j) * c.vocab_size;
      const int32_t target = tokens[static_cast<size_t>(start + j + 1)];
      LogSoftmax(rp, c.vocab_size, &lp);
      nll_pol -= lp[static_cast<size_t>(target)];
      segment_nll -= lp[static_cast<size_t>(target)];
      if (o.segment > 0 && ++segment_n == o.segment) {
        r.segment_perplexity.push_back(std::exp(segment_nll / segment_n));
        segment_nll = 0;
        segment_n = 0;
      }
      if (!reference) {
        ++r.scored_tokens;
        continue;
      }
      const float* rf = full.logits.data() + static_cast<size_t>(j) * c.vocab_size;
      LogSoftmax(rf, c.vocab_size, &lf);
      nll_full -= lf[static_cast<size_t>(target)];
      double k = 0;
      for (int32_t v = 0; v < c.vocab_size; ++v) {
        const double p = std::exp(lf[static_cast<size_t>(v)]);
        k += p * (lf[static_cast<size_t>(v)] - lp[static_cast<size_t>(v)]);
      }
      kl += k;
      same += Argmax(rf, c.vocab_size) == Argmax(rp, c.vocab_size) ? 1 : 0;
      ++r.scored_tokens;
    }
    r.max_slots = std::max(r.max_slots, pol.seq->num_computed);
    evictor.MaybeCompact(o.policy, pol.seq.get(), &pol.score, &pol.age);
  }
  r.reference = reference;
  if (reference) {
    r.perplexity_full = std::exp(nll_full / static_cast<double>(r.scored_tokens));
    r.mean_kl = kl / static_cast<double>(r.scored_tokens);
    r.same_top1 = static_cast<double>(same) / static_cast<double>(r.scored_tokens);
  }
  r.perplexity_policy = std::exp(nll_pol / static_cast<double>(r.scored_tokens));
  r.dropped_tokens = pol.seq->position_shift;
  r.rotated_keys = evictor.rotated_keys();
  full.kv->Discard(full.seq.get());
  pol.kv->Discard(pol.seq.get());
  return r;
}

}  // namespace kvserve
