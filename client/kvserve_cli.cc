// kvserve-cli: a command-line client of the kvserve gRPC API.
//
//   kvserve-cli generate -p "Once upon a time" --max-tokens 48 --temperature 0
//   kvserve-cli chat --system "You are terse."       (interactive)
//   kvserve-cli chat -p "Hello"                      (one turn)
//   kvserve-cli generate -p "..." --kv-policy sinks --kv-window 128
//   kvserve-cli tokenize "some text"
//   kvserve-cli stats | info | health
//   kvserve-cli kv-events [--summary]                (follow the prefix cache)
//   kvserve-cli clear-prefix-cache
//
// Text streams to stdout as it arrives; --json prints one JSON object per
// line instead, for scripts. Exit status: 0 on success, 1 on any error (the
// gRPC status is printed to stderr).
//
// Depends on the public API (proto/) and gRPC only, like any outside client.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "CLI/CLI.hpp"
#include "proto/kvserve.grpc.pb.h"

namespace {

namespace pb = ::kvserve::v1;

struct GlobalOptions {
  std::string address = "127.0.0.1:50051";
  std::string api_key;
  std::string tls_ca;
  std::string tls_server_name;
  double timeout_s = 0;  // 0: no deadline
  bool json = false;
  std::string model;
};

// Sampling flags shared by generate and chat. Only flags the user gave are
// sent, so the daemon's defaults apply to the rest.
struct SamplingFlags {
  int32_t max_tokens = 0;
  float temperature = 1;
  float top_p = 1;
  int32_t top_k = 0;
  float min_p = 0;
  float repetition_penalty = 1;
  float presence_penalty = 0;
  float frequency_penalty = 0;
  int64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  int32_t n = 1;
  bool logprobs = false;
  bool ignore_eos = false;
  int32_t priority = 0;
  std::map<std::string, CLI::Option*> given;

  void Add(CLI::App* app) {
    given["max_tokens"] = app->add_option("--max-tokens,-n", max_tokens, "Most tokens to generate");
    given["temperature"] =
        app->add_option("--temperature,-t", temperature, "0 = greedy (default 1)");
    given["top_p"] = app->add_option("--top-p", top_p, "Nucleus mass in (0, 1]");
    given["top_k"] = app->add_option("--top-k", top_k, "Keep the k most likely tokens (0 = off)");
    given["min_p"] = app->add_option("--min-p", min_p, "Relative probability floor (0 = off)");
    given["repetition_penalty"] =
        app->add_option("--repetition-penalty", repetition_penalty, "1 = off");
    given["presence_penalty"] = app->add_option("--presence-penalty", presence_penalty, "0 = off");
    given["frequency_penalty"] =
        app->add_option("--frequency-penalty", frequency_penalty, "0 = off");
    given["seed"] = app->add_option("--seed", seed, "Sampler seed, for reproducible output");
    app->add_option("--stop", stop, "Stop string (repeatable)");
    app->add_option("--stop-token-id", stop_token_ids, "Stop token id (repeatable)");
    given["n"] = app->add_option("--samples", n, "Samples from the one prompt");
    app->add_flag("--logprobs", logprobs, "Return token log-probabilities");
    app->add_flag("--ignore-eos", ignore_eos, "Keep generating past end-of-sequence");
    app->add_option("--priority", priority, "Higher runs first");
  }

  bool Given(const std::string& name) const { return given.at(name)->count() > 0; }

  void Fill(pb::SamplingParams* s) const {
    if (Given("max_tokens")) s->set_max_tokens(max_tokens);
    if (Given("temperature")) s->set_temperature(temperature);
    if (Given("top_p")) s->set_top_p(top_p);
    s->set_top_k(top_k);
    s->set_min_p(min_p);
    if (Given("repetition_penalty")) s->set_repetition_penalty(repetition_penalty);
    s->set_presence_penalty(presence_penalty);
    s->set_frequency_penalty(frequency_penalty);
    if (Given("seed")) s->set_seed(seed);
    for (const std::string& x : stop) s->add_stop(x);
    for (int32_t id : stop_token_ids) s->add_stop_token_ids(id);
    if (Given("n")) s->set_n(n);
    s->set_logprobs(logprobs);
    s->set_ignore_eos(ignore_eos);
    s->set_priority(priority);
  }
};

// Token eviction (KvPolicy) for generate and chat. As with sampling, only the
// flags given are sent; the daemon's --kv-* defaults fill the rest, and with
// none given the request carries no kv_policy at all.
struct KvPolicyFlags {
  std::string policy;
  int32_t sinks = 0;
  int32_t window = 0;
  int32_t budget = 0;
  CLI::Option* sinks_opt = nullptr;
  CLI::Option* window_opt = nullptr;
  CLI::Option* budget_opt = nullptr;

  void Add(CLI::App* app) {
    app->add_option("--kv-policy", policy,
                    "Token eviction: none, window, sinks or h2o (default: the daemon's)");
    sinks_opt = app->add_option("--kv-sinks", sinks, "Tokens kept from the start (sinks, h2o)");
    window_opt = app->add_option("--kv-window", window, "Most recent tokens kept");
    budget_opt = app->add_option("--kv-budget", budget, "h2o: tokens kept in all");
  }

  // A GenerateRequest or a ChatRequest.
  template <typename Request>
  void Fill(Request* request) const {
    const bool any = !policy.empty() || sinks_opt->count() > 0 || window_opt->count() > 0 ||
                     budget_opt->count() > 0;
    if (!any) return;
    pb::KvPolicy* k = request->mutable_kv_policy();
    k->set_policy(policy);
    if (sinks_opt->count() > 0) k->set_sinks(sinks);
    if (window_opt->count() > 0) k->set_window(window);
    if (budget_opt->count() > 0) k->set_budget(budget);
  }
};

const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < static_cast<int>(std::size(kNames)) ? kNames[i] : "UNKNOWN";
}

int Fail(const grpc::Status& s) {
  std::fprintf(stderr, "kvserve-cli: error: %s: %s\n", CodeName(s.error_code()),
               s.error_message().c_str());
  return 1;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvserve-cli: error: %s\n", message.c_str());
  return 1;
}

std::string ToJson(const google::protobuf::Message& m, bool pretty = false) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;  // the names of the .proto, as documented
  o.always_print_primitive_fields = true;
  o.add_whitespace = pretty;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

class Client {
 public:
  explicit Client(const GlobalOptions& o) : options_(o) {}

  bool Connect(std::string* error) {
    std::shared_ptr<grpc::ChannelCredentials> creds;
    grpc::ChannelArguments args;
    if (!options_.tls_ca.empty()) {
      std::ifstream in(options_.tls_ca, std::ios::binary);
      if (!in) {
        *error = "--tls-ca: cannot read " + options_.tls_ca;
        return false;
      }
      std::ostringstream ss;
      ss << in.rdbuf();
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = ss.str();
      creds = grpc::SslCredentials(ssl);
      if (!options_.tls_server_name.empty()) {
        args.SetSslTargetNameOverride(options_.tls_server_name);
      }
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
    channel_ = grpc::CreateCustomChannel(options_.address, creds, args);
    stub_ = pb::Kvserve::NewStub(channel_);
    return true;
  }

  // A fresh context per call, carrying the key and the deadline.
  std::unique_ptr<grpc::ClientContext> Context(double default_timeout_s = 0) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (!options_.api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.api_key);
    const double t = options_.timeout_s > 0 ? options_.timeout_s : default_timeout_s;
    if (t > 0) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(t * 1000)));
    }
    return ctx;
  }

  pb::Kvserve::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  const GlobalOptions& options() const { return options_; }

 private:
  GlobalOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvserve::Stub> stub_;
};

// Reads a stream to its end, printing as it goes. Returns the text of each
// sample (for chat history) through `texts`.
template <typename Reader>
grpc::Status PrintStream(Reader* reader, bool json, int32_t samples,
                         std::map<int32_t, std::string>* texts) {
  pb::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    (*texts)[chunk.index()] += chunk.text();
    if (json) {
      std::printf("%s\n", ToJson(chunk).c_str());
      std::fflush(stdout);
    } else if (samples <= 1) {
      std::fwrite(chunk.text().data(), 1, chunk.text().size(), stdout);
      std::fflush(stdout);
    }
  }
  grpc::Status status = reader->Finish();
  if (!json) {
    if (samples > 1) {
      for (const auto& [index, text] : *texts) std::printf("[%d] %s\n", index, text.c_str());
    } else {
      std::printf("\n");
    }
    std::fflush(stdout);
  }
  return status;
}

int RunGenerate(Client* client, const std::string& prompt, const SamplingFlags& flags,
                const KvPolicyFlags& kv) {
  pb::GenerateRequest request;
  request.set_model(client->options().model);
  request.set_prompt(prompt);
  flags.Fill(request.mutable_sampling());
  kv.Fill(&request);
  auto ctx = client->Context();
  auto reader = client->stub()->Generate(ctx.get(), request);
  std::map<int32_t, std::string> texts;
  grpc::Status s =
      PrintStream(reader.get(), client->options().json, flags.Given("n") ? flags.n : 1, &texts);
  return s.ok() ? 0 : Fail(s);
}

// One chat turn: sends the history, streams the reply, appends it.
grpc::Status ChatTurn(Client* client, pb::ChatRequest* request) {
  auto ctx = client->Context();
  auto reader = client->stub()->Chat(ctx.get(), *request);
  std::map<int32_t, std::string> texts;
  grpc::Status s = PrintStream(reader.get(), client->options().json, 1, &texts);
  if (s.ok()) {
    pb::ChatMessage* reply = request->add_messages();
    reply->set_role("assistant");
    reply->set_content(texts[0]);
  }
  return s;
}

int RunChat(Client* client, const std::string& system, const std::string& prompt,
            const SamplingFlags& flags, const KvPolicyFlags& kv) {
  pb::ChatRequest request;
  request.set_model(client->options().model);
  flags.Fill(request.mutable_sampling());
  kv.Fill(&request);
  if (flags.Given("n") && flags.n != 1) return Fail("--samples: chat keeps one conversation");
  if (!system.empty()) {
    pb::ChatMessage* m = request.add_messages();
    m->set_role("system");
    m->set_content(system);
  }
  auto add_user = [&request](const std::string& text) {
    pb::ChatMessage* m = request.add_messages();
    m->set_role("user");
    m->set_content(text);
  };
  if (!prompt.empty()) {
    add_user(prompt);
    grpc::Status s = ChatTurn(client, &request);
    return s.ok() ? 0 : Fail(s);
  }
  const bool tty = isatty(STDIN_FILENO);
  if (tty)
    std::fprintf(stderr, "kvserve chat: /reset clears the conversation, /exit or Ctrl-D quits\n");
  const int history_base = request.messages_size();  // the system message stays
  std::string line;
  while (true) {
    if (tty) std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      request.mutable_messages()->DeleteSubrange(history_base,
                                                 request.messages_size() - history_base);
      continue;
    }
    add_user(line);
    grpc::Status s = ChatTurn(client, &request);
    if (!s.ok()) {
      // Keep the session: drop the unanswered turn and let the user retry.
      request.mutable_messages()->RemoveLast();
      Fail(s);
      if (!tty) return 1;
    }
  }
  return 0;
}

int RunTokenize(Client* client, const std::string& text, bool no_special, bool parse_special) {
  pb::TokenizeRequest request;
  request.set_model(client->options().model);
  request.set_text(text);
  request.set_add_special_tokens(!no_special);
  request.set_parse_special(parse_special);
  pb::TokenizeResponse response;
  auto ctx = client->Context(30);
  grpc::Status s = client->stub()->Tokenize(ctx.get(), request, &response);
  if (!s.ok()) return Fail(s);
  if (client->options().json) {
    std::printf("%s\n", ToJson(response).c_str());
  } else {
    for (int i = 0; i < response.token_ids_size(); ++i) {
      std::printf(i == 0 ? "%d" : " %d", response.token_ids(i));
    }
    std::printf("\n");
  }
  return 0;
}

int RunDetokenize(Client* client, const std::vector<int32_t>& ids) {
  pb::DetokenizeRequest request;
  request.set_model(client->options().model);
  for (int32_t id : ids) request.add_token_ids(id);
  pb::DetokenizeResponse response;
  auto ctx = client->Context(30);
  grpc::Status s = client->stub()->Detokenize(ctx.get(), request, &response);
  if (!s.ok()) return Fail(s);
  if (client->options().json) {
    std::printf("%s\n", ToJson(response).c_str());
  } else {
    std::printf("%s\n", response.text().c_str());
  }
  return 0;
}

int RunStats(Client* client) {
  pb::Stats response;
  auto ctx = client->Context(30);
  grpc::Status s = client->stub()->GetStats(ctx.get(), pb::GetStatsRequest(), &response);
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", ToJson(response, !client->options().json).c_str());
  return 0;
}

int RunInfo(Client* client) {
  pb::ModelInfo response;
  auto ctx = client->Context(30);
  grpc::Status s = client->stub()->GetModelInfo(ctx.get(), pb::GetModelInfoRequest(), &response);
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", ToJson(response, !client->options().json).c_str());
  return 0;
}

// grpc.health.v1.Health/Check through the generic stub: the two messages
// have one field each, so they are encoded by hand rather than pulling the
// health proto's generated code into the client.
int RunHealth(Client* client, const std::string& service) {
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back(0x0a);  // field 1 (service), length-delimited
    size_t len = service.size();
    do {
      unsigned char b = len & 0x7f;
      len >>= 7;
      request_bytes.push_back(static_cast<char>(len ? (b | 0x80) : b));
    } while (len);
    request_bytes += service;
  }
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::GenericStub stub(client->channel());
  grpc::CompletionQueue cq;
  auto ctx = client->Context(10);
  auto call = stub.PrepareUnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return Fail(status);

  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse: field 1 (status) varint; absent means UNKNOWN (0).
  int serving_status = 0;
  if (bytes.size() >= 2 && bytes[0] == 0x08) serving_status = static_cast<unsigned char>(bytes[1]);
  static const char* const kStatus[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const char* name =
      serving_status >= 0 && serving_status < 4 ? kStatus[serving_status] : "UNKNOWN";
  if (client->options().json) {
    std::printf("{\"status\":\"%s\"}\n", name);
  } else {
    std::printf("%s\n", name);
  }
  return serving_status == 1 ? 0 : 1;
}

int RunClearPrefixCache(Client* client) {
  pb::ClearPrefixCacheResponse response;
  auto ctx = client->Context(30);
  grpc::Status s =
      client->stub()->ClearPrefixCache(ctx.get(), pb::ClearPrefixCacheRequest(), &response);
  if (!s.ok()) return Fail(s);
  if (client->options().json) {
    std::printf("%s\n", ToJson(response).c_str());
  } else {
    std::printf("cleared %d blocks\n", response.blocks_cleared());
  }
  return 0;
}

// ---------------------------------------------------------------------------
// cache: retention leases, public prefixes and the cache-miss explainer
// (docs/cache-control.md), through the CacheControl call's JSON bodies.

struct CacheFlags {
  std::string prompt;
  std::string ids;            // comma-separated token ids
  std::string messages_file;  // a JSON array of {role, content}
  std::string salt;
  std::string tenant;         // operator: look at a tenant's scope
  double ttl_s = 300;
  int32_t tokens = 0;
  bool no_warm = false;
  bool unmark = false;
  uint64_t lease = 0;
};

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
}

// The prompt part of a body: prompt, prompt_ids or messages.
std::string PromptFields(const CacheFlags& f, std::string* error) {
  std::string out;
  int given = 0;
  if (!f.prompt.empty()) {
    out += ",\"prompt\":" + JsonString(f.prompt);
    ++given;
  }
  if (!f.ids.empty()) {
    out += ",\"prompt_ids\":[" + f.ids + "]";
    for (char c : f.ids) {
      if (!(std::isdigit(static_cast<unsigned char>(c)) || c == ',' || c == ' ')) {
        *error = "--ids takes comma-separated token ids";
        return "";
      }
    }
    ++given;
  }
  if (!f.messages_file.empty()) {
    std::ifstream in(f.messages_file);
    if (!in) {
      *error = "cannot read --messages-file " + f.messages_file;
      return "";
    }
    std::stringstream ss;
    ss << in.rdbuf();
    out += ",\"messages\":" + ss.str();
    ++given;
  }
  if (given != 1) *error = "give exactly one of --prompt, --ids, --messages-file";
  if (!f.salt.empty()) out += ",\"cache_salt\":" + JsonString(f.salt);
  if (!f.tenant.empty()) out += ",\"tenant\":" + JsonString(f.tenant);
  return out;
}

int RunCache(Client* client, const std::string& op, const CacheFlags& f) {
  std::string body = "{\"_\":0";
  std::string error;
  if (op == "retain" || op == "explain" || op == "public") {
    body += PromptFields(f, &error);
    if (!error.empty()) return Fail(error);
  }
  if (op == "retain") {
    body += ",\"ttl_s\":" + std::to_string(f.ttl_s) + ",\"tokens\":" + std::to_string(f.tokens);
    if (f.no_warm) body += ",\"warm\":false";
  } else if (op == "renew" || op == "release") {
    body += ",\"lease_id\":" + std::to_string(f.lease);
    if (op == "renew") body += ",\"ttl_s\":" + std::to_string(f.ttl_s);
  } else if (op == "public") {
    if (f.unmark) body += ",\"public\":false";
  }
  body += "}";
  pb::CacheControlRequest request;
  request.set_op(op);
  request.set_body_json(body);
  pb::CacheControlResponse response;
  auto ctx = client->Context(180);
  grpc::Status s = client->stub()->CacheControl(ctx.get(), request, &response);
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", response.body_json().c_str());
  // A refused retention is an answer, but not a success for scripts.
  if (response.body_json().find("\"outcome\":\"refused\"") != std::string::npos) return 3;
  return 0;
}

// ---------------------------------------------------------------------------
// kv-events: a replica of the daemon's prefix-cache index, kept from the
// event stream alone, as a router would keep one.

struct KvEventsFlags {
  uint64_t after = 0;           // resume after this sequence
  bool snapshot = false;        // start from a snapshot
  bool snapshot_only = false;   // take one snapshot, print the summary, exit
  bool summary = false;         // print the replica's summary at the end
  bool quiet = false;           // no per-event lines
  bool no_reconnect = false;
  double duration_s = 0;        // 0: until interrupted
  int64_t count = 0;            // stop after this many events (0: no limit)
  double reconnect_delay_s = 0.5;
};

std::atomic<bool> g_interrupted{false};
void OnInterrupt(int /*sig*/) { g_interrupted = true; }

std::string Hex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

class KvReplica {
 public:
  void Clear() { blocks_.clear(); }
  void Store(const pb::KvBlockStored& b) {
    blocks_[b.block_hash()] = Block{b.parent_hash(), b.token_count()};
  }
  bool Remove(uint64_t hash) { return blocks_.erase(hash) > 0; }
  bool Has(uint64_t hash) const { return blocks_.count(hash) > 0; }

  void PrintSummary(bool json, uint64_t sequence, int64_t events, int64_t snapshots,
                    int64_t reconnects) const {
    int64_t roots = 0, tokens = 0, leaves = 0;
    int32_t max_depth = 0;
    std::unordered_map<uint64_t, int32_t> children;
    for (const auto& [hash, b] : blocks_) {
      if (b.parent == 0) ++roots;
      tokens += b.token_count;
      ++children[b.parent];
    }
    for (const auto& [hash, b] : blocks_) {
      if (children.count(hash) == 0) ++leaves;
      int32_t depth = 1;
      for (uint64_t p = b.parent; p != 0 && depth <= static_cast<int32_t>(blocks_.size());) {
        auto it = blocks_.find(p);
        if (it == blocks_.end()) break;
        ++depth;
        p = it->second.parent;
      }
      max_depth = std::max(max_depth, depth);
    }
    if (json) {
      std::printf(
          "{\"sequence\":%" PRIu64 ",\"blocks\":%zu,\"roots\":%" PRId64 ",\"leaves\":%" PRId64
          ",\"max_depth\":%d,\"tokens\":%" PRId64 ",\"events\":%" PRId64
          ",\"snapshots\":%" PRId64 ",\"reconnects\":%" PRId64 "}\n",
          sequence, blocks_.size(), roots, leaves, max_depth, tokens, events, snapshots,
          reconnects);
    } else {
      std::printf("replica as of #%" PRIu64 ": %zu blocks (%" PRId64 " roots, %" PRId64
                  " leaves, depth up to %d), %" PRId64 " tokens; %" PRId64 " events, %" PRId64
                  " snapshots, %" PRId64 " reconnects\n",
                  sequence, blocks_.size(), roots, leaves, max_depth, tokens, events, snapshots,
                  reconnects);
    }
    std::fflush(stdout);
  }

 private:
  struct Block {
    uint64_t parent = 0;
    int32_t token_count = 0;
  };
  std::unordered_map<uint64_t, Block> blocks_;
};

// " (group g)" for another KV cache group's block (a hybrid model), "" for
// group 0's.
std::string GroupNote(int32_t group) {
  return group == 0 ? std::string() : " (group " + std::to_string(group) + ")";
}

void PrintEvent(const pb::KvEvent& e, bool json) {
  if (json) {
    std::printf("%s\n", ToJson(e).c_str());
    return;
  }
  switch (e.event_case()) {
    case pb::KvEvent::kBlockStored: {
      const pb::KvBlockStored& b = e.block_stored();
      std::printf("#%" PRIu64 " stored%s%s %s parent %s tokens %d [", e.sequence(),
                  b.tier() == pb::KV_TIER_HOST   ? " (host tier)"
                  : b.tier() == pb::KV_TIER_DISK ? " (disk tier)"
                                                 : "",
                  GroupNote(b.group_idx()).c_str(), Hex(b.block_hash()).c_str(),
                  Hex(b.parent_hash()).c_str(), b.token_count());
      for (int i = 0; i < b.token_ids_size(); ++i) {
        std::printf(i == 0 ? "%d" : " %d", b.token_ids(i));
      }
      std::printf("]\n");
      break;
    }
    case pb::KvEvent::kBlockRemoved:
      std::printf("#%" PRIu64 " removed%s%s %s\n", e.sequence(),
                  e.block_removed().tier() == pb::KV_TIER_HOST   ? " (host tier)"
                  : e.block_removed().tier() == pb::KV_TIER_DISK ? " (disk tier)"
                                                                 : "",
                  GroupNote(e.block_removed().group_idx()).c_str(),
                  Hex(e.block_removed().block_hash()).c_str());
      break;
    case pb::KvEvent::kAllCleared:
      std::printf("#%" PRIu64 " cleared%s\n", e.sequence(),
                  GroupNote(e.all_cleared().group_idx()).c_str());
      break;
    case pb::KvEvent::EVENT_NOT_SET:
      std::printf("#%" PRIu64 " (unknown event)\n", e.sequence());
      break;
  }
}

// Statuses after which trying again cannot help.
bool Permanent(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAUTHENTICATED ||
         code == grpc::StatusCode::PERMISSION_DENIED ||
         code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::INVALID_ARGUMENT ||
         code == grpc::StatusCode::UNIMPLEMENTED;
}

int RunKvEvents(Client* client, const KvEventsFlags& flags) {
  const bool json = client->options().json;
  signal(SIGINT, OnInterrupt);
  signal(SIGTERM, OnInterrupt);
  const auto end = flags.duration_s > 0
                       ? std::chrono::steady_clock::now() +
                             std::chrono::milliseconds(static_cast<int64_t>(flags.duration_s * 1000))
                       : std::chrono::steady_clock::time_point::max();
  // The watcher cancels the call in progress on Ctrl-C, at the end of
  // --duration, or once --count events arrived (signal handlers may not).
  std::mutex mu;
  grpc::ClientContext* current = nullptr;  // guarded by mu
  std::atomic<bool> stop{false}, done{false};
  std::thread watcher([&] {
    while (!done) {
      if (g_interrupted || std::chrono::steady_clock::now() >= end) stop = true;
      if (stop) {
        std::lock_guard<std::mutex> lock(mu);
        if (current != nullptr) current->TryCancel();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });

  KvReplica replica;
  uint64_t position = flags.after;  // the last sequence the replica reflects
  uint64_t epoch = 0;               // the daemon log's epoch position counts in
  bool want_snapshot = flags.snapshot || flags.snapshot_only;
  int64_t events = 0, snapshots = 0, reconnects = 0;
  int exit_code = 0;
  double delay_s = flags.reconnect_delay_s;
  while (!stop) {
    pb::SubscribeKvEventsRequest request;
    request.set_after_sequence(position);
    request.set_snapshot(want_snapshot);
    request.set_epoch(epoch);
    // A stream lives as long as it is wanted: no deadline from --timeout.
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (!client->options().api_key.empty()) {
      ctx->AddMetadata("authorization", "Bearer " + client->options().api_key);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      current = ctx.get();
    }
    auto reader = client->stub()->SubscribeKvEvents(ctx.get(), request);
    pb::KvEventsResponse msg;
    bool got_any = false;
    bool resync = false;
    while (!resync && reader->Read(&msg)) {
      got_any = true;
      epoch = msg.epoch();
      if (msg.has_snapshot()) {
        const pb::KvSnapshotChunk& chunk = msg.snapshot();
        if (chunk.index() == 0) {
          // Until the last chunk the replica matches no sequence: a break
          // now means starting over (after 0 replays or re-snapshots).
          replica.Clear();
          position = 0;
        }
        for (const pb::KvBlockStored& b : chunk.blocks()) {
          // Tier pages and other KV cache groups' blocks: not the index.
          if (b.tier() == pb::KV_TIER_NONE && b.group_idx() == 0) replica.Store(b);
        }
        if (json) {
          std::printf("{\"snapshot\":{\"as_of_sequence\":%" PRIu64
                      ",\"index\":%u,\"blocks\":%d,\"last\":%s}}\n",
                      chunk.as_of_sequence(), chunk.index(), chunk.blocks_size(),
                      chunk.last() ? "true" : "false");
        } else if (!flags.quiet) {
          std::printf("snapshot as of #%" PRIu64 ": chunk %u, %d blocks%s\n",
                      chunk.as_of_sequence(), chunk.index(), chunk.blocks_size(),
                      chunk.last() ? " (complete)" : "");
        }
        if (chunk.last()) {
          position = chunk.as_of_sequence();
          ++snapshots;
          want_snapshot = false;
          if (flags.snapshot_only) stop = true;
        }
      }
      for (const pb::KvEvent& e : msg.events()) {
        if (e.sequence() != position + 1) {
          std::fprintf(stderr, "kvserve-cli: warning: expected event #%" PRIu64 ", got #%" PRIu64
                       "; resynchronizing\n", position + 1, e.sequence());
          want_snapshot = true;
          resync = true;
          ctx->TryCancel();
          break;
        }
        switch (e.event_case()) {
          case pb::KvEvent::kBlockStored:
            if (e.block_stored().tier() == pb::KV_TIER_NONE && e.block_stored().group_idx() == 0) {
              replica.Store(e.block_stored());
            }
            break;
          case pb::KvEvent::kBlockRemoved:
            if (e.block_removed().tier() == pb::KV_TIER_NONE &&
                e.block_removed().group_idx() == 0) {
              replica.Remove(e.block_removed().block_hash());
            }
            break;
          case pb::KvEvent::kAllCleared:
            if (e.all_cleared().group_idx() == 0) replica.Clear();
            break;
          case pb::KvEvent::EVENT_NOT_SET: break;
        }
        position = e.sequence();
        ++events;
        if (!flags.quiet) PrintEvent(e, json);
        if (flags.count > 0 && events >= flags.count) stop = true;
      }
      std::fflush(stdout);
      if (stop) ctx->TryCancel();
    }
    grpc::Status status = reader->Finish();
    {
      std::lock_guard<std::mutex> lock(mu);
      current = nullptr;
    }
    if (stop) break;
    if (Permanent(status.error_code())) {
      exit_code = Fail(status);
      break;
    }
    if (flags.no_reconnect) {
      if (!status.ok()) exit_code = Fail(status);
      break;
    }
    // Back off while the daemon is away; reset once a stream delivered.
    delay_s = got_any ? flags.reconnect_delay_s : std::min(delay_s * 2, 10.0);
    std::fprintf(stderr, "kvserve-cli: event stream ended (%s: %s); reconnecting after #%" PRIu64
                 "\n", CodeName(status.error_code()), status.error_message().c_str(), position);
    for (auto until = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(delay_s * 1000));
         !stop && std::chrono::steady_clock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ++reconnects;
  }
  done = true;
  watcher.join();
  if (flags.summary || flags.snapshot_only) {
    replica.PrintSummary(json, position, events, snapshots, reconnects);
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvserve-cli: talk to a kvserve daemon over gRPC"};
  app.require_subcommand(1);
  GlobalOptions g;
  app.add_option("--address,-a", g.address, "Daemon address host:port")
      ->envname("KVSERVE_ADDRESS")
      ->capture_default_str();
  app.add_option("--api-key", g.api_key, "Sent as 'authorization: Bearer <key>'")
      ->envname("KVSERVE_API_KEY");
  app.add_option("--tls-ca", g.tls_ca, "PEM root certificate(s): connect with TLS")
      ->envname("KVSERVE_TLS_CA");
  app.add_option("--tls-server-name", g.tls_server_name,
                 "Name to verify in the server certificate (default: the host of --address)");
  app.add_option("--timeout", g.timeout_s, "Deadline per call in seconds (0: none)");
  app.add_option("--model", g.model, "Model name (default: the one the daemon serves)");
  app.add_flag("--json", g.json, "Print JSON (one object per line) for scripts");

  CLI::App* generate = app.add_subcommand("generate", "Complete a prompt, streaming the text");
  std::string prompt;
  generate->add_option("-p,--prompt", prompt, "Prompt text")->required();
  SamplingFlags generate_flags;
  generate_flags.Add(generate);
  KvPolicyFlags generate_kv;
  generate_kv.Add(generate);

  CLI::App* chat = app.add_subcommand("chat", "Chat interactively (or one turn with -p)");
  std::string chat_prompt, system;
  chat->add_option("-p,--prompt", chat_prompt, "One user message; print the reply and exit");
  chat->add_option("--system", system, "System message opening the conversation");
  SamplingFlags chat_flags;
  chat_flags.Add(chat);
  KvPolicyFlags chat_kv;
  chat_kv.Add(chat);

  CLI::App* tokenize = app.add_subcommand("tokenize", "Print the token ids of TEXT");
  std::string text;
  bool no_special = false, parse_special = false;
  tokenize->add_option("text", text, "Text to tokenize")->required();
  tokenize->add_flag("--no-special", no_special, "Do not add BOS");
  tokenize->add_flag("--parse-special", parse_special, "Recognize special-token text");

  CLI::App* detokenize = app.add_subcommand("detokenize", "Print the text of token ids");
  std::vector<int32_t> ids;
  detokenize->add_option("ids", ids, "Token ids")->required();

  CLI::App* stats = app.add_subcommand("stats", "Print the engine's statistics");
  CLI::App* info = app.add_subcommand("info", "Print the served model and KV cache shape");
  CLI::App* health = app.add_subcommand("health", "Standard gRPC health check (exit 0 if SERVING)");
  std::string health_service;
  health->add_option("--service", health_service, "Service to check (default: the server)");

  CLI::App* kv_events = app.add_subcommand(
      "kv-events",
      "Follow the prefix cache's KV event stream, keeping a local replica of the index "
      "(reconnects with its last sequence number)");
  KvEventsFlags kv;
  kv_events->add_option("--after", kv.after, "Resume after this sequence number (default 0)");
  kv_events->add_flag("--snapshot", kv.snapshot, "Start from a snapshot of the whole index");
  kv_events->add_flag("--snapshot-only", kv.snapshot_only,
                      "Take one snapshot, print the replica's summary and exit");
  kv_events->add_flag("--summary", kv.summary, "Print a summary of the replica on exit");
  kv_events->add_flag("--quiet,-q", kv.quiet, "Print no line per event");
  kv_events->add_option("--duration", kv.duration_s, "Stop after this many seconds (0: never)");
  kv_events->add_option("--count", kv.count, "Stop after this many events (0: no limit)");
  kv_events->add_flag("--no-reconnect", kv.no_reconnect, "Exit when the stream ends");
  kv_events->add_option("--reconnect-delay", kv.reconnect_delay_s,
                        "Seconds before reconnecting (doubles while the daemon is away)")
      ->capture_default_str();

  CLI::App* clear_prefix_cache = app.add_subcommand(
      "clear-prefix-cache", "Drop every prefix-cache block that no running request uses");

  CLI::App* cache = app.add_subcommand(
      "cache", "Cache control: retain, renew, release, list, explain, public (docs/cache-control.md)");
  cache->require_subcommand(1);
  CacheFlags cf;
  std::string cache_op;
  auto prompt_options = [&cf](CLI::App* sub) {
    sub->add_option("--prompt,-p", cf.prompt, "The prompt as text");
    sub->add_option("--ids", cf.ids, "The prompt as comma-separated token ids");
    sub->add_option("--messages-file", cf.messages_file,
                    "The prompt as chat messages: a file with a JSON array of {role, content}");
    sub->add_option("--salt", cf.salt, "cache_salt (narrows the caller's scope)");
    sub->add_option("--tenant", cf.tenant, "Operator key only: the tenant whose scope to use");
  };
  CLI::App* c_retain = cache->add_subcommand("retain", "Pin a cached prompt's blocks for a TTL");
  prompt_options(c_retain);
  c_retain->add_option("--ttl", cf.ttl_s, "Seconds to retain")->capture_default_str();
  c_retain->add_option("--tokens", cf.tokens, "Retain the first N tokens only (0: all)");
  c_retain->add_flag("--no-warm", cf.no_warm, "Do not compute the prompt when it is not cached");
  CLI::App* c_renew = cache->add_subcommand("renew", "Extend a lease");
  c_renew->add_option("lease", cf.lease, "Lease id")->required();
  c_renew->add_option("--ttl", cf.ttl_s, "New TTL in seconds from now")->capture_default_str();
  CLI::App* c_release = cache->add_subcommand("release", "Release a lease now");
  c_release->add_option("lease", cf.lease, "Lease id")->required();
  CLI::App* c_list = cache->add_subcommand("list", "List retention leases (a tenant sees its own)");
  CLI::App* c_explain = cache->add_subcommand(
      "explain", "What the cache holds for a prompt and why the rest misses (runs no model)");
  prompt_options(c_explain);
  CLI::App* c_public = cache->add_subcommand(
      "public", "Operator: share a prompt prefix with every tenant (--unmark to stop)");
  prompt_options(c_public);
  c_public->add_flag("--unmark", cf.unmark, "Stop sharing it");
  for (CLI::App* sub : {c_retain, c_renew, c_release, c_list, c_explain, c_public}) {
    sub->callback([&cache_op, sub] { cache_op = sub->get_name(); });
  }

  CLI11_PARSE(app, argc, argv);

  Client client(g);
  std::string error;
  if (!client.Connect(&error)) return Fail(error);
  if (*generate) return RunGenerate(&client, prompt, generate_flags, generate_kv);
  if (*chat) return RunChat(&client, system, chat_prompt, chat_flags, chat_kv);
  if (*tokenize) return RunTokenize(&client, text, no_special, parse_special);
  if (*detokenize) return RunDetokenize(&client, ids);
  if (*stats) return RunStats(&client);
  if (*info) return RunInfo(&client);
  if (*health) return RunHealth(&client, health_service);
  if (*kv_events) return RunKvEvents(&client, kv);
  if (*clear_prefix_cache) return RunClearPrefixCache(&client);
  if (*cache) return RunCache(&client, cache_op, cf);
  return 1;
}
