// The implementation of Metrics. What it owns and how it is used: the
// opening paragraph of server/observe/metrics.h.

#include "server/observe/metrics.h"

#include <map>

#include <cassert>
#include <charconv>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvserve {
namespace {

// The outcomes ModelService reports; rendered at zero from the start.
constexpr const char* kKnownOutcomes[] = {"stop",     "length",   "cancelled",
                                          "deadline", "rejected", "error"};

}  // namespace

void AppendHeader(const std::string& name, const std::string& help, const char* type,
                  std::string* out) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void AppendSample(const std::string& name, const std::string& labels, double value,
                  std::string* out) {
  if (labels.empty()) {
    absl::StrAppend(out, name, " ", FormatMetricValue(value), "\n");
  } else {
    absl::StrAppend(out, name, "{", labels, "} ", FormatMetricValue(value), "\n");
  }
}

void AppendGauge(const std::string& name, const std::string& help, const std::string& labels,
                 double value, std::string* out) {
  AppendHeader(name, help, "gauge", out);
  AppendSample(name, labels, value, out);
}

void AppendCounter(const std::string& name, const std::string& help, const std::string& labels,
                   double value, std::string* out) {
  AppendHeader(name, help, "counter", out);
  AppendSample(name, labels, value, out);
}


std::string RenderCacheControlMetrics(const CacheControlStats& s) {
  std::string out;
  absl::StrAppend(&out,
                  "# HELP kvserve:cache_retained_bytes KV bytes pinned by retention leases, per tenant.\n"
                  "# TYPE kvserve:cache_retained_bytes gauge\n");
  if (s.retained_bytes.empty()) {
    absl::StrAppend(&out, "kvserve:cache_retained_bytes{tenant=\"\"} 0\n");
  }
  for (const auto& [t, b] : s.retained_bytes) {
    absl::StrAppend(&out, "kvserve:cache_retained_bytes{tenant=\"", EscapeLabelValue(t), "\"} ", b,
                    "\n");
  }
  auto counter = [&](const char* name, const char* help, int64_t v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ", v,
                    "\n");
  };
  absl::StrAppend(&out, "# HELP kvserve:cache_retention_leases Retention leases held now.\n",
                  "# TYPE kvserve:cache_retention_leases gauge\nkvserve:cache_retention_leases ",
                  s.leases, "\n");
  counter("kvserve:cache_retention_grants_total", "Retention requests granted whole.", s.grants);
  counter("kvserve:cache_retention_clips_total", "Retention requests granted in part.", s.clips);
  counter("kvserve:cache_retention_expiries_total", "Retention leases whose TTL lapsed.",
          s.expiries);
  counter("kvserve:cache_retention_releases_total", "Retention leases released early.",
          s.releases);
  absl::StrAppend(&out,
                  "# HELP kvserve:cache_retention_refusals_total Retention requests refused, by reason.\n"
                  "# TYPE kvserve:cache_retention_refusals_total counter\n");
  // The reasons CacheControl gives, each present from the first scrape.
  std::map<std::string, int64_t> refusals = {{"tenant_budget", 0}, {"pool_too_small", 0},
                                             {"not_cached", 0},    {"bad_request", 0},
                                             {"unsupported", 0}};
  for (const auto& [reason, n] : s.refusals_by_reason) refusals[reason] = n;
  for (const auto& [reason, n] : refusals) {
    absl::StrAppend(&out, "kvserve:cache_retention_refusals_total{reason=\"",
                    EscapeLabelValue(reason), "\"} ", n, "\n");
  }
  counter("kvserve:cache_explains_total", "Cache reports computed (explain calls and requests).",
          s.explains);
  counter("kvserve:cache_template_drift_total",
          "Chat requests whose history the template rendered differently from the cached turn.",
          s.template_drifts);
  return out;
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
  return out;
}

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Shortest round-trip form: 0.1 stays "0.1", counts stay integers.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  if (ec != std::errc()) return absl::StrCat(v);  // cannot happen for 64 bytes
  return std::string(buf, end);
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  for (size_t i = 1; i < bounds_.size(); ++i) assert(bounds_[i - 1] < bounds_[i]);
}

void Histogram::Observe(double v) {
  // Prometheus buckets are "less than or equal": v lands in the first bucket
  // whose bound is >= v.
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

double Histogram::sum() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sum_;
}

void Histogram::Render(const std::string& name, const std::string& help,
                       const std::string& labels, std::string* out) const {
  std::vector<uint64_t> counts;
  double sum;
  uint64_t count;
  {
    // Copy under the lock so the cumulative counts, _sum and _count of one
    // scrape agree with each other.
    std::lock_guard<std::mutex> lock(mu_);
    counts = counts_;
    sum = sum_;
    count = count_;
  }
  AppendHeader(name, help, "histogram", out);
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    const std::string le = i < bounds_.size() ? FormatMetricValue(bounds_[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket{", labels, sep, "le=\"", le, "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_sum{", labels, "} ", FormatMetricValue(sum), "\n");
  absl::StrAppend(out, name, "_count{", labels, "} ", count, "\n");
}

std::vector<double> Metrics::TimeToFirstTokenBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> Metrics::InterTokenLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2, 0.3,
          0.4,   0.5,    0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
}

std::vector<double> Metrics::EndToEndLatencyBuckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

Metrics::Metrics(std::string model_name)
    : model_name_(std::move(model_name)),
      labels_(absl::StrCat("model_name=\"", EscapeLabelValue(model_name_), "\"")),
      ttft_(TimeToFirstTokenBuckets()),
      itl_(InterTokenLatencyBuckets()),
      e2e_(EndToEndLatencyBuckets()) {
  for (const char* o : kKnownOutcomes) outcomes_.emplace_back(o, 0);
}

void Metrics::RequestFinished(const std::string& outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, count] : outcomes_) {
    if (name == outcome) {
      ++count;
      return;
    }
  }
  outcomes_.emplace_back(outcome, 1);
}

void Metrics::ObserveTimeToFirstToken(double seconds) { ttft_.Observe(seconds); }
void Metrics::ObserveInterTokenLatency(double seconds) { itl_.Observe(seconds); }
void Metrics::ObserveEndToEndLatency(double seconds) { e2e_.Observe(seconds); }

void Metrics::AddPromptTokens(int64_t n) {
  if (n <= 0) return;  // counters never go down
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(n);
}

void Metrics::AddGenerationTokens(int64_t n) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  generation_tokens_ += static_cast<uint64_t>(n);
}

void Metrics::AddSection(Section section) {
  std::lock_guard<std::mutex> lock(mu_);
  sections_.push_back(std::move(section));
}

std::string Metrics::Render(const EngineStats& stats) const {
  std::vector<std::pair<std::string, uint64_t>> outcomes;
  uint64_t prompt_tokens, generation_tokens;
  std::vector<Section> sections;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sections = sections_;
    outcomes = outcomes_;
    prompt_tokens = prompt_tokens_;
    generation_tokens = generation_tokens_;
  }
  const std::string& l = labels_;
  std::string out;
  out.reserve(8192);

  // vLLM's names.
  AppendGauge("kvserve:num_requests_running", "Number of requests in model execution batches.",
              l, stats.running, &out);
  AppendGauge("kvserve:num_requests_waiting", "Number of requests waiting to be processed.", l,
              stats.waiting, &out);
  AppendGauge("kvserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", l,
              stats.kv_utilization, &out);
  AppendGauge("kvserve:http_connections", "Open HTTP connections.", l,
              static_cast<double>(http_open_.load()), &out);
  AppendCounter("kvserve:http_connections_refused_total",
                "HTTP connections refused with 503 at --max-connections.", l,
                static_cast<double>(http_refused_.load()), &out);
  AppendCounter("kvserve:http_idle_connections_closed_total",
                "Idle HTTP connections closed to make room at --max-connections.", l,
                static_cast<double>(http_evicted_.load()), &out);
  AppendCounter("kvserve:http_timeouts_total",
                "HTTP connections closed by the idle, header, body or write timeout (a stream "
                "whose client stopped reading counts in http_stalled_readers_total instead).", l,
                static_cast<double>(http_timed_out_.load()), &out);
  AppendCounter("kvserve:http_stalled_readers_total",
                "HTTP streams disconnected because the client stopped reading.", l,
                static_cast<double>(http_stalled_.load()), &out);
  AppendCounter("kvserve:num_preemptions_total",
                "Cumulative number of preemptions (by recompute) from the engine.", l,
                static_cast<double>(stats.preemptions), &out);
  AppendCounter("kvserve:prompt_tokens_total", "Number of prefill tokens processed.", l,
                static_cast<double>(prompt_tokens), &out);
  AppendCounter("kvserve:generation_tokens_total", "Number of generation tokens processed.", l,
                static_cast<double>(generation_tokens), &out);
  AppendHeader("kvserve:request_success_total",
               "Count of finished requests by outcome (finished_reason).", "counter", &out);
  for (const auto& [outcome, count] : outcomes) {
    absl::StrAppend(&out, "kvserve:request_success_total{", l, ",finished_reason=\"",
                    EscapeLabelValue(outcome), "\"} ", count, "\n");
  }
  ttft_.Render("kvserve:time_to_first_token_seconds",
               "Histogram of time to first token in seconds.", l, &out);
  itl_.Render("kvserve:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds.", l, &out);
  e2e_.Render("kvserve:e2e_request_latency_seconds",
              "Histogram of end to end request latency in seconds.", l, &out);

  if (vllm_names_) {
    // The same values under vLLM's names, for routers and dashboards built
    // for vLLM (the endpoint picker's defaults read these exact names).
    AppendGauge("vllm:num_requests_running", "Number of requests in model execution batches.", l,
                stats.running, &out);
    AppendGauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", l,
                stats.waiting, &out);
    AppendGauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", l,
                stats.kv_utilization, &out);
    AppendHeader("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", "gauge",
                 &out);
    absl::StrAppend(&out, "vllm:cache_config_info{", l, ",block_size=\"", vllm_block_size_,
                    "\",num_gpu_blocks=\"", stats.blocks_total, "\"} 1\n");
    // kvserve serves no LoRA adapters; the value is the scrape time, as
    // vLLM's (pickers keep the newest sample).
    AppendHeader("vllm:lora_requests_info", "Running stats on lora requests.", "gauge", &out);
    absl::StrAppend(
        &out, "vllm:lora_requests_info{", l,
        ",max_lora=\"0\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} ",
        FormatMetricValue(std::chrono::duration<double>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count()),
        "\n");
    AppendCounter("vllm:num_preemptions_total",
                  "Cumulative number of preemptions from the engine.", l,
                  static_cast<double>(stats.preemptions), &out);
    AppendCounter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", l,
                  static_cast<double>(prompt_tokens), &out);
    AppendCounter("vllm:generation_tokens_total", "Number of generation tokens processed.", l,
                  static_cast<double>(generation_tokens), &out);
    AppendHeader("vllm:request_success_total", "Count of successfully processed requests.",
                 "counter", &out);
    for (const auto& [outcome, count] : outcomes) {
      absl::StrAppend(&out, "vllm:request_success_total{", l, ",finished_reason=\"",
                      EscapeLabelValue(outcome), "\"} ", count, "\n");
    }
    ttft_.Render("vllm:time_to_first_token_seconds",
                 "Histogram of time to first token in seconds.", l, &out);
    itl_.Render("vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.", l, &out);
    e2e_.Render("vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.", l, &out);
  }

  // Ours: the paged KV cache and the batches.
  AppendGauge("kvserve:kv_blocks_used", "KV-cache blocks in use.", l,
              static_cast<double>(stats.blocks_used), &out);
  AppendGauge("kvserve:kv_blocks_free", "KV-cache blocks free.", l,
              static_cast<double>(stats.blocks_free), &out);
  AppendGauge("kvserve:kv_blocks_total", "KV-cache blocks in the pool.", l,
              static_cast<double>(stats.blocks_total), &out);
  AppendGauge("kvserve:kv_slot_efficiency",
              "Live token slots over allocated token slots in the KV cache, now.", l,
              stats.slot_efficiency, &out);
  AppendGauge("kvserve:batch_tokens", "Tokens in the last engine step's batch.", l,
              static_cast<double>(stats.last_batch_tokens), &out);
  AppendGauge("kvserve:batch_seqs", "Sequences in the last engine step's batch.", l,
              static_cast<double>(stats.last_batch_seqs), &out);
  AppendGauge("kvserve:batch_prefill_tokens", "Prefill tokens in the last engine step's batch.",
              l, static_cast<double>(stats.last_batch_prefill_tokens), &out);
  AppendGauge("kvserve:step_token_budget",
              "Token budget of the last engine step after the stall-free bound.", l,
              static_cast<double>(stats.last_token_budget), &out);
  AppendGauge("kvserve:step_decode_ms_per_token",
              "Measured cost of a decode token in an engine step (ms).", l,
              stats.step_decode_ms_per_token, &out);
  AppendGauge("kvserve:step_prefill_ms_per_token",
              "Measured cost of a prefill token in an engine step (ms).", l,
              stats.step_prefill_ms_per_token, &out);
  AppendGauge("kvserve:kv_arriving_sequences",
              "Sequences waiting for KV that is being loaded (tiers, prefill nodes).", l,
              static_cast<double>(stats.kv_arriving), &out);
  AppendCounter("kvserve:kv_loads_total", "KV loads started instead of recomputing.", l,
                static_cast<double>(stats.kv_loads), &out);
  AppendCounter("kvserve:kv_evicted_tokens_total",
                "Cached tokens dropped by KV policies (window, sinks, h2o).", l,
                static_cast<double>(stats.kv_evicted_tokens), &out);
  AppendCounter("kvserve:kv_compactions_total",
                "Compactions by KV policies (each frees at least one block).", l,
                static_cast<double>(stats.kv_compactions), &out);
  AppendCounter("kvserve:kv_rotated_keys_total",
                "Cached keys re-rotated to positions within the cache (sinks past the context).", l,
                static_cast<double>(stats.kv_rotated_keys), &out);
  AppendCounter("kvserve:kv_load_failures_total",
                "KV loads that failed (their tokens were recomputed).", l,
                static_cast<double>(stats.kv_load_failures), &out);

  // Speculative decoding (scheduler/speculation.h, docs/speculation.md).
  {
    const SpeculationStats& sp = stats.speculation;
    auto with = [&](const std::string& label) {
      return absl::StrCat(l, l.empty() ? "" : ",", label);
    };
    auto per_source = [&](const std::string& name, const char* help,
                          const std::array<int64_t, kNumDraftSources>& v) {
      AppendHeader(name, help, "counter", &out);
      for (int i = 0; i < kNumDraftSources; ++i) {
        AppendSample(name,
                     with(absl::StrCat("source=\"", DraftSourceName(static_cast<DraftSource>(i)),
                                       "\"")),
                     static_cast<double>(v[static_cast<size_t>(i)]), &out);
      }
    };
    per_source("kvserve:spec_proposed_tokens_total", "Draft tokens verified, by proposer.",
               sp.proposed_by_source);
    per_source("kvserve:spec_accepted_tokens_total",
               "Draft tokens the target model accepted, by proposer.", sp.accepted_by_source);
    auto per_position = [&](const std::string& name, const char* help,
                            const std::array<int64_t, kMaxSpecK>& v) {
      AppendHeader(name, help, "counter", &out);
      for (int i = 0; i < kMaxSpecK; ++i) {
        AppendSample(name, with(absl::StrCat("position=\"", i, "\"")),
                     static_cast<double>(v[static_cast<size_t>(i)]), &out);
      }
    };
    per_position("kvserve:spec_position_proposed_total",
                 "Drafts that reached position (0-based) of the draft.", sp.proposed_by_position);
    per_position("kvserve:spec_position_accepted_total",
                 "Drafts whose token at position (0-based) was accepted.", sp.accepted_by_position);
    auto per_match = [&](const std::string& name, const char* help,
                         const std::array<int64_t, kSpecMatchBuckets>& v) {
      AppendHeader(name, help, "counter", &out);
      for (int i = 0; i < kSpecMatchBuckets; ++i) {
        AppendSample(
            name,
            with(absl::StrCat("match=\"", i + 1, i + 1 == kSpecMatchBuckets ? "+" : "", "\"")),
            static_cast<double>(v[static_cast<size_t>(i)]), &out);
      }
    };
    per_match(
        "kvserve:spec_match_proposed_tokens_total",
        "Draft tokens verified, by the match length (tokens of context) the draft was found on.",
        sp.proposed_by_match);
    per_match("kvserve:spec_match_accepted_tokens_total",
              "Draft tokens accepted, by the match length the draft was found on.",
              sp.accepted_by_match);
    AppendGauge("kvserve:spec_acceptance_rate", "Accepted over proposed draft tokens, so far.", l,
                sp.proposed_tokens > 0
                    ? static_cast<double>(sp.accepted_tokens) / sp.proposed_tokens
                    : 0.0,
                &out);
    AppendCounter("kvserve:spec_drafts_total", "Sequence-steps that verified a draft.", l,
                  static_cast<double>(sp.drafts), &out);
    AppendCounter("kvserve:spec_emitted_tokens_total",
                  "Tokens produced by sequence-steps that verified a draft.", l,
                  static_cast<double>(sp.emitted_tokens), &out);
    AppendGauge("kvserve:spec_tokens_per_step",
                "Tokens a sequence-step with a draft produced, on average (1 without).", l,
                sp.drafts > 0 ? static_cast<double>(sp.emitted_tokens) / sp.drafts : 1.0, &out);
    AppendCounter("kvserve:spec_skipped_by_cost_total",
                  "Proposals dropped whole because the cost model said they would not pay.", l,
                  static_cast<double>(sp.skipped_by_cost), &out);
    AppendCounter("kvserve:spec_held_for_prompts_total",
                  "Steps that drafted nothing because prompt chunks shared them.", l,
                  static_cast<double>(sp.held_for_prompts), &out);
    AppendGauge("kvserve:spec_step_fixed_ms",
                "Measured fixed cost of a decode/verify step (ms), as speculation sees it.", l,
                sp.step_fixed_ms, &out);
    AppendGauge("kvserve:spec_step_ms_per_token",
                "Measured cost of one more token in a decode/verify step (ms): the line, used "
                "for step sizes not measured.", l,
                sp.step_ms_per_token, &out);
    AppendGauge("kvserve:spec_step_sizes_measured",
                "Step sizes (tokens) whose cost speculation prices from recent steps of that "
                "size rather than from the line.",
                l, static_cast<double>(sp.step_sizes_measured), &out);
    AppendGauge("kvserve:spec_suffix_index_tokens",
                "Output tokens held by the cross-request suffix index.", l,
                static_cast<double>(sp.suffix_index_tokens), &out);
  }

  // KV tiers under the primary pool (host, disk); per-tier series carry a
  // tier label, and everything reads zero without tiers.
  {
    const KvTiersStats& t = stats.tiers;
    const std::string host = absl::StrCat(l, l.empty() ? "" : ",", "tier=\"host\"");
    const std::string disk = absl::StrCat(l, l.empty() ? "" : ",", "tier=\"disk\"");
    auto per_tier = [&](const std::string& name, const char* help, const char* type, double h,
                        double d) {
      AppendHeader(name, help, type, &out);
      AppendSample(name, host, h, &out);
      AppendSample(name, disk, d, &out);
    };
    per_tier("kvserve:kv_tier_blocks", "KV blocks held by the tier.", "gauge",
             static_cast<double>(t.host_blocks), static_cast<double>(t.disk_blocks));
    per_tier("kvserve:kv_tier_capacity_blocks", "KV blocks the tier can hold.", "gauge",
             static_cast<double>(t.host_capacity_blocks),
             static_cast<double>(t.disk_capacity_blocks));
    per_tier("kvserve:kv_tier_demotions_total", "KV blocks written into the tier.", "counter",
             static_cast<double>(t.demotions_host), static_cast<double>(t.demotions_disk));
    per_tier("kvserve:kv_tier_promotions_total",
             "KV blocks loaded from the tier into the primary pool.", "counter",
             static_cast<double>(t.promotions_host), static_cast<double>(t.promotions_disk));
    per_tier("kvserve:kv_tier_bytes_written_total", "Bytes copied into the tier.", "counter",
             static_cast<double>(t.bytes_to_host), static_cast<double>(t.bytes_to_disk));
    per_tier("kvserve:kv_tier_bytes_read_total",
             "Bytes copied from the tier into the primary pool.", "counter",
             static_cast<double>(t.bytes_from_host), static_cast<double>(t.bytes_from_disk));
    per_tier("kvserve:kv_tier_hit_tokens_total",
             "Prompt tokens loaded from the tier instead of computed.", "counter",
             static_cast<double>(t.hit_tokens_host), static_cast<double>(t.hit_tokens_disk));
    AppendCounter("kvserve:kv_tier_checksum_failures_total",
                  "Tier blocks whose checksum failed on load (their tokens were recomputed).", l,
                  static_cast<double>(t.checksum_failures), &out);
    AppendCounter("kvserve:kv_tier_disk_write_failures_total",
                  "Disk tier writes that failed (never visible to lookups).", l,
                  static_cast<double>(t.disk_write_failures), &out);
    AppendCounter("kvserve:kv_tier_dropped_demotions_total",
                  "Evicted KV blocks no tier could take (full of blocks in use, or not hit "
                  "often enough for the disk).",
                  l, static_cast<double>(t.dropped_demotions), &out);
    per_tier("kvserve:kv_tier_block_load_seconds",
             "The load cost model's estimate of one block's load from the tier (moving "
             "average of timed loads).",
             "gauge", t.host_block_load_s, t.disk_block_load_s);
    AppendCounter("kvserve:kv_tier_load_predicted_seconds_total",
                  "Predicted seconds of the tier loads started (next to the load latency "
                  "histogram's sum: predicted vs actual).",
                  l, t.load_predicted_sum_s, &out);
    AppendCounter("kvserve:kv_tier_recompute_chosen_blocks_total",
                  "KV blocks a tier held that were recomputed instead, because loading them "
                  "was predicted to take longer.",
                  l, static_cast<double>(t.recompute_chosen_blocks), &out);
    AppendCounter("kvserve:kv_tier_lossy_reencoded_blocks_total",
                  "KV blocks re-encoded into a lossier codec on demotion (--kv-host-dtype).", l,
                  static_cast<double>(t.lossy_reencoded_blocks), &out);
    AppendCounter("kvserve:kv_tier_lossy_hit_tokens_total",
                  "Prompt tokens loaded from a tier whose pages were re-encoded lossily "
                  "(--kv-host-dtype): close to, not exactly, the computed K/V.",
                  l, static_cast<double>(t.lossy_hit_tokens), &out);
    const std::string name = "kvserve:kv_tier_load_latency_seconds";
    AppendHeader(name, "Time from starting a tier load to its completion.", "histogram", &out);
    int64_t cumulative = 0;
    for (int i = 0; i <= kTierLoadLatencyBuckets; ++i) {
      cumulative += t.load_latency_buckets[i];
      const std::string le = i < kTierLoadLatencyBuckets
                                 ? FormatMetricValue(kTierLoadLatencyBounds[i])
                                 : std::string("+Inf");
      AppendSample(name + "_bucket", absl::StrCat(l, l.empty() ? "" : ",", "le=\"", le, "\""),
                   static_cast<double>(cumulative), &out);
    }
    AppendSample(name + "_sum", l, t.load_latency_sum_s, &out);
    AppendSample(name + "_count", l, static_cast<double>(t.loads), &out);
  }

  // The prefix cache (all zero when it is off). vLLM's two counters count
  // tokens; the rest are ours.
  AppendCounter("kvserve:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried prompt tokens.", l,
                static_cast<double>(stats.prefix_query_tokens), &out);
  AppendCounter("kvserve:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of prompt tokens served from the cache.", l,
                static_cast<double>(stats.prefix_hit_tokens), &out);
  AppendCounter("kvserve:prefix_cache_lookups_total",
                "Sequences matched against the prefix cache at admission.", l,
                static_cast<double>(stats.prefix_queries), &out);
  AppendGauge("kvserve:prefix_cache_hit_rate",
              "Prompt tokens served from the prefix cache over prompt tokens queried, since "
              "start (0 before the first query).",
              l,
              stats.prefix_query_tokens > 0 ? static_cast<double>(stats.prefix_hit_tokens) /
                                                  static_cast<double>(stats.prefix_query_tokens)
                                            : 0.0,
              &out);
  AppendCounter("kvserve:prefix_cache_inserted_blocks_total",
                "KV blocks inserted into the prefix cache.", l,
                static_cast<double>(stats.prefix_inserted_blocks), &out);
  AppendCounter("kvserve:prefix_cache_evicted_blocks_total",
                "KV blocks evicted from the prefix cache.", l,
                static_cast<double>(stats.prefix_evicted_blocks), &out);
  AppendGauge("kvserve:prefix_cache_cached_blocks", "KV blocks held by the prefix cache.", l,
              static_cast<double>(stats.prefix_cached_blocks), &out);
  AppendGauge("kvserve:prefix_cache_evictable_blocks",
              "KV blocks held by the prefix cache that no running request uses.", l,
              static_cast<double>(stats.prefix_evictable_blocks), &out);
  AppendGauge("kvserve:prefix_cache_enabled", "1 when the prefix cache is on.", l,
              stats.prefix_cache_enabled ? 1.0 : 0.0, &out);
  if (stats.sliding_window > 0) {
    // The sliding window's counters, in exposition order.
    const struct {
      const char* name;
      const char* help;
      int64_t value;
    } window_counters[] = {
        {"kvserve:kv_window_released_blocks_total",
         "KV blocks sequences let go as their sliding window moved past them.",
         stats.window_released_blocks},
        {"kvserve:kv_window_kept_cached_blocks_total",
         "Of the window-released blocks, those the prefix cache kept for later matches.",
         stats.window_kept_cached_blocks},
        {"kvserve:prefix_cache_window_lost_blocks_total",
         "Prefix blocks that could not be cached because the sliding window had let go "
         "of an earlier block of their prefix and the cache had evicted it.",
         stats.window_lost_prefix_blocks},
        {"kvserve:kv_window_hollowed_blocks_total",
         "Of the window-released blocks the prefix cache held, those it gave back to the "
         "pool (no cached prefix boundary needs their K/V; the tokens stay as a path).",
         stats.window_hollowed_blocks},
        {"kvserve:prefix_cache_window_dropped_tokens_total",
         "Prompt tokens the prefix cache spells but could not reuse because the sliding "
         "window had dropped K/V their continuation needs.",
         stats.window_dropped_prefix_tokens},
    };
    for (const auto& c : window_counters) {
      AppendCounter(c.name, c.help, l, static_cast<double>(c.value), &out);
    }
    AppendGauge("kvserve:prefix_cache_hollow_blocks",
                "Prefix-cache nodes whose K/V the sliding window dropped (tokens only).", l,
                static_cast<double>(stats.window_hollow_nodes), &out);
  }
  for (const Section& section : sections) section(l, &out);
  return out;
}

}  // namespace kvserve
