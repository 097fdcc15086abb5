#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace kvserve {

namespace {

// This absl build has its own string_view type, which does not accept
// std::string_view (the public API's type); Cat converts those arguments.
template <typename T>
decltype(auto) CatArg(const T& v) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return absl::string_view(v.data(), v.size());
  } else {
    return (v);
  }
}

template <typename... T>
std::string Cat(const T&... args) {
  return absl::StrCat(CatArg(args)...);
}

}  // namespace

const char* GgmlTypeName(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return "F32";
    case GgmlType::kF16:
      return "F16";
    case GgmlType::kQ4_0:
      return "Q4_0";
    case GgmlType::kQ4_1:
      return "Q4_1";
    case GgmlType::kQ8_0:
      return "Q8_0";
    case GgmlType::kBF16:
      return "BF16";
    case GgmlType::kQ5_0:
      return "Q5_0";
    case GgmlType::kQ5_1:
      return "Q5_1";
    case GgmlType::kQ2_K:
      return "Q2_K";
    case GgmlType::kQ3_K:
      return "Q3_K";
    case GgmlType::kQ4_K:
      return "Q4_K";
    case GgmlType::kQ5_K:
      return "Q5_K";
    case GgmlType::kQ6_K:
      return "Q6_K";
    case GgmlType::kIQ4_NL:
      return "IQ4_NL";
    case GgmlType::kIQ4_XS:
      return "IQ4_XS";
  }
  return "unknown";
}

const char* GgmlTypeIdName(uint32_t id) {
  // ggml's type table (ggml.h enum ggml_type); gaps are ids ggml retired.
  static constexpr const char* kNames[] = {
      "F32",     "F16",    "Q4_0",   "Q4_1",   "Q4_2",   "Q4_3",    "Q5_0",     "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",   "Q3_K",   "Q4_K",   "Q5_K",    "Q6_K",     "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",   "IQ2_S",    "IQ4_XS",
      "I8",      "I16",    "I32",    "I64",    "F64",    "IQ1_M",   "BF16",     "Q4_0_4_4",
      "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8",
      "MXFP4",   "NVFP4",  "Q1_0"};
  return id < sizeof(kNames) / sizeof(kNames[0]) ? kNames[id] : "unknown";
}

const std::vector<GgmlType>& AllGgmlTypes() {
  static const std::vector<GgmlType> kAll = {
      GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ8_0,   GgmlType::kQ4_0,
      GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ2_K,   GgmlType::kQ3_K,
      GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS};
  return kAll;
}

int64_t GgmlBlockElems(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return 1;
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
    case GgmlType::kIQ4_NL:
      return 32;
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_XS:
      return 256;
  }
  return 0;
}

int64_t GgmlBlockBytes(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return 4;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return 2;
    case GgmlType::kQ4_0:
      return 18;
    case GgmlType::kQ4_1:
      return 20;
    case GgmlType::kQ8_0:
      return 34;
    case GgmlType::kQ5_0:
      return 22;
    case GgmlType::kQ5_1:
      return 24;
    case GgmlType::kIQ4_NL:
      return 18;
    case GgmlType::kQ2_K:
      return 84;
    case GgmlType::kQ3_K:
      return 110;
    case GgmlType::kQ4_K:
      return 144;
    case GgmlType::kQ5_K:
      return 176;
    case GgmlType::kQ6_K:
      return 210;
    case GgmlType::kIQ4_XS:
      return 136;
  }
  return 0;
}

int64_t GgmlRowBytes(GgmlType t, int64_t n) {
  const int64_t elems = GgmlBlockElems(t);
  return elems == 0 ? 0 : n / elems * GgmlBlockBytes(t);
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // the reader has checked this cannot overflow
  return n;
}

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Nested arrays recurse; a crafted file could nest millions deep and blow the
// stack, and no real file nests more than once.
constexpr int kMaxArrayDepth = 8;

const char* ValueTypeName(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

bool IsKnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

bool IsKnownTensorType(uint32_t t) {
  for (GgmlType known : AllGgmlTypes()) {
    if (static_cast<uint32_t>(known) == t) return true;
  }
  return false;
}

std::string SupportedTypeNames() {
  std::string out;
  for (GgmlType t : AllGgmlTypes()) {
    if (!out.empty()) out += ", ";
    out += GgmlTypeName(t);
  }
  return out;
}

// Size in bytes of a fixed-size value type; 0 for string and array.
uint64_t FixedSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

// Fewest bytes one element of type `t` can occupy: bounds a declared count by
// the bytes left, so a lying count cannot make us allocate gigabytes.
uint64_t MinEncodedSize(GgufValueType t) {
  if (t == GgufValueType::kString) return 8;  // u64 length
  if (t == GgufValueType::kArray) return 12;  // u32 type + u64 count
  return FixedSize(t);
}

bool IsInteger(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsSigned(GgufValueType t) {
  return t == GgufValueType::kInt8 || t == GgufValueType::kInt16 || t == GgufValueType::kInt32 ||
         t == GgufValueType::kInt64;
}

template <typename T>
T LoadLe(const uint8_t* p) {
  // Host is little-endian (x86-64/aarch64 Linux), as is the file.
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// An integer of any stored width, widened without losing the sign.
struct WideInt {
  bool negative = false;
  uint64_t magnitude = 0;  // two's complement reinterpretation when negative
  int64_t as_signed = 0;
};

WideInt LoadInteger(GgufValueType t, const uint8_t* p) {
  WideInt w;
  int64_t s = 0;
  uint64_t u = 0;
  switch (t) {
    case GgufValueType::kUint8:
      u = LoadLe<uint8_t>(p);
      break;
    case GgufValueType::kInt8:
      s = LoadLe<int8_t>(p);
      break;
    case GgufValueType::kUint16:
      u = LoadLe<uint16_t>(p);
      break;
    case GgufValueType::kInt16:
      s = LoadLe<int16_t>(p);
      break;
    case GgufValueType::kUint32:
      u = LoadLe<uint32_t>(p);
      break;
    case GgufValueType::kInt32:
      s = LoadLe<int32_t>(p);
      break;
    case GgufValueType::kUint64:
      u = LoadLe<uint64_t>(p);
      break;
    case GgufValueType::kInt64:
      s = LoadLe<int64_t>(p);
      break;
    default:
      break;
  }
  if (IsSigned(t)) {
    w.negative = s < 0;
    w.as_signed = s;
    w.magnitude = static_cast<uint64_t>(s);
  } else {
    w.magnitude = u;
    w.as_signed = static_cast<int64_t>(u);  // only meaningful when u <= INT64_MAX
  }
  return w;
}

double LoadFloat(GgufValueType t, const uint8_t* p) {
  return t == GgufValueType::kFloat32 ? LoadLe<float>(p) : LoadLe<double>(p);
}

// Bounds-checked little-endian reader over the whole file. Every read checks
// the remaining length first; errors carry the offset and what was being read.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  absl::Status Need(uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      return absl::InvalidArgumentError(Cat("truncated file: ", what, " needs ", n,
                                            " bytes at offset ", pos_, " but only ", remaining(),
                                            " remain"));
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::StatusOr<T> Read(std::string_view what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v = LoadLe<T>(data_ + pos_);
    pos_ += sizeof(T);
    return v;
  }

  // Returns a pointer to `n` bytes and advances past them.
  absl::StatusOr<const uint8_t*> Take(uint64_t n, std::string_view what) {
    RETURN_IF_ERROR(Need(n, what));
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }

  absl::StatusOr<std::string_view> ReadString(std::string_view what) {
    const size_t start = pos_;
    ASSIGN_OR_RETURN(uint64_t len, Read<uint64_t>(Cat(what, " length")));
    if (len > remaining()) {
      return absl::InvalidArgumentError(Cat("string length ", len, " of ", what, " at offset ",
                                            start, " runs past the end of the file (", remaining(),
                                            " bytes remain)"));
    }
    const char* p = reinterpret_cast<const char*>(data_ + pos_);
    pos_ += len;
    return std::string_view(p, len);
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return Cat("{", absl::StrJoin(shape, ", "), "}");
}

// A parsed metadata value. Strings and numeric array payloads stay in the
// mapping (views), so even a 49k-entry vocabulary costs one vector of views.
struct ParsedValue {
  GgufValueType type = GgufValueType::kUint8;
  const uint8_t* scalar = nullptr;  // fixed-size scalars: the encoded bytes
  std::string_view str;             // kString
  // kArray:
  GgufValueType elem_type = GgufValueType::kUint8;
  uint64_t count = 0;
  const uint8_t* elems = nullptr;         // fixed-size element payload
  std::vector<std::string_view> strings;  // string elements
};

// Parses one value of type `type` at the cursor into `out`; `out` is null for
// the elements of nested arrays, which are validated and skipped because no
// getter exposes them.
absl::Status ParseValue(Cursor& c, GgufValueType type, int depth, std::string_view key,
                        ParsedValue* out) {
  if (out != nullptr) out->type = type;
  if (const uint64_t size = FixedSize(type); size != 0) {
    ASSIGN_OR_RETURN(const uint8_t* p, c.Take(size, Cat("value of key '", key, "'")));
    if (out != nullptr) out->scalar = p;
    return absl::OkStatus();
  }
  if (type == GgufValueType::kString) {
    ASSIGN_OR_RETURN(std::string_view s, c.ReadString(Cat("value of key '", key, "'")));
    if (out != nullptr) out->str = s;
    return absl::OkStatus();
  }
  // Array: element type, count, elements.
  if (depth >= kMaxArrayDepth) {
    return absl::InvalidArgumentError(
        Cat("metadata key '", key, "' nests arrays deeper than ", kMaxArrayDepth));
  }
  ASSIGN_OR_RETURN(uint32_t elem_raw,
                   c.Read<uint32_t>(Cat("array element type of key '", key, "'")));
  if (!IsKnownValueType(elem_raw)) {
    return absl::InvalidArgumentError(
        Cat("metadata key '", key, "' has unknown array element type ", elem_raw));
  }
  const auto elem = static_cast<GgufValueType>(elem_raw);
  ASSIGN_OR_RETURN(uint64_t count, c.Read<uint64_t>(Cat("array length of key '", key, "'")));
  const uint64_t min_size = MinEncodedSize(elem);
  if (count > c.remaining() / min_size) {
    return absl::InvalidArgumentError(Cat("array length ", count, " of metadata key '", key, "' (",
                                          ValueTypeName(elem), ") runs past the end of the file (",
                                          c.remaining(), " bytes remain)"));
  }
  if (out != nullptr) {
    out->elem_type = elem;
    out->count = count;
  }
  if (const uint64_t size = FixedSize(elem); size != 0) {
    ASSIGN_OR_RETURN(const uint8_t* p, c.Take(count * size, Cat("array of key '", key, "'")));
    if (out != nullptr) out->elems = p;
    return absl::OkStatus();
  }
  if (elem == GgufValueType::kString) {
    if (out != nullptr) out->strings.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      ASSIGN_OR_RETURN(std::string_view s, c.ReadString(Cat("element ", i, " of key '", key, "'")));
      if (out != nullptr) out->strings.push_back(s);
    }
    return absl::OkStatus();
  }
  for (uint64_t i = 0; i < count; ++i) {
    RETURN_IF_ERROR(ParseValue(c, GgufValueType::kArray, depth + 1, key, nullptr));
  }
  return absl::OkStatus();
}

}  // namespace

struct GgufFile::Value : ParsedValue {};

GgufFile::GgufFile() = default;

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, size_);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, Cat("cannot open GGUF file ", path));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, Cat("cannot stat GGUF file ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(Cat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return absl::InvalidArgumentError(Cat(path, ": truncated file: empty, no GGUF header"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (map == MAP_FAILED) {
    return absl::ErrnoToStatus(map_err, Cat("cannot mmap GGUF file ", path));
  }
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = path;
  file->mapping_ = map;
  file->data_ = static_cast<const uint8_t*>(map);
  file->size_ = size;
  if (absl::Status s = file->Parse(); !s.ok()) {
    return absl::Status(s.code(), Cat(path, ": ", s.message()));
  }
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBuffer(const uint8_t* data, size_t size) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = "<buffer>";
  file->data_ = data;
  file->size_ = data == nullptr ? 0 : size;
  RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::Status GgufFile::Parse() {
  Cursor c(data_, size_);
  ASSIGN_OR_RETURN(uint32_t magic, c.Read<uint32_t>("magic"));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(Cat("bad magic 0x", absl::Hex(magic, absl::kZeroPad8),
                                          ": not a GGUF file (expected \"GGUF\")"));
  }
  ASSIGN_OR_RETURN(version_, c.Read<uint32_t>("version"));
  if (version_ != 2 && version_ != 3) {
    // A big-endian file shows up as a byte-swapped version number.
    const bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    return absl::InvalidArgumentError(Cat(
        "unsupported GGUF version ", version_,
        swapped ? " (big-endian file; only little-endian is supported)" : " (supported: 2 and 3)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("metadata count"));
  // Smallest possible tensor info: name length, n_dims, one dim, type, offset.
  constexpr uint64_t kMinTensorInfo = 8 + 4 + 8 + 4 + 8;
  constexpr uint64_t kMinKv = 8 + 1 + 4 + 1;  // key length, 1-byte key, type, 1-byte value
  if (n_kv > c.remaining() / kMinKv) {
    return absl::InvalidArgumentError(Cat("metadata count ", n_kv, " is absurd: the file has only ",
                                          c.remaining(), " bytes left"));
  }
  if (n_tensors > c.remaining() / kMinTensorInfo) {
    return absl::InvalidArgumentError(Cat("tensor count ", n_tensors,
                                          " is absurd: the file has only ", c.remaining(),
                                          " bytes left"));
  }

  // Metadata.
  kv_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    ASSIGN_OR_RETURN(std::string_view key, c.ReadString(Cat("metadata key #", i)));
    if (key.empty()) {
      return absl::InvalidArgumentError(Cat("metadata key #", i, " is empty"));
    }
    if (kv_index_.contains(key)) {
      return absl::InvalidArgumentError(Cat("duplicate metadata key '", key, "'"));
    }
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>(Cat("type of key '", key, "'")));
    if (!IsKnownValueType(type)) {
      return absl::InvalidArgumentError(
          Cat("metadata key '", key, "' has unknown value type ", type));
    }
    auto value = std::make_unique<Value>();
    RETURN_IF_ERROR(ParseValue(c, static_cast<GgufValueType>(type), 0, key, value.get()));
    kv_index_.emplace(std::string(key), kv_.size());
    kv_.emplace_back(std::string(key), std::move(value));
  }

  // Alignment of tensor data; must be known before offsets are checked.
  alignment_ = kDefaultAlignment;
  if (const Value* v = Find("general.alignment")) {
    if (v->type != GgufValueType::kUint32) {
      return absl::InvalidArgumentError(
          Cat("general.alignment has type ", ValueTypeName(v->type), ", expected uint32"));
    }
    const uint32_t a = LoadLe<uint32_t>(v->scalar);
    if (a == 0 || (a & (a - 1)) != 0) {
      return absl::InvalidArgumentError(Cat("general.alignment ", a, " is not a power of two"));
    }
    alignment_ = a;
  }

  // Tensor table.
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    ASSIGN_OR_RETURN(std::string_view name, c.ReadString(Cat("tensor name #", i)));
    if (name.empty()) {
      return absl::InvalidArgumentError(Cat("tensor #", i, " has an empty name"));
    }
    if (tensor_index_.contains(name)) {
      return absl::InvalidArgumentError(Cat("duplicate tensor name '", name, "'"));
    }
    t.name = std::string(name);
    const std::string ctx = Cat("tensor '", t.name, "'");
    ASSIGN_OR_RETURN(uint32_t n_dims, c.Read<uint32_t>(Cat(ctx, " n_dims")));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::InvalidArgumentError(
          Cat(ctx, " has n_dims ", n_dims, " (must be 1..", kMaxDims, ")"));
    }
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t raw, c.Read<uint64_t>(Cat(ctx, " dim ", d)));
      const auto dim = static_cast<int64_t>(raw);
      if (dim <= 0) {
        return absl::InvalidArgumentError(Cat(ctx, " has non-positive dimension ", d, " = ", dim));
      }
      if (__builtin_mul_overflow(n_elements, dim, &n_elements)) {
        return absl::InvalidArgumentError(
            Cat(ctx, " element count overflows (dimension ", d, " = ", dim, ")"));
      }
      t.shape.push_back(dim);
    }
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>(Cat(ctx, " type")));
    if (!IsKnownTensorType(type)) {
      return absl::InvalidArgumentError(Cat(ctx, " has unsupported tensor type ",
                                            GgmlTypeIdName(type), " (ggml type id ", type,
                                            "; supported: ", SupportedTypeNames(), ")"));
    }
    t.type = static_cast<GgmlType>(type);
    const int64_t block = GgmlBlockElems(t.type);
    if (t.shape[0] % block != 0) {
      return absl::InvalidArgumentError(Cat(ctx, " row size ", t.shape[0],
                                            " is not a multiple of the ", GgmlTypeName(t.type),
                                            " block size ", block));
    }
    // n_elements fits in int64, but its byte size need not (F32 is 4 bytes each).
    int64_t n_bytes = 0;
    if (__builtin_mul_overflow(n_elements / block, GgmlBlockBytes(t.type), &n_bytes)) {
      return absl::InvalidArgumentError(Cat(ctx, " byte size overflows"));
    }
    t.n_bytes = static_cast<uint64_t>(n_bytes);
    ASSIGN_OR_RETURN(t.offset, c.Read<uint64_t>(Cat(ctx, " offset")));
    if (t.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(
          Cat(ctx, " offset ", t.offset, " is not aligned to ", alignment_));
    }
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // Data section starts at the next alignment boundary after the table.
  const uint64_t table_end = c.pos();
  const uint64_t data_start = (table_end + alignment_ - 1) / alignment_ * alignment_;
  if (tensors_.empty()) return absl::OkStatus();
  if (data_start > size_) {
    return absl::InvalidArgumentError(Cat("truncated file: data section starts at ", data_start,
                                          " past the end of the file (", size_, " bytes)"));
  }
  const uint64_t data_size = size_ - data_start;
  for (GgufTensorInfo& t : tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
      return absl::InvalidArgumentError(
          Cat("tensor '", t.name, "' data [", t.offset, ", ", t.offset + t.n_bytes,
              ") lies outside the file: truncated data section has ", data_size, " bytes"));
    }
    t.data = data_ + data_start + t.offset;
  }
  // Overlap check on a sorted copy of (offset, index); file order is kept.
  std::vector<std::pair<uint64_t, size_t>> order;
  order.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) order.emplace_back(tensors_[i].offset, i);
  std::sort(order.begin(), order.end());
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensorInfo& prev = tensors_[order[k - 1].second];
    const GgufTensorInfo& cur = tensors_[order[k].second];
    if (cur.offset < prev.offset + prev.n_bytes) {
      return absl::InvalidArgumentError(Cat("tensor '", cur.name, "' at offset ", cur.offset,
                                            " overlaps tensor '", prev.name, "' [", prev.offset,
                                            ", ", prev.offset + prev.n_bytes, ")"));
    }
  }
  return absl::OkStatus();
}

const GgufFile::Value* GgufFile::Find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : kv_[it->second].second.get();
}

bool GgufFile::Has(std::string_view key) const { return Find(key) != nullptr; }

std::optional<GgufValueType> GgufFile::TypeOf(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return std::nullopt;
  return v->type;
}

std::vector<std::string> GgufFile::Keys() const {
  std::vector<std::string> keys;
  keys.reserve(kv_.size());
  for (const auto& [key, value] : kv_) keys.push_back(key);
  return keys;
}

namespace {

absl::Status MissingKey(std::string_view key) {
  return absl::NotFoundError(Cat("metadata key '", key, "' not found"));
}

absl::Status WrongType(std::string_view key, const ParsedValue& v, std::string_view expected) {
  std::string actual = ValueTypeName(v.type);
  if (v.type == GgufValueType::kArray) {
    actual = Cat("array of ", ValueTypeName(v.elem_type));
  }
  return absl::InvalidArgumentError(
      Cat("metadata key '", key, "' has type ", actual, ", expected ", expected));
}

// Checks that an integer fits in [lo, hi]; the error names key and value.
absl::Status CheckRange(std::string_view key, const WideInt& w, int64_t lo, uint64_t hi) {
  const bool fits = w.negative ? (w.as_signed >= lo) : (w.magnitude <= hi);
  if (fits) return absl::OkStatus();
  return absl::OutOfRangeError(Cat("metadata key '", key, "' value ",
                                   w.negative ? Cat(w.as_signed) : Cat(w.magnitude),
                                   " is out of range [", lo, ", ", hi, "]"));
}

}  // namespace

absl::StatusOr<uint32_t> GgufFile::GetU32(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (!IsInteger(v->type)) return WrongType(key, *v, "an integer");
  const WideInt w = LoadInteger(v->type, v->scalar);
  RETURN_IF_ERROR(CheckRange(key, w, 0, std::numeric_limits<uint32_t>::max()));
  return static_cast<uint32_t>(w.magnitude);
}

absl::StatusOr<int64_t> GgufFile::GetI64(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (!IsInteger(v->type)) return WrongType(key, *v, "an integer");
  const WideInt w = LoadInteger(v->type, v->scalar);
  RETURN_IF_ERROR(
      CheckRange(key, w, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  return w.as_signed;
}

absl::StatusOr<float> GgufFile::GetF32(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kFloat32 && v->type != GgufValueType::kFloat64) {
    return WrongType(key, *v, "float32 or float64");
  }
  return static_cast<float>(LoadFloat(v->type, v->scalar));
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kBool) return WrongType(key, *v, "bool");
  return *v->scalar != 0;
}

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kString) return WrongType(key, *v, "string");
  return std::string(v->str);
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kArray || v->elem_type != GgufValueType::kString) {
    return WrongType(key, *v, "array of string");
  }
  return std::vector<std::string>(v->strings.begin(), v->strings.end());
}

absl::StatusOr<std::vector<float>> GgufFile::GetF32Array(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kArray ||
      (v->elem_type != GgufValueType::kFloat32 && v->elem_type != GgufValueType::kFloat64)) {
    return WrongType(key, *v, "array of float32 or float64");
  }
  const uint64_t stride = FixedSize(v->elem_type);
  std::vector<float> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    out[i] = static_cast<float>(LoadFloat(v->elem_type, v->elems + i * stride));
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> GgufFile::GetI32Array(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return MissingKey(key);
  if (v->type != GgufValueType::kArray || !IsInteger(v->elem_type)) {
    return WrongType(key, *v, "array of integers");
  }
  const uint64_t stride = FixedSize(v->elem_type);
  std::vector<int32_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    const WideInt w = LoadInteger(v->elem_type, v->elems + i * stride);
    if (absl::Status s = CheckRange(key, w, std::numeric_limits<int32_t>::min(),
                                    std::numeric_limits<int32_t>::max());
        !s.ok()) {
      return absl::OutOfRangeError(Cat(s.message(), " (element ", i, ")"));
    }
    out[i] = static_cast<int32_t>(w.as_signed);
  }
  return out;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<const GgufTensorInfo*> GgufFile::RequireTensor(
    std::string_view name, const std::vector<int64_t>& shape,
    const std::vector<GgmlType>& types) const {
  const GgufTensorInfo* t = FindTensor(name);
  if (t == nullptr) {
    return absl::NotFoundError(Cat("tensor '", name, "' not found in ", path_));
  }
  if (t->shape != shape) {
    return absl::InvalidArgumentError(Cat("tensor '", name, "' has shape ", ShapeString(t->shape),
                                          ", expected ", ShapeString(shape)));
  }
  if (!types.empty() && std::find(types.begin(), types.end(), t->type) == types.end()) {
    std::vector<std::string> names;
    for (GgmlType ty : types) names.emplace_back(GgmlTypeName(ty));
    return absl::InvalidArgumentError(Cat("tensor '", name, "' has type ", GgmlTypeName(t->type),
                                          ", expected ", absl::StrJoin(names, " or ")));
  }
  return t;
}

}  // namespace kvserve
