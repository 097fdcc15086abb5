// The implementation of advisor.h. What it owns and how it is used: the
// opening paragraph of server/app/advisor.h.

#include "server/app/advisor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/kv_view.h"

namespace kvserve {

using json = nlohmann::json;

namespace {

std::string F(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

// The KV dtypes the advisor considers, best quality first, with their
// perplexity cost as measured for docs/quantized-kv.md (SmolLM2-135M-Instruct
// Q4_1, GPL-3 text, 512-token context, `kvserve perplexity --kv-cache-dtype
// D` against f16). int4 and int4-g64 (+11.7 %, +18.1 %) and fp8-e5m2
// (+3.7 %) are never advised; fp8-e4m3 costs more than int8 at the same size.
struct DtypeChoice {
  const char* name;
  double ppl_cost_pct;  // prompt (prefill-written) keys
  const char* note;
};
constexpr DtypeChoice kDtypes[] = {
    {"f16", 0.0, "the reference"},
    {"int8", 0.0, "-0.003 % (noise)"},
    {"int4-kivi", 1.03, "+1.03 % on prefill-written keys, +3.72 % when every key is written by decode"},
};
constexpr const char* kPplSource =
    "measured: kvserve perplexity on SmolLM2-135M-Instruct Q4_1, GPL-3 text, context 512 "
    "(docs/quantized-kv.md)";

// The layout the engine would allocate for `dtype` (one GiB: only the block
// and group figures are used).
MemoryPlan LayoutFor(const KvShape& shape, const std::string& dtype, int32_t block_size) {
  kernels::KvDType d;
  if (!kernels::ParseKvDType(dtype, &d)) return {};
  absl::StatusOr<MemoryPlan> p = PlanKvMemory(shape, block_size, d, int64_t{1} << 30);
  return p.ok() ? *p : MemoryPlan{};
}

// Bytes a sequence of `tokens` holds (KV cache groups: each group's pages,
// window groups only their window's), memory_planner.h's SequenceKvBytes.
double SeqBytes(const KvShape& shape, const std::string& dtype, int32_t block_size,
                double tokens) {
  return static_cast<double>(
      SequenceKvBytes(LayoutFor(shape, dtype, block_size), static_cast<int64_t>(tokens)));
}

// Average bytes per token of a sequence of `tokens` (hybrid models hold
// fewer per token the longer the sequence runs past the window).
double BytesPerToken(const KvShape& shape, const std::string& dtype, int32_t block_size,
                     double tokens) {
  return SeqBytes(shape, dtype, block_size, std::max(1.0, tokens)) / std::max(1.0, tokens);
}

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

absl::StatusOr<LengthSpec> ParseLengthSpec(const std::string& text) {
  std::vector<std::string> p = absl::StrSplit(text, ':');
  LengthSpec s;
  s.text = text;
  double a = 0, b = 0;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad length distribution '", text, "' (want N, fixed:N, uniform:LO:HI or normal:MEAN:STD)"));
  };
  if (p.size() == 1 && absl::SimpleAtod(p[0], &a)) {
    s.mean = s.high = a;
  } else if (p.size() == 2 && p[0] == "fixed" && absl::SimpleAtod(p[1], &a)) {
    s.mean = s.high = a;
  } else if (p.size() == 3 && p[0] == "uniform" && absl::SimpleAtod(p[1], &a) &&
             absl::SimpleAtod(p[2], &b) && b >= a) {
    s.mean = (a + b) / 2;
    s.high = b;
  } else if (p.size() == 3 && p[0] == "normal" && absl::SimpleAtod(p[1], &a) &&
             absl::SimpleAtod(p[2], &b) && b >= 0) {
    s.mean = a;
    s.high = a + 2.33 * b;
  } else {
    return bad();
  }
  if (s.mean < 1) return bad();
  return s;
}

absl::StatusOr<AdvisorWorkload> WorkloadFromBench(const json& r) {
  if (!r.is_object() || !r.contains("config") || !r.contains("runs") || !r["runs"].is_array() ||
      r["runs"].empty()) {
    return absl::InvalidArgumentError(
        "not a kvserve-bench result (want {\"config\": ..., \"runs\": [...]})");
  }
  const json& c = r["config"];
  AdvisorWorkload w;
  auto spec = [&](const char* key) -> absl::StatusOr<LengthSpec> {
    if (!c.contains(key) || !c[key].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("the bench result's config has no ", key));
    }
    return ParseLengthSpec(c[key].get<std::string>());
  };
  auto in = spec("input_len");
  if (!in.ok()) return in.status();
  auto out = spec("output_len");
  if (!out.ok()) return out.status();
  w.prompt = *in;
  w.output = *out;
  // The busiest run is the load to plan for.
  const json* best = &r["runs"][0];
  for (const json& run : r["runs"]) {
    if (run["load"].value("value", 0.0) > (*best)["load"].value("value", 0.0)) best = &run;
  }
  const json& load = (*best)["load"];
  if (load.value("mode", "") == "open") {
    w.rate = load.value("value", 0.0);
  } else {
    w.concurrency = static_cast<int32_t>(load.value("value", 1.0));
  }
  const json& s = (*best)["summary"];
  const double prompt = s.value("prompt_tokens", 0.0), cached = s.value("cached_tokens", 0.0);
  w.prefix_share = prompt > 0 ? std::clamp(cached / prompt, 0.0, 1.0) : 0;
  w.slo_ttft_ms = c.value("slo_ttft_ms", 0.0);
  w.slo_tpot_ms = c.value("slo_tpot_ms", 0.0);
  w.source = "a kvserve-bench result";
  return w;
}

Prediction Predict(const AdvisorWorkload& w, const Calibration& c, int32_t max_seqs,
                   int32_t max_batched_tokens, double prefix_hit_share) {
  Prediction p;
  const double uncached = w.prompt.mean * (1 - std::clamp(prefix_hit_share, 0.0, 1.0));
  const double out = std::max(1.0, w.output.mean);
  const double chunk = std::max(1, max_batched_tokens);
  auto decode_step = [&](double b) { return c.step_fixed_s + c.decode_per_seq_s * b; };
  // One request's prefill: its uncached tokens in chunks of the step budget.
  const double prefill_s = uncached * c.prefill_per_token_s +
                           std::ceil(std::max(1.0, uncached) / chunk) * c.step_fixed_s;
  // In a steady state of B running sequences, every output-length decode
  // steps B new prompts are prefilled, their cost spread over those steps.
  auto cycle = [&](double b) { return out * decode_step(b) + b * uncached * c.prefill_per_token_s; };
  double b = 1;
  if (w.concurrency > 0) {
    b = std::min<double>(w.concurrency, std::max(1, max_seqs));
    const double t = cycle(b);
    p.requests_per_s = b / t;
    p.tpot_ms = 1e3 * t / out;
    p.utilization = 1;
    // Clients beyond max_seqs wait for a place: a whole request's time.
    const double queue_s = w.concurrency > max_seqs ? t * (w.concurrency - max_seqs) / b : 0;
    p.ttft_ms = 1e3 * (queue_s + prefill_s + decode_step(b));
  } else {
    // Open loop: Little's law, B = rate x time in the system, to a fixed point.
    const double rate = std::max(w.rate, 1e-9);
    for (int i = 0; i < 50; ++i) {
      const double t = cycle(b);
      const double next = std::clamp(rate * (prefill_s + t), 1.0, static_cast<double>(std::max(1, max_seqs)));
      if (std::fabs(next - b) < 1e-3) break;
      b = 0.5 * (b + next);
    }
    const double t = cycle(b);
    const double capacity = b / t;  // requests per second at this batch
    p.utilization = rate / std::max(capacity, 1e-12);
    p.overloaded = p.utilization >= 1;
    p.requests_per_s = std::min(rate, capacity);
    p.tpot_ms = 1e3 * t / out;
    // M/D/1-style waiting before admission while the batch is full.
    const double rho = std::min(p.utilization, 0.99);
    const double wait_s = b >= max_seqs ? rho / (2 * (1 - rho)) * t / b : 0;
    p.ttft_ms = 1e3 * (wait_s + prefill_s + decode_step(b));
  }
  p.output_tokens_per_s = p.requests_per_s * out;
  return p;
}

std::string FormatBytes(int64_t bytes) {
  if (bytes <= 0) return "0";
  const int64_t mib = bytes >> 20;
  if (mib >= 1024 && mib % 1024 == 0) return absl::StrCat(mib / 1024, "GiB");
  return absl::StrCat(std::max<int64_t>(1, mib), "MiB");
}

absl::StatusOr<Advice> Advise(const AdvisorInputs& in) {
  const AdvisorWorkload& w = in.workload;
  const Calibration& c = in.calibration;
  if (w.concurrency <= 0 && w.rate <= 0) {
    return absl::InvalidArgumentError("give the load: --concurrency N or --rate R");
  }
  if (w.prefix_share < 0 || w.prefix_share > 1) {
    return absl::InvalidArgumentError("--prefix-share must be in [0, 1]");
  }
  if (in.memory_budget_bytes <= 0) return absl::InvalidArgumentError("--memory must be > 0");
  if (in.shape.n_layers <= 0) return absl::InvalidArgumentError("the model has no layers");
  const double context = in.shape.context_length > 0 ? in.shape.context_length : 1e9;
  if (w.prompt.high + w.output.high > context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt + output (", w.prompt.high, " + ", w.output.high,
        " tokens) exceed the model's context of ", in.shape.context_length, " tokens"));
  }
  Advice a;

  // Block size: a common prefix is shared in whole blocks, so short shared
  // prefixes want small blocks; long unshared prompts want fewer, larger ones.
  const double prefix_tokens = w.prompt.mean * w.prefix_share;
  if (w.prefix_share >= 0.2 && prefix_tokens < 512) {
    a.block_size = 16;
    a.reasons.push_back(absl::StrCat(
        "block size 16: the common prefix (~", static_cast<int>(prefix_tokens),
        " tokens) is cached in whole blocks; at 16 at most 15 of its tokens are recomputed"));
  } else if (w.prompt.mean >= 1024 && w.prefix_share < 0.2) {
    a.block_size = 32;
    a.reasons.push_back(absl::StrCat(
        "block size 32: long prompts (~", static_cast<int>(w.prompt.mean),
        " tokens) with little sharing: half the block-table entries and copies of 16, and "
        "prefix reuse is rare anyway"));
  } else {
    a.block_size = 16;
    a.reasons.push_back("block size 16: the default; nothing in this workload favours another");
  }

  // Memory: weights first, then a margin for activations, the rest is KV.
  const int64_t margin = std::max<int64_t>(int64_t{64} << 20, in.memory_budget_bytes / 20);
  const int64_t kv_room = in.memory_budget_bytes - in.model_bytes - margin;
  if (kv_room <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--memory ", FormatBytes(in.memory_budget_bytes), " does not hold the weights (",
        FormatBytes(in.model_bytes), ") and a ", FormatBytes(margin), " margin"));
  }
  // Batch: a closed loop runs its clients; an open loop what Little's law
  // says (refined below once the costs are known).
  int32_t seqs = w.concurrency > 0 ? w.concurrency : 8;
  if (w.concurrency <= 0) {
    const Prediction guess = Predict(w, c, 1 << 12, 512, 0);
    seqs = static_cast<int32_t>(std::ceil(w.rate * (guess.ttft_ms + guess.tpot_ms * w.output.mean) / 1e3 * 1.5));
    seqs = std::clamp(seqs, 1, 256);
  }
  // Tokens to reserve: every running sequence at its high lengths, plus the
  // common prefixes kept cached.
  const double per_seq = w.prompt.high + w.output.high;
  const double prefix_ws = w.prefix_share > 0 ? prefix_tokens * std::max(1, w.prefixes) : 0;
  // Each running sequence at its high length, and each common prefix once
  // (a cached prefix of a hybrid model keeps its window groups' last blocks
  // only, as a sequence does).
  auto prefix_bytes = [&](const std::string& dtype) {
    return w.prefix_share > 0
               ? std::max(1, w.prefixes) * SeqBytes(in.shape, dtype, a.block_size, prefix_tokens)
               : 0.0;
  };
  auto need_bytes = [&](const std::string& dtype) {
    return static_cast<int64_t>(seqs * SeqBytes(in.shape, dtype, a.block_size, per_seq) +
                                prefix_bytes(dtype));
  };
  const DtypeChoice* chosen = nullptr;
  for (const DtypeChoice& d : kDtypes) {
    if (need_bytes(d.name) <= kv_room) {
      chosen = &d;
      break;
    }
  }
  double hit_share = w.prefix_share;
  if (chosen == nullptr) {
    // Nothing holds the whole batch: the smallest dtype, fewer sequences.
    chosen = &kDtypes[std::size(kDtypes) - 1];
    const int32_t fit =
        static_cast<int32_t>((kv_room - prefix_bytes(chosen->name)) /
                             std::max(1.0, SeqBytes(in.shape, chosen->name, a.block_size, per_seq)));
    if (fit < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--memory ", FormatBytes(in.memory_budget_bytes), " leaves ", FormatBytes(kv_room),
          " for KV, less than one sequence of ", static_cast<int>(per_seq), " tokens even at ",
          chosen->name));
    }
    a.warnings.push_back(absl::StrCat("the budget holds ", fit, " sequences at ", chosen->name,
                                      ", not the ", seqs, " the load asks for: the rest queue"));
    seqs = fit;
  }
  a.kv_dtype = chosen->name;
  a.kv_dtype_cost = absl::StrCat(chosen->note, " perplexity vs f16 (", kPplSource, ")");
  const int64_t need = need_bytes(a.kv_dtype);
  if (a.kv_dtype == "f16") {
    a.reasons.push_back(absl::StrCat(
        "KV dtype f16: ", seqs, " sequences of ", static_cast<int>(per_seq), " tokens",
        prefix_ws > 0 ? absl::StrCat(" and ", static_cast<int>(prefix_ws), " cached prefix tokens")
                      : std::string(),
        " need ", FormatBytes(need), " at f16, within the ", FormatBytes(kv_room),
        " left for KV: no quantization cost to pay"));
  } else {
    a.reasons.push_back(absl::StrCat(
        "KV dtype ", a.kv_dtype, ": f16 would need ", FormatBytes(need_bytes("f16")), " but ",
        FormatBytes(kv_room), " is left for KV; ", a.kv_dtype, " needs ", FormatBytes(need),
        "; its cost: ", chosen->note));
  }

  if (in.shape.layers_per_block > 0 && in.shape.full_groups + in.shape.window_groups > 1) {
    // Hybrid attention: memory per KV cache group, against the layout that
    // keeps every layer's K/V for every token.
    const MemoryPlan grouped = LayoutFor(in.shape, a.kv_dtype, a.block_size);
    KvShape all_layers = in.shape;
    all_layers.layers_per_block = all_layers.full_groups = all_layers.window_groups = 0;
    const int64_t blocks = (static_cast<int64_t>(per_seq) + a.block_size - 1) / a.block_size;
    const int64_t full_part = grouped.block_bytes * grouped.full_groups * blocks;
    const int64_t seq_bytes = SequenceKvBytes(grouped, static_cast<int64_t>(per_seq));
    const int64_t flat_bytes =
        SequenceKvBytes(LayoutFor(all_layers, a.kv_dtype, a.block_size), static_cast<int64_t>(per_seq));
    a.reasons.push_back(absl::StrCat(
        "KV cache groups: ", grouped.kv_groups, " groups of ", grouped.layers_per_block,
        " layers (", grouped.full_groups, " full, ", grouped.window_groups, " with a ",
        in.shape.sliding_window, "-token window); a sequence of ", static_cast<int>(per_seq),
        " tokens holds ", FormatBytes(seq_bytes), " at ", a.kv_dtype, " (full groups ",
        FormatBytes(full_part), ", window groups ", FormatBytes(seq_bytes - full_part),
        ") where keeping every layer would take ", FormatBytes(flat_bytes)));
  }
  // The KV budget is all the room: spare blocks keep more prefixes cached.
  a.kv_cache_bytes = (kv_room >> 20) << 20;
  a.reasons.push_back(absl::StrCat(
      "KV budget ", FormatBytes(a.kv_cache_bytes), ": the memory (", FormatBytes(in.memory_budget_bytes),
      ") less the weights (", FormatBytes(in.model_bytes), ") and a ", FormatBytes(margin),
      " activation margin; blocks beyond the running sequences hold cached prefixes"));
  // Tiers: on this (CPU) engine the primary pool already is host memory, so a
  // host tier would copy within the same RAM. A disk tier pays when the
  // prefixes worth keeping exceed what RAM holds.
  const double bpt_chosen = BytesPerToken(in.shape, a.kv_dtype, a.block_size, per_seq);
  const double primary_tokens = a.kv_cache_bytes / std::max(1.0, bpt_chosen);
  const double spare_tokens = primary_tokens - seqs * per_seq;
  if (prefix_ws > 0 && prefix_ws > spare_tokens) {
    a.kv_disk_bytes = RoundUp(static_cast<int64_t>(2 * prefix_ws * bpt_chosen), int64_t{1} << 20);
    hit_share = w.prefix_share * std::clamp(spare_tokens / prefix_ws, 0.0, 1.0);
    a.reasons.push_back(absl::StrCat(
        "tiers: host off (on CPU the pool is host memory already); disk ", FormatBytes(a.kv_disk_bytes),
        ": the ", w.prefixes, " common prefixes (", static_cast<int>(prefix_ws),
        " tokens) exceed the pool's spare ", static_cast<int>(std::max(0.0, spare_tokens)),
        " tokens, so the evicted ones are reloaded from disk instead of recomputed"));
  } else {
    a.reasons.push_back(
        "tiers: off: the pool holds the running sequences and the common prefixes together "
        "(and on CPU a host tier would copy within the same RAM)");
  }

  // Batch budget: the step's token budget that keeps TPOT within its SLO
  // (decode tokens ride every step; the rest of the budget is prefill).
  a.max_seqs = seqs;
  int32_t mbt = 512;
  if (w.slo_tpot_ms > 0 && c.prefill_per_token_s > 0) {
    const double room_s = w.slo_tpot_ms / 1e3 - c.step_fixed_s - c.decode_per_seq_s * seqs;
    const double tokens = room_s / c.prefill_per_token_s;
    if (tokens < a.block_size) {
      a.warnings.push_back(absl::StrCat(
          "TPOT SLO ", w.slo_tpot_ms, " ms: a decode step of ", seqs, " sequences already takes ",
          F("%.1f", 1e3 * (c.step_fixed_s + c.decode_per_seq_s * seqs)),
          " ms here; lower the concurrency or accept a longer TPOT"));
      mbt = a.block_size * 4;
    } else {
      mbt = static_cast<int32_t>(std::clamp<double>(std::floor(tokens / a.block_size) * a.block_size,
                                                    a.block_size, 4096));
    }
    a.target_itl_ms = w.slo_tpot_ms;
    const double step_ms =
        1e3 * (c.step_fixed_s + c.decode_per_seq_s * seqs + c.prefill_per_token_s * mbt);
    a.reasons.push_back(absl::StrCat(
        "batch: --max-seqs ", seqs, ", --max-batched-tokens ", mbt, " and --target-itl-ms ",
        w.slo_tpot_ms, ": a step of ", seqs, " decodes and ", mbt, " prompt tokens takes ~",
        F("%.1f", step_ms), " ms",
        step_ms <= w.slo_tpot_ms
            ? ", within the TPOT SLO, so long prompts cannot stall the streams"
            : absl::StrCat(", over the ", w.slo_tpot_ms,
                           " ms TPOT SLO even so: the smallest budget that still makes progress "
                           "(see the warnings)")));
  } else {
    mbt = static_cast<int32_t>(std::clamp<double>(RoundUp(static_cast<int64_t>(w.prompt.high), a.block_size), 256, 2048));
    a.reasons.push_back(absl::StrCat(
        "batch: --max-seqs ", seqs, w.concurrency > 0 ? " (the clients)" : " (rate x time in system, x1.5)",
        ", --max-batched-tokens ", mbt, ": no TPOT SLO, so a prompt of ",
        static_cast<int>(w.prompt.high), " tokens is prefilled in one step for the best TTFT"));
  }
  a.max_batched_tokens = mbt;
  a.predicted = Predict(w, c, a.max_seqs, a.max_batched_tokens, hit_share);
  if (a.predicted.overloaded) {
    a.warnings.push_back(absl::StrCat("the rate needs ", F("%.2f", a.predicted.utilization),
                                      "x this machine's capacity: requests will queue without bound"));
  }
  if (w.slo_ttft_ms > 0 && a.predicted.ttft_ms > w.slo_ttft_ms) {
    a.warnings.push_back(absl::StrCat("predicted TTFT ", F("%.0f", a.predicted.ttft_ms),
                                      " ms misses the SLO of ", w.slo_ttft_ms, " ms"));
  }
  if (w.slo_tpot_ms > 0 && a.predicted.tpot_ms > w.slo_tpot_ms) {
    a.warnings.push_back(absl::StrCat("predicted TPOT ", F("%.1f", a.predicted.tpot_ms),
                                      " ms misses the SLO of ", w.slo_tpot_ms, " ms"));
  }

  // A decode step of the chosen batch: what a draft token rides in, and what
  // disaggregation leaves the decode node.
  const double decode_step_s = c.step_fixed_s + c.decode_per_seq_s * a.max_seqs;

  // Speculative decoding: drafts from the request's own tokens pay where
  // answers repeat their prompt, which the workload does not say, and only
  // while a draft token is cheap next to the step it rides in (few
  // sequences); give the operator that price, measured here.
  a.speculation = false;
  const double draft_share = decode_step_s > 0 ? c.decode_per_seq_s / decode_step_s : 0;
  a.reasons.push_back(absl::StrCat(
      "speculative decoding: off (the default): --speculative ngram (or a request's "
      "\"speculative\": \"ngram\") drafts from each request's own prompt and output and pays "
      "where answers repeat their prompt (code edits, summaries, extraction) and few sequences "
      "share a step; here a draft token adds ",
      F("%.0f", 100 * draft_share), "% to a step of ", a.max_seqs,
      a.max_seqs == 1 ? " sequence" : " sequences",
      "; the workload does not say whether answers repeat, and the adaptive cost model turns "
      "drafts down where they would not pay"));

  // Disaggregation: prefill on other nodes takes the prompt work out of the
  // decode steps, at the cost of moving the KV.
  const Prediction colocated = a.predicted;
  const double decode_only_tpot = 1e3 * decode_step_s;
  const double prefill_share = 1 - decode_only_tpot / std::max(colocated.tpot_ms, 1e-9);
  const double kv_bytes = w.prompt.mean * (1 - hit_share) * bpt_chosen;
  const double transfer_ms = c.copy_gbps > 0 ? 1e3 * kv_bytes / (c.copy_gbps * 1e9) : 0;
  const bool tpot_helped = w.slo_tpot_ms > 0 && colocated.tpot_ms > w.slo_tpot_ms &&
                           decode_only_tpot <= w.slo_tpot_ms;
  a.disaggregate = tpot_helped && prefill_share > 0.3 &&
                   (w.slo_ttft_ms <= 0 || colocated.ttft_ms + transfer_ms <= w.slo_ttft_ms);
  a.reasons.push_back(absl::StrCat(
      "prefill/decode disaggregation: ", a.disaggregate ? "pays" : "does not pay", ": prefill is ",
      F("%.0f", 100 * std::max(0.0, prefill_share)), " % of the decode nodes' step time; without it TPOT would be ",
      F("%.1f", decode_only_tpot), " ms (vs ", F("%.1f", colocated.tpot_ms), " ms colocated); moving a prompt's KV (",
      FormatBytes(static_cast<int64_t>(kv_bytes)), ") costs >= ", F("%.2f", transfer_ms),
      " ms at this machine's copy bandwidth",
      a.disaggregate ? "" : (w.slo_tpot_ms <= 0 ? "; with no TPOT SLO there is nothing to win"
                                                 : (colocated.tpot_ms <= w.slo_tpot_ms
                                                        ? "; TPOT already meets its SLO colocated"
                                                        : "; decode alone would still miss the SLO"))));
  return a;
}

json Advice::ToJson() const {
  return {{"config",
           {{"block-size", block_size},
            {"kv-cache-dtype", kv_dtype},
            {"kv-cache-memory", FormatBytes(kv_cache_bytes)},
            {"kv-host-memory", FormatBytes(kv_host_bytes)},
            {"kv-disk-bytes", kv_disk_bytes > 0 ? FormatBytes(kv_disk_bytes) : "0"},
            {"max-seqs", max_seqs},
            {"max-batched-tokens", max_batched_tokens},
            {"target-itl-ms", target_itl_ms}}},
          {"kv_dtype_cost", kv_dtype_cost},
          {"speculation", speculation},
          {"disaggregate", disaggregate},
          {"predicted",
           {{"ttft_ms", predicted.ttft_ms},
            {"tpot_ms", predicted.tpot_ms},
            {"output_tokens_per_s", predicted.output_tokens_per_s},
            {"requests_per_s", predicted.requests_per_s},
            {"utilization", predicted.utilization},
            {"overloaded", predicted.overloaded}}},
          {"reasons", reasons},
          {"warnings", warnings}};
}

std::string Advice::ToToml(const std::string& header_comment) const {
  std::ostringstream o;
  for (absl::string_view line : absl::StrSplit(header_comment, '\n')) o << "# " << line << '\n';
  o << "[serve]\n"
    << "block-size = " << block_size << '\n'
    << "kv-cache-dtype = \"" << kv_dtype << "\"\n"
    << "kv-cache-memory = \"" << FormatBytes(kv_cache_bytes) << "\"\n"
    << "max-seqs = " << max_seqs << '\n'
    << "max-batched-tokens = " << max_batched_tokens << '\n';
  if (target_itl_ms > 0) o << "target-itl-ms = " << target_itl_ms << '\n';
  if (kv_host_bytes > 0) o << "kv-host-memory = \"" << FormatBytes(kv_host_bytes) << "\"\n";
  if (kv_disk_bytes > 0) {
    o << "# a disk tier: set kv-disk-dir to a directory on a local SSD to turn it on\n"
      << "# kv-disk-dir = \"/var/lib/kvserve/kv\"\n"
      << "kv-disk-bytes = \"" << FormatBytes(kv_disk_bytes) << "\"\n";
  }
  return o.str();
}

std::string Advice::ToText() const {
  std::ostringstream o;
  o << "recommended configuration\n";
  o << "  --block-size " << block_size << " --kv-cache-dtype " << kv_dtype << " --kv-cache-memory "
    << FormatBytes(kv_cache_bytes) << " --max-seqs " << max_seqs << " --max-batched-tokens "
    << max_batched_tokens;
  if (target_itl_ms > 0) o << " --target-itl-ms " << target_itl_ms;
  if (kv_disk_bytes > 0) o << " --kv-disk-dir DIR --kv-disk-bytes " << FormatBytes(kv_disk_bytes);
  o << "\n  speculative decoding " << (speculation ? "on" : "off") << ", P/D disaggregation "
    << (disaggregate ? "yes" : "no") << "\n\nwhy\n";
  for (const std::string& r : reasons) o << "  - " << r << '\n';
  o << "  KV dtype cost: " << kv_dtype_cost << "\n\npredicted on this machine\n";
  o << "  TTFT " << F("%.1f", predicted.ttft_ms) << " ms, TPOT " << F("%.2f", predicted.tpot_ms)
    << " ms, " << F("%.1f", predicted.output_tokens_per_s) << " output tokens/s, "
    << F("%.2f", predicted.requests_per_s) << " requests/s";
  if (predicted.utilization > 0 && predicted.utilization != 1) {
    o << ", engine " << F("%.0f", 100 * predicted.utilization) << " % busy";
  }
  o << '\n';
  if (!warnings.empty()) {
    o << "\nwarnings\n";
    for (const std::string& w : warnings) o << "  ! " << w << '\n';
  }
  return o.str();
}

}  // namespace kvserve
