// SafetensorsFile: header parsing and validation, dtype conversion.
#include "embed/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

// A header larger than this is not a model we know how to read (the
// reference implementation caps it at 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

SafetensorsDType ParseDType(const std::string& s) {
  if (s == "F32") return SafetensorsDType::kF32;
  if (s == "F16") return SafetensorsDType::kF16;
  if (s == "BF16") return SafetensorsDType::kBF16;
  if (s == "I64") return SafetensorsDType::kI64;
  if (s == "I32") return SafetensorsDType::kI32;
  return SafetensorsDType::kOther;
}

// Bytes per element, or 0 where the dtype is one we do not size (its byte
// range is then only checked against the file).
uint64_t ElemBytes(SafetensorsDType t) {
  switch (t) {
    case SafetensorsDType::kF32:
    case SafetensorsDType::kI32:
      return 4;
    case SafetensorsDType::kF16:
    case SafetensorsDType::kBF16:
      return 2;
    case SafetensorsDType::kI64:
      return 8;
    case SafetensorsDType::kOther:
      return 0;
  }
  return 0;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open safetensors file"));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read its size"));
  in.seekg(0);
  std::string bytes(static_cast<size_t>(size), '\0');
  if (!in.read(bytes.data(), size)) {
    return absl::DataLossError(absl::StrCat(path, ": read failed"));
  }
  return FromBytes(std::move(bytes), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::string bytes,
                                                           const std::string& origin) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": not a valid safetensors file: ", what));
  };
  if (bytes.size() < 8) {
    return bad(
        absl::StrCat("file is ", bytes.size(), " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > kMaxHeaderBytes) {
    return bad(absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes,
                            "-byte limit"));
  }
  if (header_len > bytes.size() - 8) {
    return bad(absl::StrCat("header length ", header_len, " runs past the end of the file (",
                            bytes.size() - 8, " bytes follow the length); truncated?"));
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    return bad(absl::StrCat("header is not JSON (", e.what(), ")"));
  }
  if (!header.is_object()) return bad("header is not a JSON object");

  SafetensorsFile f;
  f.origin_ = origin;
  f.data_offset_ = 8 + header_len;
  const uint64_t data_size = bytes.size() - f.data_offset_;
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return bad(absl::StrCat("__metadata__[", k, "] is not a string"));
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor '", name, "': ");
    if (!entry.is_object()) return bad(where + "entry is not an object");
    const auto dtype = entry.find("dtype");
    const auto shape = entry.find("shape");
    const auto offsets = entry.find("data_offsets");
    if (dtype == entry.end() || !dtype->is_string()) return bad(where + "missing string 'dtype'");
    if (shape == entry.end() || !shape->is_array()) return bad(where + "missing array 'shape'");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return bad(where + "'data_offsets' is not a pair of non-negative integers");
    }
    SafetensorsTensor t;
    t.dtype_name = dtype->get<std::string>();
    t.dtype = ParseDType(t.dtype_name);
    uint64_t elems = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned())
        return bad(where + "shape has a non-integer or negative dimension");
      const uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (v != 0 && elems > std::numeric_limits<uint64_t>::max() / v)) {
        return bad(where + "shape overflows");
      }
      elems *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    if (t.begin > t.end) {
      return bad(absl::StrCat(where, "data_offsets [", t.begin, ", ", t.end, ") are reversed"));
    }
    if (t.end > data_size) {
      return bad(absl::StrCat(where, "data_offsets end ", t.end, " is past the ", data_size,
                              "-byte data section; truncated?"));
    }
    const uint64_t eb = ElemBytes(t.dtype);
    if (eb != 0 &&
        (elems > std::numeric_limits<uint64_t>::max() / eb || elems * eb != t.end - t.begin)) {
      return bad(absl::StrCat(where, t.dtype_name, " ", ShapeString(t.shape), " needs ", elems,
                              " x ", eb, " bytes but data_offsets span ", t.end - t.begin));
    }
    ranges.push_back({{t.begin, t.end}, name});
    f.tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first.first < ranges[i - 1].first.second) {
      return bad(absl::StrCat("tensors '", ranges[i - 1].second, "' and '", ranges[i].second,
                              "' overlap"));
    }
  }
  f.bytes_ = std::move(bytes);
  return f;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadF32(
    const std::string& name, const std::vector<int64_t>& shape) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(origin_, ": no tensor '", name, "'"));
  }
  const SafetensorsTensor& t = it->second;
  if (t.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": tensor '", name, "' has shape ",
                                                   ShapeString(t.shape), ", expected ",
                                                   ShapeString(shape)));
  }
  const char* src = bytes_.data() + data_offset_ + t.begin;
  const uint64_t n = t.end - t.begin;
  std::vector<float> out;
  switch (t.dtype) {
    case SafetensorsDType::kF32:
      out.resize(n / 4);
      std::memcpy(out.data(), src, n);
      return out;
    case SafetensorsDType::kF16:
    case SafetensorsDType::kBF16:
      out.resize(n / 2);
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = t.dtype == SafetensorsDType::kF16 ? Fp16ToFp32(h) : Bf16ToFp32(h);
      }
      return out;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(origin_, ": tensor '", name, "' is ", t.dtype_name,
                       "; only F32, F16 and BF16 are read as floats"));
  }
}

}  // namespace kvserve::embed
