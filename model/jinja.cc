#include "model/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/utf8.h"

namespace kvserve::jinja {

// ---------------------------------------------------------------------------
// Values

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return i_ != 0;
    case Kind::kFloat: return f_ != 0;
    case Kind::kString: return !s_.empty();
    case Kind::kArray: return !a_->empty();
    case Kind::kObject: return !o_->empty();
    case Kind::kFunction: return true;
  }
  return false;
}

Value Value::Get(const std::string& key) const {
  if (kind_ != Kind::kObject) return Value();
  for (const auto& [k, v] : *o_) {
    if (k == key) return v;
  }
  return Value();
}

void Value::Set(const std::string& key, Value v) const {
  if (kind_ != Kind::kObject) return;
  for (auto& [k, old] : *o_) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  o_->emplace_back(key, std::move(v));
}

namespace {

std::string PyFloat(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {  // shortest text that reads back exactly
    std::snprintf(buf, sizeof(buf), "%.*g", prec, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

std::string PyRepr(const Value& v);

std::string PyStrRepr(const std::string& s) {
  const char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  out += q;
  return out;
}

std::string PyRepr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString: return PyStrRepr(v.str());
    case Value::Kind::kArray: {
      std::vector<std::string> parts;
      for (const Value& e : v.array()) parts.push_back(PyRepr(e));
      return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
    }
    case Value::Kind::kObject: {
      std::vector<std::string> parts;
      for (const auto& [k, e] : v.object()) parts.push_back(absl::StrCat(PyStrRepr(k), ": ", PyRepr(e)));
      return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
    }
    default: return ToText(v);
  }
}

void JsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void Json(const Value& v, int indent, int depth, std::string* out) {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent) * d, ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
    case Value::Kind::kFunction: out->append("null"); return;
    case Value::Kind::kBool: out->append(v.as_bool() ? "true" : "false"); return;
    case Value::Kind::kInt: out->append(std::to_string(v.as_int())); return;
    case Value::Kind::kFloat: out->append(PyFloat(v.as_float())); return;
    case Value::Kind::kString: JsonString(v.str(), out); return;
    case Value::Kind::kArray: {
      if (v.array().empty()) {
        out->append("[]");
        return;
      }
      out->push_back('[');
      bool first = true;
      for (const Value& e : v.array()) {
        if (!first) out->append(indent < 0 ? ", " : ",");
        first = false;
        newline(depth + 1);
        Json(e, indent, depth + 1, out);
      }
      newline(depth);
      out->push_back(']');
      return;
    }
    case Value::Kind::kObject: {
      if (v.object().empty()) {
        out->append("{}");
        return;
      }
      out->push_back('{');
      bool first = true;
      for (const auto& [k, e] : v.object()) {
        if (!first) out->append(indent < 0 ? ", " : ",");
        first = false;
        newline(depth + 1);
        JsonString(k, out);
        out->append(": ");
        Json(e, indent, depth + 1, out);
      }
      newline(depth);
      out->push_back('}');
      return;
    }
  }
}

}  // namespace

std::string ToText(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat: return PyFloat(v.as_float());
    case Value::Kind::kString: return v.str();
    case Value::Kind::kFunction: return absl::StrCat("<function ", v.str(), ">");
    default: return PyRepr(v);
  }
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  Json(v, indent, 0, &out);
  return out;
}

// ---------------------------------------------------------------------------
// Lexer

namespace {

struct Token {
  enum Type { kText, kVarBegin, kBlockBegin, kEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Type type;
  std::string text;  // text, name, string value, operator
  int64_t i = 0;
  double f = 0;
  int line = 1;
};

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  explicit Lexer(const std::string& src) : src_(src) {}

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool strip_next = false;  // a "-" closed the previous tag
    while (pos <= src_.size()) {
      size_t at = FindTagStart(pos);
      std::string text = src_.substr(pos, (at == std::string::npos ? src_.size() : at) - pos);
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && IsSpace(text[k])) ++k;
        text.erase(0, k);
        strip_next = false;
      }
      if (at == std::string::npos) {
        Emit(Token::kText, text, pos);
        break;
      }
      const char kind = src_[at + 1];  // '{', '%' or '#'
      const char sign = at + 2 < src_.size() ? src_[at + 2] : 0;
      if (sign == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      } else if (kind != '{' && sign != '+') {
        // lstrip_blocks: spaces and tabs from the start of the line to a
        // block or comment tag go.
        const size_t nl = text.rfind('\n');
        const bool line_start = nl != std::string::npos || pos == 0 || src_[pos - 1] == '\n';
        const size_t from = nl == std::string::npos ? 0 : nl + 1;
        if (line_start && text.find_first_not_of(" \t", from) == std::string::npos) {
          text.erase(from);
        }
      }
      Emit(Token::kText, text, pos);
      size_t p = at + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) return Error("unclosed comment", at);
        strip_next = end > p && src_[end - 1] == '-';
        pos = end + 2;
        if (!strip_next) pos = TrimBlock(pos);
        continue;
      }
      Emit(kind == '{' ? Token::kVarBegin : Token::kBlockBegin, "", at);
      const char close = kind == '{' ? '}' : '%';
      // Expression tokens up to the closing "}}" / "%}" (outside brackets:
      // "{{ {'a': {'b': 1}} }}" closes a dict first, as jinja2's lexer
      // balances them).
      depth_ = 0;
      while (true) {
        while (p < src_.size() && IsSpace(src_[p])) ++p;
        if (p >= src_.size()) return Error("unclosed tag", at);
        if (depth_ > 0) {
          ASSIGN_OR_RETURN(p, LexOne(p));
          continue;
        }
        if (src_[p] == '-' && p + 2 < src_.size() && src_[p + 1] == close && src_[p + 2] == '}') {
          strip_next = true;
          p += 3;
          break;
        }
        if (src_[p] == close && p + 1 < src_.size() && src_[p + 1] == '}') {
          p += 2;
          if (kind == '%') p = TrimBlock(p);
          break;
        }
        ASSIGN_OR_RETURN(p, LexOne(p));
      }
      Emit(Token::kEnd, "", p);
      pos = p;
    }
    Emit(Token::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t pos) const {
    while (true) {
      const size_t at = src_.find('{', pos);
      if (at == std::string::npos || at + 1 >= src_.size()) return std::string::npos;
      const char c = src_[at + 1];
      if (c == '{' || c == '%' || c == '#') return at;
      pos = at + 1;
    }
  }
  // trim_blocks: the first newline after a block tag goes.
  size_t TrimBlock(size_t p) const {
    if (p < src_.size() && src_[p] == '\n') return p + 1;
    if (p + 1 < src_.size() && src_[p] == '\r' && src_[p + 1] == '\n') return p + 2;
    return p;
  }
  // Tokens come in source order, so the line count only moves forward.
  int LineOf(size_t pos) const {
    pos = std::min(pos, src_.size());
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    line_ += static_cast<int>(std::count(src_.begin() + line_pos_, src_.begin() + pos, '\n'));
    line_pos_ = pos;
    return line_;
  }
  absl::Status Error(const std::string& what, size_t pos) const {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", LineOf(pos), ": ", what));
  }
  void Emit(Token::Type t, std::string text, size_t pos) {
    if (t == Token::kText && text.empty()) return;
    Token tok;
    tok.type = t;
    tok.text = std::move(text);
    tok.line = LineOf(pos);
    tokens_.push_back(std::move(tok));
  }

  absl::StatusOr<size_t> LexOne(size_t p) {
    const char c = src_[p];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = p;
      while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      Emit(Token::kName, src_.substr(p, e - p), p);
      return e;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = p;
      while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      bool is_float = false;
      if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        is_float = true;
        ++e;
        while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
      }
      std::string num = src_.substr(p, e - p);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Token tok;
      tok.type = is_float ? Token::kFloat : Token::kInt;
      tok.text = num;
      tok.line = LineOf(p);
      if (is_float) {
        tok.f = std::strtod(num.c_str(), nullptr);
      } else {
        tok.i = std::strtoll(num.c_str(), nullptr, 10);
      }
      tokens_.push_back(std::move(tok));
      return e;
    }
    if (c == '\'' || c == '"') {
      std::string out;
      size_t e = p + 1;
      while (true) {
        if (e >= src_.size()) return Error("unterminated string literal", p);
        const char d = src_[e];
        if (d == c) break;
        if (d == '\\' && e + 1 < src_.size()) {
          const char x = src_[e + 1];
          e += 2;
          switch (x) {
            case 'n': out += '\n'; break;
            case 't': out += '\t'; break;
            case 'r': out += '\r'; break;
            case '0': out += '\0'; break;
            case '\n': break;  // a line continuation
            case 'x':
            case 'u':
            case 'U': {
              const size_t digits = x == 'x' ? 2 : x == 'u' ? 4 : 8;
              if (e + digits > src_.size()) return Error("bad escape in string literal", p);
              const uint32_t cp =
                  static_cast<uint32_t>(std::strtoul(src_.substr(e, digits).c_str(), nullptr, 16));
              AppendUtf8(cp, &out);
              e += digits;
              break;
            }
            case '\\':
            case '\'':
            case '"': out += x; break;
            default:  // Python keeps unknown escapes as written
              out += '\\';
              out += x;
          }
          continue;
        }
        out += d;
        ++e;
      }
      Emit(Token::kString, "", p);
      tokens_.back().text = std::move(out);
      return e + 1;
    }
    static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/",
                                       "%",  "~",  "<",  ">",  "|",  ".",  ",", ":", "(", ")",
                                       "[",  "]",  "{",  "}",  "="};
    for (const char* op : kOps) {
      const size_t n = std::strlen(op);
      if (src_.compare(p, n, op) == 0) {
        if (n == 1 && (*op == '(' || *op == '[' || *op == '{')) ++depth_;
        if (n == 1 && (*op == ')' || *op == ']' || *op == '}') && depth_ > 0) --depth_;
        Emit(Token::kOp, op, p);
        return p + n;
      }
    }
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"), p);
  }

  const std::string& src_;
  std::vector<Token> tokens_;
  mutable size_t line_pos_ = 0;
  mutable int line_ = 1;
  int depth_ = 0;  // open brackets in the current tag
};

}  // namespace

// ---------------------------------------------------------------------------
// Syntax tree

namespace {

struct Expr {
  enum Type {
    kLiteral, kName, kList, kDict, kAttr, kItem, kSlice, kCall, kFilter, kTest, kUnary, kBinary,
    kAnd, kOr, kNot, kCond, kTuple
  };
  Type type;
  Value literal;
  std::string name;  // name, attribute, filter, test, operator
  std::vector<std::unique_ptr<Expr>> args;  // operands / call arguments / list items
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  bool negated = false;  // `is not`, `not in`
  int line = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

}  // namespace

struct Template::Node {
  enum Type { kText, kOutput, kIf, kFor, kSet, kBreak, kContinue };
  Type type;
  std::string text;
  ExprPtr expr;  // output, set value, for iterable
  // if: (condition, body) per branch; a null condition is `else`.
  std::vector<std::pair<ExprPtr, std::vector<std::unique_ptr<Node>>>> branches;
  // for
  std::vector<std::string> targets;
  ExprPtr filter;
  std::vector<std::unique_ptr<Node>> body, else_body;
  // set: target name and optional namespace attribute
  std::string set_name, set_attr;
  int line = 0;
};

Template::~Template() = default;

namespace {

using Node = Template::Node;
using NodePtr = std::unique_ptr<Node>;

const std::set<std::string>& KnownFilters() {
  static const std::set<std::string> k = {
      "trim",  "length", "count",  "upper",      "lower", "tojson",     "string", "int",
      "float", "join",   "first",  "last",       "list",  "default",    "d",      "capitalize",
      "title", "replace", "selectattr", "rejectattr", "select", "reject", "map", "items", "safe",
      "abs", "reverse", "unique", "sum"};
  return k;
}
const std::set<std::string>& KnownTests() {
  static const std::set<std::string> k = {
      "defined", "undefined", "none",   "string", "number",  "integer", "float", "mapping",
      "iterable", "sequence", "boolean", "true",  "false",   "odd",     "even",  "callable",
      "equalto", "eq", "ne", "sameas", "in", "divisibleby", "lower", "upper", "gt", "lt", "ge", "le"};
  return k;
}

// Nesting deeper than this (parentheses, blocks) is refused rather than
// recursed into: a template from a model file must not overflow the stack.
constexpr int kMaxDepth = 256;
// Work per render: statements and expressions evaluated, and output bytes.
constexpr int64_t kMaxSteps = 1'000'000;  // real chat templates use thousands
constexpr size_t kMaxOutputBytes = 64u << 20;

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  absl::StatusOr<std::vector<NodePtr>> ParseTemplate() {
    std::string end;
    ASSIGN_OR_RETURN(auto body, ParseBody({}, &end));
    return body;
  }

 private:
  const Token& Peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& Next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool IsOp(const char* op, size_t k = 0) const {
    return Peek(k).type == Token::kOp && Peek(k).text == op;
  }
  bool IsName(const char* n, size_t k = 0) const {
    return Peek(k).type == Token::kName && Peek(k).text == n;
  }
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", Peek().line, ": ", what));
  }
  absl::Status Unsupported(const std::string& construct) const {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", Peek().line,
                                                   ": unsupported construct ", construct,
                                                   " (kvserve's Jinja subset)"));
  }
  absl::Status Expect(const char* op) {
    if (!IsOp(op)) return Error(absl::StrCat("expected '", op, "', got '", Peek().text, "'"));
    ++i_;
    return absl::OkStatus();
  }
  absl::Status ExpectEnd() {
    if (Peek().type != Token::kEnd) return Error(absl::StrCat("expected end of tag, got '", Peek().text, "'"));
    ++i_;
    return absl::OkStatus();
  }

  // Parses nodes until a block tag whose keyword is in `ends` (left
  // unconsumed after the keyword; *end gets the keyword).
  absl::StatusOr<std::vector<NodePtr>> ParseBody(const std::set<std::string>& ends, std::string* end) {
    DepthGuard guard(&depth_);
    if (depth_ > kMaxDepth) return Error("blocks nest too deeply");
    std::vector<NodePtr> out;
    while (true) {
      const Token& tok = Peek();
      if (tok.type == Token::kEof) {
        if (!ends.empty()) {
          std::string closer = *ends.begin();
          for (const std::string& e : ends) {
            if (e.rfind("end", 0) == 0) closer = e;
          }
          return Error(absl::StrCat("missing {% ", closer, " %}"));
        }
        return out;
      }
      if (tok.type == Token::kText) {
        auto n = std::make_unique<Node>();
        n->type = Node::kText;
        n->text = tok.text;
        out.push_back(std::move(n));
        ++i_;
        continue;
      }
      if (tok.type == Token::kVarBegin) {
        ++i_;
        auto n = std::make_unique<Node>();
        n->type = Node::kOutput;
        n->line = tok.line;
        ASSIGN_OR_RETURN(n->expr, ParseExpr());
        RETURN_IF_ERROR(ExpectEnd());
        out.push_back(std::move(n));
        continue;
      }
      if (tok.type != Token::kBlockBegin) return Error("unexpected token");
      ++i_;
      if (Peek().type != Token::kName) return Error("expected a statement keyword");
      const std::string kw = Peek().text;
      if (ends.count(kw)) {
        ++i_;
        *end = kw;
        return out;
      }
      ++i_;
      ASSIGN_OR_RETURN(NodePtr n, ParseStatement(kw));
      out.push_back(std::move(n));
    }
  }

  absl::StatusOr<NodePtr> ParseStatement(const std::string& kw) {
    auto n = std::make_unique<Node>();
    n->line = Peek().line;
    if (kw == "if") {
      n->type = Node::kIf;
      ASSIGN_OR_RETURN(ExprPtr cond, ParseExpr());
      RETURN_IF_ERROR(ExpectEnd());
      while (true) {
        std::string end;
        ASSIGN_OR_RETURN(auto body, ParseBody({"elif", "else", "endif"}, &end));
        n->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "endif") {
          RETURN_IF_ERROR(ExpectEnd());
          return n;
        }
        if (end == "else") {
          RETURN_IF_ERROR(ExpectEnd());
          ASSIGN_OR_RETURN(auto else_body, ParseBody({"endif"}, &end));
          RETURN_IF_ERROR(ExpectEnd());
          n->branches.emplace_back(nullptr, std::move(else_body));
          return n;
        }
        ASSIGN_OR_RETURN(cond, ParseExpr());  // elif
        RETURN_IF_ERROR(ExpectEnd());
      }
    }
    if (kw == "for") {
      n->type = Node::kFor;
      do {
        if (Peek().type != Token::kName) return Error("expected a loop variable");
        n->targets.push_back(Next().text);
      } while (IsOp(",") && (++i_, true));
      if (!IsName("in")) return Error("expected 'in' in for loop");
      ++i_;
      ASSIGN_OR_RETURN(n->expr, ParseOr(/*allow_cond=*/false));
      if (IsName("if")) {
        ++i_;
        ASSIGN_OR_RETURN(n->filter, ParseOr(false));
      }
      if (IsName("recursive")) return Unsupported("'for ... recursive'");
      RETURN_IF_ERROR(ExpectEnd());
      std::string end;
      ASSIGN_OR_RETURN(n->body, ParseBody({"else", "endfor"}, &end));
      RETURN_IF_ERROR(ExpectEnd());
      if (end == "else") {
        ASSIGN_OR_RETURN(n->else_body, ParseBody({"endfor"}, &end));
        RETURN_IF_ERROR(ExpectEnd());
      }
      return n;
    }
    if (kw == "set") {
      n->type = Node::kSet;
      if (Peek().type != Token::kName) return Error("expected a name after set");
      n->set_name = Next().text;
      if (IsOp(".")) {
        ++i_;
        if (Peek().type != Token::kName) return Error("expected an attribute name");
        n->set_attr = Next().text;
      }
      if (IsOp(",")) return Unsupported("'set' with several targets");
      if (Peek().type == Token::kEnd) return Unsupported("block 'set ... endset'");
      RETURN_IF_ERROR(Expect("="));
      ASSIGN_OR_RETURN(n->expr, ParseExpr());
      RETURN_IF_ERROR(ExpectEnd());
      return n;
    }
    if (kw == "break" || kw == "continue") {
      n->type = kw == "break" ? Node::kBreak : Node::kContinue;
      RETURN_IF_ERROR(ExpectEnd());
      return n;
    }
    --i_;
    return Unsupported(absl::StrCat("'{% ", kw, " %}'"));
  }

  absl::StatusOr<ExprPtr> ParseExpr() {
    ASSIGN_OR_RETURN(ExprPtr e, ParseOr(true));
    if (IsOp(",")) {  // a bare tuple
      auto t = Make(Expr::kTuple);
      t->args.push_back(std::move(e));
      while (IsOp(",")) {
        ++i_;
        ASSIGN_OR_RETURN(ExprPtr x, ParseOr(true));
        t->args.push_back(std::move(x));
      }
      return t;
    }
    return e;
  }

  ExprPtr Make(Expr::Type type) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = Peek().line;
    return e;
  }

  // or-expression, optionally followed by `if cond [else other]`.
  absl::StatusOr<ExprPtr> ParseOr(bool allow_cond) {
    ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      ++i_;
      ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      auto e = Make(Expr::kOr);
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
    if (allow_cond && IsName("if")) {
      ++i_;
      auto e = Make(Expr::kCond);
      ASSIGN_OR_RETURN(ExprPtr cond, ParseOr(false));
      e->args.push_back(std::move(cond));
      e->args.push_back(std::move(left));
      if (IsName("else")) {
        ++i_;
        ASSIGN_OR_RETURN(ExprPtr other, ParseOr(true));
        e->args.push_back(std::move(other));
      }
      return e;
    }
    return left;
  }
  absl::StatusOr<ExprPtr> ParseAnd() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      ++i_;
      ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      auto e = Make(Expr::kAnd);
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }
  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      ++i_;
      auto e = Make(Expr::kNot);
      ASSIGN_OR_RETURN(ExprPtr x, ParseNot());
      e->args.push_back(std::move(x));
      return e;
    }
    return ParseCompare();
  }
  absl::StatusOr<ExprPtr> ParseCompare() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (true) {
      std::string op;
      bool negated = false;
      if (Peek().type == Token::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == ">" ||
           Peek().text == "<=" || Peek().text == ">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        ++i_;
        op = "in";
      } else if (IsName("not") && IsName("in", 1)) {
        i_ += 2;
        op = "in";
        negated = true;
      } else {
        return left;
      }
      ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      auto e = Make(Expr::kBinary);
      e->name = op;
      e->negated = negated;
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
  }
  absl::StatusOr<ExprPtr> ParseBinaryLevel(const std::vector<std::string>& ops,
                                           const std::function<absl::StatusOr<ExprPtr>()>& next) {
    ASSIGN_OR_RETURN(ExprPtr left, next());
    while (Peek().type == Token::kOp &&
           std::find(ops.begin(), ops.end(), Peek().text) != ops.end()) {
      auto e = Make(Expr::kBinary);
      e->name = Next().text;
      ASSIGN_OR_RETURN(ExprPtr right, next());
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }
  absl::StatusOr<ExprPtr> ParseConcat() {
    return ParseBinaryLevel({"~"}, [this] { return ParseMath1(); });
  }
  absl::StatusOr<ExprPtr> ParseMath1() {
    return ParseBinaryLevel({"+", "-"}, [this] { return ParseMath2(); });
  }
  absl::StatusOr<ExprPtr> ParseMath2() {
    return ParseBinaryLevel({"*", "/", "//", "%"}, [this] { return ParsePow(); });
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    return ParseBinaryLevel({"**"}, [this] { return ParseUnary(true); });
  }
  struct DepthGuard {
    explicit DepthGuard(int* d) : depth(d) { ++*depth; }
    ~DepthGuard() { --*depth; }
    int* depth;
  };
  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    DepthGuard guard(&depth_);
    if (depth_ > kMaxDepth) return Error("expressions nest too deeply");
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      auto u = Make(Expr::kUnary);
      u->name = Next().text;
      ASSIGN_OR_RETURN(ExprPtr x, ParseUnary(false));
      u->args.push_back(std::move(x));
      e = std::move(u);
    } else {
      ASSIGN_OR_RETURN(e, ParsePrimary());
      ASSIGN_OR_RETURN(e, ParsePostfix(std::move(e)));
    }
    if (with_filter) return ParseFilterTest(std::move(e));
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token tok = Peek();
    switch (tok.type) {
      case Token::kString: {
        auto e = Make(Expr::kLiteral);
        std::string s;
        while (Peek().type == Token::kString) s += Next().text;  // adjacent literals join
        e->literal = Value::String(std::move(s));
        return e;
      }
      case Token::kInt: {
        ++i_;
        auto e = Make(Expr::kLiteral);
        e->literal = Value::Int(tok.i);
        return e;
      }
      case Token::kFloat: {
        ++i_;
        auto e = Make(Expr::kLiteral);
        e->literal = Value::Float(tok.f);
        return e;
      }
      case Token::kName: {
        ++i_;
        auto e = Make(Expr::kLiteral);
        if (tok.text == "true" || tok.text == "True") {
          e->literal = Value::Bool(true);
        } else if (tok.text == "false" || tok.text == "False") {
          e->literal = Value::Bool(false);
        } else if (tok.text == "none" || tok.text == "None") {
          e->literal = Value::None();
        } else {
          e->type = Expr::kName;
          e->name = tok.text;
        }
        return e;
      }
      case Token::kOp: {
        if (tok.text == "(") {
          ++i_;
          if (IsOp(")")) {
            ++i_;
            return Make(Expr::kTuple);
          }
          ASSIGN_OR_RETURN(ExprPtr e, ParseExpr());
          RETURN_IF_ERROR(Expect(")"));
          return e;
        }
        if (tok.text == "[") {
          ++i_;
          auto e = Make(Expr::kList);
          while (!IsOp("]")) {
            ASSIGN_OR_RETURN(ExprPtr x, ParseOr(true));
            e->args.push_back(std::move(x));
            if (!IsOp(",")) break;
            ++i_;
          }
          RETURN_IF_ERROR(Expect("]"));
          return e;
        }
        if (tok.text == "{") {
          ++i_;
          auto e = Make(Expr::kDict);
          while (!IsOp("}")) {
            ASSIGN_OR_RETURN(ExprPtr k, ParseOr(true));
            RETURN_IF_ERROR(Expect(":"));
            ASSIGN_OR_RETURN(ExprPtr v, ParseOr(true));
            e->args.push_back(std::move(k));
            e->args.push_back(std::move(v));
            if (!IsOp(",")) break;
            ++i_;
          }
          RETURN_IF_ERROR(Expect("}"));
          return e;
        }
        break;
      }
      default: break;
    }
    return Error(absl::StrCat("unexpected '", tok.text, "' in expression"));
  }

  absl::Status ParseArgs(Expr* call) {
    RETURN_IF_ERROR(Expect("("));
    while (!IsOp(")")) {
      if (Peek().type == Token::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        ++i_;
        ASSIGN_OR_RETURN(ExprPtr v, ParseOr(true));
        call->kwargs.emplace_back(std::move(key), std::move(v));
      } else {
        ASSIGN_OR_RETURN(ExprPtr v, ParseOr(true));
        call->args.push_back(std::move(v));
      }
      if (!IsOp(",")) break;
      ++i_;
    }
    return Expect(")");
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        ++i_;
        if (Peek().type != Token::kName && Peek().type != Token::kInt) {
          return Error("expected an attribute name after '.'");
        }
        auto a = Make(Expr::kAttr);
        a->name = Next().text;
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (IsOp("[")) {
        ++i_;
        // item or slice [a:b:c]
        ExprPtr parts[3];
        int colons = 0;
        for (int k = 0; k < 3; ++k) {
          if (!IsOp(":") && !IsOp("]")) {
            ASSIGN_OR_RETURN(parts[k], ParseOr(true));
          }
          if (IsOp(":") && k < 2) {
            ++i_;
            ++colons;
          } else {
            break;
          }
        }
        RETURN_IF_ERROR(Expect("]"));
        if (colons == 0) {
          if (parts[0] == nullptr) return Error("empty subscript");
          auto it = Make(Expr::kItem);
          it->args.push_back(std::move(e));
          it->args.push_back(std::move(parts[0]));
          e = std::move(it);
        } else {
          auto s = Make(Expr::kSlice);
          s->args.push_back(std::move(e));
          for (auto& p : parts) s->args.push_back(std::move(p));  // null: omitted
          e = std::move(s);
        }
      } else if (IsOp("(")) {
        auto c = Make(Expr::kCall);
        c->args.push_back(std::move(e));
        RETURN_IF_ERROR(ParseArgs(c.get()));
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFilterTest(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        ++i_;
        if (Peek().type != Token::kName) return Error("expected a filter name after '|'");
        const std::string name = Peek().text;
        if (!KnownFilters().count(name)) return Unsupported(absl::StrCat("filter '", name, "'"));
        ++i_;
        auto f = Make(Expr::kFilter);
        f->name = name;
        f->args.push_back(std::move(e));
        if (IsOp("(")) RETURN_IF_ERROR(ParseArgs(f.get()));
        e = std::move(f);
      } else if (IsName("is")) {
        ++i_;
        auto t = Make(Expr::kTest);
        if (IsName("not")) {
          ++i_;
          t->negated = true;
        }
        if (Peek().type != Token::kName) return Error("expected a test name after 'is'");
        std::string name = Next().text;
        if (name == "none" || name == "None") name = "none";
        if (name == "true" || name == "True") name = "true";
        if (name == "false" || name == "False") name = "false";
        if (!KnownTests().count(name)) {
          --i_;
          return Unsupported(absl::StrCat("test 'is ", name, "'"));
        }
        t->name = name;
        t->args.push_back(std::move(e));
        if (IsOp("(")) {
          RETURN_IF_ERROR(ParseArgs(t.get()));
        } else if (Peek().type == Token::kString || Peek().type == Token::kInt ||
                   Peek().type == Token::kFloat ||
                   (Peek().type == Token::kName && !IsName("and") && !IsName("or") &&
                    !IsName("if") && !IsName("else") && !IsName("is") && !IsName("in") &&
                    !IsName("not"))) {
          ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());  // `is divisibleby 3`
          t->args.push_back(std::move(arg));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------
// Evaluation

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const Context& ctx) : ctx_(ctx) { scopes_.emplace_back(); }

  absl::Status Exec(const std::vector<NodePtr>& body, std::string* out, Flow* flow) {
    for (const NodePtr& n : body) {
      RETURN_IF_ERROR(ExecNode(*n, out, flow));
      if (*flow != Flow::kNormal) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

 private:
  absl::Status ErrorAt(int line, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
  }

  absl::Status Spend(int line) {
    if (++steps_ > kMaxSteps) return ErrorAt(line, "template does too much work (step limit)");
    return absl::OkStatus();
  }

  absl::Status ExecNode(const Node& n, std::string* out, Flow* flow) {
    RETURN_IF_ERROR(Spend(n.line));
    if (out->size() > kMaxOutputBytes) return ErrorAt(n.line, "template output is too large");
    switch (n.type) {
      case Node::kText: out->append(n.text); return absl::OkStatus();
      case Node::kOutput: {
        ASSIGN_OR_RETURN(Value v, Eval(*n.expr));
        out->append(ToText(v));
        return absl::OkStatus();
      }
      case Node::kIf:
        for (const auto& [cond, body] : n.branches) {
          bool take = true;
          if (cond != nullptr) {
            ASSIGN_OR_RETURN(Value c, Eval(*cond));
            take = c.Truthy();
          }
          if (take) return Exec(body, out, flow);
        }
        return absl::OkStatus();
      case Node::kSet: {
        ASSIGN_OR_RETURN(Value v, Eval(*n.expr));
        if (n.set_attr.empty()) {
          Assign(n.set_name, std::move(v));
          return absl::OkStatus();
        }
        Value ns = Lookup(n.set_name);
        if (!ns.is_object()) {
          return ErrorAt(n.line, absl::StrCat("cannot set attribute of '", n.set_name,
                                              "': it is not a namespace"));
        }
        ns.Set(n.set_attr, std::move(v));
        return absl::OkStatus();
      }
      case Node::kBreak: *flow = Flow::kBreak; return absl::OkStatus();
      case Node::kContinue: *flow = Flow::kContinue; return absl::OkStatus();
      case Node::kFor: return ExecFor(n, out);
    }
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Node& n, std::string* out) {
    ASSIGN_OR_RETURN(Value seq, Eval(*n.expr));
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(seq, n.line));
    scopes_.emplace_back();
    if (n.filter != nullptr) {  // `for x in xs if cond`: loop.* counts the kept items
      std::vector<Value> kept;
      for (const Value& item : items) {
        RETURN_IF_ERROR(BindTargets(n, item));
        ASSIGN_OR_RETURN(Value c, Eval(*n.filter));
        if (c.Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      RETURN_IF_ERROR(Spend(n.line));
      RETURN_IF_ERROR(BindTargets(n, items[k]));
      Value loop = Value::MakeObject({{"index", Value::Int(k + 1)},
                                      {"index0", Value::Int(k)},
                                      {"revindex", Value::Int(len - k)},
                                      {"revindex0", Value::Int(len - k - 1)},
                                      {"first", Value::Bool(k == 0)},
                                      {"last", Value::Bool(k + 1 == len)},
                                      {"length", Value::Int(len)},
                                      {"previtem", k > 0 ? items[k - 1] : Value()},
                                      {"nextitem", k + 1 < len ? items[k + 1] : Value()}});
      scopes_.back()["loop"] = loop;
      Flow flow = Flow::kNormal;
      RETURN_IF_ERROR(Exec(n.body, out, &flow));
      if (flow == Flow::kBreak) break;
    }
    scopes_.pop_back();
    if (len == 0 && !n.else_body.empty()) {
      Flow flow = Flow::kNormal;
      RETURN_IF_ERROR(Exec(n.else_body, out, &flow));
    }
    return absl::OkStatus();
  }

  absl::Status BindTargets(const Node& n, const Value& item) {
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = item;
      return absl::OkStatus();
    }
    if (!item.is_array() || item.array().size() != n.targets.size()) {
      return ErrorAt(n.line, absl::StrCat("cannot unpack into ", n.targets.size(), " loop variables"));
    }
    for (size_t k = 0; k < n.targets.size(); ++k) scopes_.back()[n.targets[k]] = item.array()[k];
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<Value>> Iterate(const Value& v, int line) const {
    switch (v.kind()) {
      case Value::Kind::kUndefined:
      case Value::Kind::kNone:
        if (v.is_none()) return ErrorAt(line, "'NoneType' object is not iterable");
        return std::vector<Value>{};
      case Value::Kind::kArray: return v.array();
      case Value::Kind::kObject: {
        std::vector<Value> keys;
        for (const auto& [k, e] : v.object()) keys.push_back(Value::String(k));
        return keys;
      }
      case Value::Kind::kString: {
        std::vector<Value> chars;
        const std::string& s = v.str();
        for (size_t p = 0; p < s.size();) {
          size_t len = 1;
          const unsigned char b = s[p];
          if (b >= 0xF0) len = 4; else if (b >= 0xE0) len = 3; else if (b >= 0xC0) len = 2;
          len = std::min(len, s.size() - p);
          chars.push_back(Value::String(s.substr(p, len)));
          p += len;
        }
        return chars;
      }
      default: return ErrorAt(line, "value is not iterable");
    }
  }

  Value Lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    for (const auto& [k, v] : ctx_.variables) {
      if (k == name) return v;
    }
    if (name == "raise_exception" || name == "namespace" || name == "range" ||
        name == "strftime_now" || name == "dict") {
      return Value::Function(name);
    }
    return Value();
  }
  void Assign(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }

  absl::StatusOr<Value> Eval(const Expr& e) {
    RETURN_IF_ERROR(Spend(e.line));
    switch (e.type) {
      case Expr::kLiteral: return e.literal;
      case Expr::kName: return Lookup(e.name);
      case Expr::kList:
      case Expr::kTuple: {
        Array a;
        for (const ExprPtr& x : e.args) {
          ASSIGN_OR_RETURN(Value v, Eval(*x));
          a.push_back(std::move(v));
        }
        return Value::MakeArray(std::move(a));
      }
      case Expr::kDict: {
        Value d = Value::MakeObject();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          ASSIGN_OR_RETURN(Value key, Eval(*e.args[k]));
          ASSIGN_OR_RETURN(Value v, Eval(*e.args[k + 1]));
          d.Set(ToText(key), std::move(v));
        }
        return d;
      }
      case Expr::kAttr: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        return GetAttr(obj, e.name, e.line, Describe(*e.args[0]));
      }
      case Expr::kItem: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        ASSIGN_OR_RETURN(Value key, Eval(*e.args[1]));
        return GetItem(obj, key, e.line, Describe(*e.args[0]));
      }
      case Expr::kSlice: return EvalSlice(e);
      case Expr::kCall: return EvalCall(e);
      case Expr::kFilter: return EvalFilter(e);
      case Expr::kTest: {
        ASSIGN_OR_RETURN(bool r, EvalTest(e));
        return Value::Bool(r != e.negated);
      }
      case Expr::kUnary: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        if (!v.is_number()) return ErrorAt(e.line, "unary sign on a value that is not a number");
        if (e.name == "+") return v;
        if (v.kind() != Value::Kind::kInt) return Value::Float(-v.as_float());
        if (v.as_int() == std::numeric_limits<int64_t>::min()) {
          return ErrorAt(e.line, "integer overflow in unary '-'");
        }
        return Value::Int(-v.as_int());
      }
      case Expr::kNot: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        return Value::Bool(!v.Truthy());
      }
      case Expr::kAnd: {
        ASSIGN_OR_RETURN(Value l, Eval(*e.args[0]));
        if (!l.Truthy()) return l;
        return Eval(*e.args[1]);
      }
      case Expr::kOr: {
        ASSIGN_OR_RETURN(Value l, Eval(*e.args[0]));
        if (l.Truthy()) return l;
        return Eval(*e.args[1]);
      }
      case Expr::kCond: {
        ASSIGN_OR_RETURN(Value c, Eval(*e.args[0]));
        if (c.Truthy()) return Eval(*e.args[1]);
        if (e.args.size() > 2) return Eval(*e.args[2]);
        return Value();
      }
      case Expr::kBinary: return EvalBinary(e);
    }
    return Value();
  }

  static std::string Describe(const Expr& e) {
    if (e.type == Expr::kName) return e.name;
    if (e.type == Expr::kAttr) return absl::StrCat(Describe(*e.args[0]), ".", e.name);
    if (e.type == Expr::kItem && e.args[1]->type == Expr::kLiteral) {
      return absl::StrCat(Describe(*e.args[0]), "[", PyRepr(e.args[1]->literal), "]");
    }
    return "value";
  }

  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name, int line,
                                const std::string& what) const {
    if (obj.is_undefined()) return ErrorAt(line, absl::StrCat("'", what, "' is undefined"));
    if (obj.is_object()) return obj.Get(name);
    return Value();  // methods are resolved by calls; other attributes are undefined
  }

  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key, int line,
                                const std::string& what) const {
    if (obj.is_undefined()) return ErrorAt(line, absl::StrCat("'", what, "' is undefined"));
    if (obj.is_object()) return obj.Get(ToText(key));
    if ((obj.is_array() || obj.is_string()) && key.kind() == Value::Kind::kInt) {
      ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(obj, line));
      int64_t k = key.as_int();
      const int64_t n = static_cast<int64_t>(items.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value();  // jinja2: undefined
      return items[k];
    }
    return Value();
  }

  absl::StatusOr<Value> EvalSlice(const Expr& e) {
    ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
    std::optional<int64_t> idx[3];
    for (int k = 0; k < 3; ++k) {
      if (e.args[k + 1] == nullptr) continue;
      ASSIGN_OR_RETURN(Value v, Eval(*e.args[k + 1]));
      if (v.is_none()) continue;
      if (v.kind() != Value::Kind::kInt) return ErrorAt(e.line, "slice index is not an integer");
      idx[k] = v.as_int();
    }
    if (!obj.is_array() && !obj.is_string()) return ErrorAt(e.line, "only lists and strings can be sliced");
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(obj, e.line));
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t step = idx[2].value_or(1);
    if (step == 0) return ErrorAt(e.line, "slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t start = clamp(idx[0], step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(idx[1], step > 0 ? n : -1);
    Array picked;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) picked.push_back(items[k]);
    if (obj.is_string()) {
      std::string s;
      for (const Value& c : picked) s += c.str();
      return Value::String(std::move(s));
    }
    return Value::MakeArray(std::move(picked));
  }

  absl::StatusOr<std::vector<Value>> EvalArgs(const Expr& e, size_t first) {
    std::vector<Value> args;
    for (size_t k = first; k < e.args.size(); ++k) {
      ASSIGN_OR_RETURN(Value v, Eval(*e.args[k]));
      args.push_back(std::move(v));
    }
    return args;
  }
  absl::StatusOr<Value> Kwarg(const Expr& e, const std::string& name) {
    for (const auto& [k, v] : e.kwargs) {
      if (k == name) return Eval(*v);
    }
    return Value();
  }

  absl::StatusOr<Value> EvalCall(const Expr& e) {
    const Expr& callee = *e.args[0];
    if (callee.type == Expr::kAttr) {
      // A method of a string, dict or list.
      ASSIGN_OR_RETURN(Value self, Eval(*callee.args[0]));
      ASSIGN_OR_RETURN(std::vector<Value> args, EvalArgs(e, 1));
      return CallMethod(self, callee.name, args, e.line, Describe(*callee.args[0]));
    }
    ASSIGN_OR_RETURN(Value fn, Eval(callee));
    ASSIGN_OR_RETURN(std::vector<Value> args, EvalArgs(e, 1));
    if (fn.kind() != Value::Kind::kFunction) {
      return ErrorAt(e.line, absl::StrCat("'", Describe(callee), "' is not callable"));
    }
    const std::string& name = fn.str();
    if (name == "raise_exception") {
      return ErrorAt(e.line, absl::StrCat("raise_exception: ", args.empty() ? "" : ToText(args[0])));
    }
    if (name == "namespace" || name == "dict") {
      Value ns = Value::MakeObject();
      if (!args.empty() && args[0].is_object()) {
        for (const auto& [k, v] : args[0].object()) ns.Set(k, v);
      }
      for (const auto& [k, x] : e.kwargs) {
        ASSIGN_OR_RETURN(Value v, Eval(*x));
        ns.Set(k, std::move(v));
      }
      return ns;
    }
    if (name == "range") {
      int64_t start = 0, stop = 0, step = 1;
      for (const Value& a : args) {
        if (a.kind() != Value::Kind::kInt) return ErrorAt(e.line, "range() takes integers");
      }
      if (args.size() == 1) {
        stop = args[0].as_int();
      } else if (args.size() >= 2) {
        start = args[0].as_int();
        stop = args[1].as_int();
        if (args.size() > 2) step = args[2].as_int();
      }
      if (step == 0) return ErrorAt(e.line, "range() step cannot be zero");
      Array a;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        a.push_back(Value::Int(k));
        if (a.size() > 100000) return ErrorAt(e.line, "range() is too long");
        RETURN_IF_ERROR(Spend(e.line));
      }
      return Value::MakeArray(std::move(a));
    }
    if (name == "strftime_now") {
      const std::time_t now = ctx_.now != 0 ? ctx_.now : std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const std::string fmt = args.empty() ? "" : ToText(args[0]);
      const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::String(std::string(buf, n));
    }
    return ErrorAt(e.line, absl::StrCat("unknown function '", name, "'"));
  }

  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& m,
                                   const std::vector<Value>& args, int line,
                                   const std::string& what) {
    auto arg_str = [&](size_t k) { return k < args.size() ? ToText(args[k]) : std::string(); };
    if (self.is_string()) {
      const std::string& s = self.str();
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const std::string chars = args.empty() || args[0].is_none() ? " \t\n\r\f\v" : arg_str(0);
        size_t b = 0, en = s.size();
        if (m != "rstrip") while (b < en && chars.find(s[b]) != std::string::npos) ++b;
        if (m != "lstrip") while (en > b && chars.find(s[en - 1]) != std::string::npos) --en;
        return Value::String(s.substr(b, en - b));
      }
      if (m == "startswith") return Value::Bool(s.rfind(arg_str(0), 0) == 0);
      if (m == "endswith") {
        const std::string x = arg_str(0);
        return Value::Bool(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0);
      }
      if (m == "upper" || m == "lower") {
        std::string r = s;
        for (char& c : r) c = m == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                           : std::tolower(static_cast<unsigned char>(c));
        return Value::String(r);
      }
      if (m == "replace") {
        const std::string from = arg_str(0), to = arg_str(1);
        if (from.empty()) return self;
        std::string r;
        size_t p = 0;
        for (size_t q; (q = s.find(from, p)) != std::string::npos; p = q + from.size()) {
          r += s.substr(p, q - p);
          r += to;
        }
        r += s.substr(p);
        return Value::String(r);
      }
      if (m == "split") {
        Array parts;
        if (args.empty() || args[0].is_none()) {
          size_t p = 0;
          while (true) {
            while (p < s.size() && IsSpace(s[p])) ++p;
            if (p >= s.size()) break;
            size_t q = p;
            while (q < s.size() && !IsSpace(s[q])) ++q;
            parts.push_back(Value::String(s.substr(p, q - p)));
            p = q;
          }
        } else {
          const std::string sep = arg_str(0);
          if (sep.empty()) return ErrorAt(line, "split(): empty separator");
          size_t p = 0;
          for (size_t q; (q = s.find(sep, p)) != std::string::npos; p = q + sep.size()) {
            parts.push_back(Value::String(s.substr(p, q - p)));
          }
          parts.push_back(Value::String(s.substr(p)));
        }
        return Value::MakeArray(std::move(parts));
      }
      if (m == "find") return Value::Int(static_cast<int64_t>(s.find(arg_str(0))));
      if (m == "count") {
        const std::string x = arg_str(0);
        int64_t c = 0;
        if (!x.empty()) for (size_t p = 0; (p = s.find(x, p)) != std::string::npos; p += x.size()) ++c;
        return Value::Int(c);
      }
    }
    if (self.is_object()) {
      if (m == "get") {
        Value v = args.empty() ? Value() : self.Get(arg_str(0));
        if (v.is_undefined()) return args.size() > 1 ? args[1] : Value::None();
        return v;
      }
      if (m == "items" || m == "keys" || m == "values") {
        Array a;
        for (const auto& [k, v] : self.object()) {
          if (m == "items") a.push_back(Value::MakeArray({Value::String(k), v}));
          if (m == "keys") a.push_back(Value::String(k));
          if (m == "values") a.push_back(v);
        }
        return Value::MakeArray(std::move(a));
      }
    }
    if (self.is_undefined()) return ErrorAt(line, absl::StrCat("'", what, "' is undefined"));
    return ErrorAt(line, absl::StrCat("unsupported method '", m, "' (kvserve's Jinja subset)"));
  }

  static int64_t Length(const Value& v) {
    if (v.is_string()) {
      int64_t n = 0;
      for (unsigned char c : v.str()) n += (c & 0xC0) != 0x80;
      return n;
    }
    if (v.is_array()) return static_cast<int64_t>(v.array().size());
    if (v.is_object()) return static_cast<int64_t>(v.object().size());
    return 0;
  }

  static bool Equal(const Value& a, const Value& b) {
    if (a.is_number() && b.is_number()) return a.as_float() == b.as_float();
    if ((a.kind() == Value::Kind::kBool) != (b.kind() == Value::Kind::kBool)) {
      // Python: True == 1
      if (a.kind() == Value::Kind::kBool && b.is_number()) return a.as_int() == b.as_float();
      if (b.kind() == Value::Kind::kBool && a.is_number()) return b.as_int() == a.as_float();
      return false;
    }
    if (a.kind() != b.kind()) return false;
    switch (a.kind()) {
      case Value::Kind::kUndefined:
      case Value::Kind::kNone: return true;
      case Value::Kind::kBool: return a.as_bool() == b.as_bool();
      case Value::Kind::kString:
      case Value::Kind::kFunction: return a.str() == b.str();
      case Value::Kind::kArray: {
        if (a.array().size() != b.array().size()) return false;
        for (size_t k = 0; k < a.array().size(); ++k) {
          if (!Equal(a.array()[k], b.array()[k])) return false;
        }
        return true;
      }
      case Value::Kind::kObject: {
        if (a.object().size() != b.object().size()) return false;
        for (const auto& [k, v] : a.object()) {
          if (!Equal(v, b.Get(k))) return false;
        }
        return true;
      }
      default: return false;
    }
  }

  absl::StatusOr<bool> Less(const Value& a, const Value& b, int line) const {
    if (a.is_number() && b.is_number()) return a.as_float() < b.as_float();
    if ((a.is_number() || a.kind() == Value::Kind::kBool) &&
        (b.is_number() || b.kind() == Value::Kind::kBool)) {
      return a.as_float() < b.as_float();
    }
    if (a.is_string() && b.is_string()) return a.str() < b.str();
    return ErrorAt(line, "'<' between values that cannot be ordered");
  }

  absl::StatusOr<Value> EvalBinary(const Expr& e) {
    ASSIGN_OR_RETURN(Value l, Eval(*e.args[0]));
    ASSIGN_OR_RETURN(Value r, Eval(*e.args[1]));
    const std::string& op = e.name;
    if (op == "==") return Value::Bool(Equal(l, r));
    if (op == "!=") return Value::Bool(!Equal(l, r));
    if (op == "<") {
      ASSIGN_OR_RETURN(bool x, Less(l, r, e.line));
      return Value::Bool(x);
    }
    if (op == ">") {
      ASSIGN_OR_RETURN(bool x, Less(r, l, e.line));
      return Value::Bool(x);
    }
    if (op == "<=") {
      ASSIGN_OR_RETURN(bool x, Less(r, l, e.line));
      return Value::Bool(!x);
    }
    if (op == ">=") {
      ASSIGN_OR_RETURN(bool x, Less(l, r, e.line));
      return Value::Bool(!x);
    }
    if (op == "in") {
      bool found = false;
      if (r.is_string()) {
        if (!l.is_string()) return ErrorAt(e.line, "'in <string>' needs a string on the left");
        found = r.str().find(l.str()) != std::string::npos;
      } else if (r.is_array()) {
        for (const Value& x : r.array()) found = found || Equal(l, x);
      } else if (r.is_object()) {
        found = !r.Get(ToText(l)).is_undefined();
      } else if (r.is_undefined()) {
        return ErrorAt(e.line, absl::StrCat("'", Describe(*e.args[1]), "' is undefined"));
      } else {
        return ErrorAt(e.line, "'in' needs a string, list or mapping on the right");
      }
      return Value::Bool(found != e.negated);
    }
    auto too_long = [&](size_t n) { return n > kMaxOutputBytes; };
    if (op == "~") {
      std::string a = ToText(l), b = ToText(r);
      if (too_long(a.size() + b.size())) return ErrorAt(e.line, "string too long");
      return Value::String(a + b);
    }
    auto undefined_operand = [&]() -> absl::Status {
      const Expr& side = l.is_undefined() ? *e.args[0] : *e.args[1];
      return ErrorAt(e.line, absl::StrCat("'", Describe(side), "' is undefined"));
    };
    if (l.is_undefined() || r.is_undefined()) return undefined_operand();
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        if (too_long(l.str().size() + r.str().size())) return ErrorAt(e.line, "string too long");
        return Value::String(l.str() + r.str());
      }
      if (l.is_array() && r.is_array()) {
        if (too_long(l.array().size() + r.array().size())) return ErrorAt(e.line, "list too long");
        Array a = l.array();
        a.insert(a.end(), r.array().begin(), r.array().end());
        return Value::MakeArray(std::move(a));
      }
    }
    if (op == "*" && l.is_string() && r.kind() == Value::Kind::kInt) {
      std::string s;
      for (int64_t k = 0; k < r.as_int() && s.size() < (1 << 20); ++k) s += l.str();
      return Value::String(s);
    }
    const bool lnum = l.is_number() || l.kind() == Value::Kind::kBool;
    const bool rnum = r.is_number() || r.kind() == Value::Kind::kBool;
    if (!lnum || !rnum) {
      return ErrorAt(e.line, absl::StrCat("unsupported operand types for '", op, "'"));
    }
    const bool ints = l.kind() != Value::Kind::kFloat && r.kind() != Value::Kind::kFloat;
    const double a = l.as_float(), b = r.as_float();
    // Python's ints do not overflow; these are 64-bit, so an overflow is an
    // error naming the operator (found by the chat-template fuzzer).
    if (ints && (op == "+" || op == "-" || op == "*")) {
      int64_t out = 0;
      const int64_t x = l.as_int(), y = r.as_int();
      const bool over = op == "+"   ? __builtin_add_overflow(x, y, &out)
                        : op == "-" ? __builtin_sub_overflow(x, y, &out)
                                    : __builtin_mul_overflow(x, y, &out);
      if (over) return ErrorAt(e.line, absl::StrCat("integer overflow in '", op, "'"));
      return Value::Int(out);
    }
    if (op == "+") return Value::Float(a + b);
    if (op == "-") return Value::Float(a - b);
    if (op == "*") return Value::Float(a * b);
    if (b == 0 && (op == "/" || op == "//" || op == "%")) return ErrorAt(e.line, "division by zero");
    if (ints && (op == "//" || op == "%") && l.as_int() == std::numeric_limits<int64_t>::min() &&
        r.as_int() == -1) {
      return ErrorAt(e.line, absl::StrCat("integer overflow in '", op, "'"));
    }
    if (op == "/") return Value::Float(a / b);
    if (op == "//") {
      if (ints) {
        const int64_t x = l.as_int(), y = r.as_int();
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value::Int(q);
      }
      return Value::Float(std::floor(a / b));
    }
    if (op == "%") {
      if (ints) {
        const int64_t y = r.as_int();
        int64_t m = l.as_int() % y;
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return Value::Int(m);
      }
      double m = std::fmod(a, b);
      if (m != 0 && ((m < 0) != (b < 0))) m += b;
      return Value::Float(m);
    }
    if (op == "**") {
      if (ints && r.as_int() >= 0) {
        const double p = std::pow(a, b);
        if (!(std::fabs(p) < 9.2e18)) return ErrorAt(e.line, "integer overflow in '**'");
        return Value::Int(static_cast<int64_t>(p));
      }
      return Value::Float(std::pow(a, b));
    }
    return ErrorAt(e.line, absl::StrCat("unknown operator '", op, "'"));
  }

  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v,
                                 const std::vector<Value>& args, int line) const {
    using K = Value::Kind;
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind() == K::kInt;
    if (name == "float") return v.kind() == K::kFloat;
    if (name == "boolean") return v.kind() == K::kBool;
    if (name == "true") return v.kind() == K::kBool && v.as_bool();
    if (name == "false") return v.kind() == K::kBool && !v.as_bool();
    if (name == "mapping") return v.is_object();
    if (name == "iterable") return v.is_array() || v.is_object() || v.is_string() || v.is_undefined();
    if (name == "sequence") return v.is_array() || v.is_object() || v.is_string();
    if (name == "callable") return v.kind() == K::kFunction;
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      for (char c : v.str()) {
        if (name == "lower" ? std::isupper(static_cast<unsigned char>(c)) : std::islower(static_cast<unsigned char>(c))) return false;
      }
      return true;
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (v.kind() != K::kInt) return ErrorAt(line, absl::StrCat("'is ", name, "' on a value that is not an integer"));
      if (name == "divisibleby") {
        const int64_t d = args.empty() ? 0 : args[0].as_int();
        if (d == 0) return ErrorAt(line, "divisibleby 0");
        return v.as_int() % d == 0;
      }
      return (((v.as_int() % 2) + 2) % 2 == 1) == (name == "odd");
    }
    const Value arg = args.empty() ? Value() : args[0];
    if (name == "equalto" || name == "eq" || name == "sameas") return Equal(v, arg);
    if (name == "ne") return !Equal(v, arg);
    if (name == "in") {
      if (arg.is_array()) {
        for (const Value& x : arg.array()) if (Equal(v, x)) return true;
        return false;
      }
      if (arg.is_string() && v.is_string()) return arg.str().find(v.str()) != std::string::npos;
      if (arg.is_object()) return !arg.Get(ToText(v)).is_undefined();
      return false;
    }
    if (name == "gt") return Less(arg, v, line);
    if (name == "lt") return Less(v, arg, line);
    if (name == "ge") {
      ASSIGN_OR_RETURN(bool x, Less(v, arg, line));
      return !x;
    }
    if (name == "le") {
      ASSIGN_OR_RETURN(bool x, Less(arg, v, line));
      return !x;
    }
    return ErrorAt(line, absl::StrCat("unknown test '", name, "'"));
  }

  absl::StatusOr<bool> EvalTest(const Expr& e) {
    ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
    ASSIGN_OR_RETURN(std::vector<Value> args, EvalArgs(e, 1));
    return ApplyTest(e.name, v, args, e.line);
  }

  absl::StatusOr<Value> EvalFilter(const Expr& e) {
    ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
    ASSIGN_OR_RETURN(std::vector<Value> args, EvalArgs(e, 1));
    const std::string& f = e.name;
    const int line = e.line;
    if (f == "safe") return v;
    if (f == "trim") {
      if (v.is_undefined()) return Value::String("");
      return CallMethod(Value::String(ToText(v)), "strip", args, line, "value");
    }
    if (f == "length" || f == "count") return Value::Int(Length(v));
    if (f == "upper" || f == "lower") return CallMethod(Value::String(ToText(v)), f, {}, line, "value");
    if (f == "string") return Value::String(ToText(v));
    if (f == "capitalize" || f == "title") {
      std::string s = ToText(v);
      bool start = true;
      for (char& c : s) {
        const unsigned char u = static_cast<unsigned char>(c);
        if (f == "capitalize") {
          c = start ? std::toupper(u) : std::tolower(u);
          start = false;
        } else {
          c = start ? std::toupper(u) : std::tolower(u);
          start = !std::isalnum(u);
        }
      }
      return Value::String(s);
    }
    if (f == "replace") return CallMethod(Value::String(ToText(v)), "replace", args, line, "value");
    if (f == "tojson") {
      ASSIGN_OR_RETURN(Value indent, Kwarg(e, "indent"));
      if (indent.is_undefined() && !args.empty()) indent = args[0];
      return Value::String(ToJson(v, indent.kind() == Value::Kind::kInt ? indent.as_int() : -1));
    }
    if (f == "int") {
      if (v.is_number() || v.kind() == Value::Kind::kBool) return Value::Int(v.as_int());
      if (v.is_string()) {
        char* end = nullptr;
        const long long x = std::strtoll(v.str().c_str(), &end, 10);
        return Value::Int(end != v.str().c_str() ? x : 0);
      }
      return Value::Int(0);
    }
    if (f == "float") {
      if (v.is_number() || v.kind() == Value::Kind::kBool) return Value::Float(v.as_float());
      if (v.is_string()) return Value::Float(std::strtod(v.str().c_str(), nullptr));
      return Value::Float(0);
    }
    if (f == "abs") {
      if (!v.is_number()) return ErrorAt(line, "abs of a value that is not a number");
      return v.kind() == Value::Kind::kInt ? Value::Int(std::llabs(v.as_int())) : Value::Float(std::fabs(v.as_float()));
    }
    if (f == "default" || f == "d") {
      const bool boolean = args.size() > 1 && args[1].Truthy();
      if (v.is_undefined() || (boolean && !v.Truthy())) return args.empty() ? Value::String("") : args[0];
      return v;
    }
    if (f == "items") return CallMethod(v, "items", {}, line, Describe(*e.args[0]));
    // Filters over sequences.
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
    if (f == "list") return Value::MakeArray(items);
    if (f == "first") return items.empty() ? Value() : items.front();
    if (f == "last") return items.empty() ? Value() : items.back();
    if (f == "reverse") {
      if (v.is_string()) {
        std::string s;
        for (auto it = items.rbegin(); it != items.rend(); ++it) s += it->str();
        return Value::String(s);
      }
      std::reverse(items.begin(), items.end());
      return Value::MakeArray(items);
    }
    if (f == "join") {
      std::string sep = args.empty() ? "" : ToText(args[0]);
      std::vector<std::string> parts;
      for (const Value& x : items) parts.push_back(ToText(x));
      return Value::String(absl::StrJoin(parts, sep));
    }
    if (f == "unique") {
      Array out;
      for (const Value& x : items) {
        bool seen = false;
        for (const Value& y : out) seen = seen || Equal(x, y);
        if (!seen) out.push_back(x);
      }
      return Value::MakeArray(std::move(out));
    }
    if (f == "sum") {
      Value acc = Value::Int(0);
      for (const Value& x : items) {
        if (!x.is_number()) return ErrorAt(line, "sum of values that are not numbers");
        acc = (acc.kind() == Value::Kind::kInt && x.kind() == Value::Kind::kInt)
                  ? Value::Int(acc.as_int() + x.as_int())
                  : Value::Float(acc.as_float() + x.as_float());
      }
      return acc;
    }
    if (f == "map") {
      ASSIGN_OR_RETURN(Value attr, Kwarg(e, "attribute"));
      Array out;
      if (!attr.is_undefined()) {
        for (const Value& x : items) out.push_back(x.Get(ToText(attr)));
        return Value::MakeArray(std::move(out));
      }
      if (args.empty() || !args[0].is_string()) return ErrorAt(line, "map needs a filter name or attribute=");
      return ErrorAt(line, absl::StrCat("unsupported construct map('", args[0].str(), "') (kvserve's Jinja subset)"));
    }
    if (f == "select" || f == "reject") {
      Array out;
      for (const Value& x : items) {
        bool keep;
        if (args.empty()) {
          keep = x.Truthy();
        } else {
          const std::string test = ToText(args[0]);
          if (!KnownTests().count(test)) return ErrorAt(line, absl::StrCat("unsupported construct test '", test, "'"));
          ASSIGN_OR_RETURN(keep, ApplyTest(test, x, {args.begin() + 1, args.end()}, line));
        }
        if (keep == (f == "select")) out.push_back(x);
      }
      return Value::MakeArray(std::move(out));
    }
    if (f == "selectattr" || f == "rejectattr") {
      if (args.empty()) return ErrorAt(line, absl::StrCat(f, " needs an attribute name"));
      const std::string attr = ToText(args[0]);
      Array out;
      for (const Value& x : items) {
        const Value a = x.is_object() ? x.Get(attr) : Value();
        bool keep;
        if (args.size() == 1) {
          keep = a.Truthy();
        } else {
          const std::string test = ToText(args[1]);
          if (!KnownTests().count(test)) return ErrorAt(line, absl::StrCat("unsupported construct test '", test, "'"));
          ASSIGN_OR_RETURN(keep, ApplyTest(test, a, {args.begin() + 2, args.end()}, line));
        }
        if (keep == (f == "selectattr")) out.push_back(x);
      }
      return Value::MakeArray(std::move(out));
    }
    return ErrorAt(line, absl::StrCat("unsupported construct filter '", f, "' (kvserve's Jinja subset)"));
  }

  const Context& ctx_;
  std::vector<std::map<std::string, Value>> scopes_;
  int64_t steps_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Template>> Template::Parse(const std::string& source) {
  Lexer lexer(source);
  ASSIGN_OR_RETURN(std::vector<Token> tokens, lexer.Run());
  Parser parser(std::move(tokens));
  ASSIGN_OR_RETURN(auto body, parser.ParseTemplate());
  std::shared_ptr<Template> t(new Template());
  t->body_ = std::move(body);
  return std::shared_ptr<const Template>(std::move(t));
}

absl::StatusOr<std::string> Template::Render(const Context& context) const {
  Renderer r(context);
  std::string out;
  Flow flow = Flow::kNormal;
  RETURN_IF_ERROR(r.Exec(body_, &out, &flow));
  return out;
}

}  // namespace kvserve::jinja
