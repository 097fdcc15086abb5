// Client helpers for end-to-end tests against a live `kvserve serve`: JSON
// requests to its HTTP front end, samples from /metrics, a gRPC channel,
// Generate streamed to its end, GetStats (once, or polled until a condition
// holds), and the deterministic prompts several e2e tests share. Starting
// and stopping the daemon is daemon.h's. Each call opens its own client, so
// the helpers may be used from any thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"

namespace kvserve::testing {

// ---- HTTP (127.0.0.1:port, a 120 s read timeout) ----

struct HttpReply {
  int status = -1;           // -1: no response at all
  nlohmann::json body;       // discarded (is_discarded()) when not JSON
  std::string raw;           // the body as sent
  std::string cache_header;  // x-kvserve-cache
  double seconds = 0;        // wall time of the request, for reporting only
};

// `method` is "GET" (body unused) or "POST" (body sent as application/json);
// a non-empty `key` goes as a bearer token.
HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const nlohmann::json& body, const std::string& key = "");
HttpReply HttpPost(int port, const std::string& path, const nlohmann::json& body,
                   const std::string& key = "");

// usage.prompt_tokens_details.cached_tokens of a completion reply; -1 when
// the body has no usage.
int CachedTokens(const HttpReply& r);

// ---- /metrics (a 30 s read timeout) ----
//
// A scrape that does not answer 200, or a sample that is not there, records
// a test failure (naming the port, the sample and its labels) and returns
// NaN, which every comparison rejects: no caller can mistake a dead
// /metrics for a value (as -1 once passed `EXPECT_LT(metric, N)` and
// `free == total`).

// The value of the first sample named exactly `name` whose line contains
// every string in `labels` (e.g. `finished_reason="cancelled"`).
// Unlabelled (`name value`) and labelled (`name{...} value`) samples count,
// or with `labelled_only` the labelled ones only.
double MetricSample(int port, const std::string& name, const std::vector<std::string>& labels = {},
                    bool labelled_only = false);
// The same lookup in /metrics text scraped some other way (over TLS, say).
double MetricSampleIn(const std::string& text, const std::string& name,
                      const std::vector<std::string>& labels = {}, bool labelled_only = false);
// The same lookup without the failure: nullopt when there is no such sample.
std::optional<double> FindMetricSample(const std::string& text, const std::string& name,
                                       const std::vector<std::string>& labels = {},
                                       bool labelled_only = false);
// The sum of every labelled sample `name{...} value`; a failure (and NaN)
// when there is none.
double MetricSum(int port, const std::string& name);
// The /metrics text; a failure and false when it does not answer 200.
bool ScrapeMetrics(int port, std::string* text);

// ---- gRPC ----

std::shared_ptr<grpc::Channel> GrpcChannel(int port);

struct GrpcReply {
  std::vector<int32_t> tokens;      // every chunk's token_ids, in order
  std::vector<std::string> chunks;  // every chunk's non-empty text, in order
  std::string text;                 // the chunks' texts joined
  v1::Usage usage;                  // the last usage seen
  v1::CacheInfo cache;              // the last cache info seen
  grpc::Status status;
};

// Streams one Generate call to its end (a 60 s deadline; a non-empty
// `api_key` goes as a bearer token). Does not check the status.
GrpcReply GrpcGenerate(const std::shared_ptr<grpc::Channel>& channel,
                       const v1::GenerateRequest& request, const std::string& api_key = "");
// The same, recording a non-fatal failure when the status is not OK.
GrpcReply GrpcGenerateOk(const std::shared_ptr<grpc::Channel>& channel,
                         const v1::GenerateRequest& request, const std::string& api_key = "");

// One GetStats call (a 10 s deadline); records a non-fatal failure naming
// the error when it fails.
v1::Stats GrpcStats(const std::shared_ptr<grpc::Channel>& channel, const std::string& api_key = "");

// Calls GetStats (a 10 s deadline each) until `done(stats)` holds or
// `tries` calls were made, sleeping `interval` between calls; the last
// stats go to *stats. Returns the first failed call's status (then stops),
// else OK. A bound for work finishing on another thread, not a timing
// assertion: the caller still checks what it waited for.
grpc::Status PollStats(const std::shared_ptr<grpc::Channel>& channel,
                       const std::function<bool(const v1::Stats&)>& done, int tries,
                       std::chrono::milliseconds interval, v1::Stats* stats,
                       const std::string& api_key = "");

// ---- Prompts ----

// BOS and 99 token ids particular to `seed` (3..482, within stories260K's
// 512-token vocabulary): 6 full blocks of 16 in its 128-token context.
std::vector<int32_t> SeededPromptIds(int seed);
// A greedy (temperature 0, ignore_eos) request for SeededPromptIds(seed).
v1::GenerateRequest SeededGreedyRequest(int seed, int max_tokens = 4);

// A distinct prompt of words, of about `len` characters, particular to
// (tag, i); stories260K makes 150 characters into about 95 tokens.
std::string Words(const std::string& tag, int i, size_t len = 150);
// A one-token greedy /v1/completions body for `prompt`.
nlohmann::json Completion(const std::string& prompt);

}  // namespace kvserve::testing
