// The configuration advisor behind `kvserve advise`: from a workload (length
// distributions, common-prefix share, load, SLOs), a memory budget, the
// model's shape and a calibration measured on this machine (the engine's
// step cost), it picks block size, KV dtype, KV budget and tiers, batch
// budget, and says whether speculative decoding and prefill/decode
// disaggregation pay, each with its reason and the predicted TTFT, TPOT and
// throughput. Pure functions: the calibration is measured by the command
// (server/app/cmd_advise.cc) and passed in, so tests feed their own.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/memory_planner.h"
#include "nlohmann/json.hpp"

namespace kvserve {

// A length distribution as kvserve-bench writes it: "N", "fixed:N",
// "uniform:LO:HI", "normal:MEAN:STD".
struct LengthSpec {
  double mean = 0;
  double high = 0;  // the length to reserve for (uniform: HI; normal: mean + 2.33 std)
  std::string text;
};
[[nodiscard]] absl::StatusOr<LengthSpec> ParseLengthSpec(const std::string& text);

struct AdvisorWorkload {
  LengthSpec prompt, output;
  double prefix_share = 0;   // of prompt tokens, the share that is a common prefix (0..1)
  int32_t prefixes = 1;      // distinct common prefixes in use
  int32_t concurrency = 0;   // closed loop: clients with one request each in flight
  double rate = 0;           // open loop: requests per second (when concurrency is 0)
  double slo_ttft_ms = 0;    // 0: none
  double slo_tpot_ms = 0;
  std::string source;        // "flags" or the kvserve-bench result it came from
};

// A kvserve-bench JSON result as the workload: its lengths, load and SLOs,
// and the prefix share its server measured (cached / prompt tokens).
[[nodiscard]] absl::StatusOr<AdvisorWorkload> WorkloadFromBench(const nlohmann::json& result);

// Step cost measured on this machine: step = fixed + per_seq * decoding
// sequences + per_prefill_token * prompt tokens.
struct Calibration {
  double step_fixed_s = 0;
  double decode_per_seq_s = 0;
  double prefill_per_token_s = 0;
  double copy_gbps = 0;  // host memcpy bandwidth, an upper bound on a KV transfer
  std::vector<std::pair<int, double>> decode_steps;  // (batch, seconds per step) measured
  double prefill_tokens_per_s = 0;
};

struct AdvisorInputs {
  AdvisorWorkload workload;
  int64_t memory_budget_bytes = 0;  // weights + KV (+ host tier) together
  int64_t model_bytes = 0;          // the weights file
  KvShape shape;
  Calibration calibration;
  std::string model_name;
};

struct Prediction {
  double ttft_ms = 0;
  double tpot_ms = 0;
  double output_tokens_per_s = 0;
  double requests_per_s = 0;
  double utilization = 0;  // engine busy share (open loop); 1 in a closed loop
  bool overloaded = false;
};

struct Advice {
  int32_t block_size = 16;
  std::string kv_dtype = "f16";
  std::string kv_dtype_cost;  // its measured perplexity cost and where it was measured
  int64_t kv_cache_bytes = 0;
  int64_t kv_host_bytes = 0;
  int64_t kv_disk_bytes = 0;  // 0: no disk tier
  int32_t max_seqs = 0;
  int32_t max_batched_tokens = 512;
  double target_itl_ms = 0;  // 0: off
  bool speculation = false;
  bool disaggregate = false;
  Prediction predicted;
  std::vector<std::string> reasons;  // one per choice, in the order above
  std::vector<std::string> warnings;
  nlohmann::json ToJson() const;
  // The TOML `kvserve serve --config` reads ([serve] section).
  std::string ToToml(const std::string& header_comment) const;
  std::string ToText() const;
};

[[nodiscard]] absl::StatusOr<Advice> Advise(const AdvisorInputs& in);

// The model the predictions use, for a given batch budget (exposed for
// tests): closed loop at workload.concurrency, or open loop at workload.rate.
Prediction Predict(const AdvisorWorkload& w, const Calibration& c, int32_t max_seqs,
                   int32_t max_batched_tokens, double prefix_hit_share);

// Bytes as "512MiB" / "1.5GiB", what --kv-cache-memory parses.
std::string FormatBytes(int64_t bytes);

}  // namespace kvserve
