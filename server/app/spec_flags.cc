// The implementation of spec_flags.h. What it owns and how it is used: the
// opening paragraph of server/app/spec_flags.h.

#include "server/app/spec_flags.h"

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"

namespace kvserve {

void AddSpeculativeFlags(CLI::App* app, SpeculativeFlags* f) {
  app->add_option("--speculative", f->mode,
                  "Speculative decoding without a draft model, for requests that name no mode: "
                  "off, ngram (n-gram lookup over the request's own prompt and output, and the "
                  "response cache's candidate) or suffix (ngram plus an index over recent "
                  "outputs of all requests); output is identical either way")
      ->check(CLI::IsMember({"off", "ngram", "suffix"}))
      ->capture_default_str();
  app->add_option("--spec-ngram-min", f->ngram_min, "Shortest n-gram a draft is matched on")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app->add_option("--spec-ngram-max", f->ngram_max,
                  "Longest n-gram a draft is matched on (the longest match wins)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app->add_option("--spec-max-k", f->max_k,
                  "Draft tokens a sequence verifies per step at most (the adaptive choice is "
                  "at most this)")
      ->check(CLI::Range(1, kMaxSpecK))
      ->capture_default_str();
  app->add_option("--spec-suffix-tokens", f->suffix_tokens,
                  "Recent output tokens the suffix proposer indexes (fixed memory: about 100 "
                  "bytes a token)")
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 26))
      ->capture_default_str();
  app->add_flag("--spec-adaptive,!--no-spec-adaptive", f->adaptive,
                "Size each draft from the sequence's recent acceptance and the measured step "
                "cost, off where it would not pay (--no-spec-adaptive: verify every proposal "
                "in full)")
      ->capture_default_str();
}

absl::StatusOr<SpeculationOptions> SpeculationOptionsFromFlags(const SpeculativeFlags& f) {
  SpeculationOptions o;
  if (absl::Status s = ParseSpecMode(f.mode, "--speculative", &o.mode); !s.ok()) return s;
  o.ngram_min = f.ngram_min;
  o.ngram_max = f.ngram_max;
  o.max_k = f.max_k;
  o.suffix_capacity_tokens = f.suffix_tokens;
  o.adaptive = f.adaptive;
  if (o.ngram_max < o.ngram_min) {
    return absl::InvalidArgumentError(absl::StrCat("--spec-ngram-max (", o.ngram_max,
                                                   ") must be >= --spec-ngram-min (", o.ngram_min,
                                                   ")"));
  }
  if (absl::Status s = ValidateSpeculationOptions(o); !s.ok()) return s;
  return o;
}

}  // namespace kvserve
