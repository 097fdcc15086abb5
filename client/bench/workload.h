// Workloads for kvserve-bench: what to send, independent of how it is sent.
//
// A workload is a list of conversations; a single-turn request is a
// conversation of one turn. Multi-turn conversations run their turns in
// order on one worker, so each turn can carry the replies before it.
// Everything random draws from one seeded engine, so a seed reproduces the
// prompts exactly (given the same tokenizer).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace kvserve::bench {

// A length distribution in tokens: "128" (fixed), "uniform:64:256",
// "normal:128:32" (mean, stddev; clamped to >= 1).
struct LengthDist {
  enum class Kind { kFixed, kUniform, kNormal } kind = Kind::kFixed;
  double a = 128;  // fixed value, uniform low, or normal mean
  double b = 0;    // uniform high or normal stddev
  // Throws std::invalid_argument on a malformed spec.
  static LengthDist Parse(const std::string& spec);
  int Sample(std::mt19937_64& rng) const;
  std::string ToString() const;
};

struct Turn {
  std::string user;  // the user message of this turn
  int max_tokens = 0;
};

struct Conversation {
  int id = 0;
  std::string system;  // optional system message
  std::vector<Turn> turns;
};

// Counts the tokens the server would see for `text`; returns -1 when no
// tokenizer is reachable (lengths are then approximated).
using TokenCounter = std::function<int(const std::string& text)>;

struct WorkloadOptions {
  std::string kind = "synthetic";  // synthetic | shared-prefix | multi-turn | file
  uint64_t seed = 0;
  int num_conversations = 100;
  LengthDist input{LengthDist::Kind::kFixed, 128, 0};
  LengthDist output{LengthDist::Kind::kFixed, 128, 0};
  // shared-prefix: P prefixes of L tokens, Q questions (input dist) each.
  int num_prefixes = 4;
  int prefix_len = 256;
  int questions_per_prefix = 8;
  // multi-turn: turns per session (num_conversations sessions).
  int turns = 4;
  // file: JSONL of {"prompt": ..., "max_tokens"?: N}, or ShareGPT
  // ({"conversations": [{"from": "human", "value": ...}, ...]}) as JSONL or
  // as one JSON array. use_file_output_len: size outputs like the reference
  // replies (as vLLM's benchmark does) instead of the output distribution.
  std::string file;
  bool use_file_output_len = true;
};

// Builds the workload. Throws std::runtime_error on a bad file or option.
std::vector<Conversation> BuildWorkload(const WorkloadOptions& options,
                                        const TokenCounter& count_tokens);

// Random words making about `tokens` tokens (exactly, when count_tokens
// works and the tokenizer allows it).
std::string MakeText(int tokens, std::mt19937_64& rng, const TokenCounter& count_tokens);

}  // namespace kvserve::bench
