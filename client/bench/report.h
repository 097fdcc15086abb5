// Summaries and reports of kvserve-bench runs: the table on stdout, the
// JSON result file and the self-contained HTML report. Pure functions of
// the records; nothing here talks to a server.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "client/bench/backend.h"
#include "nlohmann/json.hpp"

namespace kvserve::bench {

struct Distribution {
  int count = 0;
  double mean = 0, p50 = 0, p90 = 0, p95 = 0, p99 = 0, max = 0;
  static Distribution Of(std::vector<double> values);
  nlohmann::json ToJson(double scale) const;
};

struct Slo {
  double ttft_ms = 0;  // 0: no bound
  double tpot_ms = 0;
};

// Summary of the measured (non-warm-up) records of one run.
struct Summary {
  int completed = 0;
  int failed = 0;
  std::map<std::string, int> errors;
  double duration_s = 0;  // first start to last end
  double request_throughput = 0, output_throughput = 0, total_throughput = 0;
  double goodput = 0;  // req/s meeting both SLOs
  int good_requests = 0;
  // Requests resent once on a fresh connection after a reused one failed
  // before any response byte (RequestRecord::connection_retries); never
  // counted as failures.
  int connection_retries = 0;
  long prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  Distribution ttft, tpot, itl, e2e;  // seconds
  static Summary Of(const std::vector<RequestRecord>& records, const Slo& slo);
  nlohmann::json ToJson() const;
};

// One run: a target at one load point.
struct Run {
  std::string target;
  std::string load_label;              // "concurrency=4", "rate=2/s (poisson)"
  std::string load_mode;               // closed | open
  double load_value = 0;               // concurrency or rate
  std::vector<RequestRecord> records;  // warm-up included, flagged
  Summary summary;
};

nlohmann::json RecordToJson(const RequestRecord& r);
// The whole result file; see client/README.md "kvserve-bench" for the schema.
nlohmann::json ResultsToJson(const nlohmann::json& config, const std::vector<Run>& runs);
std::string FormatTable(const std::vector<Run>& runs);
// Ratios B/A for each load point when runs alternate between two targets.
std::string FormatComparison(const std::vector<Run>& runs);
// `compare`: the runs alternate between two targets (--compare); the ratio
// table then comes first and each load point's targets share one chart.
std::string RenderHtml(const nlohmann::json& config, const std::vector<Run>& runs,
                       bool compare = false);

// Tick values for an axis from 0 to `max`: 0, step, 2 step, ... with a step
// of 1, 2 or 5 times a power of ten, at most about `target` ticks; the last
// tick is >= max (the axis ends there).
std::vector<double> NiceTicks(double max, int target = 5);
// A tick label in plain decimals, as many as the step needs (0.25, 1.5,
// 2000; never 1.74e+0). Thousands above 10^4 get a k (12k), millions an M.
std::string TickLabel(double v, double step);

}  // namespace kvserve::bench
