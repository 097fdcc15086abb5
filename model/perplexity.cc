#include "model/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvserve {
namespace {

// -log softmax(logits)[target], computed stably in double.
double NegLogProb(const float* logits, int32_t n, int32_t target) {
  float max = logits[0];
  for (int32_t i = 1; i < n; ++i) max = std::max(max, logits[i]);
  double sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  return std::log(sum) + max - logits[target];
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

absl::StatusOr<PerplexityResult> ComputePerplexity(LlamaModel& model,
                                                   const std::vector<int32_t>& tokens,
                                                   const PerplexityOptions& o, ThreadPool* pool) {
  const LlamaConfig& cfg = model.config();
  if (o.context < 2) return absl::InvalidArgumentError("context must be at least 2 tokens");
  if (o.context > cfg.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("context ", o.context,
                                                   " exceeds the model's context length ",
                                                   cfg.context_length));
  }
  if (o.stride < 0 || o.stride > o.context) {
    return absl::InvalidArgumentError("stride must be in [0, context]");
  }
  if (o.batch_tokens < 1) return absl::InvalidArgumentError("batch_tokens must be positive");
  const int64_t n_tok = static_cast<int64_t>(tokens.size());
  if (n_tok < o.context) {
    return absl::InvalidArgumentError(absl::StrCat("text has ", n_tok,
                                                   " tokens, fewer than one window of ", o.context));
  }

  // Windows as (begin, first scored row): row j predicts tokens[begin + j + 1].
  struct Window {
    int64_t begin;
    int32_t first;
    int32_t length;
  };
  std::vector<Window> windows;
  if (o.stride == 0) {
    for (int64_t b = 0; b + o.context <= n_tok; b += o.context) {
      windows.push_back({b, o.context / 2, o.context});
    }
  } else {
    int64_t prev_end = 0;  // targets below prev_end are already scored
    for (int64_t b = 0; b < n_tok - 1; b += o.stride) {
      const int64_t end = std::min<int64_t>(b + o.context, n_tok);
      const int32_t len = static_cast<int32_t>(end - b);
      // Targets are tokens[b+1 .. end); score those >= max(prev_end, b+1).
      const int64_t first_target = std::max<int64_t>(prev_end, b + 1);
      windows.push_back({b, static_cast<int32_t>(first_target - b - 1), len});
      prev_end = end;
      if (end == n_tok) break;
    }
  }
  if (o.max_windows > 0 && static_cast<int32_t>(windows.size()) > o.max_windows) {
    windows.resize(o.max_windows);
  }

  // One sequence's worth of contiguous KV, addressed through an identity
  // block table.
  constexpr int32_t kBlock = 16;
  const int32_t n_blocks = (o.context + kBlock - 1) / kBlock;
  const int64_t half = kernels::PagedKvView::HalfLayerBytes(kBlock, cfg.n_kv_heads, cfg.head_dim,
                                                            kernels::KvDType::kF32);
  const int64_t block_bytes = 2 * half * cfg.n_layers;
  std::unique_ptr<uint8_t, FreeDeleter> storage(
      static_cast<uint8_t*>(std::aligned_alloc(64, block_bytes * n_blocks)));
  if (!storage) return absl::ResourceExhaustedError("cannot allocate KV for perplexity");
  std::vector<int32_t> block_ids(n_blocks);
  for (int32_t i = 0; i < n_blocks; ++i) block_ids[i] = i;
  const int32_t offsets[2] = {0, n_blocks};
  kernels::PagedKvView view;
  view.pool = storage.get();
  view.block_bytes = block_bytes;
  view.layer_bytes = 2 * half;
  view.block_size = kBlock;
  view.n_kv_heads = cfg.n_kv_heads;
  view.head_dim = cfg.head_dim;
  view.dtype = kernels::KvDType::kF32;
  view.block_ids = block_ids.data();
  view.seq_block_offsets = offsets;
  view.n_seqs = 1;

  PerplexityResult result;
  double nll = 0;
  std::vector<int32_t> chunk, seq, pos, rows;
  std::vector<float> logits;
  for (const Window& w : windows) {
    for (int32_t start = 0; start < w.length; start += o.batch_tokens) {
      const int32_t n = std::min(o.batch_tokens, w.length - start);
      chunk.assign(tokens.begin() + w.begin + start, tokens.begin() + w.begin + start + n);
      if (start == 0 && o.stride == 0 && o.bos_id >= 0) chunk[0] = o.bos_id;
      seq.assign(n, 0);
      pos.resize(n);
      rows.clear();
      for (int32_t j = 0; j < n; ++j) {
        pos[j] = start + j;
        const int32_t row = start + j;
        if (row >= w.first && row < w.length - 1) rows.push_back(j);
      }
      logits.resize(rows.size() * static_cast<size_t>(cfg.vocab_size));
      RETURN_IF_ERROR(model.Forward(ForwardBatch{chunk, seq, pos, rows}, view, logits.data(), pool));
      for (size_t r = 0; r < rows.size(); ++r) {
        const int64_t target = w.begin + start + rows[r] + 1;
        nll += NegLogProb(logits.data() + r * cfg.vocab_size, cfg.vocab_size, tokens[target]);
        ++result.scored_tokens;
      }
    }
    ++result.windows;
    result.window_perplexity.push_back(std::exp(nll / std::max<int64_t>(1, result.scored_tokens)));
  }
  if (result.scored_tokens == 0) return absl::InvalidArgumentError("no tokens to score");
  result.mean_nll = nll / result.scored_tokens;
  result.perplexity = std::exp(result.mean_nll);
  return result;
}

}  // namespace kvserve
