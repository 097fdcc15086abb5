#include "client/bench/backend.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"

namespace kvserve::bench {
namespace {

using nlohmann::json;

double Since(Clock::time_point epoch) {
  return std::chrono::duration<double>(Clock::now() - epoch).count();
}

std::string Truncate(std::string s) {
  if (s.size() > 300) s.resize(300);
  return s;
}

// Marks a content event: the first sets TTFT, later ones add a gap.
void OnContent(RequestRecord& r, double now_s, double& last_s) {
  if (r.chunks == 0) {
    r.ttft_s = now_s - r.start_s;
  } else {
    r.itl_s.push_back(now_s - last_s);
  }
  last_s = now_s;
  ++r.chunks;
}

class HttpBackend : public Backend {
 public:
  HttpBackend(std::string base_url, BackendOptions o)
      : url_(std::move(base_url)), o_(std::move(o)) {
    while (!url_.empty() && url_.back() == '/') url_.pop_back();
    if (url_.size() >= 3 && url_.compare(url_.size() - 3, 3, "/v1") == 0)
      url_.resize(url_.size() - 3);
    if (url_.find("://") == std::string::npos) url_ = "http://" + url_;
    // vLLM and others require "model"; ask the server for its first one so
    // a new user need not know the name. Failure is left to the requests.
    if (o_.model.empty()) {
      httplib::Client cli(url_);
      cli.set_connection_timeout(5);
      cli.set_read_timeout(10);
      httplib::Headers headers;
      if (!o_.api_key.empty()) headers.emplace("Authorization", "Bearer " + o_.api_key);
      if (auto res = cli.Get("/v1/models", headers); res && res->status == 200) {
        json j = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
            j["data"][0].contains("id") && j["data"][0]["id"].is_string()) {
          o_.model = j["data"][0]["id"].get<std::string>();
        }
      }
    }
  }

  std::string Name() const override {
    return o_.speculative.empty() ? url_ : url_ + " speculative=" + o_.speculative;
  }

  RequestRecord Send(const std::vector<Message>& messages, int max_tokens,
                     Clock::time_point epoch) override {
    RequestRecord r;
    r.target = Name();
    json body = {{"max_tokens", max_tokens},
                 {"temperature", o_.temperature},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    // ignore_eos is a vLLM / kvserve / llama.cpp extension; other servers
    // may reject unknown fields, so it is only sent when asked for.
    if (o_.ignore_eos) body["ignore_eos"] = true;
    if (!o_.speculative.empty()) body["speculative"] = o_.speculative;
    if (!o_.model.empty()) body["model"] = o_.model;
    std::string path;
    if (o_.api == "chat") {
      path = "/v1/chat/completions";
      body["messages"] = json::array();
      for (const Message& m : messages)
        body["messages"].push_back({{"role", m.role}, {"content", m.content}});
    } else {
      path = "/v1/completions";
      body["prompt"] = FlattenMessages(messages);
    }

    // httplib's Client is not safe to share across threads, so each worker
    // thread keeps its own keep-alive connection, as benchmark clients with
    // a connection pool do: TTFT then excludes the TCP handshake.
    // --no-keep-alive instead opens a connection per request, as one-shot
    // clients (curl) do.
    thread_local std::map<const HttpBackend*, PooledClient> clients;
    PooledClient one_shot;
    PooledClient& pooled = o_.keep_alive ? clients[this] : one_shot;
    std::unique_ptr<httplib::Client>& client = pooled.client;
    if (!client) {
      pooled.uses = 0;
      MakeClient(client);
    }

    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.headers = {{"Accept", "text/event-stream"}};
    if (!o_.api_key.empty()) req.headers.emplace("Authorization", "Bearer " + o_.api_key);
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");

    std::string buffer, raw_error;
    double last_s = 0;
    bool stream_error = false;
    httplib::Response res;
    // The receiver sees the body before the status is checked, so it keeps
    // the raw bytes too: on a non-2xx status they are the error message.
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      const double now_s = Since(epoch);
      if (raw_error.size() < 1000) raw_error.append(data, std::min<size_t>(n, 1000));
      buffer.append(data, n);
      size_t end;
      while ((end = buffer.find("\n\n")) != std::string::npos) {
        std::string event = buffer.substr(0, end);
        buffer.erase(0, end + 2);
        HandleEvent(event, now_s, r, last_s, stream_error);
      }
      return true;
    };
    bool got_bytes = false;
    req.response_handler = [&](const httplib::Response&) {
      got_bytes = true;  // the status line and headers arrived
      return true;
    };
    r.start_s = Since(epoch);
    httplib::Error err = httplib::Error::Success;
    const bool reused = pooled.uses > 0;
    bool sent = client->send(req, res, err);
    ++pooled.uses;
    if (!sent && reused && !got_bytes && raw_error.empty() && r.chunks == 0 &&
        err != httplib::Error::Canceled) {
      // A kept-alive connection the server had already closed (its idle
      // timeout, a restart) and not one response byte came back: retry
      // once on a new connection, as HTTP clients do. The failed attempt
      // is the client's cost (its pool held a dead connection), not the
      // server's: the record is timed from the retry.
      ++r.connection_retries;
      MakeClient(client);
      pooled.uses = 0;
      res = httplib::Response();
      buffer.clear();
      r.start_s = Since(epoch);
      err = httplib::Error::Success;
      sent = client->send(req, res, err);
      ++pooled.uses;
    }
    r.e2e_s = Since(epoch) - r.start_s;
    if (!sent) {
      client.reset();  // the connection is in an unknown state
      r.error = (err == httplib::Error::Read && r.e2e_s >= o_.timeout_s * 0.95) ? "timeout"
                                                                                : "connection";
      r.error_message = httplib::to_string(err);
      return r;
    }
    if (res.status < 200 || res.status >= 300) {
      r.error = "http_" + std::to_string(res.status);
      r.error_message = Truncate(raw_error);
      return r;
    }
    if (!buffer.empty()) HandleEvent(buffer, r.start_s + r.e2e_s, r, last_s, stream_error);
    if (stream_error) {
      r.error = "stream";
      return r;
    }
    if (r.chunks == 0 && r.output_tokens != 0) {
      r.error = "empty_stream";
      return r;
    }
    if (r.output_tokens < 0) r.output_tokens = r.chunks;  // no usage: count chunks
    r.ok = true;
    return r;
  }

 private:
  // One worker's connection and how many requests it has carried.
  struct PooledClient {
    std::unique_ptr<httplib::Client> client;
    int uses = 0;
  };

  void MakeClient(std::unique_ptr<httplib::Client>& client) const {
    client = std::make_unique<httplib::Client>(url_);
    const auto timeout = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::duration<double>(o_.timeout_s));
    client->set_connection_timeout(timeout);
    client->set_read_timeout(timeout);
    client->set_write_timeout(timeout);
    client->set_keep_alive(o_.keep_alive);
    // Without it, Nagle holds the body of a request on a reused connection
    // until the server ACKs the headers (a delayed ACK: tens of ms of
    // false TTFT).
    client->set_tcp_nodelay(true);
  }

  void HandleEvent(const std::string& event, double now_s, RequestRecord& r, double& last_s,
                   bool& stream_error) {
    size_t pos = 0;
    while (pos < event.size()) {
      size_t eol = event.find('\n', pos);
      if (eol == std::string::npos) eol = event.size();
      std::string line = event.substr(pos, eol - pos);
      pos = eol + 1;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.rfind("data:", 0) != 0) continue;  // comments (keep-alive), ids
      std::string data = line.substr(5);
      if (!data.empty() && data[0] == ' ') data.erase(0, 1);
      if (data == "[DONE]") continue;
      json j = json::parse(data, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) continue;
      if (j.contains("error")) {
        stream_error = true;
        r.error_message = Truncate(j["error"].dump());
        continue;
      }
      if (j.contains("choices") && j["choices"].is_array()) {
        for (const auto& c : j["choices"]) {
          std::string piece;
          if (c.contains("text") && c["text"].is_string()) piece = c["text"].get<std::string>();
          if (c.contains("delta") && c["delta"].is_object()) {
            const auto& d = c["delta"];
            if (d.contains("content") && d["content"].is_string())
              piece = d["content"].get<std::string>();
            // Reasoning models stream thoughts first; they are output too.
            if (piece.empty() && d.contains("reasoning_content") &&
                d["reasoning_content"].is_string()) {
              piece = d["reasoning_content"].get<std::string>();
            }
          }
          if (!piece.empty()) {
            OnContent(r, now_s, last_s);
            r.text += piece;
          }
        }
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const auto& u = j["usage"];
        r.prompt_tokens = u.value("prompt_tokens", -1);
        r.output_tokens = u.value("completion_tokens", -1);
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
          r.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", -1);
        }
      }
    }
  }

  std::string url_;
  BackendOptions o_;
};

std::string CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::OK:
      return "OK";
    case grpc::CANCELLED:
      return "CANCELLED";
    case grpc::UNKNOWN:
      return "UNKNOWN";
    case grpc::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::ABORTED:
      return "ABORTED";
    case grpc::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::INTERNAL:
      return "INTERNAL";
    case grpc::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::DATA_LOSS:
      return "DATA_LOSS";
    default:
      return std::to_string(static_cast<int>(c));
  }
}

class GrpcBackend : public Backend {
 public:
  GrpcBackend(std::string address, BackendOptions o)
      : address_(std::move(address)),
        o_(std::move(o)),
        stub_(v1::Kvserve::NewStub(
            grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()))) {}

  std::string Name() const override {
    const std::string n = "grpc://" + address_;
    return o_.speculative.empty() ? n : n + " speculative=" + o_.speculative;
  }

  int CountTokens(const std::string& text) override {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::TokenizeRequest req;
    req.set_model(o_.model);
    req.set_text(text);
    v1::TokenizeResponse resp;
    if (!stub_->Tokenize(&ctx, req, &resp).ok()) return -1;
    return resp.token_ids_size();
  }

  RequestRecord Send(const std::vector<Message>& messages, int max_tokens,
                     Clock::time_point epoch) override {
    RequestRecord r;
    r.target = Name();
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::SamplingParams sampling;
    sampling.set_max_tokens(max_tokens);
    sampling.set_temperature(static_cast<float>(o_.temperature));
    sampling.set_ignore_eos(o_.ignore_eos);
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
    v1::GenerateRequest gen;
    v1::ChatRequest chat;
    r.start_s = Since(epoch);
    if (o_.api == "chat") {
      chat.set_model(o_.model);
      for (const Message& m : messages) {
        auto* pm = chat.add_messages();
        pm->set_role(m.role);
        pm->set_content(m.content);
      }
      *chat.mutable_sampling() = sampling;
      if (!o_.speculative.empty()) chat.set_speculative(o_.speculative);
      reader = stub_->Chat(&ctx, chat);
    } else {
      gen.set_model(o_.model);
      gen.set_prompt(FlattenMessages(messages));
      *gen.mutable_sampling() = sampling;
      if (!o_.speculative.empty()) gen.set_speculative(o_.speculative);
      reader = stub_->Generate(&ctx, gen);
    }
    v1::GenerateResponse resp;
    double last_s = 0;
    int tokens = 0;
    while (reader->Read(&resp)) {
      const double now_s = Since(epoch);
      if (resp.token_ids_size() > 0) {
        OnContent(r, now_s, last_s);
        tokens += resp.token_ids_size();
      }
      r.text += resp.text();
      if (resp.has_usage()) {
        r.prompt_tokens = resp.usage().prompt_tokens();
        r.output_tokens = resp.usage().completion_tokens();
        r.cached_tokens = resp.usage().cached_prompt_tokens();
      }
    }
    const grpc::Status status = reader->Finish();
    r.e2e_s = Since(epoch) - r.start_s;
    if (!status.ok()) {
      r.error = status.error_code() == grpc::DEADLINE_EXCEEDED ? "timeout"
                : status.error_code() == grpc::UNAVAILABLE && r.chunks == 0 &&
                        status.error_message().find("connect") != std::string::npos
                    ? "connection"
                    : "grpc_" + CodeName(status.error_code());
      r.error_message = Truncate(status.error_message());
      return r;
    }
    if (r.output_tokens < 0) r.output_tokens = tokens;
    r.ok = true;
    return r;
  }

 private:
  void Prepare(grpc::ClientContext& ctx) const {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)));
    if (!o_.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + o_.api_key);
  }

  std::string address_;
  BackendOptions o_;
  std::unique_ptr<v1::Kvserve::Stub> stub_;
};

}  // namespace

std::string FlattenMessages(const std::vector<Message>& messages) {
  if (messages.size() == 1 && messages[0].role == "user") return messages[0].content;
  std::string out;
  for (const Message& m : messages) out += m.role + ": " + m.content + "\n";
  return out + "assistant:";
}

std::unique_ptr<Backend> MakeHttpBackend(const std::string& base_url, const BackendOptions& o) {
  return std::make_unique<HttpBackend>(base_url, o);
}

std::unique_ptr<Backend> MakeGrpcBackend(const std::string& address, const BackendOptions& o) {
  return std::make_unique<GrpcBackend>(address, o);
}

}  // namespace kvserve::bench
