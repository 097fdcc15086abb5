// GgufWriter builds GGUF files in memory for tests: fixtures for the reader,
// and tiny Llama models with random weights so the suite exercises the real
// engine without ../shared.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/gguf.h"

namespace kvserve::testing {

class GgufWriter {
 public:
  void SetU32(const std::string& key, uint32_t v);
  void SetI32(const std::string& key, int32_t v);
  void SetU64(const std::string& key, uint64_t v);
  void SetF32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetString(const std::string& key, const std::string& v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetF32Array(const std::string& key, const std::vector<float>& v);
  void SetI32Array(const std::string& key, const std::vector<int32_t>& v);
  // Adds a tensor with raw data already in `type`'s encoding; shape in ggml
  // order (shape[0] contiguous).
  void AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape,
                 std::string raw_bytes);
  // Adds an F32 tensor quantized/converted to `type` (F32, F16, BF16, Q8_0,
  // Q4_0, Q4_1) with the reference quantizers.
  void AddTensorFromFloats(const std::string& name, GgmlType type,
                           const std::vector<int64_t>& shape, const std::vector<float>& values);

  std::string Serialize(uint32_t version = 3, uint32_t alignment = 32) const;
  [[nodiscard]] absl::Status WriteFile(const std::string& path, uint32_t version = 3) const;

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    std::string payload;  // encoded value (after the type tag)
  };
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;
    std::string data;
  };
  void SetRaw(const std::string& key, uint32_t type, std::string payload);
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

struct TinyLlamaOptions {
  int32_t n_layers = 2;
  int32_t dim = 64;
  int32_t n_heads = 4;
  int32_t n_kv_heads = 2;
  int32_t ffn_dim = 128;
  int32_t context_length = 256;
  float rope_freq_base = 10000.0f;
  GgmlType weight_type = GgmlType::kF32;
  bool tied_output = false;
  uint64_t seed = 1;
  // Family layout: "llama", "mistral", "qwen2", "qwen3" or "gemma3"
  // (metadata under that prefix; qwen2 adds attn_{q,k,v}.bias tensors,
  // qwen3 and gemma3 attn_{q,k}_norm, gemma3 post_attention_norm and
  // post_ffw_norm).
  std::string architecture = "llama";
  // Head width when not dim / n_heads (written as attention.key_length and
  // value_length; qwen3 and gemma3 heads are wider). 0: dim / n_heads.
  int32_t head_dim = 0;
  // gemma3: final_logit_softcapping when > 0; rope.freq_base_swa when > 0.
  float final_logit_softcap = 0.0f;
  float rope_freq_base_swa = 0.0f;
  // Llama 3.x RoPE scaling: "llama3" writes rope.scaling.{type, factor,
  // low_freq_factor, high_freq_factor, original_context_length} as
  // metadata; "llama3-tensor" writes the converter's rope_freqs.weight
  // instead. "" writes neither; anything else writes rope.scaling.type.
  std::string rope_scaling;
  float rope_scaling_factor = 8.0f;
  int32_t rope_original_context = 64;
  // When not empty: written as rope_freqs.weight (rot_dim / 2 divisors)
  // instead of "llama3-tensor"'s made-up ones, e.g. what the converter
  // computes from a config's llama3 scaling.
  std::vector<float> rope_freqs;
  // Sliding-window attention (attention.sliding_window, and
  // attention.sliding_window_pattern when > 0).
  int32_t sliding_window = 0;
  int32_t sliding_window_pattern = 0;
  std::string chat_template;  // tokenizer.chat_template when not empty
  // Refusal tests: an expert_count (> 0) and a qwen2 file without biases.
  uint32_t expert_count = 0;
  bool omit_qkv_bias = false;
  bool omit_qk_norm = false;  // a qwen3/gemma3 file without attn_{q,k}_norm
};

// A small Gemma 3 layout for hybrid-attention tests: 3 layers of 128, 4
// query heads of 64 over one KV head, a 16-token window on 2 of every 3
// layers (local RoPE base 10,000, global 1,000,000), so one full KV cache
// group and two window groups.
TinyLlamaOptions TinyGemma3Options();

// A complete Llama GGUF with random weights and a small SentencePiece-style
// vocabulary (<unk>, <s>, </s>, 256 byte tokens <0x00>..<0xFF>, a few dozen
// merged pieces with scores). Returns the serialized file.
std::string MakeTinyLlamaGguf(const TinyLlamaOptions& options);

// A written model slow enough to stop in flight: wide enough that a token
// costs milliseconds on a CPU, with a 4096-token context, so a generation of
// thousands of tokens (ignore_eos) is certainly still running when a test
// hangs up, cancels or lets a deadline pass, and one that ran to its end is
// told apart by its token count, not by a clock. Writes it to `path`.
[[nodiscard]] absl::Status WriteSlowTinyLlama(const std::string& path);

}  // namespace kvserve::testing
