#include "tests/testing/e2e_client.h"

#include <httplib.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"

namespace kvserve::testing {

using json = nlohmann::json;

HttpReply HttpCall(int port, const std::string& method, const std::string& path, const json& body,
                   const std::string& key) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  if (!key.empty()) c.set_bearer_token_auth(key);
  HttpReply r;
  const auto t0 = std::chrono::steady_clock::now();
  auto res = method == "GET" ? c.Get(path) : c.Post(path, body.dump(), "application/json");
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!res) return r;
  r.status = res->status;
  r.cache_header = res->get_header_value("x-kvserve-cache");
  r.raw = res->body;
  r.body = json::parse(res->body, nullptr, false);
  return r;
}

HttpReply HttpPost(int port, const std::string& path, const json& body, const std::string& key) {
  return HttpCall(port, "POST", path, body, key);
}

int CachedTokens(const HttpReply& r) {
  if (!r.body.is_object() || !r.body.contains("usage")) return -1;
  return r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
}

bool ScrapeMetrics(int port, std::string* text) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  auto res = c.Get("/metrics");
  if (!res || res->status != 200) {
    ADD_FAILURE() << "GET /metrics on 127.0.0.1:" << port << " did not answer 200 ("
                  << (res ? "status " + std::to_string(res->status)
                          : "no response: " + httplib::to_string(res.error()))
                  << ")";
    return false;
  }
  *text = res->body;
  return true;
}

namespace {

std::string Describe(const std::string& name, const std::vector<std::string>& labels) {
  std::string out = name;
  for (const std::string& l : labels) out += (out.size() == name.size() ? " with " : ", ") + l;
  return out;
}

}  // namespace

double MetricSample(int port, const std::string& name, const std::vector<std::string>& labels,
                    bool labelled_only) {
  std::string text;
  if (!ScrapeMetrics(port, &text)) return std::nan("");
  return MetricSampleIn(text, name, labels, labelled_only);
}

std::optional<double> FindMetricSample(const std::string& text, const std::string& name,
                                       const std::vector<std::string>& labels,
                                       bool labelled_only) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != '{' && (labelled_only || next != ' ')) continue;
    bool match = true;
    for (const std::string& l : labels) match = match && line.find(l) != std::string::npos;
    if (match) return std::strtod(line.substr(line.rfind(' ') + 1).c_str(), nullptr);
  }
  return std::nullopt;
}

double MetricSampleIn(const std::string& text, const std::string& name,
                      const std::vector<std::string>& labels, bool labelled_only) {
  const std::optional<double> v = FindMetricSample(text, name, labels, labelled_only);
  if (!v) {
    ADD_FAILURE() << "/metrics has no sample " << Describe(name, labels);
    return std::nan("");
  }
  return *v;
}

double MetricSum(int port, const std::string& name) {
  std::string text;
  if (!ScrapeMetrics(port, &text)) return std::nan("");
  double sum = 0;
  int samples = 0;
  const std::regex sample("^" + name + "\\{[^}]*\\} ([0-9.e+-]+)$");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, sample)) {
      sum += std::stod(m[1]);
      ++samples;
    }
  }
  if (samples == 0) {
    ADD_FAILURE() << "/metrics on 127.0.0.1:" << port << " has no labelled sample " << name;
    return std::nan("");
  }
  return sum;
}

std::shared_ptr<grpc::Channel> GrpcChannel(int port) {
  return grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                             grpc::InsecureChannelCredentials());
}

namespace {

void Authorize(grpc::ClientContext* ctx, const std::string& api_key) {
  if (!api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + api_key);
}

}  // namespace

GrpcReply GrpcGenerate(const std::shared_ptr<grpc::Channel>& channel,
                       const v1::GenerateRequest& request, const std::string& api_key) {
  auto stub = v1::Kvserve::NewStub(channel);
  grpc::ClientContext ctx;
  Authorize(&ctx, api_key);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->Generate(&ctx, request);
  GrpcReply out;
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    out.tokens.insert(out.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    if (!chunk.text().empty()) out.chunks.push_back(chunk.text());
    out.text += chunk.text();
    if (chunk.has_usage()) out.usage = chunk.usage();
    if (chunk.has_cache()) out.cache = chunk.cache();
  }
  out.status = reader->Finish();
  return out;
}

GrpcReply GrpcGenerateOk(const std::shared_ptr<grpc::Channel>& channel,
                         const v1::GenerateRequest& request, const std::string& api_key) {
  GrpcReply out = GrpcGenerate(channel, request, api_key);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  return out;
}

namespace {

grpc::Status GetStats(const std::shared_ptr<grpc::Channel>& channel, const std::string& api_key,
                      v1::Stats* stats) {
  auto stub = v1::Kvserve::NewStub(channel);
  grpc::ClientContext ctx;
  Authorize(&ctx, api_key);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->GetStats(&ctx, v1::GetStatsRequest(), stats);
}

}  // namespace

v1::Stats GrpcStats(const std::shared_ptr<grpc::Channel>& channel, const std::string& api_key) {
  v1::Stats stats;
  const grpc::Status s = GetStats(channel, api_key, &stats);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return stats;
}

grpc::Status PollStats(const std::shared_ptr<grpc::Channel>& channel,
                       const std::function<bool(const v1::Stats&)>& done, int tries,
                       std::chrono::milliseconds interval, v1::Stats* stats,
                       const std::string& api_key) {
  for (int i = 0; i < tries; ++i) {
    if (i > 0) std::this_thread::sleep_for(interval);
    *stats = v1::Stats();
    const grpc::Status s = GetStats(channel, api_key, stats);
    if (!s.ok()) return s;
    if (done(*stats)) break;
  }
  return grpc::Status::OK;
}

std::vector<int32_t> SeededPromptIds(int seed) {
  std::vector<int32_t> ids = {1};
  std::mt19937 rng(seed * 7919 + 1);
  for (int i = 0; i < 99; ++i) ids.push_back(3 + static_cast<int32_t>(rng() % 480));
  return ids;
}

v1::GenerateRequest SeededGreedyRequest(int seed, int max_tokens) {
  v1::GenerateRequest r;
  for (int32_t id : SeededPromptIds(seed)) r.add_prompt_ids(id);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

std::string Words(const std::string& tag, int i, size_t len) {
  static const char* kWords[] = {"river",  "lantern", "pebble", "meadow",  "cobalt", "thistle",
                                 "harbor", "quill",   "ember",  "saffron", "willow", "granite"};
  std::string s = tag + " " + std::to_string(i) + ":";
  uint32_t x = 2654435761u * static_cast<uint32_t>(i + 1) + static_cast<uint32_t>(tag.size());
  while (s.size() < len) {
    x = x * 1664525u + 1013904223u;
    s += " ";
    s += kWords[(x >> 16) % 12];
  }
  return s;
}

json Completion(const std::string& prompt) {
  return {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
}

}  // namespace kvserve::testing
