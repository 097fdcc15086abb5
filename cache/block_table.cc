#include "cache/block_table.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvserve {

BlockTable::BlockTable(KvPool* pool) : pool_(pool) {}

BlockTable::~BlockTable() { Release(); }

// The source keeps its pool so it can be reused, but gives up every block:
// two tables must never believe they own the same references.
BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_),
      blocks_(std::exchange(other.blocks_, {})),
      num_tokens_(std::exchange(other.num_tokens_, 0)) {}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    blocks_ = std::exchange(other.blocks_, {});
    num_tokens_ = std::exchange(other.num_tokens_, 0);
  }
  return *this;
}

int32_t BlockTable::BlocksNeeded(int32_t n) const {
  if (n <= 0) return 0;
  const int32_t bs = pool_->block_size();
  const int64_t tokens = static_cast<int64_t>(num_tokens_) + n;
  const int64_t blocks = (tokens + bs - 1) / bs;
  int64_t needed = blocks > num_blocks() ? blocks - num_blocks() : 0;
  // The next token lands in the last block only when that block is partly
  // filled; a shared one must be copied before that write.
  if (!blocks_.empty() && num_tokens_ % bs != 0 && pool_->ref_count(blocks_.back()) > 1) {
    ++needed;
  }
  return static_cast<int32_t>(needed);
}

absl::Status BlockTable::Reserve(int32_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("cannot reserve ", n, " tokens"));
  if (n == 0) return absl::OkStatus();
  if (static_cast<int64_t>(num_tokens_) + n > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence of ", num_tokens_, " tokens cannot grow by ", n));
  }
  const int32_t bs = pool_->block_size();
  const bool copy_last =
      !blocks_.empty() && num_tokens_ % bs != 0 && pool_->ref_count(blocks_.back()) > 1;
  // One Allocate for the copy and the new blocks makes Reserve all-or-nothing:
  // on ResourceExhausted nothing has been copied, released or appended.
  std::vector<BlockHandle> fresh;
  absl::Status s = pool_->Allocate(BlocksNeeded(n), &fresh);
  if (!s.ok()) return s;
  size_t next = 0;
  if (copy_last) {
    const BlockHandle copy = fresh[next++];
    pool_->CopyBlock(blocks_.back(), copy);
    pool_->Release(blocks_.back());  // still live: another table holds it
    blocks_.back() = copy;
  }
  blocks_.insert(blocks_.end(), fresh.begin() + next, fresh.end());
  num_tokens_ += n;
  return absl::OkStatus();
}

void BlockTable::Adopt(std::vector<BlockHandle> blocks, int32_t num_tokens) {
  const int32_t bs = pool_->block_size();
  const int64_t want = (static_cast<int64_t>(num_tokens) + bs - 1) / bs;
  if (!blocks_.empty() || num_tokens_ != 0 || static_cast<int64_t>(blocks.size()) != want) {
    // A mismatch would let the kernels read slots no block backs.
    std::fprintf(stderr, "BlockTable::Adopt: %zu blocks for %d tokens into a table of %d\n",
                 blocks.size(), num_tokens, num_tokens_);
    std::abort();
  }
  blocks_ = std::move(blocks);
  num_tokens_ = num_tokens;
}

void BlockTable::Truncate(int32_t num_tokens) {
  if (num_tokens < 0 || num_tokens > num_tokens_) {
    std::fprintf(stderr, "BlockTable::Truncate: %d tokens in a table of %d\n", num_tokens,
                 num_tokens_);
    std::abort();
  }
  const int32_t bs = pool_->block_size();
  const size_t keep = static_cast<size_t>((num_tokens + bs - 1) / bs);
  if (keep < blocks_.size()) {
    pool_->Release(absl::MakeConstSpan(blocks_).subspan(keep));
    blocks_.resize(keep);
  }
  num_tokens_ = num_tokens;
}

absl::Status BlockTable::MakePrivate(int32_t index) {
  if (index < 0 || index >= num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat("no block ", index, " in a table of ",
                                                   num_blocks()));
  }
  if (pool_->ref_count(blocks_[index]) <= 1) return absl::OkStatus();
  std::vector<BlockHandle> fresh;
  absl::Status s = pool_->Allocate(1, &fresh);
  if (!s.ok()) return s;
  pool_->CopyBlock(blocks_[index], fresh[0]);
  pool_->Release(blocks_[index]);  // still live: someone else holds it
  blocks_[index] = fresh[0];
  return absl::OkStatus();
}

void BlockTable::ReplaceBlock(int32_t index, BlockHandle shared) {
  if (index < 0 || index >= num_blocks()) {
    std::fprintf(stderr, "BlockTable::ReplaceBlock: no block %d in a table of %d\n", index,
                 num_blocks());
    std::abort();
  }
  pool_->AddRef(shared);
  pool_->Release(blocks_[index]);
  blocks_[index] = shared;
}

BlockTable BlockTable::Fork() const {
  BlockTable fork(pool_);
  for (const BlockHandle& h : blocks_) pool_->AddRef(h);
  fork.blocks_ = blocks_;
  fork.num_tokens_ = num_tokens_;
  return fork;
}

void BlockTable::Release() {
  if (!blocks_.empty()) pool_->Release(blocks_);
  blocks_.clear();
  num_tokens_ = 0;
}

void BlockTable::AppendIds(std::vector<int32_t>* out) const {
  out->reserve(out->size() + blocks_.size());
  for (const BlockHandle& h : blocks_) out->push_back(h.id);
}

}  // namespace kvserve
