// The speculative-decoding flags of the commands that run the engine
// (--speculative, --spec-ngram-min, --spec-ngram-max, --spec-max-k,
// --spec-suffix-tokens, --[no-]spec-adaptive), apart from serve_flags.cc so
// the feature's flags live in one block. docs/speculation.md explains them.
//
// Thread-safety: plain data; registration happens once, before parsing.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "scheduler/speculation.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvserve {

struct SpeculativeFlags {
  std::string mode = "off";
  int32_t ngram_min = 2;
  int32_t ngram_max = 4;
  int32_t max_k = 8;
  int64_t suffix_tokens = 1 << 18;
  bool adaptive = true;
};

void AddSpeculativeFlags(CLI::App* app, SpeculativeFlags* flags);

// InvalidArgument naming the flag.
absl::StatusOr<SpeculationOptions> SpeculationOptionsFromFlags(const SpeculativeFlags& flags);

}  // namespace kvserve
