// The gRPC API end to end, on stories260K: every test runs against the real
// `kvserve serve` daemon (a child process on free loopback ports) and against
// an in-process server built from the same parts (fast, and debuggable in
// one process). Both are driven only through gRPC, as a client would.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"
#include "server/frontend/grpc_server.h"
#include "server/service/model_service.h"
#include "tests/testing/daemon.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

namespace pb = ::kvserve::v1;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

struct GoldenCase {
  std::string prompt;
  std::vector<int32_t> prompt_ids;  // BOS first
  std::string generated;            // the continuation only
};

std::vector<GoldenCase> LoadGolden() {
  std::vector<GoldenCase> cases;
  const std::string path = testing::Stories260KGoldenPath();
  if (path.empty()) return cases;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    GoldenCase c;
    c.prompt = j["prompt"].get<std::string>();
    c.prompt_ids = j["prompt_ids_with_bos"].get<std::vector<int32_t>>();
    // llama.cpp prints the prompt with SentencePiece's leading space.
    const std::string full = j["output_text_including_prompt"].get<std::string>();
    const std::string head = " " + c.prompt;
    if (full.compare(0, head.size(), head) != 0) continue;
    c.generated = full.substr(head.size());
    cases.push_back(std::move(c));
  }
  return cases;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// How a test wants the server configured.
struct ServerConfig {
  std::string model_path;  // empty: stories260K
  std::string api_key;
  std::string tls_cert;
  std::string tls_key;
};

ServerConfig WithApiKey(std::string key) {
  ServerConfig c;
  c.api_key = std::move(key);
  return c;
}

ServerConfig WithTls(std::string cert, std::string key) {
  ServerConfig c;
  c.tls_cert = std::move(cert);
  c.tls_key = std::move(key);
  return c;
}

class TestServer {
 public:
  virtual ~TestServer() = default;
  virtual int port() const = 0;
};

// The daemon binary as a child process. Stopped with SIGTERM and reaped in
// the destructor; a daemon that will not stop is killed, and the test fails.
class DaemonServer final : public TestServer {
 public:
  static std::unique_ptr<DaemonServer> Start(const ServerConfig& config, std::string* error) {
    static std::atomic<int> counter{0};
    const std::string dir = testing::TempDir() + "/daemon-" + std::to_string(getpid()) + "-" +
                            std::to_string(counter++);
    std::filesystem::create_directories(dir);
    const std::string port_file = dir + "/ports.json";
    const std::string log_file = dir + "/daemon.log";
    std::vector<std::string> args = {KVSERVE_BINARY,
                                     "--log-level",
                                     "warn",
                                     "-m",
                                     config.model_path.empty() ? testing::Stories260KPath()
                                                               : config.model_path,
                                     "serve",
                                     "--grpc-address",
                                     "127.0.0.1:0",
                                     "--http-port",
                                     "0",
                                     "--port-file",
                                     port_file,
                                     "--drain-timeout",
                                     "2"};
    if (!config.api_key.empty()) args.insert(args.end(), {"--api-key", config.api_key});
    if (!config.tls_cert.empty()) {
      args.insert(args.end(), {"--tls-cert", config.tls_cert, "--tls-key", config.tls_key});
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    auto d = std::unique_ptr<DaemonServer>(new DaemonServer());
    d->log_file_ = log_file;
    d->pid_ = fork();
    if (d->pid_ < 0) {
      *error = "fork failed";
      return nullptr;
    }
    if (d->pid_ == 0) {
      // Child: only async-signal-safe calls until exec.
      FILE* log = std::fopen(log_file.c_str(), "w");
      if (log != nullptr) {
        dup2(fileno(log), STDOUT_FILENO);
        dup2(fileno(log), STDERR_FILENO);
      }
      execv(argv[0], argv.data());
      _exit(127);
    }
    const auto give_up = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < give_up) {
      int status = 0;
      if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
        d->pid_ = -1;
        *error = "daemon exited before listening:\n" + ReadAll(log_file);
        return nullptr;
      }
      std::ifstream in(port_file);
      if (in) {
        auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("grpc")) {
          d->port_ = j["grpc"].get<int>();
          return d;
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    *error = "daemon did not write " + port_file + " in 60 s:\n" + ReadAll(log_file);
    return nullptr;  // the destructor stops it
  }

  ~DaemonServer() override {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (waitpid(pid_, &status, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() > give_up) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        ADD_FAILURE() << "daemon ignored SIGTERM; killed. Log:\n" << ReadAll(log_file_);
        return;
      }
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "daemon exit status " << status << ". Log:\n"
        << ReadAll(log_file_);
  }

  int port() const override { return port_; }

 private:
  DaemonServer() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_file_;
};

// The same parts the daemon wires, in this process.
class InProcessServer final : public TestServer {
 public:
  static std::unique_ptr<InProcessServer> Start(const ServerConfig& config, std::string* error) {
    auto s = std::unique_ptr<InProcessServer>(new InProcessServer());
    auto model = LlamaModel::Load(config.model_path.empty() ? testing::Stories260KPath()
                                                            : config.model_path);
    if (!model.ok()) {
      *error = model.status().ToString();
      return nullptr;
    }
    s->model_ = std::move(model).value();
    auto tok = Tokenizer::FromGguf(s->model_->file());
    if (!tok.ok()) {
      *error = tok.status().ToString();
      return nullptr;
    }
    s->tokenizer_ = std::move(tok).value();
    std::optional<ChatTemplate> chat;
    if (auto t = ChatTemplate::FromGguf(s->model_->file()); t.ok()) chat = *t;
    EngineOptions eo;
    eo.num_blocks = 2048;
    auto engine = Engine::Create(s->model_.get(), s->tokenizer_.get(), &s->pool_, eo);
    if (!engine.ok()) {
      *error = engine.status().ToString();
      return nullptr;
    }
    s->engine_ = std::move(engine).value();
    s->metrics_ = std::make_unique<Metrics>("stories260K");
    s->service_ =
        std::make_unique<ModelService>("stories260K", s->model_.get(), s->tokenizer_.get(), chat,
                                       s->engine_.get(), ServiceLimits{}, s->metrics_.get());
    s->engine_->Start();
    GrpcServerOptions go;
    go.address = "127.0.0.1:0";
    go.api_key = config.api_key;
    go.tls_cert = config.tls_cert;
    go.tls_key = config.tls_key;
    auto grpc = GrpcServer::Start(s->service_.get(), go);
    if (!grpc.ok()) {
      *error = grpc.status().ToString();
      return nullptr;
    }
    s->grpc_ = std::move(grpc).value();
    return s;
  }

  ~InProcessServer() override {
    // Streams first (their cancels reach a live engine), then the engine.
    if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now() + 1s);
    grpc_.reset();
    if (engine_) engine_->Stop();
  }

  int port() const override { return grpc_->port(); }

 private:
  InProcessServer() : pool_(1) {}
  ThreadPool pool_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ModelService> service_;
  std::unique_ptr<GrpcServer> grpc_;
};

enum class Mode { kDaemon, kInProcess };

struct StreamResult {
  grpc::Status status;
  std::string text;
  std::vector<int32_t> token_ids;
  std::string finish_reason;
  pb::Usage usage;
  int chunks = 0;
  int chunks_with_usage = 0;
};

struct InvalidCase {
  const char* name;
  std::function<void(pb::GenerateRequest*)> mutate;
  grpc::StatusCode code;
  const char* field;
};

class GrpcTest : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    if (testing::Stories260KPath().empty()) GTEST_SKIP() << "stories260K.gguf not found";
    golden_ = LoadGolden();
    if (golden_.empty()) GTEST_SKIP() << "golden outputs not found";
  }

  // Starts the server under test; fails the test (returns false) if it won't.
  bool StartServer(const ServerConfig& config = {}) {
    std::string error;
    if (GetParam() == Mode::kDaemon) {
      server_ = DaemonServer::Start(config, &error);
    } else {
      server_ = InProcessServer::Start(config, &error);
    }
    if (server_ == nullptr) {
      ADD_FAILURE() << "server did not start: " << error;
      return false;
    }
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = pb::Kvserve::NewStub(channel_);
    return true;
  }

  void TearDown() override {
    stub_.reset();
    channel_.reset();
    server_.reset();
  }

  std::unique_ptr<grpc::ClientContext> Context(const std::string& api_key = "") {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + 60s);
    if (!api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + api_key);
    return ctx;
  }

  static pb::GenerateRequest Greedy(const std::string& prompt, int max_tokens) {
    pb::GenerateRequest r;
    r.set_prompt(prompt);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    return r;
  }

  static StreamResult Generate(pb::Kvserve::Stub* stub, const pb::GenerateRequest& request,
                               grpc::ClientContext* ctx) {
    StreamResult r;
    auto reader = stub->Generate(ctx, request);
    pb::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      ++r.chunks;
      r.text += chunk.text();
      r.token_ids.insert(r.token_ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      if (!chunk.finish_reason().empty()) r.finish_reason = chunk.finish_reason();
      if (chunk.has_usage()) {
        ++r.chunks_with_usage;
        r.usage = chunk.usage();
      }
    }
    r.status = reader->Finish();
    return r;
  }

  StreamResult Generate(const pb::GenerateRequest& request, const std::string& api_key = "") {
    auto ctx = Context(api_key);
    return Generate(stub_.get(), request, ctx.get());
  }

  // Each case's mutation of a greedy request is refused with the case's
  // code, naming its field, before any chunk.
  void ExpectRefused(const std::vector<InvalidCase>& cases) {
    for (const InvalidCase& c : cases) {
      SCOPED_TRACE(c.name);
      pb::GenerateRequest r = Greedy(golden_[0].prompt, 8);
      c.mutate(&r);
      StreamResult out = Generate(r);
      EXPECT_EQ(out.status.error_code(), c.code) << out.status.error_message();
      EXPECT_THAT(out.status.error_message(), HasSubstr(c.field));
      EXPECT_EQ(out.chunks, 0);
    }
  }

  pb::Stats Stats() {
    pb::Stats s;
    auto ctx = Context();
    grpc::Status st = stub_->GetStats(ctx.get(), pb::GetStatsRequest(), &s);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return s;
  }

  // Stats are snapshots published by the engine after a step, so a request's
  // blocks show as free a moment after its last chunk: poll briefly.
  // Polls Stats until nothing runs and `done` holds (stats are published at
  // the end of an engine step), or `within` passes; returns the last Stats.
  template <typename Done>
  pb::Stats WaitForIdle(Done done, std::chrono::milliseconds within = 1000ms) {
    pb::Stats s;
    const auto give_up = std::chrono::steady_clock::now() + within;
    do {
      s = Stats();
      if (done(s) && s.running() == 0) break;
      std::this_thread::sleep_for(5ms);
    } while (std::chrono::steady_clock::now() < give_up);
    return s;
  }
  pb::Stats WaitForNoBlocksUsed() {
    return WaitForIdle([](const pb::Stats& s) { return s.blocks_used() == 0; });
  }
  pb::Stats WaitForFreeBlocks(int64_t free, std::chrono::milliseconds within) {
    return WaitForIdle([free](const pb::Stats& s) { return s.blocks_free() == free; }, within);
  }

  std::vector<GoldenCase> golden_;
  std::unique_ptr<TestServer> server_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvserve::Stub> stub_;
};

TEST_P(GrpcTest, GreedyGenerateMatchesGoldenAndStreams) {
  ASSERT_TRUE(StartServer());
  for (const GoldenCase& c : golden_) {
    SCOPED_TRACE(c.prompt);
    StreamResult r = Generate(Greedy(c.prompt, 48));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.text, c.generated);  // the concatenated deltas
    EXPECT_GT(r.chunks, 1) << "text arrived in one piece, not streamed";
    EXPECT_EQ(r.token_ids.size(), 48u);
    EXPECT_EQ(r.finish_reason, "length");
    EXPECT_EQ(r.chunks_with_usage, 1);
    EXPECT_EQ(r.usage.prompt_tokens(), static_cast<int32_t>(c.prompt_ids.size()));
    EXPECT_EQ(r.usage.completion_tokens(), 48);
    // The prefix cache may serve some prompt tokens (the shared BOS at least,
    // after the first case), never all of them: the last one is computed.
    EXPECT_LT(r.usage.cached_prompt_tokens(), r.usage.prompt_tokens());
  }
}

TEST_P(GrpcTest, PromptIdsGiveTheSameTextAsThePrompt) {
  ASSERT_TRUE(StartServer());
  const GoldenCase& c = golden_[0];
  pb::GenerateRequest r = Greedy("", 48);
  r.mutable_prompt_ids()->Add(c.prompt_ids.begin(), c.prompt_ids.end());
  StreamResult out = Generate(r);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.text, c.generated);
}

TEST_P(GrpcTest, TokenizeDetokenizeInfoAndStats) {
  ASSERT_TRUE(StartServer());
  const GoldenCase& c = golden_[0];
  pb::TokenizeRequest treq;
  treq.set_text(c.prompt);
  pb::TokenizeResponse tres;
  auto ctx = Context();
  ASSERT_TRUE(stub_->Tokenize(ctx.get(), treq, &tres).ok());
  EXPECT_EQ(std::vector<int32_t>(tres.token_ids().begin(), tres.token_ids().end()), c.prompt_ids);

  pb::DetokenizeRequest dreq;
  dreq.mutable_token_ids()->Add(c.prompt_ids.begin() + 1, c.prompt_ids.end());
  pb::DetokenizeResponse dres;
  ctx = Context();
  ASSERT_TRUE(stub_->Detokenize(ctx.get(), dreq, &dres).ok());
  EXPECT_THAT(dres.text(), HasSubstr(c.prompt));

  pb::ModelInfo info;
  ctx = Context();
  ASSERT_TRUE(stub_->GetModelInfo(ctx.get(), pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_GT(info.context_length(), 0);
  EXPECT_GT(info.n_layers(), 0);
  EXPECT_EQ(info.n_heads() * info.head_dim(), info.dim());
  EXPECT_GT(info.kv_blocks(), 0);
  EXPECT_GT(info.block_size(), 0);

  pb::Stats s = Stats();
  EXPECT_EQ(s.blocks_total(), info.kv_blocks());
  EXPECT_EQ(s.blocks_free() + s.blocks_used(), s.blocks_total());
}

TEST_P(GrpcTest, ClientCancelMidStreamFreesBlocks) {
  ASSERT_TRUE(StartServer());
  pb::ModelInfo info;
  auto ictx = Context();
  ASSERT_TRUE(stub_->GetModelInfo(ictx.get(), pb::GetModelInfoRequest(), &info).ok());
  const pb::Stats before = Stats();

  // Long enough that it is still running when we cancel: the whole context,
  // ignoring EOS, in several samples.
  pb::GenerateRequest req = Greedy(golden_[0].prompt, info.context_length() - 16);
  req.mutable_sampling()->set_ignore_eos(true);
  req.mutable_sampling()->set_n(8);
  auto ctx = Context();
  auto reader = stub_->Generate(ctx.get(), req);
  pb::GenerateResponse chunk;
  int read = 0;
  bool saw_finish = false;
  while (read < 3 && reader->Read(&chunk)) {
    ++read;
    saw_finish |= !chunk.finish_reason().empty();
  }
  ASSERT_EQ(read, 3);
  // It holds blocks now. Stats are published at the end of an engine step,
  // and the first chunks can arrive before that step has ended: poll.
  int64_t used = 0;
  for (auto until = std::chrono::steady_clock::now() + 1s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(2ms)) {
    used = Stats().blocks_used();
    if (used > before.blocks_used()) break;
  }
  EXPECT_GT(used, before.blocks_used());
  ctx->TryCancel();
  while (reader->Read(&chunk)) saw_finish |= !chunk.finish_reason().empty();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);

  const pb::Stats after = WaitForFreeBlocks(before.blocks_free(), 1s);
  EXPECT_EQ(after.blocks_free(), before.blocks_free());
  EXPECT_EQ(after.running(), 0);
  // The engine really cancelled it (it had not run to its end).
  EXPECT_FALSE(saw_finish);
  EXPECT_EQ(after.requests_cancelled(), before.requests_cancelled() + 1);

  // And the server goes on serving.
  StreamResult r = Generate(Greedy(golden_[0].prompt, 48));
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.text, golden_[0].generated);
}

// A generation of n x 4000 tokens (ignore_eos) on a written model slow
// enough to take many seconds (WriteSlowTinyLlama), under a 300 ms client
// deadline: the call must end DEADLINE_EXCEEDED with a fraction of the
// tokens, and the server must have stopped the request itself (the engine
// counts it cancelled, generated fewer than half of its tokens, and gave
// every block back). The client library reports DEADLINE_EXCEEDED whatever
// the server does, so only the server-side counts tell a server that
// ignores deadlines apart; the wait is bounded by the request's natural end.
TEST_P(GrpcTest, DeadlineCancelsTheRequest) {
  ServerConfig config;
  config.model_path = testing::TempDir() + "/grpc-slow.gguf";
  ASSERT_TRUE(testing::WriteSlowTinyLlama(config.model_path).ok());
  ASSERT_TRUE(StartServer(config));
  constexpr int kSamples = 2, kMaxTokens = 4000;
  const pb::Stats before = Stats();
  pb::GenerateRequest req = Greedy("Once upon a time", kMaxTokens);
  req.mutable_sampling()->set_ignore_eos(true);
  req.mutable_sampling()->set_n(kSamples);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 300ms);
  StreamResult r = Generate(stub_.get(), req, &ctx);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << r.status.error_message();
  EXPECT_LT(r.token_ids.size(), kSamples * kMaxTokens / 2u);
  // Until the request is gone (cancelled, or run to its end if the server
  // ignored the deadline); the bound only keeps a hung server from hanging
  // the test.
  const pb::Stats after = WaitForIdle(
      [&](const pb::Stats& s) {
        return s.requests_finished() > before.requests_finished() &&
               s.blocks_free() == before.blocks_free();
      },
      120s);
  EXPECT_EQ(after.requests_cancelled(), before.requests_cancelled() + 1)
      << "the server did not cancel the request at its deadline";
  EXPECT_LT(after.generation_tokens_total() - before.generation_tokens_total(),
            kSamples * kMaxTokens / 2)
      << "the request ran on past its deadline";
  EXPECT_EQ(after.running(), 0);
  EXPECT_EQ(after.blocks_free(), before.blocks_free());
}

// A read reactor per stream: 500 streams need no client thread each either.
class StreamCollector final : public grpc::ClientReadReactor<pb::GenerateResponse> {
 public:
  StreamCollector(pb::Kvserve::Stub* stub, pb::GenerateRequest request)
      : request_(std::move(request)) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 120s);
    stub->async()->Generate(&ctx_, &request_, this);
    StartRead(&chunk_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    text_ += chunk_.text();
    if (!chunk_.finish_reason().empty()) finish_reason_ = chunk_.finish_reason();
    StartRead(&chunk_);
  }
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  bool Await(std::chrono::steady_clock::time_point until) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, until, [this] { return done_; });
  }
  const grpc::Status& status() const { return status_; }
  const std::string& text() const { return text_; }
  const std::string& finish_reason() const { return finish_reason_; }

 private:
  pb::GenerateRequest request_;
  grpc::ClientContext ctx_;
  pb::GenerateResponse chunk_;
  std::string text_;
  std::string finish_reason_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  grpc::Status status_;
};

TEST_P(GrpcTest, FiveHundredConcurrentStreamsAllComplete) {
  ASSERT_TRUE(StartServer());
  constexpr int kStreams = 500;
  constexpr int kMaxTokens = 8;
  // Expected outputs, one request at a time; each is a prefix of the golden.
  std::vector<std::string> expected;
  for (const GoldenCase& c : golden_) {
    StreamResult r = Generate(Greedy(c.prompt, kMaxTokens));
    ASSERT_TRUE(r.status.ok());
    ASSERT_EQ(c.generated.compare(0, r.text.size(), r.text), 0) << r.text;
    expected.push_back(r.text);
  }
  std::vector<std::unique_ptr<StreamCollector>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(std::make_unique<StreamCollector>(
        stub_.get(), Greedy(golden_[i % golden_.size()].prompt, kMaxTokens)));
  }
  const auto until = std::chrono::steady_clock::now() + 120s;
  int ok = 0;
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(streams[i]->Await(until)) << "stream " << i << " did not finish";
    const StreamCollector& s = *streams[i];
    EXPECT_TRUE(s.status().ok()) << i << ": " << s.status().error_message();
    EXPECT_EQ(s.text(), expected[i % golden_.size()]) << "stream " << i;
    EXPECT_EQ(s.finish_reason(), "length");
    ok += s.status().ok() && s.text() == expected[i % golden_.size()];
  }
  EXPECT_EQ(ok, kStreams);
  EXPECT_EQ(WaitForNoBlocksUsed().blocks_used(), 0);
}

TEST_P(GrpcTest, InvalidInputsAreRejectedNamingTheField) {
  ASSERT_TRUE(StartServer());
  pb::ModelInfo info;
  auto ictx = Context();
  ASSERT_TRUE(stub_->GetModelInfo(ictx.get(), pb::GetModelInfoRequest(), &info).ok());
  const int ctx_len = info.context_length();
  const std::vector<InvalidCase> cases = {
      {"empty prompt", [](pb::GenerateRequest* r) { r->clear_prompt(); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt"},
      {"prompt + max_tokens over the context",
       [ctx_len](pb::GenerateRequest* r) { r->mutable_sampling()->set_max_tokens(ctx_len); },
       grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"},
      {"n over the limit", [](pb::GenerateRequest* r) { r->mutable_sampling()->set_n(1000); },
       grpc::StatusCode::INVALID_ARGUMENT, "n "},
      {"n zero", [](pb::GenerateRequest* r) { r->mutable_sampling()->set_n(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "n "},
      {"negative temperature",
       [](pb::GenerateRequest* r) { r->mutable_sampling()->set_temperature(-0.5f); },
       grpc::StatusCode::INVALID_ARGUMENT, "temperature"},
      {"top_p zero", [](pb::GenerateRequest* r) { r->mutable_sampling()->set_top_p(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "top_p"},
      {"top_p over one", [](pb::GenerateRequest* r) { r->mutable_sampling()->set_top_p(1.5f); },
       grpc::StatusCode::INVALID_ARGUMENT, "top_p"},
      {"too many stop strings",
       [](pb::GenerateRequest* r) {
         for (int i = 0; i < 100; ++i) r->mutable_sampling()->add_stop("s" + std::to_string(i));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "stop"},
      {"too long stop string",
       [](pb::GenerateRequest* r) { r->mutable_sampling()->add_stop(std::string(100000, 'x')); },
       grpc::StatusCode::INVALID_ARGUMENT, "stop"},
      {"unknown model", [](pb::GenerateRequest* r) { r->set_model("no-such-model"); },
       grpc::StatusCode::NOT_FOUND, "model"},
      {"prompt and prompt_ids", [](pb::GenerateRequest* r) { r->add_prompt_ids(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt"},
      {"token id outside the vocabulary",
       [](pb::GenerateRequest* r) {
         r->clear_prompt();
         r->add_prompt_ids(1);
         r->add_prompt_ids(1 << 20);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt"},
  };
  ExpectRefused(cases);
  // Unknown model on a unary call too.
  pb::TokenizeRequest treq;
  treq.set_model("no-such-model");
  treq.set_text("hi");
  pb::TokenizeResponse tres;
  auto tctx = Context();
  EXPECT_EQ(stub_->Tokenize(tctx.get(), treq, &tres).error_code(), grpc::StatusCode::NOT_FOUND);

  // Nothing else was disturbed.
  StreamResult r = Generate(Greedy(golden_[0].prompt, 48));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.text, golden_[0].generated);
  EXPECT_EQ(WaitForNoBlocksUsed().blocks_used(), 0);
}

TEST_P(GrpcTest, ChatIsServedOrRejectedNamingMessages) {
  ASSERT_TRUE(StartServer());
  pb::ChatRequest req;
  pb::ChatMessage* m = req.add_messages();
  m->set_role("user");
  m->set_content("Hello");
  req.mutable_sampling()->set_max_tokens(8);
  req.mutable_sampling()->set_temperature(0);
  auto ctx = Context();
  auto reader = stub_->Chat(ctx.get(), req);
  pb::GenerateResponse chunk;
  std::string text;
  while (reader->Read(&chunk)) text += chunk.text();
  grpc::Status s = reader->Finish();
  // stories260K has no chat template (the refusal says what to do
  // instead); a chat model answers.
  if (!s.ok()) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("messages"));
    EXPECT_THAT(s.error_message(), HasSubstr("--chat-template FILE"));
  }
  pb::ChatRequest empty;
  ctx = Context();
  reader = stub_->Chat(ctx.get(), empty);
  while (reader->Read(&chunk)) {
  }
  s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("messages"));
}

// GenerateRequest.kv_policy: a bad value is INVALID_ARGUMENT naming the
// field; a good one runs, and the last chunk's usage says what it dropped
// (the engine may not evict yet: only the field and the finish are checked).
// stories260K's context is 128 tokens, so the windows are small.
TEST_P(GrpcTest, KvPolicyIsValidatedAndUsageCarriesDroppedTokens) {
  ASSERT_TRUE(StartServer());
  const std::vector<InvalidCase> cases = {
      {"unknown policy", [](pb::GenerateRequest* r) { r->mutable_kv_policy()->set_policy("lru"); },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_policy: unknown policy 'lru'"},
      {"budget too small",
       [](pb::GenerateRequest* r) {
         pb::KvPolicy* k = r->mutable_kv_policy();
         k->set_policy("h2o");
         k->set_window(16);
         k->set_budget(20);  // not above 4 + 16
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_policy.budget"},
      {"zero window",
       [](pb::GenerateRequest* r) {
         r->mutable_kv_policy()->set_policy("window");
         r->mutable_kv_policy()->set_window(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_policy.window"},
      {"negative sinks",
       [](pb::GenerateRequest* r) {
         r->mutable_kv_policy()->set_policy("sinks");
         r->mutable_kv_policy()->set_sinks(-2);
         r->mutable_kv_policy()->set_window(8);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_policy.sinks"},
      {"default window past the context",
       [](pb::GenerateRequest* r) { r->mutable_kv_policy()->set_policy("sinks"); },
       grpc::StatusCode::INVALID_ARGUMENT, "context length"},
  };
  ExpectRefused(cases);

  std::vector<pb::KvPolicy> policies(5);
  policies[0].set_policy("window");
  policies[0].set_window(16);
  policies[1].set_policy("sinks");
  policies[1].set_sinks(0);  // set, not defaulted
  policies[1].set_window(16);
  policies[2].set_policy("h2o");
  policies[2].set_window(16);  // budget: 2 x (4 + 16)
  policies[3].set_policy("h2o");
  policies[3].set_sinks(2);
  policies[3].set_window(8);
  policies[3].set_budget(40);
  policies[4].set_policy("none");
  constexpr int kTokens = 64;
  for (const pb::KvPolicy& k : policies) {
    SCOPED_TRACE(k.ShortDebugString());
    pb::GenerateRequest r = Greedy(golden_[0].prompt, kTokens);
    r.mutable_sampling()->set_n(2);
    *r.mutable_kv_policy() = k;
    StreamResult out = Generate(r);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.finish_reason, "length");
    EXPECT_EQ(out.chunks_with_usage, 1);
    EXPECT_EQ(out.usage.completion_tokens(), 2 * kTokens);
    // Each sample holds its prompt and 64 tokens, more than any policy here
    // keeps plus the block of slack a policy may hold (docs/token-eviction.md:
    // a window of 16, or an h2o budget of 40, + 16): every policy but "none"
    // must have dropped some, and never more than the two samples held
    // (usage sums over them).
    if (k.policy() == "none") {
      EXPECT_EQ(out.usage.dropped_tokens(), 0);
    } else {
      EXPECT_GT(out.usage.dropped_tokens(), 0);
      EXPECT_LE(out.usage.dropped_tokens(),
                2 * (static_cast<int>(golden_[0].prompt_ids.size()) + kTokens));
    }
  }
  // The field is part of Usage (proto3 leaves a 0 off the wire, so its
  // presence can only be seen in the schema and in the CLI's JSON).
  EXPECT_NE(pb::Usage::descriptor()->FindFieldByName("dropped_tokens"), nullptr);
  EXPECT_EQ(WaitForNoBlocksUsed().blocks_used(), 0);
}

// ChatRequest.kv_policy on a model with a chat template.
TEST_P(GrpcTest, ChatTakesAKvPolicy) {
  ServerConfig config;
  config.model_path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(config.model_path, "SmolLM2-135M-Instruct.Q4_1.gguf");
  ASSERT_TRUE(StartServer(config));
  auto chat = [this](const pb::KvPolicy& k, std::string* error) {
    pb::ChatRequest req;
    pb::ChatMessage* m = req.add_messages();
    m->set_role("user");
    m->set_content("Name three colors.");
    req.mutable_sampling()->set_max_tokens(8);
    req.mutable_sampling()->set_temperature(0);
    *req.mutable_kv_policy() = k;
    auto ctx = Context();
    auto reader = stub_->Chat(ctx.get(), req);
    pb::GenerateResponse chunk;
    pb::Usage usage;
    bool finished = false;
    while (reader->Read(&chunk)) {
      if (chunk.has_usage()) usage = chunk.usage();
      finished = finished || !chunk.finish_reason().empty();
    }
    grpc::Status s = reader->Finish();
    *error = s.error_message();
    EXPECT_TRUE(s.ok() ? finished : s.error_code() == grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    return s.ok() ? usage.dropped_tokens() : -1;
  };
  pb::KvPolicy sinks;
  sinks.set_policy("sinks");  // the defaults: 4 + 256
  std::string error;
  // The chat (its template, question and 8 tokens) fits in 4 + 256:
  // nothing to drop. A window of 8 must drop some of it.
  EXPECT_EQ(chat(sinks, &error), 0) << error;
  pb::KvPolicy window;
  window.set_policy("window");
  window.set_window(8);
  EXPECT_GT(chat(window, &error), 0) << error;
  pb::KvPolicy bad;
  bad.set_policy("h2o");
  bad.set_budget(100);
  EXPECT_EQ(chat(bad, &error), -1);
  EXPECT_THAT(error, HasSubstr("kv_policy.budget"));
}

// grpc.health.v1.Health/Check with an empty request, through the generic
// stub (the test needs no generated health code). Returns the status enum.
int HealthCheck(const std::shared_ptr<grpc::Channel>& channel, grpc::Status* status) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::ByteBuffer request(nullptr, 0), response;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  call->Finish(&response, status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  std::vector<grpc::Slice> slices;
  if (!status->ok() || !response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes.size() >= 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

TEST_P(GrpcTest, ApiKeyIsRequiredExceptForHealth) {
  ASSERT_TRUE(StartServer(WithApiKey("sesame")));
  StreamResult without = Generate(Greedy(golden_[0].prompt, 8));
  EXPECT_EQ(without.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  StreamResult wrong = Generate(Greedy(golden_[0].prompt, 8), "sesamf");
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  pb::Stats stats;
  auto ctx = Context();
  EXPECT_EQ(stub_->GetStats(ctx.get(), pb::GetStatsRequest(), &stats).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  StreamResult with = Generate(Greedy(golden_[0].prompt, 48), "sesame");
  ASSERT_TRUE(with.status.ok()) << with.status.error_message();
  EXPECT_EQ(with.text, golden_[0].generated);

  grpc::Status hs;
  EXPECT_EQ(HealthCheck(channel_, &hs), 1) << hs.error_message();  // SERVING
}

TEST_P(GrpcTest, TlsWithASelfSignedCertificate) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl";
  static std::atomic<int> counter{0};
  const std::string dir = testing::TempDir() + "/tls-" + std::to_string(counter++);
  std::filesystem::create_directories(dir);
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost -keyout " +
                          dir + "/k.pem -out " + dir + "/c.pem -days 1 >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  ASSERT_TRUE(StartServer(WithTls(dir + "/c.pem", dir + "/k.pem")));

  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadAll(dir + "/c.pem");
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");  // we dial 127.0.0.1; the cert names localhost
  auto channel = grpc::CreateCustomChannel(address_, grpc::SslCredentials(ssl), args);
  auto stub = pb::Kvserve::NewStub(channel);
  auto ctx = Context();
  StreamResult r = Generate(stub.get(), Greedy(golden_[0].prompt, 48), ctx.get());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.text, golden_[0].generated);

  // A plaintext client gets nowhere.
  ctx = Context();
  ctx->set_deadline(std::chrono::system_clock::now() + 5s);
  StreamResult plain = Generate(stub_.get(), Greedy(golden_[0].prompt, 8), ctx.get());
  EXPECT_FALSE(plain.status.ok());
}

struct CliResult {
  int exit_code = -1;
  std::string out;
};

CliResult RunCli(const std::string& args) {
  const std::string cmd = std::string(KVSERVE_CLI_BINARY) + " " + args + " 2>&1";
  const testing::CommandResult run = testing::RunCommand(cmd);
  return CliResult{run.exit_code, run.out};
}

TEST_P(GrpcTest, CliGeneratePrintsTheGoldenText) {
  ASSERT_TRUE(StartServer(WithApiKey("k3y")));
  const GoldenCase& c = golden_[0];
  CliResult r = RunCli("--address " + address_ + " --api-key k3y generate -p '" + c.prompt +
                       "' --max-tokens 48 --temperature 0");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, c.generated + "\n");

  r = RunCli("--address " + address_ + " --api-key k3y --json generate -p '" + c.prompt +
             "' --max-tokens 4 --temperature 0");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);

  EXPECT_EQ(j["usage"]["dropped_tokens"], 0);  // no policy: nothing dropped

  // --kv-* fill the request's kv_policy; --json shows what was dropped.
  r = RunCli("--address " + address_ + " --api-key k3y --json generate -p '" + c.prompt +
             "' --max-tokens 48 --kv-policy h2o --kv-sinks 2 --kv-window 8 --kv-budget 24");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["usage"]["completion_tokens"], 48);
  ASSERT_TRUE(j["usage"].contains("dropped_tokens")) << r.out;
  // The prompt (5 tokens) and 48 more are more than h2o's budget of 24 keeps
  // with its block of slack (24 + 16).
  EXPECT_GT(j["usage"]["dropped_tokens"].get<int>(), 0) << r.out;
  r = RunCli("--address " + address_ +
             " --api-key k3y generate -p hi --kv-policy h2o "
             "--kv-window 8 --kv-budget 9");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("kv_policy.budget"));

  r = RunCli("--address " + address_ + " --api-key k3y tokenize '" + c.prompt + "'");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  std::string ids;
  for (size_t i = 0; i < c.prompt_ids.size(); ++i) {
    ids += (i ? " " : "") + std::to_string(c.prompt_ids[i]);
  }
  EXPECT_EQ(r.out, ids + "\n");

  r = RunCli("--address " + address_ + " --api-key k3y --json stats");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(nlohmann::json::parse(r.out).contains("blocks_free")) << r.out;

  r = RunCli("--address " + address_ + " health");  // no key needed
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "SERVING\n");

  // Errors: the status is printed and the exit code is 1.
  r = RunCli("--address " + address_ + " generate -p hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("UNAUTHENTICATED"));
  r = RunCli("--address " + address_ + " --api-key k3y generate -p hi --top-p 2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("top_p"));
}

TEST_P(GrpcTest, CliChatSendsTheKvPolicy) {
  ServerConfig config;
  config.model_path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(config.model_path, "SmolLM2-135M-Instruct.Q4_1.gguf");
  ASSERT_TRUE(StartServer(config));
  CliResult r = RunCli("--address " + address_ +
                       " --json chat -p 'Say hi.' --max-tokens 4 --temperature 0 --kv-policy "
                       "window --kv-window 8");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  // The chat's template and question alone pass a window of 8: the
  // policy reached the server only if some tokens were dropped.
  EXPECT_GT(j["usage"]["dropped_tokens"].get<int>(), 0) << r.out;
  r = RunCli("--address " + address_ + " chat -p hi --max-tokens 4 --kv-policy lru");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("kv_policy: unknown policy 'lru'"));
}

INSTANTIATE_TEST_SUITE_P(Servers, GrpcTest, ::testing::Values(Mode::kInProcess, Mode::kDaemon),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return info.param == Mode::kDaemon ? "Daemon" : "InProcess";
                         });

}  // namespace
}  // namespace kvserve
