#include "tests/testing/generate.h"

#include <fstream>
#include <map>
#include <mutex>

#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve::testing {

const WrittenModel& TinyWrittenModel(const std::string& name, int32_t context_length) {
  static std::mutex mu;
  static auto* models = new std::map<std::string, std::unique_ptr<WrittenModel>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*models)[name];
  if (slot == nullptr) {
    TinyLlamaOptions o;
    o.context_length = context_length;
    const std::string path = TempDir() + "/" + name + ".gguf";
    std::ofstream(path, std::ios::binary) << MakeTinyLlamaGguf(o);
    slot = std::make_unique<WrittenModel>();
    slot->model = LlamaModel::Load(path).value();
    slot->tokenizer = Tokenizer::FromGguf(slot->model->file()).value();
  }
  return *slot;
}

ThreadPool* TestPool() {
  static ThreadPool pool(2);
  return &pool;
}

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
