#include "transport/oob_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvserve::transport {
namespace {

// Bigger messages are a corrupted stream, not a descriptor.
constexpr uint32_t kMaxMessage = 64u << 20;

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

OobChannel& OobChannel::operator=(OobChannel&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

OobChannel::~OobChannel() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::pair<OobChannel, OobChannel>> OobChannel::SocketPair() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return Errno("socketpair");
  }
  return std::make_pair(OobChannel(fds[0]), OobChannel(fds[1]));
}

absl::StatusOr<std::pair<int, int>> OobChannel::Listen() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 8) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    absl::Status s = Errno("bind/listen");
    close(fd);
    return s;
  }
  return std::make_pair(fd, static_cast<int>(ntohs(addr.sin_port)));
}

absl::StatusOr<OobChannel> OobChannel::Accept(int listen_fd,
                                              absl::Duration timeout) {
  pollfd p = {listen_fd, POLLIN, 0};
  int r = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  if (r == 0) return absl::DeadlineExceededError("accept timed out");
  if (r < 0) return Errno("poll");
  int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return Errno("accept");
  return OobChannel(fd);
}

absl::StatusOr<OobChannel> OobChannel::ConnectTcp(absl::string_view host,
                                                  int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string h(host);
  if (inet_pton(AF_INET, h.c_str(), &addr.sin_addr) != 1) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("bad IPv4 address ", host));
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = Errno(absl::StrCat("connect ", host, ":", port));
    close(fd);
    return s;
  }
  return OobChannel(fd);
}

absl::Status OobChannel::Send(absl::string_view message) {
  if (message.size() > kMaxMessage) {
    return absl::InvalidArgumentError("OOB message too large");
  }
  uint32_t length = static_cast<uint32_t>(message.size());
  std::string frame(reinterpret_cast<const char*>(&length), sizeof(length));
  frame.append(message.data(), message.size());
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent,
                       MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("OOB send");
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status OobChannel::ReadFull(char* out, size_t n, absl::Time deadline) {
  size_t got = 0;
  while (got < n) {
    int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) return absl::DeadlineExceededError("OOB receive timed out");
    pollfd p = {fd_, POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r == 0) return absl::DeadlineExceededError("OOB receive timed out");
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("poll");
    }
    ssize_t k = ::recv(fd_, out + got, n - got, 0);
    if (k == 0) return absl::UnavailableError("OOB channel closed by peer");
    if (k < 0) {
      if (errno == EINTR) continue;
      return Errno("OOB recv");
    }
    got += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> OobChannel::Receive(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  uint32_t length = 0;
  if (auto s = ReadFull(reinterpret_cast<char*>(&length), sizeof(length), deadline);
      !s.ok()) {
    return s;
  }
  if (length > kMaxMessage) {
    return absl::DataLossError("OOB frame length out of range");
  }
  std::string message(length, '\0');
  if (auto s = ReadFull(message.data(), length, deadline); !s.ok()) return s;
  return message;
}

}  // namespace kvserve::transport
