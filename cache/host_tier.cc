#include "cache/host_tier.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

namespace kvserve {

void PageDeleter::operator()(uint8_t* p) const {
  if (arena != nullptr) {
    arena->Return(p);
  } else {
    std::free(p);
  }
}

PageBuffer AllocatePage(int64_t bytes) {
  const int64_t rounded = (bytes + 63) / 64 * 64;
  return PageBuffer(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(rounded))));
}

PageArena::PageArena(int64_t page_bytes, int64_t max_pages, int64_t pages_per_chunk,
                     ChunkAlloc alloc, ChunkFree free)
    : page_bytes_(page_bytes),
      stride_((page_bytes + 63) / 64 * 64),
      max_pages_(max_pages),
      pages_per_chunk_(std::max<int64_t>(1, pages_per_chunk)),
      alloc_(std::move(alloc)),
      free_(std::move(free)) {}

PageArena::~PageArena() {
  absl::MutexLock lock(&mu_);
  if (out_ != 0) {
    std::fprintf(stderr, "PageArena: destroyed with %lld pages still lent\n",
                 static_cast<long long>(out_));
    std::abort();  // a lent page would point into freed memory
  }
  for (void* c : chunks_) free_(c);
}

PageBuffer PageArena::Allocate() {
  absl::MutexLock lock(&mu_);
  if (free_pages_.empty()) {
    const int64_t n = std::min(pages_per_chunk_, max_pages_ - made_);
    if (n <= 0) return PageBuffer(nullptr, PageDeleter{this});
    // Chunks start 64-byte aligned (cudaHostAlloc gives page alignment).
    auto* chunk = static_cast<uint8_t*>(alloc_(static_cast<size_t>(n * stride_)));
    if (chunk == nullptr) return PageBuffer(nullptr, PageDeleter{this});
    chunks_.push_back(chunk);
    for (int64_t i = n - 1; i >= 0; --i) free_pages_.push_back(chunk + i * stride_);
    made_ += n;
  }
  uint8_t* p = free_pages_.back();
  free_pages_.pop_back();
  ++out_;
  return PageBuffer(p, PageDeleter{this});
}

void PageArena::Return(uint8_t* page) {
  absl::MutexLock lock(&mu_);
  free_pages_.push_back(page);
  --out_;
}

int64_t PageArena::pages_out() const {
  absl::MutexLock lock(&mu_);
  return out_;
}

int64_t PageArena::pages_made() const {
  absl::MutexLock lock(&mu_);
  return made_;
}

HostTier::HostTier(int64_t capacity_bytes, int64_t page_bytes, PageArena* arena)
    : page_bytes_(page_bytes),
      capacity_pages_(page_bytes > 0 ? capacity_bytes / page_bytes : 0),
      arena_(arena) {}

void HostTier::TouchLocked(Entry* e) { lru_.splice(lru_.end(), lru_, e->lru); }

void HostTier::EraseLocked(uint64_t hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

HostTier::ReserveResult HostTier::Reserve(uint64_t hash, int64_t hits, uint8_t** page,
                                          std::vector<EvictedPage>* evicted) {
  absl::MutexLock lock(&mu_);
  if (auto it = entries_.find(hash); it != entries_.end()) {
    Entry& e = it->second;
    if (e.hits < hits) e.hits = hits;
    TouchLocked(&e);
    return ReserveResult::kPresent;
  }
  if (capacity_pages_ <= 0) return ReserveResult::kFull;
  // Evict least recently used pages nobody reads or writes. A pinned page
  // is skipped, never waited for.
  auto victim = lru_.begin();
  while (static_cast<int64_t>(entries_.size()) >= capacity_pages_ && victim != lru_.end()) {
    Entry& e = entries_.at(*victim);
    if (e.pins > 0 || !e.ready) {
      ++victim;
      continue;
    }
    const uint64_t h = *victim;
    ++victim;
    evicted->push_back(EvictedPage{h, e.checksum, e.hits, std::move(e.data)});
    EraseLocked(h);
    ++evicted_;
  }
  if (static_cast<int64_t>(entries_.size()) >= capacity_pages_) {
    ++full_drops_;
    return ReserveResult::kFull;
  }
  PageBuffer data = arena_ != nullptr ? arena_->Allocate() : AllocatePage(page_bytes_);
  if (data == nullptr) {
    ++full_drops_;
    return ReserveResult::kFull;
  }
  Entry e;
  *page = data.get();
  e.data = std::move(data);
  e.hits = hits;
  e.pins = 1;
  e.lru = lru_.insert(lru_.end(), hash);
  entries_.emplace(hash, std::move(e));
  ++pinned_;
  return ReserveResult::kReserved;
}

void HostTier::Publish(uint64_t hash, uint64_t checksum) {
  absl::MutexLock lock(&mu_);
  Entry& e = entries_.at(hash);
  e.checksum = checksum;
  e.ready = true;
  if (--e.pins == 0) --pinned_;
}

void HostTier::Abort(uint64_t hash) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  if (--it->second.pins == 0) --pinned_;
  EraseLocked(hash);
}

bool HostTier::Contains(uint64_t hash) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  return it != entries_.end() && it->second.ready && !it->second.doomed;
}

const uint8_t* HostTier::Pin(uint64_t hash, uint64_t* checksum) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end() || !it->second.ready || it->second.doomed) return nullptr;
  Entry& e = it->second;
  if (e.pins++ == 0) ++pinned_;
  ++e.hits;
  TouchLocked(&e);
  *checksum = e.checksum;
  return e.data.get();
}

void HostTier::Unpin(uint64_t hash) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (--e.pins == 0) {
    --pinned_;
    if (e.doomed) EraseLocked(hash);
  }
}

void HostTier::Remove(uint64_t hash) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  if (it->second.pins > 0) {
    it->second.doomed = true;
  } else {
    EraseLocked(hash);
  }
}

std::vector<std::pair<uint64_t, int64_t>> HostTier::ReadyPages() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, int64_t>> out;
  for (uint64_t h : lru_) {
    const Entry& e = entries_.at(h);
    if (e.ready && !e.doomed) out.emplace_back(h, e.hits);
  }
  return out;
}

HostTierStats HostTier::stats() const {
  absl::MutexLock lock(&mu_);
  HostTierStats s;
  s.pages = static_cast<int64_t>(entries_.size());
  s.capacity_pages = capacity_pages_;
  s.pinned = pinned_;
  s.evicted = evicted_;
  s.full_drops = full_drops_;
  return s;
}

}  // namespace kvserve
