// BertEncoder: config and weight loading, the forward pass.
#include "embed/bert_encoder.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status.h"
#include "embed/safetensors.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

using kernels::DType;
using kernels::WeightView;

// out[t] = (x[t] - mean) / sqrt(var + eps) * g + b, rows of n. out may alias x.
void LayerNorm(const float* x, const float* g, const float* b, int64_t rows, int64_t n, float eps,
               float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * n;
    float* o = out + t * n;
    double mean = 0;
    for (int64_t i = 0; i < n; ++i) mean += xr[i];
    mean /= n;
    double var = 0;
    for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= n;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] - m) * inv * g[i] + b[i];
  }
}

void AddBias(float* y, const float* bias, int64_t rows, int64_t n) {
  for (int64_t t = 0; t < rows; ++t) kernels::AddInPlace(y + t * n, bias, n);
}

// BERT's "gelu": the exact, erf-based form.
void Gelu(float* x, int64_t n) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

}  // namespace

absl::StatusOr<BertConfig> BertConfig::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open model config"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("not JSON (", e.what(), ")"));
  }
  BertConfig c;
  try {
    if (j.value("model_type", "") != "bert") {
      return bad(absl::StrCat("model_type is '", j.value("model_type", ""), "', expected bert"));
    }
    if (j.value("hidden_act", "gelu") != "gelu") {
      return bad(absl::StrCat("hidden_act '", j.value("hidden_act", ""),
                              "' is not supported (gelu only)"));
    }
    if (j.value("position_embedding_type", "absolute") != "absolute") {
      return bad("only absolute position embeddings are supported");
    }
    c.vocab_size = j.at("vocab_size").get<int32_t>();
    c.hidden = j.at("hidden_size").get<int32_t>();
    c.layers = j.at("num_hidden_layers").get<int32_t>();
    c.heads = j.at("num_attention_heads").get<int32_t>();
    c.intermediate = j.at("intermediate_size").get<int32_t>();
    c.max_positions = j.at("max_position_embeddings").get<int32_t>();
    c.type_vocab_size = j.value("type_vocab_size", 2);
    c.layer_norm_eps = j.value("layer_norm_eps", 1e-12f);
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("unexpected config layout (", e.what(), ")"));
  }
  if (c.vocab_size <= 0 || c.hidden <= 0 || c.layers <= 0 || c.heads <= 0 || c.intermediate <= 0 ||
      c.max_positions <= 0 || c.type_vocab_size <= 0 || c.hidden % c.heads != 0 ||
      c.hidden > 16384 || c.intermediate > 65536 || c.layers > 256) {
    return bad("sizes are out of range (hidden must divide by heads)");
  }
  return c;
}

absl::StatusOr<BertEncoder> BertEncoder::Load(const BertConfig& config,
                                              const SafetensorsFile& weights, DType weight_type) {
  if (weight_type != DType::kF32 && weight_type != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("BertEncoder: weight type ",
                                                   kernels::DTypeName(weight_type),
                                                   " is not supported (F32 or F16)"));
  }
  BertEncoder e;
  e.config_ = config;
  const int64_t h = config.hidden, inter = config.intermediate;
  // sentence-transformers saves a bare BertModel; a BertFor* checkpoint
  // prefixes every name with "bert.".
  const std::string prefix =
      weights.tensors().count("embeddings.word_embeddings.weight") ? "" : "bert.";
  auto read = [&](const std::string& name, std::vector<int64_t> shape) {
    return weights.ReadF32(prefix + name, shape);
  };
  auto read_matrix = [&](const std::string& name, int64_t rows,
                         int64_t cols) -> absl::StatusOr<Matrix> {
    ASSIGN_OR_RETURN(std::vector<float> f, read(name, {rows, cols}));
    Matrix m;
    m.type = weight_type;
    m.rows = rows;
    m.cols = cols;
    if (weight_type == DType::kF32) {
      m.bytes.resize(f.size() * 4);
      std::memcpy(m.bytes.data(), f.data(), m.bytes.size());
    } else {
      m.bytes.resize(f.size() * 2);
      for (size_t i = 0; i < f.size(); ++i) {
        const uint16_t h = Fp32ToFp16(f[i]);
        std::memcpy(m.bytes.data() + 2 * i, &h, 2);
      }
    }
    return m;
  };
  ASSIGN_OR_RETURN(e.word_, read("embeddings.word_embeddings.weight", {config.vocab_size, h}));
  ASSIGN_OR_RETURN(e.position_,
                   read("embeddings.position_embeddings.weight", {config.max_positions, h}));
  ASSIGN_OR_RETURN(e.token_type_,
                   read("embeddings.token_type_embeddings.weight", {config.type_vocab_size, h}));
  ASSIGN_OR_RETURN(e.emb_ln_g_, read("embeddings.LayerNorm.weight", {h}));
  ASSIGN_OR_RETURN(e.emb_ln_b_, read("embeddings.LayerNorm.bias", {h}));
  for (int l = 0; l < config.layers; ++l) {
    const std::string p = absl::StrCat("encoder.layer.", l, ".");
    Layer L;
    ASSIGN_OR_RETURN(L.wq, read_matrix(p + "attention.self.query.weight", h, h));
    ASSIGN_OR_RETURN(L.bq, read(p + "attention.self.query.bias", {h}));
    ASSIGN_OR_RETURN(L.wk, read_matrix(p + "attention.self.key.weight", h, h));
    ASSIGN_OR_RETURN(L.bk, read(p + "attention.self.key.bias", {h}));
    ASSIGN_OR_RETURN(L.wv, read_matrix(p + "attention.self.value.weight", h, h));
    ASSIGN_OR_RETURN(L.bv, read(p + "attention.self.value.bias", {h}));
    ASSIGN_OR_RETURN(L.wo, read_matrix(p + "attention.output.dense.weight", h, h));
    ASSIGN_OR_RETURN(L.bo, read(p + "attention.output.dense.bias", {h}));
    ASSIGN_OR_RETURN(L.ln1_g, read(p + "attention.output.LayerNorm.weight", {h}));
    ASSIGN_OR_RETURN(L.ln1_b, read(p + "attention.output.LayerNorm.bias", {h}));
    ASSIGN_OR_RETURN(L.w1, read_matrix(p + "intermediate.dense.weight", inter, h));
    ASSIGN_OR_RETURN(L.b1, read(p + "intermediate.dense.bias", {inter}));
    ASSIGN_OR_RETURN(L.w2, read_matrix(p + "output.dense.weight", h, inter));
    ASSIGN_OR_RETURN(L.b2, read(p + "output.dense.bias", {h}));
    ASSIGN_OR_RETURN(L.ln2_g, read(p + "output.LayerNorm.weight", {h}));
    ASSIGN_OR_RETURN(L.ln2_b, read(p + "output.LayerNorm.bias", {h}));
    e.layers_.push_back(std::move(L));
  }
  return e;
}

kernels::WeightView BertEncoder::View(const Matrix& m) {
  return WeightView{m.type, m.bytes.data(), m.rows, m.cols};
}

absl::StatusOr<std::vector<float>> BertEncoder::Forward(const std::vector<int32_t>& ids) const {
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n == 0) return absl::InvalidArgumentError("BertEncoder: empty token sequence");
  if (n > config_.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BertEncoder: ", n, " tokens exceed the model's ", config_.max_positions, " positions"));
  }
  for (int32_t id : ids) {
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("BertEncoder: token id ", id,
                                                     " is outside the ", config_.vocab_size,
                                                     "-entry vocabulary"));
    }
  }
  const int64_t h = config_.hidden, inter = config_.intermediate, nh = config_.heads;
  const int64_t hd = h / nh;
  const float eps = config_.layer_norm_eps;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  std::vector<float> x(n * h), q(n * h), k(n * h), v(n * h), ctx(n * h), tmp(n * h), ff(n * inter);
  std::vector<float> qh(n * hd), kh(n * hd), vt(hd * n), scores(n * n);

  for (int64_t t = 0; t < n; ++t) {
    const float* we = word_.data() + static_cast<int64_t>(ids[t]) * h;
    const float* pe = position_.data() + t * h;
    const float* te = token_type_.data();  // token type 0
    float* xr = x.data() + t * h;
    for (int64_t i = 0; i < h; ++i) xr[i] = we[i] + pe[i] + te[i];
  }
  LayerNorm(x.data(), emb_ln_g_.data(), emb_ln_b_.data(), n, h, eps, x.data());

  for (const Layer& L : layers_) {
    const WeightView qkv[3] = {View(L.wq), View(L.wk), View(L.wv)};
    float* const outs[3] = {q.data(), k.data(), v.data()};
    const int64_t strides[3] = {h, h, h};
    kernels::MatMulMany(qkv, 3, x.data(), n, h, outs, strides, nullptr);
    AddBias(q.data(), L.bq.data(), n, h);
    AddBias(k.data(), L.bk.data(), n, h);
    AddBias(v.data(), L.bv.data(), n, h);

    for (int64_t head = 0; head < nh; ++head) {
      // Per-head copies laid out as the matmul's weights want them:
      // scores[t][j] = (q_t / sqrt(hd)) . k_j, ctx[t][d] = sum_j p[t][j] v[j][d].
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t d = 0; d < hd; ++d) {
          qh[t * hd + d] = q[t * h + head * hd + d] * scale;
          kh[t * hd + d] = k[t * h + head * hd + d];
          vt[d * n + t] = v[t * h + head * hd + d];
        }
      }
      kernels::MatMul(WeightView{DType::kF32, kh.data(), n, hd}, qh.data(), n, hd, scores.data(), n,
                      nullptr);
      for (int64_t t = 0; t < n; ++t) kernels::SoftmaxInPlace(scores.data() + t * n, n);
      kernels::MatMul(WeightView{DType::kF32, vt.data(), hd, n}, scores.data(), n, n,
                      ctx.data() + head * hd, h, nullptr);
    }
    kernels::MatMul(View(L.wo), ctx.data(), n, h, tmp.data(), h, nullptr);
    AddBias(tmp.data(), L.bo.data(), n, h);
    kernels::AddInPlace(x.data(), tmp.data(), n * h);
    LayerNorm(x.data(), L.ln1_g.data(), L.ln1_b.data(), n, h, eps, x.data());

    kernels::MatMul(View(L.w1), x.data(), n, h, ff.data(), inter, nullptr);
    AddBias(ff.data(), L.b1.data(), n, inter);
    Gelu(ff.data(), n * inter);
    kernels::MatMul(View(L.w2), ff.data(), n, inter, tmp.data(), h, nullptr);
    AddBias(tmp.data(), L.b2.data(), n, h);
    kernels::AddInPlace(x.data(), tmp.data(), n * h);
    LayerNorm(x.data(), L.ln2_g.data(), L.ln2_b.data(), n, h, eps, x.data());
  }

  std::vector<float> pooled(h, 0.0f);
  for (int64_t t = 0; t < n; ++t) kernels::AddInPlace(pooled.data(), x.data() + t * h, h);
  for (float& p : pooled) p /= static_cast<float>(n);
  return pooled;
}

}  // namespace kvserve::embed
