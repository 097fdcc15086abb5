// transport_test_peer: the far side of the multi-process transport tests.
// Owns one region, sends its address and descriptor over the inherited
// socket, verifies every notified write batch by checksum and acks it, and
// answers "hash" with a checksum of the whole region. Exits on EOF.
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "tests/unit/transport/transfer_harness.h"
#include "transport/descriptor.h"
#include "transport/ucx_transport.h"

namespace kt = kvserve::transport;

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (!absl::ConsumePrefix(&a, "--")) continue;
    size_t eq = a.find('=');
    flags[std::string(a.substr(0, eq))] =
        eq == a.npos ? "" : std::string(a.substr(eq + 1));
  }
  int fd = -1;
  uint64_t bytes = 0, seed = 0;
  if (!absl::SimpleAtoi(flags["fd"], &fd) ||
      !absl::SimpleAtoi(flags["bytes"], &bytes) ||
      !absl::SimpleAtoi(flags["seed"], &seed)) {
    std::fprintf(stderr, "transport_test_peer: bad flags\n");
    return 2;
  }
  kt::OobChannel channel(fd);
  kt::UcxTransportOptions options;
  options.name = flags["name"];
  options.tls = flags["tls"];
  options.net_devices = flags["net_devices"];
  options.force_cuda_staging = true;
  auto transport = kt::CreateUcxTransport(options);
  if (!transport.ok()) {
    std::fprintf(stderr, "peer: %s\n", transport.status().ToString().c_str());
    return 3;
  }
  kt::Transport& t = **transport;
  std::vector<uint8_t> user_memory;
  absl::StatusOr<kt::LocalRegion> region;
  const bool staged = flags["staged"] == "1";
  if (flags["user_memory"] == "1" || staged) {
    user_memory.resize(bytes);
    for (uint64_t i = 0; i < bytes; ++i) {
      user_memory[i] = kt::testing::InitialByte(i, seed);
    }
    region = t.RegisterRegion(user_memory.data(), bytes,
                              staged ? kt::MemoryKind::kCuda
                                     : kt::MemoryKind::kHost);
  } else {
    region = t.AllocateRegion(bytes);
    if (region.ok()) {
      auto* p = static_cast<uint8_t*>(region->address);
      for (uint64_t i = 0; i < bytes; ++i) p[i] = kt::testing::InitialByte(i, seed);
    }
  }
  if (!region.ok()) {
    std::fprintf(stderr, "peer: %s\n", region.status().ToString().c_str());
    return 4;
  }
  const auto* data = static_cast<const uint8_t*>(region->address);
  if (!channel.Send(*t.LocalAddress()).ok() ||
      !channel.Send(*t.DescribeRegion(region->id)).ok()) {
    return 5;
  }

  // Commands and acks share the socket: recv on this thread, send on the
  // verifier thread for acks and here for hashes; a send is one write() of
  // a small frame, so they do not interleave.
  std::atomic<bool> stop{false};
  std::thread verifier([&] {
    while (!stop) {
      auto note = t.WaitNotification(absl::Milliseconds(50));
      if (!note.ok()) continue;
      absl::string_view p = note->payload;
      auto get = [&p](uint64_t* v) {
        if (p.size() < 8) return false;
        std::memcpy(v, p.data(), 8);
        p.remove_prefix(8);
        return true;
      };
      uint64_t batch = 0, n = 0;
      bool ok = get(&batch) && get(&n);
      for (uint64_t i = 0; ok && i < n; ++i) {
        uint64_t off, len, hash;
        ok = get(&off) && get(&len) && get(&hash) && off + len <= bytes &&
             kt::testing::Checksum(data + off, len) == hash;
      }
      if (!channel.Send(absl::StrCat("ack ", batch, ok ? " ok" : " bad")).ok()) {
        return;
      }
    }
  });
  while (true) {
    auto command = channel.Receive(absl::Hours(1));
    if (!command.ok()) break;  // EOF: the test is done with us
    if (*command == "hash") {
      if (!channel.Send(absl::StrCat("hash ", kt::testing::Checksum(data, bytes))).ok()) break;
    }
  }
  stop = true;
  verifier.join();
  return 0;
}
