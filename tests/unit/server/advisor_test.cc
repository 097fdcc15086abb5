// The advisor's choices from a fixed calibration: two different workloads
// get two different, explained configurations; the prediction model behaves
// (more load, longer TPOT); the TOML is what `kvserve serve --config` reads.
#include "server/app/advisor.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace kvserve {
namespace {

Calibration FakeCalibration() {
  Calibration c;
  c.step_fixed_s = 0.004;         // 4 ms a step
  c.decode_per_seq_s = 0.0005;    // + 0.5 ms per decoding sequence
  c.prefill_per_token_s = 0.0001; // + 0.1 ms per prompt token
  c.copy_gbps = 5;
  return c;
}

AdvisorInputs Inputs() {
  AdvisorInputs in;
  in.shape = {30, 3, 64, 8192};  // SmolLM2-135M's KV shape
  in.model_bytes = int64_t{90} << 20;
  in.calibration = FakeCalibration();
  in.model_name = "m";
  return in;
}

bool AnyReason(const Advice& a, const std::string& needle) {
  for (const std::string& r : a.reasons) {
    if (absl::StrContains(r, needle)) return true;
  }
  return false;
}

TEST(AdvisorTest, ChatWithSharedPrefixVersusLongUnsharedPromptsInLittleMemory) {
  // A: a chat service: short prompts mostly a shared system prompt, a TPOT SLO.
  AdvisorInputs a = Inputs();
  a.workload.prompt = *ParseLengthSpec("uniform:200:300");
  a.workload.output = *ParseLengthSpec("128");
  a.workload.prefix_share = 0.7;
  a.workload.concurrency = 4;
  a.workload.slo_tpot_ms = 20;
  a.memory_budget_bytes = int64_t{2} << 30;
  // B: document summaries: long unshared prompts, many clients, tight memory.
  AdvisorInputs b = Inputs();
  b.workload.prompt = *ParseLengthSpec("normal:3000:300");
  b.workload.output = *ParseLengthSpec("64");
  b.workload.concurrency = 16;
  b.memory_budget_bytes = int64_t{1} << 30;

  const Advice x = *Advise(a);
  const Advice y = *Advise(b);
  EXPECT_EQ(x.block_size, 16);
  EXPECT_EQ(y.block_size, 32);
  EXPECT_EQ(x.kv_dtype, "f16");
  EXPECT_NE(y.kv_dtype, "f16") << "16 x 3700 tokens at f16 is 2.6 GiB, more than 1 GiB holds";
  EXPECT_EQ(x.max_seqs, 4);
  EXPECT_EQ(y.max_seqs, 16);
  EXPECT_EQ(x.target_itl_ms, 20);
  EXPECT_EQ(y.target_itl_ms, 0);
  // The TPOT SLO bounds A's step budget: 20 ms - 4 - 2 = 14 ms of 0.1 ms tokens.
  EXPECT_EQ(x.max_batched_tokens, 128);
  EXPECT_GE(y.max_batched_tokens, 2048);
  EXPECT_NE(x.ToToml("a"), y.ToToml("b"));
  // Each choice is explained.
  EXPECT_TRUE(AnyReason(x, "common prefix"));
  EXPECT_TRUE(AnyReason(y, "long prompts"));
  EXPECT_TRUE(AnyReason(y, "f16 would need"));
  EXPECT_TRUE(AnyReason(x, "disaggregation"));
  EXPECT_TRUE(AnyReason(x, "speculative decoding: off"));
  // A's 4 sequences: a draft token's 0.5 ms on a 4 + 4 x 0.5 ms step.
  EXPECT_TRUE(AnyReason(x, "a draft token adds 8% to a step of 4 sequences"));
  EXPECT_NE(y.kv_dtype_cost.find("perplexity"), std::string::npos);
  EXPECT_GT(x.predicted.tpot_ms, 0);
  EXPECT_GT(y.predicted.output_tokens_per_s, 0);
}

TEST(AdvisorTest, PredictionGrowsWithLoadAndShrinksWithHits) {
  AdvisorWorkload w;
  w.prompt = *ParseLengthSpec("200");
  w.output = *ParseLengthSpec("50");
  const Calibration c = FakeCalibration();
  w.concurrency = 1;
  const Prediction one = Predict(w, c, 64, 512, 0);
  w.concurrency = 8;
  const Prediction eight = Predict(w, c, 64, 512, 0);
  EXPECT_GT(eight.tpot_ms, one.tpot_ms);
  EXPECT_GT(eight.output_tokens_per_s, one.output_tokens_per_s);
  const Prediction cached = Predict(w, c, 64, 512, 0.9);
  EXPECT_LT(cached.ttft_ms, eight.ttft_ms);
  // By hand at concurrency 1: a cycle is 50 x 4.5 ms decode + 200 x 0.1 ms.
  EXPECT_NEAR(one.tpot_ms, (50 * 4.5 + 20) / 50.0, 1e-9);
  EXPECT_NEAR(one.ttft_ms, 20 + 4 + 4.5, 1e-9);
  // Open loop past capacity is flagged.
  w.concurrency = 0;
  w.rate = 1000;
  EXPECT_TRUE(Predict(w, c, 64, 512, 0).overloaded);
  w.rate = 0.1;
  EXPECT_FALSE(Predict(w, c, 64, 512, 0).overloaded);
}

// A hybrid-attention model (Gemma 3 270M's KV shape: 18 layers, 1 KV head of
// 256, a 512-token window on 15 layers): memory per KV cache group. Long
// sequences hold far less than with every layer's K/V kept, so the same
// budget advises more sequences at f16, and the advice says why.
TEST(AdvisorTest, HybridModelsAreSizedPerKvCacheGroup) {
  AdvisorInputs flat = Inputs();
  flat.shape = {18, 1, 256, 32768, 512, 15};
  flat.model_bytes = int64_t{240} << 20;
  flat.workload.prompt = *ParseLengthSpec("8000");
  flat.workload.output = *ParseLengthSpec("192");
  flat.workload.concurrency = 24;
  flat.memory_budget_bytes = int64_t{2} << 30;
  AdvisorInputs grouped = flat;
  grouped.shape.layers_per_block = 3;
  grouped.shape.full_groups = 1;
  grouped.shape.window_groups = 5;

  const Advice f = *Advise(flat);
  const Advice g = *Advise(grouped);
  // All layers: 24 x 8192 tokens x 18 KiB/token = 3.4 GiB > the room, so
  // fewer sequences or a smaller dtype; groups: 24 x (8192 x 3 KiB + 5 x
  // ~560 x 3 KiB) = 0.75 GiB fits at f16.
  EXPECT_EQ(g.kv_dtype, "f16");
  EXPECT_EQ(g.max_seqs, 24);
  EXPECT_TRUE(f.kv_dtype != "f16" || f.max_seqs < 24);
  EXPECT_TRUE(AnyReason(g, "KV cache groups: 6 groups of 3 layers (1 full, 5 with a 512-token window)"));
  EXPECT_FALSE(AnyReason(f, "KV cache groups"));
  // The planner's per-sequence bytes: one full group for every block, five
  // window groups for at most their window's blocks.
  kernels::KvDType f16;
  ASSERT_TRUE(kernels::ParseKvDType("f16", &f16));
  const MemoryPlan plan = *PlanKvMemory(grouped.shape, 16, f16, int64_t{1} << 30);
  const int64_t blocks = 8192 / 16;
  EXPECT_EQ(SequenceKvBytes(plan, 8192),
            plan.block_bytes * (blocks + 5 * WindowBlocks(512, 16)));
  EXPECT_EQ(SequenceKvBytes(plan, 100), plan.block_bytes * 6 * 7);  // 7 blocks, all groups
}

TEST(AdvisorTest, BadInputsNameTheProblem) {
  AdvisorInputs in = Inputs();
  in.workload.prompt = *ParseLengthSpec("100");
  in.workload.output = *ParseLengthSpec("10");
  in.memory_budget_bytes = int64_t{1} << 30;
  EXPECT_TRUE(absl::StrContains(Advise(in).status().message(), "--concurrency"));
  in.workload.concurrency = 2;
  in.memory_budget_bytes = int64_t{50} << 20;
  EXPECT_TRUE(absl::StrContains(Advise(in).status().message(), "weights"));
  in.memory_budget_bytes = int64_t{1} << 30;
  in.workload.prompt = *ParseLengthSpec("9000");
  EXPECT_TRUE(absl::StrContains(Advise(in).status().message(), "context"));
  EXPECT_FALSE(ParseLengthSpec("uniform:5").ok());
  EXPECT_FALSE(ParseLengthSpec("zero").ok());
  EXPECT_DOUBLE_EQ(ParseLengthSpec("uniform:100:300")->mean, 200);
}

TEST(AdvisorTest, WorkloadFromABenchResult) {
  const nlohmann::json r = {
      {"config", {{"input_len", "uniform:100:200"}, {"output_len", "32"}, {"slo_tpot_ms", 50.0}}},
      {"runs",
       {{{"load", {{"mode", "closed"}, {"value", 2}}},
         {"summary", {{"prompt_tokens", 1000}, {"cached_tokens", 250}}}},
        {{"load", {{"mode", "closed"}, {"value", 8}}},
         {"summary", {{"prompt_tokens", 1000}, {"cached_tokens", 500}}}}}}};
  const AdvisorWorkload w = *WorkloadFromBench(r);
  EXPECT_EQ(w.concurrency, 8) << "the busiest load point";
  EXPECT_DOUBLE_EQ(w.prefix_share, 0.5);
  EXPECT_DOUBLE_EQ(w.prompt.mean, 150);
  EXPECT_DOUBLE_EQ(w.slo_tpot_ms, 50);
  EXPECT_FALSE(WorkloadFromBench(nlohmann::json::object()).ok());
}

TEST(AdvisorTest, TomlIsTheServeSection) {
  AdvisorInputs in = Inputs();
  in.workload.prompt = *ParseLengthSpec("100");
  in.workload.output = *ParseLengthSpec("10");
  in.workload.concurrency = 2;
  in.memory_budget_bytes = int64_t{1} << 30;
  const std::string toml = Advise(in)->ToToml("line one\nline two");
  EXPECT_TRUE(absl::StartsWith(toml, "# line one\n# line two\n[serve]\n")) << toml;
  EXPECT_TRUE(absl::StrContains(toml, "block-size = 16\n"));
  EXPECT_TRUE(absl::StrContains(toml, "kv-cache-dtype = \"f16\"\n"));
  EXPECT_TRUE(absl::StrContains(toml, "max-seqs = 2\n"));
}

}  // namespace
}  // namespace kvserve
