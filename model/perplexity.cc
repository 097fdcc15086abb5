#include "model/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_codec.h"

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

int32_t ArgMax(const float* x, int32_t n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}

// KL(p || q) of the softmax distributions of two logit rows, in double.
double KlDivergence(const float* p_logits, const float* q_logits, int32_t n) {
  const double pm = *std::max_element(p_logits, p_logits + n);
  const double qm = *std::max_element(q_logits, q_logits + n);
  double ps = 0, qs = 0;
  for (int32_t i = 0; i < n; ++i) {
    ps += std::exp(p_logits[i] - pm);
    qs += std::exp(q_logits[i] - qm);
  }
  const double plse = pm + std::log(ps), qlse = qm + std::log(qs);
  double kl = 0;
  for (int32_t i = 0; i < n; ++i) {
    const double lp = p_logits[i] - plse, lq = q_logits[i] - qlse;
    kl += std::exp(lp) * (lp - lq);
  }
  return kl;
}

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

  if (o.block_size < 1) return absl::InvalidArgumentError("block_size must be positive");
  // One sequence's worth of contiguous KV, addressed through an identity
  // block table.
  const int32_t kBlock = o.block_size;
  const int32_t n_blocks = (o.context + kBlock - 1) / kBlock;
  std::vector<int32_t> block_ids(n_blocks);
  for (int32_t i = 0; i < n_blocks; ++i) block_ids[i] = i;
  const int32_t offsets[2] = {0, n_blocks};
  std::unique_ptr<uint8_t, FreeDeleter> storage, compare_storage;
  auto make_view = [&](kernels::KvDType dtype,
                       std::unique_ptr<uint8_t, FreeDeleter>* store) -> kernels::PagedKvView {
    const int64_t half =
        kernels::PagedKvView::HalfLayerBytes(kBlock, cfg.n_kv_heads, cfg.head_dim, dtype);
    const int64_t block_bytes = 2 * half * cfg.n_layers;
    store->reset(static_cast<uint8_t*>(std::aligned_alloc(64, block_bytes * n_blocks)));
    kernels::PagedKvView view;
    view.pool = store->get();
    view.block_bytes = block_bytes;
    view.layer_bytes = 2 * half;
    view.block_size = kBlock;
    view.n_kv_heads = cfg.n_kv_heads;
    view.head_dim = cfg.head_dim;
    view.dtype = dtype;
    view.block_ids = block_ids.data();
    view.seq_block_offsets = offsets;
    view.n_seqs = 1;
    return view;
  };
  const kernels::PagedKvView view = make_view(o.kv_dtype, &storage);
  kernels::PagedKvView compare_view;
  if (o.compare) compare_view = make_view(o.compare_dtype, &compare_storage);
  if (!storage || (o.compare && !compare_storage)) {
    return absl::ResourceExhaustedError("cannot allocate KV for perplexity");
  }
  int64_t same_top1 = 0;
  double kl_sum = 0;

  PerplexityResult result;
  double nll = 0;
  std::vector<int32_t> chunk, seq, pos, rows;
  std::vector<float> logits, compare_logits;
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
      if (o.compare) {
        compare_logits.resize(logits.size());
        RETURN_IF_ERROR(model.Forward(ForwardBatch{chunk, seq, pos, rows}, compare_view,
                                      compare_logits.data(), pool));
      }
      for (size_t r = 0; r < rows.size(); ++r) {
        const int64_t target = w.begin + start + rows[r] + 1;
        const float* row_logits = logits.data() + r * cfg.vocab_size;
        const double token_nll = NegLogProb(row_logits, cfg.vocab_size, tokens[target]);
        nll += token_nll;
        result.nll.push_back(static_cast<float>(token_nll));
        result.top1.push_back(ArgMax(row_logits, cfg.vocab_size));
        ++result.scored_tokens;
        if (o.compare) {
          const float* ref = compare_logits.data() + r * cfg.vocab_size;
          same_top1 += ArgMax(ref, cfg.vocab_size) == ArgMax(row_logits, cfg.vocab_size);
          kl_sum += KlDivergence(ref, row_logits, cfg.vocab_size);
        }
      }
    }
    ++result.windows;
    result.window_perplexity.push_back(std::exp(nll / std::max<int64_t>(1, result.scored_tokens)));
  }
  if (result.scored_tokens == 0) return absl::InvalidArgumentError("no tokens to score");
  result.mean_nll = nll / result.scored_tokens;
  result.perplexity = std::exp(result.mean_nll);
  result.same_top1 = static_cast<double>(same_top1) / result.scored_tokens;
  result.mean_kl = kl_sum / result.scored_tokens;
  return result;
}

namespace {

// Accumulates error statistics of reconstructed rows against the originals.
struct ErrorStats {
  double sq_err = 0, max_abs = 0, cos_sum = 0;
  int64_t n = 0, rows = 0;
  void AddRow(const float* x, const float* y, int32_t len) {
    double dot = 0, nx = 0, ny = 0;
    for (int32_t i = 0; i < len; ++i) {
      const double d = static_cast<double>(y[i]) - x[i];
      sq_err += d * d;
      max_abs = std::max(max_abs, std::abs(d));
      dot += static_cast<double>(x[i]) * y[i];
      nx += static_cast<double>(x[i]) * x[i];
      ny += static_cast<double>(y[i]) * y[i];
    }
    n += len;
    ++rows;
    cos_sum += (nx > 0 && ny > 0) ? dot / std::sqrt(nx * ny) : (nx == ny ? 1.0 : 0.0);
  }
};

// Symmetric int8 / asymmetric int4 of x[i * stride] for i < n with one range
// for all n values: per-tensor and per-channel granularities, which the
// cache cannot store (it appends token by token) but the report compares.
void FakeQuantize(const float* x, int64_t n, int64_t stride, int bits, float* y) {
  float lo = x[0], hi = x[0], amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
    amax = std::max(amax, std::abs(x[i * stride]));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i * stride];
    if (bits == 8) {
      const float s = amax / 127.0f;
      y[i * stride] = s > 0 ? std::clamp(std::nearbyint(v / s), -127.0f, 127.0f) * s : 0.0f;
    } else {
      const float s = (hi - lo) / 15.0f;
      y[i * stride] = s > 0 ? std::clamp(std::nearbyint((v - lo) / s), 0.0f, 15.0f) * s + lo : lo;
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<KvErrorRow>> ComputeKvError(LlamaModel& model,
                                                       const std::vector<int32_t>& tokens,
                                                       int32_t context, ThreadPool* pool) {
  const LlamaConfig& cfg = model.config();
  if (context < 1 || context > cfg.context_length) {
    return absl::InvalidArgumentError("context must be in [1, model context length]");
  }
  if (static_cast<int64_t>(tokens.size()) < context) {
    return absl::InvalidArgumentError(absl::StrCat("text has ", tokens.size(),
                                                   " tokens, fewer than ", context));
  }
  // K/V captured in f32: a contiguous one-sequence cache, as in perplexity.
  constexpr int32_t kBlock = 16;
  const int32_t n_blocks = (context + kBlock - 1) / kBlock;
  const int64_t half = kernels::PagedKvView::HalfLayerBytes(kBlock, cfg.n_kv_heads, cfg.head_dim,
                                                            kernels::KvDType::kF32);
  std::vector<uint8_t> storage(2 * half * cfg.n_layers * n_blocks);
  std::vector<int32_t> block_ids(n_blocks);
  for (int32_t i = 0; i < n_blocks; ++i) block_ids[i] = i;
  const int32_t offsets[2] = {0, n_blocks};
  kernels::PagedKvView view;
  view.pool = storage.data();
  view.block_bytes = 2 * half * cfg.n_layers;
  view.layer_bytes = 2 * half;
  view.block_size = kBlock;
  view.n_kv_heads = cfg.n_kv_heads;
  view.head_dim = cfg.head_dim;
  view.block_ids = block_ids.data();
  view.seq_block_offsets = offsets;
  view.n_seqs = 1;
  constexpr int32_t kBatch = 256;
  std::vector<int32_t> seq, pos;
  for (int32_t start = 0; start < context; start += kBatch) {
    const int32_t n = std::min(kBatch, context - start);
    seq.assign(n, 0);
    pos.resize(n);
    for (int32_t j = 0; j < n; ++j) pos[j] = start + j;
    RETURN_IF_ERROR(model.Forward(
        ForwardBatch{absl::MakeConstSpan(tokens.data() + start, n), seq, pos, {}}, view, nullptr,
        pool));
  }

  // Gather K and V as [layer][kv_head][pos][head_dim] tensors.
  const int32_t hd = cfg.head_dim;
  const int64_t per_head = static_cast<int64_t>(context) * hd;
  const int64_t per_layer = per_head * cfg.n_kv_heads;
  std::vector<float> k(per_layer * cfg.n_layers), v(per_layer * cfg.n_layers);
  for (int32_t l = 0; l < cfg.n_layers; ++l) {
    for (int32_t h = 0; h < cfg.n_kv_heads; ++h) {
      for (int32_t p = 0; p < context; ++p) {
        const int64_t off = l * per_layer + h * per_head + static_cast<int64_t>(p) * hd;
        std::memcpy(&k[off], view.KeyAt(l, 0, p, h), hd * sizeof(float));
        std::memcpy(&v[off], view.ValueAt(l, 0, p, h), hd * sizeof(float));
      }
    }
  }

  std::vector<KvErrorRow> out;
  std::vector<float> yk(k.size()), yv(v.size());
  auto report = [&](std::string codec, std::string granularity) {
    ErrorStats ks, vs;
    for (int64_t r = 0; r < static_cast<int64_t>(k.size()) / hd; ++r) {
      ks.AddRow(&k[r * hd], &yk[r * hd], hd);
      vs.AddRow(&v[r * hd], &yv[r * hd], hd);
    }
    out.push_back({std::move(codec), std::move(granularity), ks.sq_err / ks.n, ks.max_abs,
                   ks.cos_sum / ks.rows, vs.sq_err / vs.n, vs.max_abs, vs.cos_sum / vs.rows});
  };
  // The cache's own codecs: per (token, KV head) row, or int4 per 32 channels.
  std::vector<uint8_t> data(kernels::KvRowBytes(kernels::KvDType::kF32, hd)), meta(64 + 4 * hd);
  for (kernels::KvDType t : {kernels::KvDType::kF16, kernels::KvDType::kBF16,
                             kernels::KvDType::kFp8E4M3, kernels::KvDType::kFp8E5M2,
                             kernels::KvDType::kInt8, kernels::KvDType::kInt4,
                             kernels::KvDType::kInt4G64}) {
    for (int64_t r = 0; r < static_cast<int64_t>(k.size()) / hd; ++r) {
      kernels::QuantizeRow(t, &k[r * hd], hd, data.data(), meta.data());
      kernels::DequantizeRow(t, data.data(), meta.data(), hd, &yk[r * hd]);
      kernels::QuantizeRow(t, &v[r * hd], hd, data.data(), meta.data());
      kernels::DequantizeRow(t, data.data(), meta.data(), hd, &yv[r * hd]);
    }
    report(std::string(kernels::KvDTypeName(t)),
           t == kernels::KvDType::kInt4      ? "per token, 32-channel groups"
           : t == kernels::KvDType::kInt4G64 ? "per token, 64-channel groups"
           : kernels::KvIsQuantized(t) && t != kernels::KvDType::kBF16 ? "per token-head"
                                                                        : "-");
  }
  // int4-kivi through the paged cache's own write path: keys per channel of
  // a 16-token block, written as prefill writes them (a block at once) and
  // as decode does (one token per append, earlier keys re-encoded when a
  // channel's range widens).
  struct KiviCase {
    kernels::KvDType dtype;
    int32_t block_size;  // int4-kivi-g64's halves are equal at 32
    bool one_by_one;
  };
  for (const KiviCase& kc : {KiviCase{kernels::KvDType::kInt4Kivi, 16, false},
                             KiviCase{kernels::KvDType::kInt4Kivi, 16, true},
                             KiviCase{kernels::KvDType::kInt4KiviG64, 32, false},
                             KiviCase{kernels::KvDType::kInt4KiviG64, 32, true}}) {
    const bool one_by_one = kc.one_by_one;
    kernels::PagedKvView q = view;
    q.dtype = kc.dtype;
    q.block_size = kc.block_size;
    const int32_t q_blocks = (context + kc.block_size - 1) / kc.block_size;
    const int32_t q_offsets[2] = {0, q_blocks};
    q.seq_block_offsets = q_offsets;  // block_ids: the identity, long enough
    const int64_t qhalf =
        kernels::PagedKvView::HalfLayerBytes(kc.block_size, cfg.n_kv_heads, hd, q.dtype);
    q.layer_bytes = 2 * qhalf;
    q.block_bytes = q.layer_bytes * cfg.n_layers;
    std::vector<uint8_t> qstore(q.block_bytes * q_blocks);
    q.pool = qstore.data();
    const int32_t row = cfg.n_kv_heads * hd;
    std::vector<float> kt(static_cast<size_t>(context) * row), vt(kt.size());
    std::vector<int32_t> seqs(context, 0), positions(context);
    for (int32_t p = 0; p < context; ++p) positions[p] = p;
    for (int32_t l = 0; l < cfg.n_layers; ++l) {
      for (int32_t h = 0; h < cfg.n_kv_heads; ++h) {
        for (int32_t p = 0; p < context; ++p) {
          const int64_t off = l * per_layer + h * per_head + static_cast<int64_t>(p) * hd;
          std::memcpy(&kt[static_cast<int64_t>(p) * row + h * hd], &k[off], hd * sizeof(float));
          std::memcpy(&vt[static_cast<int64_t>(p) * row + h * hd], &v[off], hd * sizeof(float));
        }
      }
      const int32_t step = one_by_one ? 1 : context;
      for (int32_t p = 0; p < context; p += step) {
        const int32_t n = std::min(step, context - p);
        kernels::AppendKv(q, l, n, seqs.data(), positions.data() + p, &kt[int64_t{p} * row], row,
                          &vt[int64_t{p} * row], row);
      }
      for (int32_t h = 0; h < cfg.n_kv_heads; ++h) {
        for (int32_t p = 0; p < context; ++p) {
          const int64_t off = l * per_layer + h * per_head + static_cast<int64_t>(p) * hd;
          kernels::ReadKvRow(q, l, 0, p, h, false, &yk[off]);
          kernels::ReadKvRow(q, l, 0, p, h, true, &yv[off]);
        }
      }
    }
    report(std::string(kernels::KvDTypeName(kc.dtype)),
           absl::StrCat("keys per channel (", kc.block_size, "-token block, appended ",
                        one_by_one ? "one by one" : "at once", "), values per token (",
                        kernels::KvInt4GroupOf(kc.dtype), "-channel groups)"));
  }
  // Granularities the paged cache does not store, for comparison.
  for (int bits : {8, 4}) {
    const std::string codec = bits == 8 ? "int8" : "int4";
    for (int32_t l = 0; l < cfg.n_layers; ++l) {
      FakeQuantize(&k[l * per_layer], per_layer, 1, bits, &yk[l * per_layer]);
      FakeQuantize(&v[l * per_layer], per_layer, 1, bits, &yv[l * per_layer]);
    }
    report(codec, "per tensor (layer)");
    // KIVI: keys per channel over groups of 32 tokens, values per token.
    constexpr int32_t kTokGroup = 32;
    for (int64_t hh = 0; hh < int64_t{cfg.n_layers} * cfg.n_kv_heads; ++hh) {
      for (int32_t p0 = 0; p0 < context; p0 += kTokGroup) {
        const int32_t n = std::min(kTokGroup, context - p0);
        for (int32_t c = 0; c < hd; ++c) {
          const int64_t off = hh * per_head + static_cast<int64_t>(p0) * hd + c;
          FakeQuantize(&k[off], n, hd, bits, &yk[off]);
        }
      }
      for (int32_t p = 0; p < context; ++p) {
        const int64_t off = hh * per_head + static_cast<int64_t>(p) * hd;
        FakeQuantize(&v[off], hd, 1, bits, &yv[off]);
      }
    }
    report(codec, "keys per channel (32 tokens), values per token");
  }
  return out;
}

}  // namespace kvserve
