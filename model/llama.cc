#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/attention.h"

namespace kvserve {
namespace {

using kernels::DType;
using kernels::WeightView;

// Every weight type the GGUF reader accepts has a matmul kernel
// (kernels/dtype.h): F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants
// Q2_K..Q6_K, IQ4_NL and IQ4_XS.
const std::vector<GgmlType>& kMatrixTypes = AllGgmlTypes();

DType ToDType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return DType::kF32;
    case GgmlType::kF16: return DType::kF16;
    case GgmlType::kBF16: return DType::kBF16;
    case GgmlType::kQ8_0: return DType::kQ8_0;
    case GgmlType::kQ4_0: return DType::kQ4_0;
    case GgmlType::kQ4_1: return DType::kQ4_1;
    case GgmlType::kQ5_0: return DType::kQ5_0;
    case GgmlType::kQ5_1: return DType::kQ5_1;
    case GgmlType::kQ2_K: return DType::kQ2_K;
    case GgmlType::kQ3_K: return DType::kQ3_K;
    case GgmlType::kQ4_K: return DType::kQ4_K;
    case GgmlType::kQ5_K: return DType::kQ5_K;
    case GgmlType::kQ6_K: return DType::kQ6_K;
    case GgmlType::kIQ4_NL: return DType::kIQ4_NL;
    case GgmlType::kIQ4_XS: return DType::kIQ4_XS;
  }
  return DType::kF32;
}

// Reads an integer hyper-parameter that must be positive and not absurd.
absl::StatusOr<int32_t> PositiveParam(const GgufFile& f, const std::string& key, int64_t max) {
  ASSIGN_OR_RETURN(int64_t v, f.GetI64(key));
  if (v <= 0 || v > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", key, " = ", v, " is out of range (1..", max, ")"));
  }
  return static_cast<int32_t>(v);
}

}  // namespace

std::vector<float> Llama3RopeFactors(float freq_base, int32_t rope_dim, float factor,
                                     float low_freq_factor, float high_freq_factor,
                                     float original_context_length) {
  const double low_wavelen = original_context_length / low_freq_factor;
  const double high_wavelen = original_context_length / high_freq_factor;
  std::vector<float> out(rope_dim / 2);
  for (int32_t i = 0; i < rope_dim / 2; ++i) {
    const double freq = std::pow(static_cast<double>(freq_base), -2.0 * i / rope_dim);
    const double wavelen = 2 * 3.14159265358979323846 / freq;
    if (wavelen < high_wavelen) {
      out[i] = 1.0f;
    } else if (wavelen > low_wavelen) {
      out[i] = factor;
    } else {
      const double smooth = (original_context_length / wavelen - low_freq_factor) /
                            (high_freq_factor - low_freq_factor);
      out[i] = static_cast<float>(1.0 / ((1 - smooth) / factor + smooth));
    }
  }
  return out;
}

namespace {

absl::StatusOr<int32_t> OptionalPositiveParam(const GgufFile& f, const std::string& key,
                                              int64_t max, int32_t fallback) {
  if (!f.Has(key)) return fallback;
  return PositiveParam(f, key, max);
}

}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfig::FromGguf(const GgufFile& f) {
  LlamaConfig c;
  ASSIGN_OR_RETURN(c.architecture, f.GetString("general.architecture"));
  // Architectures that share Llama's graph: llama and mistral exactly,
  // qwen2 with Q/K/V biases and NeoX-style RoPE, qwen3 with QK-norm instead
  // of the biases, gemma3 with QK-norm, post-norms, GELU and local layers.
  const std::string& arch = c.architecture;
  if (arch != "llama" && arch != "mistral" && arch != "qwen2" && arch != "qwen3" &&
      arch != "gemma3") {
    return absl::UnimplementedError(absl::StrCat(
        "architecture '", arch, "' is not supported (llama, mistral, qwen2, qwen3, gemma3)"));
  }
  const bool gemma3 = arch == "gemma3";
  if (f.Has("general.name")) {
    ASSIGN_OR_RETURN(c.name, f.GetString("general.name"));
  }
  const std::string a = c.architecture + ".";
  ASSIGN_OR_RETURN(c.n_layers, PositiveParam(f, a + "block_count", 1024));
  ASSIGN_OR_RETURN(c.dim, PositiveParam(f, a + "embedding_length", 1 << 16));
  ASSIGN_OR_RETURN(c.n_heads, PositiveParam(f, a + "attention.head_count", 1024));
  ASSIGN_OR_RETURN(c.n_kv_heads,
                   OptionalPositiveParam(f, a + "attention.head_count_kv", 1024, c.n_heads));
  ASSIGN_OR_RETURN(c.ffn_dim, PositiveParam(f, a + "feed_forward_length", 1 << 20));
  ASSIGN_OR_RETURN(c.context_length, PositiveParam(f, a + "context_length", 1 << 24));
  if (c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("embedding_length ", c.dim,
                                                   " is not a multiple of head_count ", c.n_heads));
  }
  ASSIGN_OR_RETURN(c.head_dim,
                   OptionalPositiveParam(f, a + "attention.key_length", 4096, c.dim / c.n_heads));
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_count ", c.n_heads, " is not a multiple of head_count_kv ", c.n_kv_heads));
  }
  // Qwen3 and Gemma 3 heads are wider than dim / head_count (Q projects
  // dim to head_count x key_length, the output projection back).
  if (f.Has(a + "attention.value_length")) {
    ASSIGN_OR_RETURN(int32_t value_length, PositiveParam(f, a + "attention.value_length", 4096));
    if (value_length != c.head_dim) {
      return absl::UnimplementedError(absl::StrCat("attention.value_length ", value_length,
                                                   " != key_length ", c.head_dim));
    }
  }
  if (c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("head dimension ", c.head_dim, " is odd"));
  }
  ASSIGN_OR_RETURN(c.rope_dim,
                   OptionalPositiveParam(f, a + "rope.dimension_count", c.head_dim, c.head_dim));
  if (c.rope_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope.dimension_count ", c.rope_dim, " is odd"));
  }
  if (f.Has(a + "rope.freq_base")) {
    ASSIGN_OR_RETURN(c.rope_freq_base, f.GetF32(a + "rope.freq_base"));
  }
  if (f.Has(a + "attention.layer_norm_rms_epsilon")) {
    ASSIGN_OR_RETURN(c.rms_eps, f.GetF32(a + "attention.layer_norm_rms_epsilon"));
  }
  if (!(c.rope_freq_base > 0) || !std::isfinite(c.rope_freq_base)) {
    return absl::InvalidArgumentError("rope.freq_base must be a positive number");
  }
  if (!(c.rms_eps >= 0) || !std::isfinite(c.rms_eps)) {
    return absl::InvalidArgumentError("attention.layer_norm_rms_epsilon must be >= 0");
  }
  // Parts of other graphs that a GGUF of these architectures may name:
  // refused by name rather than run wrongly.
  for (const char* key : {"expert_count", "attn_logit_softcapping", "final_logit_softcapping",
                          "attention.layer_norm_epsilon", "attention.clamp_kqv",
                          "attention.q_lora_rank", "rope.scaling.attn_factor"}) {
    // Gemma 3 caps its final logits when its file says so (llama.cpp
    // reads the key as optional for gemma3).
    if (gemma3 && std::string(key) == "final_logit_softcapping") continue;
    if (f.Has(a + key)) {
      if (std::string(key) == "expert_count") {
        ASSIGN_OR_RETURN(int64_t n, f.GetI64(a + key));
        if (n <= 1) continue;
      }
      return absl::UnimplementedError(absl::StrCat("metadata ", a, key, " is not supported"));
    }
  }
  std::string scaling = "none";
  if (f.Has(a + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(scaling, f.GetString(a + "rope.scaling.type"));
  }
  const int32_t half = c.rope_dim / 2;
  auto scaling_f32 = [&](const std::string& key, float fallback) -> absl::StatusOr<float> {
    if (!f.Has(a + "rope.scaling." + key)) return fallback;
    ASSIGN_OR_RETURN(float v, f.GetF32(a + "rope.scaling." + key));
    if (!(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata ", a, "rope.scaling.", key, " must be a positive number"));
    }
    return v;
  };
  if (scaling == "linear") {
    ASSIGN_OR_RETURN(const float factor, scaling_f32("factor", 1.0f));
    c.rope_freq_factors.assign(half, factor);
  } else if (scaling == "llama3") {
    // Llama 3.1's scaling (as its config.json states it and the GGUF
    // converter bakes into rope_freqs.weight): wavelengths beyond the
    // original context are stretched by `factor`, short ones kept, the band
    // between interpolated.
    ASSIGN_OR_RETURN(const float factor, scaling_f32("factor", 8.0f));
    ASSIGN_OR_RETURN(const float low, scaling_f32("low_freq_factor", 1.0f));
    ASSIGN_OR_RETURN(const float high, scaling_f32("high_freq_factor", 4.0f));
    // gguf-py writes the original context length as a uint32 (llama.cpp
    // reads it so); a float is taken too.
    float original = 8192.0f;
    const std::string orig_key = a + "rope.scaling.original_context_length";
    if (absl::StatusOr<int64_t> n = f.GetI64(orig_key); n.ok()) {
      if (*n <= 0 || *n > (int64_t{1} << 30)) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata ", orig_key, " = ", *n, " is out of range"));
      }
      original = static_cast<float>(*n);
    } else {
      ASSIGN_OR_RETURN(original, scaling_f32("original_context_length", 8192.0f));
    }
    if (!(high > low)) {
      return absl::InvalidArgumentError(
          "rope.scaling.high_freq_factor must exceed rope.scaling.low_freq_factor");
    }
    c.rope_freq_factors = Llama3RopeFactors(c.rope_freq_base, c.rope_dim, factor, low, high,
                                            original);
  } else if (scaling != "none") {
    return absl::UnimplementedError(
        absl::StrCat("rope scaling '", scaling, "' is not supported (none, linear, llama3)"));
  }
  c.rope_scaling = scaling;
  // The converter's form of the same: per-pair divisors as a tensor.
  if (const GgufTensorInfo* ff = f.FindTensor("rope_freqs.weight"); ff != nullptr) {
    if (ff->type != GgmlType::kF32 || ff->shape.size() != 1 || ff->shape[0] != half) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_freqs.weight must be F32 with ", half, " elements"));
    }
    const float* data = reinterpret_cast<const float*>(ff->data);
    c.rope_freq_factors.assign(data, data + half);
    for (float v : c.rope_freq_factors) {
      if (!(v > 0) || !std::isfinite(v)) {
        return absl::InvalidArgumentError("rope_freqs.weight holds a factor that is not positive");
      }
    }
    if (c.rope_scaling == "none") c.rope_scaling = "llama3";
  }
  // GGUF's llama layout rotates adjacent pairs (the converter permutes Q/K);
  // qwen2 keeps Hugging Face's halves (NeoX style), as llama.cpp runs it.
  // qwen3 and gemma3 likewise (llama.cpp's LLAMA_ROPE_TYPE_NEOX for both).
  c.rope_style = (arch == "qwen2" || arch == "qwen3" || gemma3) ? kernels::RopeStyle::kNeox
                                                                : kernels::RopeStyle::kNorm;
  c.qkv_bias = arch == "qwen2";
  c.qk_norm = arch == "qwen3" || gemma3;
  c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (gemma3) {
    c.post_norms = true;
    c.gelu_ffn = true;
    c.embed_scale = std::sqrt(static_cast<float>(c.dim));
    // llama.cpp's gemma3 loader: 1/sqrt(head_dim), except the 62-layer 27B,
    // whose query_pre_attn_scalar is dim / head_count.
    if (c.n_layers == 62) c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.dim / c.n_heads));
    if (f.Has(a + "final_logit_softcapping")) {
      ASSIGN_OR_RETURN(c.final_logit_softcap, f.GetF32(a + "final_logit_softcapping"));
      if (!(c.final_logit_softcap >= 0) || !std::isfinite(c.final_logit_softcap)) {
        return absl::InvalidArgumentError("final_logit_softcapping must be >= 0");
      }
    }
  }

  // Sliding-window attention: every layer (Mistral v0.1's sliding_window),
  // or with sliding_window_pattern N every layer but each N-th.
  if (f.Has(a + "attention.sliding_window")) {
    ASSIGN_OR_RETURN(int64_t w, f.GetI64(a + "attention.sliding_window"));
    if (w < 0 || w > (1 << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata ", a, "attention.sliding_window = ", w, " is out of range"));
    }
    c.sliding_window = static_cast<int32_t>(w);
  }
  // Gemma 3 with a window defaults to pattern 6: layers 5, 11, 17, ...
  // global, the others local (llama.cpp's gemma3 loader; without a window
  // every layer is global).
  c.layer_window.assign(c.n_layers, c.sliding_window > 0 ? 1 : 0);
  const std::string pattern_key = a + "attention.sliding_window_pattern";
  if (c.sliding_window > 0 && f.Has(pattern_key)) {
    if (absl::StatusOr<int64_t> n = f.GetI64(pattern_key); n.ok()) {
      ASSIGN_OR_RETURN(int32_t pattern, PositiveParam(f, pattern_key, 1024));
      for (int32_t l = 0; l < c.n_layers; ++l) c.layer_window[l] = (l + 1) % pattern != 0;
    } else {
      // The per-layer form (one flag per layer, nonzero = windowed).
      absl::StatusOr<std::vector<int32_t>> flags = f.GetI32Array(pattern_key);
      if (!flags.ok() || static_cast<int32_t>(flags->size()) != c.n_layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "metadata ", pattern_key, " must be an integer or ", c.n_layers, " integer flags"));
      }
      for (int32_t l = 0; l < c.n_layers; ++l) c.layer_window[l] = (*flags)[l] != 0;
    }
  } else if (gemma3 && c.sliding_window > 0) {
    for (int32_t l = 0; l < c.n_layers; ++l) c.layer_window[l] = (l + 1) % 6 != 0;
  }
  // Local layers' RoPE base (gemma3: rope.freq_base_swa, else 10000, as
  // llama.cpp's loader has it; other families: the global base).
  c.rope_freq_base_swa = gemma3 ? 10000.0f : c.rope_freq_base;
  if (f.Has(a + "rope.freq_base_swa")) {
    ASSIGN_OR_RETURN(c.rope_freq_base_swa, f.GetF32(a + "rope.freq_base_swa"));
    if (!(c.rope_freq_base_swa > 0) || !std::isfinite(c.rope_freq_base_swa)) {
      return absl::InvalidArgumentError("rope.freq_base_swa must be a positive number");
    }
  }
  c.layer_local = c.layer_window;
  if (c.sliding_window >= c.context_length) {  // a window that never drops anything
    c.sliding_window = 0;
    c.layer_window.assign(c.n_layers, 0);
  }

  const GgufTensorInfo* embd = f.FindTensor("token_embd.weight");
  if (embd == nullptr) return absl::NotFoundError("missing tensor token_embd.weight");
  if (embd->shape.size() != 2 || embd->shape[0] != c.dim || embd->shape[1] <= 0 ||
      embd->shape[1] > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_embd.weight must have shape {", c.dim, ", vocab}"));
  }
  c.vocab_size = static_cast<int32_t>(embd->shape[1]);
  c.tied_output = f.FindTensor("output.weight") == nullptr;
  return c;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  auto file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  return FromGguf(std::shared_ptr<const GgufFile>(std::move(file).value()));
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromGguf(
    std::shared_ptr<const GgufFile> file) {
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->file_ = std::move(file);
  absl::Status s = m->Bind();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(m->file_->path(), ": ", s.message()));
  }
  return m;
}

absl::Status LlamaModel::Bind() {
  ASSIGN_OR_RETURN(config_, LlamaConfig::FromGguf(*file_));
  const LlamaConfig& c = config_;
  const GgufFile& f = *file_;
  weight_bytes_ = 0;

  auto matrix = [&](const std::string& name, int64_t in, int64_t out) -> absl::StatusOr<WeightView> {
    ASSIGN_OR_RETURN(const GgufTensorInfo* t, f.RequireTensor(name, {in, out}, kMatrixTypes));
    if (in % kernels::BlockElems(ToDType(t->type)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": row length ", in,
                                                     " is not a multiple of the block size"));
    }
    weight_bytes_ += static_cast<int64_t>(t->n_bytes);
    return WeightView{ToDType(t->type), t->data, out, in};
  };
  auto vector = [&](const std::string& name, int64_t n) -> absl::StatusOr<const float*> {
    ASSIGN_OR_RETURN(const GgufTensorInfo* t, f.RequireTensor(name, {n}, {GgmlType::kF32}));
    weight_bytes_ += static_cast<int64_t>(t->n_bytes);
    return reinterpret_cast<const float*>(t->data);
  };

  ASSIGN_OR_RETURN(token_embd_, matrix("token_embd.weight", c.dim, c.vocab_size));
  weight_bytes_ = 0;  // one embedding row per token is read, not the table
  ASSIGN_OR_RETURN(output_norm_, vector("output_norm.weight", c.dim));
  if (c.tied_output) {
    output_ = token_embd_;
    weight_bytes_ += kernels::RowBytes(output_.type, c.dim) * c.vocab_size;
  } else {
    ASSIGN_OR_RETURN(output_, matrix("output.weight", c.dim, c.vocab_size));
  }
  layers_.resize(c.n_layers);
  for (int32_t l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    Layer& L = layers_[l];
    ASSIGN_OR_RETURN(L.attn_norm, vector(p + "attn_norm.weight", c.dim));
    ASSIGN_OR_RETURN(L.wq, matrix(p + "attn_q.weight", c.dim, c.q_dim()));
    ASSIGN_OR_RETURN(L.wk, matrix(p + "attn_k.weight", c.dim, c.kv_dim()));
    ASSIGN_OR_RETURN(L.wv, matrix(p + "attn_v.weight", c.dim, c.kv_dim()));
    ASSIGN_OR_RETURN(L.wo, matrix(p + "attn_output.weight", c.q_dim(), c.dim));
    if (c.qk_norm) {
      ASSIGN_OR_RETURN(L.q_norm, vector(p + "attn_q_norm.weight", c.head_dim));
      ASSIGN_OR_RETURN(L.k_norm, vector(p + "attn_k_norm.weight", c.head_dim));
    } else {
      for (const char* t : {"attn_q_norm.weight", "attn_k_norm.weight"}) {
        if (f.FindTensor(p + t) != nullptr) {
          return absl::UnimplementedError(absl::StrCat(
              "tensor ", p, t, ": QK-norm is supported for qwen3 and gemma3 only"));
        }
      }
    }
    if (c.post_norms) {
      ASSIGN_OR_RETURN(L.post_attn_norm, vector(p + "post_attention_norm.weight", c.dim));
      ASSIGN_OR_RETURN(L.post_ffn_norm, vector(p + "post_ffw_norm.weight", c.dim));
    }
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(L.bq, vector(p + "attn_q.bias", c.n_heads * c.head_dim));
      ASSIGN_OR_RETURN(L.bk, vector(p + "attn_k.bias", c.kv_dim()));
      ASSIGN_OR_RETURN(L.bv, vector(p + "attn_v.bias", c.kv_dim()));
    } else {
      for (const char* b : {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"}) {
        if (f.FindTensor(p + b) != nullptr) {
          return absl::UnimplementedError(
              absl::StrCat("tensor ", p, b, ": attention biases are supported for qwen2 only"));
        }
      }
    }
    ASSIGN_OR_RETURN(L.ffn_norm, vector(p + "ffn_norm.weight", c.dim));
    ASSIGN_OR_RETURN(L.w_gate, matrix(p + "ffn_gate.weight", c.dim, c.ffn_dim));
    ASSIGN_OR_RETURN(L.w_up, matrix(p + "ffn_up.weight", c.dim, c.ffn_dim));
    ASSIGN_OR_RETURN(L.w_down, matrix(p + "ffn_down.weight", c.ffn_dim, c.dim));
  }
  // Quantized matrices in the VNNI/AMX panel layout. The embedding table
  // keeps only its mapped rows (lookups dequantize single rows); a tied
  // output head gets its own packed copy.
  // All of them are cut from one arena, so the layers' small matrices share
  // huge pages as they are streamed (kernels::PanelArena).
  packed_.clear();
  packed_bytes_ = 0;
  kernels::PanelArena arena;
  auto pack = [&](WeightView* v) {
    std::shared_ptr<const kernels::PackedWeight> p = kernels::PackWeight(*v, &arena);
    if (p == nullptr) return;
    v->packed = p.get();
    packed_bytes_ += kernels::PackedBytes(*p);
    packed_.push_back(std::move(p));
  };
  pack(&output_);
  for (Layer& L : layers_) {
    for (WeightView* v : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) pack(v);
  }
  return absl::OkStatus();
}

absl::Status CheckKvGroupMap(const ForwardBatch& b, int32_t n_layers) {
  if (b.group_kv.empty()) return absl::OkStatus();
  if (b.layer_group.size() != static_cast<size_t>(n_layers) ||
      b.layer_index.size() != static_cast<size_t>(n_layers)) {
    return absl::InvalidArgumentError("KV group map does not cover every layer");
  }
  if (b.attention_mass != nullptr) {
    return absl::UnimplementedError("attention mass (h2o) with KV cache groups");
  }
  for (int32_t l = 0; l < n_layers; ++l) {
    const int32_t g = b.layer_group[l];
    if (g < 0 || g >= static_cast<int32_t>(b.group_kv.size()) || b.layer_index[l] < 0 ||
        b.layer_index[l] >= b.group_kv[g].block_bytes / b.group_kv[g].layer_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", l, " has no KV group slot"));
    }
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::CheckBatch(const ForwardBatch& b, const kernels::PagedKvView& kv) const {
  const size_t n = b.tokens.size();
  if (n == 0) return absl::InvalidArgumentError("empty batch");
  if (b.token_seq.size() != n || b.positions.size() != n ||
      (!b.slots.empty() && b.slots.size() != n) ||
      (!b.attention_mass_seqs.empty() &&
       b.attention_mass_seqs.size() != static_cast<size_t>(kv.n_seqs))) {
    return absl::InvalidArgumentError("batch arrays differ in length");
  }
  if (kv.n_kv_heads != config_.n_kv_heads || kv.head_dim != config_.head_dim) {
    return absl::InvalidArgumentError("KV view does not match the model's heads");
  }
  const absl::Span<const int32_t> slots = b.kv_slots();
  for (size_t i = 0; i < n; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", b.tokens[i], " is outside the vocabulary (", config_.vocab_size,
                       ")"));
    }
    if (b.token_seq[i] < 0 || b.token_seq[i] >= kv.n_seqs) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " names sequence ",
                                                     b.token_seq[i], " outside the KV view"));
    }
    const int32_t s = b.token_seq[i];
    const int64_t capacity =
        static_cast<int64_t>(kv.seq_block_offsets[s + 1] - kv.seq_block_offsets[s]) *
        kv.block_size;
    if (b.positions[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("position ", b.positions[i], " is negative"));
    }
    if (slots[i] < 0 || slots[i] >= capacity) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots[i], " of sequence ", s,
                                                     " has no KV slot (capacity ", capacity,
                                                     ")"));
    }
    // Only the sequences whose mass is wanted need room in a mass row.
    if (b.attention_mass != nullptr && slots[i] >= b.attention_mass_stride &&
        (b.attention_mass_seqs.empty() || b.attention_mass_seqs[s] != 0)) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots[i],
                                                     " is outside the attention-mass row (",
                                                     b.attention_mass_stride, ")"));
    }
  }
  for (int32_t r : b.logit_rows) {
    if (r < 0 || static_cast<size_t>(r) >= n) {
      return absl::InvalidArgumentError(absl::StrCat("logit row ", r, " is outside the batch"));
    }
  }
  return absl::OkStatus();
}

void LlamaModel::EnsureScratch(int64_t n, int64_t n_logits) {
  const LlamaConfig& c = config_;
  auto grow = [](std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  };
  grow(x_, n * c.dim);
  grow(xn_, n * c.dim);
  grow(q_, n * c.n_heads * c.head_dim);
  grow(k_, n * c.kv_dim());
  grow(v_, n * c.kv_dim());
  grow(attn_, n * c.n_heads * c.head_dim);
  grow(gate_, n * c.ffn_dim);
  grow(up_, n * c.ffn_dim);
  grow(final_, n_logits * c.dim);
}

absl::Status LlamaModel::Forward(const ForwardBatch& b, const kernels::PagedKvView& kv,
                                 float* logits, ThreadPool* pool) {
  RETURN_IF_ERROR(CheckBatch(b, kv));
  const LlamaConfig& c = config_;
  // KV cache groups: every group's view must cover the batch as the main
  // one does.
  RETURN_IF_ERROR(CheckKvGroupMap(b, c.n_layers));
  for (const kernels::PagedKvView& g : b.group_kv) RETURN_IF_ERROR(CheckBatch(b, g));
  const int64_t n = static_cast<int64_t>(b.tokens.size());
  const int64_t q_dim = c.q_dim();
  const int64_t kv_dim = c.kv_dim();
  EnsureScratch(n, static_cast<int64_t>(b.logit_rows.size()));
  float* x = x_.data();
  float* xn = xn_.data();

  for (int64_t i = 0; i < n; ++i) {
    const auto* row = static_cast<const uint8_t*>(token_embd_.data) +
                      kernels::RowBytes(token_embd_.type, c.dim) * b.tokens[i];
    kernels::DequantizeRow(token_embd_.type, row, x + i * c.dim, c.dim);
    if (c.embed_scale != 1.0f) {
      for (int64_t j = 0; j < c.dim; ++j) x[i * c.dim + j] *= c.embed_scale;
    }
  }

  kernels::AttentionBatch attn_batch;
  attn_batch.n_tokens = static_cast<int32_t>(n);
  attn_batch.token_seq = b.token_seq.data();
  // The kernels address K/V and bound causality by slot; RoPE uses positions.
  const int32_t* slots = b.kv_slots().data();
  attn_batch.token_pos = slots;
  attn_batch.n_heads = c.n_heads;
  attn_batch.scale = c.attention_scale;
  // A window reaching back past slot 0 for every token masks nothing: such
  // batches take the full-attention kernels (Gemma's 512-token window only
  // starts to drop keys at slot 512).
  int32_t max_slot = 0;
  for (int64_t i = 0; i < n; ++i) max_slot = std::max(max_slot, slots[i]);
  const bool window_masks = c.sliding_window > 0 && max_slot >= c.sliding_window;

  for (int32_t l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    // Attention block.
    kernels::RmsNorm(x, L.attn_norm, n, c.dim, c.rms_eps, xn);
    {
      // One activation quantization and one thread dispatch for Q, K and V.
      const kernels::WeightView ws[3] = {L.wq, L.wk, L.wv};
      float* const ys[3] = {q_.data(), k_.data(), v_.data()};
      const int64_t strides[3] = {q_dim, kv_dim, kv_dim};
      kernels::MatMulMany(ws, 3, xn, n, c.dim, ys, strides, pool);
    }
    if (L.bq != nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        kernels::AddInPlace(q_.data() + i * q_dim, L.bq, q_dim);
        kernels::AddInPlace(k_.data() + i * kv_dim, L.bk, kv_dim);
        kernels::AddInPlace(v_.data() + i * kv_dim, L.bv, kv_dim);
      }
    }
    if (L.q_norm != nullptr) {  // per head, before RoPE
      kernels::RmsNorm(q_.data(), L.q_norm, n * c.n_heads, c.head_dim, c.rms_eps, q_.data());
      kernels::RmsNorm(k_.data(), L.k_norm, n * c.n_kv_heads, c.head_dim, c.rms_eps, k_.data());
    }
    const kernels::RopeParams rope = c.RopeForLayer(l);
    for (int64_t i = 0; i < n; ++i) {
      kernels::Rope(q_.data() + i * q_dim, c.n_heads, b.positions[i], rope);
      kernels::Rope(k_.data() + i * kv_dim, c.n_kv_heads, b.positions[i], rope);
    }
    // The layer's K/V: its group's table and its slot in the group's page,
    // or layer l of the one all-layers view.
    const bool grouped = !b.group_kv.empty();
    const kernels::PagedKvView& lkv = grouped ? b.group_kv[b.layer_group[l]] : kv;
    const int32_t ll = grouped ? b.layer_index[l] : l;
    kernels::AppendKv(lkv, ll, static_cast<int32_t>(n), b.token_seq.data(), slots, k_.data(),
                      kv_dim, v_.data(), kv_dim);
    attn_batch.window = window_masks && c.LayerWindowed(l) ? c.sliding_window : 0;
    kernels::PagedAttention(lkv, ll, attn_batch, q_.data(), q_dim, attn_.data(), q_dim, pool);
    if (b.attention_mass != nullptr) {
      kernels::AccumulateAttentionMass(
          lkv, ll, attn_batch, q_.data(), q_dim, b.attention_mass, b.attention_mass_stride,
          b.attention_mass_seqs.empty() ? nullptr : b.attention_mass_seqs.data());
    }
    kernels::MatMul(L.wo, attn_.data(), n, q_dim, xn, c.dim, pool);
    if (L.post_attn_norm != nullptr) {
      kernels::RmsNorm(xn, L.post_attn_norm, n, c.dim, c.rms_eps, xn);
    }
    kernels::AddInPlace(x, xn, n * c.dim);
    // Feed-forward block (SwiGLU; GEGLU with the tanh GELU for Gemma).
    kernels::RmsNorm(x, L.ffn_norm, n, c.dim, c.rms_eps, xn);
    {
      const kernels::WeightView ws[2] = {L.w_gate, L.w_up};
      float* const ys[2] = {gate_.data(), up_.data()};
      const int64_t strides[2] = {c.ffn_dim, c.ffn_dim};
      kernels::MatMulMany(ws, 2, xn, n, c.dim, ys, strides, pool);
    }
    if (c.gelu_ffn) {
      kernels::GeluTanhMul(gate_.data(), up_.data(), n * c.ffn_dim, gate_.data());
    } else {
      kernels::SiluMul(gate_.data(), up_.data(), n * c.ffn_dim, gate_.data());
    }
    kernels::MatMul(L.w_down, gate_.data(), n, c.ffn_dim, xn, c.dim, pool);
    if (L.post_ffn_norm != nullptr) {
      kernels::RmsNorm(xn, L.post_ffn_norm, n, c.dim, c.rms_eps, xn);
    }
    kernels::AddInPlace(x, xn, n * c.dim);
  }

  // Only rows that need logits pay for the output head.
  const int64_t n_logits = static_cast<int64_t>(b.logit_rows.size());
  if (n_logits == 0) return absl::OkStatus();
  for (int64_t r = 0; r < n_logits; ++r) {
    std::memcpy(final_.data() + r * c.dim, x + static_cast<int64_t>(b.logit_rows[r]) * c.dim,
                sizeof(float) * c.dim);
  }
  kernels::RmsNorm(final_.data(), output_norm_, n_logits, c.dim, c.rms_eps, final_.data());
  kernels::MatMul(output_, final_.data(), n_logits, c.dim, logits, c.vocab_size, pool);
  if (c.final_logit_softcap > 0) {
    const float cap = c.final_logit_softcap;
    for (int64_t i = 0; i < n_logits * c.vocab_size; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
  return absl::OkStatus();
}

}  // namespace kvserve
