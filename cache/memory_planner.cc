#include "cache/memory_planner.h"

#include <algorithm>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "cache/kv_pool.h"

namespace kvserve {
namespace {

absl::Status BadBudget(const std::string& text, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid memory budget \"", text, "\": ", why,
                   " (expected bytes such as 1000000, 512MiB, 2GiB, 1.5GB, or a fraction of "
                   "available memory in (0, 1] such as 0.5)"));
}

// Multiplier for a unit suffix; 0 for an unknown one. Binary units (KiB..)
// are powers of 1024, decimal ones (KB..) powers of 1000, as in the IEC and
// SI conventions operators read from `free` and cloud instance sheets.
int64_t UnitMultiplier(absl::string_view unit) {
  const std::string u = absl::AsciiStrToLower(unit);
  if (u.empty() || u == "b") return 1;
  if (u == "kib") return int64_t{1} << 10;
  if (u == "mib") return int64_t{1} << 20;
  if (u == "gib") return int64_t{1} << 30;
  if (u == "tib") return int64_t{1} << 40;
  if (u == "kb") return 1000;
  if (u == "mb") return 1000 * 1000;
  if (u == "gb") return int64_t{1000} * 1000 * 1000;
  if (u == "tb") return int64_t{1000} * 1000 * 1000 * 1000;
  return 0;
}

std::string HumanBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.2f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

}  // namespace

absl::StatusOr<int64_t> ParseMemoryBudget(const std::string& text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  if (s.empty()) return BadBudget(text, "empty");
  // Split "<digits>[.<digits>]" from the unit; a sign, exponent or any other
  // character makes the text garbage rather than a number we guess at.
  size_t i = 0;
  while (i < s.size() && absl::ascii_isdigit(s[i])) ++i;
  const absl::string_view whole = s.substr(0, i);
  absl::string_view frac;
  bool has_point = false;
  if (i < s.size() && s[i] == '.') {
    has_point = true;
    const size_t start = ++i;
    while (i < s.size() && absl::ascii_isdigit(s[i])) ++i;
    frac = s.substr(start, i - start);
  }
  if (whole.empty() && frac.empty()) {
    return BadBudget(text, s[0] == '-' ? "negative" : "not a number");
  }
  const absl::string_view unit = absl::StripLeadingAsciiWhitespace(s.substr(i));
  const int64_t mult = UnitMultiplier(unit);
  if (mult == 0) return BadBudget(text, absl::StrCat("unknown unit \"", unit, "\""));

  // A bare number with a decimal point is a fraction of available memory;
  // a bare integer is a byte count, so "1" is one byte, never "everything".
  if (unit.empty() && has_point) {
    const double fraction = std::strtod(std::string(s).c_str(), nullptr);
    if (!(fraction > 0.0)) return BadBudget(text, "must be greater than zero");
    if (fraction > 1.0) return BadBudget(text, "a fraction of available memory must be at most 1");
    const int64_t available = AvailableMemoryBytes();
    if (available <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("memory budget \"", text,
                       "\" is a fraction of available memory, which is unknown here "
                       "(no MemAvailable in /proc/meminfo); give a size such as 2GiB"));
    }
    const int64_t bytes =
        static_cast<int64_t>(std::floor(fraction * static_cast<double>(available)));
    if (bytes <= 0) return BadBudget(text, "resolves to zero bytes");
    return bytes;
  }

  // Integer part exactly, so large byte counts are not rounded through a double.
  int64_t whole_value = 0;
  for (char c : whole) {
    if (__builtin_mul_overflow(whole_value, int64_t{10}, &whole_value) ||
        __builtin_add_overflow(whole_value, int64_t{c - '0'}, &whole_value)) {
      return BadBudget(text, "too large");
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(whole_value, mult, &bytes)) return BadBudget(text, "too large");
  if (!frac.empty()) {
    // At most 18 fraction digits matter for a multiplier below 2^63.
    const absl::string_view digits = frac.substr(0, 18);
    const double f = std::strtod(absl::StrCat("0.", digits).c_str(), nullptr);
    const int64_t extra = static_cast<int64_t>(std::floor(f * static_cast<double>(mult)));
    if (__builtin_add_overflow(bytes, extra, &bytes)) return BadBudget(text, "too large");
  }
  if (bytes <= 0) return BadBudget(text, "must be greater than zero");
  return bytes;
}

int64_t AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    // "MemAvailable:   12345678 kB"
    absl::string_view v(line);
    if (!absl::ConsumePrefix(&v, "MemAvailable:")) continue;
    v = absl::StripAsciiWhitespace(v);
    if (!absl::ConsumeSuffix(&v, "kB")) return 0;
    int64_t kib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &kib) || kib < 0 ||
        kib > std::numeric_limits<int64_t>::max() / 1024) {
      return 0;
    }
    return kib * 1024;
  }
  return 0;
}

absl::StatusOr<MemoryPlan> PlanKvMemory(const KvShape& shape, int32_t block_size,
                                        kernels::KvDType dtype, int64_t budget_bytes) {
  if (shape.n_layers <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.context_length <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV shape needs positive layers, KV heads, head_dim and context length (got ",
                     shape.n_layers, ", ", shape.n_kv_heads, ", ", shape.head_dim, ", ",
                     shape.context_length, ")"));
  }
  if (block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size must be positive (got ", block_size, ")"));
  }
  if (budget_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV memory budget must be positive (got ", budget_bytes, " bytes)"));
  }
  const bool grouped = shape.layers_per_block > 0 && shape.full_groups + shape.window_groups > 1;
  KvPoolOptions po;
  po.n_layers = grouped ? shape.layers_per_block : shape.n_layers;
  po.n_kv_heads = shape.n_kv_heads;
  po.head_dim = shape.head_dim;
  po.block_size = block_size;
  po.dtype = dtype;
  MemoryPlan plan;
  plan.budget_bytes = budget_bytes;
  plan.block_size = block_size;
  // Same formula the pool allocates with, so the plan is what Create() gets.
  plan.block_bytes = KvPool::BlockBytes(po);
  plan.kv_bytes_per_token = plan.block_bytes / block_size;
  plan.num_blocks = budget_bytes / plan.block_bytes;
  if (plan.num_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV memory budget of ", budget_bytes, " bytes (", HumanBytes(budget_bytes),
                     ") holds no block: one block of ", block_size, " tokens needs ",
                     plan.block_bytes, " bytes (", HumanBytes(plan.block_bytes), ")"));
  }
  plan.token_capacity = plan.num_blocks * block_size;
  const int64_t blocks_per_context = (int64_t{shape.context_length} + block_size - 1) / block_size;
  plan.full_context_sequences = plan.num_blocks / blocks_per_context;
  plan.n_layers = shape.n_layers;
  plan.windowed_layers = shape.windowed_layers;
  if (shape.sliding_window > 0) {
    constexpr int64_t k32k = 32768;
    const int64_t full_32k = (k32k + block_size - 1) / block_size;
    plan.sliding_window = shape.sliding_window;
    plan.sequences_at_32k_full_attention = plan.num_blocks / full_32k;
    // Only a window on every layer frees blocks (a block holds all layers).
    const bool frees = shape.windowed_layers == shape.n_layers;
    plan.window_blocks_per_sequence =
        frees ? std::min(WindowBlocks(shape.sliding_window, block_size), blocks_per_context)
              : blocks_per_context;
    const int64_t per_seq_32k =
        frees ? std::min(WindowBlocks(shape.sliding_window, block_size), full_32k) : full_32k;
    plan.sequences_at_32k_windowed = plan.num_blocks / per_seq_32k;
    plan.full_context_sequences = plan.num_blocks / plan.window_blocks_per_sequence;
  }
  if (grouped) {
    // Each group has its own table of pages: the full groups hold the whole
    // context, the window groups their window's blocks.
    plan.kv_groups = shape.full_groups + shape.window_groups;
    plan.layers_per_block = shape.layers_per_block;
    plan.full_groups = shape.full_groups;
    plan.window_groups = shape.window_groups;
    plan.kv_bytes_per_token = plan.block_bytes * plan.kv_groups / block_size;  // before windows
    const int64_t window_pages =
        shape.sliding_window > 0
            ? std::min(WindowBlocks(shape.sliding_window, block_size), blocks_per_context)
            : blocks_per_context;
    plan.group_pages_per_sequence =
        shape.full_groups * blocks_per_context + shape.window_groups * window_pages;
    plan.full_context_sequences = plan.num_blocks / plan.group_pages_per_sequence;
    // Tokens every group can hold at once (before the windows free pages).
    plan.token_capacity = plan.num_blocks / plan.kv_groups * block_size;
    plan.full_context_sequences_all_layers =
        plan.num_blocks / (int64_t{plan.kv_groups} * blocks_per_context);
    constexpr int64_t k32k = 32768;
    const int64_t full_32k = (k32k + block_size - 1) / block_size;
    plan.window_blocks_per_sequence = window_pages;
    plan.sequences_at_32k_full_attention = plan.num_blocks / (plan.kv_groups * full_32k);
    plan.sequences_at_32k_windowed =
        plan.num_blocks /
        (shape.full_groups * full_32k +
         shape.window_groups * std::min(WindowBlocks(shape.sliding_window, block_size), full_32k));
  }
  return plan;
}

int64_t SequenceKvBytes(const MemoryPlan& plan, int64_t tokens) {
  const int64_t bs = std::max<int64_t>(1, plan.block_size);
  const int64_t blocks = (std::max<int64_t>(tokens, 0) + bs - 1) / bs;
  const int64_t window =
      plan.sliding_window > 0 ? std::min(blocks, WindowBlocks(plan.sliding_window, plan.block_size))
                              : blocks;
  if (plan.kv_groups > 0) {
    return plan.block_bytes * (plan.full_groups * blocks + plan.window_groups * window);
  }
  if (plan.sliding_window > 0 && plan.windowed_layers == plan.n_layers) {
    return plan.block_bytes * window;
  }
  return plan.block_bytes * blocks;
}

int64_t WindowBlocks(int32_t window, int32_t block_size) {
  // Slots [L - window + 1, L] touch at most ceil((window - 1) / bs) + 1
  // blocks; the block the next token lands in may be one more.
  return (int64_t{window} - 1 + block_size - 1) / block_size + 2;
}

std::string MemoryPlan::ToString() const {
  return absl::StrCat(
      "KV budget: ", budget_bytes, " bytes (", HumanBytes(budget_bytes), ")\n",
      "KV per token: ", kv_bytes_per_token, " bytes (", HumanBytes(kv_bytes_per_token), ")\n",
      "block: ", block_size, " tokens, ", block_bytes, " bytes (", HumanBytes(block_bytes), ")\n",
      "blocks: ", num_blocks, "\n", "token capacity: ", token_capacity, "\n",
      "full-context sequences: ", full_context_sequences, "\n",
      kv_groups > 0
          ? absl::StrCat(
                "KV cache groups: ", kv_groups, " of ", layers_per_block, " layers (", full_groups,
                " full, ", window_groups, " with a ", sliding_window,
                "-token window), one pool of pages of the block above\n",
                "pages per full-context sequence: ", group_pages_per_sequence, " (each full group ",
                (group_pages_per_sequence - int64_t{window_groups} * window_blocks_per_sequence) /
                    std::max(full_groups, 1),
                ", each window group at most ", window_blocks_per_sequence, ")\n",
                "full-context sequences, all-layers layout: ", full_context_sequences_all_layers,
                "\n", "32k-token sequences: ", sequences_at_32k_windowed, " with the groups, ",
                sequences_at_32k_full_attention, " in the all-layers layout\n")
      : sliding_window == 0
          ? std::string()
          : absl::StrCat("sliding window: ", sliding_window, " tokens on ", windowed_layers, " of ",
                         n_layers, " layers",
                         windowed_layers == n_layers
                             ? absl::StrCat(" (at most ", window_blocks_per_sequence,
                                            " blocks per running sequence; the prefix "
                                            "cache keeps at most ",
                                            (sliding_window + block_size - 1) / block_size + 1,
                                            " per cached prompt boundary)")
                             : std::string(" (blocks hold every layer: none freed; the "
                                           "windowed layers save attention work, not "
                                           "memory)"),
                         "\n", "32k-token sequences: ", sequences_at_32k_windowed,
                         " with the window, ", sequences_at_32k_full_attention,
                         " with full attention\n"));
}

}  // namespace kvserve
