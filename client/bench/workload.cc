#include "client/bench/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "nlohmann/json.hpp"

namespace kvserve::bench {
namespace {

// Common short English words: most are one token in BPE and SentencePiece
// vocabularies, so the word count is a fair first guess at the token count.
constexpr const char* kWords[] = {
    "the",   "cat",  "sat",  "on",   "a",    "mat",  "and",    "dog",   "ran",   "to",
    "park",  "with", "big",  "red",  "ball", "sun",  "was",    "hot",   "day",   "she",
    "he",    "saw",  "bird", "fly",  "over", "tree", "little", "girl",  "boy",   "happy",
    "play",  "time", "once", "upon", "went", "home", "said",   "good",  "night", "mom",
    "water", "fish", "swim", "box",  "toy",  "car",  "blue",   "green", "house", "friend"};
constexpr int kNumWords = sizeof(kWords) / sizeof(kWords[0]);

std::string Words(const std::vector<int>& ids, size_t n) {
  std::string out;
  for (size_t i = 0; i < n && i < ids.size(); ++i) {
    if (i) out += ' ';
    out += kWords[ids[i]];
  }
  return out;
}

// Rough token estimate for servers whose tokenizer we cannot reach.
int ApproxTokens(const std::string& text) {
  int words = 0;
  bool in_word = false;
  for (char c : text) {
    const bool space = c == ' ' || c == '\n' || c == '\t';
    if (!space && !in_word) ++words;
    in_word = !space;
  }
  return std::max(1, static_cast<int>(std::lround(words * 1.3)));
}

int Count(const TokenCounter& count, const std::string& text) {
  const int n = count ? count(text) : -1;
  return n >= 0 ? n : ApproxTokens(text);
}

}  // namespace

LengthDist LengthDist::Parse(const std::string& spec) {
  LengthDist d;
  std::vector<std::string> parts;
  std::stringstream ss(spec);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  try {
    if (parts.size() == 1) {
      d.kind = Kind::kFixed;
      d.a = std::stod(parts[0]);
    } else if (parts.size() == 3 && (parts[0] == "uniform" || parts[0] == "normal")) {
      d.kind = parts[0] == "uniform" ? Kind::kUniform : Kind::kNormal;
      d.a = std::stod(parts[1]);
      d.b = std::stod(parts[2]);
    } else if (parts.size() == 2 && parts[0] == "fixed") {
      d.a = std::stod(parts[1]);
    } else {
      throw std::invalid_argument("");
    }
  } catch (const std::exception&) {
    throw std::invalid_argument("bad length distribution '" + spec +
                                "' (want N, fixed:N, uniform:LO:HI or normal:MEAN:STD)");
  }
  if (d.a < 1 || (d.kind == Kind::kUniform && d.b < d.a) || d.b < 0) {
    throw std::invalid_argument("bad length distribution '" + spec + "': lengths must be >= 1");
  }
  return d;
}

int LengthDist::Sample(std::mt19937_64& rng) const {
  double v = a;
  if (kind == Kind::kUniform) {
    v = std::uniform_int_distribution<int>(static_cast<int>(a), static_cast<int>(b))(rng);
  } else if (kind == Kind::kNormal) {
    v = std::normal_distribution<double>(a, b)(rng);
  }
  return std::max(1, static_cast<int>(std::lround(v)));
}

std::string LengthDist::ToString() const {
  std::ostringstream os;
  if (kind == Kind::kFixed) os << a;
  if (kind == Kind::kUniform) os << "uniform:" << a << ':' << b;
  if (kind == Kind::kNormal) os << "normal:" << a << ':' << b;
  return os.str();
}

std::string MakeText(int tokens, std::mt19937_64& rng, const TokenCounter& count_tokens) {
  // Draw more words than needed once, then only choose how many to keep: the
  // text stays a prefix of one random sequence, so the count is monotone in
  // the word count and a bisection converges.
  std::vector<int> ids(static_cast<size_t>(tokens) * 2 + 8);
  std::uniform_int_distribution<int> pick(0, kNumWords - 1);
  for (int& id : ids) id = pick(rng);
  size_t lo = 1, hi = ids.size();
  if (Count(count_tokens, Words(ids, hi)) < tokens) return Words(ids, hi);
  while (lo < hi) {  // smallest n with Count(n) >= tokens
    const size_t mid = (lo + hi) / 2;
    if (Count(count_tokens, Words(ids, mid)) >= tokens) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return Words(ids, lo);
}

namespace {

std::vector<Conversation> LoadFile(const WorkloadOptions& o, const TokenCounter& count,
                                   std::mt19937_64& rng) {
  std::ifstream in(o.file);
  if (!in) throw std::runtime_error("cannot open workload file " + o.file);
  std::vector<nlohmann::json> records;
  std::stringstream all;
  all << in.rdbuf();
  const std::string text = all.str();
  const size_t first = text.find_first_not_of(" \t\r\n");
  try {
    if (first != std::string::npos && text[first] == '[') {
      for (auto& r : nlohmann::json::parse(text)) records.push_back(std::move(r));
    } else {
      std::stringstream lines(text);
      for (std::string line; std::getline(lines, line);) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        records.push_back(nlohmann::json::parse(line));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("workload file " + o.file + ": " + e.what());
  }
  std::vector<Conversation> out;
  for (const auto& r : records) {
    Conversation c;
    c.id = static_cast<int>(out.size());
    if (r.contains("prompt") && r["prompt"].is_string()) {
      Turn t{r["prompt"].get<std::string>(), o.output.Sample(rng)};
      if (o.use_file_output_len && r.contains("max_tokens") && r["max_tokens"].is_number()) {
        t.max_tokens = r["max_tokens"].get<int>();
      }
      c.turns.push_back(std::move(t));
    } else if (r.contains("conversations") && r["conversations"].is_array()) {
      // ShareGPT: human turns become user turns; each following gpt reply
      // sizes that turn's output.
      for (const auto& m : r["conversations"]) {
        const std::string from = m.value("from", "");
        const std::string value = m.value("value", "");
        if (from == "system") {
          c.system = value;
        } else if (from == "human" || from == "user") {
          c.turns.push_back(Turn{value, o.output.Sample(rng)});
        } else if ((from == "gpt" || from == "assistant") && !c.turns.empty() &&
                   o.use_file_output_len) {
          c.turns.back().max_tokens = std::max(1, Count(count, value));
        }
      }
    }
    if (!c.turns.empty()) out.push_back(std::move(c));
    if (static_cast<int>(out.size()) >= o.num_conversations) break;
  }
  if (out.empty()) throw std::runtime_error("workload file " + o.file + " holds no prompts");
  return out;
}

}  // namespace

std::vector<Conversation> BuildWorkload(const WorkloadOptions& o, const TokenCounter& count) {
  std::mt19937_64 rng(o.seed);
  std::vector<Conversation> out;
  if (o.kind == "synthetic") {
    for (int i = 0; i < o.num_conversations; ++i) {
      const int in_len = o.input.Sample(rng);
      out.push_back(
          Conversation{i, "", {Turn{MakeText(in_len, rng, count), o.output.Sample(rng)}}});
    }
  } else if (o.kind == "shared-prefix") {
    std::vector<std::string> prefixes;
    for (int p = 0; p < o.num_prefixes; ++p) prefixes.push_back(MakeText(o.prefix_len, rng, count));
    for (int p = 0; p < o.num_prefixes; ++p) {
      for (int q = 0; q < o.questions_per_prefix; ++q) {
        // The question gets its own counter-free length: the prefix already
        // carries the BOS the tokenizer adds.
        const std::string question = MakeText(o.input.Sample(rng), rng, nullptr);
        out.push_back(
            Conversation{0, "", {Turn{prefixes[p] + "\n" + question, o.output.Sample(rng)}}});
      }
    }
    // Interleave prefixes in arrival order, as real traffic would.
    std::shuffle(out.begin(), out.end(), rng);
    for (size_t i = 0; i < out.size(); ++i) out[i].id = static_cast<int>(i);
  } else if (o.kind == "multi-turn") {
    for (int i = 0; i < o.num_conversations; ++i) {
      Conversation c{i, "", {}};
      for (int t = 0; t < o.turns; ++t) {
        c.turns.push_back(Turn{MakeText(o.input.Sample(rng), rng, count), o.output.Sample(rng)});
      }
      out.push_back(std::move(c));
    }
  } else if (o.kind == "file") {
    out = LoadFile(o, count, rng);
  } else {
    throw std::runtime_error("unknown workload '" + o.kind +
                             "' (synthetic, shared-prefix, multi-turn, file)");
  }
  return out;
}

}  // namespace kvserve::bench
