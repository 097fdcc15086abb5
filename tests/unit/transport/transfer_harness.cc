#include "tests/unit/transport/transfer_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace kvserve::transport::testing {
namespace {

constexpr uint64_t kSlot = 64 << 10;  // KV-block-sized piece
constexpr absl::Duration kStepTimeout = absl::Seconds(20);

void Put64(std::string& out, uint64_t v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

}  // namespace

absl::StatusOr<PeerProcess> PeerProcess::Spawn(const PeerConfig& config) {
  ASSIGN_OR_RETURN(auto pair, OobChannel::SocketPair());
  std::vector<std::string> args;
  if (!config.netns.empty()) {
    args = {"ip", "netns", "exec", config.netns};
  }
  args.push_back(KVSERVE_TRANSPORT_PEER);
  int child_fd = pair.second.fd();
  args.push_back(absl::StrCat("--fd=", child_fd));
  args.push_back(absl::StrCat("--name=", config.name));
  args.push_back(absl::StrCat("--tls=", config.tls));
  args.push_back(absl::StrCat("--net_devices=", config.net_devices));
  args.push_back(absl::StrCat("--bytes=", config.region_bytes));
  args.push_back(absl::StrCat("--seed=", config.seed));
  args.push_back(absl::StrCat("--user_memory=", config.user_memory ? 1 : 0));
  args.push_back(absl::StrCat("--staged=", config.staged ? 1 : 0));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    int flags = fcntl(child_fd, F_GETFD);
    fcntl(child_fd, F_SETFD, flags & ~FD_CLOEXEC);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  PeerProcess process(pid, std::move(pair.first), config);
  // pair.second closes here, so the child's exit shows up as EOF.
  ASSIGN_OR_RETURN(process.address_, process.channel_.Receive(kStepTimeout));
  ASSIGN_OR_RETURN(process.descriptor_, process.channel_.Receive(kStepTimeout));
  return process;
}

PeerProcess::PeerProcess(PeerProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      channel_(std::move(other.channel_)),
      config_(std::move(other.config_)),
      address_(std::move(other.address_)),
      descriptor_(std::move(other.descriptor_)) {}

PeerProcess::~PeerProcess() {
  if (pid_ <= 0) return;
  channel_ = OobChannel(-1);  // EOF tells the peer to exit
  for (int i = 0; i < 200; ++i) {
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
}

void PeerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

absl::StatusOr<PeerSession> ConnectToPeer(Transport& transport,
                                          PeerProcess& process) {
  PeerSession session;
  ASSIGN_OR_RETURN(session.peer, transport.Connect(process.address()));
  ASSIGN_OR_RETURN(session.remote,
                   transport.ImportRegion(session.peer, process.descriptor()));
  session.shadow.resize(process.config().region_bytes);
  for (uint64_t i = 0; i < session.shadow.size(); ++i) {
    session.shadow[i] = InitialByte(i, process.config().seed);
  }
  return session;
}

absl::Status RunRandomBatches(Transport& transport, const LocalRegion& local,
                              PeerSession& session, PeerProcess& process,
                              int batches, std::mt19937_64& rng,
                              BatchStats* stats) {
  auto* local_bytes = static_cast<uint8_t*>(local.address);
  const uint64_t remote_slots = session.shadow.size() / kSlot;
  const uint64_t local_slots = local.length / kSlot;
  std::vector<uint64_t> slots;
  for (int b = 0; b < batches; ++b) {
    const bool write = rng() % 10 < 7;
    const int pieces = 1 + static_cast<int>(rng() % 16);
    // Pieces never overlap at their destination, so the batch has one
    // defined outcome whatever order the wire applies them in.
    const uint64_t dst_slots = write ? remote_slots : local_slots;
    slots.resize(dst_slots);
    for (uint64_t i = 0; i < dst_slots; ++i) slots[i] = i;
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<TransferOp> ops;
    for (int p = 0; p < pieces && p < static_cast<int>(dst_slots); ++p) {
      // A quarter are whole KV blocks; the rest small and odd-sized.
      uint64_t length = rng() % 4 == 0 ? kSlot : 1 + rng() % (kSlot / 4);
      uint64_t dst = slots[p] * kSlot + rng() % (kSlot - length + 1);
      uint64_t src_limit = (write ? local.length : session.shadow.size()) - length;
      uint64_t src = rng() % (src_limit + 1);
      TransferOp op;
      op.local = local.id;
      op.remote = session.remote;
      op.length = length;
      op.local_offset = write ? src : dst;
      op.remote_offset = write ? dst : src;
      ops.push_back(op);
    }
    std::string note;
    if (write) {
      // Fresh random source bytes for every write batch.
      for (const TransferOp& op : ops) {
        for (uint64_t i = 0; i < op.length; i += 8) {
          uint64_t word = rng();
          std::memcpy(local_bytes + op.local_offset + i, &word,
                      std::min<uint64_t>(8, op.length - i));
        }
      }
      Put64(note, static_cast<uint64_t>(b));
      Put64(note, ops.size());
      for (const TransferOp& op : ops) {
        Put64(note, op.remote_offset);
        Put64(note, op.length);
        Put64(note, Checksum(local_bytes + op.local_offset, op.length));
      }
    }
    ASSIGN_OR_RETURN(TransferId id,
                     transport.PostTransfer(session.peer,
                                            write ? Direction::kWrite
                                                  : Direction::kRead,
                                            ops, note));
    absl::Status done = transport.Wait(id, kStepTimeout);
    RETURN_IF_ERROR(transport.ReleaseTransfer(id));
    if (!done.ok()) {
      return absl::Status(done.code(),
                          absl::StrCat("batch ", b, ": ", done.message()));
    }
    for (const TransferOp& op : ops) {
      uint8_t* mine = local_bytes + op.local_offset;
      uint8_t* theirs = session.shadow.data() + op.remote_offset;
      if (write) {
        std::memcpy(theirs, mine, op.length);
      } else if (Checksum(mine, op.length) != Checksum(theirs, op.length)) {
        return absl::DataLossError(absl::StrCat(
            "batch ", b, ": read of ", op.length, " bytes at remote offset ",
            op.remote_offset, " returned wrong bytes"));
      }
      if (stats) {
        stats->bytes += op.length;
        ++stats->pieces;
      }
    }
    if (write) {
      ASSIGN_OR_RETURN(std::string ack, process.channel().Receive(kStepTimeout));
      if (ack != absl::StrCat("ack ", b, " ok")) {
        return absl::DataLossError(absl::StrCat(
            "batch ", b, ": peer verification says '", ack, "'"));
      }
      if (stats) ++stats->write_batches;
    } else if (stats) {
      ++stats->read_batches;
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyWholeRegion(PeerSession& session, PeerProcess& process) {
  RETURN_IF_ERROR(process.channel().Send("hash"));
  ASSIGN_OR_RETURN(std::string reply, process.channel().Receive(kStepTimeout));
  std::string expected = absl::StrCat(
      "hash ", Checksum(session.shadow.data(), session.shadow.size()));
  if (reply != expected) {
    return absl::DataLossError(
        absl::StrCat("whole-region checksum: peer '", reply, "', expected '",
                     expected, "'"));
  }
  return absl::OkStatus();
}

}  // namespace kvserve::transport::testing
