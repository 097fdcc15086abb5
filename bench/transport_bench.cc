// kvserve-transfer-bench: bandwidth and latency of the UCX transport between
// two processes on this host, over shared memory and over tcp (lo), printed
// next to ucx_perftest's ucp_put_bw on the same transport in the same run.
//
//   kvserve-transfer-bench [--links=shm,tcp] [--budget_mib=512] [--perftest=ucx_perftest]
//
// The target process is this binary re-executed with --role=target; it
// allocates a 64 MiB region and serves puts until its socket closes.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "transport/cost_model.h"
#include "transport/oob_channel.h"
#include "spdlog/spdlog.h"
#include "transport/ucx_transport.h"

namespace kt = kvserve::transport;

namespace {

constexpr uint64_t kRegionBytes = 64ull << 20;
constexpr uint64_t kPiece = 64 << 10;  // KV-block-sized scatter-gather piece

struct Link {
  std::string name;
  std::string tls;
  std::string net_devices;
};

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (!absl::ConsumePrefix(&a, "--")) continue;
    size_t eq = a.find('=');
    flags[std::string(a.substr(0, eq))] =
        eq == a.npos ? "1" : std::string(a.substr(eq + 1));
  }
  return flags;
}

int RunTarget(std::map<std::string, std::string>& flags) {
  int fd = std::atoi(flags["fd"].c_str());
  kt::OobChannel channel(fd);
  kt::UcxTransportOptions options;
  options.name = "bench-target";
  options.tls = flags["tls"];
  options.net_devices = flags["net_devices"];
  auto transport = kt::CreateUcxTransport(options);
  if (!transport.ok()) return 3;
  auto region = (*transport)->AllocateRegion(kRegionBytes);
  if (!region.ok()) return 4;
  if (!channel.Send(*(*transport)->LocalAddress()).ok() ||
      !channel.Send(*(*transport)->DescribeRegion(region->id)).ok()) {
    return 5;
  }
  while (channel.Receive(absl::Hours(1)).ok()) {
  }
  return 0;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string EnvPrefix(const Link& link) {
  std::string env = absl::StrCat("UCX_TLS=", link.tls);
  if (!link.net_devices.empty()) {
    absl::StrAppend(&env, " UCX_NET_DEVICES=", link.net_devices);
  }
  return env;
}

// ucx_perftest ucp_put_bw on the same transport; returns GB/s (1e9), or a
// negative value when it could not run.
double PerftestPutBandwidth(const std::string& perftest, const Link& link,
                            uint64_t size, uint64_t iterations) {
  const int port = FreePort();
  const std::string env = EnvPrefix(link);
  std::string server = absl::StrCat(env, " ", perftest, " -p ", port,
                                    " >/dev/null 2>&1 &");
  if (std::system(server.c_str()) != 0) return -1;
  absl::SleepFor(absl::Milliseconds(300));
  std::string client = absl::StrCat(
      env, " ", perftest, " 127.0.0.1 -p ", port, " -t ucp_put_bw -s ", size,
      " -n ", iterations, " -w ", std::max<uint64_t>(iterations / 10, 1),
      " -f 2>&1");
  FILE* out = popen(client.c_str(), "r");
  if (!out) return -1;
  char line[1024];
  double mib_per_s = -1;
  while (fgets(line, sizeof(line), out)) {
    std::vector<std::string> fields =
        absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
    // Final line: iterations, p50, avg, overall, bw avg, bw overall, ...
    uint64_t iters;
    double bw;
    if (fields.size() >= 6 && absl::SimpleAtoi(fields[0], &iters) &&
        absl::SimpleAtod(fields[5], &bw)) {
      mib_per_s = bw;
    }
  }
  pclose(out);
  return mib_per_s < 0 ? -1 : mib_per_s * 1048576.0 / 1e9;
}

struct Target {
  pid_t pid = -1;
  kt::OobChannel channel{-1};
  std::string address, descriptor;
};

Target SpawnTarget(const Link& link) {
  auto pair = *kt::OobChannel::SocketPair();
  Target t;
  int child_fd = pair.second.fd();
  std::vector<std::string> args = {
      "/proc/self/exe", "--role=target", absl::StrCat("--fd=", child_fd),
      absl::StrCat("--tls=", link.tls),
      absl::StrCat("--net_devices=", link.net_devices)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  t.pid = fork();
  if (t.pid == 0) {
    int flags = fcntl(child_fd, F_GETFD);
    fcntl(child_fd, F_SETFD, flags & ~FD_CLOEXEC);
    execv(argv[0], argv.data());
    _exit(127);
  }
  t.channel = std::move(pair.first);
  t.address = *t.channel.Receive(absl::Seconds(20));
  t.descriptor = *t.channel.Receive(absl::Seconds(20));
  return t;
}

struct Session {
  kt::Transport* transport;
  kt::LocalRegion local;
  kt::PeerId peer;
  kt::RemoteRegionId remote;

  // Posts `batches` batches of the given ops with up to `window` in flight;
  // returns the elapsed seconds.
  double Run(const std::vector<kt::TransferOp>& ops, int batches, int window) {
    std::vector<kt::TransferId> inflight;
    absl::Time start = absl::Now();
    for (int b = 0; b < batches; ++b) {
      if (static_cast<int>(inflight.size()) == window) {
        Finish(inflight.front());
        inflight.erase(inflight.begin());
      }
      auto id = transport->PostTransfer(peer, kt::Direction::kWrite, ops);
      if (!id.ok()) {
        std::fprintf(stderr, "post: %s\n", id.status().ToString().c_str());
        std::exit(1);
      }
      inflight.push_back(*id);
    }
    for (kt::TransferId id : inflight) Finish(id);
    return absl::ToDoubleSeconds(absl::Now() - start);
  }
  void Finish(kt::TransferId id) {
    absl::Status s = transport->Wait(id, absl::Seconds(60));
    if (!s.ok() || !transport->ReleaseTransfer(id).ok()) {
      std::fprintf(stderr, "transfer: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  }
};

void BenchLink(const Link& link, uint64_t budget, const std::string& perftest,
               std::vector<kt::LinkSample>* samples) {
  Target target = SpawnTarget(link);
  kt::UcxTransportOptions options;
  options.name = "bench-initiator";
  options.tls = link.tls;
  options.net_devices = link.net_devices;
  options.transfer_timeout = absl::Seconds(60);
  auto transport = *kt::CreateUcxTransport(options);
  Session s{transport.get(), *transport->AllocateRegion(kRegionBytes), 0, 0};
  std::memset(s.local.address, 0x5a, kRegionBytes);
  s.peer = *transport->Connect(target.address);
  s.remote = *transport->ImportRegion(s.peer, target.descriptor);

  std::printf("\n== %s (UCX_TLS=%s%s%s) ==\n", link.name.c_str(),
              link.tls.c_str(), link.net_devices.empty() ? "" : " UCX_NET_DEVICES=",
              link.net_devices.c_str());
  std::printf("%10s %12s %14s %8s %12s\n", "size", "ours GB/s", "perftest GB/s",
              "ratio", "lat us (p50)");
  for (uint64_t size = 4096; size <= kRegionBytes; size *= 4) {
    // Like ucp_put_bw: every message writes the same buffers.
    const uint64_t iterations = std::clamp<uint64_t>(budget / size, 8, 200000);
    const int per_batch = static_cast<int>(
        std::clamp<uint64_t>((8ull << 20) / size, 1, iterations));
    std::vector<kt::TransferOp> ops(per_batch,
                                    {s.local.id, 0, s.remote, 0, size});
    const int batches = static_cast<int>(iterations / per_batch);
    s.Run(ops, std::max(1, batches / 10), 4);  // warm-up
    double seconds = s.Run(ops, batches, 4);
    double ours = static_cast<double>(size) * per_batch * batches / seconds / 1e9;
    // Latency: one message, post to completion (remote flush included).
    std::vector<double> lat;
    std::vector<kt::TransferOp> one = {{s.local.id, 0, s.remote, 0, size}};
    const int reps = size <= (1 << 20) ? 200 : 10;
    for (int i = 0; i < reps; ++i) lat.push_back(s.Run(one, 1, 1));
    std::sort(lat.begin(), lat.end());
    samples->push_back({size, 1, lat[lat.size() / 2]});
    double theirs = PerftestPutBandwidth(perftest, link, size, iterations);
    std::string ratio = theirs > 0 ? absl::StrFormat("%.2f", ours / theirs) : "n/a";
    std::printf("%10s %12.2f %14s %8s %12.1f\n",
                size >= (1 << 20) ? absl::StrCat(size >> 20, " MiB").c_str()
                                  : absl::StrCat(size >> 10, " KiB").c_str(),
                ours, theirs > 0 ? absl::StrFormat("%.2f", theirs).c_str() : "n/a",
                ratio.c_str(), lat[lat.size() / 2] * 1e6);
    std::fflush(stdout);
  }

  // Scatter-gather: 64 MiB as 1024 pieces of 64 KiB at shuffled offsets on
  // both sides, against the same bytes as one contiguous message.
  std::vector<uint64_t> slots(kRegionBytes / kPiece);
  for (uint64_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::mt19937_64 rng(1);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<kt::TransferOp> sg;
  for (uint64_t i = 0; i < slots.size(); ++i) {
    sg.push_back({s.local.id, i * kPiece, s.remote, slots[i] * kPiece, kPiece});
  }
  std::vector<kt::TransferOp> contiguous = {
      {s.local.id, 0, s.remote, 0, kRegionBytes}};
  const int reps = std::max<int>(2, static_cast<int>(budget / kRegionBytes));
  s.Run(sg, 1, 1);
  s.Run(contiguous, 1, 1);
  double sg_s = s.Run(sg, reps, 2) / reps;
  double contig_s = s.Run(contiguous, reps, 2) / reps;
  samples->push_back({kRegionBytes, sg.size(), s.Run(sg, 1, 1)});
  samples->push_back({kRegionBytes, 1, s.Run(contiguous, 1, 1)});
  std::printf("scatter-gather 1024 x 64 KiB: %.2f GB/s; contiguous 64 MiB: "
              "%.2f GB/s; sg/contiguous %.2f\n",
              kRegionBytes / sg_s / 1e9, kRegionBytes / contig_s / 1e9,
              contig_s / sg_s);

  target.channel = kt::OobChannel(-1);
  waitpid(target.pid, nullptr, 0);
}

}  // namespace

int main(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv);
  if (flags["role"] == "target") return RunTarget(flags);
  spdlog::set_level(spdlog::level::warn);
  std::string perftest = flags.count("perftest") ? flags["perftest"] : "ucx_perftest";
  uint64_t budget_mib = 512;
  if (flags.count("budget_mib")) absl::SimpleAtoi(flags["budget_mib"], &budget_mib);
  std::string links = flags.count("links") ? flags["links"] : "shm,tcp";
  std::vector<Link> all = {{"shm", "posix,cma", ""},
                           {"shm_sysv", "sysv,cma", ""},
                           {"tcp", "tcp", "lo"}};
  for (const Link& link : all) {
    std::vector<std::string> wanted = absl::StrSplit(links, ',');
    if (std::find(wanted.begin(), wanted.end(), link.name) == wanted.end()) continue;
    std::vector<kt::LinkSample> samples;
    uint64_t budget = (link.name == "tcp" ? budget_mib / 4 : budget_mib) << 20;
    BenchLink(link, budget, perftest, &samples);
    auto model = kt::FitLinkModel("measured-" + link.name, samples);
    if (model.ok()) {
      std::printf("cost model fit: latency %.1f us, per message %.2f us, "
                  "bandwidth %.2f GB/s\n",
                  model->latency_s * 1e6, model->per_message_s * 1e6,
                  model->bandwidth_bytes_per_s / 1e9);
      // SmolLM2-135M: 30 layers x K,V x 3 heads x 64 dims x 2 bytes per token.
      const uint64_t tokens = 4096, bytes = tokens * 30 * 2 * 3 * 64 * 2;
      auto d = kt::ChooseTransferOrRecompute(*model, bytes, bytes / kPiece + 1,
                                             tokens, 20000);
      std::printf("4096-token SmolLM2 prefix (%.1f MiB): transfer %.2f ms vs "
                  "recompute %.2f ms at 20k tok/s -> %s\n",
                  bytes / 1048576.0, d.transfer_s * 1e3, d.recompute_s * 1e3,
                  d.transfer ? "transfer" : "recompute");
    } else {
      std::printf("cost model fit failed: %s\n", model.status().ToString().c_str());
    }
  }
  return 0;
}
