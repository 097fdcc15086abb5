// A tiny out-of-band channel for exchanging peer addresses and region
// descriptors: length-prefixed messages over a connected stream socket (a
// socketpair between a parent and a forked child, or a loopback TCP
// connection). Production deployments carry the same blobs over gRPC.
#pragma once

#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvserve::transport {

// Owns one socket fd. Not thread safe.
class OobChannel {
 public:
  explicit OobChannel(int fd) : fd_(fd) {}
  OobChannel(OobChannel&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  OobChannel& operator=(OobChannel&& other) noexcept;
  ~OobChannel();

  // A connected pair; the second end is typically inherited by a child.
  static absl::StatusOr<std::pair<OobChannel, OobChannel>> SocketPair();
  // Loopback TCP: Listen() binds 127.0.0.1 on an ephemeral port.
  static absl::StatusOr<std::pair<int, int>> Listen();  // {fd, port}
  static absl::StatusOr<OobChannel> Accept(int listen_fd, absl::Duration timeout);
  static absl::StatusOr<OobChannel> ConnectTcp(absl::string_view host, int port);

  [[nodiscard]] absl::Status Send(absl::string_view message);
  [[nodiscard]] absl::StatusOr<std::string> Receive(absl::Duration timeout);

  int fd() const { return fd_; }
  // Gives up ownership (e.g. before exec in a child).
  int Release() { return std::exchange(fd_, -1); }

 private:
  absl::Status ReadFull(char* out, size_t n, absl::Time deadline);
  int fd_;
};

}  // namespace kvserve::transport
