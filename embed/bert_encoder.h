// BertEncoder: the transformer of a BERT-family sentence encoder (Hugging
// Face BertModel: absolute position embeddings, post-LayerNorm blocks, GELU
// (erf) feed-forward), with F32 weights read from model.safetensors and run
// on kvserve's CPU kernels (kernels/cpu MatMul for every product). One
// sequence at a time, token type 0, no padding: Forward returns the mean of
// the last hidden states over all tokens (sentence-transformers' mean
// pooling, whose attention mask is all ones for a single sequence).
//
// Thread-safety: immutable after Load; Forward is const and keeps its
// scratch on the caller's stack/heap, so concurrent calls are safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/matmul.h"
#include "kernels/dtype.h"

namespace kvserve::embed {

class SafetensorsFile;

struct BertConfig {
  int32_t vocab_size = 0;
  int32_t hidden = 0;
  int32_t layers = 0;
  int32_t heads = 0;
  int32_t intermediate = 0;
  int32_t max_positions = 0;
  int32_t type_vocab_size = 0;
  float layer_norm_eps = 1e-12f;

  // Reads a Hugging Face config.json; InvalidArgument for anything but a
  // BERT with absolute positions and GELU.
  [[nodiscard]] static absl::StatusOr<BertConfig> FromFile(const std::string& path);
};

class BertEncoder {
 public:
  // weight_type: how the layers' matrices are held and multiplied, kF32
  // (as stored; the default) or kF16 (half the memory traffic; embeddings,
  // biases, norms and activations stay F32).
  [[nodiscard]] static absl::StatusOr<BertEncoder> Load(
      const BertConfig& config, const SafetensorsFile& weights,
      kernels::DType weight_type = kernels::DType::kF32);

  const BertConfig& config() const { return config_; }

  // Mean-pooled last hidden state (config().hidden floats) of `ids`.
  // InvalidArgument for an empty sequence, one longer than max_positions, or
  // an id outside the vocabulary.
  [[nodiscard]] absl::StatusOr<std::vector<float>> Forward(const std::vector<int32_t>& ids) const;

 private:
  // A row-major [rows, cols] weight matrix in F32 or F16.
  struct Matrix {
    kernels::DType type = kernels::DType::kF32;
    std::vector<uint8_t> bytes;
    int64_t rows = 0;
    int64_t cols = 0;
  };
  struct Layer {
    Matrix wq, wk, wv, wo, w1, w2;
    std::vector<float> bq, bk, bv, bo;
    std::vector<float> ln1_g, ln1_b;
    std::vector<float> b1, b2;
    std::vector<float> ln2_g, ln2_b;
  };

  static kernels::WeightView View(const Matrix& m);

  BertConfig config_;
  std::vector<float> word_, position_, token_type_, emb_ln_g_, emb_ln_b_;
  std::vector<Layer> layers_;
};

}  // namespace kvserve::embed
