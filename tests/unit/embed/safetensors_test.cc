// SafetensorsFile: values of F32/F16/BF16 tensors, and a clear
// InvalidArgument for each way a file can be truncated or malformed.
#include "embed/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

std::string WithHeader(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Two tensors: "a" F32 [2, 2] = {1, 2, 3, 4}, "b" F16 [3] = {0.5, -2, 1024}.
std::string GoodFile() {
  std::string data(16 + 6, '\0');
  const float a[4] = {1, 2, 3, 4};
  std::memcpy(data.data(), a, 16);
  const uint16_t b[3] = {Fp32ToFp16(0.5f), Fp32ToFp16(-2.0f), Fp32ToFp16(1024.0f)};
  std::memcpy(data.data() + 16, b, 6);
  nlohmann::json h = {
      {"__metadata__", {{"format", "pt"}}},
      {"a", {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}}},
      {"b", {{"dtype", "F16"}, {"shape", {3}}, {"data_offsets", {16, 22}}}},
  };
  return WithHeader(h.dump(), data);
}

void ExpectInvalid(const std::string& bytes, const std::string& needle) {
  auto f = SafetensorsFile::FromBytes(bytes, "test.safetensors");
  ASSERT_FALSE(f.ok()) << "expected an error mentioning: " << needle;
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("test.safetensors"), std::string::npos) << f.status();
}

TEST(SafetensorsTest, ReadsF32AndF16Tensors) {
  auto f = SafetensorsFile::FromBytes(GoodFile(), "good");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("format"), "pt");
  auto a = f->ReadF32("a", {2, 2});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, (std::vector<float>{1, 2, 3, 4}));
  auto b = f->ReadF32("b", {3});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<float>{0.5f, -2.0f, 1024.0f}));
}

TEST(SafetensorsTest, ReadsBf16) {
  const uint16_t v[2] = {Fp32ToBf16(1.5f), Fp32ToBf16(-3.0f)};
  std::string data(4, '\0');
  std::memcpy(data.data(), v, 4);
  nlohmann::json h = {{"w", {{"dtype", "BF16"}, {"shape", {2}}, {"data_offsets", {0, 4}}}}};
  auto f = SafetensorsFile::FromBytes(WithHeader(h.dump(), data), "bf16");
  ASSERT_TRUE(f.ok()) << f.status();
  auto w = f->ReadF32("w", {2});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, (std::vector<float>{1.5f, -3.0f}));
}

TEST(SafetensorsTest, WrongShapeDtypeOrNameIsAnError) {
  auto f = SafetensorsFile::FromBytes(GoodFile(), "good");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->ReadF32("a", {4}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f->ReadF32("a", {4}).status().message().find("has shape [2, 2], expected [4]"),
            std::string::npos);
  EXPECT_EQ(f->ReadF32("missing", {1}).status().code(), absl::StatusCode::kNotFound);

  nlohmann::json h = {{"i", {{"dtype", "I64"}, {"shape", {1}}, {"data_offsets", {0, 8}}}}};
  auto g = SafetensorsFile::FromBytes(WithHeader(h.dump(), std::string(8, '\0')), "i64");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->ReadF32("i", {1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, TruncatedFilesAreInvalidArgument) {
  const std::string good = GoodFile();
  ExpectInvalid(good.substr(0, 5), "shorter than the 8-byte header length");
  ExpectInvalid(good.substr(0, 20), "runs past the end of the file");
  // Header intact, data cut short: the last tensor's range is past the end.
  ExpectInvalid(good.substr(0, good.size() - 1), "past the 21-byte data section");
}

TEST(SafetensorsTest, MalformedHeadersAreInvalidArgument) {
  ExpectInvalid(WithHeader("{not json", ""), "header is not JSON");
  ExpectInvalid(WithHeader("[1, 2]", ""), "header is not a JSON object");
  std::string huge(8, '\xff');
  ExpectInvalid(huge, "exceeds the");
  auto one = [](nlohmann::json entry) {
    return WithHeader(nlohmann::json{{"t", entry}}.dump(), std::string(16, '\0'));
  };
  ExpectInvalid(one({{"shape", {4}}, {"data_offsets", {0, 16}}}), "missing string 'dtype'");
  ExpectInvalid(one({{"dtype", "F32"}, {"data_offsets", {0, 16}}}), "missing array 'shape'");
  ExpectInvalid(one({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0}}}),
                "'data_offsets' is not a pair");
  ExpectInvalid(one({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {-1, 16}}}),
                "'data_offsets' is not a pair");
  ExpectInvalid(one({{"dtype", "F32"}, {"shape", {-4}}, {"data_offsets", {0, 16}}}),
                "negative dimension");
  ExpectInvalid(one({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {16, 0}}}), "reversed");
  ExpectInvalid(one({{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 16}}}),
                "F32 [3] needs 3 x 4 bytes but data_offsets span 16");
  ExpectInvalid(
      one({{"dtype", "F32"}, {"shape", {uint64_t{1} << 62, 8}}, {"data_offsets", {0, 16}}}),
      "overflows");
  nlohmann::json overlap = {
      {"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
      {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}},
  };
  ExpectInvalid(WithHeader(overlap.dump(), std::string(16, '\0')), "overlap");
  ExpectInvalid(WithHeader(R"({"__metadata__": {"k": 1}})", ""), "is not a string");
}

// Random byte flips, truncations and header-length changes of a valid file
// never crash or read out of bounds (run under ASan in deploy/test.sh):
// each gives either a valid file whose tensors read back, or InvalidArgument.
TEST(SafetensorsTest, RandomCorruptionsAreRejectedOrReadSafely) {
  const std::string good = GoodFile();
  std::mt19937 rng(19);
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = good;
    switch (iter % 3) {
      case 0:
        for (int k = 0; k < 3; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
        break;
      case 1:
        bytes.resize(rng() % bytes.size());
        break;
      default:
        bytes[rng() % 8] = static_cast<char>(rng());
        break;
    }
    auto f = SafetensorsFile::FromBytes(bytes, "fuzz");
    if (!f.ok()) {
      EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
      ++rejected;
      continue;
    }
    for (const auto& [name, t] : f->tensors()) {
      auto v = f->ReadF32(name, t.shape);
      if (v.ok()) {
        int64_t n = 1;
        for (int64_t d : t.shape) n *= d;
        EXPECT_EQ(static_cast<int64_t>(v->size()), n);
      }
    }
  }
  EXPECT_GT(rejected, 1000);
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open("/nonexistent/model.safetensors");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("/nonexistent/model.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace kvserve::embed
