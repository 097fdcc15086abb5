// BlockTable: the ordered blocks holding one sequence's K/V, with
// copy-on-write sharing. Forking shares every block (n > 1 samples of one
// prompt); a table never writes into a block another table also references:
// before the first write into a shared, partially filled last block it takes
// a private copy.
//
// Not thread-safe: owned by the engine thread, like the pool it draws from.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "cache/kv_pool.h"

namespace kvserve {

class BlockTable {
 public:
  // REQUIRES: pool outlives the table.
  explicit BlockTable(KvPool* pool);
  ~BlockTable();  // releases every reference
  BlockTable(BlockTable&& other) noexcept;
  BlockTable& operator=(BlockTable&& other) noexcept;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  // Tokens whose K/V slots this table holds (written or about to be).
  int32_t num_tokens() const { return num_tokens_; }
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  const std::vector<BlockHandle>& blocks() const { return blocks_; }

  // Blocks Reserve(n) would take from the pool: new blocks for the tokens
  // past the last block's capacity, plus one copy when the last block is
  // shared and partially filled. Used by admission to dry-run a batch.
  int32_t BlocksNeeded(int32_t n) const;

  // Makes slots for n more tokens (num_tokens grows by n), copying a shared
  // partial last block first. ResourceExhausted when the pool lacks blocks;
  // then nothing changes.
  [[nodiscard]] absl::Status Reserve(int32_t n);

  // Takes over `blocks` (one reference each, now the table's) as holding the
  // first num_tokens tokens: a prefix-cache match. The last block may be
  // partly used and shared; Reserve copies it before writing into it.
  // REQUIRES: the table is empty and blocks cover num_tokens exactly
  // (ceil(num_tokens / block_size) blocks).
  void Adopt(std::vector<BlockHandle> blocks, int32_t num_tokens);

  // Shrinks the table to its first num_tokens slots, releasing the blocks
  // past ceil(num_tokens / block_size). Rolls back slots reserved for tokens
  // that will not be kept (rejected drafts, a failed step).
  // REQUIRES: 0 <= num_tokens <= this->num_tokens().
  void Truncate(int32_t num_tokens);

  // Gives the table its own copy of block `index` when another table or the
  // prefix cache also references it (a no-op for a block it alone holds), so
  // the caller may write any slot of it. ResourceExhausted when the pool has
  // no free block; then nothing changes.
  [[nodiscard]] absl::Status MakePrivate(int32_t index);

  // Points entry `index` at `shared` (one more reference on it) and drops
  // this table's reference on the block it held: a sliding-window sequence
  // parks blocks its window left on the manager's placeholder block.
  void ReplaceBlock(int32_t index, BlockHandle shared);

  // A new table sharing every block of this one (reference counts +1).
  BlockTable Fork() const;

  // Drops every reference; num_tokens becomes 0.
  void Release();

  // Appends the raw block ids (for the kernels' CSR view).
  void AppendIds(std::vector<int32_t>* out) const;

 private:
  KvPool* pool_;
  std::vector<BlockHandle> blocks_;
  int32_t num_tokens_ = 0;
};

}  // namespace kvserve
