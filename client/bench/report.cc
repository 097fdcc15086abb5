#include "client/bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace kvserve::bench {
namespace {

using nlohmann::json;

// Nearest-rank percentile with linear interpolation, as numpy's default.
double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double pos = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

std::string PadRight(size_t width, std::string s) {
  if (s.size() < width) s.resize(width, ' ');
  return s;
}

std::string PadLeft(size_t width, const std::string& s) {
  return s.size() < width ? std::string(width - s.size(), ' ') + s : s;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
};

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// An inline SVG line chart; axes start at zero so curves compare honestly.
std::string LineChart(const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, bool markers) {
  constexpr double kW = 640, kH = 360, kL = 70, kR = 20, kT = 30, kB = 50;
  double xmax = 0, ymax = 0;
  for (const Series& s : series) {
    for (auto [x, y] : s.points) {
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  }
  if (xmax <= 0) xmax = 1;
  if (ymax <= 0) ymax = 1;
  auto X = [&](double x) { return kL + x / xmax * (kW - kL - kR); };
  auto Y = [&](double y) { return kH - kB - y / ymax * (kH - kT - kB); };
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kW << "' height='" << kH
    << "' viewBox='0 0 " << kW << ' ' << kH << "' font-family='sans-serif' font-size='11'>"
    << "<rect width='100%' height='100%' fill='white'/>"
    << "<text x='" << kW / 2 << "' y='18' text-anchor='middle' font-size='14'>" << Escape(title)
    << "</text>";
  for (int i = 0; i <= 4; ++i) {
    const double xv = xmax * i / 4, yv = ymax * i / 4;
    o << "<line x1='" << X(0) << "' x2='" << X(xmax) << "' y1='" << Y(yv) << "' y2='" << Y(yv)
      << "' stroke='#ddd'/>"
      << "<text x='" << kL - 5 << "' y='" << Y(yv) + 4 << "' text-anchor='end'>" << Fmt("%.3g", yv)
      << "</text>"
      << "<text x='" << X(xv) << "' y='" << kH - kB + 15 << "' text-anchor='middle'>"
      << Fmt("%.3g", xv) << "</text>";
  }
  o << "<line x1='" << X(0) << "' x2='" << X(xmax) << "' y1='" << Y(0) << "' y2='" << Y(0)
    << "' stroke='black'/><line x1='" << X(0) << "' x2='" << X(0) << "' y1='" << Y(0) << "' y2='"
    << Y(ymax) << "' stroke='black'/>"
    << "<text x='" << (kL + kW - kR) / 2 << "' y='" << kH - 12 << "' text-anchor='middle'>"
    << Escape(xlabel) << "</text>"
    << "<text transform='translate(14," << (kT + kH - kB) / 2
    << ") rotate(-90)' text-anchor='middle'>" << Escape(ylabel) << "</text>";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    o << "<polyline fill='none' stroke='" << color << "' stroke-width='1.5' points='";
    for (auto [x, y] : series[i].points) o << Fmt("%.1f", X(x)) << ',' << Fmt("%.1f", Y(y)) << ' ';
    o << "'/>";
    if (markers) {
      for (auto [x, y] : series[i].points) {
        o << "<circle cx='" << X(x) << "' cy='" << Y(y) << "' r='3' fill='" << color << "'/>";
      }
    }
    o << "<text x='" << kL + 10 << "' y='" << kT + 14 + 14 * i << "' fill='" << color << "'>"
      << Escape(series[i].name) << "</text>";
  }
  o << "</svg>";
  return o.str();
}

std::vector<const RequestRecord*> Measured(const Run& run) {
  std::vector<const RequestRecord*> out;
  for (const RequestRecord& r : run.records) {
    if (!r.warmup) out.push_back(&r);
  }
  return out;
}

Series Cdf(const std::string& name, std::vector<double> values_ms) {
  std::sort(values_ms.begin(), values_ms.end());
  Series s{name, {}};
  for (size_t i = 0; i < values_ms.size(); ++i) {
    s.points.emplace_back(values_ms[i], static_cast<double>(i + 1) / values_ms.size());
  }
  return s;
}

// Output tokens per second over the run, from the arrival time of each
// streamed chunk (a chunk's share is the request's tokens / chunks).
Series ThroughputOverTime(const Run& run) {
  Series s{run.target + " " + run.load_label, {}};
  std::vector<std::pair<double, double>> events;  // time, tokens
  double t0 = 1e300, t1 = 0;
  for (const RequestRecord* r : Measured(run)) {
    if (!r->ok || r->chunks == 0) continue;
    const double per_chunk = static_cast<double>(std::max(r->output_tokens, 0)) / r->chunks;
    double t = r->start_s + r->ttft_s;
    events.emplace_back(t, per_chunk);
    for (double gap : r->itl_s) events.emplace_back(t += gap, per_chunk);
    t0 = std::min(t0, r->start_s);
    t1 = std::max(t1, r->start_s + r->e2e_s);
  }
  if (events.empty()) return s;
  const double width = std::max(0.1, (t1 - t0) / 40);
  const int n = static_cast<int>(std::ceil((t1 - t0) / width)) + 1;
  std::vector<double> buckets(n, 0);
  for (auto [t, tok] : events)
    buckets[std::clamp(static_cast<int>((t - t0) / width), 0, n - 1)] += tok;
  for (int i = 0; i < n; ++i) s.points.emplace_back((i + 0.5) * width, buckets[i] / width);
  return s;
}

}  // namespace

Distribution Distribution::Of(std::vector<double> v) {
  Distribution d;
  if (v.empty()) return d;
  std::sort(v.begin(), v.end());
  d.count = static_cast<int>(v.size());
  double sum = 0;
  for (double x : v) sum += x;
  d.mean = sum / v.size();
  d.p50 = Percentile(v, 50);
  d.p90 = Percentile(v, 90);
  d.p95 = Percentile(v, 95);
  d.p99 = Percentile(v, 99);
  d.max = v.back();
  return d;
}

json Distribution::ToJson(double scale) const {
  return {{"count", count},     {"mean", mean * scale}, {"p50", p50 * scale}, {"p90", p90 * scale},
          {"p95", p95 * scale}, {"p99", p99 * scale},   {"max", max * scale}};
}

Summary Summary::Of(const std::vector<RequestRecord>& records, const Slo& slo) {
  Summary s;
  std::vector<double> ttft, tpot, itl, e2e;
  double t0 = 1e300, t1 = 0;
  for (const RequestRecord& r : records) {
    if (r.warmup) continue;
    t0 = std::min(t0, r.start_s);
    t1 = std::max(t1, r.start_s + r.e2e_s);
    if (!r.ok) {
      ++s.failed;
      ++s.errors[r.error];
      continue;
    }
    ++s.completed;
    s.prompt_tokens += std::max(r.prompt_tokens, 0);
    s.output_tokens += std::max(r.output_tokens, 0);
    s.cached_tokens += std::max(r.cached_tokens, 0);
    if (r.ttft_s >= 0) ttft.push_back(r.ttft_s);
    if (r.TpotS() >= 0) tpot.push_back(r.TpotS());
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    e2e.push_back(r.e2e_s);
    const bool ttft_ok = slo.ttft_ms <= 0 || (r.ttft_s >= 0 && r.ttft_s * 1e3 <= slo.ttft_ms);
    const bool tpot_ok = slo.tpot_ms <= 0 || r.TpotS() * 1e3 <= slo.tpot_ms;
    if (ttft_ok && tpot_ok) ++s.good_requests;
  }
  s.duration_s = t1 > t0 ? t1 - t0 : 0;
  if (s.duration_s > 0) {
    s.request_throughput = s.completed / s.duration_s;
    s.output_throughput = s.output_tokens / s.duration_s;
    s.total_throughput = (s.prompt_tokens + s.output_tokens) / s.duration_s;
    s.goodput = s.good_requests / s.duration_s;
  }
  s.ttft = Distribution::Of(ttft);
  s.tpot = Distribution::Of(tpot);
  s.itl = Distribution::Of(itl);
  s.e2e = Distribution::Of(e2e);
  return s;
}

json Summary::ToJson() const {
  return {{"completed", completed},
          {"failed", failed},
          {"errors", errors},
          {"duration_s", duration_s},
          {"request_throughput", request_throughput},
          {"output_token_throughput", output_throughput},
          {"total_token_throughput", total_throughput},
          {"goodput", goodput},
          {"good_requests", good_requests},
          {"prompt_tokens", prompt_tokens},
          {"output_tokens", output_tokens},
          {"cached_tokens", cached_tokens},
          {"ttft_ms", ttft.ToJson(1e3)},
          {"tpot_ms", tpot.ToJson(1e3)},
          {"itl_ms", itl.ToJson(1e3)},
          {"e2e_ms", e2e.ToJson(1e3)}};
}

json RecordToJson(const RequestRecord& r) {
  json itl = json::array();
  for (double g : r.itl_s) itl.push_back(g * 1e3);
  return {{"id", r.id},
          {"conversation", r.conversation},
          {"turn", r.turn},
          {"target", r.target},
          {"warmup", r.warmup},
          {"ok", r.ok},
          {"error", r.error},
          {"error_message", r.error_message},
          {"start_s", r.start_s},
          {"ttft_ms", r.ttft_s >= 0 ? json(r.ttft_s * 1e3) : json(nullptr)},
          {"e2e_ms", r.e2e_s * 1e3},
          {"tpot_ms", r.TpotS() >= 0 ? json(r.TpotS() * 1e3) : json(nullptr)},
          {"itl_ms", std::move(itl)},
          {"prompt_tokens", r.prompt_tokens},
          {"output_tokens", r.output_tokens},
          {"cached_tokens", r.cached_tokens},
          {"chunks", r.chunks}};
}

json ResultsToJson(const json& config, const std::vector<Run>& runs) {
  json out = {{"schema", "kvserve-bench/1"}, {"config", config}, {"runs", json::array()}};
  for (const Run& run : runs) {
    json records = json::array();
    for (const RequestRecord& r : run.records) records.push_back(RecordToJson(r));
    out["runs"].push_back(
        {{"target", run.target},
         {"load", {{"mode", run.load_mode}, {"value", run.load_value}, {"label", run.load_label}}},
         {"summary", run.summary.ToJson()},
         {"requests", std::move(records)}});
  }
  return out;
}

std::string FormatTable(const std::vector<Run>& runs) {
  std::ostringstream o;
  for (const Run& run : runs) {
    const Summary& s = run.summary;
    o << "=== " << run.target << "  " << run.load_label << " ===\n";
    o << PadRight(28, "completed / failed") << s.completed << " / " << s.failed << '\n';
    for (const auto& [kind, n] : s.errors) o << "  error " << kind << ": " << n << '\n';
    o << PadRight(28, "duration (s)") << Fmt("%.2f", s.duration_s) << '\n';
    o << PadRight(28, "prompt / output tokens") << s.prompt_tokens << " / " << s.output_tokens;
    if (s.cached_tokens > 0) o << "  (cached prompt " << s.cached_tokens << ")";
    o << '\n';
    o << PadRight(28, "requests/s") << Fmt("%.2f", s.request_throughput) << '\n';
    o << PadRight(28, "output tokens/s") << Fmt("%.1f", s.output_throughput) << '\n';
    o << PadRight(28, "total tokens/s") << Fmt("%.1f", s.total_throughput) << '\n';
    o << PadRight(28, "goodput (req/s within SLO)") << Fmt("%.2f", s.goodput) << '\n';
    o << PadRight(12, "ms") << PadLeft(10, "mean") << PadLeft(10, "p50") << PadLeft(10, "p90")
      << PadLeft(10, "p95") << PadLeft(10, "p99") << '\n';
    auto row = [&](const char* name, const Distribution& d) {
      o << PadRight(12, name) << Fmt("%10.2f", d.mean * 1e3) << Fmt("%10.2f", d.p50 * 1e3)
        << Fmt("%10.2f", d.p90 * 1e3) << Fmt("%10.2f", d.p95 * 1e3) << Fmt("%10.2f", d.p99 * 1e3)
        << '\n';
    };
    row("TTFT", s.ttft);
    row("TPOT", s.tpot);
    row("ITL", s.itl);
    row("E2E", s.e2e);
    o << '\n';
  }
  return o.str();
}

std::string FormatComparison(const std::vector<Run>& runs) {
  // Runs come in pairs (A, B) per load point when comparing.
  std::ostringstream o;
  for (size_t i = 0; i + 1 < runs.size(); i += 2) {
    const Summary& a = runs[i].summary;
    const Summary& b = runs[i + 1].summary;
    auto ratio = [](double x, double y) { return y > 0 ? Fmt("%.3f", x / y) : std::string("n/a"); };
    o << "=== B/A  " << runs[i].load_label << "  (A=" << runs[i].target
      << ", B=" << runs[i + 1].target << ") ===\n";
    o << PadRight(24, "requests/s") << ratio(b.request_throughput, a.request_throughput) << '\n';
    o << PadRight(24, "output tokens/s") << ratio(b.output_throughput, a.output_throughput) << '\n';
    o << PadRight(24, "TTFT p50") << ratio(b.ttft.p50, a.ttft.p50) << '\n';
    o << PadRight(24, "TTFT p99") << ratio(b.ttft.p99, a.ttft.p99) << '\n';
    o << PadRight(24, "TPOT p50") << ratio(b.tpot.p50, a.tpot.p50) << '\n';
    o << PadRight(24, "TPOT p99") << ratio(b.tpot.p99, a.tpot.p99) << '\n';
    o << PadRight(24, "E2E p50") << ratio(b.e2e.p50, a.e2e.p50) << '\n';
    o << '\n';
  }
  return o.str();
}

std::string RenderHtml(const json& config, const std::vector<Run>& runs) {
  std::vector<Series> ttft, tpot, e2e, tput;
  for (const Run& run : runs) {
    std::vector<double> t, p, e;
    for (const RequestRecord* r : Measured(run)) {
      if (!r->ok) continue;
      if (r->ttft_s >= 0) t.push_back(r->ttft_s * 1e3);
      if (r->TpotS() >= 0) p.push_back(r->TpotS() * 1e3);
      e.push_back(r->e2e_s * 1e3);
    }
    const std::string name = run.target + " " + run.load_label;
    ttft.push_back(Cdf(name, t));
    tpot.push_back(Cdf(name, p));
    e2e.push_back(Cdf(name, e));
    tput.push_back(ThroughputOverTime(run));
  }
  std::ostringstream o;
  o << "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvserve-bench report</title>"
    << "<style>body{font-family:sans-serif;margin:2em}svg{margin:0.5em;border:1px solid #eee}"
    << "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
    << "text-align:right}</style></head><body><h1>kvserve-bench report</h1>"
    << "<pre>" << Escape(config.dump(2)) << "</pre><h2>Summary</h2><table><tr><th>target</th>"
    << "<th>load</th><th>ok</th><th>failed</th><th>req/s</th><th>out tok/s</th><th>goodput</th>"
    << "<th>TTFT p50 ms</th><th>TTFT p99 ms</th><th>TPOT p50 ms</th><th>TPOT p99 ms</th>"
    << "<th>E2E p50 ms</th></tr>";
  for (const Run& run : runs) {
    const Summary& s = run.summary;
    o << "<tr><td>" << Escape(run.target) << "</td><td>" << Escape(run.load_label) << "</td><td>"
      << s.completed << "</td><td>" << s.failed << "</td><td>" << Fmt("%.2f", s.request_throughput)
      << "</td><td>" << Fmt("%.1f", s.output_throughput) << "</td><td>" << Fmt("%.2f", s.goodput)
      << "</td><td>" << Fmt("%.1f", s.ttft.p50 * 1e3) << "</td><td>"
      << Fmt("%.1f", s.ttft.p99 * 1e3) << "</td><td>" << Fmt("%.2f", s.tpot.p50 * 1e3)
      << "</td><td>" << Fmt("%.2f", s.tpot.p99 * 1e3) << "</td><td>" << Fmt("%.1f", s.e2e.p50 * 1e3)
      << "</td></tr>";
  }
  o << "</table><h2>Latency CDFs</h2>"
    << LineChart("TTFT CDF", "TTFT (ms)", "fraction of requests", ttft, false)
    << LineChart("TPOT CDF", "TPOT (ms)", "fraction of requests", tpot, false)
    << LineChart("End-to-end CDF", "latency (ms)", "fraction of requests", e2e, false)
    << "<h2>Throughput over time</h2>"
    << LineChart("Output tokens/s", "time since run start (s)", "tokens/s", tput, false);
  // Latency vs load, per target, when a sweep produced several load points.
  std::map<std::string, std::vector<const Run*>> by_target;
  for (const Run& run : runs) by_target[run.target].push_back(&run);
  bool sweep = false;
  for (const auto& [target, rs] : by_target) sweep |= rs.size() > 1;
  if (sweep) {
    std::vector<Series> ttft_load, tpot_load, tput_load;
    std::string unit = runs.front().load_mode == "open" ? "request rate (req/s)" : "concurrency";
    for (const auto& [target, rs] : by_target) {
      Series t50{target + " p50", {}}, t99{target + " p99", {}}, p50{target + " p50", {}},
          p99{target + " p99", {}}, tp{target, {}};
      for (const Run* r : rs) {
        t50.points.emplace_back(r->load_value, r->summary.ttft.p50 * 1e3);
        t99.points.emplace_back(r->load_value, r->summary.ttft.p99 * 1e3);
        p50.points.emplace_back(r->load_value, r->summary.tpot.p50 * 1e3);
        p99.points.emplace_back(r->load_value, r->summary.tpot.p99 * 1e3);
        tp.points.emplace_back(r->load_value, r->summary.output_throughput);
      }
      ttft_load.push_back(t50);
      ttft_load.push_back(t99);
      tpot_load.push_back(p50);
      tpot_load.push_back(p99);
      tput_load.push_back(tp);
    }
    o << "<h2>Latency vs load</h2>" << LineChart("TTFT vs load", unit, "TTFT (ms)", ttft_load, true)
      << LineChart("TPOT vs load", unit, "TPOT (ms)", tpot_load, true)
      << LineChart("Output throughput vs load", unit, "tokens/s", tput_load, true);
  }
  o << "</body></html>\n";
  return o.str();
}

}  // namespace kvserve::bench
