// Mutation fuzzing of the GGUF reader: truncations at every structural
// boundary, byte flips and numeric fields forced to extreme values, over real
// and writer-made files. Each input must either fail with a Status or load
// into a file whose every tensor and metadata value can be read in bounds.
// Each mutated input lives in its own exact-size heap allocation so that
// AddressSanitizer (CI runs this test under it) flags any read past the end.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/gguf.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

// One field of a valid GGUF file, found by walking its structure.
struct Field {
  size_t offset;
  int width;  // 4 or 8 for numeric fields; 0 for a boundary without a width
};

// The structure of a valid file: field offsets and where the table ends.
struct Layout {
  std::vector<Field> fields;
  size_t table_end = 0;
};

// A deliberately separate, minimal walker (not the reader under test). Long
// arrays contribute only their first and last few elements: the structure
// in between repeats and would only slow the test down.
class Walker {
 public:
  explicit Walker(const std::string& b) : b_(b) {}

  Layout Walk() {
    Num(4);  // magic
    Num(4);  // version
    const uint64_t n_tensors = Num(8);
    const uint64_t n_kv = Num(8);
    for (uint64_t i = 0; i < n_kv; ++i) {
      String();
      const auto type = static_cast<uint32_t>(Num(4));
      Value(type, /*record=*/true);
    }
    for (uint64_t i = 0; i < n_tensors; ++i) {
      String();
      const uint64_t n_dims = Num(4);
      for (uint64_t d = 0; d < n_dims; ++d) Num(8);
      Num(4);  // type
      Num(8);  // offset
    }
    layout_.table_end = pos_;
    return layout_;
  }

 private:
  uint64_t Num(int width, bool record = true) {
    if (record) layout_.fields.push_back({pos_, width});
    uint64_t v = 0;
    std::memcpy(&v, b_.data() + pos_, static_cast<size_t>(width));
    pos_ += static_cast<size_t>(width);
    return v;
  }
  void String(bool record = true) {
    const uint64_t len = Num(8, record);
    if (record) layout_.fields.push_back({pos_, 0});
    pos_ += len;
  }
  void Value(uint32_t type, bool record) {
    static constexpr int kWidth[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type == 8) return String(record);
    if (type != 9) {
      if (record) layout_.fields.push_back({pos_, kWidth[type] >= 4 ? kWidth[type] : 0});
      pos_ += static_cast<size_t>(kWidth[type]);
      return;
    }
    const auto elem = static_cast<uint32_t>(Num(4, record));
    const uint64_t count = Num(8, record);
    for (uint64_t i = 0; i < count; ++i) {
      Value(elem, record && (i < 4 || i + 4 >= count));
    }
  }

  const std::string& b_;
  size_t pos_ = 0;
  Layout layout_;
};

class GgufFuzzer {
 public:
  GgufFuzzer(std::string base, uint64_t seed, size_t alignment = 32)
      : base_(std::move(base)), work_(std::make_unique<uint8_t[]>(base_.size())), rng_(seed) {
    Restore();
    layout_ = Walker(base_).Walk();
    data_start_ = (layout_.table_end + alignment - 1) / alignment * alignment;
  }

  uint64_t Rand(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  const Layout& layout() const { return layout_; }
  size_t data_start() const { return data_start_; }
  const std::string& base() const { return base_; }

  // Parses `size` bytes at `buf`; true when they loaded.
  bool Check(const uint8_t* buf, size_t size, const std::string& what) {
    ++runs_;
    auto file = GgufFile::FromBuffer(buf, size);
    if (!file.ok()) {
      EXPECT_FALSE(file.status().message().empty()) << what;
      ++errors_;
      return false;
    }
    Exercise(**file, buf, size, what);
    return true;
  }

  bool CheckBase() { return Check(work_.get(), base_.size(), "unmodified"); }

  void Truncations() {
    std::vector<size_t> cuts = {0, 1, 3, 4, 7, 8, 15, 16, 23, 24};
    for (const Field& f : layout_.fields) {
      for (size_t c : {f.offset, f.offset + 1, f.offset + (f.width ? f.width - 1 : 2)}) {
        cuts.push_back(c);
      }
    }
    cuts.push_back(layout_.table_end);
    cuts.push_back(data_start_ - 1);
    cuts.push_back(base_.size() - 1);
    for (int i = 0; i < 100; ++i) cuts.push_back(Rand(base_.size()));
    const size_t n = base_.size();
    for (size_t cut : cuts) {
      if (cut >= n) continue;
      // The prefix goes at the end of the buffer, so reading past the cut is
      // reading past the allocation.
      uint8_t* start = work_.get() + (n - cut);
      std::memmove(start, base_.data(), cut);
      const bool loaded = Check(start, cut, "truncated at " + std::to_string(cut));
      // Cutting anywhere before the data section must be caught.
      if (cut < data_start_) {
        EXPECT_FALSE(loaded) << "truncated at " << cut;
      }
    }
    Restore();
  }

  void ByteFlips(int n) {
    for (int i = 0; i < n; ++i) {
      uint8_t* m = work_.get();
      std::vector<size_t> touched;
      const int flips = 1 + static_cast<int>(Rand(4));
      // Three in four land in the header and tables, where parsing happens.
      const bool header = Rand(4) != 0;
      for (int k = 0; k < flips; ++k) {
        const size_t at = header ? Rand(layout_.table_end) : Rand(base_.size());
        m[at] = static_cast<uint8_t>(m[at] ^ (1 + Rand(255)));
        touched.push_back(at);
      }
      Check(m, base_.size(), "byte flips #" + std::to_string(i));
      for (size_t at : touched) m[at] = static_cast<uint8_t>(base_[at]);
    }
  }

  // Every numeric field set to 0, max, and a random value; a sample also to
  // values that sit on boundaries (sign bit, 2^32).
  void NumericFields() {
    for (const Field& f : layout_.fields) {
      if (f.width == 0) continue;
      std::vector<uint64_t> values = {0, ~0ull, rng_(), 1};
      if (Rand(4) == 0) {
        values.push_back(1ull << 63);
        values.push_back(1ull << 31);
        values.push_back(0xffffffffull);
        values.push_back(Rand(64));
      }
      for (uint64_t v : values) {
        uint8_t* field = work_.get() + f.offset;
        std::memcpy(field, &v, static_cast<size_t>(f.width));
        Check(work_.get(), base_.size(),
              "field at " + std::to_string(f.offset) + " = " + std::to_string(v));
        std::memcpy(field, base_.data() + f.offset, static_cast<size_t>(f.width));
      }
    }
  }

  int runs() const { return runs_; }
  int errors() const { return errors_; }

 private:
  // A loaded file must be fully readable: every tensor byte range inside the
  // buffer (first and last byte read), every metadata value through every
  // getter that could apply.
  static void Exercise(const GgufFile& f, const uint8_t* buf, size_t size,
                       const std::string& what) {
    volatile uint8_t sink = 0;
    for (const GgufTensorInfo& t : f.tensors()) {
      ASSERT_GE(t.data, buf) << what << ": " << t.name;
      ASSERT_GT(t.n_bytes, 0u) << what << ": " << t.name;
      ASSERT_LE(t.n_bytes, size - static_cast<size_t>(t.data - buf)) << what << ": " << t.name;
      sink = sink + t.data[0] + t.data[t.n_bytes - 1];
      ASSERT_EQ(f.FindTensor(t.name), &t) << what;
      EXPECT_GT(t.n_elements(), 0) << what;
    }
    for (const std::string& key : f.Keys()) {
      ASSERT_TRUE(f.Has(key)) << what;
      (void)f.GetU32(key);
      (void)f.GetI64(key);
      (void)f.GetF32(key);
      (void)f.GetBool(key);
      if (auto s = f.GetString(key); s.ok()) sink = sink + static_cast<uint8_t>(s->size());
      if (auto a = f.GetStringArray(key); a.ok()) {
        for (const std::string& e : *a) sink = sink + static_cast<uint8_t>(e.size());
      }
      (void)f.GetF32Array(key);
      (void)f.GetI32Array(key);
    }
    (void)sink;
  }

  void Restore() { std::memcpy(work_.get(), base_.data(), base_.size()); }

  std::string base_;
  // Mutations happen in place in this exact-size heap copy of base_ (and are
  // undone after each check), so AddressSanitizer sees its true end.
  std::unique_ptr<uint8_t[]> work_;
  std::mt19937_64 rng_;  // the engine is specified by the standard: same sequence everywhere
  Layout layout_;
  size_t data_start_ = 0;
  int runs_ = 0;
  int errors_ = 0;
};

std::string ReadAll(const std::string& path) {
  std::string out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

void FuzzAll(const std::string& base, uint64_t seed, size_t alignment = 32) {
  GgufFuzzer fz(base, seed, alignment);
  ASSERT_TRUE(fz.CheckBase()) << "the base file must load";
  fz.Truncations();
  fz.ByteFlips(400);
  fz.NumericFields();
  std::printf("  %d mutated inputs, %d rejected, %d loaded\n", fz.runs(), fz.errors(),
              fz.runs() - fz.errors());
  EXPECT_GT(fz.runs(), 500);
  EXPECT_GT(fz.errors(), fz.runs() / 4);  // the mutations do reach the checks
}

TEST(GgufFuzzTest, WriterTinyLlamaQ8) {
  testing::TinyLlamaOptions o;
  o.weight_type = GgmlType::kQ8_0;
  o.n_layers = 1;
  FuzzAll(testing::MakeTinyLlamaGguf(o), 1);
}

// Every accepted tensor type, a non-default alignment, and version 2.
TEST(GgufFuzzTest, WriterAllTypesV2) {
  testing::GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("general.alignment", 64);
  w.SetStringArray("words", {"x", "yy", "zzz", "", "w"});
  w.SetF32Array("scores", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  w.SetI32Array("ids", {-1, 0, 1});
  w.SetU64("big", 1ull << 40);
  w.SetBool("flag", false);
  w.SetF32("f", 0.25f);
  std::vector<float> values(64 * 2);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.01f - 0.5f;
  w.AddTensorFromFloats("f32", GgmlType::kF32, {64, 2}, values);
  w.AddTensorFromFloats("f16", GgmlType::kF16, {64, 2}, values);
  w.AddTensorFromFloats("bf16", GgmlType::kBF16, {64, 2}, values);
  w.AddTensorFromFloats("q8_0", GgmlType::kQ8_0, {64, 2}, values);
  w.AddTensorFromFloats("q4_0", GgmlType::kQ4_0, {64, 2}, values);
  w.AddTensorFromFloats("q4_1", GgmlType::kQ4_1, {64, 1, 2}, values);
  FuzzAll(w.Serialize(2, 64), 2, 64);
}

TEST(GgufFuzzTest, Stories260K) {
  const std::string path = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(path, "stories260K.gguf");
  const std::string base = ReadAll(path);
  ASSERT_FALSE(base.empty());
  FuzzAll(base, 3);
}

// The mmap path sees the same mutations as the buffer path.
TEST(GgufFuzzTest, MutatedFilesThroughOpen) {
  testing::TinyLlamaOptions o;
  o.n_layers = 1;
  o.weight_type = GgmlType::kQ4_0;
  const std::string base = testing::MakeTinyLlamaGguf(o);
  GgufFuzzer fz(base, 4);
  const std::string path = testing::TempDir() + "/fuzz-open.gguf";
  int loaded = 0;
  for (int i = 0; i < 24; ++i) {
    std::string m = base;
    if (i % 3 == 0) {
      m.resize(fz.Rand(base.size()));
    } else if (i % 3 == 1) {
      const size_t at = fz.Rand(fz.layout().table_end);
      m[at] = static_cast<char>(m[at] ^ 0x5a);
    } else {
      const Field& f = fz.layout().fields[fz.Rand(fz.layout().fields.size())];
      if (f.width != 0) std::memset(m.data() + f.offset, 0xff, static_cast<size_t>(f.width));
    }
    FILE* out = std::fopen(path.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    std::fwrite(m.data(), 1, m.size(), out);
    std::fclose(out);
    auto file = GgufFile::Open(path);
    if (file.ok()) {
      ++loaded;
      for (const GgufTensorInfo& t : (*file)->tensors()) {
        volatile uint8_t sink = t.data[0];
        sink = t.data[t.n_bytes - 1];
        (void)sink;
      }
    } else {
      EXPECT_NE(file.status().message().find(path), std::string::npos) << file.status();
    }
  }
  std::remove(path.c_str());
  SUCCEED() << loaded << " of 24 mutated files loaded";
}

}  // namespace
}  // namespace kvserve
