// HostTier: the tier under the primary KV pool, in host DRAM. It holds whole
// blocks as pages (one page = one primary block, every layer contiguous, the
// pool's own bytes), keyed by the block's chained prefix hash (the radix
// index's name for it), with an XXH3-64 checksum per page.
//
// A page's life: Reserve (engine thread: a page is taken, state writing, one
// pin held by the writer) -> the caller fills it -> Publish(checksum) (any
// thread: the page becomes ready, the writer's pin goes). Only ready pages
// are visible to Contains/Pin, so a half-written page is never read. A
// pinned page (being written, or read by a load) is never evicted: LRU
// eviction skips it, and when every page is pinned Reserve fails rather than
// waits (no deadlock under pressure: the demotion is dropped).
//
// Pages come from the heap, or from a PageArena (pinned host memory when
// the pool above is on a GPU, so copies to and from the device run on a
// copy stream without the driver's bounce buffer).
//
// Thread-safe (one mutex); page bytes are read and written outside it under
// the pin.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace kvserve {

class PageArena;

// Page memory (64-byte aligned), movable between tiers without a copy. A
// page from an arena goes back to it.
struct PageDeleter {
  PageArena* arena = nullptr;  // null: the heap
  void operator()(uint8_t* p) const;
};
using PageBuffer = std::unique_ptr<uint8_t, PageDeleter>;
PageBuffer AllocatePage(int64_t bytes);  // nullptr when out of memory

// Pages of one size carved from chunks a supplied allocator gives (pinned
// host memory, cudaHostAlloc, for a device pool: pinning is slow, so it is
// done a chunk at a time and kept), up to max_pages at once; a returned
// page is reused. Thread-safe. REQUIRES: every page is returned before the
// arena goes.
class PageArena {
 public:
  using ChunkAlloc = std::function<void*(size_t bytes)>;  // nullptr: no memory
  using ChunkFree = std::function<void(void* chunk)>;
  PageArena(int64_t page_bytes, int64_t max_pages, int64_t pages_per_chunk, ChunkAlloc alloc,
            ChunkFree free);
  ~PageArena();
  PageArena(const PageArena&) = delete;
  PageArena& operator=(const PageArena&) = delete;

  // nullptr when max_pages are out or the allocator failed.
  PageBuffer Allocate();
  int64_t page_bytes() const { return page_bytes_; }
  int64_t pages_out() const;
  int64_t pages_made() const;  // carved so far (never more than max_pages)

 private:
  friend struct PageDeleter;
  void Return(uint8_t* page);
  const int64_t page_bytes_, stride_, max_pages_, pages_per_chunk_;
  ChunkAlloc alloc_;
  ChunkFree free_;
  mutable absl::Mutex mu_;
  std::vector<void*> chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> free_pages_ ABSL_GUARDED_BY(mu_);
  int64_t made_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t out_ ABSL_GUARDED_BY(mu_) = 0;
};

// A page that left the host tier by LRU eviction (ready, so checksummed).
struct EvictedPage {
  uint64_t hash = 0;
  uint64_t checksum = 0;
  int64_t hits = 0;
  PageBuffer data;
};

struct HostTierStats {
  int64_t pages = 0;           // ready or being written
  int64_t capacity_pages = 0;
  int64_t pinned = 0;          // pages with a pin (writes and loads in flight)
  int64_t evicted = 0;         // pages evicted by LRU so far
  int64_t full_drops = 0;      // Reserves refused: every page pinned
};

class HostTier {
 public:
  // REQUIRES: page_bytes > 0; an arena's pages are page_bytes long and it
  // outlives the tier and every page it lends.
  HostTier(int64_t capacity_bytes, int64_t page_bytes, PageArena* arena = nullptr);
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  int64_t page_bytes() const { return page_bytes_; }
  int64_t capacity_pages() const { return capacity_pages_; }

  enum class ReserveResult { kReserved, kPresent, kFull };
  // A page for `hash`: kReserved with *page set (state writing, pinned for
  // the writer, who must Publish or Abort it); kPresent when the tier has
  // the hash already (touched; hits raised to at least `hits`); kFull when
  // no unpinned page can be evicted. Pages evicted to make room are appended
  // to *evicted (ownership passes to the caller).
  ReserveResult Reserve(uint64_t hash, int64_t hits, uint8_t** page,
                        std::vector<EvictedPage>* evicted);
  // The writer finished: the page is ready with this checksum.
  // REQUIRES: a Reserve of hash returned kReserved and was not finished.
  void Publish(uint64_t hash, uint64_t checksum);
  // The writer gave up: the page is dropped, never having been visible.
  void Abort(uint64_t hash);

  // True when a ready page holds hash.
  bool Contains(uint64_t hash) const;
  // Pins a ready page for reading (it cannot be evicted until Unpin) and
  // counts a hit; null when absent or not ready.
  const uint8_t* Pin(uint64_t hash, uint64_t* checksum);
  void Unpin(uint64_t hash);
  // Drops hash (a page that failed its checksum); a pinned page goes when
  // its last pin does.
  void Remove(uint64_t hash);

  // The hashes and hit counts of every ready page (a snapshot).
  std::vector<std::pair<uint64_t, int64_t>> ReadyPages() const;

  HostTierStats stats() const;

 private:
  struct Entry {
    PageBuffer data;
    uint64_t checksum = 0;
    int64_t hits = 0;
    int32_t pins = 0;
    bool ready = false;
    bool doomed = false;  // Remove while pinned
    std::list<uint64_t>::iterator lru;
  };
  void EraseLocked(uint64_t hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t page_bytes_;
  const int64_t capacity_pages_;
  PageArena* const arena_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<uint64_t> lru_ ABSL_GUARDED_BY(mu_);  // front: least recently used
  int64_t pinned_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t full_drops_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvserve
