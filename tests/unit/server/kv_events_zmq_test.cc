// The vLLM-format KV event encoder (server/observe/kv_events_zmq.h): exact msgpack
// bytes, worked out by hand from msgspec's rules for vLLM's structs (map,
// "type" tag first, declared field order, None defaults omitted, smallest
// integer forms), and the translation of the prefix cache's events.
#include "server/observe/kv_events_zmq.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvserve {
namespace {

std::string Str(const std::string& s) {
  // fixstr: every key and value in these tests is under 32 bytes.
  return std::string(1, static_cast<char>(0xa0 | s.size())) + s;
}

std::string Bytes(std::initializer_list<int> b) {
  std::string out;
  for (int c : b) out.push_back(static_cast<char>(c));
  return out;
}

TEST(VllmEventEncoderTest, BlockRemovedBatchIsMsgspecBytes) {
  VllmKvEvent r;
  r.kind = VllmKvEvent::Kind::kBlockRemoved;
  r.block_hashes = {5, 300};
  VllmEventFormat f;
  f.medium = "CPU";
  const std::string want =
      Bytes({0x83}) + Str("ts") + Bytes({0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}) + Str("events") +
      Bytes({0x91}) + Bytes({0x83}) + Str("type") + Str("BlockRemoved") + Str("block_hashes") +
      Bytes({0x92, 0x05, 0xcd, 0x01, 0x2c}) + Str("medium") + Str("CPU") +
      Str("data_parallel_rank") + Bytes({0x00});
  EXPECT_EQ(EncodeVllmEventBatch(1.5, {r}, f), want);
}

TEST(VllmEventEncoderTest, BlockStoredFieldsInDeclaredOrder) {
  VllmKvEvent s;
  s.kind = VllmKvEvent::Kind::kBlockStored;
  s.block_hashes = {0xfedcba9876543210ull};
  s.token_ids = {1, 200, 70000};
  VllmEventFormat f;
  f.block_size = 3;
  f.medium = "GPU";
  f.data_parallel_rank = 2;
  const std::string stored =
      Bytes({0x88}) + Str("type") + Str("BlockStored") + Str("block_hashes") +
      Bytes({0x91, 0xcf, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10}) +
      Str("parent_block_hash") + Bytes({0xc0}) + Str("token_ids") +
      Bytes({0x93, 0x01, 0xcc, 0xc8, 0xce, 0x00, 0x01, 0x11, 0x70}) + Str("block_size") +
      Bytes({0x03}) + Str("lora_id") + Bytes({0xc0}) + Str("medium") + Str("GPU") +
      Str("lora_name") + Bytes({0xc0});
  const std::string want = Bytes({0x83}) + Str("ts") + Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0}) +
                           Str("events") + Bytes({0x91}) + stored + Str("data_parallel_rank") +
                           Bytes({0x02});
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {s}, f), want);

  // A parent and extra keys: the parent as an integer, extra_keys after
  // lora_name (one entry per block: an array, or nil for none; a key that
  // is not UTF-8 goes as bin).
  s.parent_block_hash = 7;
  s.block_hashes = {8, 9};
  s.token_ids = {1, 2, 3, 4, 5, 6};
  s.extra_keys = {{"salt"}, {}};
  std::string with = EncodeVllmEventBatch(0.0, {s}, f);
  EXPECT_NE(with.find(Bytes({0x89}) + Str("type")), std::string::npos);
  EXPECT_NE(with.find(Str("parent_block_hash") + Bytes({0x07})), std::string::npos);
  EXPECT_NE(with.find(Str("lora_name") + Bytes({0xc0}) + Str("extra_keys") +
                      Bytes({0x92, 0x91}) + Str("salt") + Bytes({0xc0})),
            std::string::npos);
  s.extra_keys = {{std::string("\xffpub", 4)}, {}};
  with = EncodeVllmEventBatch(0.0, {s}, f);
  EXPECT_NE(with.find(Bytes({0x92, 0x91, 0xc4, 0x04, 0xff}) + "pub" + Bytes({0xc0})),
            std::string::npos);
}

// A hybrid model's stream (KV cache groups): group_idx and the KV cache
// spec follow extra_keys in vLLM's declared order, each only when set (None
// defaults stay off); BlockRemoved gains group_idx after medium.
TEST(VllmEventEncoderTest, GroupFieldsFollowInDeclaredOrderOnlyWhenSet) {
  VllmKvEvent s;
  s.kind = VllmKvEvent::Kind::kBlockStored;
  s.block_hashes = {9};
  s.token_ids = {4};
  VllmEventFormat f;
  f.block_size = 1;
  f.medium = "CPU";
  f.group_idx = 0;
  f.kv_cache_spec_kind = "full_attention";
  const std::string head = Bytes({0x83}) + Str("ts") + Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0}) +
                           Str("events") + Bytes({0x91});
  const std::string common = Str("type") + Str("BlockStored") + Str("block_hashes") +
                             Bytes({0x91, 0x09}) + Str("parent_block_hash") + Bytes({0xc0}) +
                             Str("token_ids") + Bytes({0x91, 0x04}) + Str("block_size") +
                             Bytes({0x01}) + Str("lora_id") + Bytes({0xc0}) + Str("medium") +
                             Str("CPU") + Str("lora_name") + Bytes({0xc0});
  const std::string tail = Str("data_parallel_rank") + Bytes({0x00});
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {s}, f),
            head + Bytes({0x8a}) + common + Str("group_idx") + Bytes({0x00}) +
                Str("kv_cache_spec_kind") + Str("full_attention") + tail);

  // A window group: the window as msgspec's smallest integer (uint16 for
  // 512), after the kind; with extra keys those come first.
  f.group_idx = 3;
  f.kv_cache_spec_kind = "sliding_window";
  f.kv_cache_spec_sliding_window = 512;
  s.extra_keys = {{"t"}};
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {s}, f),
            head + Bytes({0x8c}) + common + Str("extra_keys") + Bytes({0x91, 0x91}) + Str("t") +
                Str("group_idx") + Bytes({0x03}) + Str("kv_cache_spec_kind") +
                Str("sliding_window") + Str("kv_cache_spec_sliding_window") +
                Bytes({0xcd, 0x02, 0x00}) + tail);

  VllmKvEvent r;
  r.kind = VllmKvEvent::Kind::kBlockRemoved;
  r.block_hashes = {5};
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {r}, f),
            head + Bytes({0x84}) + Str("type") + Str("BlockRemoved") + Str("block_hashes") +
                Bytes({0x91, 0x05}) + Str("medium") + Str("CPU") + Str("group_idx") +
                Bytes({0x03}) + tail);

  // One group (the fields unset): today's bytes, nothing added.
  VllmEventFormat one;
  one.block_size = 1;
  one.medium = "CPU";
  s.extra_keys.clear();
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {s}, one), head + Bytes({0x88}) + common + tail);
}

// Every KV cache group publishing (VllmEventFormat::group_windows): each
// event carries its own group_idx and that group's spec: full attention
// without a window, a window group its window.
TEST(VllmEventEncoderTest, EachEventCarriesItsOwnGroupAndSpec) {
  VllmKvEvent s;
  s.kind = VllmKvEvent::Kind::kBlockStored;
  s.block_hashes = {9};
  s.token_ids = {4};
  VllmEventFormat f;
  f.block_size = 1;
  f.medium = "CPU";
  f.group_windows = {0, 512, 512};
  const std::string head = Bytes({0x83}) + Str("ts") + Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0}) +
                           Str("events") + Bytes({0x92});
  const std::string common = Str("type") + Str("BlockStored") + Str("block_hashes") +
                             Bytes({0x91, 0x09}) + Str("parent_block_hash") + Bytes({0xc0}) +
                             Str("token_ids") + Bytes({0x91, 0x04}) + Str("block_size") +
                             Bytes({0x01}) + Str("lora_id") + Bytes({0xc0}) + Str("medium") +
                             Str("CPU") + Str("lora_name") + Bytes({0xc0});
  const std::string tail = Str("data_parallel_rank") + Bytes({0x00});
  VllmKvEvent w = s;
  w.group = 2;
  EXPECT_EQ(EncodeVllmEventBatch(0.0, {s, w}, f),
            head + Bytes({0x8a}) + common + Str("group_idx") + Bytes({0x00}) +
                Str("kv_cache_spec_kind") + Str("full_attention") + Bytes({0x8b}) + common +
                Str("group_idx") + Bytes({0x02}) + Str("kv_cache_spec_kind") +
                Str("sliding_window") + Str("kv_cache_spec_sliding_window") +
                Bytes({0xcd, 0x02, 0x00}) + tail);
  VllmKvEvent r;
  r.kind = VllmKvEvent::Kind::kBlockRemoved;
  r.block_hashes = {5};
  r.group = 1;
  const std::string removed = EncodeVllmEventBatch(0.0, {r}, f);
  EXPECT_NE(removed.find(Str("medium") + Str("CPU") + Str("group_idx") + Bytes({0x01})),
            std::string::npos);
}

TEST(VllmEventEncoderTest, AllBlocksClearedIsATagAlone) {
  VllmKvEvent c;
  c.kind = VllmKvEvent::Kind::kAllBlocksCleared;
  const std::string got = EncodeVllmEventBatch(0.0, {c}, VllmEventFormat());
  EXPECT_NE(got.find(Str("events") + Bytes({0x91, 0x81}) + Str("type") + Str("AllBlocksCleared") +
                     Str("data_parallel_rank")),
            std::string::npos);
}

KvCacheEvent Stored(uint64_t hash, uint64_t parent, std::vector<int32_t> tokens) {
  KvCacheEvent e;
  e.kind = KvCacheEvent::Kind::kBlockStored;
  e.block_hash = hash;
  e.parent_hash = parent;
  e.token_ids = std::move(tokens);
  return e;
}

KvCacheEvent Removed(uint64_t hash) {
  KvCacheEvent e;
  e.kind = KvCacheEvent::Kind::kBlockRemoved;
  e.block_hash = hash;
  return e;
}

TEST(VllmEventTranslatorTest, ChainsMergeAndPartialBlocksStayOut) {
  VllmEventTranslator t(2);
  std::vector<VllmKvEvent> out;
  t.Add(Stored(10, 0, {1, 2}), &out);
  t.Add(Stored(11, 10, {3, 4}), &out);
  t.Add(Stored(12, 11, {5}), &out);      // partial tail: not published
  t.Add(Stored(20, 10, {6, 7}), &out);   // a branch: a new event under 10
  t.Add(Stored(30, 0, {8, 9}), &out);    // a new root
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{10, 11}));
  EXPECT_FALSE(out[0].parent_block_hash.has_value());
  EXPECT_EQ(out[0].token_ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(out[1].block_hashes, (std::vector<uint64_t>{20}));
  EXPECT_EQ(out[1].parent_block_hash, 10u);
  EXPECT_EQ(out[2].block_hashes, (std::vector<uint64_t>{30}));
  EXPECT_EQ(t.published_blocks(), 4u);

  out.clear();
  t.Add(Removed(12), &out);  // never published
  t.Add(Removed(11), &out);
  t.Add(Removed(20), &out);
  t.Add(Removed(99), &out);  // unknown
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, VllmKvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{11, 20}));

  // A snapshot starts over: AllBlocksCleared, then the index.
  out.clear();
  t.AddSnapshot({Stored(10, 0, {1, 2}), Stored(40, 10, {1, 1})}, &out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, VllmKvEvent::Kind::kAllBlocksCleared);
  EXPECT_EQ(out[1].block_hashes, (std::vector<uint64_t>{10, 40}));
  EXPECT_EQ(t.published_blocks(), 2u);
}

// KV cache groups: the same hashes in two groups are published once per
// group, chains never merge across groups, a group's removal removes its
// own block only, and a snapshot clears and re-lists every group.
TEST(VllmEventTranslatorTest, EachGroupPublishesItsOwnBlocksUnderTheSameHashes) {
  auto in_group = [](KvCacheEvent e, int32_t g) {
    e.group = g;
    return e;
  };
  VllmEventTranslator t(2);
  std::vector<VllmKvEvent> out;
  t.Add(Stored(10, 0, {1, 2}), &out);
  t.Add(in_group(Stored(10, 0, {1, 2}), 1), &out);
  t.Add(in_group(Stored(11, 10, {3, 4}), 1), &out);
  t.Add(Stored(11, 10, {3, 4}), &out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].group, 0);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{10}));
  EXPECT_EQ(out[1].group, 1);
  EXPECT_EQ(out[1].block_hashes, (std::vector<uint64_t>{10, 11}));
  EXPECT_EQ(out[2].group, 0);
  EXPECT_EQ(out[2].block_hashes, (std::vector<uint64_t>{11}));
  EXPECT_EQ(t.published_blocks(), 4u);
  out.clear();
  t.Add(in_group(Removed(11), 1), &out);
  t.Add(in_group(Removed(11), 1), &out);  // already gone from group 1
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].group, 1);
  EXPECT_EQ(t.published_blocks(), 3u);
  out.clear();
  t.Add(Removed(11), &out);  // group 0's own copy is still published
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].group, 0);
  out.clear();
  t.AddSnapshot({Stored(10, 0, {1, 2}), in_group(Stored(10, 0, {1, 2}), 1)}, &out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].kind, VllmKvEvent::Kind::kAllBlocksCleared);
  EXPECT_EQ(out[2].group, 1);
  EXPECT_EQ(t.published_blocks(), 2u);
}

// A namespaced chain (cache_salt, tenant) carries its scope as the first
// block's extra keys, None for the rest; a default-namespace chain has no
// extra_keys at all (vLLM's None).
TEST(VllmEventTranslatorTest, ScopedFirstBlockCarriesItsNamespaceInExtraKeys) {
  VllmEventTranslator t(2);
  std::vector<VllmKvEvent> out;
  KvCacheEvent first = Stored(10, 0, {1, 2});
  first.scope = "tenant:acme\x1fsalt-7";
  t.Add(first, &out);
  t.Add(Stored(11, 10, {3, 4}), &out);
  t.Add(Stored(30, 0, {8, 9}), &out);  // default namespace
  t.Add(Stored(31, 30, {8, 8}), &out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{10, 11}));
  ASSERT_EQ(out[0].extra_keys.size(), 2u);
  EXPECT_EQ(out[0].extra_keys[0], (std::vector<std::string>{"tenant:acme\x1fsalt-7"}));
  EXPECT_TRUE(out[0].extra_keys[1].empty());
  EXPECT_TRUE(out[1].extra_keys.empty());
  // The encoded batch names the scope after lora_name.
  const std::string bytes = EncodeVllmEventBatch(1.0, out, VllmEventFormat{});
  EXPECT_NE(bytes.find("tenant:acme\x1fsalt-7"), std::string::npos);
  // A snapshot keeps the scope (the event log's replica remembers it).
  out.clear();
  t.AddSnapshot({first}, &out);
  ASSERT_EQ(out.size(), 2u);
  ASSERT_EQ(out[1].extra_keys.size(), 1u);
  EXPECT_EQ(out[1].extra_keys[0][0], first.scope);
}

// Tier moves (issue 42's medium): a block demoted to the host tier is a
// BlockRemoved with medium GPU and a BlockStored with medium CPU, a spill to
// the disk a BlockStored "Disk" and a BlockRemoved "CPU", and the block
// promoted back a BlockStored "GPU" again; each tier's events stay apart
// (never merged into another tier's event), and a clear of the index keeps
// the tiers' pages published.
TEST(VllmEventTranslatorTest, TierMovesCarryTheirMedium) {
  VllmEventTranslator t(2);
  std::vector<VllmKvEvent> out;
  auto in = [](KvCacheEvent e, KvTier tier, KvTier moved_to = KvTier::kNone) {
    e.tier = tier;
    e.moved_to = moved_to;
    return e;
  };
  t.Add(Stored(10, 0, {1, 2}), &out);
  t.Add(Stored(11, 10, {3, 4}), &out);
  t.Add(in(Stored(11, 10, {3, 4}), KvTier::kHost), &out);  // demoted...
  t.Add(in(Removed(11), KvTier::kNone, KvTier::kHost), &out);  // ...out of the pool
  t.Add(in(Stored(11, 10, {3, 4}), KvTier::kDisk), &out);  // spilled...
  t.Add(in(Removed(11), KvTier::kHost, KvTier::kDisk), &out);  // ...out of the host
  t.Add(Stored(11, 10, {3, 4}), &out);  // promoted
  ASSERT_EQ(out.size(), 6u);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{10, 11}));
  EXPECT_EQ(out[1].block_hashes, (std::vector<uint64_t>{11}));  // not merged into the GPU's
  EXPECT_EQ(out[1].tier, KvTier::kHost);
  EXPECT_EQ(out[1].parent_block_hash, 10u);
  EXPECT_EQ(out[2].kind, VllmKvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[2].tier, KvTier::kNone);
  EXPECT_EQ(out[3].tier, KvTier::kDisk);
  EXPECT_EQ(out[4].kind, VllmKvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[4].tier, KvTier::kHost);
  EXPECT_EQ(out[5].kind, VllmKvEvent::Kind::kBlockStored);
  EXPECT_EQ(out[5].tier, KvTier::kNone);
  const VllmEventFormat f;
  // Each event's bytes name its tier's medium.
  auto medium_of = [&](const VllmKvEvent& e) {
    const std::string b = EncodeVllmEventBatch(1.0, {e}, f);
    for (const char* m : {"GPU", "CPU", "Disk"}) {
      if (b.find(Str("medium") + Str(m)) != std::string::npos) return std::string(m);
    }
    return std::string("?");
  };
  EXPECT_EQ(medium_of(out[0]), "GPU");
  EXPECT_EQ(medium_of(out[1]), "CPU");
  EXPECT_EQ(medium_of(out[2]), "GPU");
  EXPECT_EQ(medium_of(out[3]), "Disk");
  EXPECT_EQ(medium_of(out[4]), "CPU");
  EXPECT_EQ(medium_of(out[5]), "GPU");
  // Index cleared: the disk page stays published (its removal goes out).
  out.clear();
  KvCacheEvent clear;
  clear.kind = KvCacheEvent::Kind::kAllCleared;
  t.Add(clear, &out);
  t.Add(in(Removed(11), KvTier::kDisk), &out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].kind, VllmKvEvent::Kind::kBlockRemoved);
  EXPECT_EQ(medium_of(out[1]), "Disk");
}

}  // namespace
}  // namespace kvserve
