#include "scheduler/batch_generator.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "cache/block_table.h"
#include "common/status.h"

namespace kvserve {
namespace {

struct Sequence {
  const GenerationRequest* request = nullptr;
  std::optional<BlockTable> blocks;  // set once the pool exists
  int32_t n_cached = 0;          // tokens whose K/V are in the cache
  std::vector<int32_t> pending;  // tokens to feed: the prompt, then each sampled token
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamingDetokenizer> detok;
  std::unique_ptr<StopStringMatcher> stops;
  GenerationOutput out;
  bool done = false;
};

}  // namespace

BatchGenerator::BatchGenerator(LlamaModel* model, const Tokenizer* tokenizer, ThreadPool* pool,
                               const Options& options)
    : model_(model), tokenizer_(tokenizer), pool_(pool), options_(options) {}

absl::StatusOr<std::vector<GenerationOutput>> BatchGenerator::Generate(
    const std::vector<GenerationRequest>& requests, const DeltaCallback& on_delta,
    GenerationStats* stats) {
  const LlamaConfig& cfg = model_->config();
  const int32_t bs = options_.block_size;
  if (bs <= 0) return absl::InvalidArgumentError("block_size must be positive");
  if (options_.max_batched_tokens < 1) {
    return absl::InvalidArgumentError("max_batched_tokens must be positive");
  }
  int64_t total_blocks = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    auto fail = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": ", what));
    };
    if (r.prompt.empty()) return fail("prompt is empty");
    for (int32_t t : r.prompt) {
      if (t < 0 || t >= cfg.vocab_size) return fail(absl::StrCat("prompt token ", t, " is out of range"));
    }
    absl::Status s = ValidateSamplingParams(r.params);
    if (!s.ok()) return fail(std::string(s.message()));
    const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.params.max_tokens;
    if (need > cfg.context_length) {
      return fail(absl::StrCat("prompt (", r.prompt.size(), " tokens) + max_tokens (",
                               r.params.max_tokens, ") exceeds the context length ",
                               cfg.context_length));
    }
    total_blocks += (need + bs - 1) / bs;
  }
  std::vector<GenerationOutput> outputs(requests.size());
  if (requests.empty()) return outputs;
  if (total_blocks > (1 << 30)) return absl::InvalidArgumentError("batch needs too much KV memory");

  // A static batch reserves each sequence's whole span up front.
  KvPoolOptions po;
  po.n_layers = cfg.n_layers;
  po.n_kv_heads = cfg.n_kv_heads;
  po.head_dim = cfg.head_dim;
  po.block_size = bs;
  po.n_blocks = static_cast<int32_t>(total_blocks);
  po.dtype = options_.kv_dtype;
  ASSIGN_OR_RETURN(std::unique_ptr<KvPool> kv_pool, KvPool::Create(po));

  // Declared after kv_pool so the tables release their blocks before the pool goes.
  std::vector<Sequence> seqs(requests.size());
  std::vector<int32_t> block_ids;
  std::vector<int32_t> block_offsets = {0};
  for (size_t i = 0; i < requests.size(); ++i) {
    Sequence& s = seqs[i];
    s.request = &requests[i];
    const int64_t need = static_cast<int64_t>(s.request->prompt.size()) + s.request->params.max_tokens;
    s.blocks.emplace(kv_pool.get());
    RETURN_IF_ERROR(s.blocks->Reserve(static_cast<int32_t>(need)));
    s.blocks->AppendIds(&block_ids);
    block_offsets.push_back(static_cast<int32_t>(block_ids.size()));
    s.pending = s.request->prompt;
    s.sampler = std::make_unique<Sampler>(s.request->params);
    s.detok = std::make_unique<StreamingDetokenizer>(tokenizer_);
    s.stops = std::make_unique<StopStringMatcher>(s.request->params.stop);
  }
  const kernels::PagedKvView view =
      kv_pool->View(block_ids.data(), block_offsets.data(), static_cast<int32_t>(seqs.size()));

  std::vector<int32_t> tokens, token_seq, positions, logit_rows, logit_seq;
  std::vector<float> logits;
  GenerationStats local_stats;
  for (const auto& r : requests) local_stats.prompt_tokens += static_cast<int64_t>(r.prompt.size());

  auto emit = [&](size_t i, const std::string& text) {
    if (text.empty()) return;
    seqs[i].out.text += text;
    if (on_delta) on_delta(i, text);
  };
  auto finish = [&](size_t i, const char* reason) {
    Sequence& s = seqs[i];
    if (!s.stops->stopped()) {
      emit(i, s.stops->Push(s.detok->Flush()));
      emit(i, s.stops->Flush());
    }
    s.out.finish_reason = reason;
    s.done = true;
  };

  for (;;) {
    tokens.clear();
    token_seq.clear();
    positions.clear();
    logit_rows.clear();
    logit_seq.clear();
    int32_t budget = options_.max_batched_tokens;
    bool has_prefill = false;
    // Decode tokens first so a long prompt never stalls running sequences.
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < seqs.size() && budget > 0; ++i) {
        Sequence& s = seqs[i];
        const bool decoding = s.pending.size() == 1;
        if (s.done || s.pending.empty() || decoding != (pass == 0)) continue;
        const int32_t take = std::min<int32_t>(budget, static_cast<int32_t>(s.pending.size()));
        for (int32_t j = 0; j < take; ++j) {
          tokens.push_back(s.pending[j]);
          token_seq.push_back(static_cast<int32_t>(i));
          positions.push_back(s.n_cached + j);
        }
        s.pending.erase(s.pending.begin(), s.pending.begin() + take);
        s.n_cached += take;
        budget -= take;
        if (!decoding) has_prefill = true;
        if (s.pending.empty()) {  // the whole input is in: sample the next token
          logit_rows.push_back(static_cast<int32_t>(tokens.size()) - 1);
          logit_seq.push_back(static_cast<int32_t>(i));
        }
      }
    }
    if (tokens.empty()) break;

    logits.resize(logit_rows.size() * static_cast<size_t>(cfg.vocab_size));
    const auto t0 = std::chrono::steady_clock::now();
    ForwardBatch batch{tokens, token_seq, positions, logit_rows};
    RETURN_IF_ERROR(model_->Forward(batch, view, logits.data(), pool_));

    for (size_t r = 0; r < logit_seq.size(); ++r) {
      const size_t i = static_cast<size_t>(logit_seq[r]);
      Sequence& s = seqs[i];
      const GenerationRequest& req = *s.request;
      const absl::Span<const float> row(logits.data() + r * cfg.vocab_size, cfg.vocab_size);
      const SampleResult sample = s.sampler->Sample(row, req.prompt, s.out.tokens);
      const int32_t tok = sample.token;
      const bool is_stop_id = std::find(req.params.stop_token_ids.begin(),
                                        req.params.stop_token_ids.end(),
                                        tok) != req.params.stop_token_ids.end();
      if ((!req.params.ignore_eos && tokenizer_->IsEndOfGeneration(tok)) || is_stop_id) {
        finish(i, "stop");
        continue;
      }
      s.out.tokens.push_back(tok);
      s.out.logprobs.push_back(sample.logprob);
      emit(i, s.stops->Push(s.detok->Push(tok)));
      if (s.stops->stopped()) {
        finish(i, "stop");
      } else if (static_cast<int32_t>(s.out.tokens.size()) >= req.params.max_tokens) {
        finish(i, "length");
      } else {
        s.pending.push_back(tok);
      }
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (has_prefill ? local_stats.prefill_seconds : local_stats.decode_seconds) += secs;
    ++local_stats.steps;
  }

  for (size_t i = 0; i < seqs.size(); ++i) {
    local_stats.generated_tokens += static_cast<int64_t>(seqs[i].out.tokens.size());
    outputs[i] = std::move(seqs[i].out);
  }
  if (stats != nullptr) *stats = local_stats;
  return outputs;
}

}  // namespace kvserve
