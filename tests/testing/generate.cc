#include "tests/testing/generate.h"

#include <map>

namespace kvserve::testing {

absl::StatusOr<std::vector<GenOutput>> GenerateAll(LlamaModel* model, const Tokenizer* tokenizer,
                                                   ThreadPool* pool,
                                                   const std::vector<EngineRequest>& requests,
                                                   const GenOptions& options) {
  EngineOptions o;
  o.max_batched_tokens = options.max_batched_tokens;
  o.block_size = options.block_size;
  o.num_blocks = options.num_blocks;
  auto engine = Engine::Create(model, tokenizer, pool, o);
  if (!engine.ok()) return engine.status();
  std::vector<GenOutput> out(requests.size());
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto id = (*engine)->Submit(requests[i], [&out, i](const SeqEvent& ev) {
      GenOutput& o = out[i];
      o.tokens.insert(o.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
      o.text += ev.text;
      if (ev.finish != FinishReason::kNone) o.finish_reason = FinishReasonName(ev.finish);
    });
    if (!id.ok()) return id.status();
  }
  while ((*engine)->Step()) {
  }
  return out;
}

}  // namespace kvserve::testing
