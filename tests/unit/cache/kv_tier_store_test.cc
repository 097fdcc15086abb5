// The host and disk KV tiers as stores: a page is visible only once its
// write completed (host: published with its checksum; disk: fsynced, closed
// and renamed), a pinned page is never evicted, a full tier refuses rather
// than waits, a failed disk write is never visible and leaves no file, and
// a reopened disk tier finds its blocks under the same fingerprint only.
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "cache/disk_tier.h"
#include "cache/host_tier.h"
#include "gtest/gtest.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

constexpr int64_t kPage = 256;

std::vector<uint8_t> Pattern(uint64_t seed) {
  std::vector<uint8_t> p(kPage);
  for (int64_t i = 0; i < kPage; ++i) p[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return p;
}

uint64_t Sum(const std::vector<uint8_t>& p) { return XXH3_64bits(p.data(), p.size()); }

TEST(HostTierTest, APageIsInvisibleUntilPublished) {
  HostTier t(4 * kPage, kPage);
  uint8_t* page = nullptr;
  std::vector<EvictedPage> ev;
  ASSERT_EQ(t.Reserve(7, 0, &page, &ev), HostTier::ReserveResult::kReserved);
  uint64_t cs = 0;
  EXPECT_FALSE(t.Contains(7));
  EXPECT_EQ(t.Pin(7, &cs), nullptr) << "a half-written page must not be read";
  const std::vector<uint8_t> p = Pattern(7);
  std::memcpy(page, p.data(), kPage);
  t.Publish(7, Sum(p));
  EXPECT_TRUE(t.Contains(7));
  const uint8_t* r = t.Pin(7, &cs);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(cs, Sum(p));
  EXPECT_EQ(std::memcmp(r, p.data(), kPage), 0);
  t.Unpin(7);
  EXPECT_EQ(t.Reserve(7, 3, &page, &ev), HostTier::ReserveResult::kPresent);
  EXPECT_EQ(t.stats().pinned, 0);
}

TEST(HostTierTest, LruSkipsPinnedPagesAndAFullTierRefusesInsteadOfWaiting) {
  HostTier t(2 * kPage, kPage);
  uint8_t* page = nullptr;
  std::vector<EvictedPage> ev;
  for (uint64_t h : {1, 2}) {
    ASSERT_EQ(t.Reserve(h, 5, &page, &ev), HostTier::ReserveResult::kReserved);
    t.Publish(h, 0);
  }
  uint64_t cs;
  ASSERT_NE(t.Pin(1, &cs), nullptr);  // 1 is being read: 2 must go first
  ASSERT_EQ(t.Reserve(3, 0, &page, &ev), HostTier::ReserveResult::kReserved);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].hash, 2u);
  EXPECT_GE(ev[0].hits, 5) << "hits travel with the page (the disk tier's admission rule)";
  EXPECT_TRUE(t.Contains(1));
  // Now 1 is pinned by its reader and 3 by its writer: nothing can go.
  ev.clear();
  EXPECT_EQ(t.Reserve(4, 0, &page, &ev), HostTier::ReserveResult::kFull);
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(t.stats().full_drops, 1);
  t.Publish(3, 0);
  t.Unpin(1);
  EXPECT_EQ(t.Reserve(4, 0, &page, &ev), HostTier::ReserveResult::kReserved);
  t.Abort(4);
  EXPECT_FALSE(t.Contains(4));
  EXPECT_EQ(t.stats().pinned, 0);
}

// Host pages from an arena (pinned memory for a device pool): carved a chunk
// at a time up to its limit, reused when returned (a page evicted from the
// tier goes back), and a tier whose arena is out refuses like a full tier.
TEST(HostTierTest, ArenaPagesAreCarvedByChunkReusedAndBounded) {
  std::vector<std::unique_ptr<uint8_t[]>> chunks;
  int chunk_allocs = 0;
  PageArena arena(
      100, 5, 2,
      [&](size_t bytes) -> void* {
        ++chunk_allocs;
        EXPECT_EQ(bytes % 128, 0u) << "pages of 100 bytes on a 64-byte stride";
        chunks.push_back(std::make_unique<uint8_t[]>(bytes));
        return chunks.back().get();
      },
      [](void*) {});
  {
    PageBuffer a = arena.Allocate(), b = arena.Allocate();
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(chunk_allocs, 1);
    EXPECT_EQ(b.get() - a.get(), 128) << "one chunk, consecutive pages";
    EXPECT_EQ(arena.pages_out(), 2);
  }
  EXPECT_EQ(arena.pages_out(), 0) << "a dropped page goes back to its arena";
  HostTier tier(100 * 10, 100, &arena);  // room for 10 pages, the arena for 5
  std::vector<EvictedPage> evicted;
  uint8_t* page = nullptr;
  for (uint64_t h = 1; h <= 5; ++h) {
    ASSERT_EQ(tier.Reserve(h, 0, &page, &evicted), HostTier::ReserveResult::kReserved);
    tier.Publish(h, 0);
  }
  EXPECT_EQ(arena.pages_made(), 5);
  EXPECT_EQ(chunk_allocs, 3) << "the last chunk holds only the fifth page";
  EXPECT_EQ(tier.Reserve(6, 0, &page, &evicted), HostTier::ReserveResult::kFull)
      << "the arena is out: refused, not waited for";
  tier.Remove(1);
  EXPECT_EQ(tier.Reserve(6, 0, &page, &evicted), HostTier::ReserveResult::kReserved)
      << "a removed page's memory is reused";
  tier.Publish(6, 0);
  EXPECT_EQ(arena.pages_made(), 5);
  EXPECT_EQ(arena.pages_out(), 5);
}

TEST(HostTierTest, RemovingAPinnedPageWaitsForItsReader) {
  HostTier t(2 * kPage, kPage);
  uint8_t* page = nullptr;
  std::vector<EvictedPage> ev;
  ASSERT_EQ(t.Reserve(1, 0, &page, &ev), HostTier::ReserveResult::kReserved);
  t.Publish(1, 0);
  uint64_t cs;
  ASSERT_NE(t.Pin(1, &cs), nullptr);
  t.Remove(1);
  EXPECT_FALSE(t.Contains(1)) << "no new reader";
  EXPECT_EQ(t.stats().pages, 1) << "the reader's memory stays";
  t.Unpin(1);
  EXPECT_EQ(t.stats().pages, 0);
}

// A file layer that fails the writes it is told to (disk full).
class FailingFiles : public DiskFileLayer {
 public:
  absl::Status WriteDurably(const std::string& path,
                            const std::vector<std::pair<const void*, size_t>>& parts) override {
    if (fail_writes.load()) {
      // A partial file, as a full disk leaves one.
      std::ofstream(path) << "partial";
      return absl::ResourceExhaustedError("No space left on device");
    }
    return real()->WriteDurably(path, parts);
  }
  absl::Status Rename(const std::string& a, const std::string& b) override {
    return real()->Rename(a, b);
  }
  absl::Status ReadAt(const std::string& p, int64_t o, void* out, size_t n) override {
    return real()->ReadAt(p, o, out, n);
  }
  absl::Status Remove(const std::string& p) override { return real()->Remove(p); }
  absl::Status MakeDirs(const std::string& d) override { return real()->MakeDirs(d); }
  absl::StatusOr<std::vector<std::string>> List(const std::string& d) override {
    return real()->List(d);
  }
  std::atomic<bool> fail_writes{false};

 private:
  static DiskFileLayer* real() { return PosixDiskFileLayer(); }
};

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "/disk-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<DiskTier> Open(const std::string& fp, int64_t files = 8,
                                 DiskTierRecovery* rec = nullptr, DiskFileLayer* fs = nullptr) {
    DiskTierOptions o;
    o.dir = dir_;
    o.fingerprint = fp;
    o.page_bytes = kPage;
    o.capacity_bytes = files * (kPage + 64);
    o.files = fs;
    auto t = DiskTier::Open(o, rec);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(t).value() : nullptr;
  }
  std::string dir_;
};

TEST_F(DiskTierTest, StoredBlocksReadBackAndSurviveAReopen) {
  {
    auto t = Open("aaaa");
    for (uint64_t h = 1; h <= 3; ++h) ASSERT_TRUE(t->Store(h, Pattern(h).data(), Sum(Pattern(h)), 2).ok());
    EXPECT_EQ(t->stats().files, 3);
  }
  DiskTierRecovery rec;
  auto t = Open("aaaa", 8, &rec);
  EXPECT_EQ(rec.recovered, 3);
  EXPECT_EQ(rec.other_fingerprints, 0);
  uint64_t cs = 0;
  ASSERT_TRUE(t->Pin(2, &cs));
  std::vector<uint8_t> out(kPage);
  ASSERT_TRUE(t->Read(2, out.data()).ok());
  t->Unpin(2);
  EXPECT_EQ(out, Pattern(2));
  EXPECT_EQ(cs, Sum(Pattern(2)));
}

TEST_F(DiskTierTest, AnotherFingerprintSeesNothingAndIsCounted) {
  {
    auto t = Open("aaaa");
    ASSERT_TRUE(t->Store(1, Pattern(1).data(), Sum(Pattern(1)), 2).ok());
  }
  DiskTierRecovery rec;
  auto t = Open("bbbb", 8, &rec);
  EXPECT_EQ(rec.recovered, 0);
  EXPECT_EQ(rec.other_fingerprints, 1);
  EXPECT_FALSE(t->Contains(1));
}

TEST_F(DiskTierTest, AFailedWriteIsNeverVisibleAndLeavesNoFile) {
  FailingFiles fs;
  auto t = Open("aaaa", 8, nullptr, &fs);
  fs.fail_writes = true;
  EXPECT_FALSE(t->Store(5, Pattern(5).data(), Sum(Pattern(5)), 2).ok());
  EXPECT_FALSE(t->Contains(5));
  uint64_t cs;
  EXPECT_FALSE(t->Pin(5, &cs));
  EXPECT_EQ(t->stats().write_failures, 1);
  EXPECT_EQ(t->stats().files, 0);
  EXPECT_TRUE(std::filesystem::is_empty(t->directory())) << "the partial file was removed";
  fs.fail_writes = false;
  EXPECT_TRUE(t->Store(5, Pattern(5).data(), Sum(Pattern(5)), 2).ok()) << "a retry may succeed";
  EXPECT_TRUE(t->Contains(5));
}

TEST_F(DiskTierTest, TornAndForeignFilesAreDiscardedOnOpen) {
  std::string sub;
  {
    auto t = Open("aaaa");
    ASSERT_TRUE(t->Store(1, Pattern(1).data(), Sum(Pattern(1)), 2).ok());
    ASSERT_TRUE(t->Store(2, Pattern(2).data(), Sum(Pattern(2)), 2).ok());
    sub = t->directory();
  }
  // A torn file (cut short) and a leftover temporary.
  std::filesystem::resize_file(sub + "/0000000000000002.kv", 100);
  std::ofstream(sub + "/0000000000000003.tmp") << "x";
  DiskTierRecovery rec;
  auto t = Open("aaaa", 8, &rec);
  EXPECT_EQ(rec.recovered, 1);
  EXPECT_EQ(rec.discarded, 2);
  EXPECT_TRUE(t->Contains(1));
  EXPECT_FALSE(t->Contains(2));
}

TEST_F(DiskTierTest, BudgetEvictsLruButNeverAPinnedFile) {
  auto t = Open("aaaa", /*files=*/2);
  ASSERT_TRUE(t->Store(1, Pattern(1).data(), Sum(Pattern(1)), 2).ok());
  ASSERT_TRUE(t->Store(2, Pattern(2).data(), Sum(Pattern(2)), 2).ok());
  uint64_t cs;
  ASSERT_TRUE(t->Pin(1, &cs));  // 1 is being read
  ASSERT_TRUE(t->Store(3, Pattern(3).data(), Sum(Pattern(3)), 2).ok());
  EXPECT_TRUE(t->Contains(1));
  EXPECT_FALSE(t->Contains(2));
  ASSERT_TRUE(t->Pin(3, &cs));
  // Both files pinned: a store is refused, not queued behind the readers.
  EXPECT_TRUE(absl::IsResourceExhausted(t->Store(4, Pattern(4).data(), Sum(Pattern(4)), 2)));
  t->Unpin(1);
  t->Unpin(3);
  EXPECT_TRUE(t->Store(4, Pattern(4).data(), Sum(Pattern(4)), 2).ok());
}

TEST_F(DiskTierTest, BadOptionsAreNamed) {
  DiskTierOptions o;
  o.dir = dir_;
  o.fingerprint = "aaaa";
  o.page_bytes = kPage;
  o.capacity_bytes = 10;
  auto t = DiskTier::Open(o, nullptr);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("--kv-disk-bytes"), std::string::npos) << t.status();
}

}  // namespace
}  // namespace kvserve
