// Metrics render valid Prometheus text exposition: the test parses the
// output line by line as a scraper would and checks the format's rules
// (one HELP/TYPE per family before its samples, valid names and labels,
// parseable values, cumulative histogram buckets ending in +Inf that agree
// with _count), and that recorded events show up in the right series.
#include "server/observe/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Family {
  std::string help;
  std::string type;
  std::vector<Sample> samples;
};

struct Parsed {
  std::map<std::string, Family> families;
  std::vector<std::string> order;
};

double ParseValue(const std::string& s) {
  if (s == "+Inf") return INFINITY;
  if (s == "-Inf") return -INFINITY;
  if (s == "NaN") return NAN;
  size_t used = 0;
  double v = std::stod(s, &used);
  EXPECT_EQ(used, s.size()) << "value '" << s << "'";
  return v;
}

// The family a sample belongs to: histogram samples carry a suffix.
std::string FamilyOf(const std::string& sample_name, const std::map<std::string, Family>& fams) {
  if (fams.count(sample_name)) return sample_name;
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (sample_name.size() > s.size() &&
        sample_name.compare(sample_name.size() - s.size(), s.size(), s) == 0) {
      return sample_name.substr(0, sample_name.size() - s.size());
    }
  }
  return sample_name;
}

// Parses `text` into `*out` and fails the test on any violation of the
// format rules (void so that ASSERT_* may stop at the first broken line).
void ParseInto(const std::string& text, Parsed* out) {
  static const std::regex kName("[a-zA-Z_:][a-zA-Z0-9_:]*");
  static const std::regex kHelp("# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*)");
  static const std::regex kType("# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)");
  static const std::regex kSample(
      "([a-zA-Z_:][a-zA-Z0-9_:]*)(\\{(.*)\\})? ([^ ]+)");
  static const std::regex kLabel("([a-zA-Z_][a-zA-Z0-9_]*)=\"((?:[^\"\\\\\\n]|\\\\[\\\\\"n])*)\"(,|$)");
  Parsed& p = *out;
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "exposition must end with a newline";
  std::set<std::string> seen_series;
  std::string current;  // family whose samples may follow
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    SCOPED_TRACE("line " + std::to_string(lineno) + ": " + line);
    ASSERT_FALSE(line.empty()) << "blank line";
    std::smatch m;
    if (line.rfind("# HELP ", 0) == 0) {
      ASSERT_TRUE(std::regex_match(line, m, kHelp));
      const std::string name = m[1];
      EXPECT_EQ(p.families.count(name), 0u) << "second HELP for " << name;
      p.families[name].help = m[2];
      p.order.push_back(name);
      current = name;
    } else if (line.rfind("# TYPE ", 0) == 0) {
      ASSERT_TRUE(std::regex_match(line, m, kType));
      const std::string name = m[1];
      EXPECT_EQ(name, current) << "TYPE must follow its HELP";
      EXPECT_TRUE(p.families[name].type.empty()) << "second TYPE for " << name;
      EXPECT_TRUE(p.families[name].samples.empty()) << "TYPE after samples";
      p.families[name].type = m[2];
    } else if (line[0] == '#') {
      ADD_FAILURE() << "unexpected comment";
    } else {
      ASSERT_TRUE(std::regex_match(line, m, kSample));
      Sample s;
      s.name = m[1];
      std::string labels = m[3];
      while (!labels.empty()) {
        std::smatch lm;
        ASSERT_TRUE(std::regex_search(labels, lm, kLabel, std::regex_constants::match_continuous))
            << "bad label list '" << labels << "'";
        EXPECT_EQ(s.labels.count(lm[1]), 0u) << "duplicate label " << lm[1];
        s.labels[lm[1]] = lm[2];
        labels = lm.suffix();
      }
      s.value = ParseValue(m[4]);
      const std::string fam = FamilyOf(s.name, p.families);
      EXPECT_EQ(fam, current) << "sample outside its family's block";
      EXPECT_TRUE(std::regex_match(s.name, kName));
      const std::string series = std::string(m[1]) + "{" + std::string(m[3]) + "}";
      EXPECT_TRUE(seen_series.insert(series).second) << "duplicate series " << series;
      p.families[fam].samples.push_back(std::move(s));
    }
  }
  for (const auto& [name, fam] : p.families) {
    EXPECT_FALSE(fam.type.empty()) << name << " has no TYPE";
    EXPECT_FALSE(fam.samples.empty()) << name << " has no samples";
    if (fam.type == "counter" || fam.type == "histogram") {
      for (const Sample& s : fam.samples) EXPECT_GE(s.value, 0) << s.name;
    }
  }
}

Parsed ParseExposition(const std::string& text) {
  Parsed p;
  ParseInto(text, &p);
  return p;
}

// Checks the histogram rules for one family; returns its _count.
double CheckHistogram(const Family& fam, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(fam.type, "histogram");
  double prev_le = -INFINITY, prev_count = 0, inf_count = -1, count = -1;
  bool has_sum = false;
  for (const Sample& s : fam.samples) {
    if (s.name == name + "_bucket") {
      EXPECT_LT(inf_count, 0) << "bucket after +Inf";
      auto it = s.labels.find("le");
      EXPECT_NE(it, s.labels.end());
      if (it == s.labels.end()) continue;
      const double le = ParseValue(it->second);
      EXPECT_GT(le, prev_le) << "le not increasing";
      EXPECT_GE(s.value, prev_count) << "buckets not cumulative";
      prev_le = le;
      prev_count = s.value;
      if (std::isinf(le)) inf_count = s.value;
    } else if (s.name == name + "_sum") {
      has_sum = true;
    } else if (s.name == name + "_count") {
      count = s.value;
    } else {
      ADD_FAILURE() << "unexpected sample " << s.name;
    }
  }
  EXPECT_TRUE(has_sum);
  EXPECT_GE(inf_count, 0) << "no +Inf bucket";
  EXPECT_EQ(inf_count, count) << "+Inf bucket must equal _count";
  return count;
}

// The value of the sample named `name` (a histogram's _bucket/_sum/_count
// included) whose labels include `labels`.
double Value(const Parsed& p, const std::string& name,
             const std::map<std::string, std::string>& labels = {}) {
  auto it = p.families.find(FamilyOf(name, p.families));
  if (it == p.families.end()) {
    ADD_FAILURE() << "no family for " << name;
    return NAN;
  }
  for (const Sample& s : it->second.samples) {
    bool match = s.name == name;
    for (const auto& [k, v] : labels) {
      auto l = s.labels.find(k);
      match = match && l != s.labels.end() && l->second == v;
    }
    if (match) return s.value;
  }
  ADD_FAILURE() << "no sample for " << name;
  return NAN;
}

EngineStats SomeStats() {
  EngineStats s;
  s.blocks_total = 100;
  s.blocks_used = 25;
  s.blocks_free = 75;
  s.kv_utilization = 0.25;
  s.slot_efficiency = 0.875;
  s.preemptions = 3;
  s.running = 4;
  s.waiting = 2;
  s.last_batch_tokens = 130;
  s.last_batch_seqs = 5;
  s.last_batch_prefill_tokens = 125;
  s.last_token_budget = 140;
  s.step_prefill_ms_per_token = 2.5;
  s.kv_arriving = 1;
  s.kv_loads = 7;
  s.kv_evicted_tokens = 96;
  return s;
}

TEST(MetricsTest, FreshRenderIsValidExposition) {
  Metrics m("stories260K");
  const Parsed p = ParseExposition(m.Render(EngineStats{}));
  for (const char* name :
       {"kvserve:num_requests_running", "kvserve:num_requests_waiting",
        "kvserve:kv_cache_usage_perc", "kvserve:num_preemptions_total",
        "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
        "kvserve:request_success_total", "kvserve:time_to_first_token_seconds",
        "kvserve:inter_token_latency_seconds", "kvserve:e2e_request_latency_seconds",
        "kvserve:kv_blocks_used", "kvserve:kv_blocks_free", "kvserve:kv_slot_efficiency",
        "kvserve:batch_tokens"}) {
    EXPECT_EQ(p.families.count(name), 1u) << name;
  }
  EXPECT_EQ(CheckHistogram(p.families.at("kvserve:time_to_first_token_seconds"),
                           "kvserve:time_to_first_token_seconds"),
            0);
  // Outcome series exist before the first request so rate() sees them.
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "stop"}}), 0);
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "cancelled"}}), 0);
}

TEST(MetricsTest, EverySeriesIsLabelledWithTheModel) {
  Metrics m("my \"quoted\" model\\x");
  const Parsed p = ParseExposition(m.Render(SomeStats()));
  for (const auto& [name, fam] : p.families) {
    for (const Sample& s : fam.samples) {
      auto it = s.labels.find("model_name");
      ASSERT_NE(it, s.labels.end()) << s.name;
      EXPECT_EQ(it->second, "my \\\"quoted\\\" model\\\\x");
    }
  }
}

TEST(MetricsTest, CountersAndGaugesCarryTheirValues) {
  Metrics m("m");
  m.AddPromptTokens(5);
  m.AddPromptTokens(7);
  m.AddGenerationTokens(48);
  m.AddGenerationTokens(-3);  // ignored: counters never decrease
  m.RequestFinished("stop");
  m.RequestFinished("length");
  m.RequestFinished("length");
  m.RequestFinished("some_new_outcome");
  const Parsed p = ParseExposition(m.Render(SomeStats()));
  EXPECT_EQ(Value(p, "kvserve:prompt_tokens_total"), 12);
  EXPECT_EQ(Value(p, "kvserve:generation_tokens_total"), 48);
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "stop"}}), 1);
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "length"}}), 2);
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "some_new_outcome"}}),
            1);
  EXPECT_EQ(Value(p, "kvserve:num_requests_running"), 4);
  EXPECT_EQ(Value(p, "kvserve:num_requests_waiting"), 2);
  EXPECT_EQ(Value(p, "kvserve:kv_cache_usage_perc"), 0.25);
  EXPECT_EQ(Value(p, "kvserve:num_preemptions_total"), 3);
  EXPECT_EQ(Value(p, "kvserve:kv_blocks_used"), 25);
  EXPECT_EQ(Value(p, "kvserve:kv_blocks_free"), 75);
  EXPECT_EQ(Value(p, "kvserve:kv_slot_efficiency"), 0.875);
  EXPECT_EQ(Value(p, "kvserve:batch_tokens"), 130);
  EXPECT_EQ(Value(p, "kvserve:batch_prefill_tokens"), 125);
  EXPECT_EQ(Value(p, "kvserve:step_token_budget"), 140);
  EXPECT_EQ(Value(p, "kvserve:step_prefill_ms_per_token"), 2.5);
  EXPECT_EQ(Value(p, "kvserve:kv_arriving_sequences"), 1);
  EXPECT_EQ(Value(p, "kvserve:kv_loads_total"), 7);
  EXPECT_EQ(Value(p, "kvserve:kv_evicted_tokens_total"), 96);
  EXPECT_EQ(p.families.at("kvserve:kv_loads_total").type, "counter");
  EXPECT_EQ(p.families.at("kvserve:num_preemptions_total").type, "counter");
  EXPECT_EQ(p.families.at("kvserve:kv_blocks_free").type, "gauge");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeAndEndInInf) {
  Metrics m("m");
  m.ObserveTimeToFirstToken(0.001);  // exactly on a bound: counted in it (le)
  m.ObserveTimeToFirstToken(0.03);
  m.ObserveTimeToFirstToken(1e6);  // past every bound: only +Inf
  for (int i = 0; i < 10; ++i) m.ObserveInterTokenLatency(0.002 * i);
  m.ObserveEndToEndLatency(2.0);
  const Parsed p = ParseExposition(m.Render(SomeStats()));
  const std::string ttft = "kvserve:time_to_first_token_seconds";
  EXPECT_EQ(CheckHistogram(p.families.at(ttft), ttft), 3);
  EXPECT_EQ(Value(p, ttft + "_bucket", {{"le", "0.001"}}), 1);
  EXPECT_EQ(Value(p, ttft + "_bucket", {{"le", "0.04"}}), 2);
  EXPECT_EQ(Value(p, ttft + "_bucket", {{"le", "2560"}}), 2);
  EXPECT_EQ(Value(p, ttft + "_bucket", {{"le", "+Inf"}}), 3);
  EXPECT_DOUBLE_EQ(Value(p, ttft + "_sum"), 0.001 + 0.03 + 1e6);
  const std::string itl = "kvserve:inter_token_latency_seconds";
  EXPECT_EQ(CheckHistogram(p.families.at(itl), itl), 10);
  const std::string e2e = "kvserve:e2e_request_latency_seconds";
  EXPECT_EQ(CheckHistogram(p.families.at(e2e), e2e), 1);
  EXPECT_EQ(Value(p, e2e + "_bucket", {{"le", "1.5"}}), 0);
  EXPECT_EQ(Value(p, e2e + "_bucket", {{"le", "2"}}), 1);
}

TEST(MetricsTest, ConcurrentUpdatesAreAllCounted) {
  Metrics m("m");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m] {
      for (int i = 0; i < 1000; ++i) {
        m.AddGenerationTokens(1);
        m.ObserveInterTokenLatency(0.01);
        m.RequestFinished("stop");
      }
    });
  }
  // Scrapes while writers run must stay valid.
  for (int i = 0; i < 20; ++i) ParseExposition(m.Render(SomeStats()));
  for (auto& t : threads) t.join();
  const Parsed p = ParseExposition(m.Render(SomeStats()));
  EXPECT_EQ(Value(p, "kvserve:generation_tokens_total"), 4000);
  EXPECT_EQ(Value(p, "kvserve:request_success_total", {{"finished_reason", "stop"}}), 4000);
  const std::string itl = "kvserve:inter_token_latency_seconds";
  EXPECT_EQ(CheckHistogram(p.families.at(itl), itl), 4000);
}

// A sliding-window model adds its window series, each with its own value,
// in one block after the prefix cache's; a model without a window has none.
TEST(MetricsTest, SlidingWindowSeriesCarryTheirValues) {
  Metrics m("m");
  EngineStats s = SomeStats();
  EXPECT_EQ(ParseExposition(m.Render(s)).families.count("kvserve:kv_window_released_blocks_total"),
            0u);
  s.sliding_window = 16;
  s.window_released_blocks = 11;
  s.window_kept_cached_blocks = 7;
  s.window_lost_prefix_blocks = 3;
  s.window_hollowed_blocks = 5;
  s.window_dropped_prefix_tokens = 40;
  s.window_hollow_nodes = 2;
  const Parsed p = ParseExposition(m.Render(s));
  const std::vector<std::pair<std::string, std::string>> window = {
      {"kvserve:kv_window_released_blocks_total", "counter"},
      {"kvserve:kv_window_kept_cached_blocks_total", "counter"},
      {"kvserve:prefix_cache_window_lost_blocks_total", "counter"},
      {"kvserve:kv_window_hollowed_blocks_total", "counter"},
      {"kvserve:prefix_cache_window_dropped_tokens_total", "counter"},
      {"kvserve:prefix_cache_hollow_blocks", "gauge"}};
  const double values[] = {11, 7, 3, 5, 40, 2};
  auto first = std::find(p.order.begin(), p.order.end(), window[0].first);
  ASSERT_NE(first, p.order.end());
  for (size_t i = 0; i < window.size(); ++i) {
    SCOPED_TRACE(window[i].first);
    ASSERT_LT(first + i, p.order.end());
    EXPECT_EQ(*(first + i), window[i].first) << "the window block keeps its order";
    EXPECT_EQ(p.families.at(window[i].first).type, window[i].second);
    EXPECT_FALSE(p.families.at(window[i].first).help.empty());
    EXPECT_EQ(Value(p, window[i].first), values[i]);
  }
}

TEST(MetricsTest, ValuesUseShortestRoundTripForm) {
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(48), "48");
  EXPECT_EQ(FormatMetricValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatMetricValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatMetricValue(NAN), "NaN");
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

// CacheControl exports statistics; the server renders them: every refusal
// reason is a series from the first scrape (the hybrid-model 'unsupported'
// one included), tenant names are escaped like every other label.
TEST(CacheControlMetricsTest, RendersStatisticsWithEveryReasonAndEscapedTenants) {
  CacheControlStats s;
  s.leases = 2;
  s.grants = 3;
  s.retained_bytes["acme \"x\""] = 4096;
  s.refusals_by_reason["unsupported"] = 5;
  const std::string text = RenderCacheControlMetrics(s);
  EXPECT_NE(text.find("kvserve:cache_retained_bytes{tenant=\"acme \\\"x\\\"\"} 4096\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvserve:cache_retention_leases 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvserve:cache_retention_grants_total 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvserve:cache_retention_refusals_total{reason=\"unsupported\"} 5\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvserve:cache_retention_refusals_total{reason=\"tenant_budget\"} 0\n"),
            std::string::npos);
  EXPECT_EQ(text.find("kvserve_"), std::string::npos);
}

}  // namespace
}  // namespace kvserve
