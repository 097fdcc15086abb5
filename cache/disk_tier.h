// DiskTier: KV blocks as files under --kv-disk-dir, one file per block
// (every layer contiguous, the primary pool's bytes behind a 64-byte
// header), keyed by the block's chained prefix hash. Files live in a
// subdirectory named by the model fingerprint (weights content, tokenizer,
// KV dtype, block size, shape), so a restarted daemon on the same model
// finds them again and a daemon on another model never reads them.
//
// Store writes `<hash>.tmp`, fsyncs and closes it, then renames it to
// `<hash>.kv`; only after all of that succeeded is the block visible to
// Contains/Pin. A failed write (disk full, I/O error) is removed and never
// visible. A file being read is pinned and never evicted; when the budget
// is taken by pinned files a Store fails instead of waiting.
//
// File I/O goes through DiskFileLayer so tests inject failures.
//
// Thread-safe (one mutex for the index; I/O runs outside it).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvserve {

// The retention table (scheduler/cache_control.h) in the fingerprint
// directory: Open leaves it alone (every other unknown file is removed).
inline constexpr char kDiskTierRetentionFile[] = "retention.tbl";

// The few file operations the disk tier needs. Thread-safe.
class DiskFileLayer {
 public:
  virtual ~DiskFileLayer() = default;
  // Creates (or truncates) path with the bytes of parts, in order, then
  // fsyncs and closes it; OK only when every step succeeded.
  virtual absl::Status WriteDurably(const std::string& path,
                                    const std::vector<std::pair<const void*, size_t>>& parts) = 0;
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // Reads exactly n bytes at offset.
  virtual absl::Status ReadAt(const std::string& path, int64_t offset, void* out, size_t n) = 0;
  virtual absl::Status Remove(const std::string& path) = 0;
  virtual absl::Status MakeDirs(const std::string& dir) = 0;
  // Entry names (not paths) of dir; directories get a trailing '/'.
  virtual absl::StatusOr<std::vector<std::string>> List(const std::string& dir) = 0;
};
// POSIX open/write/fsync/close/rename.
DiskFileLayer* PosixDiskFileLayer();

struct DiskTierOptions {
  std::string dir;                 // --kv-disk-dir
  int64_t capacity_bytes = 0;      // --kv-disk-bytes (files, headers included)
  std::string fingerprint;         // the subdirectory name (hex)
  int64_t page_bytes = 0;          // one primary block
  DiskFileLayer* files = nullptr;  // null: PosixDiskFileLayer()
};

// What Open found.
struct DiskTierRecovery {
  int64_t recovered = 0;            // valid files of this fingerprint, now visible
  int64_t discarded = 0;            // invalid, partial or over-budget files removed
  int64_t other_fingerprints = 0;   // subdirectories of other models/configurations
};

struct DiskTierStats {
  int64_t files = 0;            // visible blocks
  int64_t capacity_files = 0;
  int64_t writes = 0;           // stores published
  int64_t write_failures = 0;   // stores that failed (never visible)
  int64_t full_drops = 0;       // stores refused: budget taken by pinned files
  int64_t evicted = 0;          // files removed by LRU
  int64_t bytes_written = 0;
};

class DiskTier {
 public:
  // Creates dir/fingerprint if needed and indexes the valid files in it.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DiskTier>> Open(DiskTierOptions options,
                                                                      DiskTierRecovery* recovery);
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  int64_t page_bytes() const { return options_.page_bytes; }
  int64_t file_bytes() const;
  const std::string& directory() const { return subdir_; }

  // Writes a page under hash (blocking I/O: call from a writer thread) and
  // publishes it when the write is durable. OK when stored or already there.
  // REQUIRES: data holds page_bytes() bytes whose XXH3-64 is checksum.
  // evicted (optional): the hashes of the files LRU removed to make room.
  [[nodiscard]] absl::Status Store(uint64_t hash, const uint8_t* data, uint64_t checksum,
                                   int64_t hits, std::vector<uint64_t>* evicted = nullptr);
  bool Contains(uint64_t hash) const;
  // Pins a visible file for reading; false when absent.
  bool Pin(uint64_t hash, uint64_t* checksum);
  void Unpin(uint64_t hash);
  // Reads a pinned file's page into out (page_bytes()). The caller checks
  // the checksum.
  [[nodiscard]] absl::Status Read(uint64_t hash, uint8_t* out);
  // Drops a file that failed its checksum (once unpinned).
  void Remove(uint64_t hash);

  DiskTierStats stats() const;

 private:
  explicit DiskTier(DiskTierOptions options);
  std::string PathOf(uint64_t hash, const char* ext) const;

  struct Entry {
    uint64_t checksum = 0;
    int64_t hits = 0;
    int32_t pins = 0;
    bool ready = false;
    bool doomed = false;
    std::list<uint64_t>::iterator lru;
  };
  void EraseLocked(uint64_t hash, std::vector<std::string>* remove)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DiskTierOptions options_;
  std::string subdir_;
  int64_t capacity_files_ = 0;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<uint64_t> lru_ ABSL_GUARDED_BY(mu_);
  DiskTierStats stats_ ABSL_GUARDED_BY(mu_);
  int64_t ready_files_ ABSL_GUARDED_BY(mu_) = 0;
};

// The file header, little-endian: what makes a file self-checking.
struct DiskBlockHeader {
  char magic[8];             // "KVSTIER1"
  uint32_t version;          // 1
  uint32_t header_bytes;     // 64
  uint64_t fingerprint;      // XXH3-64 of the fingerprint string
  uint64_t block_hash;
  uint64_t payload_bytes;
  uint64_t payload_checksum; // XXH3-64 of the payload
  uint64_t hits;
  uint64_t header_checksum;  // XXH3-64 of the 56 bytes before it
};
static_assert(sizeof(DiskBlockHeader) == 64);

}  // namespace kvserve
