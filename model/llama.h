// LlamaModel: a Llama-family decoder loaded from GGUF, with a forward pass
// over one ragged batch (any mix of prefill chunks and single decode tokens
// from many sequences) that appends K/V to, and attends through, a paged KV
// view. The model holds weights (pointers into the mapped file) and scratch
// buffers; it knows nothing about requests or how the cache is managed.
//
// Thread-safety: Forward is not thread-safe (scratch buffers are reused);
// the engine thread owns the model. It parallelizes internally over the
// ThreadPool it is given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/kv_view.h"
#include "model/gguf.h"

namespace kvserve {

struct LlamaConfig {
  std::string architecture;
  std::string name;
  int32_t n_layers = 0;
  int32_t dim = 0;
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn_dim = 0;
  int32_t vocab_size = 0;
  int32_t context_length = 0;
  int32_t rope_dim = 0;
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-5f;
  kernels::RopeStyle rope_style = kernels::RopeStyle::kNorm;
  bool tied_output = false;
  // Per-pair RoPE frequency divisors (Llama 3 / linear rope scaling), from
  // the GGUF tensor rope_freqs.weight or computed from rope.scaling.*
  // metadata; empty: none.
  std::vector<float> rope_freq_factors;
  std::string rope_scaling = "none";  // none | linear | llama3 (for reports)
  // Qwen2: Q, K and V projections carry a bias.
  bool qkv_bias = false;
  // Qwen3 / Gemma 3: RMSNorm over each head of Q and of K (weights of
  // head_dim, blk.N.attn_{q,k}_norm.weight) before RoPE.
  bool qk_norm = false;
  // Gemma 3's block: RMSNorm of the attention output and of the FFN output
  // before each residual add (blk.N.post_attention_norm, post_ffw_norm),
  // a GELU (tanh form) gated FFN instead of SwiGLU, and the embeddings
  // scaled by embed_scale (sqrt(dim)) after lookup. GGUF norm weights
  // already hold Gemma's 1 + w (llama.cpp's converter adds the 1).
  bool post_norms = false;
  bool gelu_ffn = false;
  float embed_scale = 1.0f;
  // Query scale before softmax (1/sqrt(head_dim) unless the family says
  // otherwise).
  float attention_scale = 0.0f;
  // Final logits = cap * tanh(logits / cap) when > 0 (final_logit_softcapping).
  float final_logit_softcap = 0.0f;
  // RoPE base of the local (sliding-window) layers; layer_local[l] marks
  // them by the family's pattern, whether or not the window ever drops a
  // key (Gemma 3: 10000 on local layers, rope.freq_base on global ones).
  float rope_freq_base_swa = 10000.0f;
  std::vector<uint8_t> layer_local;
  // Sliding-window attention: layer l attends to the last sliding_window
  // positions when layer_window[l] != 0 (a Mistral-style uniform window,
  // or a per-layer pattern); 0: full attention everywhere.
  int32_t sliding_window = 0;
  std::vector<uint8_t> layer_window;
  bool LayerWindowed(int32_t l) const {
    return sliding_window > 0 && l < static_cast<int32_t>(layer_window.size()) && layer_window[l];
  }
  int32_t n_windowed_layers() const {
    int32_t n = 0;
    for (int32_t l = 0; l < n_layers; ++l) n += LayerWindowed(l);
    return n;
  }
  // The RoPE parameters the forward uses (freq_factors point into this
  // config: it must outlive them).
  kernels::RopeParams Rope() const {
    kernels::RopeParams p{head_dim, rope_dim, rope_freq_base, rope_style};
    p.freq_factors = rope_freq_factors.empty() ? nullptr : rope_freq_factors.data();
    return p;
  }
  // Layer l's RoPE: the local base on local layers, else Rope().
  kernels::RopeParams RopeForLayer(int32_t l) const {
    kernels::RopeParams p = Rope();
    if (l < static_cast<int32_t>(layer_local.size()) && layer_local[l]) {
      p.freq_base = rope_freq_base_swa;
    }
    return p;
  }
  // True when some layer's RoPE base differs from rope_freq_base (users of
  // Rope() for re-rotation must refuse such a model).
  bool PerLayerRope() const {
    for (uint8_t local : layer_local) {
      if (local && rope_freq_base_swa != rope_freq_base) return true;
    }
    return false;
  }
  // KV cache groups (vLLM's hybrid layout): layers of one attention kind
  // (full, or the window) are cut into groups of an equal number of layers,
  // so every group's block (page) has the same bytes and all groups share
  // one pool. A model with one attention kind is one group of every layer
  // (the classic layout). Groups are ordered full first; within a kind,
  // layers in ascending order, layers_per_group at a time.
  struct KvGroups {
    int32_t layers_per_group = 0;
    std::vector<int32_t> group_window;  // per group: 0 = full attention, else the window
    std::vector<int32_t> layer_group;   // per layer: its group
    std::vector<int32_t> layer_index;   // per layer: its layer slot inside the group's page
    int32_t num_groups() const { return static_cast<int32_t>(group_window.size()); }
  };
  // hybrid = false forces the classic layout (one group of every layer,
  // windowed only when every layer is) whatever the attention kinds.
  KvGroups MakeKvGroups(bool hybrid = true) const {
    KvGroups g;
    std::vector<int32_t> full, windowed;
    for (int32_t l = 0; l < n_layers; ++l) (LayerWindowed(l) ? windowed : full).push_back(l);
    g.layer_group.assign(n_layers, 0);
    g.layer_index.assign(n_layers, 0);
    if (!hybrid || full.empty() || windowed.empty()) {
      g.layers_per_group = n_layers;
      g.group_window.push_back(full.empty() && !windowed.empty() ? sliding_window : 0);
      for (int32_t l = 0; l < n_layers; ++l) g.layer_index[l] = l;
      return g;
    }
    int32_t a = static_cast<int32_t>(full.size()), b = static_cast<int32_t>(windowed.size());
    while (b != 0) {
      const int32_t t = a % b;
      a = b;
      b = t;
    }
    g.layers_per_group = a;  // gcd: equal groups, no padding layers
    for (const std::vector<int32_t>* kind : {&full, &windowed}) {
      for (size_t i = 0; i < kind->size(); ++i) {
        if (i % a == 0) g.group_window.push_back(kind == &full ? 0 : sliding_window);
        g.layer_group[(*kind)[i]] = g.num_groups() - 1;
        g.layer_index[(*kind)[i]] = static_cast<int32_t>(i % a);
      }
    }
    return g;
  }
  int32_t q_dim() const { return n_heads * head_dim; }

  int32_t kv_dim() const { return n_kv_heads * head_dim; }
  // Bytes of K and V of one token across all layers at the given element size.
  int64_t KvBytesPerToken(int64_t elem_bytes) const {
    return 2LL * n_layers * n_kv_heads * head_dim * elem_bytes;
  }

  // Reads and validates hyper-parameters from GGUF metadata without touching
  // tensor data (the memory planner uses this too).
  [[nodiscard]] static absl::StatusOr<LlamaConfig> FromGguf(const GgufFile& file);
};

// Llama 3.1's RoPE scaling as per-pair frequency divisors (what the GGUF
// converter stores as rope_freqs.weight): rope_dim/2 values.
std::vector<float> Llama3RopeFactors(float freq_base, int32_t rope_dim, float factor,
                                     float low_freq_factor, float high_freq_factor,
                                     float original_context_length);

// One ragged batch. Token i belongs to sequence token_seq[i] (an index into
// the KV view's block table) at RoPE position positions[i], and its K/V go to
// KV slot slots[i] of that sequence; it attends causally to slots [0,
// slots[i]], so all earlier slots must already be in the cache or appear
// earlier in this batch. Slots apart from positions let a sequence drop
// tokens from the middle of its cache (attention sinks, heavy hitters) and
// keep the survivors' positions: the keys carry their rotation, so only the
// new token's position matters. Empty `slots` means slot == position (every
// plain sequence; the kernels then see exactly the positions).
struct ForwardBatch {
  absl::Span<const int32_t> tokens;
  absl::Span<const int32_t> token_seq;
  absl::Span<const int32_t> positions;
  // Rows of `tokens` whose next-token logits are wanted, in output order.
  absl::Span<const int32_t> logit_rows;
  absl::Span<const int32_t> slots = {};  // empty, or one per token
  // Optional (H2O): when not null, for every layer, query token and query
  // head, the softmax weight each attended slot received is ADDED to
  // attention_mass[(seq * n_kv_heads + kv_head) * attention_mass_stride +
  // slot] (query heads summed into their KV head). REQUIRES: stride >= the
  // largest slot + 1. Null costs nothing.
  float* attention_mass = nullptr;
  int64_t attention_mass_stride = 0;
  // With attention_mass: the sequences whose mass is wanted (one flag per
  // view sequence; empty: every sequence). The others' rows are left alone
  // and cost nothing.
  absl::Span<const uint8_t> attention_mass_seqs = {};

  // KV cache groups (LlamaConfig::KvGroups): when not empty, layer l
  // appends to and attends through group_kv[layer_group[l]] at layer
  // layer_index[l] of that view (each group has its own block table); empty:
  // the Forward's single view holds every layer (the classic layout).
  absl::Span<const kernels::PagedKvView> group_kv = {};
  absl::Span<const int32_t> layer_group = {};
  absl::Span<const int32_t> layer_index = {};
  // The KV slots: `slots` when given, else the positions.
  absl::Span<const int32_t> kv_slots() const { return slots.empty() ? positions : slots; }
};

// The batch's KV cache group map, as both forwards (CPU and CUDA) require
// it: layer_group and layer_index cover n_layers, every layer names a group
// and a layer slot inside that group's page, and no attention mass is asked
// for (not with groups). OK for a batch without groups. Each forward still
// checks every group's view against the batch itself.
[[nodiscard]] absl::Status CheckKvGroupMap(const ForwardBatch& b, int32_t n_layers);

class LlamaModel {
 public:
  // Opens and maps a GGUF file and binds every weight. Errors name the file
  // and the missing or malformed piece.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& path);
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LlamaModel>> FromGguf(
      std::shared_ptr<const GgufFile> file);

  const LlamaConfig& config() const { return config_; }
  const GgufFile& file() const { return *file_; }
  std::shared_ptr<const GgufFile> shared_file() const { return file_; }
  // Bytes of weights the forward reads per token (for bandwidth figures).
  int64_t weight_bytes() const { return weight_bytes_; }
  // Bytes of the weights repacked for the VNNI/AMX kernels at load (memory
  // beside the mapped file; 0 where those kernels do not run).
  int64_t packed_bytes() const { return packed_bytes_; }

  // Runs the batch: appends K/V of every token to `kv` and writes
  // logit_rows.size() rows of vocab_size logits to `logits`.
  // REQUIRES: kv's block table covers every position of the batch.
  [[nodiscard]] absl::Status Forward(const ForwardBatch& batch, const kernels::PagedKvView& kv,
                                     float* logits, ThreadPool* pool);

 private:
  struct Layer {
    const float* attn_norm;
    kernels::WeightView wq, wk, wv, wo;
    const float* bq = nullptr;  // QKV biases (Qwen2); null without
    const float* bk = nullptr;
    const float* bv = nullptr;
    const float* q_norm = nullptr;  // QK-norm (qwen3, gemma3); null without
    const float* k_norm = nullptr;
    const float* post_attn_norm = nullptr;  // Gemma 3; null without
    const float* post_ffn_norm = nullptr;
    const float* ffn_norm;
    kernels::WeightView w_gate, w_up, w_down;
  };

  LlamaModel() = default;
  absl::Status Bind();
  absl::Status CheckBatch(const ForwardBatch& batch, const kernels::PagedKvView& kv) const;
  void EnsureScratch(int64_t n_tokens, int64_t n_logits);

  std::shared_ptr<const GgufFile> file_;
  LlamaConfig config_;
  kernels::WeightView token_embd_{};
  const float* output_norm_ = nullptr;
  kernels::WeightView output_{};
  std::vector<Layer> layers_;
  int64_t weight_bytes_ = 0;
  // Repacked quantized matrices the views' `packed` point into.
  std::vector<std::shared_ptr<const kernels::PackedWeight>> packed_;
  int64_t packed_bytes_ = 0;

  // Scratch, sized for the largest batch seen so far.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, final_;
};

}  // namespace kvserve
