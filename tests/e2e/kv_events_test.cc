// The prefix cache's KV event stream end to end, on stories260K: a real
// `kvserve serve` daemon (small event window, small KV pool so that blocks
// get evicted) and a client that rebuilds the index from SubscribeKvEvents
// alone, through live events, a reconnect that replays a small gap, and a
// reconnect after a gap larger than the window (a snapshot). The replica
// must equal a fresh snapshot of the server's index each time. Also:
// cached_tokens in gRPC and HTTP usage, the clear endpoints, the API key,
// and a prompt shutdown with subscribers attached.
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e_client.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace pb = ::kvserve::v1;
using json = nlohmann::json;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr char kApiKey[] = "open-sesame";
// --kv-events-retain: small enough that a long disconnect outlives it, large
// enough that a live subscriber on a loaded 2-core machine does not fall
// behind it (one request publishes about five events).
constexpr int kRetain = 32;

std::unique_ptr<testing::Daemon> StartDaemon(const std::vector<std::string>& extra) {
  return testing::StartServe(KVSERVE_BINARY, testing::Stories260KPath(), "warn",
                             {"--api-key", kApiKey, "--kv-events-retain", std::to_string(kRetain),
                              "--kv-cache-memory", "512KiB", "--drain-timeout", "2"},
                             extra);
}

void Authorize(grpc::ClientContext* ctx, const std::string& key = kApiKey) {
  if (!key.empty()) ctx->AddMetadata("authorization", "Bearer " + key);
}

// The index as a router rebuilds it. Violations of the stream's promises
// (a sequence gap, an unknown parent, an unknown removal) are recorded,
// not asserted, because they happen on the reader thread.
struct Replica {
  struct Block {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    bool operator==(const Block& o) const { return parent == o.parent && tokens == o.tokens; }
  };
  std::map<uint64_t, Block> blocks;
  uint64_t position = 0;
  uint64_t epoch = 0;
  bool in_snapshot = false;
  int snapshots = 0;
  int stored = 0, removed = 0, cleared = 0;
  std::string error;

  void Fail(const std::string& what) {
    if (error.empty()) error = what;
  }

  void Store(const pb::KvBlockStored& b) {
    if (b.parent_hash() != 0 && blocks.count(b.parent_hash()) == 0) {
      Fail("block " + std::to_string(b.block_hash()) + " arrived before its parent");
    }
    if (b.token_count() != b.token_ids_size()) Fail("token_count disagrees with token_ids");
    blocks[b.block_hash()] = Block{b.parent_hash(), {b.token_ids().begin(), b.token_ids().end()}};
  }

  void Apply(const pb::KvEventsResponse& msg) {
    if (msg.epoch() == 0) Fail("message without an epoch");
    if (epoch != 0 && msg.epoch() != epoch && !msg.has_snapshot()) {
      Fail("events of another epoch without a snapshot");
    }
    epoch = msg.epoch();
    if (msg.has_snapshot()) {
      const pb::KvSnapshotChunk& chunk = msg.snapshot();
      if (chunk.index() == 0) {
        blocks.clear();
        in_snapshot = true;
      } else if (!in_snapshot) {
        Fail("snapshot chunk " + std::to_string(chunk.index()) + " without chunk 0");
      }
      for (const pb::KvBlockStored& b : chunk.blocks()) Store(b);
      if (chunk.last()) {
        in_snapshot = false;
        position = chunk.as_of_sequence();
        ++snapshots;
      }
    }
    for (const pb::KvEvent& e : msg.events()) {
      if (in_snapshot) Fail("events inside a snapshot");
      if (e.sequence() != position + 1) {
        Fail("expected sequence " + std::to_string(position + 1) + ", got " +
             std::to_string(e.sequence()));
      }
      position = e.sequence();
      switch (e.event_case()) {
        case pb::KvEvent::kBlockStored:
          ++stored;
          Store(e.block_stored());
          break;
        case pb::KvEvent::kBlockRemoved:
          ++removed;
          if (blocks.erase(e.block_removed().block_hash()) == 0) Fail("removal of unknown block");
          break;
        case pb::KvEvent::kAllCleared:
          ++cleared;
          blocks.clear();
          break;
        case pb::KvEvent::EVENT_NOT_SET:
          Fail("event without a kind");
          break;
      }
    }
    if (!msg.has_snapshot() && msg.events_size() > 0 && msg.sequence() != position) {
      Fail("message sequence disagrees with its last event");
    }
  }
};

// A subscription on its own thread, applying into a Replica that survives
// reconnects.
class Subscriber {
 public:
  explicit Subscriber(std::shared_ptr<grpc::Channel> channel) : channel_(std::move(channel)) {}
  ~Subscriber() { (void)Stop(); }

  // Subscribes after the replica's position (0 at first).
  void Start(bool snapshot = false) {
    ctx_ = std::make_unique<grpc::ClientContext>();
    Authorize(ctx_.get());
    pb::SubscribeKvEventsRequest request;
    {
      std::lock_guard<std::mutex> lock(mu_);
      request.set_after_sequence(replica_.position);
    }
    request.set_snapshot(snapshot);
    stub_ = pb::Kvserve::NewStub(channel_);
    thread_ = std::thread([this, request] {
      auto reader = stub_->SubscribeKvEvents(ctx_.get(), request);
      pb::KvEventsResponse msg;
      while (reader->Read(&msg)) {
        std::lock_guard<std::mutex> lock(mu_);
        replica_.Apply(msg);
      }
      status_ = reader->Finish();
    });
  }

  // Disconnects (as a client that loses its connection would).
  grpc::Status Stop() {
    if (!thread_.joinable()) return status_;
    ctx_->TryCancel();
    thread_.join();
    return status_;
  }

  // Waits for the server to end the stream.
  grpc::Status Join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

  Replica replica() const {
    std::lock_guard<std::mutex> lock(mu_);
    return replica_;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvserve::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::thread thread_;
  grpc::Status status_;
  mutable std::mutex mu_;
  Replica replica_;  // guarded by mu_
};

// The server's index now, through a snapshot-only subscription.
Replica FreshSnapshot(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = pb::Kvserve::NewStub(channel);
  grpc::ClientContext ctx;
  Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  pb::SubscribeKvEventsRequest request;
  request.set_snapshot(true);
  auto reader = stub->SubscribeKvEvents(&ctx, request);
  Replica r;
  pb::KvEventsResponse msg;
  while (reader->Read(&msg)) {
    r.Apply(msg);
    if (msg.has_snapshot() && msg.snapshot().last()) break;
  }
  ctx.TryCancel();
  (void)reader->Finish();
  EXPECT_EQ(r.snapshots, 1) << "no complete snapshot";
  return r;
}

// Waits until the subscriber's replica equals a fresh snapshot at the same
// sequence (requests finish before their blocks enter the cache, so the
// index may still move for a moment after the last response).
::testing::AssertionResult InSync(Subscriber& sub, const std::shared_ptr<grpc::Channel>& channel) {
  Replica mine, theirs;
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < give_up) {
    theirs = FreshSnapshot(channel);
    mine = sub.replica();
    if (!mine.error.empty()) return ::testing::AssertionFailure() << mine.error;
    if (mine.position == theirs.position && mine.blocks == theirs.blocks) {
      return ::testing::AssertionSuccess();
    }
    std::this_thread::sleep_for(50ms);
  }
  return ::testing::AssertionFailure()
         << "replica at #" << mine.position << " with " << mine.blocks.size()
         << " blocks; server at #" << theirs.position << " with " << theirs.blocks.size();
}

// Runs one greedy request to its end; returns its usage.
pb::Usage Generate(const std::shared_ptr<grpc::Channel>& channel, const pb::GenerateRequest& r,
                   grpc::Status* status = nullptr) {
  const testing::GrpcReply reply = testing::GrpcGenerate(channel, r, kApiKey);
  if (status != nullptr) {
    *status = reply.status;
  } else {
    EXPECT_TRUE(reply.status.ok()) << reply.status.error_message();
  }
  return reply.usage;
}

// A prompt of token ids: BOS, a prefix shared by every request of
// `family`, then `suffix_tokens` tokens particular to `seed`. The default
// makes 6 full blocks (4 of them new) in stories260K's 128-token context,
// so a few dozen requests overflow the 51-block pool of --kv-cache-memory.
pb::GenerateRequest SharedPrefixRequest(int family, int seed, int suffix_tokens = 72) {
  pb::GenerateRequest r;
  std::mt19937 rng(1000 * family + 7);
  r.add_prompt_ids(1);
  for (int i = 0; i < 31; ++i) r.add_prompt_ids(3 + static_cast<int32_t>(rng() % 480));
  std::mt19937 tail(seed * 7919 + family);
  for (int i = 0; i < suffix_tokens; ++i) r.add_prompt_ids(3 + static_cast<int32_t>(tail() % 480));
  r.mutable_sampling()->set_max_tokens(4);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

TEST(KvEventsTest, ReplicaFromEventsAloneMatchesTheServerAcrossReconnects) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  int next_seed = 0;
  auto send = [&](int n, int family) {
    for (int i = 0; i < n; ++i) Generate(channel, SharedPrefixRequest(family, next_seed++));
  };

  // Live: a new subscriber follows requests that share prefixes.
  Subscriber sub(channel);
  sub.Start();
  send(1, 1);
  // The subscription is live once its first event arrives.
  for (int i = 0; i < 400 && sub.replica().position == 0; ++i) std::this_thread::sleep_for(50ms);
  ASSERT_GT(sub.replica().position, 0u) << "no event reached the subscriber";
  send(5, 1);
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_GT(sub.replica().stored, 0);
  EXPECT_EQ(sub.replica().snapshots, 0);  // every event was still retained

  // A short disconnect: one request publishes fewer events than the window
  // holds, so the reconnect replays exactly what was missed.
  ASSERT_TRUE(sub.Stop().error_code() == grpc::StatusCode::CANCELLED);
  const uint64_t left_at = sub.replica().position;
  Generate(channel, SharedPrefixRequest(1, next_seed++));
  const uint64_t missed = FreshSnapshot(channel).position - left_at;
  sub.Start();
  ASSERT_TRUE(InSync(sub, channel));
  if (missed <= static_cast<uint64_t>(kRetain)) {
    EXPECT_EQ(sub.replica().snapshots, 0) << "a gap of " << missed << " events was replayed";
  }

  // A long disconnect: far more events than the window holds, evictions
  // among them (the pool is small). The reconnect gets a snapshot.
  ASSERT_TRUE(sub.Stop().error_code() == grpc::StatusCode::CANCELLED);
  const uint64_t gap_from = sub.replica().position;
  send(12, 2);
  send(4, 1);
  ASSERT_GT(FreshSnapshot(channel).position - gap_from, static_cast<uint64_t>(kRetain));
  sub.Start();
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_EQ(sub.replica().snapshots, 1);

  // Live again after the snapshot, until blocks are evicted under it.
  const int removed_before = sub.replica().removed;
  send(16, 3);
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_GT(sub.replica().removed, removed_before) << "no eviction: is the KV pool small?";

  // The server agrees on what it holds. Stats are a snapshot published at
  // the end of each engine step, while events go out during it: poll briefly
  // so a step still finishing (a loaded machine) is not a mismatch.
  pb::Stats stats;
  auto agrees = [&](const pb::Stats& st) {
    return st.prefix_cached_blocks() == static_cast<int64_t>(sub.replica().blocks.size());
  };
  ASSERT_TRUE(testing::PollStats(channel, agrees, 100, 50ms, &stats, kApiKey).ok());
  EXPECT_TRUE(stats.prefix_cache_enabled());
  EXPECT_EQ(stats.prefix_cached_blocks(), static_cast<int64_t>(sub.replica().blocks.size()));
  EXPECT_GT(stats.prefix_hit_tokens(), 0);
  EXPECT_GT(stats.prefix_evicted_blocks(), 0);
  EXPECT_EQ(sub.Stop().error_code(), grpc::StatusCode::CANCELLED);
}

TEST(KvEventsTest, CachedTokensAppearInGrpcAndHttpUsage) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  const std::string prompt =
      "Once upon a time there was a little girl named Lily. She loved to play outside in the "
      "park with her friends";

  pb::GenerateRequest r;
  r.set_prompt(prompt);
  r.mutable_sampling()->set_max_tokens(4);
  r.mutable_sampling()->set_temperature(0);
  const pb::Usage first = Generate(channel, r);
  ASSERT_GE(first.prompt_tokens(), 32) << "the prompt must span two full blocks";
  EXPECT_EQ(first.cached_prompt_tokens(), 0);
  // Blocks enter the cache as the first request finishes; wait until they
  // are visible to new requests.
  pb::Usage again;
  for (int i = 0; i < 100 && again.cached_prompt_tokens() == 0; ++i) {
    again = Generate(channel, r);
    if (again.cached_prompt_tokens() == 0) std::this_thread::sleep_for(20ms);
  }
  EXPECT_GT(again.cached_prompt_tokens(), 0);
  EXPECT_LE(again.cached_prompt_tokens(), again.prompt_tokens());

  // Another salt shares nothing.
  pb::GenerateRequest salted = r;
  salted.set_cache_salt("tenant-b");
  EXPECT_EQ(Generate(channel, salted).cached_prompt_tokens(), 0);

  httplib::Client http("127.0.0.1", d->http_port());
  http.set_read_timeout(60, 0);
  http.set_bearer_token_auth(kApiKey);
  json body = {{"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0}};
  auto res = http.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json j = json::parse(res->body);
  EXPECT_GT(j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0) << res->body;

  // The final usage chunk of a stream carries it too.
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  res = http.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  int cached_in_stream = -1;
  std::istringstream lines(res->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    json chunk = json::parse(line.substr(6));
    if (chunk.contains("usage") && !chunk["usage"].is_null()) {
      cached_in_stream = chunk["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
    }
  }
  EXPECT_GT(cached_in_stream, 0) << res->body;

  // A salt that is not a string is refused, naming the field.
  json bad = {{"prompt", prompt}, {"max_tokens", 1}, {"cache_salt", 7}};
  res = http.Post("/v1/completions", bad.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_THAT(res->body, HasSubstr("cache_salt"));
}

TEST(KvEventsTest, ClearEndpointsEmptyTheIndexAndPublishAllCleared) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  Subscriber sub(channel);
  sub.Start();
  Generate(channel, SharedPrefixRequest(1, 0));
  ASSERT_TRUE(InSync(sub, channel));
  const size_t cached = sub.replica().blocks.size();
  ASSERT_GT(cached, 0u);

  httplib::Client http("127.0.0.1", d->http_port());
  http.set_read_timeout(60, 0);
  auto res = http.Post("/admin/clear_prefix_cache", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);  // behind the API key
  http.set_bearer_token_auth(kApiKey);
  res = http.Post("/admin/clear_prefix_cache", "", "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["blocks_cleared"].get<size_t>(), cached);
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_EQ(sub.replica().cleared, 1);
  EXPECT_TRUE(sub.replica().blocks.empty());

  // The gRPC method, after the index filled again.
  Generate(channel, SharedPrefixRequest(2, 0));
  ASSERT_TRUE(InSync(sub, channel));
  auto stub = pb::Kvserve::NewStub(channel);
  {
    grpc::ClientContext ctx;
    pb::ClearPrefixCacheResponse response;
    EXPECT_EQ(stub->ClearPrefixCache(&ctx, pb::ClearPrefixCacheRequest(), &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext ctx;
  Authorize(&ctx);
  pb::ClearPrefixCacheResponse response;
  grpc::Status s = stub->ClearPrefixCache(&ctx, pb::ClearPrefixCacheRequest(), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GT(response.blocks_cleared(), 0);
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_EQ(sub.replica().cleared, 2);
  EXPECT_TRUE(sub.replica().blocks.empty());

  // Metrics count what happened (stats are published right after the
  // clear answers, so allow a moment).
  const std::string empty_cache =
      "kvserve:prefix_cache_cached_blocks{model_name=\"stories260K\"} 0\n";
  for (int i = 0; i < 100; ++i) {
    res = http.Get("/metrics");
    ASSERT_TRUE(res);
    if (res->body.find(empty_cache) != std::string::npos) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_THAT(res->body, HasSubstr(empty_cache));
  EXPECT_THAT(res->body, HasSubstr("# TYPE kvserve:prefix_cache_hits_total counter"));
  EXPECT_THAT(res->body, HasSubstr("kvserve:prefix_cache_hit_rate{"));
}

// The first message of a subscription from (after_sequence, epoch).
pb::KvEventsResponse FirstMessage(const std::shared_ptr<grpc::Channel>& channel, uint64_t after,
                                  uint64_t epoch) {
  auto stub = pb::Kvserve::NewStub(channel);
  grpc::ClientContext ctx;
  Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  pb::SubscribeKvEventsRequest request;
  request.set_after_sequence(after);
  request.set_epoch(epoch);
  auto reader = stub->SubscribeKvEvents(&ctx, request);
  pb::KvEventsResponse msg;
  EXPECT_TRUE(reader->Read(&msg)) << "the stream sent nothing";
  ctx.TryCancel();
  (void)reader->Finish();
  return msg;
}

// A restarted daemon numbers its events from 1 again: a subscriber whose
// sequence number comes from another epoch must get a snapshot, never a
// replay of unrelated events on top of its stale replica.
TEST(KvEventsTest, ASequenceFromAnotherEpochGetsASnapshot) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  for (int i = 0; i < 3; ++i) Generate(channel, SharedPrefixRequest(1, i));
  const Replica now = FreshSnapshot(channel);
  ASSERT_NE(now.epoch, 0u);
  ASSERT_GT(now.position, 1u);
  // Same epoch, a retained position: the missed events are replayed.
  // (The daemon retains only the last kRetain events.)
  const uint64_t after = now.position - 1;
  const pb::KvEventsResponse same = FirstMessage(channel, after, now.epoch);
  EXPECT_FALSE(same.has_snapshot());
  ASSERT_GT(same.events_size(), 0);
  EXPECT_EQ(same.events(0).sequence(), after + 1);
  EXPECT_EQ(same.epoch(), now.epoch);
  // Another epoch, the same position: a snapshot.
  const pb::KvEventsResponse other = FirstMessage(channel, after, now.epoch + 1);
  ASSERT_TRUE(other.has_snapshot());
  EXPECT_EQ(other.snapshot().index(), 0u);
  EXPECT_EQ(other.epoch(), now.epoch);
}

TEST(KvEventsTest, AWrongApiKeyIsRejected) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto stub = pb::Kvserve::NewStub(testing::GrpcChannel(d->grpc_port()));
  for (const std::string key : {"", "not-the-key"}) {
    grpc::ClientContext ctx;
    Authorize(&ctx, key);
    auto reader = stub->SubscribeKvEvents(&ctx, pb::SubscribeKvEventsRequest());
    pb::KvEventsResponse msg;
    EXPECT_FALSE(reader->Read(&msg));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED) << key;
  }
  grpc::ClientContext ctx;
  Authorize(&ctx, "not-the-key");
  pb::ClearPrefixCacheResponse response;
  EXPECT_EQ(stub->ClearPrefixCache(&ctx, pb::ClearPrefixCacheRequest(), &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  httplib::Client http("127.0.0.1", d->http_port());
  http.set_bearer_token_auth("not-the-key");
  auto res = http.Post("/admin/clear_prefix_cache", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
}

TEST(KvEventsTest, WithThePrefixCacheOffEventsAndClearAreRefused) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--no-prefix-cache"});
  ASSERT_TRUE(d);
  auto stub = pb::Kvserve::NewStub(testing::GrpcChannel(d->grpc_port()));
  {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    auto reader = stub->SubscribeKvEvents(&ctx, pb::SubscribeKvEventsRequest());
    pb::KvEventsResponse msg;
    EXPECT_FALSE(reader->Read(&msg));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("prefix cache"));
  }
  grpc::ClientContext ctx;
  Authorize(&ctx);
  pb::ClearPrefixCacheResponse response;
  EXPECT_EQ(stub->ClearPrefixCache(&ctx, pb::ClearPrefixCacheRequest(), &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  httplib::Client http("127.0.0.1", d->http_port());
  http.set_bearer_token_auth(kApiKey);
  auto res = http.Post("/admin/clear_prefix_cache", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 409);
  EXPECT_THAT(res->body, HasSubstr("prefix cache"));
}

TEST(KvEventsTest, TheDaemonStopsPromptlyWithSubscribersAttached) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  std::vector<std::unique_ptr<Subscriber>> subs;
  for (int i = 0; i < 3; ++i) {
    subs.push_back(std::make_unique<Subscriber>(channel));
    subs.back()->Start();
  }
  Generate(channel, SharedPrefixRequest(1, 0));
  ASSERT_TRUE(InSync(*subs[0], channel));
  // gRPC's shutdown may wait out main's 2 s deadline for open client
  // connections; subscribers must not hold it longer than that.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(d->StopWith(SIGTERM, 15), 0) << d->Log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  for (auto& s : subs) {
    const grpc::Status status = s->Join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }
}

TEST(KvEventsTest, CliKeepsAReplicaAndClearsTheCache) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d = StartDaemon({"--prefix-cache"});
  ASSERT_TRUE(d);
  auto channel = testing::GrpcChannel(d->grpc_port());
  Subscriber sub(channel);
  sub.Start();
  for (int i = 0; i < 3; ++i) Generate(channel, SharedPrefixRequest(1, i));
  ASSERT_TRUE(InSync(sub, channel));
  const Replica want = sub.replica();

  const std::string cli = std::string(KVSERVE_CLI_BINARY) +
                          " --address 127.0.0.1:" + std::to_string(d->grpc_port()) + " --api-key " +
                          kApiKey + " --json ";
  // One snapshot, then the replica's summary.
  testing::CommandResult r = testing::RunCommand(cli + "kv-events --snapshot-only 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string summary_line = r.out.substr(r.out.rfind("{\"sequence\""));
  json summary = json::parse(summary_line);
  EXPECT_EQ(summary["sequence"].get<uint64_t>(), want.position);
  EXPECT_EQ(summary["blocks"].get<size_t>(), want.blocks.size());
  EXPECT_EQ(summary["snapshots"].get<int>(), 1);

  // Following the stream for a while: replay or snapshot, then live.
  r = testing::RunCommand(cli + "kv-events --duration 1.5 --summary 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  summary = json::parse(r.out.substr(r.out.rfind("{\"sequence\"")));
  EXPECT_EQ(summary["sequence"].get<uint64_t>(), want.position);
  EXPECT_EQ(summary["blocks"].get<size_t>(), want.blocks.size());

  r = testing::RunCommand(cli + "clear-prefix-cache 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["blocks_cleared"].get<size_t>(), want.blocks.size());
  ASSERT_TRUE(InSync(sub, channel));
  EXPECT_TRUE(sub.replica().blocks.empty());
}

}  // namespace
}  // namespace kvserve
