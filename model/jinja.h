// A small Jinja2 interpreter for chat templates (tokenizer.chat_template).
// It covers what the chat templates of the families kvserve serves use:
// text with whitespace control, {{ expressions }}, {% if/elif/else %},
// {% for %} (loop.index/index0/first/last/length, tuple targets, an `if`
// filter, else, break/continue), {% set %} (names and namespace
// attributes), comments, literals (strings, numbers, lists, dicts),
// arithmetic, comparisons, `in`, `~`, `and/or/not`, conditional
// expressions, slicing, attribute and item access, string and dict methods
// (strip, startswith, split, get, items, ...), the filters and tests chat
// templates use (trim, length, tojson, default, selectattr, `is defined`,
// `is string`, ...), and the functions raise_exception, namespace, range
// and strftime_now. The environment is Hugging Face's: trim_blocks and
// lstrip_blocks on, default Undefined, its tojson (no key sorting, no HTML
// escaping).
//
// Anything else (macros, includes, call blocks, unknown filters or tests)
// is refused at parse time with an InvalidArgument that names the
// construct and its line, so a template is either rendered exactly or not
// at all.
//
// Thread-safety: a parsed Template is immutable; Render is const and may be
// called from many threads at once.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve::jinja {

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python dicts

// A Jinja value. Arrays and objects are shared (templates do not mutate
// them, except namespace objects through {% set ns.x = ... %}).
class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };

  Value() = default;  // undefined
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.i_ = b ? 1 : 0;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Kind::kInt);
    v.i_ = i;
    return v;
  }
  static Value Float(double f) {
    Value v(Kind::kFloat);
    v.f_ = f;
    return v;
  }
  static Value String(std::string s) {
    Value v(Kind::kString);
    v.s_ = std::move(s);
    return v;
  }
  static Value MakeArray(Array a = {}) {
    Value v(Kind::kArray);
    v.a_ = std::make_shared<Array>(std::move(a));
    return v;
  }
  static Value MakeObject(Object o = {}) {
    Value v(Kind::kObject);
    v.o_ = std::make_shared<Object>(std::move(o));
    return v;
  }
  // A built-in function, called by name (raise_exception, namespace, ...).
  static Value Function(std::string name) {
    Value v(Kind::kFunction);
    v.s_ = std::move(name);
    return v;
  }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool as_bool() const { return i_ != 0; }
  // A float out of int64's range saturates (NaN gives 0): the cast alone is
  // undefined behaviour.
  int64_t as_int() const {
    if (kind_ != Kind::kFloat) return i_;
    if (f_ >= -9.2e18 && f_ <= 9.2e18) return static_cast<int64_t>(f_);
    return f_ > 0 ? INT64_MAX : f_ < 0 ? INT64_MIN : 0;
  }
  double as_float() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(i_); }
  const std::string& str() const { return s_; }
  const Array& array() const { return *a_; }
  const Object& object() const { return *o_; }
  Object& mutable_object() const { return *o_; }

  // Python truthiness.
  bool Truthy() const;
  // The object's value for `key`, or undefined.
  Value Get(const std::string& key) const;
  // Sets or adds `key` (objects only).
  void Set(const std::string& key, Value v) const;

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::kUndefined;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<Array> a_;
  std::shared_ptr<Object> o_;
};

// The variables a render sees (messages, add_generation_prompt, bos_token,
// ...) and the clock strftime_now reads.
struct Context {
  Object variables;
  // strftime_now formats this time (local time); 0: the current time.
  std::time_t now = 0;
};

class Template {
 public:
  // Parses `source`. InvalidArgument names an unsupported construct or a
  // syntax error, with its line.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const Template>> Parse(
      const std::string& source);
  ~Template();

  // Renders with `context`. raise_exception and run-time errors (undefined
  // attribute of an undefined value, a string added to a number, ...) are
  // InvalidArgument.
  [[nodiscard]] absl::StatusOr<std::string> Render(const Context& context) const;

  struct Node;  // the parsed statement tree (jinja.cc)

 private:
  Template() = default;
  std::vector<std::unique_ptr<Node>> body_;
};

// Python's repr-like text of a value as Jinja prints it ({{ v }}).
std::string ToText(const Value& v);
// Hugging Face's tojson: json.dumps(v, ensure_ascii=False, indent=indent).
std::string ToJson(const Value& v, int indent = -1);

}  // namespace kvserve::jinja
