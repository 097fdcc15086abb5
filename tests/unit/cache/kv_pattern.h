// Test helpers that write and check per-token K/V patterns through a table's
// blocks, the way the model's forward pass writes after Reserve. Each element
// gets its own salt, so a copy that misses a layer, a head or V shows up.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/block_table.h"
#include "cache/kv_pool.h"

namespace kvserve::testing_kv {

inline uint32_t Salted(uint32_t value, int32_t layer, int32_t kv, int32_t head, int32_t d) {
  return value * 2654435761u ^ (static_cast<uint32_t>(layer) << 24) ^
         (static_cast<uint32_t>(kv) << 23) ^ (static_cast<uint32_t>(head) << 16) ^
         static_cast<uint32_t>(d);
}

// Calls fn(element pointer, expected word) for every K and V element of token
// pos. REQUIRES: an f32 pool (one 32-bit word per element) and pos < num_tokens.
template <typename Fn>
void ForEachElement(const KvPool& pool, const BlockTable& table, int32_t pos, uint32_t value,
                    Fn fn) {
  std::vector<int32_t> ids;
  table.AppendIds(&ids);
  const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
  const kernels::PagedKvView v = pool.View(ids.data(), offsets, 1);
  for (int32_t l = 0; l < pool.options().n_layers; ++l) {
    for (int32_t h = 0; h < v.n_kv_heads; ++h) {
      uint8_t* k = v.KeyAt(l, 0, pos, h);
      uint8_t* val = v.ValueAt(l, 0, pos, h);
      for (int32_t d = 0; d < v.head_dim; ++d) {
        fn(k + 4 * d, Salted(value, l, 0, h, d));
        fn(val + 4 * d, Salted(value, l, 1, h, d));
      }
    }
  }
}

inline void WriteToken(const KvPool& pool, const BlockTable& table, int32_t pos, uint32_t value) {
  ForEachElement(pool, table, pos, value,
                 [](uint8_t* p, uint32_t word) { std::memcpy(p, &word, sizeof(word)); });
}

// True when every element of token pos holds the pattern of value.
inline bool TokenHolds(const KvPool& pool, const BlockTable& table, int32_t pos, uint32_t value) {
  bool ok = true;
  ForEachElement(pool, table, pos, value, [&ok](uint8_t* p, uint32_t word) {
    uint32_t got;
    std::memcpy(&got, p, sizeof(got));
    ok = ok && got == word;
  });
  return ok;
}

// The raw bytes of one block, to show a block was left untouched.
inline std::vector<uint8_t> BlockBytes(const KvPool& pool, BlockHandle h) {
  const int32_t ids[1] = {h.id};
  const int32_t offsets[2] = {0, 1};
  const kernels::PagedKvView v = pool.View(ids, offsets, 1);
  const uint8_t* start = v.pool + static_cast<int64_t>(h.id) * v.block_bytes;
  return std::vector<uint8_t>(start, start + v.block_bytes);
}

}  // namespace kvserve::testing_kv
