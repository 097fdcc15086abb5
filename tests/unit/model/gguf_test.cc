#include "model/gguf.h"

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::ElementsAre;
using testing::GgufWriter;
using ::testing::HasSubstr;

// Hand-assembles GGUF bytes field by field, for inputs GgufWriter refuses to
// produce (duplicate keys, explicit tensor offsets, odd value types).
class RawGguf {
 public:
  RawGguf& U8(uint8_t v) { return Put(v); }
  RawGguf& U32(uint32_t v) { return Put(v); }
  RawGguf& U64(uint64_t v) { return Put(v); }
  RawGguf& I64(int64_t v) { return Put(v); }
  RawGguf& Str(const std::string& s) {
    U64(s.size());
    bytes_.append(s);
    return *this;
  }
  RawGguf& Header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    return U32(0x46554747).U32(version).U64(n_tensors).U64(n_kv);
  }
  RawGguf& KvU32(const std::string& key, uint32_t v) { return Str(key).U32(4).U32(v); }
  RawGguf& Tensor(const std::string& name, std::vector<int64_t> shape, uint32_t type,
                  uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(shape.size()));
    for (int64_t d : shape) I64(d);
    return U32(type).U64(offset);
  }
  RawGguf& PadTo(size_t alignment) {
    bytes_.resize((bytes_.size() + alignment - 1) / alignment * alignment, '\0');
    return *this;
  }
  RawGguf& Zeros(size_t n) {
    bytes_.append(n, '\0');
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  template <typename T>
  RawGguf& Put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    bytes_.append(b, sizeof(T));
    return *this;
  }
  std::string bytes_;
};

absl::StatusOr<std::unique_ptr<GgufFile>> Parse(const std::string& bytes) {
  return GgufFile::FromBuffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// The parse error message, or "OK" so a mistaken success fails HasSubstr.
std::string ParseError(const std::string& bytes) {
  auto file = Parse(bytes);
  if (file.ok()) return "OK";
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  return std::string(file.status().message());
}

std::string Floats(int n, float v = 0.5f) {
  std::string s(static_cast<size_t>(n) * 4, '\0');
  for (int i = 0; i < n; ++i) std::memcpy(s.data() + 4 * i, &v, 4);
  return s;
}

// A small valid file: a few keys and two F32 tensors.
GgufWriter SmallWriter() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("llama.block_count", 2);
  w.SetI32("answer", -42);
  w.SetU64("big", std::numeric_limits<uint64_t>::max());
  w.SetF32("eps", 1e-5f);
  w.SetBool("flag", true);
  w.SetStringArray("words", {"a", "bb", ""});
  w.SetF32Array("scores", {0.5f, -1.0f});
  w.SetI32Array("types", {1, 2, 3});
  w.AddTensor("a.weight", GgmlType::kF32, {4, 2}, Floats(8, 1.5f));
  w.AddTensor("b.weight", GgmlType::kF32, {3}, Floats(3, -2.0f));
  return w;
}

TEST(GgmlTypeTest, BlockSizes) {
  EXPECT_STREQ(GgmlTypeName(GgmlType::kQ8_0), "Q8_0");
  EXPECT_STREQ(GgmlTypeName(GgmlType::kBF16), "BF16");
  EXPECT_EQ(GgmlBlockElems(GgmlType::kQ8_0), 32);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kQ8_0), 34);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kQ4_0), 18);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kQ4_1), 20);
  EXPECT_EQ(GgmlBlockElems(GgmlType::kF16), 1);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kF16), 2);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kBF16), 2);
  EXPECT_EQ(GgmlBlockBytes(GgmlType::kF32), 4);
  EXPECT_EQ(GgmlRowBytes(GgmlType::kQ4_1, 576), 18 * 20);
  EXPECT_EQ(GgmlRowBytes(GgmlType::kF16, 7), 14);
}

// ---------------------------------------------------------------------------
// Real model files.

TEST(GgufRealFileTest, Stories260K) {
  const std::string path = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(path, "stories260K.gguf");
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.tensors().size(), 48u);
  EXPECT_EQ(f.Keys().size(), 19u);
  EXPECT_EQ(f.Keys().front(), "tokenizer.ggml.tokens");
  EXPECT_EQ(f.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(f.GetU32("llama.block_count").value(), 5u);
  EXPECT_EQ(f.GetI64("llama.embedding_length").value(), 64);
  EXPECT_EQ(f.GetU32("tokenizer.ggml.padding_token_id").value(), 0xffffffffu);
  EXPECT_NEAR(f.GetF32("llama.attention.layer_norm_rms_epsilon").value(), 1e-5f, 1e-9f);
  auto tokens = f.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ(f.GetF32Array("tokenizer.ggml.scores")->size(), 512u);
  auto types = f.GetI32Array("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ((*types)[0], 2);
  EXPECT_EQ(f.TypeOf("tokenizer.ggml.tokens"), GgufValueType::kArray);
  EXPECT_EQ(f.TypeOf("nope"), std::nullopt);

  auto embd = f.RequireTensor("token_embd.weight", {64, 512}, {GgmlType::kF32});
  ASSERT_TRUE(embd.ok()) << embd.status();
  EXPECT_EQ((*embd)->n_bytes, 64u * 512 * 4);
  EXPECT_EQ((*embd)->n_elements(), 64 * 512);
  EXPECT_NE(f.FindTensor("blk.4.ffn_down.weight"), nullptr);
  EXPECT_EQ(f.FindTensor("blk.5.ffn_down.weight"), nullptr);
  // Tensor data lies inside the mapping and is aligned there.
  for (const GgufTensorInfo& t : f.tensors()) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 32, 0u) << t.name;
  }

  // Getter errors name the key and the problem.
  auto missing = f.GetF32("llama.rope.freq_base");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("llama.rope.freq_base"));
  auto wrong = f.GetString("llama.block_count");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("'llama.block_count' has type uint32"));
  EXPECT_THAT(f.GetU32("tokenizer.ggml.tokens").status().message(), HasSubstr("array of string"));
  EXPECT_THAT(f.GetF32Array("tokenizer.ggml.tokens").status().message(),
              HasSubstr("expected array of float32"));
}

TEST(GgufRealFileTest, SmolLM2) {
  const std::string path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(path, "SmolLM2 Q4_1 model");
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.Keys().size(), 33u);
  EXPECT_EQ(f.GetU32("llama.block_count").value(), 30u);
  EXPECT_FLOAT_EQ(f.GetF32("llama.rope.freq_base").value(), 100000.0f);
  EXPECT_FALSE(f.GetBool("tokenizer.ggml.add_bos_token").value());
  EXPECT_EQ(f.GetString("tokenizer.ggml.model").value(), "gpt2");
  EXPECT_EQ(f.GetStringArray("tokenizer.ggml.tokens")->size(), 49152u);
  EXPECT_EQ(f.GetStringArray("tokenizer.ggml.merges")->size(), 48900u);

  auto embd = f.RequireTensor("token_embd.weight", {576, 49152}, {GgmlType::kQ8_0});
  ASSERT_TRUE(embd.ok()) << embd.status();
  EXPECT_EQ((*embd)->n_bytes, 49152u * 18 * 34);
  auto down = f.RequireTensor("blk.0.ffn_down.weight", {1536, 576}, {GgmlType::kQ4_1});
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ((*down)->n_bytes, 576u * 48 * 20);

  auto bad_type =
      f.RequireTensor("blk.0.ffn_down.weight", {1536, 576}, {GgmlType::kF32, GgmlType::kF16});
  EXPECT_THAT(bad_type.status().message(),
              HasSubstr("'blk.0.ffn_down.weight' has type Q4_1, expected F32 or F16"));
  auto bad_shape = f.RequireTensor("blk.0.ffn_down.weight", {576, 1536});
  EXPECT_THAT(bad_shape.status().message(),
              HasSubstr("has shape {1536, 576}, expected {576, 1536}"));
  auto absent = f.RequireTensor("blk.30.ffn_down.weight", {1536, 576});
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(absent.status().message(), HasSubstr("'blk.30.ffn_down.weight' not found"));
}

TEST(GgufOpenTest, MissingFileIsNotFound) {
  auto file = GgufFile::Open(testing::TempDir() + "/does-not-exist.gguf");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("does-not-exist.gguf"));
}

TEST(GgufOpenTest, ErrorsFromFilesNameThePath) {
  const std::string path = testing::TempDir() + "/bad-magic.gguf";
  std::string bytes = SmallWriter().Serialize();
  bytes[0] = 'X';
  {
    FILE* f = fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    fwrite(bytes.data(), 1, bytes.size(), f);
    fclose(f);
  }
  auto file = GgufFile::Open(path);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  EXPECT_THAT(file.status().message(), HasSubstr("bad magic"));
}

// ---------------------------------------------------------------------------
// Writer round trips.

class GgufRoundTripTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufRoundTripTest, ValuesAndTensorsSurvive) {
  const uint32_t version = GetParam();
  const std::string path = testing::TempDir() + "/round-trip-v" + std::to_string(version) + ".gguf";
  ASSERT_TRUE(SmallWriter().WriteFile(path, version).ok());
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), version);
  EXPECT_THAT(f.Keys(), ElementsAre("general.architecture", "llama.block_count", "answer", "big",
                                    "eps", "flag", "words", "scores", "types"));
  EXPECT_EQ(f.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(f.GetU32("llama.block_count").value(), 2u);
  EXPECT_EQ(f.GetI64("answer").value(), -42);
  EXPECT_FLOAT_EQ(f.GetF32("eps").value(), 1e-5f);
  EXPECT_TRUE(f.GetBool("flag").value());
  EXPECT_THAT(f.GetStringArray("words").value(), ElementsAre("a", "bb", ""));
  EXPECT_THAT(f.GetF32Array("scores").value(), ElementsAre(0.5f, -1.0f));
  EXPECT_THAT(f.GetI32Array("types").value(), ElementsAre(1, 2, 3));
  ASSERT_EQ(f.tensors().size(), 2u);
  const GgufTensorInfo& a = f.tensors()[0];
  EXPECT_EQ(a.name, "a.weight");
  EXPECT_THAT(a.shape, ElementsAre(4, 2));
  EXPECT_EQ(a.n_bytes, 32u);
  float v;
  std::memcpy(&v, a.data + 28, 4);
  EXPECT_EQ(v, 1.5f);
  const GgufTensorInfo* b = f.FindTensor("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 32u);
  std::memcpy(&v, b->data, 4);
  EXPECT_EQ(v, -2.0f);
}

INSTANTIATE_TEST_SUITE_P(Versions, GgufRoundTripTest, ::testing::Values(2u, 3u));

TEST(GgufWriterTest, CustomAlignmentIsRecordedAndHonoured) {
  const std::string bytes = SmallWriter().Serialize(3, 64);
  auto file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->alignment(), 64u);
  EXPECT_EQ((*file)->FindTensor("b.weight")->offset, 64u);
  EXPECT_EQ(
      ((*file)->FindTensor("a.weight")->data - reinterpret_cast<const uint8_t*>(bytes.data())) % 64,
      0);
}

TEST(GgufGetterTest, IntegerRangesAndTypes) {
  const std::string bytes = SmallWriter().Serialize();
  auto file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  auto negative = f.GetU32("answer");
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(negative.status().message(), HasSubstr("'answer' value -42 is out of range"));
  auto too_big = f.GetU32("big");
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(too_big.status().message(), HasSubstr("18446744073709551615"));
  EXPECT_EQ(f.GetI64("big").status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(f.GetF32("llama.block_count").status().message(),
              HasSubstr("has type uint32, expected float32 or float64"));
  EXPECT_THAT(f.GetBool("eps").status().message(), HasSubstr("has type float32, expected bool"));
  EXPECT_THAT(f.GetI32Array("scores").status().message(), HasSubstr("array of float32"));
  EXPECT_THAT(f.GetStringArray("general.architecture").status().message(),
              HasSubstr("has type string, expected array of string"));
  EXPECT_EQ(f.GetI64("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(f.Has("flag"));
  EXPECT_FALSE(f.Has("fla"));
}

// Every one of the 13 value types, nested arrays included, parses; the
// getters read what they expose and reject the rest.
TEST(GgufGetterTest, AllValueTypes) {
  RawGguf r;
  r.Header(3, 0, 16);
  r.Str("u8").U32(0).U8(200);
  r.Str("i8").U32(1).U8(0xff);  // -1
  r.Str("u16").U32(2).U8(0x34).U8(0x12);
  r.Str("i16").U32(3).U8(0xfe).U8(0xff);  // -2
  r.Str("u32").U32(4).U32(7);
  r.Str("i32").U32(5).U32(static_cast<uint32_t>(-3));
  r.Str("f32").U32(6).U32(0x3f800000);  // 1.0f
  r.Str("bool").U32(7).U8(1);
  r.Str("str").U32(8).Str("hi");
  r.Str("u64").U32(10).U64(1ull << 40);
  r.Str("i64").U32(11).I64(-(1ll << 40));
  r.Str("f64").U32(12).U64(0x4000000000000000ull);  // 2.0
  r.Str("u8s").U32(9).U32(0).U64(2).U8(1).U8(255);
  r.Str("f64s").U32(9).U32(12).U64(1).U64(0x4000000000000000ull);
  r.Str("nested").U32(9).U32(9).U64(2);
  r.U32(4).U64(1).U32(5);       // [uint32: 5]
  r.U32(8).U64(1).Str("deep");  // [string: "deep"]
  r.Str("u64s").U32(9).U32(10).U64(1).U64(1ull << 33);
  auto file = Parse(r.bytes());
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.GetU32("u8").value(), 200u);
  EXPECT_EQ(f.GetI64("i8").value(), -1);
  EXPECT_EQ(f.GetU32("u16").value(), 0x1234u);
  EXPECT_EQ(f.GetI64("i16").value(), -2);
  EXPECT_EQ(f.GetU32("u32").value(), 7u);
  EXPECT_EQ(f.GetI64("i32").value(), -3);
  EXPECT_EQ(f.GetF32("f32").value(), 1.0f);
  EXPECT_TRUE(f.GetBool("bool").value());
  EXPECT_EQ(f.GetString("str").value(), "hi");
  EXPECT_EQ(f.GetI64("u64").value(), 1ll << 40);
  EXPECT_EQ(f.GetI64("i64").value(), -(1ll << 40));
  EXPECT_EQ(f.GetF32("f64").value(), 2.0f);
  EXPECT_THAT(f.GetI32Array("u8s").value(), ElementsAre(1, 255));
  EXPECT_THAT(f.GetF32Array("f64s").value(), ElementsAre(2.0f));
  EXPECT_EQ(f.TypeOf("nested"), GgufValueType::kArray);
  EXPECT_THAT(f.GetI32Array("nested").status().message(), HasSubstr("array of array"));
  auto wide = f.GetI32Array("u64s");
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(wide.status().message(), HasSubstr("element 0"));
}

TEST(GgufWriterTest, TinyLlamaHasTheExpectedLayout) {
  testing::TinyLlamaOptions o;
  o.weight_type = GgmlType::kF16;
  const std::string bytes = testing::MakeTinyLlamaGguf(o);
  auto file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(f.GetU32("llama.rope.dimension_count").value(), 16u);
  EXPECT_EQ(f.GetU32("llama.attention.head_count_kv").value(), 2u);
  EXPECT_TRUE(f.GetBool("tokenizer.ggml.add_bos_token").value());
  const auto tokens = f.GetStringArray("tokenizer.ggml.tokens").value();
  const auto types = f.GetI32Array("tokenizer.ggml.token_type").value();
  ASSERT_EQ(tokens.size(), types.size());
  EXPECT_EQ(f.GetF32Array("tokenizer.ggml.scores")->size(), tokens.size());
  EXPECT_EQ(tokens[0], "<unk>");
  EXPECT_EQ(types[0], 2);
  EXPECT_EQ(types[1], 3);
  EXPECT_EQ(tokens[3], "<0x00>");
  EXPECT_EQ(types[3 + 255], 6);
  EXPECT_EQ(types.back(), 1);
  const int64_t vocab = static_cast<int64_t>(tokens.size());
  EXPECT_TRUE(f.RequireTensor("token_embd.weight", {64, vocab}, {GgmlType::kF16}).ok());
  EXPECT_TRUE(f.RequireTensor("output.weight", {64, vocab}).ok());
  EXPECT_TRUE(f.RequireTensor("output_norm.weight", {64}, {GgmlType::kF32}).ok());
  EXPECT_TRUE(f.RequireTensor("blk.1.attn_k.weight", {64, 32}).ok());
  EXPECT_TRUE(f.RequireTensor("blk.1.ffn_down.weight", {128, 64}).ok());
  EXPECT_EQ(f.tensors().size(), 3u + 2 * 9);
  // Norm weights sit near 1.
  float w0;
  std::memcpy(&w0, f.FindTensor("blk.0.ffn_norm.weight")->data, 4);
  EXPECT_NEAR(w0, 1.0f, 0.3f);
}

TEST(GgufWriterTest, TinyLlamaQuantizedAndTied) {
  testing::TinyLlamaOptions o;
  o.weight_type = GgmlType::kQ4_1;
  o.tied_output = true;
  o.n_layers = 1;
  const std::string bytes = testing::MakeTinyLlamaGguf(o);
  auto file = Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->FindTensor("output.weight"), nullptr);
  EXPECT_EQ((*file)->FindTensor("blk.0.attn_q.weight")->type, GgmlType::kQ4_1);
  EXPECT_EQ((*file)->FindTensor("blk.0.ffn_down.weight")->type, GgmlType::kQ4_1);
  EXPECT_EQ((*file)->FindTensor("blk.0.attn_norm.weight")->type, GgmlType::kF32);
  // The same seed gives the same bytes.
  EXPECT_EQ(bytes, testing::MakeTinyLlamaGguf(o));
}

// ---------------------------------------------------------------------------
// Malformed inputs: one test per class, each checking the message.

TEST(GgufMalformedTest, BadMagic) {
  std::string bytes = SmallWriter().Serialize();
  std::memcpy(bytes.data(), "GGML", 4);
  EXPECT_THAT(ParseError(bytes), HasSubstr("bad magic"));
}

TEST(GgufMalformedTest, UnsupportedVersions) {
  EXPECT_THAT(ParseError(SmallWriter().Serialize(1)), HasSubstr("unsupported GGUF version 1"));
  EXPECT_THAT(ParseError(SmallWriter().Serialize(4)), HasSubstr("unsupported GGUF version 4"));
  EXPECT_THAT(ParseError(SmallWriter().Serialize(0x03000000)), HasSubstr("big-endian"));
}

TEST(GgufMalformedTest, EmptyAndTruncatedHeader) {
  EXPECT_THAT(ParseError(""), HasSubstr("truncated file: magic"));
  auto null_buffer = GgufFile::FromBuffer(nullptr, 100);
  EXPECT_FALSE(null_buffer.ok());
  const std::string bytes = SmallWriter().Serialize();
  EXPECT_THAT(ParseError(bytes.substr(0, 6)), HasSubstr("truncated file: version"));
  EXPECT_THAT(ParseError(bytes.substr(0, 12)), HasSubstr("truncated file: tensor count"));
  EXPECT_THAT(ParseError(bytes.substr(0, 20)), HasSubstr("truncated file: metadata count"));
}

TEST(GgufMalformedTest, TruncatedKeyString) {
  const std::string bytes = RawGguf().Header(3, 0, 1).Str("general.architecture").bytes();
  // Cut inside the key's bytes: the declared length runs past the end.
  EXPECT_THAT(ParseError(bytes.substr(0, bytes.size() - 4)),
              HasSubstr("string length 20 of metadata key #0"));
  const std::string two =
      RawGguf().Header(3, 0, 2).KvU32("abcdefghijklmnopqrstuvwxyz", 1).U32(0).bytes();
  EXPECT_THAT(ParseError(two), HasSubstr("truncated file: metadata key #1 length needs 8 bytes"));
}

TEST(GgufMalformedTest, TruncatedValue) {
  const std::string bytes = RawGguf().Header(3, 0, 1).Str("k").U32(10).U32(7).bytes();
  EXPECT_THAT(ParseError(bytes), HasSubstr("truncated file: value of key 'k' needs 8 bytes"));
  const std::string str = RawGguf().Header(3, 0, 1).Str("k").U32(8).U64(100).Str("short").bytes();
  EXPECT_THAT(ParseError(str), HasSubstr("string length 100 of value of key 'k'"));
}

TEST(GgufMalformedTest, TruncatedArray) {
  const std::string bytes =
      RawGguf().Header(3, 0, 1).Str("arr").U32(9).U32(4).U64(3).U32(1).U32(2).bytes();
  EXPECT_THAT(ParseError(bytes), HasSubstr("array length 3 of metadata key 'arr'"));
  const std::string strings =
      RawGguf().Header(3, 0, 1).Str("arr").U32(9).U32(8).U64(2).Str("one").U64(50).bytes();
  EXPECT_THAT(ParseError(strings), HasSubstr("element 1 of key 'arr'"));
  const std::string no_count = RawGguf().Header(3, 0, 1).Str("arr").U32(9).U32(8).U32(0).bytes();
  EXPECT_THAT(ParseError(no_count), HasSubstr("truncated file: array length of key 'arr'"));
}

TEST(GgufMalformedTest, TruncatedTensorInfo) {
  RawGguf r;
  // A long string value first, so the header's count check (which only bounds
  // the count by the bytes left) lets the truncated table through to be read.
  r.Header(3, 1, 1).Str("pad").U32(8).Str(std::string(64, 'x'));
  const size_t info_start = r.bytes().size();
  r.Str("w").U32(2).I64(4).I64(4).U32(0).U64(0).PadTo(32).Zeros(64);
  const std::string& full = r.bytes();
  ASSERT_EQ(ParseError(full), "OK");
  EXPECT_THAT(ParseError(full.substr(0, info_start + 8 + 1 + 4 + 8 + 3)),
              HasSubstr("tensor 'w' dim 1"));
  EXPECT_THAT(ParseError(full.substr(0, info_start + 8 + 1 + 2)), HasSubstr("tensor 'w' n_dims"));
  EXPECT_THAT(ParseError(full.substr(0, info_start + 8 + 1 + 4 + 16 + 4 + 2)),
              HasSubstr("tensor 'w' offset"));
}

TEST(GgufMalformedTest, TruncatedTensorData) {
  const std::string bytes = SmallWriter().Serialize();
  EXPECT_THAT(ParseError(bytes.substr(0, bytes.size() - 21)),
              HasSubstr("tensor 'b.weight' data [32, 44) lies outside the file"));
}

TEST(GgufMalformedTest, AbsurdCounts) {
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1ull << 60).Zeros(100).bytes()),
              HasSubstr("metadata count 1152921504606846976 is absurd"));
  EXPECT_THAT(ParseError(RawGguf().Header(3, ~0ull, 0).Zeros(100).bytes()),
              HasSubstr("tensor count 18446744073709551615 is absurd"));
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1).Str("a").U32(9).U32(8).U64(~0ull).bytes()),
              HasSubstr("array length 18446744073709551615"));
}

TEST(GgufMalformedTest, StringLengthPastEnd) {
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1).U64(~0ull).Zeros(16).bytes()),
              HasSubstr("string length 18446744073709551615 of metadata key #0"));
  RawGguf r;
  r.Header(3, 1, 0).U64(1ull << 40).Zeros(64);
  EXPECT_THAT(ParseError(r.bytes()), HasSubstr("runs past the end"));
}

TEST(GgufMalformedTest, DuplicateKey) {
  const std::string bytes = RawGguf().Header(3, 0, 2).KvU32("k", 1).KvU32("k", 2).bytes();
  EXPECT_THAT(ParseError(bytes), HasSubstr("duplicate metadata key 'k'"));
}

TEST(GgufMalformedTest, EmptyKey) {
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1).KvU32("", 1).bytes()), HasSubstr("empty"));
}

TEST(GgufMalformedTest, UnknownValueType) {
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1).Str("k").U32(13).U32(0).bytes()),
              HasSubstr("'k' has unknown value type 13"));
  EXPECT_THAT(ParseError(RawGguf().Header(3, 0, 1).Str("k").U32(9).U32(99).U64(0).bytes()),
              HasSubstr("unknown array element type 99"));
}

TEST(GgufMalformedTest, ArraysNestedTooDeep) {
  RawGguf r;
  r.Header(3, 0, 1).Str("k").U32(9);
  for (int i = 0; i < 20; ++i) r.U32(9).U64(1);
  r.U32(4).U64(0);
  EXPECT_THAT(ParseError(r.bytes()), HasSubstr("nests arrays deeper than"));
}

TEST(GgufMalformedTest, DuplicateTensorName) {
  GgufWriter w;
  w.AddTensor("w", GgmlType::kF32, {2}, Floats(2));
  w.AddTensor("w", GgmlType::kF32, {2}, Floats(2));
  EXPECT_THAT(ParseError(w.Serialize()), HasSubstr("duplicate tensor name 'w'"));
}

TEST(GgufMalformedTest, BadDimensionCount) {
  GgufWriter zero;
  zero.AddTensor("scalar", GgmlType::kF32, {}, Floats(1));
  EXPECT_THAT(ParseError(zero.Serialize()), HasSubstr("tensor 'scalar' has n_dims 0"));
  GgufWriter five;
  five.AddTensor("t5", GgmlType::kF32, {1, 1, 1, 1, 1}, Floats(1));
  EXPECT_THAT(ParseError(five.Serialize()), HasSubstr("tensor 't5' has n_dims 5 (must be 1..4)"));
}

TEST(GgufMalformedTest, NonPositiveDimension) {
  GgufWriter neg;
  neg.AddTensor("neg", GgmlType::kF32, {4, -2}, Floats(8));
  EXPECT_THAT(ParseError(neg.Serialize()),
              HasSubstr("tensor 'neg' has non-positive dimension 1 = -2"));
  GgufWriter zero;
  zero.AddTensor("zero", GgmlType::kF32, {0}, "");
  EXPECT_THAT(ParseError(zero.Serialize()), HasSubstr("non-positive dimension 0 = 0"));
}

TEST(GgufMalformedTest, OverflowingDimensions) {
  GgufWriter w;
  w.AddTensor("huge", GgmlType::kF32, {1ll << 32, 1ll << 32}, Floats(1));
  EXPECT_THAT(ParseError(w.Serialize()), HasSubstr("tensor 'huge' element count overflows"));
  GgufWriter bytes;  // elements fit in int64, bytes do not
  bytes.AddTensor("wide", GgmlType::kF32, {1ll << 31, 1ll << 31}, Floats(1));
  EXPECT_THAT(ParseError(bytes.Serialize()), HasSubstr("tensor 'wide' byte size overflows"));
}

TEST(GgufMalformedTest, RowNotMultipleOfBlock) {
  GgufWriter w;
  w.AddTensor("q", GgmlType::kQ8_0, {48, 2}, std::string(68, '\0'));
  EXPECT_THAT(ParseError(w.Serialize()),
              HasSubstr("tensor 'q' row size 48 is not a multiple of the Q8_0 block size 32"));
}

TEST(GgufMalformedTest, UnknownTensorType) {
  // A type ggml defines but the engine does not compute with: refused with
  // its ggml name and the tensor's name.
  GgufWriter w;
  w.AddTensor("k", static_cast<GgmlType>(16), {256}, std::string(66, '\0'));  // IQ2_XXS
  EXPECT_THAT(ParseError(w.Serialize()),
              HasSubstr("tensor 'k' has unsupported tensor type IQ2_XXS (ggml type id 16;"));
  GgufWriter never;  // an id ggml never used
  never.AddTensor("z", static_cast<GgmlType>(977), {32}, std::string(32, '\0'));
  EXPECT_THAT(ParseError(never.Serialize()),
              HasSubstr("tensor 'z' has unsupported tensor type unknown (ggml type id 977;"));
}

TEST(GgufMalformedTest, UnalignedOffset) {
  RawGguf r;
  r.Header(3, 1, 0).Tensor("w", {4}, 0, 8).PadTo(32).Zeros(64);
  EXPECT_THAT(ParseError(r.bytes()), HasSubstr("tensor 'w' offset 8 is not aligned to 32"));
}

TEST(GgufMalformedTest, TensorDataOutsideFile) {
  RawGguf r;
  r.Header(3, 1, 0).Tensor("w", {4}, 0, 1ull << 62).PadTo(32).Zeros(64);
  EXPECT_THAT(ParseError(r.bytes()), HasSubstr("tensor 'w' data [4611686018427387904, "));
  RawGguf wrap;  // offset + size wraps around 2^64
  wrap.Header(3, 1, 0).Tensor("w", {8}, 0, ~0ull - 31).PadTo(32).Zeros(64);
  EXPECT_THAT(ParseError(wrap.bytes()), HasSubstr("lies outside the file"));
  RawGguf no_data;  // the table ends right at the end of the file
  no_data.Header(3, 1, 0).Tensor("w", {4}, 0, 0).U8(0);
  EXPECT_THAT(ParseError(no_data.bytes()), HasSubstr("data section starts at"));
}

TEST(GgufMalformedTest, OverlappingTensors) {
  RawGguf r;
  r.Header(3, 2, 0).Tensor("a", {16}, 0, 32).Tensor("b", {16}, 0, 64).PadTo(32).Zeros(128);
  EXPECT_THAT(ParseError(r.bytes()),
              HasSubstr("tensor 'b' at offset 64 overlaps tensor 'a' [32, 96)"));
}

TEST(GgufMalformedTest, BadAlignment) {
  GgufWriter w = SmallWriter();
  w.SetU32("general.alignment", 48);
  EXPECT_THAT(ParseError(w.Serialize()), HasSubstr("general.alignment 48 is not a power of two"));
  w.SetU32("general.alignment", 0);
  EXPECT_THAT(ParseError(w.Serialize()), HasSubstr("general.alignment 0 is not a power of two"));
  w.SetU64("general.alignment", 32);
  EXPECT_THAT(ParseError(w.Serialize()), HasSubstr("general.alignment has type uint64"));
}

}  // namespace
}  // namespace kvserve
