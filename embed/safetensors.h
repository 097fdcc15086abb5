// SafetensorsFile: reads a .safetensors file (Hugging Face's format: an
// 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw data) and hands out its tensors
// as float arrays. Every offset and size in the header is checked against
// the file before any data is read; a truncated or malformed file gives
// InvalidArgument naming the problem.
//
// Thread-safety: immutable after Open; const methods may be called from any
// thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve::embed {

enum class SafetensorsDType : uint8_t { kF32, kF16, kBF16, kI64, kI32, kOther };

struct SafetensorsTensor {
  SafetensorsDType dtype;
  std::string dtype_name;  // as written in the header ("F32", "I64", ...)
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range within the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Reads and validates the whole file.
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  // Same, from bytes in memory (tests); `origin` names it in errors.
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> FromBytes(std::string bytes,
                                                                 const std::string& origin);

  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The whole file, header included (for content fingerprints).
  std::string_view bytes() const { return bytes_; }

  // The tensor `name` converted to float (F32, F16 and BF16 are accepted),
  // checked to have exactly `shape`. NotFound when absent, InvalidArgument
  // for another dtype or shape.
  [[nodiscard]] absl::StatusOr<std::vector<float>> ReadF32(const std::string& name,
                                                           const std::vector<int64_t>& shape) const;

 private:
  SafetensorsFile() = default;

  std::string origin_;
  std::string bytes_;  // the whole file
  uint64_t data_offset_ = 0;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvserve::embed
