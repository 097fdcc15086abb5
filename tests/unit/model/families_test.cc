// The model families beyond plain Llama -- Llama 3.x RoPE scaling, Qwen2's
// Q/K/V biases and NeoX rotation, sliding-window attention (uniform, as
// Mistral's sliding_window, and per layer) -- on tiny fixture GGUFs written
// with each family's metadata layout, against a plain-loop forward written
// here from the papers' formulas (double precision, no kernels).
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_pool.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

std::string Write(const testing::TinyLlamaOptions& o, const std::string& name) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  return path;
}

testing::TinyLlamaOptions Small() {
  testing::TinyLlamaOptions o;
  o.n_layers = 2;
  o.dim = 32;
  o.n_heads = 2;
  o.n_kv_heads = 1;
  o.ffn_dim = 48;
  o.context_length = 128;
  return o;
}

// Plain loops over the fixture's F32 tensors.
class ReferenceForward {
 public:
  ReferenceForward(const GgufFile& f, const testing::TinyLlamaOptions& o) : f_(f), o_(o) {}

  // Logits of every position of `tokens` (one sequence from position 0).
  std::vector<std::vector<double>> Run(const std::vector<int32_t>& tokens) const {
    const int dim = o_.dim, nh = o_.n_heads, nkv = o_.n_kv_heads;
    const int hd = o_.head_dim > 0 ? o_.head_dim : dim / nh;
    const bool gemma = o_.architecture == "gemma3";
    const bool qk_norm = gemma || o_.architecture == "qwen3";
    const int n = static_cast<int>(tokens.size());
    const int vocab = static_cast<int>(f_.FindTensor("token_embd.weight")->shape[1]);
    std::vector<std::vector<double>> x(n, std::vector<double>(dim));
    for (int t = 0; t < n; ++t) {
      const float* e = T("token_embd.weight") + static_cast<int64_t>(tokens[t]) * dim;
      // Gemma scales the embeddings by sqrt(dim).
      for (int i = 0; i < dim; ++i) x[t][i] = e[i] * (gemma ? std::sqrt(static_cast<double>(dim)) : 1.0);
    }
    for (int l = 0; l < o_.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      std::vector<std::vector<double>> q(n), k(n), v(n);
      for (int t = 0; t < n; ++t) {
        const std::vector<double> xn = Norm(x[t], p + "attn_norm.weight");
        q[t] = MatVec(p + "attn_q.weight", xn, nh * hd);
        k[t] = MatVec(p + "attn_k.weight", xn, nkv * hd);
        v[t] = MatVec(p + "attn_v.weight", xn, nkv * hd);
        if (o_.architecture == "qwen2") {
          AddBias(&q[t], p + "attn_q.bias");
          AddBias(&k[t], p + "attn_k.bias");
          AddBias(&v[t], p + "attn_v.bias");
        }
        if (qk_norm) {  // RMSNorm over each head, before RoPE
          for (int h = 0; h < nh; ++h) NormSlice(&q[t], h * hd, hd, p + "attn_q_norm.weight");
          for (int h = 0; h < nkv; ++h) NormSlice(&k[t], h * hd, hd, p + "attn_k_norm.weight");
        }
        for (int h = 0; h < nh; ++h) Rotate(&q[t], h * hd, hd, t, LayerBase(l));
        for (int h = 0; h < nkv; ++h) Rotate(&k[t], h * hd, hd, t, LayerBase(l));
      }
      const bool windowed = o_.sliding_window > 0 && Local(l);
      for (int t = 0; t < n; ++t) {
        std::vector<double> attn(nh * hd, 0.0);
        const int lo = windowed ? std::max(0, t - o_.sliding_window + 1) : 0;
        for (int h = 0; h < nh; ++h) {
          const int kvh = h / (nh / nkv);
          std::vector<double> s(t + 1, 0.0);
          double mx = -1e300;
          for (int j = lo; j <= t; ++j) {
            double d = 0;
            for (int i = 0; i < hd; ++i) d += q[t][h * hd + i] * k[j][kvh * hd + i];
            s[j] = d / std::sqrt(static_cast<double>(hd));  // gemma3 (not 27B) too
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (int j = lo; j <= t; ++j) sum += (s[j] = std::exp(s[j] - mx));
          for (int j = lo; j <= t; ++j) {
            for (int i = 0; i < hd; ++i) attn[h * hd + i] += s[j] / sum * v[j][kvh * hd + i];
          }
        }
        std::vector<double> o = MatVec(p + "attn_output.weight", attn, dim);
        if (gemma) o = Norm(o, p + "post_attention_norm.weight");
        for (int i = 0; i < dim; ++i) x[t][i] += o[i];
        const std::vector<double> xn = Norm(x[t], p + "ffn_norm.weight");
        std::vector<double> g = MatVec(p + "ffn_gate.weight", xn, o_.ffn_dim);
        const std::vector<double> u = MatVec(p + "ffn_up.weight", xn, o_.ffn_dim);
        for (int i = 0; i < o_.ffn_dim; ++i) {
          // GELU (tanh form) for Gemma, SiLU otherwise. Gemma's as ggml's
          // CPU backend (llama.cpp) has it: input and result rounded to f16.
          double a = g[i];
          if (gemma) {
            a = Fp16ToFp32(Fp32ToFp16(static_cast<float>(a)));
            const double gelu =
                a <= -10 ? 0.0
                : a >= 10
                    ? a
                    : Fp16ToFp32(Fp32ToFp16(static_cast<float>(
                          0.5 * a * (1 + std::tanh(std::sqrt(2 / 3.14159265358979323846) *
                                                   (a + 0.044715 * a * a * a))))));
            g[i] = gelu * u[i];
          } else {
            g[i] = a / (1 + std::exp(-a)) * u[i];
          }
        }
        std::vector<double> d = MatVec(p + "ffn_down.weight", g, dim);
        if (gemma) d = Norm(d, p + "post_ffw_norm.weight");
        for (int i = 0; i < dim; ++i) x[t][i] += d[i];
      }
    }
    std::vector<std::vector<double>> logits(n);
    const std::string head = f_.FindTensor("output.weight") ? "output.weight" : "token_embd.weight";
    for (int t = 0; t < n; ++t) {
      logits[t] = MatVec(head, Norm(x[t], "output_norm.weight"), vocab);
      if (o_.final_logit_softcap > 0) {
        for (double& z : logits[t]) z = o_.final_logit_softcap * std::tanh(z / o_.final_logit_softcap);
      }
    }
    return logits;
  }

 private:
  const float* T(const std::string& name) const {
    const GgufTensorInfo* t = f_.FindTensor(name);
    EXPECT_NE(t, nullptr) << name;
    EXPECT_EQ(t->type, GgmlType::kF32) << name;
    return reinterpret_cast<const float*>(t->data);
  }
  std::vector<double> MatVec(const std::string& name, const std::vector<double>& x, int out) const {
    const float* w = T(name);
    const int in = static_cast<int>(x.size());
    std::vector<double> y(out, 0.0);
    for (int o = 0; o < out; ++o) {
      for (int i = 0; i < in; ++i) y[o] += static_cast<double>(w[static_cast<int64_t>(o) * in + i]) * x[i];
    }
    return y;
  }
  std::vector<double> Norm(const std::vector<double>& x, const std::string& name) const {
    const float* w = T(name);
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + 1e-5);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
    return y;
  }
  // A layer is local (windowed, its own RoPE base for Gemma) unless the
  // pattern makes it global: every sliding_window_pattern-th layer, Gemma 3's
  // default pattern being 6.
  bool Local(int l) const {
    const int pattern = o_.sliding_window_pattern > 0 ? o_.sliding_window_pattern
                        : o_.architecture == "gemma3" ? 6
                                                      : 0;
    return pattern == 0 || (l + 1) % pattern != 0;
  }
  double LayerBase(int l) const {
    if (o_.architecture != "gemma3" || o_.sliding_window == 0 || !Local(l)) return o_.rope_freq_base;
    return o_.rope_freq_base_swa > 0 ? o_.rope_freq_base_swa : 10000.0;
  }
  void NormSlice(std::vector<double>* x, int off, int n, const std::string& name) const {
    std::vector<double> part(x->begin() + off, x->begin() + off + n);
    part = Norm(part, name);
    std::copy(part.begin(), part.end(), x->begin() + off);
  }
  void AddBias(std::vector<double>* x, const std::string& name) const {
    const float* b = T(name);
    for (size_t i = 0; i < x->size(); ++i) (*x)[i] += b[i];
  }
  // Llama 3.1's rope_scaling as its reference code states it
  // (apply_scaling in Meta's llama/model.py).
  double Divisor(int i, int hd) const {
    if (o_.rope_scaling == "llama3-tensor") return 1.0 + 0.5 * i;
    if (o_.rope_scaling != "llama3") return 1.0;
    const double freq = std::pow(static_cast<double>(o_.rope_freq_base), -2.0 * i / hd);
    const double wavelen = 2 * 3.14159265358979323846 / freq, old = o_.rope_original_context;
    const double low_wavelen = old / 1.0, high_wavelen = old / 4.0;
    if (wavelen < high_wavelen) return 1.0;
    if (wavelen > low_wavelen) return o_.rope_scaling_factor;
    const double smooth = (old / wavelen - 1.0) / (4.0 - 1.0);
    const double scaled_freq = (1 - smooth) * freq / o_.rope_scaling_factor + smooth * freq;
    return freq / scaled_freq;
  }
  void Rotate(std::vector<double>* x, int off, int hd, int pos, double base) const {
    const bool neox = o_.architecture == "qwen2" || o_.architecture == "qwen3" ||
                      o_.architecture == "gemma3";
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = pos * std::pow(base, -2.0 * i / hd) / Divisor(i, hd);
      const int i0 = off + (neox ? i : 2 * i), i1 = off + (neox ? i + hd / 2 : 2 * i + 1);
      const double a = (*x)[i0], b = (*x)[i1];
      (*x)[i0] = a * std::cos(angle) - b * std::sin(angle);
      (*x)[i1] = a * std::sin(angle) + b * std::cos(angle);
    }
  }

  const GgufFile& f_;
  const testing::TinyLlamaOptions& o_;
};

// The model's logits for every position: one prefill pass (`one_pass`), or
// token by token as decode does.
std::vector<std::vector<float>> ModelLogits(LlamaModel* m, const std::vector<int32_t>& tokens,
                                            bool one_pass) {
  const LlamaConfig& c = m->config();
  const int n = static_cast<int>(tokens.size());
  const int block = 4, blocks = (n + block - 1) / block;
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, block, blocks, kernels::KvDType::kF32};
  auto pool = KvPool::Create(po).value();
  std::vector<BlockHandle> handles;
  EXPECT_TRUE(pool->Allocate(blocks, &handles).ok());
  std::vector<int32_t> ids;
  for (const BlockHandle& h : handles) ids.push_back(h.id);
  const int32_t offsets[2] = {0, blocks};
  ThreadPool tp(2);
  std::vector<std::vector<float>> out(n, std::vector<float>(c.vocab_size));
  if (one_pass) {
    std::vector<int32_t> seq(n, 0), pos(n), rows(n);
    for (int i = 0; i < n; ++i) pos[i] = rows[i] = i;
    std::vector<float> all(static_cast<size_t>(n) * c.vocab_size);
    EXPECT_TRUE(m->Forward({tokens, seq, pos, rows}, pool->View(ids.data(), offsets, 1), all.data(), &tp).ok());
    for (int i = 0; i < n; ++i) out[i].assign(all.begin() + i * c.vocab_size, all.begin() + (i + 1) * c.vocab_size);
  } else {
    for (int i = 0; i < n; ++i) {
      const std::vector<int32_t> t = {tokens[i]}, seq = {0}, pos = {i}, rows = {0};
      EXPECT_TRUE(m->Forward({t, seq, pos, rows}, pool->View(ids.data(), offsets, 1), out[i].data(), &tp).ok());
    }
  }
  return out;
}

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> t = {1};
  for (int i = 1; i < n; ++i) t.push_back(3 + (i * 37) % 250);
  return t;
}

struct FamilyCase {
  const char* name;
  testing::TinyLlamaOptions options;
};

class FamilyForwardTest : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyForwardTest, MatchesPlainLoopReference) {
  const testing::TinyLlamaOptions o = GetParam().options;
  auto m = LlamaModel::Load(Write(o, std::string("family-") + GetParam().name + ".gguf"));
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int32_t> tokens = Tokens(24);
  const auto want = ReferenceForward((*m)->file(), o).Run(tokens);
  for (bool one_pass : {true, false}) {
    const auto got = ModelLogits(m->get(), tokens, one_pass);
    double worst = 0;
    for (size_t t = 0; t < tokens.size(); ++t) {
      for (size_t v = 0; v < want[t].size(); ++v) worst = std::max(worst, std::fabs(got[t][v] - want[t][v]));
    }
    EXPECT_LT(worst, 2e-3) << GetParam().name << (one_pass ? " (prefill)" : " (decode)");
  }
}

FamilyCase Case(const char* name, void (*edit)(testing::TinyLlamaOptions*)) {
  testing::TinyLlamaOptions o = Small();
  edit(&o);
  return {name, o};
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyForwardTest,
    ::testing::Values(
        Case("llama", [](testing::TinyLlamaOptions*) {}),
        Case("llama3_scaling_metadata",
             [](testing::TinyLlamaOptions* o) { o->rope_scaling = "llama3"; }),
        Case("llama3_rope_freqs_tensor",
             [](testing::TinyLlamaOptions* o) { o->rope_scaling = "llama3-tensor"; }),
        // Llama 3.2 (1B/3B): llama3 scaling and a tied head (no output.weight).
        Case("llama32_tied", [](testing::TinyLlamaOptions* o) {
          o->rope_scaling = "llama3";
          o->tied_output = true;
        }),
        Case("qwen2", [](testing::TinyLlamaOptions* o) {
          o->architecture = "qwen2";
          o->tied_output = true;
        }),
        Case("mistral_sliding_window", [](testing::TinyLlamaOptions* o) {
          o->architecture = "mistral";
          o->sliding_window = 8;
        }),
        Case("per_layer_window", [](testing::TinyLlamaOptions* o) {
          o->sliding_window = 5;
          o->sliding_window_pattern = 2;  // layer 0 windowed, layer 1 global
        }),
        Case("qwen3", [](testing::TinyLlamaOptions* o) {
          o->architecture = "qwen3";
          o->head_dim = 24;  // wider than dim / heads, as Qwen3's are
          o->tied_output = true;
        }),
        // Gemma 3 with its default pattern: layers 0-4 local (window 5, RoPE
        // base 10000), layer 5 global (base 1e6).
        Case("gemma3", [](testing::TinyLlamaOptions* o) {
          o->architecture = "gemma3";
          o->n_layers = 6;
          o->head_dim = 24;
          o->tied_output = true;
          o->rope_freq_base = 1e6f;
          o->sliding_window = 5;
        }),
        Case("gemma3_pattern_softcap_swa_base", [](testing::TinyLlamaOptions* o) {
          o->architecture = "gemma3";
          o->n_layers = 3;
          o->head_dim = 16;
          o->rope_freq_base = 1e6f;
          o->rope_freq_base_swa = 100.0f;
          o->sliding_window = 6;
          o->sliding_window_pattern = 3;
          o->final_logit_softcap = 2.0f;
        })),
    [](const auto& info) { return std::string(info.param.name); });

// The features change the logits (so the reference comparison above could
// fail): each against the same weights without it.
TEST(FamilyForwardTest, EachFeatureChangesTheOutput) {
  auto differs = [](testing::TinyLlamaOptions with, const char* name) {
    testing::TinyLlamaOptions without = Small();
    auto a = LlamaModel::Load(Write(with, std::string("with-") + name + ".gguf"));
    auto b = LlamaModel::Load(Write(without, std::string("without-") + name + ".gguf"));
    EXPECT_TRUE(a.ok() && b.ok());
    const auto la = ModelLogits(a->get(), Tokens(24), true);
    const auto lb = ModelLogits(b->get(), Tokens(24), true);
    double d = 0;
    for (size_t v = 0; v < la.back().size(); ++v) d = std::max(d, static_cast<double>(std::fabs(la.back()[v] - lb.back()[v])));
    return d;
  };
  testing::TinyLlamaOptions o = Small();
  o.rope_scaling = "llama3";
  EXPECT_GT(differs(o, "llama3"), 1e-3);
  o = Small();
  o.sliding_window = 8;
  EXPECT_GT(differs(o, "window"), 1e-3);
}

// Gemma 3's parts each change its logits: the local layers' RoPE base, the
// window, the soft-cap (against the same weights without each).
TEST(FamilyForwardTest, GemmaFeaturesChangeTheOutput) {
  testing::TinyLlamaOptions base = Small();
  base.architecture = "gemma3";
  base.n_layers = 6;
  base.head_dim = 24;
  base.rope_freq_base = 1e6f;
  base.sliding_window = 5;
  auto last_logits = [](const testing::TinyLlamaOptions& o, const std::string& name) {
    auto m = LlamaModel::Load(Write(o, "gemma-feature-" + name + ".gguf"));
    EXPECT_TRUE(m.ok()) << m.status();
    return ModelLogits(m->get(), Tokens(24), true).back();
  };
  const std::vector<float> ref = last_logits(base, "base");
  auto dist = [&](const std::vector<float>& v) {
    double d = 0;
    for (size_t i = 0; i < v.size(); ++i) d = std::max(d, static_cast<double>(std::fabs(v[i] - ref[i])));
    return d;
  };
  testing::TinyLlamaOptions o = base;
  o.rope_freq_base_swa = 1e6f;  // local layers on the global base
  EXPECT_GT(dist(last_logits(o, "swa-base")), 1e-3);
  o = base;
  o.sliding_window = 64;  // beyond the 24 tokens: no window
  EXPECT_GT(dist(last_logits(o, "no-window")), 1e-3);
  o = base;
  o.final_logit_softcap = 1.0f;
  EXPECT_GT(dist(last_logits(o, "softcap")), 1e-3);

  auto f = GgufFile::Open(Write(base, "cfg-gemma3.gguf"));
  ASSERT_TRUE(f.ok());
  auto c = LlamaConfig::FromGguf(**f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qk_norm && c->post_norms && c->gelu_ffn);
  EXPECT_FLOAT_EQ(c->embed_scale, std::sqrt(32.0f));
  EXPECT_EQ(c->n_windowed_layers(), 5);
  EXPECT_FALSE(c->LayerWindowed(5));
  EXPECT_FLOAT_EQ(c->RopeForLayer(0).freq_base, 10000.0f);
  EXPECT_FLOAT_EQ(c->RopeForLayer(5).freq_base, 1e6f);
  EXPECT_FLOAT_EQ(c->attention_scale, 1.0f / std::sqrt(24.0f));
}

TEST(FamilyConfigTest, MetadataIsReadPerFamily) {
  testing::TinyLlamaOptions o = Small();
  o.rope_scaling = "llama3";
  auto f = GgufFile::Open(Write(o, "cfg-llama3.gguf"));
  ASSERT_TRUE(f.ok());
  auto c = LlamaConfig::FromGguf(**f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling, "llama3");
  ASSERT_EQ(c->rope_freq_factors.size(), 8u);
  EXPECT_FLOAT_EQ(c->rope_freq_factors[0], 1.0f);   // short wavelengths kept
  EXPECT_FLOAT_EQ(c->rope_freq_factors[7], 8.0f);   // long ones stretched by factor
  EXPECT_GT(c->rope_freq_factors[1], 1.0f);         // the band between interpolated
  EXPECT_LT(c->rope_freq_factors[1], 8.0f);

  // original_context_length as gguf-py writes it (uint32, what the fixture
  // writes) and as a float: the same factors.
  EXPECT_TRUE((*f)->GetI64("llama.rope.scaling.original_context_length").ok());
  const std::vector<float> from_u32 = c->rope_freq_factors;
  std::string bytes = testing::MakeTinyLlamaGguf(o);
  {
    // The same file with the key's type tag and value rewritten as F32.
    const std::string key = "llama.rope.scaling.original_context_length";
    const size_t at = bytes.find(key);
    ASSERT_NE(at, std::string::npos);
    const size_t tag = at + key.size();
    uint32_t f32_tag = 6;
    float v = 64.0f;
    std::memcpy(&bytes[tag], &f32_tag, 4);
    std::memcpy(&bytes[tag + 4], &v, 4);
    const std::string path = testing::TempDir() + "/cfg-llama3-f32len.gguf";
    std::ofstream(path, std::ios::binary) << bytes;
    auto ff = GgufFile::Open(path);
    ASSERT_TRUE(ff.ok()) << ff.status();
    auto cf = LlamaConfig::FromGguf(**ff);
    ASSERT_TRUE(cf.ok()) << cf.status();
    EXPECT_EQ(cf->rope_freq_factors, from_u32);
  }

  o = Small();
  o.architecture = "qwen2";
  f = GgufFile::Open(Write(o, "cfg-qwen2.gguf"));
  c = LlamaConfig::FromGguf(**f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_EQ(c->rope_style, kernels::RopeStyle::kNeox);

  o = Small();
  o.n_layers = 4;
  o.sliding_window = 16;
  o.sliding_window_pattern = 2;
  f = GgufFile::Open(Write(o, "cfg-window.gguf"));
  c = LlamaConfig::FromGguf(**f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 16);
  EXPECT_EQ(c->n_windowed_layers(), 2);
  EXPECT_TRUE(c->LayerWindowed(0));
  EXPECT_FALSE(c->LayerWindowed(1));
}

// What these families may carry that kvserve does not run is refused by name.
TEST(FamilyConfigTest, UnsupportedPartsAreRefusedByName) {
  auto refused = [](testing::TinyLlamaOptions o, const std::string& name) {
    auto m = LlamaModel::Load(Write(o, "refused-" + name + ".gguf"));
    EXPECT_FALSE(m.ok()) << name;
    return m.ok() ? std::string() : std::string(m.status().message());
  };
  testing::TinyLlamaOptions o = Small();
  o.rope_scaling = "yarn";
  EXPECT_THAT(refused(o, "yarn"), HasSubstr("rope scaling 'yarn' is not supported"));
  o = Small();
  o.expert_count = 8;
  EXPECT_THAT(refused(o, "moe"), HasSubstr("llama.expert_count is not supported"));
  o = Small();
  o.architecture = "gemma2";
  EXPECT_THAT(refused(o, "gemma2"), HasSubstr("architecture 'gemma2'"));
  // A qwen3 file missing its QK-norm names the tensor.
  o = Small();
  o.architecture = "qwen3";
  o.omit_qk_norm = true;
  EXPECT_THAT(refused(o, "qwen3-noqknorm"), HasSubstr("blk.0.attn_q_norm.weight"));
  // A qwen2 file without its biases names the missing tensor.
  o = Small();
  o.architecture = "qwen2";
  o.omit_qkv_bias = true;
  EXPECT_THAT(refused(o, "qwen2-nobias"), HasSubstr("blk.0.attn_q.bias"));
}

}  // namespace
}  // namespace kvserve
