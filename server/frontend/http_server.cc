// The OpenAI-compatible HTTP front end on Boost.Beast / Asio.
//
// Threads: `io_threads` threads run one io_context. Each connection is a
// Session on its own strand (so its handlers never run concurrently) and
// costs a socket, a read buffer and a parser, not a thread. Route handlers
// that may block (parsing and tokenizing a completion, clearing the prefix
// cache) run on a handler pool of the same size and answer through the
// Connection interface, which posts to the session's strand.
//
// Engine events arrive on the engine thread, which must never block: each
// completion owns a Call; the sink only appends to the Call's queue and, if
// no pump is pending, posts one to the connection's strand. The pump formats
// JSON / SSE there and queues the bytes for writing. A client that stops
// reading stalls the write; after write_timeout the connection is closed and
// the request cancelled, so its KV blocks go back to the pool.
//
// Pipelined requests are answered in order: the next request is read (from
// the bytes already buffered, if any) only after the previous response is
// written. `Expect: 100-continue` gets its interim 100 before the body is
// read, or 413 without reading it when the announced body is too large.
#include "server/frontend/http_server.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/service/auth.h"
#include "server/observe/metrics.h"
#include "server/frontend/status_map.h"
#include "server/service/admission.h"
#include "server/service/completed_response.h"
#include "server/observe/dashboard.h"
#include "server/frontend/openai_request.h"
#include "server/frontend/openai_response.h"
#include "server/frontend/openai_utility.h"
#include "server/frontend/response_cache_api.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using SteadyTime = std::chrono::steady_clock;
using Request = http::request<http::string_body>;

// How long a stream may stay silent before we write an SSE comment: a failed
// write is how a client that went away is noticed while its request waits in
// the queue or in a long prefill.
constexpr auto kStreamHeartbeat = std::chrono::seconds(2);
// After an error reply that leaves request bytes unread (413, 431), the
// connection keeps reading and discarding for this long before closing, so
// the client reads the reply instead of a reset.
constexpr auto kLingerTime = std::chrono::seconds(2);
// Stop waits this long for cancelled requests to write their last bytes.
constexpr auto kStopGrace = std::chrono::seconds(2);

int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             SteadyTime::now().time_since_epoch())
      .count();
}

// One reply as the routes build it. `headers` carries any extra response
// headers (Content-Type and framing are set by the transport).
struct HttpReply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool close = false;  // close the connection after this reply
};

HttpReply ErrorReply(const ApiError& e) {
  HttpReply r;
  r.status = e.status;
  r.body = ErrorBody(e);
  return r;
}

// A refusal of Authenticator's (401 no or wrong key, 403 a tenant's key on
// an operator's call), OpenAI-shaped.
HttpReply AuthErrorReply(const absl::Status& s) {
  const int status = HttpStatusFor(s.code());
  return ErrorReply({status, std::string(s.message()), "",
                     status == 403 ? "forbidden" : "invalid_api_key"});
}

HttpReply TextReply(int status, std::string body, std::string content_type) {
  HttpReply r;
  r.status = status;
  r.body = std::move(body);
  r.content_type = std::move(content_type);
  return r;
}

// What a route sees of a connection. Every method may be called from any
// thread; each runs on the connection's strand. A route answers an exchange
// with exactly one Send, or StartStream followed by Writes and one End.
class Connection {
 public:
  virtual ~Connection() = default;
  virtual void Send(HttpReply reply) = 0;
  // Status and headers of a streamed body; `heartbeat` is written whenever
  // the stream has been silent for kStreamHeartbeat.
  virtual void StartStream(HttpReply head, std::string heartbeat) = 0;
  virtual void Write(std::string bytes) = 0;
  virtual void End() = 0;
  // Runs `fn` on the strand (never, if the server stops first).
  virtual void Post(std::function<void()> fn) = 0;
  // `fn` runs once if the connection fails before the exchange is complete
  // (client gone, write timeout, server stop); at once if it already has.
  virtual void OnAbort(std::function<void()> fn) = 0;
  // Closes the connection (its exchange aborts).
  virtual void Close() = 0;
  // Closes it if it is still waiting for a request (make room at the limit).
  virtual void CloseIfIdle() = 0;

  // Since when the connection waits for a request's first byte; 0 while an
  // exchange is in progress. Read by the acceptor to pick whom to close.
  std::atomic<int64_t> idle_since{0};
};

// The server-side state Sessions and Calls share, owned by HttpServer::Impl.
struct ServerCore;

// ---------------------------------------------------------------------------
// One completion in flight

// Shared by the engine-thread sink and the connection's strand; outlives
// whichever of them finishes first (a cancelled request's last event may
// arrive after the connection is gone).
struct Call {
  ServerCore* core = nullptr;
  ModelService* service = nullptr;
  // Reset (under mu) when the call finishes or the server stops; read on the
  // strand, and under mu by Push.
  std::shared_ptr<Connection> conn;
  bool stream = false;
  int32_t n = 1;
  uint64_t request_id = 0;
  ResponseMeta meta;
  HttpRequestOptions opts;
  TokenPieceFn piece;
  std::unique_ptr<SseEncoder> encoder;          // streaming
  std::unique_ptr<ResponseAccumulator> result;  // not streaming
  bool finished = false;                        // on the strand

  std::mutex mu;
  std::vector<SeqEvent> events;  // guarded by mu
  bool armed = false;            // guarded by mu; pumps may be posted
  bool pump_posted = false;      // guarded by mu
  bool detached = false;         // guarded by mu; the server stopped: post nothing

  // Engine thread: queue and, if no pump is pending, post one.
  void Push(const SeqEvent& ev, const std::shared_ptr<Call>& self);
  // Strand: allow pumps, and run one for what already arrived.
  void Arm();
  // Strand: turn the queued events into bytes or the final reply.
  void Pump();
};

// ---------------------------------------------------------------------------

struct ServerCore {
  ModelService* service = nullptr;
  HttpServerOptions options;
  Authenticator authenticator{""};  // options' api_key and tenant_keys
  std::unique_ptr<Admission> admission;  // the request path (server/service/admission.h)
  int64_t created = 0;
  net::io_context ioc;
  std::unique_ptr<net::thread_pool> handlers;
  std::unique_ptr<ssl::context> tls;

  std::atomic<int64_t> connections{0};
  std::atomic<bool> stopping{false};

  // Every open connection, to close them on Stop and to find the idle ones
  // at the limit.
  std::mutex sessions_mu;
  std::map<Connection*, std::weak_ptr<Connection>> sessions;  // guarded by sessions_mu

  // Completions in flight, so that Stop can cancel them.
  std::mutex calls_mu;
  std::condition_variable calls_cv;
  std::map<uint64_t, std::shared_ptr<Call>> calls;  // guarded by calls_mu

  // GET /dashboard and its stream (server/observe/dashboard.h).
  std::unique_ptr<DashboardFeed> dashboard;

  Metrics* metrics() const { return service->metrics(); }

  void Register(const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.emplace(c.get(), c);
  }
  void Unregister(Connection* c) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.erase(c);
  }
  // Closes the connection idle the longest; false when none is idle.
  bool CloseOldestIdle() {
    std::shared_ptr<Connection> victim;
    {
      std::lock_guard<std::mutex> lock(sessions_mu);
      int64_t oldest = 0;
      for (auto& [raw, weak] : sessions) {
        const int64_t since = raw->idle_since.load();
        if (since != 0 && (oldest == 0 || since < oldest)) {
          if (auto c = weak.lock()) {
            oldest = since;
            victim = std::move(c);
          }
        }
      }
      // Not picked twice while its close is on the way.
      if (victim) victim->idle_since.store(0);
    }
    if (!victim) return false;
    victim->CloseIfIdle();
    if (Metrics* m = metrics()) m->HttpIdleConnectionEvicted();
    return true;
  }

  void Untrack(uint64_t id) {
    std::lock_guard<std::mutex> lock(calls_mu);
    calls.erase(id);
    if (calls.empty()) calls_cv.notify_all();
  }

  void Route(const std::shared_ptr<Connection>& conn, Request req);
  void RouteDashboard(const std::shared_ptr<Connection>& conn, const Request& req,
                      const std::string& path, http::verb method);
  void HandleCompletion(const std::shared_ptr<Connection>& conn, std::string body, bool chat,
                        CallerAuth auth = {});
  std::string ModelJson() const;
};

void Call::Push(const SeqEvent& ev, const std::shared_ptr<Call>& self) {
  std::lock_guard<std::mutex> lock(mu);
  events.push_back(ev);
  if (!armed || pump_posted || detached || !conn) return;
  pump_posted = true;
  conn->Post([self] { self->Pump(); });
}

void Call::Arm() {
  {
    std::lock_guard<std::mutex> lock(mu);
    armed = true;
    if (events.empty() || pump_posted) return;
    pump_posted = true;
  }
  Pump();
}

void Call::Pump() {
  std::vector<SeqEvent> batch;
  {
    std::lock_guard<std::mutex> lock(mu);
    batch.swap(events);
    pump_posted = false;
  }
  if (finished || !conn) return;
  if (stream) {
    std::string out = encoder->Add(batch);
    if (!out.empty()) conn->Write(std::move(out));
    if (!encoder->finished()) return;
    if (encoder->aborted()) service->Cancel(request_id);  // the other samples, if any
    conn->End();
  } else {
    for (const SeqEvent& ev : batch) result->Add(ev);
    if (!result->done()) return;
    const CompletedResponse done = result->Take();
    if (done.aborted()) {
      // Only the server cancels a non-streaming request (drain or Stop):
      // the client should retry elsewhere, which 503 says.
      conn->Send(ErrorReply({503, "the request was cancelled: the server is shutting down", "",
                             ""}));
    } else {
      HttpReply r;
      r.body = CompletionBody(meta, opts, done, piece);
      if (meta.cache) r.headers.emplace_back(kCacheHeader, CacheHitKindName(meta.cache->kind));
      conn->Send(std::move(r));
    }
  }
  finished = true;
  {
    std::lock_guard<std::mutex> lock(mu);  // Push reads conn on the engine thread
    conn.reset();
  }
  core->Untrack(request_id);
}

// ---------------------------------------------------------------------------
// Sessions

template <typename Stream>
class Session : public Connection, public std::enable_shared_from_this<Session<Stream>> {
 public:
  Session(ServerCore* core, Stream stream, bool reject)
      : core_(core), stream_(std::move(stream)), reject_(reject), heartbeat_timer_(Executor()) {
    if (Metrics* m = core_->metrics()) {
      if (reject_) {
        m->HttpConnectionRefused();
      } else {
        m->HttpConnectionOpened();
      }
    }
  }

  ~Session() override {
    core_->Unregister(this);
    if (!reject_) {
      core_->connections.fetch_sub(1);
      if (Metrics* m = core_->metrics()) m->HttpConnectionClosed();
    }
  }

  void Run() {
    if (reject_) {
      HttpReply r = ErrorReply({503,
                                absl::StrCat("too many connections (--max-connections ",
                                             core_->options.max_connections, ")"),
                                "", "too_many_connections"});
      r.close = true;
      head_request_ = false;
      version_ = 11;
      exchange_ = true;
      linger_ = true;  // the client's request bytes stay unread
      return DoSend(std::move(r));
    }
    if constexpr (kTls) {
      Lowest().expires_after(core_->options.header_timeout);
      stream_.async_handshake(ssl::stream_base::server,
                              [self = Self()](beast::error_code ec) {
                                if (ec) return self->Fail(ec, "tls handshake");
                                self->WaitForRequest();
                              });
    } else {
      WaitForRequest();
    }
  }

  void Send(HttpReply reply) override {
    net::dispatch(Executor(), [self = Self(), r = std::move(reply)]() mutable {
      self->DoSend(std::move(r));
    });
  }
  void StartStream(HttpReply head, std::string heartbeat) override {
    net::dispatch(Executor(), [self = Self(), h = std::move(head),
                               hb = std::move(heartbeat)]() mutable {
      self->DoStartStream(std::move(h), std::move(hb));
    });
  }
  void Write(std::string bytes) override {
    net::dispatch(Executor(), [self = Self(), b = std::move(bytes)]() mutable {
      if (self->closed_ || !self->streaming_) return;
      self->pending_ += b;
      self->Flush();
    });
  }
  void End() override {
    net::dispatch(Executor(), [self = Self()] {
      if (self->closed_ || !self->streaming_) return;
      self->end_pending_ = true;
      self->Flush();
    });
  }
  void Post(std::function<void()> fn) override { net::post(Executor(), std::move(fn)); }
  void OnAbort(std::function<void()> fn) override {
    net::dispatch(Executor(), [self = Self(), f = std::move(fn)]() mutable {
      if (self->closed_) return f();
      if (self->exchange_) self->on_abort_ = std::move(f);
    });
  }
  void Close() override {
    net::dispatch(Executor(), [self = Self()] { self->Shut(); });
  }
  void CloseIfIdle() override {
    net::dispatch(Executor(), [self = Self()] {
      if (!self->exchange_) self->Shut();  // still waiting for a request
    });
  }

 private:
  static constexpr bool kTls = !std::is_same_v<Stream, beast::tcp_stream>;

  std::shared_ptr<Session> Self() { return this->shared_from_this(); }
  auto Executor() { return beast::get_lowest_layer(stream_).get_executor(); }
  beast::tcp_stream& Lowest() { return beast::get_lowest_layer(stream_); }

  // --- reading -------------------------------------------------------------

  void WaitForRequest() {
    if (closed_) return;
    exchange_ = false;
    if (buffer_.size() > 0) return ReadHeader();  // a pipelined request is already here
    buffer_.shrink_to_fit();  // an idle connection keeps no buffer (a large body's included)
    idle_since.store(NowNanos());
    if constexpr (kTls) {
      // TLS may hold a decrypted record already: read through the stream.
      Lowest().expires_after(core_->options.idle_timeout);
      stream_.async_read_some(buffer_.prepare(4096),
                              [self = Self()](beast::error_code ec, size_t n) {
                                self->idle_since.store(0);
                                if (ec) return self->Fail(ec, "");
                                self->buffer_.commit(n);
                                self->ReadHeader();
                              });
    } else {
      // Wait for readability without a buffer, so that ten thousand idle
      // connections cost sockets, not read buffers; the timer closes it.
      heartbeat_timer_.expires_after(core_->options.idle_timeout);
      heartbeat_timer_.async_wait([self = Self()](beast::error_code ec) {
        if (!ec && self->idle_since.load() != 0 && !self->exchange_) {
          self->CountTimeout();
          self->Shut();
        }
      });
      Lowest().socket().async_wait(tcp::socket::wait_read, [self = Self()](beast::error_code ec) {
        self->heartbeat_timer_.cancel();
        self->idle_since.store(0);
        if (ec || self->closed_) return self->Fail(ec, "");
        self->ReadHeader();
      });
    }
  }

  void ReadHeader() {
    if (closed_) return;
    idle_since.store(0);
    exchange_ = true;
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(
        std::clamp<int64_t>(core_->options.max_header_bytes, 256, UINT32_MAX)));
    parser_->body_limit(static_cast<std::uint64_t>(
        std::max<int64_t>(core_->options.max_request_bytes, 0)));
    Lowest().expires_after(core_->options.header_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = Self()](beast::error_code ec, size_t) {
                              self->OnHeader(ec);
                            });
  }

  void OnHeader(beast::error_code ec) {
    if (ec == http::error::header_limit) {
      return RefuseAndLinger(431, absl::StrCat("the request headers are larger than "
                                               "--http-max-header-bytes (",
                                               core_->options.max_header_bytes, " bytes)"),
                             "headers_too_large");
    }
    if (ec == http::error::body_limit) return RefuseTooLarge();
    if (ec) return FailRead(ec);
    const Request& req = parser_->get();
    version_ = req.version();
    head_request_ = req.method() == http::verb::head;
    if (req.method() == http::verb::post && !req.has_content_length() && !req.chunked()) {
      // A POST whose body length is unknown (curl -X POST without -d sends none).
      return RefuseAndLinger(400,
                             "a POST needs a Content-Length header; send an empty body for none "
                             "(curl -d '')",
                             "");
    }
    const auto expect = req[http::field::expect];
    if (!expect.empty()) {
      if (!beast::iequals(expect, "100-continue")) {
        return RefuseAndLinger(417, absl::StrCat("unsupported Expect: ", std::string(expect)), "");
      }
      if (!parser_->is_done() && version_ >= 11) {
        // RFC 9110 10.1.1: the interim response invites the body.
        auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_,
                                                                       version_);
        Lowest().expires_after(core_->options.write_timeout);
        return http::async_write(stream_, *cont,
                                 [self = Self(), cont](beast::error_code ec, size_t n) {
                                   self->bytes_out_ += n;
                                   if (ec) return self->Fail(ec, "");
                                   self->ReadBody();
                                 });
      }
    }
    if (parser_->is_done()) return Dispatch();
    ReadBody();
  }

  void ReadBody() {
    Lowest().expires_after(core_->options.body_timeout);
    http::async_read(stream_, buffer_, *parser_, [self = Self()](beast::error_code ec, size_t) {
      if (ec == http::error::body_limit) return self->RefuseTooLarge();
      if (ec) return self->FailRead(ec);
      self->Dispatch();
    });
  }

  // A read failed mid-request: a malformed request gets 400, a peer that
  // went quiet or away is just closed.
  void FailRead(beast::error_code ec) {
    if (ec == beast::error::timeout || ec == http::error::end_of_stream ||
        ec == net::error::eof || ec == net::error::connection_reset ||
        ec == net::error::operation_aborted || ec == http::error::partial_message) {
      return Fail(ec, "");
    }
    if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
      return RefuseAndLinger(400, absl::StrCat("malformed HTTP request: ", ec.message()), "");
    }
    Fail(ec, "");
  }

  void RefuseTooLarge() {
    RefuseAndLinger(413,
                    absl::StrCat("the request body is larger than max_request_bytes (",
                                 core_->options.max_request_bytes, " bytes)"),
                    "request_too_large");
  }

  void RefuseAndLinger(int status, std::string message, std::string code) {
    if (closed_) return;
    exchange_ = true;
    if (version_ == 0) version_ = 11;
    HttpReply r = ErrorReply({status, std::move(message), "", std::move(code)});
    r.close = true;
    linger_ = true;
    DoSend(std::move(r));
  }

  void Dispatch() {
    Lowest().expires_never();
    keep_alive_ = parser_->get().keep_alive();
    Request req = parser_->release();
    parser_.reset();
    core_->Route(Self(), std::move(req));
  }

  // --- writing -------------------------------------------------------------

  template <typename Body>
  void PrepareHead(http::response<Body>& res, const HttpReply& r) {
    res.version(version_);
    res.result(static_cast<unsigned>(r.status));
    res.set(http::field::server, "kvserve");
    res.set(http::field::content_type, r.content_type);
    for (const auto& [name, value] : r.headers) res.set(name, value);
    if (r.status == 401) res.set(http::field::www_authenticate, "Bearer");
    res.keep_alive(keep_alive_ && !r.close && !core_->stopping.load());
  }

  void DoSend(HttpReply r) {
    if (closed_ || !exchange_ || responding_) return;
    responding_ = true;
    on_abort_ = nullptr;  // the request is over; only its reply is left to write
    auto res = std::make_shared<http::response<http::string_body>>();
    PrepareHead(*res, r);
    close_after_ = !res->keep_alive();
    const size_t size = r.body.size();
    if (!head_request_) res->body() = std::move(r.body);
    res->content_length(size);
    Lowest().expires_after(core_->options.write_timeout);
    http::async_write(stream_, *res, [self = Self(), res](beast::error_code ec, size_t n) {
      self->bytes_out_ += n;
      if (ec) return self->Fail(ec, "write");
      self->FinishExchange();
    });
  }

  void DoStartStream(HttpReply head, std::string heartbeat) {
    if (closed_ || !exchange_ || responding_) return;
    responding_ = true;
    streaming_ = true;
    heartbeat_ = std::move(heartbeat);
    auto res = std::make_shared<http::response<http::empty_body>>();
    PrepareHead(*res, head);
    chunked_ = version_ >= 11;
    if (chunked_) {
      res->chunked(true);
    } else {
      res->keep_alive(false);  // HTTP/1.0: the body ends when the connection does
    }
    close_after_ = !res->keep_alive();
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    writing_ = true;
    Lowest().expires_after(core_->options.write_timeout);
    http::async_write_header(stream_, *sr, [self = Self(), res, sr](beast::error_code ec, size_t n) {
      self->writing_ = false;
      self->bytes_out_ += n;
      if (ec) return self->Fail(ec, "write");
      self->last_write_ = SteadyTime::now();
      self->progress_at_ = self->last_write_;
      self->ArmHeartbeat();
      self->Flush();
    });
  }

  void Flush() {
    if (closed_ || writing_ || !streaming_) return;
    if (!pending_.empty()) {
      auto data = std::make_shared<std::string>(std::move(pending_));
      pending_.clear();
      writing_ = true;
      Lowest().expires_after(core_->options.write_timeout);
      auto done = [self = Self(), data](beast::error_code ec, size_t n) {
        self->writing_ = false;
        self->bytes_out_ += n;
        if (ec == beast::error::timeout) return self->DisconnectStalledReader();
        if (ec) return self->Fail(ec, "write");
        self->last_write_ = SteadyTime::now();
        self->Flush();
      };
      if (chunked_) {
        net::async_write(stream_, http::make_chunk(net::buffer(*data)), std::move(done));
      } else {
        net::async_write(stream_, net::buffer(*data), std::move(done));
      }
      return;
    }
    if (!end_pending_) return;
    streaming_ = false;
    heartbeat_timer_.cancel();
    on_abort_ = nullptr;
    if (!chunked_) return FinishExchange();
    writing_ = true;
    Lowest().expires_after(core_->options.write_timeout);
    net::async_write(stream_, http::make_chunk_last(), [self = Self()](beast::error_code ec,
                                                                       size_t n) {
      self->writing_ = false;
      self->bytes_out_ += n;
      if (ec == beast::error::timeout) return self->DisconnectStalledReader();
      if (ec) return self->Fail(ec, "write");
      self->FinishExchange();
    });
  }

  // The stream's timer: writes the heartbeat after kStreamHeartbeat of
  // silence, and notices a client that stopped reading. The kernel's send
  // buffer (megabytes on loopback) takes our writes long after the client
  // stopped, so a stalled write alone would come too late: on plain TCP the
  // bytes the peer acknowledged (what we wrote minus SIOCOUTQ, the unacked
  // and unsent bytes) must grow within write_timeout while any are queued.
  void ArmHeartbeat() {
    const auto tick = std::clamp<std::chrono::milliseconds>(
        core_->options.write_timeout / 4, std::chrono::milliseconds(100),
        std::chrono::milliseconds(1000));
    heartbeat_timer_.expires_after(tick);
    heartbeat_timer_.async_wait([self = Self()](beast::error_code ec) {
      if (ec || self->closed_ || !self->streaming_) return;
      const auto now = SteadyTime::now();
      if constexpr (!kTls) {
        int outq = 0;
        if (::ioctl(self->Lowest().socket().native_handle(), SIOCOUTQ, &outq) == 0) {
          const uint64_t acked = self->bytes_out_ - static_cast<uint64_t>(std::max(outq, 0));
          if (outq == 0 || acked != self->acked_seen_) {
            self->acked_seen_ = acked;
            self->progress_at_ = now;
          } else if (now - self->progress_at_ >= self->core_->options.write_timeout) {
            return self->DisconnectStalledReader();
          }
        }
      }
      if (!self->writing_ && self->pending_.empty() && !self->end_pending_ &&
          now - self->last_write_ >= kStreamHeartbeat) {
        self->pending_ = self->heartbeat_;
        self->Flush();
      }
      self->ArmHeartbeat();
    });
  }

  // A client that stopped reading its stream: the heartbeat saw no bytes
  // acknowledged for write_timeout, or a write of the stream could not finish
  // within it (on a busy machine the heartbeat's tick can come after the
  // write's own timer). Either way one stalled reader, and the close cancels
  // the request.
  void DisconnectStalledReader() {
    if (closed_) return;
    spdlog::info("http: a client stopped reading its stream for {} ms; disconnecting",
                 core_->options.write_timeout.count());
    if (Metrics* m = core_->metrics()) m->HttpStalledReaderDisconnected();
    Shut();
  }

  void FinishExchange() {
    responding_ = false;
    streaming_ = false;
    end_pending_ = false;
    chunked_ = false;
    on_abort_ = nullptr;
    exchange_ = false;
    if (close_after_ || core_->stopping.load()) {
      if (linger_) return Linger();
      return Shut();
    }
    WaitForRequest();
  }

  // Half-closes, then reads and discards until the peer closes or
  // kLingerTime passes, so our last reply is not lost to a reset.
  void Linger() {
    if constexpr (kTls) {
      return Shut();
    } else {
      beast::error_code ignored;
      Lowest().socket().shutdown(tcp::socket::shutdown_send, ignored);
      if (!linger_deadline_set_) {
        linger_deadline_set_ = true;
        Lowest().expires_after(kLingerTime);
      }
      auto scratch = std::make_shared<std::array<char, 4096>>();
      Lowest().async_read_some(net::buffer(*scratch),
                               [self = Self(), scratch](beast::error_code ec, size_t) {
                                 if (ec) return self->Shut();
                                 self->Linger();
                               });
    }
  }

  // --- closing -------------------------------------------------------------

  void CountTimeout() {
    if (Metrics* m = core_->metrics()) m->HttpConnectionTimedOut();
  }

  void Fail(beast::error_code ec, const char* what) {
    if (ec == beast::error::timeout && !closed_) CountTimeout();
    if (ec && *what != '\0' && ec != net::error::operation_aborted &&
        ec != beast::error::timeout && ec != net::error::broken_pipe &&
        ec != net::error::connection_reset) {
      spdlog::debug("http: {} failed: {}", what, ec.message());
    }
    Shut();
  }

  void Shut() {
    if (closed_) return;
    closed_ = true;
    idle_since.store(0);
    heartbeat_timer_.cancel();
    beast::error_code ignored;
    Lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
    Lowest().close();
    if (on_abort_) {
      auto f = std::move(on_abort_);
      on_abort_ = nullptr;
      f();
    }
  }

  ServerCore* core_;
  Stream stream_;
  const bool reject_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  net::steady_timer heartbeat_timer_;
  std::function<void()> on_abort_;
  unsigned version_ = 0;
  bool head_request_ = false;
  bool keep_alive_ = true;
  bool exchange_ = false;    // a request was read (or is being read) and not yet answered
  bool responding_ = false;  // Send or StartStream was called for it
  bool streaming_ = false;
  bool chunked_ = false;
  bool writing_ = false;
  bool end_pending_ = false;
  bool close_after_ = false;
  bool linger_ = false;
  bool linger_deadline_set_ = false;
  bool closed_ = false;
  std::string pending_;    // stream bytes not yet written
  std::string heartbeat_;
  SteadyTime::time_point last_write_ = SteadyTime::now();
  uint64_t bytes_out_ = 0;   // written to the socket (plain TCP: what the kernel took)
  uint64_t acked_seen_ = 0;  // bytes_out_ - SIOCOUTQ at the last progress
  SteadyTime::time_point progress_at_ = SteadyTime::now();
};

using PlainSession = Session<beast::tcp_stream>;
using TlsSession = Session<beast::ssl_stream<beast::tcp_stream>>;

// ---------------------------------------------------------------------------
// Routes

std::string ServerCore::ModelJson() const {
  const ModelInfo info = service->Info();
  return json{{"id", info.name},
              {"object", "model"},
              {"created", created},
              {"owned_by", "kvserve"},
              {"max_model_len", info.config.context_length}}
      .dump();
}

void ServerCore::Route(const std::shared_ptr<Connection>& conn, Request req) {
  std::string path(req.target());
  if (size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  const http::verb method = req.method() == http::verb::head ? http::verb::get : req.method();

  if (path == "/dashboard" || path.rfind("/dashboard/", 0) == 0) {
    return RouteDashboard(conn, req, path, method);
  }
  // Who calls: the operator (--api-key, or anyone without keys) or, with
  // tenant keys, the tenant its key names (server/service/tenants.h).
  CallerAuth auth;
  const std::string_view authorization(req[http::field::authorization]);
  // Probes and (with --metrics-auth none) the Prometheus scrape need no key.
  const bool open_path = path == "/health" || path == "/health/live" ||
                         (options.metrics_without_key && path == "/metrics" &&
                          method == http::verb::get);
  // /admin/ calls other than /admin/cache/ take the operator's key.
  const bool admin_only = path.rfind("/admin/", 0) == 0 && path.rfind("/admin/cache/", 0) != 0;
  if (absl::StatusOr<CallerAuth> caller = authenticator.Check(authorization, admin_only);
      caller.ok()) {
    auth = *std::move(caller);
  } else if (!open_path) {
    return conn->Send(AuthErrorReply(caller.status()));
  }
  if (method == http::verb::get) {
    // Liveness: the process answers (restart it only when this fails).
    if (path == "/health/live") return conn->Send(TextReply(200, "alive", "text/plain"));
    if (path == "/health") {
      // Load balancers take a draining server out of rotation on 503.
      if (service->draining()) return conn->Send(TextReply(503, "draining", "text/plain"));
      return conn->Send(TextReply(200, "ok", "text/plain"));
    }
    if (path == "/metrics") {
      std::string text = service->metrics()->Render(service->Stats());
      if (service->cache_control() != nullptr) text += RenderCacheControlMetrics(service->cache_control()->stats());
      return conn->Send(TextReply(200, std::move(text), "text/plain; version=0.0.4"));
    }
    if (path == "/admin/cache/list" && options.cache_control != nullptr) {
      return net::post(*handlers, [this, conn, auth] {
        JsonReply r = options.cache_control->Handle("list", "", auth);
        conn->Send(TextReply(r.status, r.body.dump(-1, ' ', false, json::error_handler_t::replace),
                             "application/json"));
      });
    }
    if (path == "/v1/models") {
      return conn->Send(TextReply(
          200, absl::StrCat(R"({"object":"list","data":[)", ModelJson(), "]}"),
          "application/json"));
    }
    constexpr std::string_view kModelPrefix = "/v1/models/";
    if (path.size() > kModelPrefix.size() && path.compare(0, kModelPrefix.size(), kModelPrefix) == 0) {
      const std::string name = path.substr(kModelPrefix.size());
      if (name != service->model_name()) {
        return conn->Send(ErrorReply(
            {404, absl::StrCat("model '", name, "' does not exist"), "model", "model_not_found"}));
      }
      return conn->Send(TextReply(200, ModelJson(), "application/json"));
    }
  } else if (method == http::verb::post) {
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      const bool chat = path == "/v1/chat/completions";
      // Parsing and tokenizing a long prompt takes a while: off the I/O threads.
      return net::post(*handlers, [this, conn, body = std::move(req.body()), chat, auth]() mutable {
        HandleCompletion(conn, std::move(body), chat, auth);
      });
    }
    // Issue 44: embeddings (the semantic cache's encoder) and vLLM's
    // tokenize / detokenize; the encoder runs off the I/O threads.
    if (path == "/v1/embeddings" || path == "/tokenize" || path == "/detokenize") {
      return net::post(*handlers, [this, conn, path, body = std::move(req.body())] {
        const UtilityReply r =
            path == "/v1/embeddings"
                ? EmbeddingsHttp(options.embedder, options.embedding_model, body)
            : path == "/tokenize" ? TokenizeHttp(service, body)
                                  : DetokenizeHttp(service, body);
        conn->Send(TextReply(r.status, r.body, "application/json"));
      });
    }
    constexpr std::string_view kCachePrefix = "/admin/cache/";
    if (path.size() > kCachePrefix.size() && path.compare(0, kCachePrefix.size(), kCachePrefix) == 0) {
      // Admin: cache control (server/service/cache_control_service.h); waits for the
      // engine, so it runs on the handler pool.
      if (options.cache_control == nullptr) {
        return conn->Send(ErrorReply({409, "cache control needs the prefix cache (drop --no-prefix-cache)",
                                      "", "prefix_cache_disabled"}));
      }
      return net::post(*handlers, [this, conn, auth, op = path.substr(kCachePrefix.size()),
                                   body = std::move(req.body())] {
        JsonReply r = options.cache_control->Handle(op, body, auth);
        // explain quotes detokenized prompt pieces, which may cut a UTF-8
        // character: replaced, never a throw on the handler thread.
        conn->Send(TextReply(r.status, r.body.dump(-1, ' ', false, json::error_handler_t::replace),
                             "application/json"));
      });
    }
    if (path == "/admin/response_cache/purge") {
      // Admin: purges the response cache (server/frontend/response_cache_api.h).
      return net::post(*handlers, [this, conn, body = std::move(req.body())] {
        PurgeAnswer a = PurgeResponseCacheHttp(service, admission->operator_scope(), body);
        conn->Send(TextReply(a.status, a.body.dump(), "application/json"));
      });
    }
    if (path == "/admin/clear_prefix_cache") {
      // Admin: empties the prefix cache. Waits for the engine's next step,
      // so it runs on the handler pool.
      return net::post(*handlers, [this, conn] {
        absl::StatusOr<int32_t> cleared = service->ClearPrefixCache();
        if (!cleared.ok()) {
          ApiError e = ApiErrorFromStatus(cleared.status());
          if (cleared.status().code() == absl::StatusCode::kFailedPrecondition) {
            // The request is fine; the server's configuration does not allow it.
            e.status = 409;
            e.code = "prefix_cache_disabled";
            e.param.clear();
          }
          return conn->Send(ErrorReply(e));
        }
        conn->Send(TextReply(200, json{{"blocks_cleared", *cleared}}.dump(), "application/json"));
      });
    }
  }
  conn->Send(ErrorReply({404,
                         absl::StrCat("no route for ", std::string(req.method_string()), " ",
                                      path),
                         "", "not_found"}));
}

// The dashboard: the page, one snapshot, and the stream of snapshots. The
// API-key rule is /metrics's; a browser that navigates here without the key
// gets the key form as the 401's body (it holds no data).
void ServerCore::RouteDashboard(const std::shared_ptr<Connection>& conn, const Request& req,
                                const std::string& path, http::verb method) {
  if (!BearerTokenMatches(std::string_view(req[http::field::authorization]), options.api_key)) {
    if (path == "/dashboard" && method == http::verb::get) {
      HttpReply r = TextReply(401, std::string(DashboardLoginHtml()), "text/html; charset=utf-8");
      r.headers.emplace_back("Cache-Control", "no-store");
      return conn->Send(std::move(r));
    }
    return conn->Send(AuthErrorReply(
        Authenticator(options.api_key).Check(req[http::field::authorization], true).status()));
  }
  if (method != http::verb::get || !dashboard) {
    return conn->Send(ErrorReply(
        {method != http::verb::get ? 405 : 404,
         absl::StrCat("no route for ", std::string(req.method_string()), " ", path), "",
         method != http::verb::get ? "method_not_allowed" : "not_found"}));
  }
  if (path == "/dashboard") {
    HttpReply r = TextReply(200, std::string(DashboardPageHtml()), "text/html; charset=utf-8");
    r.headers.emplace_back("Cache-Control", "no-store");
    // Everything the page needs is in it: no other origin may serve it code.
    r.headers.emplace_back("Content-Security-Policy",
                           "default-src 'none'; script-src 'unsafe-inline'; style-src "
                           "'unsafe-inline'; connect-src 'self'; img-src 'self' data:");
    return conn->Send(std::move(r));
  }
  if (path == "/dashboard/snapshot") {
    HttpReply r = TextReply(200, dashboard->SnapshotJson(), "application/json");
    r.headers.emplace_back("Cache-Control", "no-store");
    return conn->Send(std::move(r));
  }
  if (path == "/dashboard/events") {
    if (dashboard->num_subscribers() >= dashboard->max_subscribers()) {
      return conn->Send(ErrorReply(
          {503, absl::StrCat("too many dashboard viewers (", dashboard->max_subscribers(), ")"),
           "", "too_many_viewers"}));
    }
    HttpReply head;
    head.content_type = "text/event-stream";
    head.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
    conn->StartStream(std::move(head), ": ping\n\n");
    const int64_t id =
        dashboard->Subscribe([conn](const std::string& event) { conn->Write(event); });
    if (id < 0) {  // lost a race for the last place
      conn->Write("event: error\ndata: {\"error\":\"too many dashboard viewers\"}\n\n");
      return conn->End();
    }
    DashboardFeed* feed = dashboard.get();
    conn->OnAbort([feed, id] { feed->Unsubscribe(id); });
    return;
  }
  conn->Send(ErrorReply({404, absl::StrCat("no route for GET ", path), "", "not_found"}));
}

void ServerCore::HandleCompletion(const std::shared_ptr<Connection>& conn, std::string body,
                                  bool chat, CallerAuth auth) {
  OpenAiRequest parsed;
  if (auto err = ParseOpenAiRequest(body, chat, &parsed)) return conn->Send(ErrorReply(*err));
  const CompletionParams& params = parsed.params;
  const HttpRequestOptions& opts = parsed.options;
  // Scope, validate, report: server/service/admission.h.
  absl::StatusOr<PreparedRequest> prepared = admission->Prepare(params, auth);
  if (!prepared.ok()) {
    ApiError e = ApiErrorFromStatus(prepared.status());
    if (e.param == "max_tokens" && opts.max_completion_tokens_alias) {
      e.param = "max_completion_tokens";
    }
    return conn->Send(ErrorReply(e));
  }

  auto call = std::make_shared<Call>();
  call->core = this;
  call->service = service;
  call->conn = conn;
  call->stream = opts.stream;
  call->n = prepared->engine.n;
  call->opts = opts;
  call->meta = ResponseMeta::New(chat, service->model_name());
  call->meta.cache_notes = prepared->notes;
  // The policy the request runs with (its own or the server's default).
  call->meta.kv_policy = prepared->engine.kv_policy.kind != KvPolicy::Kind::kNone;
  if (opts.echo) {
    if (params.prompt_text) {
      call->meta.echo_text = *params.prompt_text;
    } else if (params.prompt_ids) {
      call->meta.echo_text = service->Detokenize(*params.prompt_ids).value_or("");
    }
  }
  ModelService* svc = service;
  call->piece = [svc](int32_t t) {
    absl::StatusOr<std::string> p = svc->Detokenize({t});
    return p.ok() ? *p : std::string();
  };
  const int32_t prompt_tokens = prepared->prompt_tokens;
  if (call->stream) {
    call->encoder =
        std::make_unique<SseEncoder>(call->meta, opts, call->n, prompt_tokens, call->piece);
  } else {
    call->result = std::make_unique<ResponseAccumulator>(call->n, prompt_tokens);
  }

  CacheOutcome cache;
  // The encoder and accumulator exist already; the cache's verdict reaches
  // the encoder through its meta below, before any event is encoded (events
  // wait for Arm on the connection's strand).
  absl::StatusOr<uint64_t> started = admission->Start(
      std::move(prepared).value(),
      [call](const SeqEvent& ev) {
        call->Push(ev, call);  // engine thread: hand over and return at once
      },
      &cache);
  if (!started.ok()) return conn->Send(ErrorReply(ApiErrorFromStatus(started.status())));
  if (cache.kind != CacheHitKind::kOff) {
    call->meta.cache = cache;
    if (call->encoder) call->encoder->set_cache(cache);
  }
  call->request_id = *started;
  {
    // Registering and checking under one lock: either Stop sees this call
    // or we see Stop.
    std::lock_guard<std::mutex> lock(calls_mu);
    calls.emplace(call->request_id, call);
    if (stopping.load()) service->Cancel(call->request_id);
  }
  const uint64_t request_id = call->request_id;
  conn->OnAbort([svc, request_id] { svc->Cancel(request_id); });
  conn->Post([call] {
    if (call->stream && call->conn) {
      HttpReply head;
      head.content_type = "text/event-stream";
      head.headers = {{"Cache-Control", "no-cache"},
                      {"X-Accel-Buffering", "no"}};  // proxies must not hold the stream back
      if (call->meta.cache) {
        head.headers.emplace_back(kCacheHeader, CacheHitKindName(call->meta.cache->kind));
      }
      call->conn->StartStream(std::move(head), SseEncoder::Heartbeat());
      std::string open = call->encoder->Open();
      if (!open.empty()) call->conn->Write(std::move(open));
    }
    call->Arm();
  });
}

// ---------------------------------------------------------------------------
// Accepting

class Acceptor : public std::enable_shared_from_this<Acceptor> {
 public:
  Acceptor(ServerCore* core, tcp::acceptor acceptor)
      : core_(core), acceptor_(std::move(acceptor)), retry_(acceptor_.get_executor()) {}

  void Accept() {
    acceptor_.async_accept(net::make_strand(core_->ioc),
                           [self = shared_from_this()](beast::error_code ec, tcp::socket s) {
                             self->OnAccept(ec, std::move(s));
                           });
  }

  void Close() {
    net::dispatch(acceptor_.get_executor(), [self = shared_from_this()] {
      beast::error_code ignored;
      self->acceptor_.close(ignored);
      self->retry_.cancel();
    });
  }

 private:
  void OnAccept(beast::error_code ec, tcp::socket socket) {
    if (!acceptor_.is_open() || core_->stopping.load()) return;
    if (ec) {
      // Out of file descriptors (or a transient error): back off briefly
      // rather than spin; the pending connections wait in the backlog.
      if (ec != net::error::operation_aborted) {
        spdlog::warn("http: accept failed: {}", ec.message());
      }
      retry_.expires_after(std::chrono::milliseconds(50));
      retry_.async_wait([self = shared_from_this()](beast::error_code e) {
        if (!e) self->Accept();
      });
      return;
    }
    beast::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);  // streamed tokens are small writes
    bool reject = false;
    if (core_->connections.load() >= core_->options.max_connections &&
        !core_->CloseOldestIdle()) {
      reject = true;
    }
    if (reject && core_->tls) {
      // No handshake for a refused TLS client: accept-and-close.
      socket.close(ignored);
      return Accept();
    }
    if (!reject) core_->connections.fetch_add(1);
    std::shared_ptr<Connection> session;
    if (core_->tls) {
      auto s = std::make_shared<TlsSession>(
          core_, beast::ssl_stream<beast::tcp_stream>(beast::tcp_stream(std::move(socket)),
                                                       *core_->tls),
          reject);
      session = s;
      core_->Register(session);
      s->Run();
    } else {
      auto s = std::make_shared<PlainSession>(core_, beast::tcp_stream(std::move(socket)), reject);
      session = s;
      core_->Register(session);
      s->Run();
    }
    Accept();
  }

  ServerCore* core_;
  tcp::acceptor acceptor_;
  net::steady_timer retry_;
};

// Raises the soft open-file limit to the hard one: each connection is a
// descriptor, and the usual soft limit (1024) is far below what an
// event-driven server holds.
void RaiseFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) return;
  lim.rlim_cur = lim.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &lim) != 0) spdlog::warn("http: cannot raise the open-file limit");
}

}  // namespace

// ---------------------------------------------------------------------------

struct HttpServer::Impl {
  ServerCore core;
  std::shared_ptr<Acceptor> acceptor;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  int port = 0;
  bool stopped = false;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(ModelService* service,
                                                               const HttpServerOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key must be given together");
  }
  if (options.io_threads < 1) return absl::InvalidArgumentError("http io_threads must be >= 1");
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError("max_connections must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  ServerCore& core = impl->core;
  core.service = service;
  core.options = options;
  core.authenticator = Authenticator(options.api_key, options.tenant_keys);
  core.admission = std::make_unique<Admission>(service, options.api_key, options.cache_control);
  core.created = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  if (!options.tls_cert.empty()) {
    auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
    beast::error_code ec;
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                         ssl::context::no_sslv3 | ssl::context::no_tlsv1 |
                         ssl::context::no_tlsv1_1,
                     ec);
    if (!ec) ctx->use_certificate_chain_file(options.tls_cert, ec);
    if (!ec) ctx->use_private_key_file(options.tls_key, ssl::context::pem, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("tls_cert/tls_key: cannot load ",
                                                     options.tls_cert, " and ", options.tls_key,
                                                     ": ", ec.message()));
    }
    core.tls = std::move(ctx);
  }
  RaiseFileLimit();

  beast::error_code ec;
  const net::ip::address address = net::ip::make_address(
      options.host == "localhost" ? "127.0.0.1" : options.host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: bad listen host '", options.host, "': ", ec.message()));
  }
  tcp::acceptor acceptor(net::make_strand(core.ioc));
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(options.port));
  acceptor.open(endpoint.protocol(), ec);
  // SO_REUSEADDR allows a quick restart; SO_REUSEPORT is left off so that a
  // second daemon cannot bind the same port and silently take half the traffic.
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", options.host, ":",
                                               options.port, ": ", ec.message()));
  }
  impl->port = acceptor.local_endpoint().port();
  core.dashboard = std::make_unique<DashboardFeed>(service, DashboardFeed::Options{});
  core.handlers = std::make_unique<net::thread_pool>(options.io_threads);
  impl->acceptor = std::make_shared<Acceptor>(&core, std::move(acceptor));
  impl->acceptor->Accept();
  impl->work.emplace(net::make_work_guard(core.ioc));
  for (int i = 0; i < options.io_threads; ++i) {
    impl->threads.emplace_back([&core] { core.ioc.run(); });
  }
  spdlog::info("http: listening on {}://{}:{} ({} I/O threads, at most {} connections)",
               options.tls_cert.empty() ? "http" : "https", options.host, impl->port,
               options.io_threads, options.max_connections);
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port; }

void HttpServer::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  ServerCore& core = impl_->core;
  core.stopping.store(true);
  impl_->acceptor->Close();
  // Handlers already queued run to their end (they answer 503 or register
  // calls that are cancelled below).
  core.handlers->join();
  // Cancelled requests end through their final events, which their pumps
  // still write; give them a moment.
  std::vector<std::shared_ptr<Call>> calls;
  {
    std::unique_lock<std::mutex> lock(core.calls_mu);
    for (auto& [id, call] : core.calls) core.service->Cancel(id);
    core.calls_cv.wait_for(lock, kStopGrace, [&] { return core.calls.empty(); });
    for (auto& [id, call] : core.calls) calls.push_back(call);
  }
  for (auto& call : calls) {
    std::lock_guard<std::mutex> lock(call->mu);
    call->detached = true;  // late engine events post nothing
  }
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(core.sessions_mu);
    for (auto& [raw, weak] : core.sessions) {
      if (auto c = weak.lock()) open.push_back(std::move(c));
    }
  }
  for (auto& c : open) c->Close();
  open.clear();
  impl_->work.reset();
  // Closed sockets finish their handlers quickly; anything still pending
  // after the grace period is dropped with the io_context.
  const auto give_up = SteadyTime::now() + kStopGrace;
  while (!core.ioc.stopped() && SteadyTime::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  core.ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
  // Its subscribers' aborts (which unsubscribe) ran with the closed sessions.
  core.dashboard.reset();
  // No strand runs any more: the calls the engine may still hold must not
  // keep sockets of this io_context alive.
  for (auto& call : calls) {
    std::lock_guard<std::mutex> lock(call->mu);
    call->conn.reset();
  }
  {
    std::lock_guard<std::mutex> lock(core.calls_mu);
    core.calls.clear();
  }
}

}  // namespace kvserve
