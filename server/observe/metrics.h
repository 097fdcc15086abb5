// Metrics: counters and histograms of the serving path, rendered in the
// Prometheus text exposition format (version 0.0.4). Names follow vLLM's
// (vllm:foo becomes kvserve:foo) so existing dashboards adapt by changing the
// prefix; every series carries model_name="...", as vLLM's do. Gauges of the
// engine and KV cache come from an EngineStats snapshot at scrape time, so
// the engine thread never touches this object.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "scheduler/cache_control.h"
#include "scheduler/engine.h"

namespace kvserve {

// A Prometheus histogram with fixed upper bounds (an implicit +Inf bucket
// follows the last one).
class Histogram {
 public:
  // REQUIRES: bounds strictly increasing and finite.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  // Appends HELP, TYPE and the cumulative _bucket, _sum and _count lines for
  // `name`. `labels` is a rendered label list without braces
  // (`model_name="m"`), or empty.
  void Render(const std::string& name, const std::string& help, const std::string& labels,
              std::string* out) const;

  // Snapshot for tests and callers that aggregate.
  uint64_t count() const;
  double sum() const;

 private:
  mutable std::mutex mu_;
  const std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // guarded by mu_; per bucket (not cumulative); last is +Inf
  double sum_ = 0;                // guarded by mu_
  uint64_t count_ = 0;            // guarded by mu_
};

class Metrics {
 public:
  explicit Metrics(std::string model_name);

  // outcome: stop, length, cancelled, deadline, rejected, error. Each is
  // rendered (at 0) from the start so rate() queries see the series before
  // the first event; other outcome names are accepted too.
  void RequestFinished(const std::string& outcome);
  void ObserveTimeToFirstToken(double seconds);
  void ObserveInterTokenLatency(double seconds);
  void ObserveEndToEndLatency(double seconds);
  void AddPromptTokens(int64_t n);
  void AddGenerationTokens(int64_t n);

  // The HTTP front end's connections (server/frontend/http_server.h): open now;
  // refused at --max-connections (503); idle ones closed to make room;
  // closed by a timeout (idle, header, body, write); closed because the
  // client stopped reading its stream.
  void HttpConnectionOpened() { http_open_.fetch_add(1); }
  void HttpConnectionClosed() { http_open_.fetch_sub(1); }
  void HttpConnectionRefused() { http_refused_.fetch_add(1); }
  void HttpIdleConnectionEvicted() { http_evicted_.fetch_add(1); }
  void HttpConnectionTimedOut() { http_timed_out_.fetch_add(1); }
  void HttpStalledReaderDisconnected() { http_stalled_.fetch_add(1); }

  std::string Render(const EngineStats& stats) const;

  // --metrics-compat vllm: Render also writes, under vLLM's own names, the
  // series the Gateway API Inference Extension's endpoint picker scrapes
  // (vllm:num_requests_waiting, vllm:num_requests_running,
  // vllm:kv_cache_usage_perc, vllm:cache_config_info{block_size,
  // num_gpu_blocks}, vllm:lora_requests_info) and those vLLM's dashboards
  // plot (token counters, TTFT / inter-token / end-to-end histograms); the
  // kvserve: series stay. REQUIRES: before the first Render.
  void EnableVllmNames(int32_t block_size) {
    vllm_names_ = true;
    vllm_block_size_ = block_size;
  }

  // Another component's series (the response cache's), appended to every
  // Render; called with this object's labels. The section must outlive it.
  using Section = std::function<void(const std::string& labels, std::string* out)>;
  void AddSection(Section section);

  const std::string& model_name() const { return model_name_; }

  // The bucket bounds used (vLLM's, with finer low buckets for inter-token
  // latency, where a small model on CPU lives below vLLM's first bound).
  static std::vector<double> TimeToFirstTokenBuckets();
  static std::vector<double> InterTokenLatencyBuckets();
  static std::vector<double> EndToEndLatencyBuckets();

 private:
  const std::string model_name_;
  const std::string labels_;  // model_name="..." escaped once
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, uint64_t>> outcomes_;  // guarded by mu_
  uint64_t prompt_tokens_ = 0;                              // guarded by mu_
  uint64_t generation_tokens_ = 0;                          // guarded by mu_
  std::vector<Section> sections_;  // guarded by mu_
  bool vllm_names_ = false;
  int32_t vllm_block_size_ = 0;
  Histogram ttft_;
  Histogram itl_;
  Histogram e2e_;
  std::atomic<int64_t> http_open_{0};
  std::atomic<uint64_t> http_refused_{0};
  std::atomic<uint64_t> http_evicted_{0};
  std::atomic<uint64_t> http_timed_out_{0};
  std::atomic<uint64_t> http_stalled_{0};
};

// The retention and cache-report metrics of CacheControl's statistics
// (kvserve:cache_retained_bytes per tenant, leases, grants, clips, expiries,
// releases, refusals by reason, explains, template drift).
std::string RenderCacheControlMetrics(const CacheControlStats& s);

// The text format's pieces, for every /metrics in the project (the node's,
// the router's): a family's HELP and TYPE lines, one sample (`labels` is the
// inside of the braces, already escaped; empty: no braces), and a family of
// one gauge or counter sample.
void AppendHeader(const std::string& name, const std::string& help, const char* type,
                  std::string* out);
void AppendSample(const std::string& name, const std::string& labels, double value,
                  std::string* out);
void AppendGauge(const std::string& name, const std::string& help, const std::string& labels,
                 double value, std::string* out);
void AppendCounter(const std::string& name, const std::string& help, const std::string& labels,
                   double value, std::string* out);

// Escapes a label value for the text format (backslash, double quote, newline).
std::string EscapeLabelValue(const std::string& v);
// A sample value as the text format expects it: shortest round-trip decimal,
// "+Inf", "-Inf" or "NaN".
std::string FormatMetricValue(double v);

}  // namespace kvserve
