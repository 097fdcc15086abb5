#include "cache/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvserve {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'T', 'I', 'E', 'R', '1'};

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

class PosixFiles final : public DiskFileLayer {
 public:
  absl::Status WriteDurably(const std::string& path,
                            const std::vector<std::pair<const void*, size_t>>& parts) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("cannot create", path);
    for (const auto& [data, n] : parts) {
      const char* p = static_cast<const char*>(data);
      size_t left = n;
      while (left > 0) {
        const ssize_t w = ::write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          absl::Status s = Errno("cannot write", path);
          ::close(fd);
          return s;
        }
        p += w;
        left -= static_cast<size_t>(w);
      }
    }
    if (::fsync(fd) != 0) {
      absl::Status s = Errno("cannot fsync", path);
      ::close(fd);
      return s;
    }
    if (::close(fd) != 0) return Errno("cannot close", path);
    return absl::OkStatus();
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return Errno("cannot rename", from);
    return absl::OkStatus();
  }
  absl::Status ReadAt(const std::string& path, int64_t offset, void* out, size_t n) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("cannot open", path);
    char* p = static_cast<char*>(out);
    size_t left = n;
    while (left > 0) {
      const ssize_t r = ::pread(fd, p, left, offset);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        absl::Status s = r == 0 ? absl::DataLossError(absl::StrCat("short file ", path))
                                : Errno("cannot read", path);
        ::close(fd);
        return s;
      }
      p += r;
      offset += r;
      left -= static_cast<size_t>(r);
    }
    ::close(fd);
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove", path);
    return absl::OkStatus();
  }
  absl::Status MakeDirs(const std::string& dir) override {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      std::string name = e.path().filename().string();
      if (e.is_directory(ec)) name += '/';
      out.push_back(std::move(name));
    }
    if (ec) return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
    return out;
  }
};

uint64_t HeaderChecksum(const DiskBlockHeader& h) {
  return XXH3_64bits(&h, offsetof(DiskBlockHeader, header_checksum));
}

}  // namespace

DiskFileLayer* PosixDiskFileLayer() {
  static PosixFiles files;
  return &files;
}

DiskTier::DiskTier(DiskTierOptions options) : options_(std::move(options)) {
  if (options_.files == nullptr) options_.files = PosixDiskFileLayer();
  subdir_ = absl::StrCat(options_.dir, "/", options_.fingerprint);
  capacity_files_ = options_.capacity_bytes / file_bytes();
}

int64_t DiskTier::file_bytes() const {
  return static_cast<int64_t>(sizeof(DiskBlockHeader)) + options_.page_bytes;
}

std::string DiskTier::PathOf(uint64_t hash, const char* ext) const {
  return absl::StrFormat("%s/%016x%s", subdir_, hash, ext);
}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(DiskTierOptions options,
                                                         DiskTierRecovery* recovery) {
  if (options.dir.empty()) return absl::InvalidArgumentError("--kv-disk-dir is empty");
  if (options.fingerprint.empty() || options.page_bytes <= 0) {
    return absl::InvalidArgumentError("disk tier needs a model fingerprint and a page size");
  }
  std::unique_ptr<DiskTier> t(new DiskTier(std::move(options)));
  DiskFileLayer* fs = t->options_.files;
  if (t->capacity_files_ <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-disk-bytes ", t->options_.capacity_bytes,
                                                   " holds no block (one takes ", t->file_bytes(),
                                                   " bytes)"));
  }
  if (absl::Status s = fs->MakeDirs(t->subdir_); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--kv-disk-dir: ", s.message()));
  }
  DiskTierRecovery rec;
  if (auto top = fs->List(t->options_.dir); top.ok()) {
    for (const std::string& name : *top) {
      if (name.back() == '/' && name != t->options_.fingerprint + "/") ++rec.other_fingerprints;
    }
  }
  absl::StatusOr<std::vector<std::string>> names = fs->List(t->subdir_);
  if (!names.ok()) return names.status();
  const uint64_t fp = XXH3_64bits(t->options_.fingerprint.data(), t->options_.fingerprint.size());
  absl::MutexLock lock(&t->mu_);
  for (const std::string& name : *names) {
    // Side files other parts keep next to the blocks (the retention table,
    // scheduler/cache_control.h) are theirs to validate.
    if (name == kDiskTierRetentionFile) continue;
    const std::string path = absl::StrCat(t->subdir_, "/", name);
    uint64_t hash = 0;
    const bool kv_file = name.size() == 16 + 3 && name.substr(16) == ".kv" &&
                         absl::SimpleHexAtoi(name.substr(0, 16), &hash);
    bool valid = false;
    DiskBlockHeader h;
    if (kv_file && fs->ReadAt(path, 0, &h, sizeof(h)).ok()) {
      valid = std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.version == 1 &&
              h.header_bytes == sizeof(h) && h.header_checksum == HeaderChecksum(h) &&
              h.fingerprint == fp && h.block_hash == hash &&
              h.payload_bytes == static_cast<uint64_t>(t->options_.page_bytes);
      // The payload's length is checked too: a torn file is not a block.
      std::error_code ec;
      valid = valid && std::filesystem::file_size(path, ec) ==
                           static_cast<uintmax_t>(t->file_bytes()) && !ec;
    }
    if (!valid || static_cast<int64_t>(t->entries_.size()) >= t->capacity_files_ ||
        t->entries_.contains(hash)) {
      (void)fs->Remove(path);
      ++rec.discarded;
      continue;
    }
    Entry e;
    e.checksum = h.payload_checksum;
    e.hits = static_cast<int64_t>(h.hits);
    e.ready = true;
    e.lru = t->lru_.insert(t->lru_.end(), hash);
    t->entries_.emplace(hash, std::move(e));
    ++t->ready_files_;
    ++rec.recovered;
  }
  if (recovery != nullptr) *recovery = rec;
  return t;
}

void DiskTier::EraseLocked(uint64_t hash, std::vector<std::string>* remove) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  if (it->second.ready) --ready_files_;
  lru_.erase(it->second.lru);
  entries_.erase(it);
  remove->push_back(PathOf(hash, ".kv"));
}

absl::Status DiskTier::Store(uint64_t hash, const uint8_t* data, uint64_t checksum,
                             int64_t hits, std::vector<uint64_t>* evicted) {
  DiskFileLayer* fs = options_.files;
  std::vector<std::string> remove;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(hash); it != entries_.end()) {
      if (it->second.hits < hits) it->second.hits = hits;
      return absl::OkStatus();  // stored already, or being stored
    }
    auto victim = lru_.begin();
    while (static_cast<int64_t>(entries_.size()) >= capacity_files_ && victim != lru_.end()) {
      const uint64_t h = *victim;
      ++victim;
      const Entry& e = entries_.at(h);
      if (e.pins > 0 || !e.ready) continue;
      EraseLocked(h, &remove);
      ++stats_.evicted;
      if (evicted != nullptr) evicted->push_back(h);
    }
    if (static_cast<int64_t>(entries_.size()) >= capacity_files_) {
      ++stats_.full_drops;
      return absl::ResourceExhaustedError("disk tier full of blocks in use");
    }
    // Reserved, not visible: a concurrent Store of the same hash sees it
    // and returns, Contains and Pin do not.
    Entry e;
    e.hits = hits;
    e.pins = 1;
    e.lru = lru_.insert(lru_.end(), hash);
    entries_.emplace(hash, std::move(e));
  }
  for (const std::string& p : remove) (void)fs->Remove(p);

  DiskBlockHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = 1;
  h.header_bytes = sizeof(h);
  h.fingerprint = XXH3_64bits(options_.fingerprint.data(), options_.fingerprint.size());
  h.block_hash = hash;
  h.payload_bytes = static_cast<uint64_t>(options_.page_bytes);
  h.payload_checksum = checksum;
  h.hits = static_cast<uint64_t>(hits);
  h.header_checksum = HeaderChecksum(h);
  const std::string tmp = PathOf(hash, ".tmp");
  const std::string final_path = PathOf(hash, ".kv");
  absl::Status s = fs->WriteDurably(
      tmp, {{&h, sizeof(h)}, {data, static_cast<size_t>(options_.page_bytes)}});
  if (s.ok()) s = fs->Rename(tmp, final_path);
  absl::MutexLock lock(&mu_);
  Entry& e = entries_.at(hash);
  --e.pins;
  if (!s.ok()) {
    (void)fs->Remove(tmp);
    lru_.erase(e.lru);
    entries_.erase(hash);
    ++stats_.write_failures;
    return s;
  }
  e.checksum = checksum;
  e.ready = true;  // published: durable and renamed
  ++ready_files_;
  ++stats_.writes;
  stats_.bytes_written += file_bytes();
  return absl::OkStatus();
}

bool DiskTier::Contains(uint64_t hash) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  return it != entries_.end() && it->second.ready && !it->second.doomed;
}

bool DiskTier::Pin(uint64_t hash, uint64_t* checksum) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end() || !it->second.ready || it->second.doomed) return false;
  ++it->second.pins;
  ++it->second.hits;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  *checksum = it->second.checksum;
  return true;
}

void DiskTier::Unpin(uint64_t hash) {
  std::vector<std::string> remove;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(hash);
    if (it == entries_.end()) return;
    if (--it->second.pins == 0 && it->second.doomed) EraseLocked(hash, &remove);
  }
  for (const std::string& p : remove) (void)options_.files->Remove(p);
}

absl::Status DiskTier::Read(uint64_t hash, uint8_t* out) {
  return options_.files->ReadAt(PathOf(hash, ".kv"), sizeof(DiskBlockHeader), out,
                                static_cast<size_t>(options_.page_bytes));
}

void DiskTier::Remove(uint64_t hash) {
  std::vector<std::string> remove;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(hash);
    if (it == entries_.end()) return;
    if (it->second.pins > 0) {
      it->second.doomed = true;
    } else {
      EraseLocked(hash, &remove);
    }
  }
  for (const std::string& p : remove) (void)options_.files->Remove(p);
}

DiskTierStats DiskTier::stats() const {
  absl::MutexLock lock(&mu_);
  DiskTierStats s = stats_;
  s.files = ready_files_;
  s.capacity_files = capacity_files_;
  return s;
}

}  // namespace kvserve
