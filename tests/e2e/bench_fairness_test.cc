// kvserve-bench is fair to servers that close kept-alive connections: a
// request whose reused connection fails before any response byte is sent
// again, once, on a fresh connection; it counts as a retry, not a failure.
// A failure on a fresh connection is still the server's.
//
// The server here is a few lines of sockets, so the test controls exactly
// when a connection closes: on every connection it answers the first
// request and closes on reading the second, unanswered (what a server whose
// idle timeout fires as the next request arrives looks like to the client).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/testing/daemon.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

class ClosingServer {
 public:
  // answer_per_connection: requests answered on each connection before it
  // closes on the next one (0: every request is dropped unanswered).
  explicit ClosingServer(int answer_per_connection) : answer_(answer_per_connection) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd_, 64) != 0) {
      ADD_FAILURE() << "cannot listen";
    }
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ClosingServer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    for (auto& t : conns_) t.join();
  }
  int port() const { return port_; }
  int connections() const { return connections_; }
  int answered() const { return answered_; }
  int dropped() const { return dropped_; }

 private:
  void Serve() {
    while (!stop_) {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      ++connections_;
      conns_.emplace_back([this, c] { Connection(c); });
    }
  }

  // Reads one request (headers and Content-Length body); false at EOF.
  static bool ReadRequest(int c, std::string* buf, std::string* first_line) {
    size_t end;
    while ((end = buf->find("\r\n\r\n")) == std::string::npos) {
      char tmp[4096];
      const ssize_t n = read(c, tmp, sizeof(tmp));
      if (n <= 0) return false;
      buf->append(tmp, n);
    }
    *first_line = buf->substr(0, buf->find("\r\n"));
    size_t length = 0;
    const size_t cl = buf->find("Content-Length: ");
    if (cl != std::string::npos && cl < end) length = std::stoul(buf->substr(cl + 16));
    while (buf->size() < end + 4 + length) {
      char tmp[4096];
      const ssize_t n = read(c, tmp, sizeof(tmp));
      if (n <= 0) return false;
      buf->append(tmp, n);
    }
    buf->erase(0, end + 4 + length);
    return true;
  }

  void Connection(int c) {
    std::string buf, line;
    for (int served = 0;; ++served) {
      if (!ReadRequest(c, &buf, &line)) break;
      if (line.rfind("GET /v1/models", 0) == 0) {
        // The model probe kvserve-bench sends first: answer and close.
        const std::string body = R"({"object":"list","data":[{"id":"fake"}]})";
        const std::string res = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                "Connection: close\r\nContent-Length: " +
                                std::to_string(body.size()) + "\r\n\r\n" + body;
        (void)!write(c, res.data(), res.size());
        break;
      }
      if (served >= answer_) {
        ++dropped_;  // closes without a byte, as if its idle timeout fired
        break;
      }
      const std::string body =
          "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n"
          "data: {\"choices\":[{\"index\":0,\"text\":\"b\"}]}\n\n"
          "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":2}}\n\n"
          "data: [DONE]\n\n";
      // Keep-alive (HTTP/1.1's default): the client may reuse it.
      const std::string res = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                              "Content-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body;
      (void)!write(c, res.data(), res.size());
      ++answered_;
    }
    close(c);
  }

  const int answer_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0}, answered_{0}, dropped_{0};
  std::thread thread_;
  std::vector<std::thread> conns_;  // touched only by the accept thread, then the destructor
};

json RunBench(int port, int prompts, const std::string& name) {
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("kvserve_fair_" + std::to_string(getpid()) + "_" + name + ".json"))
                              .string();
  const std::string cmd = std::string(KVSERVE_BENCH_BINARY) + " --url http://127.0.0.1:" +
                          std::to_string(port) + " --num-prompts " + std::to_string(prompts) +
                          " --input-len 8 --output-len 2 --concurrency 1 --json-out " + out +
                          " -q 2>&1";
  const testing::CommandResult r = testing::RunCommand(cmd);
  std::ifstream in(out);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  std::remove(out.c_str());
  if (j.is_discarded()) ADD_FAILURE() << "no JSON result; exit " << r.exit_code << ":\n" << r.out;
  return j;
}

TEST(BenchFairnessTest, ClosedKeptAliveConnectionIsRetriedNotCharged) {
  ClosingServer server(1);  // one answer per connection, then close on the next request
  const json j = RunBench(server.port(), 6, "retry");
  ASSERT_FALSE(j.is_discarded());
  const json& s = j["runs"][0]["summary"];
  EXPECT_EQ(s["completed"], 6) << s.dump();
  EXPECT_EQ(s["failed"], 0) << s.dump();
  // Every request after the first found its connection closed once.
  EXPECT_EQ(s["connection_retries"], 5) << s.dump();
  EXPECT_EQ(server.dropped(), 5);
  EXPECT_EQ(server.answered(), 6);
  int per_record = 0;
  for (const json& r : j["runs"][0]["requests"]) per_record += r["connection_retries"].get<int>();
  EXPECT_EQ(per_record, 5);
}

TEST(BenchFairnessTest, FailureOnAFreshConnectionIsTheServers) {
  ClosingServer server(0);  // drops every request
  const json j = RunBench(server.port(), 3, "fresh");
  ASSERT_FALSE(j.is_discarded());
  const json& s = j["runs"][0]["summary"];
  EXPECT_EQ(s["completed"], 0);
  EXPECT_EQ(s["failed"], 3);
  EXPECT_EQ(s["errors"]["connection"], 3) << s.dump();
  EXPECT_EQ(s["connection_retries"], 0) << "a fresh connection is never retried";
  EXPECT_EQ(server.dropped(), 3);
}

}  // namespace
}  // namespace kvserve
