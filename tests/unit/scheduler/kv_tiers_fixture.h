// The KV tiers unit tests' shared fixture (kv_tiers_test.cc and
// kv_tiers_reencode_test.cc): a tiny written model, greedy prompts of
// random tokens, and a run-to-completion Generate over a hand-stepped engine.
#pragma once

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "tests/testing/generate.h"
#include "tests/testing/test_models.h"

namespace kvserve::tiers_testing {

inline const testing::WrittenModel& Tiny() {
  return testing::TinyWrittenModel("kv-tiers-tiny", 512);
}
inline ThreadPool* Pool() { return testing::TestPool(); }

constexpr int32_t kBlocks = 5;  // 80 tokens: one 64-token prompt and its output

inline SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

inline std::vector<int32_t> PromptOf(int seed, int len = 64) {
  std::vector<int32_t> p(len);
  std::mt19937 rng(seed);
  for (int32_t& t : p) t = 1 + static_cast<int32_t>(rng() % 40);
  return p;
}

// A fresh directory under the test temp dir, `prefix` + `name`.
inline std::string ScratchDir(const std::string& prefix, const char* name) {
  std::string d = testing::TempDir() + "/" + prefix + name;
  std::filesystem::remove_all(d);
  return d;
}

// A block's content tag: n bytes any block of that hash must hold.
inline void Tag(uint8_t* p, int64_t n, uint64_t hash) {
  uint64_t x = hash;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    p[i] = static_cast<uint8_t>(x >> 56);
  }
}
inline bool HasTag(const uint8_t* p, int64_t n, uint64_t hash) {
  std::vector<uint8_t> want(n);
  Tag(want.data(), n, hash);
  return std::memcmp(p, want.data(), n) == 0;
}

struct Result {
  std::vector<int32_t> tokens;
  SeqEvent last;
};

inline Result Generate(Engine& e, const std::vector<int32_t>& prompt, int max_tokens = 8) {
  Result r;
  auto id = e.Submit({prompt, Greedy(max_tokens)}, [&](const SeqEvent& ev) {
    r.tokens.insert(r.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
    r.last = ev;
  });
  EXPECT_TRUE(id.ok());
  while (e.Step()) {
  }
  return r;
}

}  // namespace kvserve::tiers_testing
