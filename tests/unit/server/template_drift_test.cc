// The template-drift guard with a Qwen3-style template that shows an empty
// reasoning block on the turn being generated and drops it from past
// assistant turns: the second turn's prompt leaves the cached first turn at
// the block's position, the explainer reports "diverged at token N" with
// exactly that N, and with canonicalization the second turn hits the whole
// cached first turn. Tokens are bytes here (no model needed).
#include "server/service/template_drift.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/cache_control.h"
#include "scheduler/kv_cache_manager.h"
#include "server/service/tenants.h"

namespace kvserve {
namespace {

// ChatML; the assistant turn being generated opens with an empty think
// block, past assistant turns render without one (the drift).
std::string Render(const std::vector<ChatMessage>& msgs, bool date_line = false) {
  std::string s;
  if (date_line) s += "<|im_start|>system\nToday is 2026-12-02.<|im_end|>\n";
  for (const ChatMessage& m : msgs) {
    s += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  }
  return s + "<|im_start|>assistant\n<think>\n\n</think>\n\n";
}

std::vector<int32_t> Bytes(const std::string& s) {
  return std::vector<int32_t>(s.begin(), s.end());
}

struct Cache {
  std::unique_ptr<CacheControl> cc = std::make_unique<CacheControl>(CacheControlOptions{});
  std::unique_ptr<KvCacheManager> kv;
  Cache() {
    KvCacheManagerOptions o;
    o.pool.n_layers = 1;
    o.pool.n_kv_heads = 1;
    o.pool.head_dim = 8;
    o.pool.block_size = 16;
    o.pool.n_blocks = 256;
    o.pool.dtype = kernels::KvDType::kF32;
    o.prefix.model_identity = "test";
    kv = KvCacheManager::Create(std::move(o)).value();
  }
  void Run(const std::vector<int32_t>& t, std::string_view salt) {
    SeqKv s(kv->mutable_pool());
    const int32_t hit = kv->MatchPrefix(&s, salt, t, static_cast<int32_t>(t.size()));
    const int32_t rest = static_cast<int32_t>(t.size()) - hit;
    ASSERT_TRUE(kv->AllocateSlots(&s, rest).ok());
    kv->MarkComputed(&s, rest);
    kv->Commit(&s, salt, t, rest);
    kv->Free(&s, salt, t);
  }
  CacheReport Explain(const std::vector<int32_t>& t, std::string_view salt) {
    return cc->Explain(*kv, nullptr, salt, t, nullptr);
  }
};

TEST(TemplateDriftTest, DriftingSecondTurnDivergesAtTheRightTokenAndCanonicalizationHits) {
  const std::string scope = TenantCacheScope("alice", "");
  const std::vector<ChatMessage> turn1 = {{"system", "You are a careful assistant."},
                                          {"user", "Name three rivers in Europe, please."}};
  const std::string reply = "The Danube, the Rhine and the Loire.";
  for (bool canonicalize : {false, true}) {
    SCOPED_TRACE(canonicalize ? "canonicalize" : "plain");
    Cache cache;
    TemplateDriftGuard guard(canonicalize);
    // Turn 1: rendered, remembered, computed with its reply (cached).
    const std::string p1 = Render(turn1);
    guard.Remember(scope, turn1, p1);
    cache.Run(Bytes(p1 + reply + "<|im_end|>"), scope);
    // Turn 2: the same history, the reply, a new question.
    std::vector<ChatMessage> turn2 = turn1;
    turn2.push_back({"assistant", reply});
    turn2.push_back({"user", "And which is longest?"});
    const std::string p2 = Render(turn2);
    const DriftCheck d = guard.Check(scope, turn2, p2);
    ASSERT_TRUE(d.known);
    ASSERT_TRUE(d.drift);
    // Where the drift is: the first-turn prompt's think block.
    const size_t think = p1.find("<think>");
    ASSERT_NE(think, std::string::npos);
    EXPECT_EQ(d.char_pos, think);
    EXPECT_EQ(guard.drifts(), 1);
    if (!canonicalize) {
      const CacheReport r = cache.Explain(Bytes(p2), scope);
      EXPECT_EQ(r.reason, "diverged") << r.detail;
      ASSERT_TRUE(r.diverged_at.has_value());
      // The right N: the first token where the cached turn and this prompt differ.
      size_t n = 0;
      const std::string cached = p1 + reply + "<|im_end|>";
      while (n < cached.size() && n < p2.size() && cached[n] == p2[n]) ++n;
      EXPECT_EQ(static_cast<size_t>(*r.diverged_at), n);
      EXPECT_EQ(n, think) << "bytes are tokens here";
      EXPECT_EQ(r.cached_tokens, static_cast<int32_t>(n));
      ASSERT_FALSE(r.cached_next.empty());
      EXPECT_EQ(r.cached_next[0], '<') << "the cached path goes on with <think>";
    } else {
      ASSERT_EQ(d.canonical.substr(0, p1.size()), p1) << "history rendered as cached";
      const CacheReport r = cache.Explain(Bytes(d.canonical), scope);
      EXPECT_EQ(r.reason, "hit") << r.detail;
      EXPECT_GE(r.cached_tokens, static_cast<int32_t>(p1.size() + reply.size()));
    }
  }
}

TEST(TemplateDriftTest, NoDriftNoNoiseAndScopesAreSeparate) {
  TemplateDriftGuard guard(true);
  const std::vector<ChatMessage> turn1 = {{"user", "hello"}};
  // A template without drift: history renders as it was.
  auto stable = [](const std::vector<ChatMessage>& msgs) {
    std::string s;
    for (const ChatMessage& m : msgs) s += "<" + m.role + ">" + m.content + "</>";
    return s + "<assistant>";
  };
  guard.Remember("a", turn1, stable(turn1));
  std::vector<ChatMessage> turn2 = turn1;
  turn2.push_back({"assistant", "hi there"});
  turn2.push_back({"user", "how are you"});
  DriftCheck d = guard.Check("a", turn2, stable(turn2));
  EXPECT_TRUE(d.known);
  EXPECT_FALSE(d.drift);
  // Another scope never saw turn 1.
  d = guard.Check("b", turn2, stable(turn2));
  EXPECT_FALSE(d.known);
  // A date line added at the top drifts at character 0... of the history.
  guard.Remember("c", turn1, Render(turn1));
  d = guard.Check("c", turn2, Render(turn2, /*date_line=*/true));
  EXPECT_TRUE(d.drift);
  EXPECT_EQ(d.char_pos, std::string("<|im_start|>").size());
  EXPECT_EQ(guard.drifts(), 1);
}

}  // namespace
}  // namespace kvserve
