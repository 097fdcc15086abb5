#include "cache/memory_planner.h"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

TEST(ParseMemoryBudgetTest, SizesWithUnits) {
  EXPECT_EQ(ParseMemoryBudget("512MiB").value(), int64_t{512} << 20);
  EXPECT_EQ(ParseMemoryBudget("2GiB").value(), int64_t{2} << 30);
  EXPECT_EQ(ParseMemoryBudget("1.5GB").value(), int64_t{1500000000});
  EXPECT_EQ(ParseMemoryBudget("1.5MiB").value(), int64_t{1572864});
  EXPECT_EQ(ParseMemoryBudget("0.5GiB").value(), int64_t{1} << 29);
  EXPECT_EQ(ParseMemoryBudget("4KiB").value(), 4096);
  EXPECT_EQ(ParseMemoryBudget("1kb").value(), 1000);
  EXPECT_EQ(ParseMemoryBudget("3TiB").value(), int64_t{3} << 40);
  EXPECT_EQ(ParseMemoryBudget(" 2 GiB ").value(), int64_t{2} << 30);
  EXPECT_EQ(ParseMemoryBudget("1000000").value(), 1000000);
  EXPECT_EQ(ParseMemoryBudget("1000000B").value(), 1000000);
  // A bare integer is bytes, never "all memory".
  EXPECT_EQ(ParseMemoryBudget("1").value(), 1);
  EXPECT_EQ(ParseMemoryBudget("9223372036854775807").value(), INT64_MAX);
}

TEST(ParseMemoryBudgetTest, FractionOfAvailableMemory) {
  const int64_t before = AvailableMemoryBytes();
  if (before <= 0) GTEST_SKIP() << "no MemAvailable on this system";
  const int64_t half = ParseMemoryBudget("0.5").value();
  const int64_t all = ParseMemoryBudget("1.0").value();
  const int64_t after = AvailableMemoryBytes();
  // Available memory moves between reads; allow for that drift.
  const int64_t lo = std::min(before, after), hi = std::max(before, after);
  const int64_t slack = int64_t{64} << 20;
  EXPECT_GE(half, lo / 2 - slack);
  EXPECT_LE(half, hi / 2 + slack);
  EXPECT_GE(all, lo - slack);
  EXPECT_LE(all, hi + slack);
}

TEST(ParseMemoryBudgetTest, GarbageIsInvalidArgumentNamingTheText) {
  for (const std::string text :
       {"", "abc", "-1", "-0.5", "0", "0.0", "0MiB", "1.5", "5.", "12XB", "1e9", "1..5", "MiB",
        "2 GiB extra", "99999999999999999999", "9000000TiB", "8589934592GiB"}) {
    SCOPED_TRACE(text);
    const absl::StatusOr<int64_t> r = ParseMemoryBudget(text);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("\"" + text + "\""));
  }
  EXPECT_THAT(std::string(ParseMemoryBudget("-1").status().message()), HasSubstr("negative"));
  EXPECT_THAT(std::string(ParseMemoryBudget("1.5").status().message()), HasSubstr("at most 1"));
  EXPECT_THAT(std::string(ParseMemoryBudget("9000000TiB").status().message()),
              HasSubstr("too large"));
}

// MemTotal from /proc/meminfo in bytes, read here independently; 0 when
// there is none.
int64_t MemTotalBytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    if (fields >> key >> kib && key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

// Linux always has /proc/meminfo's MemAvailable: a reading of 0 (the
// function's "unknown") is a parse failure, and what it reports must lie
// between a plausible floor and the machine's total memory.
TEST(AvailableMemoryTest, ReportsSomethingPlausibleOnLinux) {
  const int64_t total = MemTotalBytes();
  ASSERT_GT(total, 0) << "no MemTotal in /proc/meminfo";
  const int64_t avail = AvailableMemoryBytes();
  EXPECT_GT(avail, int64_t{16} << 20);
  EXPECT_LE(avail, total);
}

KvShape SmolLm2() { return KvShape{30, 3, 64, 8192}; }

TEST(PlanKvMemoryTest, SmolLm2InF16WithBlocksOf16) {
  const MemoryPlan p =
      PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, int64_t{2} << 30).value();
  // K and V x 30 layers x 3 KV heads x 64 dims x 2 bytes.
  EXPECT_EQ(p.kv_bytes_per_token, 23040);
  EXPECT_EQ(p.block_bytes, 368640);
  EXPECT_EQ(p.block_size, 16);
  EXPECT_EQ(p.budget_bytes, int64_t{2147483648});
  EXPECT_EQ(p.num_blocks, 5825);  // 2147483648 / 368640 = 5825.4
  EXPECT_EQ(p.token_capacity, 93200);
  EXPECT_EQ(p.full_context_sequences, 11);  // 8192 tokens = 512 blocks each
  const std::string text = p.ToString();
  EXPECT_THAT(text, HasSubstr("23040"));
  EXPECT_THAT(text, HasSubstr("5825"));
  EXPECT_THAT(text, HasSubstr("93200"));
  EXPECT_THAT(text, HasSubstr("2.00 GiB"));
}

// Scales are part of the block, so the planner counts them: per token,
// K and V x 30 layers x 3 KV heads x (data + scale bytes).
TEST(PlanKvMemoryTest, QuantizedCodecsCountTheirScales) {
  const int64_t budget = int64_t{2} << 30;
  const auto bytes = [&](kernels::KvDType t) {
    return PlanKvMemory(SmolLm2(), 16, t, budget)->kv_bytes_per_token;
  };
  EXPECT_EQ(bytes(kernels::KvDType::kBF16), 23040);
  EXPECT_EQ(bytes(kernels::KvDType::kInt8), 180 * (64 + 4));
  EXPECT_EQ(bytes(kernels::KvDType::kFp8E4M3), 180 * (64 + 4));
  EXPECT_EQ(bytes(kernels::KvDType::kFp8E5M2), 180 * (64 + 4));
  EXPECT_EQ(bytes(kernels::KvDType::kInt4), 180 * (32 + 2 * 4));
  const int64_t f16_seqs =
      PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, budget)->full_context_sequences;
  const int64_t int4_seqs =
      PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kInt4, budget)->full_context_sequences;
  EXPECT_GE(int4_seqs, 3 * f16_seqs);
}

TEST(PlanKvMemoryTest, FullContextSequencesRoundDown) {
  const int64_t one_context = int64_t{512} * 368640;
  EXPECT_EQ(
      PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, one_context)->full_context_sequences, 1);
  const MemoryPlan short_by_a_byte =
      PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, one_context - 1).value();
  EXPECT_EQ(short_by_a_byte.num_blocks, 511);
  EXPECT_EQ(short_by_a_byte.full_context_sequences, 0);
}

TEST(PlanKvMemoryTest, TinyShapeInF32) {
  // stories260K-like: 5 layers, 4 KV heads, head_dim 8, context 512.
  const KvShape tiny{5, 4, 8, 512};
  const MemoryPlan p = PlanKvMemory(tiny, 4, kernels::KvDType::kF32, int64_t{1} << 20).value();
  EXPECT_EQ(p.kv_bytes_per_token, 2 * 5 * 4 * 8 * 4);  // 1280
  EXPECT_EQ(p.block_bytes, 5120);
  EXPECT_EQ(p.num_blocks, 204);  // 1048576 / 5120 = 204.8
  EXPECT_EQ(p.token_capacity, 816);
  EXPECT_EQ(p.full_context_sequences, 1);  // 128 blocks per context

  // A context that is not a multiple of the block size still needs whole blocks.
  const KvShape odd{5, 4, 8, 5};
  EXPECT_EQ(PlanKvMemory(odd, 4, kernels::KvDType::kF32, 5 * 5120)->full_context_sequences, 2);
}

TEST(PlanKvMemoryTest, BudgetBelowOneBlockIsAnError) {
  const absl::StatusOr<MemoryPlan> p = PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, 368639);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("368640"));
  EXPECT_TRUE(PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, 368640).ok());
}

TEST(PlanKvMemoryTest, BadShapesAreRejected) {
  EXPECT_EQ(
      PlanKvMemory(KvShape{0, 3, 64, 8192}, 16, kernels::KvDType::kF16, 1 << 30).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(PlanKvMemory(SmolLm2(), 0, kernels::KvDType::kF16, 1 << 30).ok());
  EXPECT_FALSE(PlanKvMemory(SmolLm2(), 16, kernels::KvDType::kF16, 0).ok());
  EXPECT_FALSE(PlanKvMemory(KvShape{30, 3, 64, 0}, 16, kernels::KvDType::kF16, 1 << 30).ok());
}

}  // namespace
}  // namespace kvserve
