// GrammarSpec keys, the compile cache, and the xgrammar-backed compiler and
// matcher (see structured_output.h). Built without KVSERVE_WITH_XGRAMMAR,
// only the spec and cache parts exist and Create answers Unimplemented.
#include "grammar/structured_output.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

#if KVSERVE_WITH_XGRAMMAR
#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>
#endif

namespace kvserve {

const char* GrammarKindName(GrammarSpec::Kind k) {
  switch (k) {
    case GrammarSpec::Kind::kNone: return "none";
    case GrammarSpec::Kind::kJsonObject: return "json_object";
    case GrammarSpec::Kind::kJsonSchema: return "json_schema";
    case GrammarSpec::Kind::kRegex: return "regex";
    case GrammarSpec::Kind::kEbnf: return "grammar";
    case GrammarSpec::Kind::kChoice: return "choice";
    case GrammarSpec::Kind::kToolCall: return "tool_call";
    case GrammarSpec::Kind::kToolCallAuto: return "tool_call_auto";
  }
  return "";
}

std::string GrammarSpec::Key() const {
  if (kind == Kind::kNone) return "";
  // Length-prefixed, so no two specs serialise alike.
  std::string key = absl::StrCat(GrammarKindName(kind), "|", strict ? 1 : 0, "|", text.size(), ":",
                                 text, "|", choices.size());
  for (const std::string& c : choices) absl::StrAppend(&key, "|", c.size(), ":", c);
  return key;
}

int32_t TokenConstraint::ValidPrefix(absl::Span<const int32_t> draft) {
  int32_t n = 0;
  while (static_cast<size_t>(n) < draft.size() && !IsTerminated() &&
         Accept(draft[static_cast<size_t>(n)])) {
    ++n;
  }
  if (n > 0) Rollback(n);
  return n;
}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::Compile(
    const GrammarSpec& spec) {
  if (spec.empty()) return absl::InvalidArgumentError("no grammar to compile");
  const std::string key = spec.Key();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++hits_;
      return it->second->second;
    }
  }
  // Compiled outside the lock: two first requests of one schema may both
  // compile it; the second insert just replaces the first.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> compiled = CompileUncached(spec, key);
  if (!compiled.ok()) return compiled.status();
  std::lock_guard<std::mutex> lock(mu_);
  ++compiles_;
  auto it = index_.find(key);
  if (it != index_.end()) {
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.emplace_front(key, *compiled);
  index_[key] = lru_.begin();
  while (lru_.size() > cache_entries_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return *compiled;
}

int64_t GrammarCompiler::compiles() const {
  std::lock_guard<std::mutex> lock(mu_);
  return compiles_;
}

int64_t GrammarCompiler::cache_hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

#if KVSERVE_WITH_XGRAMMAR

namespace {

// A string literal of xgrammar's EBNF (C-style escapes).
std::string EbnfLiteral(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Per token: whether a grammar can never produce it (a control or unused
// token: no text, and not a stop token). Such tokens are refused before the
// matcher sees them (xgrammar logs a warning for each).
using NoText = std::vector<bool>;

class XgrConstraint final : public TokenConstraint {
 public:
  XgrConstraint(const xgrammar::CompiledGrammar& g, std::shared_ptr<const NoText> no_text)
      : matcher_(g), no_text_(std::move(no_text)) {}

  bool FillMask(absl::Span<uint32_t> words) override {
    int64_t shape[1] = {static_cast<int64_t>(words.size())};
    DLTensor t{};
    t.data = words.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLInt, 32, 1};
    t.shape = shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    return matcher_.FillNextTokenBitmask(&t);
  }
  bool Accept(int32_t token) override {
    if (token < 0 || static_cast<size_t>(token) >= no_text_->size()) return false;
    if ((*no_text_)[static_cast<size_t>(token)]) return false;
    return matcher_.AcceptToken(token);
  }
  void Rollback(int32_t n) override { matcher_.Rollback(n); }
  bool IsTerminated() const override { return matcher_.IsTerminated(); }

 private:
  xgrammar::GrammarMatcher matcher_;
  std::shared_ptr<const NoText> no_text_;
};

class XgrCompiled final : public CompiledGrammar {
 public:
  XgrCompiled(std::string key, xgrammar::CompiledGrammar g, std::shared_ptr<const NoText> no_text)
      : CompiledGrammar(std::move(key)), grammar_(std::move(g)), no_text_(std::move(no_text)) {}
  std::unique_ptr<TokenConstraint> NewConstraint() const override {
    return std::make_unique<XgrConstraint>(grammar_, no_text_);
  }

 private:
  xgrammar::CompiledGrammar grammar_;
  std::shared_ptr<const NoText> no_text_;
};

class XgrCompiler final : public GrammarCompiler {
 public:
  XgrCompiler(xgrammar::TokenizerInfo info, std::shared_ptr<const NoText> no_text,
              int32_t vocab_size, size_t cache_entries)
      : GrammarCompiler(vocab_size, cache_entries),
        no_text_(std::move(no_text)),
        // One thread per compile: the front ends' request threads compile
        // concurrently already; xgrammar's own cache is off (ours keys by spec).
        compiler_(info, /*max_threads=*/1, /*cache_enabled=*/false) {}

 protected:
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> CompileUncached(
      const GrammarSpec& spec, const std::string& key) override {
    try {
      return std::make_shared<XgrCompiled>(key, CompileSpec(spec), no_text_);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(GrammarKindName(spec.kind), " does not compile: ", Reason(e.what())));
    }
  }

 private:
  xgrammar::CompiledGrammar CompileSpec(const GrammarSpec& spec) {
    using K = GrammarSpec::Kind;
    switch (spec.kind) {
      case K::kJsonObject:
        // Compact JSON (no free whitespace: a small model given free
        // whitespace may pad forever).
        return compiler_.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false,
                                           std::nullopt, std::nullopt, /*strict_mode=*/false);
      case K::kJsonSchema:
        CheckSchemaText(spec.text);
        return compiler_.CompileJSONSchema(spec.text, /*any_whitespace=*/false, std::nullopt,
                                           std::nullopt, spec.strict);
      case K::kRegex:
        return compiler_.CompileRegex(spec.text);
      case K::kEbnf:
        return compiler_.CompileGrammar(spec.text, "root");
      case K::kChoice: {
        if (spec.choices.empty()) throw std::runtime_error("choice: no choices given");
        std::string ebnf = "root ::= ";
        for (size_t i = 0; i < spec.choices.size(); ++i) {
          if (spec.choices[i].empty()) throw std::runtime_error("choice: an empty choice");
          if (i > 0) ebnf += " | ";
          ebnf += EbnfLiteral(spec.choices[i]);
        }
        return compiler_.CompileGrammar(ebnf, "root");
      }
      case K::kToolCall:
        return compiler_.CompileGrammar(ToolCallGrammar(spec.text));
      case K::kToolCallAuto:
        return compiler_.CompileStructuralTag(ToolCallTriggers(spec.text));
      case K::kNone: break;
    }
    throw std::runtime_error("no grammar");
  }

  // xgrammar's message without its "[time] file.cc:line: " prefix.
  static std::string Reason(std::string what) {
    const size_t cc = what.find(".cc:");
    if (!what.empty() && what[0] == '[' && cc != std::string::npos) {
      const size_t colon = what.find(": ", cc + 4);
      if (colon != std::string::npos) what = what.substr(colon + 2);
    }
    while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
    return what;
  }

  static void CheckSchemaText(const std::string& text) {
    nlohmann::json s = nlohmann::json::parse(text, nullptr, false);
    if (s.is_discarded()) throw std::runtime_error("the schema is not valid JSON");
    if (!s.is_object() && !s.is_boolean()) {
      throw std::runtime_error("the schema must be a JSON object");
    }
  }

  // <tool_call>\n{"name": <one of the tools>, "arguments": <its parameters
  // schema>}\n</tool_call>: SmolLM2 / Hermes / Qwen's tool-call format.
  // xgrammar's triggered tags: any text until "<tool_call>", then
  // {"name": <a tool>, "arguments": <its parameters' JSON>}\n</tool_call>,
  // then any text again (the arguments compact like kJsonSchema's).
  std::string ToolCallTriggers(const std::string& tools_text) {
    nlohmann::ordered_json tools = nlohmann::ordered_json::parse(tools_text, nullptr, false);
    if (tools.is_discarded() || !tools.is_array() || tools.empty()) {
      throw std::runtime_error("tool_call: no tools");
    }
    nlohmann::ordered_json tags = nlohmann::ordered_json::array();
    for (const auto& t : tools) {
      nlohmann::ordered_json params = t.contains("parameters") && !t["parameters"].is_null()
                                          ? t["parameters"]
                                          : nlohmann::ordered_json{{"type", "object"}};
      if (!params.is_object()) throw std::runtime_error("tool_call: parameters must be an object");
      const bool strict = t.value("strict", false);
      const std::string args =
          xgrammar::Grammar::FromJSONSchema(params.dump(), /*any_whitespace=*/false, std::nullopt,
                                            std::nullopt, strict)
              .ToString();
      const std::string name = t.at("name").get<std::string>();
      tags.push_back({{"begin", "<tool_call>\n{\"name\": \"" + name + "\", \"arguments\": "},
                      {"content", {{"type", "grammar"}, {"grammar", args}}},
                      {"end", "}\n</tool_call>"}});
    }
    nlohmann::ordered_json st = {
        {"type", "structural_tag"},
        {"format", {{"type", "triggered_tags"}, {"triggers", {"<tool_call>"}}, {"tags", tags}}}};
    return st.dump();
  }

  xgrammar::Grammar ToolCallGrammar(const std::string& tools_text) {
    nlohmann::ordered_json tools = nlohmann::ordered_json::parse(tools_text, nullptr, false);
    if (tools.is_discarded() || !tools.is_array() || tools.empty()) {
      throw std::runtime_error("tool_call: no tools");
    }
    nlohmann::ordered_json any = nlohmann::ordered_json::array();
    for (const auto& t : tools) {
      nlohmann::ordered_json params = t.contains("parameters") && !t["parameters"].is_null()
                                          ? t["parameters"]
                                          : nlohmann::ordered_json{{"type", "object"}};
      if (!params.is_object()) throw std::runtime_error("tool_call: parameters must be an object");
      nlohmann::ordered_json call = {
          {"type", "object"},
          {"properties", {{"name", {{"const", t.at("name")}}}, {"arguments", params}}},
          {"required", {"name", "arguments"}},
          {"additionalProperties", false}};
      any.push_back(std::move(call));
    }
    const nlohmann::ordered_json schema =
        any.size() == 1 ? any[0] : nlohmann::ordered_json{{"anyOf", any}};
    xgrammar::Grammar body = xgrammar::Grammar::FromJSONSchema(
        schema.dump(), /*any_whitespace=*/false, std::nullopt, std::nullopt, /*strict_mode=*/true);
    return xgrammar::Grammar::Concat({xgrammar::Grammar::FromEBNF(R"(root ::= "<tool_call>\n")"),
                                      body,
                                      xgrammar::Grammar::FromEBNF(R"(root ::= "\n</tool_call>")")});
  }

  std::shared_ptr<const NoText> no_text_;
  xgrammar::GrammarCompiler compiler_;
};

}  // namespace

bool GrammarCompiler::Available() { return true; }
const char* GrammarCompiler::UnavailableReason() { return ""; }

absl::StatusOr<std::unique_ptr<GrammarCompiler>> GrammarCompiler::Create(
    const Tokenizer& tokenizer, int32_t vocab_size, size_t cache_entries) {
  if (vocab_size < tokenizer.vocab_size()) vocab_size = tokenizer.vocab_size();
  std::vector<std::string> vocab(static_cast<size_t>(vocab_size));
  std::vector<int32_t> stops;
  auto no_text = std::make_shared<NoText>(static_cast<size_t>(vocab_size), true);
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const bool stop = tokenizer.IsEndOfGeneration(id);
    if (stop) stops.push_back(id);
    // Control tokens stay "": never allowed as text (the detokenizer writes
    // nothing for them either).
    if (!tokenizer.IsControl(id)) vocab[static_cast<size_t>(id)] = tokenizer.TokenToBytes(id);
    (*no_text)[static_cast<size_t>(id)] = !stop && vocab[static_cast<size_t>(id)].empty();
  }
  if (stops.empty() && tokenizer.eos_id() >= 0) {
    stops.push_back(tokenizer.eos_id());
    (*no_text)[static_cast<size_t>(tokenizer.eos_id())] = false;
  }
  try {
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, vocab_size, stops,
                                 /*add_prefix_space=*/false);
    return std::unique_ptr<GrammarCompiler>(
        new XgrCompiler(std::move(info), std::move(no_text), vocab_size, cache_entries));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("grammar engine: the vocabulary: ", e.what()));
  }
}

#else  // !KVSERVE_WITH_XGRAMMAR

bool GrammarCompiler::Available() { return false; }
const char* GrammarCompiler::UnavailableReason() {
  return "structured outputs are not available in this build (xgrammar's sources were absent "
         "when it was configured; bash deploy/setup.sh fetches them)";
}

absl::StatusOr<std::unique_ptr<GrammarCompiler>> GrammarCompiler::Create(const Tokenizer&,
                                                                         int32_t, size_t) {
  return absl::UnimplementedError(UnavailableReason());
}

#endif

}  // namespace kvserve
