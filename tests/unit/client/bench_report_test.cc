// kvserve-bench's HTML report as people read it: round axis ticks in plain
// decimals, the config as a table, ITL and goodput in the summary, the
// connection retries counted apart from failures, and for --compare the
// ratio table first.
#include "client/bench/report.h"

#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <set>

namespace kvserve::bench {
namespace {

TEST(NiceTicksTest, RoundStepsThatCoverTheMaximum) {
  EXPECT_EQ(NiceTicks(1.74), (std::vector<double>{0, 0.5, 1, 1.5, 2}));
  EXPECT_EQ(NiceTicks(1.0), (std::vector<double>{0, 0.2, 0.4, 0.6000000000000001, 0.8, 1}));
  EXPECT_EQ(NiceTicks(870), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  EXPECT_EQ(NiceTicks(0), (std::vector<double>{0, 1}));
}

TEST(TickLabelTest, PlainDecimalsNeverExponents) {
  EXPECT_EQ(TickLabel(1.5, 0.5), "1.5");
  EXPECT_EQ(TickLabel(2, 0.5), "2.0");
  EXPECT_EQ(TickLabel(0.25, 0.25), "0.25");
  EXPECT_EQ(TickLabel(0.6000000000000001, 0.2), "0.6");
  EXPECT_EQ(TickLabel(600, 200), "600");
  EXPECT_EQ(TickLabel(20000, 5000), "20k");
  EXPECT_EQ(TickLabel(0, 0.001), "0");
  EXPECT_EQ(TickLabel(0.003, 0.001), "0.003");
}

// Over many random axis ranges: every label is plain (no 'e'), distinct
// within its axis, and the axis reaches the maximum in at most ~10 ticks.
TEST(TickLabelTest, RandomRangesGiveDistinctPlainLabels) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> exponent(-4, 7);
  for (int i = 0; i < 5000; ++i) {
    const double max = std::pow(10.0, exponent(rng));
    const std::vector<double> t = NiceTicks(max);
    ASSERT_GE(t.size(), 2u);
    ASSERT_LE(t.size(), 12u) << max;
    ASSERT_GE(t.back(), max * (1 - 1e-9));
    std::set<std::string> seen;
    for (double v : t) {
      const std::string l = TickLabel(v, t[1]);
      ASSERT_EQ(l.find('e'), std::string::npos) << l << " for max " << max;
      ASSERT_TRUE(seen.insert(l).second) << "duplicate " << l << " for max " << max;
    }
  }
}

RequestRecord Ok(const std::string& target, double start, double ttft, std::vector<double> itl,
                 int retries = 0) {
  RequestRecord r;
  r.target = target;
  r.ok = true;
  r.start_s = start;
  r.ttft_s = ttft;
  r.itl_s = std::move(itl);
  double e2e = ttft;
  for (double g : r.itl_s) e2e += g;
  r.e2e_s = e2e;
  r.output_tokens = static_cast<int>(r.itl_s.size()) + 1;
  r.chunks = r.output_tokens;
  r.prompt_tokens = 10;
  r.connection_retries = retries;
  return r;
}

Run MakeRun(const std::string& target, double scale, int retries) {
  Run run;
  run.target = target;
  run.load_label = "concurrency=2";
  run.load_mode = "closed";
  run.load_value = 2;
  for (int i = 0; i < 20; ++i) {
    run.records.push_back(Ok(target, 0.1 * i, 0.05 * scale * (1 + i % 3),
                             {0.01 * scale, 0.012 * scale, 0.5 * scale}, i < retries ? 1 : 0));
  }
  RequestRecord bad;
  bad.target = target;
  bad.error = "http_500";
  bad.start_s = 1;
  bad.e2e_s = 0.01;
  run.records.push_back(bad);
  run.summary = Summary::Of(run.records, Slo{100, 0});
  return run;
}

nlohmann::json Config() {
  return {{"targets", {"http://a:1", "http://b:2"}}, {"api", "completions"}, {"seed", 7},
          {"input_len", "fixed:200"}, {"slo_ttft_ms", 100.0}, {"slo_tpot_ms", 0.0}};
}

TEST(BenchReportTest, SummaryCountsRetriesApartFromFailures) {
  const auto run = MakeRun("http://a:1", 1, 3);
  EXPECT_EQ(run.summary.completed, 20);
  EXPECT_EQ(run.summary.failed, 1);
  EXPECT_EQ(run.summary.connection_retries, 3);
  EXPECT_EQ(run.summary.ToJson()["connection_retries"], 3);
  EXPECT_EQ(run.summary.itl.count, 60);
  EXPECT_NE(FormatTable({run}).find("retried on a new connection"), std::string::npos);
}

TEST(BenchReportTest, HtmlReadsAsAReport) {
  const std::string html = RenderHtml(Config(), {MakeRun("http://a:1", 1, 0)});
  // The config as a table, before any raw JSON.
  const size_t table = html.find("<th class='l'>input_len</th><td class='l'>fixed:200</td>");
  ASSERT_NE(table, std::string::npos);
  EXPECT_LT(table, html.find("<pre>"));
  EXPECT_EQ(html.find("slo_tpot_ms</th>"), std::string::npos) << "zero optional knobs are left out";
  // ITL percentiles and goodput in the summary, the SLO stated.
  EXPECT_NE(html.find("<th>ITL p99</th>"), std::string::npos);
  EXPECT_NE(html.find("<th>goodput req/s</th>"), std::string::npos);
  EXPECT_NE(html.find("TTFT &le; 100 ms"), std::string::npos);
  EXPECT_NE(html.find("<th>retried</th>"), std::string::npos);
  // Four CDFs in one row.
  const size_t row = html.find("<div class='row'>");
  ASSERT_NE(row, std::string::npos);
  const size_t row_end = html.find("</div>", row);
  int svgs = 0;
  for (size_t p = html.find("<svg", row); p != std::string::npos && p < row_end;
       p = html.find("<svg", p + 1)) {
    ++svgs;
  }
  EXPECT_EQ(svgs, 4);
  EXPECT_EQ(html.find("B / A"), std::string::npos);
  // No tick label in exponent notation (the old report's 1.74e+0).
  const std::regex exp_label(">[-0-9.]+e[-+][0-9]+<");
  EXPECT_FALSE(std::regex_search(html, exp_label));
}

TEST(BenchReportTest, CompareHasTheRatioTableFirstAndSharedAxes) {
  const std::string html =
      RenderHtml(Config(), {MakeRun("http://a:1", 1, 0), MakeRun("http://b:2", 2, 0)}, true);
  const size_t ratios = html.find("<h2>B / A</h2>");
  ASSERT_NE(ratios, std::string::npos);
  EXPECT_LT(ratios, html.find("<h2>Configuration</h2>"));
  EXPECT_LT(ratios, html.find("<h2>Summary</h2>"));
  // B is twice as slow: its TTFT ratio is 2 and marked worse.
  EXPECT_NE(html.find("<td class='worse'>2.000</td>"), std::string::npos);
  // Both targets in the same TTFT chart.
  const size_t ttft = html.find(">TTFT</text>");
  ASSERT_NE(ttft, std::string::npos);
  const size_t end = html.find("</svg>", ttft);
  EXPECT_NE(html.substr(ttft, end - ttft).find("A http://a:1"), std::string::npos);
  EXPECT_NE(html.substr(ttft, end - ttft).find("B http://b:2"), std::string::npos);
}

}  // namespace
}  // namespace kvserve::bench
