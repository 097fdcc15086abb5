// family_fixture: writes the fixture GGUFs the family tests use
// (tests/testing/gguf_writer.h) to files, and dumps kvserve's teacher-forced
// logits for a token sequence, so the fixtures can be compared with another
// implementation (docs/model-families.md, "Against llama.cpp"). A developer
// tool: not installed, not run by CTest.
//
//   family_fixture write OUT.gguf [--arch llama|mistral|qwen2] [--layers N]
//       [--dim N] [--heads N] [--kv-heads N] [--ffn N] [--context N]
//       [--weight-type f32|f16|q8_0] [--tied] [--seed N]
//       [--rope-scaling llama3|llama3-tensor|linear] [--rope-factor F]
//       [--rope-original-context N] [--rope-freqs FILE]
//       [--window W] [--window-pattern N]
//   family_fixture tokenize MODEL.gguf TEXT_FILE      (ids, one a line, BOS first)
//   family_fixture logits MODEL.gguf IDS_FILE OUT.f32 [CHUNK]
//       (n_tokens x n_vocab floats; CHUNK tokens per forward call, default 64)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cache/kv_pool.h"
#include "common/thread_pool.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "tests/testing/gguf_writer.h"

namespace kvserve {
namespace {

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "family_fixture: %s\n", message.c_str());
  std::exit(2);
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) Fail("cannot open " + path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

int Write(int argc, char** argv) {
  if (argc < 3) Fail("write: no output file");
  testing::TinyLlamaOptions o;
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--tied") {
      o.tied_output = true;
      continue;
    }
    if (i + 1 >= argc) Fail(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--arch")
      o.architecture = v;
    else if (flag == "--layers")
      o.n_layers = std::stoi(v);
    else if (flag == "--dim")
      o.dim = std::stoi(v);
    else if (flag == "--heads")
      o.n_heads = std::stoi(v);
    else if (flag == "--kv-heads")
      o.n_kv_heads = std::stoi(v);
    else if (flag == "--ffn")
      o.ffn_dim = std::stoi(v);
    else if (flag == "--context")
      o.context_length = std::stoi(v);
    else if (flag == "--seed")
      o.seed = std::stoull(v);
    else if (flag == "--rope-scaling")
      o.rope_scaling = v;
    else if (flag == "--rope-factor")
      o.rope_scaling_factor = std::stof(v);
    else if (flag == "--rope-original-context")
      o.rope_original_context = std::stoi(v);
    else if (flag == "--window")
      o.sliding_window = std::stoi(v);
    else if (flag == "--window-pattern")
      o.sliding_window_pattern = std::stoi(v);
    else if (flag == "--rope-freqs") {
      std::istringstream in(ReadAll(v));
      for (float x; in >> x;) o.rope_freqs.push_back(x);
    } else if (flag == "--weight-type") {
      if (v == "f32")
        o.weight_type = GgmlType::kF32;
      else if (v == "f16")
        o.weight_type = GgmlType::kF16;
      else if (v == "q8_0")
        o.weight_type = GgmlType::kQ8_0;
      else
        Fail("unknown --weight-type " + v);
    } else {
      Fail("unknown flag " + flag);
    }
  }
  std::ofstream(argv[2], std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  return 0;
}

int Tokenize(int argc, char** argv) {
  if (argc < 4) Fail("tokenize: MODEL.gguf TEXT_FILE");
  auto file = GgufFile::Open(argv[2]);
  if (!file.ok()) Fail(file.status().ToString());
  auto tok = Tokenizer::FromGguf(**file);
  if (!tok.ok()) Fail(tok.status().ToString());
  for (int32_t id : (*tok)->Encode(ReadAll(argv[3]), true, false)) std::printf("%d\n", id);
  return 0;
}

// One sequence, prefilled in chunks (64 tokens by default; 1 is decode), with
// an F32 KV cache; every position's logits.
int Logits(int argc, char** argv) {
  if (argc < 5) Fail("logits: MODEL.gguf IDS_FILE OUT.f32 [CHUNK]");
  const int chunk = argc > 5 ? std::stoi(argv[5]) : 64;
  if (chunk < 1) Fail("CHUNK must be at least 1");
  auto m = LlamaModel::Load(argv[2]);
  if (!m.ok()) Fail(m.status().ToString());
  std::vector<int32_t> tokens;
  std::istringstream in(ReadAll(argv[3]));
  for (int32_t t; in >> t;) tokens.push_back(t);
  const LlamaConfig& c = (*m)->config();
  const int n = static_cast<int>(tokens.size());
  const int block = 16, blocks = (n + block - 1) / block;
  KvPoolOptions po{c.n_layers, c.n_kv_heads, c.head_dim, block, blocks, kernels::KvDType::kF32};
  auto pool = KvPool::Create(po);
  if (!pool.ok()) Fail(pool.status().ToString());
  std::vector<BlockHandle> handles;
  if (!(*pool)->Allocate(blocks, &handles).ok()) Fail("KV allocation failed");
  std::vector<int32_t> ids;
  for (const BlockHandle& h : handles) ids.push_back(h.id);
  const int32_t offsets[2] = {0, blocks};
  std::vector<float> logits(static_cast<size_t>(n) * c.vocab_size);
  for (int start = 0; start < n; start += chunk) {
    const int len = std::min(chunk, n - start);
    std::vector<int32_t> t(tokens.begin() + start, tokens.begin() + start + len);
    std::vector<int32_t> seq(len, 0), pos(len), rows(len);
    for (int i = 0; i < len; ++i) {
      pos[i] = start + i;
      rows[i] = i;
    }
    const absl::Status s = (*m)->Forward({t, seq, pos, rows}, (*pool)->View(ids.data(), offsets, 1),
                                         logits.data() + static_cast<size_t>(start) * c.vocab_size,
                                         &ThreadPool::Global());
    if (!s.ok()) Fail(s.ToString());
  }
  std::ofstream out(argv[4], std::ios::binary);
  out.write(reinterpret_cast<const char*>(logits.data()),
            static_cast<std::streamsize>(logits.size() * sizeof(float)));
  std::fprintf(stderr, "%d tokens x %d logits -> %s\n", n, c.vocab_size, argv[4]);
  return 0;
}

}  // namespace
}  // namespace kvserve

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "write") return kvserve::Write(argc, argv);
    if (cmd == "tokenize") return kvserve::Tokenize(argc, argv);
    if (cmd == "logits") return kvserve::Logits(argc, argv);
  } catch (const std::exception& e) {  // std::stoi and friends on a bad value
    std::fprintf(stderr, "family_fixture: bad flag value (%s)\n", e.what());
    return 2;
  }
  std::fprintf(stderr,
               "usage: family_fixture write|tokenize|logits ... (see the source's header)\n");
  return 2;
}
