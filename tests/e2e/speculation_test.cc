// Speculative decoding through a live daemon (issue 20): with
// --speculative ngram, greedy completions over HTTP and gRPC are the same
// text as with the request's "speculative": "off"; drafts were accepted (the
// metrics say so: the comparison is not vacuous); a bad mode is refused
// naming the field on both protocols; and every KV block is back afterwards.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
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

using Reply = testing::HttpReply;

// POSTs a /v1/completions body.
Reply Post(int port, const json& body) { return testing::HttpPost(port, "/v1/completions", body); }

// The value of an unlabelled-but-model series `name{...labels...}` summed
// over its label sets.
double Metric(int port, const std::string& name) { return testing::MetricSum(port, name); }

const std::vector<std::string> kPrompts = {
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Once upon a time, there was a little girl named Lily. She liked to",
    "Tom and Sue went to the park. Tom and Sue went to the",
    "One day, a big dog saw a ball. The dog",
    "There was a tree. The tree was big. The tree was",
    "Ben had a red car. He liked his red car. He",
};

TEST(SpeculationE2eTest, SameOutputsOnAndOffOverHttpAndGrpc) {
  KVSERVE_SKIP_IF_MISSING(testing::Stories260KPath(), "stories260K.gguf");
  auto d =
      testing::StartServe(KVSERVE_BINARY, testing::Stories260KPath(), "warn",
                          {"--kv-cache-memory", "4MiB", "--drain-timeout", "2", "--speculative",
                           "ngram", "--spec-ngram-min", "1", "--no-spec-adaptive"});
  ASSERT_TRUE(d);
  const int port = d->http_port();
  for (const std::string& p : kPrompts) {
    json on = {{"prompt", p}, {"max_tokens", 64}, {"temperature", 0}, {"logprobs", 1}};
    json off = on;
    off["speculative"] = "off";
    const Reply a = Post(port, on), b = Post(port, off);
    ASSERT_EQ(a.status, 200) << a.raw;
    ASSERT_EQ(b.status, 200) << b.raw;
    EXPECT_EQ(a.body["choices"][0]["text"], b.body["choices"][0]["text"]) << p;
    EXPECT_EQ(a.body["choices"][0]["finish_reason"], b.body["choices"][0]["finish_reason"]) << p;
    EXPECT_EQ(a.body["usage"]["completion_tokens"], b.body["usage"]["completion_tokens"]) << p;
  }
  EXPECT_GT(Metric(port, "kvserve:spec_accepted_tokens_total"), 0)
      << "no draft accepted: the comparison is vacuous";
  EXPECT_GT(Metric(port, "kvserve:spec_position_accepted_total"), 0);

  // gRPC: the field on GenerateRequest, "suffix" against "off".
  auto channel = testing::GrpcChannel(d->grpc_port());
  auto generate = [&](const std::string& prompt, const std::string& mode, grpc::Status* st) {
    pb::GenerateRequest r;
    r.set_prompt(prompt);
    r.mutable_sampling()->set_max_tokens(64);
    r.mutable_sampling()->set_temperature(0);
    r.set_speculative(mode);
    const testing::GrpcReply reply = testing::GrpcGenerate(channel, r);
    *st = reply.status;
    return reply.text;
  };
  for (const std::string& p : kPrompts) {
    grpc::Status s1, s2;
    const std::string with = generate(p, "suffix", &s1);
    const std::string without = generate(p, "off", &s2);
    ASSERT_TRUE(s1.ok()) << s1.error_message();
    ASSERT_TRUE(s2.ok()) << s2.error_message();
    EXPECT_EQ(with, without) << p;
  }
  EXPECT_GT(Metric(port, "kvserve:spec_proposed_tokens_total"), 0);

  // Bad modes are refused, naming the field.
  grpc::Status bad;
  generate("Hi", "eagle", &bad);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("speculative"));
  const Reply refused = Post(port, {{"prompt", "Hi"}, {"speculative", "eagle"}});
  EXPECT_EQ(refused.status, 400) << refused.raw;
  EXPECT_THAT(refused.raw, HasSubstr("speculative"));
  const Reply wrong_type = Post(port, {{"prompt", "Hi"}, {"speculative", 3}});
  EXPECT_EQ(wrong_type.status, 400) << wrong_type.raw;

  // Every block is back: free or cached-and-evictable.
  EXPECT_EQ(Metric(port, "kvserve:kv_blocks_free"), Metric(port, "kvserve:kv_blocks_total"));
}

}  // namespace
}  // namespace kvserve
