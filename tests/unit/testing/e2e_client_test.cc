// The /metrics helpers of tests/testing/e2e_client.h must never let a test
// pass on a scrape that failed: a /metrics that does not answer, answers an
// error, or lacks the sample asked for is a recorded test failure and NaN
// (which every comparison rejects), never a number such as -1 that
// `EXPECT_LT(metric, N)` or `free == total` would accept. Served here by a
// small HTTP server on 127.0.0.1 with fixed /metrics text, so no daemon or
// model is needed.
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "tests/testing/e2e_client.h"

namespace kvserve::testing {
namespace {

constexpr char kMetrics[] =
    "# HELP kvserve:kv_blocks_free Free KV blocks.\n"
    "# TYPE kvserve:kv_blocks_free gauge\n"
    "kvserve:kv_blocks_free{model_name=\"m\"} 120\n"
    "kvserve:kv_blocks_total{model_name=\"m\"} 128\n"
    "kvserve:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 3\n"
    "kvserve:request_success_total{model_name=\"m\",finished_reason=\"cancelled\"} 2\n"
    "kvserve:uptime_seconds 7.5\n";

// An HTTP server on 127.0.0.1 whose /metrics answers `status` with kMetrics.
class FakeMetrics {
 public:
  explicit FakeMetrics(int status) {
    server_.Get("/metrics", [status](const httplib::Request&, httplib::Response& res) {
      res.status = status;
      res.set_content(kMetrics, "text/plain; version=0.0.4");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeMetrics() {
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;
};

// A loopback port nothing listens on (bound, read, closed).
int DeadPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

TEST(MetricSampleTest, ReadsLabelledAndUnlabelledSamples) {
  FakeMetrics m(200);
  EXPECT_EQ(MetricSample(m.port(), "kvserve:kv_blocks_free"), 120);
  EXPECT_EQ(MetricSample(m.port(), "kvserve:request_success_total",
                         {"finished_reason=\"cancelled\""}),
            2);
  EXPECT_EQ(MetricSample(m.port(), "kvserve:uptime_seconds"), 7.5);
  EXPECT_EQ(MetricSum(m.port(), "kvserve:request_success_total"), 5);
}

TEST(MetricSampleTest, AScrapeThatFailsIsATestFailureAndNaN) {
  const int dead = DeadPort();
  double v = 0;
  EXPECT_NONFATAL_FAILURE(v = MetricSample(dead, "kvserve:kv_blocks_free"),
                          "did not answer 200");
  EXPECT_TRUE(std::isnan(v));
  // The comparisons that once passed on -1 fail on it.
  EXPECT_FALSE(v < 4000);
  EXPECT_FALSE(v == v);
  EXPECT_NONFATAL_FAILURE(v = MetricSum(dead, "kvserve:kv_blocks_free"), "did not answer 200");
  EXPECT_TRUE(std::isnan(v));

  FakeMetrics broken(503);
  EXPECT_NONFATAL_FAILURE(v = MetricSample(broken.port(), "kvserve:kv_blocks_free"),
                          "status 503");
  EXPECT_TRUE(std::isnan(v));
}

TEST(MetricSampleTest, AMissingSampleIsATestFailureAndNaN) {
  FakeMetrics m(200);
  double v = 0;
  EXPECT_NONFATAL_FAILURE(v = MetricSample(m.port(), "kvserve:no_such_metric"),
                          "no sample kvserve:no_such_metric");
  EXPECT_TRUE(std::isnan(v));
  // A name that is only a prefix of a sample's name is not that sample.
  EXPECT_NONFATAL_FAILURE(v = MetricSample(m.port(), "kvserve:kv_blocks"), "no sample");
  EXPECT_NONFATAL_FAILURE(
      v = MetricSample(m.port(), "kvserve:request_success_total", {"finished_reason=\"length\""}),
      "finished_reason=\"length\"");
  EXPECT_TRUE(std::isnan(v));
  // labelled_only skips `name value` lines.
  EXPECT_NONFATAL_FAILURE(v = MetricSample(m.port(), "kvserve:uptime_seconds", {}, true),
                          "no sample");
  EXPECT_NONFATAL_FAILURE(v = MetricSum(m.port(), "kvserve:uptime_seconds"),
                          "no labelled sample");
  EXPECT_TRUE(std::isnan(v));
  // The quiet lookup answers nullopt instead.
  std::string text;
  ASSERT_TRUE(ScrapeMetrics(m.port(), &text));
  EXPECT_FALSE(FindMetricSample(text, "kvserve:no_such_metric").has_value());
  EXPECT_EQ(FindMetricSample(text, "kvserve:kv_blocks_total").value_or(-1), 128);
}

}  // namespace
}  // namespace kvserve::testing
