// GgufFile reads a GGUF model file (versions 2 and 3): header, typed
// metadata, and the tensor table, over a read-only memory mapping (or a
// caller-owned buffer). Every malformed input returns a Status naming the
// problem; nothing in here aborts on bad bytes.
//
// Thread-safety: immutable after Open, safe to share between threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvserve {

// ggml tensor type ids as stored in GGUF. Only the types the engine can
// compute with are accepted by the reader; a tensor of any other type is
// refused with the tensor's name and the type's ggml name
// (GgmlTypeIdName).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30,
};

const char* GgmlTypeName(GgmlType t);
// ggml's name of any type id ggml has defined ("IQ2_XXS", "TQ1_0", ...),
// supported or not; "unknown" for ids ggml never used.
const char* GgmlTypeIdName(uint32_t id);
// Every type the reader accepts, for RequireTensor's `types` when any
// weight format will do.
const std::vector<GgmlType>& AllGgmlTypes();
// Elements per quantization block (1 for float types) and bytes per block.
int64_t GgmlBlockElems(GgmlType t);
int64_t GgmlBlockBytes(GgmlType t);
// Bytes of a row of `n` elements; n must be a multiple of GgmlBlockElems.
int64_t GgmlRowBytes(GgmlType t, int64_t n);

// GGUF metadata value types.
enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5,
  kFloat32 = 6, kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11,
  kFloat64 = 12,
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type;
  // ggml order: shape[0] is the contiguous (innermost) dimension. A matrix
  // used as y = W x has shape {in_features, out_features}.
  std::vector<int64_t> shape;
  uint64_t offset = 0;      // relative to the start of the data section
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // points into the mapping

  int64_t n_elements() const;
};

class GgufFile {
 public:
  // Memory-maps and parses `path`.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses a buffer the caller keeps alive for the lifetime of the result
  // (used by tests and fuzzing).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GgufFile>> FromBuffer(const uint8_t* data,
                                                                          size_t size);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  size_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }

  bool Has(std::string_view key) const;
  std::optional<GgufValueType> TypeOf(std::string_view key) const;
  // Typed getters. Integer getters accept any stored integer type whose value
  // fits; the error names the key and what was wrong (missing, wrong type,
  // out of range).
  [[nodiscard]] absl::StatusOr<uint32_t> GetU32(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<int64_t> GetI64(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<float> GetF32(std::string_view key) const;  // any float type
  [[nodiscard]] absl::StatusOr<bool> GetBool(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::string> GetString(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<float>> GetF32Array(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> GetI32Array(std::string_view key) const;
  // Metadata keys in file order.
  std::vector<std::string> Keys() const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensorInfo* FindTensor(std::string_view name) const;
  // The tensor must exist, have exactly `shape` (ggml order) and one of the
  // given types (any type the reader accepts when `types` is empty).
  [[nodiscard]] absl::StatusOr<const GgufTensorInfo*> RequireTensor(
      std::string_view name, const std::vector<int64_t>& shape,
      const std::vector<GgmlType>& types = {}) const;

 private:
  struct Value;
  GgufFile();
  absl::Status Parse();
  const Value* Find(std::string_view key) const;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // munmap on destruction when set
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, std::unique_ptr<Value>>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace kvserve
