// Backends for kvserve-bench: send one streamed request and time it.
//
// A Backend is shared by all worker threads; Send() is thread-safe and
// blocks until the stream ends. Times are seconds on the steady clock,
// relative to the caller's epoch, so records from all threads line up.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace kvserve::bench {

using Clock = std::chrono::steady_clock;

struct Message {
  std::string role;
  std::string content;
};

// What one request measured. Token counts are the server's usage when it
// reports them (-1 when it does not).
struct RequestRecord {
  int id = 0;
  int conversation = 0;
  int turn = 0;
  std::string target;  // the server this went to
  bool warmup = false;
  bool ok = false;
  std::string error;          // kind: http_500, grpc_UNAVAILABLE, timeout, connection, stream
  std::string error_message;  // the server's words, truncated
  double start_s = 0;         // since the run's epoch
  double ttft_s = -1;         // first streamed content
  double e2e_s = -1;
  std::vector<double> itl_s;  // gaps between content chunks after the first
  int prompt_tokens = -1;
  int output_tokens = -1;
  int cached_tokens = -1;
  int chunks = 0;    // content chunks seen
  // Times the request was sent again on a fresh connection because a reused
  // kept-alive connection failed before any response byte (the server had
  // closed it; HTTP clients retry such a request once, RFC 9112 9.3.1). The
  // failed attempt is not charged to the server: start_s is the retry's.
  int connection_retries = 0;
  std::string text;  // the reply (multi-turn history needs it)

  // Time per output token after the first; -1 with fewer than 2 tokens.
  double TpotS() const {
    return ok && output_tokens > 1 ? (e2e_s - ttft_s) / (output_tokens - 1) : -1;
  }
};

struct BackendOptions {
  std::string api = "completions";  // completions | chat
  std::string model;                // empty: the server's default / first model
  std::string api_key;
  double timeout_s = 600;
  bool ignore_eos = true;
  bool keep_alive = true;  // HTTP: reuse one connection per worker thread
  double temperature = 0;
  // kvserve's per-request speculative-decoding mode (off, ngram, suffix);
  // empty: not sent (the server's default). Shown in the target's name.
  std::string speculative;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // REQUIRES: messages end with a user message.
  virtual RequestRecord Send(const std::vector<Message>& messages, int max_tokens,
                             Clock::time_point epoch) = 0;
  // Tokens the server counts for `text` (BOS included); -1 if unavailable.
  virtual int CountTokens(const std::string& text) { return -1; }
  virtual std::string Name() const = 0;
};

// OpenAI-compatible HTTP: base_url is http://host:port (a trailing /v1 is
// accepted and dropped).
std::unique_ptr<Backend> MakeHttpBackend(const std::string& base_url, const BackendOptions& o);
// kvserve gRPC: address is host:port. CountTokens calls its Tokenize RPC.
std::unique_ptr<Backend> MakeGrpcBackend(const std::string& address, const BackendOptions& o);

// The completions API takes one text: a lone user message passes as is,
// a conversation is flattened to "role: content" lines.
std::string FlattenMessages(const std::vector<Message>& messages);

}  // namespace kvserve::bench
