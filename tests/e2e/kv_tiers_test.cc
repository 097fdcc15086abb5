// The disk KV tier across daemon restarts, on stories260K: daemon A (a tiny
// primary pool, a disk tier, no host tier) serves a prompt three times (its
// blocks are hit twice, so they qualify for the disk), then other prompts
// evict it to disk, and A stops. Daemon B on a renamed copy of the same
// model file finds the blocks (gRPC usage reports disk-tier tokens): the
// fingerprint is the weights' content, not the name. Daemon C on a file
// that differs in one byte finds none and says so in one log line. Also the
// host tier end to end: usage and GetStats name the tier a prefix came from.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/kvserve.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace pb = ::kvserve::v1;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

std::unique_ptr<testing::Daemon> StartDaemon(const std::string& model,
                                             const std::vector<std::string>& extra) {
  return testing::StartServe(KVSERVE_BINARY, model, "info",
                             {"--kv-cache-memory", "128KiB", "--drain-timeout", "2"}, extra);
}

// BOS and 99 tokens particular to seed: 6 full blocks of 16 in
// stories260K's 128-token context.
pb::GenerateRequest Prompt(int seed) { return testing::SeededGreedyRequest(seed); }

std::string CopyModel(const std::string& dir, const std::string& name, bool alter) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/" + name;
  std::filesystem::copy_file(testing::Stories260KPath(), path,
                             std::filesystem::copy_options::overwrite_existing);
  if (alter) {
    // One bit of the last tensor's last float's low mantissa byte.
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-4, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-4, std::ios::end);
    f.put(static_cast<char>(c ^ 1));
  }
  return path;
}

TEST(KvTiersE2eTest, ARestartedDaemonFindsItsDiskTierOnTheSameModelOnly) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const std::string root = testing::TempDir() + "/kv-tiers-restart";
  std::filesystem::remove_all(root);
  const std::string disk = root + "/disk";
  const std::vector<std::string> tier_flags = {"--kv-disk-dir", disk, "--kv-disk-bytes", "16MiB"};
  const pb::GenerateRequest p = Prompt(1);
  {
    auto a = StartDaemon(CopyModel(root + "/a", "stories.gguf", false), tier_flags);
    ASSERT_TRUE(a);
    auto ch = testing::GrpcChannel(a->grpc_port());
    for (int i = 0; i < 3; ++i) testing::GrpcGenerateOk(ch, p);          // two hits on every block
    for (int s = 2; s < 5; ++s) testing::GrpcGenerateOk(ch, Prompt(s));  // evict it (to disk)
    // Disk writes run on the tier's own thread: wait for them (a bound, not
    // a timing assertion), as a loaded machine finishes the last one late.
    pb::Stats st;
    auto on_disk = [](const pb::Stats& s) { return s.disk_tier_demotions() >= 4; };
    EXPECT_TRUE(testing::PollStats(ch, on_disk, 101, 100ms, &st).ok());
    EXPECT_GE(st.disk_tier_demotions(), 4) << "evicted blocks went to disk";
    EXPECT_EQ(a->StopWith(SIGTERM, 20), 0) << a->Log();
    // The first block stayed in the pool until the end: written at shutdown.
    EXPECT_THAT(a->Log(), HasSubstr("1 blocks written at shutdown"));
  }
  {
    auto b = StartDaemon(CopyModel(root + "/b", "renamed-copy.gguf", false), tier_flags);
    ASSERT_TRUE(b);
    auto ch = testing::GrpcChannel(b->grpc_port());
    const pb::Usage u = testing::GrpcGenerateOk(ch, p).usage;
    EXPECT_EQ(u.cached_disk_tokens(), 96) << "six blocks from the disk tier";
    EXPECT_EQ(u.cached_prompt_tokens(), 96);
    EXPECT_EQ(u.cached_host_tokens(), 0);
    const pb::Stats st = testing::GrpcStats(ch);
    EXPECT_EQ(st.disk_tier_promotions(), 6);
    EXPECT_EQ(st.disk_tier_hit_tokens(), 96);
    EXPECT_EQ(st.tier_checksum_failures(), 0);
    EXPECT_THAT(b->Log(), HasSubstr("6 blocks found from an earlier run")) << b->Log();
  }
  {
    auto c = StartDaemon(CopyModel(root + "/c", "stories.gguf", true), tier_flags);
    ASSERT_TRUE(c);
    auto ch = testing::GrpcChannel(c->grpc_port());
    const pb::Usage u = testing::GrpcGenerateOk(ch, p).usage;
    EXPECT_EQ(u.cached_disk_tokens(), 0) << "another model's blocks are never read";
    EXPECT_EQ(u.cached_prompt_tokens(), 0);
    EXPECT_THAT(c->Log(), HasSubstr("ignoring 1 directories"));
  }
}

TEST(KvTiersE2eTest, HostTierHitsAreReportedPerTier) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon(testing::Stories260KPath(), {"--kv-host-memory", "4MiB"});
  ASSERT_TRUE(d);
  auto ch = testing::GrpcChannel(d->grpc_port());
  const pb::GenerateRequest p = Prompt(7);
  testing::GrpcGenerateOk(ch, p);
  for (int s = 8; s < 10; ++s) testing::GrpcGenerateOk(ch, Prompt(s));
  const pb::Usage u = testing::GrpcGenerateOk(ch, p).usage;
  // The pool may still hold the first block or two; the rest came from host.
  EXPECT_EQ(u.cached_prompt_tokens(), 96) << u.DebugString();
  EXPECT_GE(u.cached_host_tokens(), 64) << u.DebugString();
  const pb::Stats st = testing::GrpcStats(ch);
  EXPECT_GE(st.host_tier_demotions(), 6);
  EXPECT_EQ(st.host_tier_promotions() * 16, u.cached_host_tokens());
  EXPECT_GT(st.host_tier_capacity_blocks(), 0);
  EXPECT_GT(st.tier_loads(), 0);
}

TEST(KvTiersE2eTest, BadTierFlagsAreNamed) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  const testing::CommandResult r = testing::RunCommand(
      std::string(KVSERVE_BINARY) + " -m " + testing::Stories260KPath() +
      " serve --grpc-address 127.0.0.1:0 --http-port 0 --kv-host-memory lots 2>&1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("--kv-host-memory"));
}

}  // namespace
}  // namespace kvserve
