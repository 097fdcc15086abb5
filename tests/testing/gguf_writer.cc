#include "tests/testing/gguf_writer.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"
#include "kernels/cpu/matmul.h"
#include "kernels/dtype.h"

namespace kvserve::testing {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian host, little-endian file
  out.append(bytes, sizeof(T));
}

void PutString(std::string& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out.append(s);
}

constexpr uint32_t kTypeUint32 = 4;
constexpr uint32_t kTypeInt32 = 5;
constexpr uint32_t kTypeFloat32 = 6;
constexpr uint32_t kTypeBool = 7;
constexpr uint32_t kTypeString = 8;
constexpr uint32_t kTypeArray = 9;
constexpr uint32_t kTypeUint64 = 10;

uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

kernels::DType ToDType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return kernels::DType::kF32;
    case GgmlType::kF16:
      return kernels::DType::kF16;
    case GgmlType::kBF16:
      return kernels::DType::kBF16;
    case GgmlType::kQ8_0:
      return kernels::DType::kQ8_0;
    case GgmlType::kQ4_0:
      return kernels::DType::kQ4_0;
    case GgmlType::kQ4_1:
      return kernels::DType::kQ4_1;
  }
  return kernels::DType::kF32;
}

// Portable seeded normal source: std::normal_distribution differs between
// standard libraries, and fixtures must be identical everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>((Next() >> 11) + 1) * 0x1.0p-53; }  // (0, 1]
  float Normal(float stddev) {
    const double r = std::sqrt(-2.0 * std::log(Uniform()));
    return static_cast<float>(stddev * r * std::cos(2.0 * std::numbers::pi * Uniform()));
  }

 private:
  uint64_t state_;
};

}  // namespace

void GgufWriter::SetRaw(const std::string& key, uint32_t type, std::string payload) {
  for (Kv& kv : kvs_) {
    if (kv.key == key) {  // replacing keeps the file order and unique keys
      kv.type = type;
      kv.payload = std::move(payload);
      return;
    }
  }
  kvs_.push_back({key, type, std::move(payload)});
}

void GgufWriter::SetU32(const std::string& key, uint32_t v) {
  std::string p;
  Put(p, v);
  SetRaw(key, kTypeUint32, std::move(p));
}

void GgufWriter::SetI32(const std::string& key, int32_t v) {
  std::string p;
  Put(p, v);
  SetRaw(key, kTypeInt32, std::move(p));
}

void GgufWriter::SetU64(const std::string& key, uint64_t v) {
  std::string p;
  Put(p, v);
  SetRaw(key, kTypeUint64, std::move(p));
}

void GgufWriter::SetF32(const std::string& key, float v) {
  std::string p;
  Put(p, v);
  SetRaw(key, kTypeFloat32, std::move(p));
}

void GgufWriter::SetBool(const std::string& key, bool v) {
  std::string p;
  Put<uint8_t>(p, v ? 1 : 0);
  SetRaw(key, kTypeBool, std::move(p));
}

void GgufWriter::SetString(const std::string& key, const std::string& v) {
  std::string p;
  PutString(p, v);
  SetRaw(key, kTypeString, std::move(p));
}

void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  std::string p;
  Put(p, kTypeString);
  Put<uint64_t>(p, v.size());
  for (const std::string& s : v) PutString(p, s);
  SetRaw(key, kTypeArray, std::move(p));
}

void GgufWriter::SetF32Array(const std::string& key, const std::vector<float>& v) {
  std::string p;
  Put(p, kTypeFloat32);
  Put<uint64_t>(p, v.size());
  for (float f : v) Put(p, f);
  SetRaw(key, kTypeArray, std::move(p));
}

void GgufWriter::SetI32Array(const std::string& key, const std::vector<int32_t>& v) {
  std::string p;
  Put(p, kTypeInt32);
  Put<uint64_t>(p, v.size());
  for (int32_t i : v) Put(p, i);
  SetRaw(key, kTypeArray, std::move(p));
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type,
                           const std::vector<int64_t>& shape, std::string raw_bytes) {
  // No validation on purpose: tests build malformed files with this.
  tensors_.push_back({name, type, shape, std::move(raw_bytes)});
}

void GgufWriter::AddTensorFromFloats(const std::string& name, GgmlType type,
                                     const std::vector<int64_t>& shape,
                                     const std::vector<float>& values) {
  const int64_t row = shape.empty() ? 1 : shape[0];
  const int64_t n_rows = row == 0 ? 0 : static_cast<int64_t>(values.size()) / row;
  const int64_t row_bytes = GgmlRowBytes(type, row);
  std::string data(static_cast<size_t>(row_bytes * n_rows), '\0');
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* src = values.data() + r * row;
    uint8_t* dst = reinterpret_cast<uint8_t*>(data.data()) + r * row_bytes;
    switch (type) {
      case GgmlType::kF32:
        std::memcpy(dst, src, static_cast<size_t>(row) * sizeof(float));
        break;
      case GgmlType::kF16:
      case GgmlType::kBF16:
        for (int64_t i = 0; i < row; ++i) {
          const uint16_t h = type == GgmlType::kF16 ? Fp32ToFp16(src[i]) : Fp32ToBf16(src[i]);
          std::memcpy(dst + 2 * i, &h, 2);
        }
        break;
      default:
        kernels::QuantizeRowReference(ToDType(type), src, dst, row);
        break;
    }
  }
  AddTensor(name, type, shape, std::move(data));
}

std::string GgufWriter::Serialize(uint32_t version, uint32_t alignment) const {
  std::vector<Kv> kvs = kvs_;
  if (alignment != 32) {
    bool present = false;
    for (const Kv& kv : kvs) present |= kv.key == "general.alignment";
    if (!present) {
      std::string p;
      Put(p, alignment);
      kvs.push_back({"general.alignment", kTypeUint32, std::move(p)});
    }
  }
  std::string out;
  Put<uint32_t>(out, 0x46554747);  // "GGUF"
  Put(out, version);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, kvs.size());
  for (const Kv& kv : kvs) {
    PutString(out, kv.key);
    Put(out, kv.type);
    out.append(kv.payload);
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) Put(out, d);
    Put(out, static_cast<uint32_t>(t.type));
    Put(out, offset);
    offset = AlignUp(offset + t.data.size(), alignment);
  }
  out.resize(AlignUp(out.size(), alignment), '\0');
  for (const Tensor& t : tensors_) {
    out.append(t.data);
    out.resize(AlignUp(out.size(), alignment), '\0');
  }
  return out;
}

namespace {

absl::Status WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot create ", path));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status GgufWriter::WriteFile(const std::string& path, uint32_t version) const {
  return WriteBytes(path, Serialize(version));
}

namespace {

// SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte-fallback tokens,
// then pieces. Every prefix of a word is a piece too, so a score-driven BPE
// merge can always reach the whole word one character at a time.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
};

Vocab MakeVocab() {
  Vocab v;
  auto add = [&v](const std::string& piece, float score, int32_t type) {
    for (const std::string& t : v.tokens) {
      if (t == piece) return;
    }
    v.tokens.push_back(piece);
    v.scores.push_back(score);
    v.types.push_back(type);
  };
  add("<unk>", 0.0f, 2);
  add("<s>", 0.0f, 3);
  add("</s>", 0.0f, 3);
  for (int b = 0; b < 256; ++b) add(absl::StrFormat("<0x%02X>", b), 0.0f, 6);
  const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's word marker
  float score = -1.0f;
  // Single characters first (lowest merge priority comes last in score order).
  std::vector<std::string> chars = {kSpace, "e", "t", "a", "o", "n", "i", "h", "s", "r",
                                    "d",    "l", "u", "m", "c", "w", "y", "f", "g", "p",
                                    "b",    "v", "k", "O", "T", "S", ".", ",", "!", "?"};
  for (const std::string& c : chars) add(c, score -= 1.0f, 1);
  const std::vector<std::string> words = {"the",   "Once",   "upon", "time",  "there", "was",
                                          "a",     "little", "girl", "named", "Lily",  "She",
                                          "loved", "to",     "play", "with",  "her",   "dog",
                                          "and",   "cat",    "sun",  "happy", "day"};
  for (const std::string& w : words) {
    const std::string full = kSpace + w;
    // Longer prefixes score higher so whole words win over fragments.
    for (size_t len = kSpace.size() + 1; len <= full.size(); ++len) {
      add(full.substr(0, len), -100.0f + static_cast<float>(len), 1);
    }
  }
  return v;
}

std::vector<float> RandomNormal(Rng& rng, int64_t n, float stddev, float mean = 0.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = mean + rng.Normal(stddev);
  return v;
}

}  // namespace

TinyLlamaOptions TinyGemma3Options() {
  TinyLlamaOptions o;
  o.architecture = "gemma3";
  o.dim = 128;
  o.n_heads = 4;
  o.n_kv_heads = 1;
  o.head_dim = 64;
  o.ffn_dim = 256;
  o.n_layers = 3;
  o.sliding_window = 16;
  o.sliding_window_pattern = 3;
  o.rope_freq_base = 1000000.0f;
  o.rope_freq_base_swa = 10000.0f;
  return o;
}

std::string MakeTinyLlamaGguf(const TinyLlamaOptions& o) {
  const Vocab vocab = MakeVocab();
  const int64_t n_vocab = static_cast<int64_t>(vocab.tokens.size());
  const int32_t head_dim = o.head_dim > 0 ? o.head_dim : o.dim / o.n_heads;
  const int64_t kv_dim = static_cast<int64_t>(head_dim) * o.n_kv_heads;
  const int64_t q_dim = static_cast<int64_t>(head_dim) * o.n_heads;
  const bool qk_norm = o.architecture == "qwen3" || o.architecture == "gemma3";

  GgufWriter w;
  const std::string a = o.architecture + ".";
  w.SetString("general.architecture", o.architecture);
  w.SetString("general.name", "kvserve-tiny-" + o.architecture);
  w.SetU32(a + "block_count", static_cast<uint32_t>(o.n_layers));
  w.SetU32(a + "context_length", static_cast<uint32_t>(o.context_length));
  w.SetU32(a + "embedding_length", static_cast<uint32_t>(o.dim));
  w.SetU32(a + "feed_forward_length", static_cast<uint32_t>(o.ffn_dim));
  w.SetU32(a + "attention.head_count", static_cast<uint32_t>(o.n_heads));
  w.SetU32(a + "attention.head_count_kv", static_cast<uint32_t>(o.n_kv_heads));
  w.SetF32(a + "rope.freq_base", o.rope_freq_base);
  w.SetU32(a + "rope.dimension_count", static_cast<uint32_t>(head_dim));
  w.SetF32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  if (o.head_dim > 0) {
    w.SetU32(a + "attention.key_length", static_cast<uint32_t>(head_dim));
    w.SetU32(a + "attention.value_length", static_cast<uint32_t>(head_dim));
  }
  if (o.final_logit_softcap > 0) w.SetF32(a + "final_logit_softcapping", o.final_logit_softcap);
  if (o.rope_freq_base_swa > 0) w.SetF32(a + "rope.freq_base_swa", o.rope_freq_base_swa);
  if (o.rope_scaling == "llama3") {
    w.SetString(a + "rope.scaling.type", "llama3");
    w.SetF32(a + "rope.scaling.factor", o.rope_scaling_factor);
    w.SetF32(a + "rope.scaling.low_freq_factor", 1.0f);
    w.SetF32(a + "rope.scaling.high_freq_factor", 4.0f);
    // An integer, as gguf-py's add_rope_scaling_orig_ctx_len writes it.
    w.SetU32(a + "rope.scaling.original_context_length",
             static_cast<uint32_t>(o.rope_original_context));
  }
  if (!o.rope_scaling.empty() && o.rope_scaling != "llama3" && o.rope_scaling != "llama3-tensor") {
    w.SetString(a + "rope.scaling.type", o.rope_scaling);
  }
  if (o.expert_count > 0) w.SetU32(a + "expert_count", o.expert_count);
  if (o.sliding_window > 0) {
    w.SetU32(a + "attention.sliding_window", static_cast<uint32_t>(o.sliding_window));
    if (o.sliding_window_pattern > 0) {
      w.SetU32(a + "attention.sliding_window_pattern",
               static_cast<uint32_t>(o.sliding_window_pattern));
    }
  }
  if (!o.chat_template.empty()) w.SetString("tokenizer.chat_template", o.chat_template);
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", vocab.tokens);
  w.SetF32Array("tokenizer.ggml.scores", vocab.scores);
  w.SetI32Array("tokenizer.ggml.token_type", vocab.types);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  w.SetU32("tokenizer.ggml.unknown_token_id", 0);
  w.SetBool("tokenizer.ggml.add_bos_token", true);

  Rng rng(o.seed);
  // Matrices quantize only when their rows split into whole 32-element
  // blocks; otherwise they stay F32 so any option combination is valid.
  auto matrix = [&](const std::string& name, int64_t in, int64_t out, float stddev) {
    GgmlType type = o.weight_type;
    if (in % GgmlBlockElems(type) != 0) type = GgmlType::kF32;
    w.AddTensorFromFloats(name, type, {in, out}, RandomNormal(rng, in * out, stddev));
  };
  auto norm = [&](const std::string& name, int64_t n = 0) {
    if (n == 0) n = o.dim;
    w.AddTensorFromFloats(name, GgmlType::kF32, {n}, RandomNormal(rng, n, 0.05f, 1.0f));
  };
  // Scales keep activations O(1): weights ~ 0.5/sqrt(fan_in) (0.02..0.1 for
  // the default sizes), and the output projection ~ 1/sqrt(dim) so logits
  // have unit spread instead of collapsing onto one token.
  const float in_scale = 0.5f / std::sqrt(static_cast<float>(o.dim));
  const float ffn_scale = 0.5f / std::sqrt(static_cast<float>(o.ffn_dim));
  matrix("token_embd.weight", o.dim, n_vocab, 0.1f);
  norm("output_norm.weight");
  if (!o.tied_output) {
    matrix("output.weight", o.dim, n_vocab, 1.0f / std::sqrt(static_cast<float>(o.dim)));
  }
  if (!o.rope_freqs.empty()) {
    w.AddTensorFromFloats("rope_freqs.weight", GgmlType::kF32,
                          {static_cast<int64_t>(o.rope_freqs.size())}, o.rope_freqs);
  } else if (o.rope_scaling == "llama3-tensor") {
    // What convert_hf_to_gguf.py stores for Llama 3.1: the divisors as F32.
    std::vector<float> factors(head_dim / 2);
    for (int32_t i = 0; i < head_dim / 2; ++i) factors[i] = 1.0f + 0.5f * static_cast<float>(i);
    w.AddTensorFromFloats("rope_freqs.weight", GgmlType::kF32, {head_dim / 2}, factors);
  }
  for (int32_t l = 0; l < o.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    norm(p + "attn_norm.weight");
    matrix(p + "attn_q.weight", o.dim, q_dim, in_scale);
    matrix(p + "attn_k.weight", o.dim, kv_dim, in_scale);
    matrix(p + "attn_v.weight", o.dim, kv_dim, in_scale);
    if (o.architecture == "qwen2" && !o.omit_qkv_bias) {
      w.AddTensorFromFloats(p + "attn_q.bias", GgmlType::kF32, {o.dim}, RandomNormal(rng, o.dim, 0.2f));
      w.AddTensorFromFloats(p + "attn_k.bias", GgmlType::kF32, {kv_dim}, RandomNormal(rng, kv_dim, 0.2f));
      w.AddTensorFromFloats(p + "attn_v.bias", GgmlType::kF32, {kv_dim}, RandomNormal(rng, kv_dim, 0.2f));
    }
    if (qk_norm && !o.omit_qk_norm) {
      norm(p + "attn_q_norm.weight", head_dim);
      norm(p + "attn_k_norm.weight", head_dim);
    }
    matrix(p + "attn_output.weight", q_dim, o.dim, 0.5f / std::sqrt(static_cast<float>(q_dim)));
    if (o.architecture == "gemma3") norm(p + "post_attention_norm.weight");
    norm(p + "ffn_norm.weight");
    matrix(p + "ffn_gate.weight", o.dim, o.ffn_dim, in_scale);
    matrix(p + "ffn_up.weight", o.dim, o.ffn_dim, in_scale);
    matrix(p + "ffn_down.weight", o.ffn_dim, o.dim, ffn_scale);
    if (o.architecture == "gemma3") norm(p + "post_ffw_norm.weight");
  }
  return w.Serialize(3);
}

absl::Status WriteSlowTinyLlama(const std::string& path) {
  TinyLlamaOptions o;
  o.n_layers = 4;
  o.dim = 256;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.ffn_dim = 768;
  o.context_length = 4096;
  o.weight_type = GgmlType::kF16;
  o.seed = 11;
  return WriteBytes(path, MakeTinyLlamaGguf(o));
}

}  // namespace kvserve::testing
