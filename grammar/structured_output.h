// Grammar-constrained decoding for structured outputs and forced tool calls
// (issue 44): what a request constrains its output to (GrammarSpec), the
// grammar compiled against the served tokenizer (CompiledGrammar, shared by
// every request with the same spec), and the per-sample matcher the engine
// consults at each step (TokenConstraint): the bitmask of tokens the grammar
// allows next, applied to the logits before sampling, and the token sampled,
// accepted after. The engine of the grammars is xgrammar's C++ core
// (Apache-2.0), built from its PyPI sdist by grammar/CMakeLists.txt; without
// it GrammarCompiler::Create answers Unimplemented and the front ends refuse
// the fields that ask for a grammar.
//
// Thread-safety: GrammarCompiler is thread-safe (the front ends compile on
// their request threads; compiled grammars are cached by spec). A
// CompiledGrammar is immutable and shared. A TokenConstraint belongs to one
// sequence on the engine thread; not thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvserve {

class Tokenizer;

// What the output must match.
struct GrammarSpec {
  enum class Kind {
    kNone,
    kJsonObject,  // any JSON object (response_format json_object)
    kJsonSchema,  // text: a JSON schema (response_format json_schema, structured_outputs.json)
    kRegex,       // text: a regular expression (structured_outputs.regex)
    kEbnf,        // text: an EBNF grammar, root rule `root` (structured_outputs.grammar)
    kChoice,      // choices: exactly one of these strings (structured_outputs.choice)
    kToolCall,    // text: a JSON array of {"name", "parameters"}: one Hermes
                  // <tool_call>{"name", "arguments"}</tool_call> of one of them
    kToolCallAuto,  // text: a JSON array of {"name", "parameters", "strict"}:
                    // free text, but each <tool_call> block the model opens is
                    // a call of one of them with valid arguments (strict tools
                    // under tool_choice auto)
  };
  Kind kind = Kind::kNone;
  std::string text;
  std::vector<std::string> choices;
  // json_schema: additionalProperties defaults to false where the schema
  // does not say (xgrammar's strict mode); off, the schema's own default.
  bool strict = true;

  bool empty() const { return kind == Kind::kNone; }
  // A canonical serialisation: the compile cache's key and the part of the
  // response cache's key that the grammar contributes. "" for kNone.
  std::string Key() const;
};
const char* GrammarKindName(GrammarSpec::Kind k);

class TokenConstraint;

// A grammar compiled for the served vocabulary. Opaque; immutable.
class CompiledGrammar {
 public:
  virtual ~CompiledGrammar() = default;
  const std::string& key() const { return key_; }
  // A fresh matcher at the grammar's start.
  virtual std::unique_ptr<TokenConstraint> NewConstraint() const = 0;

 protected:
  explicit CompiledGrammar(std::string key) : key_(std::move(key)) {}

 private:
  std::string key_;
};

// One sample's position in its grammar.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Writes the tokens the grammar allows next into `words` (bit i of word
  // i / 32 set: token i allowed), ceil(vocab_size / 32) words. Returns false
  // when every token is allowed (the mask need not be applied).
  virtual bool FillMask(absl::Span<uint32_t> words) = 0;
  // Advances over `token`; false (and no change) when the grammar does not
  // allow it. A stop token is accepted only where the grammar may end; then
  // the constraint is terminated.
  virtual bool Accept(int32_t token) = 0;
  // Undoes the last `n` accepted tokens.
  virtual void Rollback(int32_t n) = 0;
  virtual bool IsTerminated() const = 0;
  // How many leading tokens of `draft` the grammar accepts from here (the
  // state is unchanged afterwards): a draft is cut there before it is
  // verified.
  int32_t ValidPrefix(absl::Span<const int32_t> draft);
};

// Words of a mask over `vocab_size` tokens.
inline size_t MaskWords(int32_t vocab_size) {
  return static_cast<size_t>((vocab_size + 31) / 32);
}
inline bool MaskAllows(absl::Span<const uint32_t> words, int32_t token) {
  return (words[static_cast<size_t>(token) / 32] >> (static_cast<uint32_t>(token) % 32)) & 1u;
}

class GrammarCompiler {
 public:
  // Whether this build has the grammar engine (xgrammar's sdist was present).
  static bool Available();
  // Why not, for the refusals ("" when Available()).
  static const char* UnavailableReason();

  // The vocabulary as xgrammar sees it: each token's output bytes
  // (Tokenizer::TokenToBytes; control tokens are empty and never allowed),
  // `vocab_size` entries (the model's logit count, which may exceed the
  // tokenizer's), and the end-of-generation tokens as the stop tokens.
  // Unimplemented without the grammar engine.
  static absl::StatusOr<std::unique_ptr<GrammarCompiler>> Create(const Tokenizer& tokenizer,
                                                                 int32_t vocab_size,
                                                                 size_t cache_entries = 64);
  virtual ~GrammarCompiler() = default;

  // The compiled grammar of `spec`, from the cache when an identical spec
  // was compiled before (agent turns resend the same schema). A schema,
  // regex or grammar that does not compile is InvalidArgument saying why.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Compile(const GrammarSpec& spec);

  int32_t vocab_size() const { return vocab_size_; }
  int64_t compiles() const;     // cache misses that compiled
  int64_t cache_hits() const;

 protected:
  GrammarCompiler(int32_t vocab_size, size_t cache_entries)
      : vocab_size_(vocab_size), cache_entries_(cache_entries) {}
  virtual absl::StatusOr<std::shared_ptr<const CompiledGrammar>> CompileUncached(
      const GrammarSpec& spec, const std::string& key) = 0;

 private:
  int32_t vocab_size_;
  size_t cache_entries_;
  mutable std::mutex mu_;
  // LRU: most recent first.
  std::list<std::pair<std::string, std::shared_ptr<const CompiledGrammar>>> lru_;
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
  int64_t compiles_ = 0;
  int64_t hits_ = 0;
};

}  // namespace kvserve
