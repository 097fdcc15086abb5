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

// An inline SVG line chart; axes start at zero so curves compare honestly,
// and end at a round tick. `xmax`/`ymax` > 0 fix an axis (charts that are
// compared side by side share their ranges).
std::string LineChart(const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, bool markers,
                      double xmax = 0, double ymax = 0, double width = 460, double height = 300,
                      bool legend_low = false) {
  const double kW = width, kH = height;
  constexpr double kL = 62, kR = 16, kT = 28, kB = 46;
  const bool fixed_x = xmax > 0, fixed_y = ymax > 0;
  for (const Series& s : series) {
    for (auto [x, y] : s.points) {
      if (!fixed_x) xmax = std::max(xmax, x);
      if (!fixed_y) ymax = std::max(ymax, y);
    }
  }
  if (xmax <= 0) xmax = 1;
  if (ymax <= 0) ymax = 1;
  const std::vector<double> xt = NiceTicks(xmax), yt = NiceTicks(ymax);
  xmax = xt.back();
  ymax = yt.back();
  const double xstep = xt.size() > 1 ? xt[1] : xmax, ystep = yt.size() > 1 ? yt[1] : ymax;
  auto X = [&](double x) { return kL + x / xmax * (kW - kL - kR); };
  auto Y = [&](double y) { return kH - kB - y / ymax * (kH - kT - kB); };
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kW << "' height='" << kH
    << "' viewBox='0 0 " << kW << ' ' << kH << "' font-family='sans-serif' font-size='11'>"
    << "<rect width='100%' height='100%' fill='white'/>"
    << "<text x='" << kW / 2 << "' y='17' text-anchor='middle' font-size='13' font-weight='bold'>"
    << Escape(title) << "</text>";
  for (double yv : yt) {
    o << "<line x1='" << X(0) << "' x2='" << X(xmax) << "' y1='" << Y(yv) << "' y2='" << Y(yv)
      << "' stroke='#e5e5e5'/>"
      << "<text x='" << kL - 5 << "' y='" << Y(yv) + 4 << "' text-anchor='end'>"
      << TickLabel(yv, ystep) << "</text>";
  }
  for (double xv : xt) {
    o << "<line x1='" << X(xv) << "' x2='" << X(xv) << "' y1='" << Y(0) << "' y2='" << Y(0) + 4
      << "' stroke='black'/>"
      << "<text x='" << X(xv) << "' y='" << kH - kB + 16 << "' text-anchor='middle'>"
      << TickLabel(xv, xstep) << "</text>";
  }
  o << "<line x1='" << X(0) << "' x2='" << X(xmax) << "' y1='" << Y(0) << "' y2='" << Y(0)
    << "' stroke='black'/><line x1='" << X(0) << "' x2='" << X(0) << "' y1='" << Y(0) << "' y2='"
    << Y(ymax) << "' stroke='black'/>"
    << "<text x='" << (kL + kW - kR) / 2 << "' y='" << kH - 10 << "' text-anchor='middle'>"
    << Escape(xlabel) << "</text>"
    << "<text transform='translate(13," << (kT + kH - kB) / 2
    << ") rotate(-90)' text-anchor='middle'>" << Escape(ylabel) << "</text>";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    o << "<polyline fill='none' stroke='" << color << "' stroke-width='1.8' points='";
    for (auto [x, y] : series[i].points) {
      o << Fmt("%.1f", X(std::min(x, xmax))) << ',' << Fmt("%.1f", Y(std::min(y, ymax))) << ' ';
    }
    o << "'/>";
    if (markers) {
      for (auto [x, y] : series[i].points) {
        o << "<circle cx='" << X(x) << "' cy='" << Y(y) << "' r='3' fill='" << color << "'/>";
      }
    }
    // CDFs leave the lower right empty; other charts the upper left.
    const double ly = legend_low ? kH - kB - 8 - 14 * (series.size() - i) : kT + 5 + 14 * i;
    const double lx = legend_low ? kW - kR - 8 : kL + 8;
    o << "<rect x='" << (legend_low ? lx - 10 : lx) << "' y='" << ly << "' width='10' height='3' fill='"
      << color << "'/><text x='" << (legend_low ? lx - 14 : lx + 14) << "' y='" << ly + 5
      << "' fill='#333' text-anchor='" << (legend_low ? "end" : "start") << "'>"
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

std::vector<double> NiceTicks(double max, int target) {
  if (!(max > 0) || !std::isfinite(max)) return {0, 1};
  target = std::max(target, 1);
  const double raw = max / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * mag >= raw * (1 - 1e-9)) {
      step = m * mag;
      break;
    }
  }
  std::vector<double> ticks;
  for (int i = 0;; ++i) {
    const double v = step * i;
    ticks.push_back(v);
    if (v >= max * (1 - 1e-9) || i > 4 * target) break;
  }
  return ticks;
}

std::string TickLabel(double v, double step) {
  if (std::fabs(v) < 1e-12) return "0";
  const double a = std::fabs(v);
  if (a >= 1e6 && step >= 1e5) return Fmt("%.6g", v / 1e6) + "M";
  if (a >= 1e4 && step >= 1e3) return Fmt("%.6g", v / 1e3) + "k";
  int decimals = 0;
  if (step > 0 && step < 1) {
    decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
    // 0.25 needs two decimals, 0.2 one.
    const double scaled = step * std::pow(10.0, decimals);
    if (std::fabs(scaled - std::round(scaled)) > 1e-6) ++decimals;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

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
    s.connection_retries += r.connection_retries;
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
          {"connection_retries", connection_retries},
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
          {"chunks", r.chunks},
          {"connection_retries", r.connection_retries}};
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
    if (s.connection_retries > 0) {
      o << PadRight(28, "retried on a new connection") << s.connection_retries
        << "  (a reused connection the server had closed; not failures)\n";
    }
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

namespace {

// The config as rows: scalars as they are, lists joined, empty and zero
// values of optional knobs left out.
std::vector<std::pair<std::string, std::string>> ConfigRows(const json& config) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (auto it = config.begin(); it != config.end(); ++it) {
    const json& v = it.value();
    std::string text;
    if (v.is_string()) {
      text = v.get<std::string>();
    } else if (v.is_array()) {
      for (const json& e : v) {
        if (!text.empty()) text += ", ";
        text += e.is_string() ? e.get<std::string>() : e.dump();
      }
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      text = Fmt("%g", d);
    } else {
      text = v.dump();
    }
    const bool optional = it.key().rfind("slo_", 0) == 0 || it.key() == "duration_s" ||
                          it.key() == "requests";
    if (text.empty() || text == "\"\"" || (optional && text == "0")) continue;
    rows.emplace_back(it.key(), text);
  }
  return rows;
}

std::string Ms(double seconds, const char* fmt = "%.1f") { return Fmt(fmt, seconds * 1e3); }

struct Cdfs {
  Series ttft, tpot, itl, e2e;
};

Cdfs CdfsOf(const Run& run, const std::string& name) {
  std::vector<double> t, p, i, e;
  for (const RequestRecord* r : Measured(run)) {
    if (!r->ok) continue;
    if (r->ttft_s >= 0) t.push_back(r->ttft_s * 1e3);
    if (r->TpotS() >= 0) p.push_back(r->TpotS() * 1e3);
    for (double g : r->itl_s) i.push_back(g * 1e3);
    e.push_back(r->e2e_s * 1e3);
  }
  return {Cdf(name, t), Cdf(name, p), Cdf(name, i), Cdf(name, e)};
}

double MaxX(const std::vector<Series>& s) {
  double m = 0;
  for (const Series& x : s) {
    for (auto [px, py] : x.points) m = std::max(m, px);
  }
  return m;
}

// ITL's tail can be a few huge gaps (a stall); the CDF's axis stops at the
// 99.5th percentile of all series so the body of the curve stays readable
// (the tail is in the summary table).
double ItlAxis(const std::vector<Series>& s) {
  std::vector<double> all;
  for (const Series& x : s) {
    for (auto [px, py] : x.points) all.push_back(px);
  }
  if (all.empty()) return 0;
  std::sort(all.begin(), all.end());
  return Percentile(all, 99.5);
}

std::string CdfRow(const std::vector<Cdfs>& group) {
  std::vector<Series> ttft, tpot, itl, e2e;
  for (const Cdfs& c : group) {
    ttft.push_back(c.ttft);
    tpot.push_back(c.tpot);
    itl.push_back(c.itl);
    e2e.push_back(c.e2e);
  }
  std::ostringstream o;
  o << "<div class='row'>"
    << LineChart("TTFT", "time to first token (ms)", "fraction of requests", ttft, false,
                 MaxX(ttft), 1, 345, 280, true)
    << LineChart("TPOT", "time per output token (ms)", "fraction of requests", tpot, false,
                 MaxX(tpot), 1, 345, 280, true)
    << LineChart("ITL", "inter-token gap (ms), axis to p99.5", "fraction of gaps", itl, false,
                 ItlAxis(itl), 1, 345, 280, true)
    << LineChart("End to end", "request latency (ms)", "fraction of requests", e2e, false,
                 MaxX(e2e), 1, 345, 280, true)
    << "</div>";
  return o.str();
}

}  // namespace

std::string RenderHtml(const json& config, const std::vector<Run>& runs, bool compare) {
  compare = compare && runs.size() >= 2 && runs.size() % 2 == 0;
  std::ostringstream o;
  o << "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvserve-bench report</title>"
    << "<style>body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222}"
    << "h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.4em}"
    << "svg{margin:0 .6em .6em 0;border:1px solid #eee}.row{display:flex;flex-wrap:wrap}"
    << "table{border-collapse:collapse;margin:.3em 0}td,th{border:1px solid #ccc;"
    << "padding:3px 8px;text-align:right;font-variant-numeric:tabular-nums}"
    << "th{background:#f3f3f3}td.l,th.l{text-align:left}.better{color:#1a7f37}"
    << ".worse{color:#b42318}.note{color:#666;font-size:.9em}"
    << "details{margin:.5em 0}pre{background:#f7f7f7;padding:.6em}</style></head><body>"
    << "<h1>kvserve-bench report</h1>";
  if (config.contains("targets") && config["targets"].is_array()) {
    o << "<div class='note'>";
    for (size_t i = 0; i < config["targets"].size(); ++i) {
      if (i) o << " vs ";
      o << (compare ? (i == 0 ? "A = " : "B = ") : "")
        << Escape(config["targets"][i].is_string() ? config["targets"][i].get<std::string>()
                                                   : config["targets"][i].dump());
    }
    o << "</div>";
  }

  // --compare: the verdict first.
  if (compare) {
    o << "<h2>B / A</h2><table><tr><th class='l'>load</th><th class='l'>metric</th><th>A</th>"
      << "<th>B</th><th>B/A</th></tr>";
    for (size_t i = 0; i + 1 < runs.size(); i += 2) {
      const Summary& a = runs[i].summary;
      const Summary& b = runs[i + 1].summary;
      struct M {
        const char* name;
        double a, b;
        bool higher_better;
        const char* fmt;
      };
      const M ms[] = {
          {"requests/s", a.request_throughput, b.request_throughput, true, "%.2f"},
          {"output tokens/s", a.output_throughput, b.output_throughput, true, "%.1f"},
          {"goodput (req/s)", a.goodput, b.goodput, true, "%.2f"},
          {"TTFT p50 (ms)", a.ttft.p50 * 1e3, b.ttft.p50 * 1e3, false, "%.1f"},
          {"TTFT p99 (ms)", a.ttft.p99 * 1e3, b.ttft.p99 * 1e3, false, "%.1f"},
          {"TPOT p50 (ms)", a.tpot.p50 * 1e3, b.tpot.p50 * 1e3, false, "%.2f"},
          {"TPOT p99 (ms)", a.tpot.p99 * 1e3, b.tpot.p99 * 1e3, false, "%.2f"},
          {"ITL p99 (ms)", a.itl.p99 * 1e3, b.itl.p99 * 1e3, false, "%.2f"},
          {"E2E p50 (ms)", a.e2e.p50 * 1e3, b.e2e.p50 * 1e3, false, "%.1f"},
      };
      bool first = true;
      for (const M& m : ms) {
        std::string ratio = "n/a", cls;
        if (m.a > 0) {
          const double r = m.b / m.a;
          ratio = Fmt("%.3f", r);
          if (std::fabs(r - 1) > 0.02) cls = (r > 1) == m.higher_better ? "better" : "worse";
        }
        o << "<tr><td class='l'>" << (first ? Escape(runs[i].load_label) : "") << "</td>"
          << "<td class='l'>" << m.name << "</td><td>" << Fmt(m.fmt, m.a) << "</td><td>"
          << Fmt(m.fmt, m.b) << "</td><td class='" << cls << "'>" << ratio << "</td></tr>";
        first = false;
      }
    }
    o << "</table><div class='note'>green: B better than A by more than 2 %; red: worse.</div>";
  }

  o << "<h2>Configuration</h2><table>";
  for (const auto& [k, v] : ConfigRows(config)) {
    o << "<tr><th class='l'>" << Escape(k) << "</th><td class='l'>" << Escape(v) << "</td></tr>";
  }
  o << "</table><details><summary>raw JSON</summary><pre>" << Escape(config.dump(2))
    << "</pre></details>";

  const double slo_ttft = config.value("slo_ttft_ms", 0.0), slo_tpot = config.value("slo_tpot_ms", 0.0);
  o << "<h2>Summary</h2><table><tr><th class='l'>target</th><th class='l'>load</th><th>ok</th>"
    << "<th>failed</th><th>retried</th><th>req/s</th><th>out tok/s</th><th>goodput req/s</th>"
    << "<th>TTFT p50</th><th>TTFT p90</th><th>TTFT p99</th><th>TPOT p50</th><th>TPOT p99</th>"
    << "<th>ITL p50</th><th>ITL p90</th><th>ITL p99</th><th>ITL max</th><th>E2E p50</th>"
    << "<th>E2E p99</th></tr>";
  for (const Run& run : runs) {
    const Summary& s = run.summary;
    o << "<tr><td class='l'>" << Escape(run.target) << "</td><td class='l'>"
      << Escape(run.load_label) << "</td><td>" << s.completed << "</td><td>" << s.failed
      << "</td><td>" << s.connection_retries << "</td><td>" << Fmt("%.2f", s.request_throughput)
      << "</td><td>" << Fmt("%.1f", s.output_throughput) << "</td><td>" << Fmt("%.2f", s.goodput)
      << "</td><td>" << Ms(s.ttft.p50) << "</td><td>" << Ms(s.ttft.p90) << "</td><td>"
      << Ms(s.ttft.p99) << "</td><td>" << Ms(s.tpot.p50, "%.2f") << "</td><td>"
      << Ms(s.tpot.p99, "%.2f") << "</td><td>" << Ms(s.itl.p50, "%.2f") << "</td><td>"
      << Ms(s.itl.p90, "%.2f") << "</td><td>" << Ms(s.itl.p99, "%.2f") << "</td><td>"
      << Ms(s.itl.max, "%.2f") << "</td><td>" << Ms(s.e2e.p50) << "</td><td>" << Ms(s.e2e.p99)
      << "</td></tr>";
  }
  o << "</table><div class='note'>Latencies in ms. Goodput: requests per second meeting ";
  if (slo_ttft > 0 || slo_tpot > 0) {
    o << (slo_ttft > 0 ? "TTFT &le; " + Fmt("%g", slo_ttft) + " ms" : std::string())
      << (slo_ttft > 0 && slo_tpot > 0 ? " and " : "")
      << (slo_tpot > 0 ? "TPOT &le; " + Fmt("%g", slo_tpot) + " ms" : std::string());
  } else {
    o << "the SLOs (none given: every completed request counts; set --slo-ttft-ms / "
         "--slo-tpot-ms)";
  }
  o << ". Retried: sent again on a fresh connection after a reused kept-alive connection failed "
       "before any response byte; not failures, not charged to the server.</div>";
  bool any_errors = false;
  for (const Run& run : runs) any_errors |= !run.summary.errors.empty();
  if (any_errors) {
    o << "<h3>Errors</h3><table><tr><th class='l'>target</th><th class='l'>load</th>"
      << "<th class='l'>kind</th><th>count</th></tr>";
    for (const Run& run : runs) {
      for (const auto& [kind, n] : run.summary.errors) {
        o << "<tr><td class='l'>" << Escape(run.target) << "</td><td class='l'>"
          << Escape(run.load_label) << "</td><td class='l'>" << Escape(kind) << "</td><td>" << n
          << "</td></tr>";
      }
    }
    o << "</table>";
  }

  o << "<h2>Latency CDFs</h2>";
  if (compare && runs.size() > 2) {
    // One row per load point: A and B on the same axes.
    for (size_t i = 0; i + 1 < runs.size(); i += 2) {
      o << "<h3>" << Escape(runs[i].load_label) << "</h3>"
        << CdfRow({CdfsOf(runs[i], "A " + runs[i].target),
                   CdfsOf(runs[i + 1], "B " + runs[i + 1].target)});
    }
  } else {
    std::vector<Cdfs> all;
    for (size_t i = 0; i < runs.size(); ++i) {
      const std::string prefix = compare ? (i % 2 == 0 ? "A " : "B ") : "";
      all.push_back(CdfsOf(runs[i], prefix + runs[i].target + " " + runs[i].load_label));
    }
    o << CdfRow(all);
  }
  std::vector<Series> tput;
  for (const Run& run : runs) tput.push_back(ThroughputOverTime(run));
  o << "<h2>Throughput over time</h2>"
    << LineChart("Output tokens/s", "time since run start (s)", "tokens/s", tput, false, 0, 0, 700,
                 300);
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
    o << "<h2>Latency vs load</h2><div class='row'>"
      << LineChart("TTFT vs load", unit, "TTFT (ms)", ttft_load, true)
      << LineChart("TPOT vs load", unit, "TPOT (ms)", tpot_load, true)
      << LineChart("Output throughput vs load", unit, "tokens/s", tput_load, true) << "</div>";
  }
  o << "</body></html>\n";
  return o.str();
}

}  // namespace kvserve::bench
