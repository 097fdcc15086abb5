#include "transport/descriptor.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvserve::transport {
namespace {

constexpr uint32_t kRegionMagic = 0x4452564b;  // "KVRD"
constexpr uint32_t kAddressMagic = 0x4157564b;  // "KVWA"
constexpr uint16_t kVersion = 1;
// Limits keep a corrupted length field from turning into a huge allocation.
constexpr uint32_t kMaxStringField = 1 << 20;

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void PutString(absl::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  std::string Finish() {
    Put<uint64_t>(Fnv1a64(out_.data(), out_.size()));
    return std::move(out_);
  }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(absl::string_view blob, const char* what) : blob_(blob), what_(what) {}

  // Verifies the trailing checksum; the body is everything before it.
  absl::Status CheckFraming(uint32_t magic) {
    if (blob_.size() < sizeof(uint32_t) + sizeof(uint16_t) + sizeof(uint64_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what_, ": ", blob_.size(), " bytes is too short to be a descriptor"));
    }
    uint64_t stored;
    std::memcpy(&stored, blob_.data() + blob_.size() - sizeof(stored),
                sizeof(stored));
    blob_.remove_suffix(sizeof(stored));
    if (stored != Fnv1a64(blob_.data(), blob_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": checksum mismatch (corrupted or truncated)"));
    }
    uint32_t got_magic = 0;
    uint16_t version = 0;
    if (!Get(&got_magic) || got_magic != magic) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": bad magic, not a kvserve descriptor"));
    }
    if (!Get(&version) || version != kVersion) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": unsupported version ", version));
    }
    return absl::OkStatus();
  }
  template <typename T>
  bool Get(T* value) {
    if (blob_.size() < sizeof(T)) return false;
    std::memcpy(value, blob_.data(), sizeof(T));
    blob_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t size;
    if (!Get(&size) || size > kMaxStringField || blob_.size() < size) {
      return false;
    }
    s->assign(blob_.data(), size);
    blob_.remove_prefix(size);
    return true;
  }
  absl::Status Truncated() const {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": truncated field"));
  }
  bool AtEnd() const { return blob_.empty(); }

 private:
  absl::string_view blob_;
  const char* what_;
};

}  // namespace

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string LocalHostId() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  struct stat ns = {};
  if (!(boot >> boot_id) || stat("/proc/self/ns/pid", &ns) != 0) return "";
  return absl::StrCat(boot_id, "/", ns.st_ino);
}

uint64_t ProcessStartTime(uint64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return 0;
  // The command name may hold spaces; fields resume after the last ')'.
  size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(line.substr(close + 2));
  std::string state;
  fields >> state;
  if (state == "Z" || state == "X") return 0;  // dead, maybe not yet reaped
  std::string field;
  // Field 22 (starttime) is the 20th after the state (field 3).
  for (int i = 4; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

uint64_t Fnv1a64(const void* data, size_t length, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < length; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string PackRegionDescriptor(const RegionDescriptor& d) {
  Writer w;
  w.Put<uint32_t>(kRegionMagic);
  w.Put<uint16_t>(kVersion);
  w.PutString(d.backend);
  w.Put<uint64_t>(d.agent_id);
  w.Put<uint64_t>(d.region);
  w.Put<uint8_t>(static_cast<uint8_t>(d.kind));
  w.Put<uint8_t>(d.staged ? 1 : 0);
  w.Put<uint64_t>(d.remote_address);
  w.Put<uint64_t>(d.length);
  w.PutString(d.rkey);
  return w.Finish();
}

absl::StatusOr<RegionDescriptor> UnpackRegionDescriptor(
    absl::string_view blob) {
  Reader r(blob, "region descriptor");
  if (auto s = r.CheckFraming(kRegionMagic); !s.ok()) return s;
  RegionDescriptor d;
  uint8_t kind, staged;
  if (!r.GetString(&d.backend) || !r.Get(&d.agent_id) || !r.Get(&d.region) ||
      !r.Get(&kind) || !r.Get(&staged) || !r.Get(&d.remote_address) ||
      !r.Get(&d.length) || !r.GetString(&d.rkey)) {
    return r.Truncated();
  }
  if (!r.AtEnd()) {
    return absl::InvalidArgumentError("region descriptor: trailing bytes");
  }
  if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor: unknown memory kind ", kind));
  }
  if (staged > 1) {
    return absl::InvalidArgumentError("region descriptor: bad staged flag");
  }
  if (d.length == 0) {
    return absl::InvalidArgumentError("region descriptor: zero length");
  }
  if (d.remote_address + d.length < d.remote_address) {
    return absl::InvalidArgumentError(
        "region descriptor: address + length overflows");
  }
  d.kind = static_cast<MemoryKind>(kind);
  d.staged = staged == 1;
  return d;
}

std::string PackPeerAddress(const PeerAddress& a) {
  Writer w;
  w.Put<uint32_t>(kAddressMagic);
  w.Put<uint16_t>(kVersion);
  w.PutString(a.backend);
  w.Put<uint64_t>(a.agent_id);
  w.PutString(a.name);
  w.PutString(a.address);
  w.PutString(a.host_id);
  w.Put<uint64_t>(a.pid);
  w.Put<uint64_t>(a.start_time);
  return w.Finish();
}

absl::StatusOr<PeerAddress> UnpackPeerAddress(absl::string_view blob) {
  Reader r(blob, "peer address");
  if (auto s = r.CheckFraming(kAddressMagic); !s.ok()) return s;
  PeerAddress a;
  if (!r.GetString(&a.backend) || !r.Get(&a.agent_id) || !r.GetString(&a.name) ||
      !r.GetString(&a.address) || !r.GetString(&a.host_id) || !r.Get(&a.pid) ||
      !r.Get(&a.start_time)) {
    return r.Truncated();
  }
  if (!r.AtEnd()) return absl::InvalidArgumentError("peer address: trailing bytes");
  return a;
}

bool InRange(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

absl::Status CheckOpRanges(size_t index, const TransferOp& op, uint64_t local_length,
                           uint64_t remote_length) {
  if (op.length == 0) {
    return absl::InvalidArgumentError(absl::StrCat("op ", index, ": zero length"));
  }
  if (!InRange(op.local_offset, op.length, local_length)) {
    return absl::OutOfRangeError(absl::StrCat("op ", index, ": local range [", op.local_offset,
                                              ", +", op.length, ") exceeds local region ",
                                              op.local, " of ", local_length, " bytes"));
  }
  if (!InRange(op.remote_offset, op.length, remote_length)) {
    return absl::OutOfRangeError(absl::StrCat("op ", index, ": remote range [", op.remote_offset,
                                              ", +", op.length, ") exceeds remote region ",
                                              op.remote, " of ", remote_length, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace kvserve::transport
