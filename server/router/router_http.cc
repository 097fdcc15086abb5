// The router's HTTP front end on Beast. What it owns and how it is used:
// the opening paragraph of server/router/router_http.h.
//
// One exchange on a session: read the request (header under idle_timeout,
// body under read_timeout), route it; a completion goes to the handler pool
// for Backend::Place, comes back to the strand, takes an upstream
// connection (pooled, else a new one), writes the body, reads the reply's
// header and relays the body: a chunked (streamed) reply chunk by chunk, a
// sized one whole. While the node works, the session watches its own socket
// for readability: a client that closed is noticed at once (not only at the
// next write) and the upstream connection is closed.
#include "server/router/router_http.h"

#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/frontend/status_map.h"
#include "server/observe/metrics.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

std::string RouterErrorJson(const std::string& message) {
  nlohmann::json j;
  j["error"]["message"] = message;
  return j.dump();
}

struct Counters {
  std::atomic<int64_t> client_connections{0};
  std::atomic<int64_t> upstream_open{0};
  std::atomic<int64_t> upstream_opened{0};
  std::atomic<int64_t> upstream_reused{0};
  std::atomic<int64_t> upstream_errors{0};
  std::atomic<int64_t> upstream_retries{0};
  std::atomic<int64_t> client_disconnects{0};
  std::mutex mu;
  std::map<int, int64_t> responses;  // by HTTP status; guarded by mu
};

// One connection to a node's HTTP port; counted while it lives.
struct UpstreamConn {
  UpstreamConn(net::io_context& ioc, Counters* c) : sock(ioc), counters(c) {}
  ~UpstreamConn() {
    if (connected) --counters->upstream_open;
  }
  tcp::socket sock;
  Counters* counters;
  bool connected = false;
};

// Idle keep-alive connections by node address.
class UpstreamPool {
 public:
  explicit UpstreamPool(size_t max_idle) : max_idle_(max_idle) {}
  // An idle connection to `address` that the node has not closed; null if none.
  std::shared_ptr<UpstreamConn> Take(const std::string& address) {
    for (;;) {
      std::shared_ptr<UpstreamConn> c;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = idle_.find(address);
        if (it == idle_.end() || it->second.empty()) return nullptr;
        c = std::move(it->second.back());
        it->second.pop_back();
      }
      // A closed peer reads as 0 bytes; unexpected bytes make it unusable too.
      char b;
      const ssize_t n = ::recv(c->sock.native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return c;
    }
  }
  void Give(const std::string& address, std::shared_ptr<UpstreamConn> c) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = idle_[address];
    if (q.size() >= max_idle_ || stopped_) return;  // c closes as it goes
    q.push_back(std::move(c));
  }
  int64_t idle() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [a, q] : idle_) n += static_cast<int64_t>(q.size());
    return n;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    idle_.clear();
  }

 private:
  const size_t max_idle_;
  std::mutex mu_;
  std::map<std::string, std::deque<std::shared_ptr<UpstreamConn>>> idle_;
  bool stopped_ = false;
};

// Declared so that the io_context goes first: sessions it still holds when
// it is destroyed count themselves out of `counters`.
struct Core {
  RouterHttpOptions options;
  RouterHttpBackend* backend = nullptr;
  Counters counters;
  std::unique_ptr<UpstreamPool> pool;  // emptied by Stop (its sockets are ioc's)
  std::atomic<bool> stopping{false};
  std::optional<net::thread_pool> handlers;
  net::io_context ioc;

  void CountResponse(int status) {
    std::lock_guard<std::mutex> lock(counters.mu);
    ++counters.responses[status];
  }

  std::string Metrics() {
    std::string out = backend->MetricsText();
    AppendGauge("kvserve:router_http_connections", "Open client HTTP connections.", "",
                counters.client_connections.load(), &out);
    AppendGauge("kvserve:router_upstream_connections", "Open connections to the nodes' HTTP ports.",
                "", counters.upstream_open.load(), &out);
    AppendGauge("kvserve:router_upstream_connections_idle",
                "Idle keep-alive connections to the nodes kept for reuse.", "", pool->idle(), &out);
    AppendCounter("kvserve:router_upstream_connections_opened_total",
                  "Connections opened to the nodes' HTTP ports.", "",
                  counters.upstream_opened.load(), &out);
    AppendCounter("kvserve:router_upstream_connections_reused_total",
                  "Requests sent on a pooled keep-alive connection.", "",
                  counters.upstream_reused.load(), &out);
    AppendCounter("kvserve:router_upstream_errors_total",
                  "Upstream connections that failed (connect, write, read or timeout).", "",
                  counters.upstream_errors.load(), &out);
    AppendCounter("kvserve:router_upstream_retries_total",
                  "Requests resent on a fresh connection after a failure before any reply byte.",
                  "", counters.upstream_retries.load(), &out);
    AppendCounter("kvserve:router_client_disconnects_total",
                  "Proxied requests whose client went away before the reply ended.", "",
                  counters.client_disconnects.load(), &out);
    AppendHeader("kvserve:router_http_responses_total", "HTTP responses by status.", "counter",
                 &out);
    std::lock_guard<std::mutex> lock(counters.mu);
    for (const auto& [code, n] : counters.responses) {
      AppendSample("kvserve:router_http_responses_total", absl::StrCat("code=\"", code, "\""), n,
                   &out);
    }
    return out;
  }
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Core* core, tcp::socket socket)
      : core_(core),
        stream_(std::move(socket)),
        strand_(stream_.get_executor()),
        resolver_(strand_),
        up_timer_(strand_) {
    ++core_->counters.client_connections;
  }
  ~Session() {
    --core_->counters.client_connections;
    CallDone();
  }

  void Run() {
    net::dispatch(strand_, [self = shared_from_this()] { self->ReadRequest(); });
  }

 private:
  // --- the client side -----------------------------------------------------

  void ReadRequest() {
    if (core_->stopping.load()) return Shut();
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(core_->options.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(core_->options.max_request_bytes));
    stream_.expires_after(core_->options.idle_timeout);
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(beast::error_code ec) {
    if (ec == http::error::header_limit) {
      return Reply(431, RouterErrorJson("request header fields too large"), true);
    }
    if (ec == http::error::body_limit) return RefuseTooLarge();
    if (ec) return Shut();
    stream_.expires_after(core_->options.read_timeout);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRequest(ec); });
  }

  void RefuseTooLarge() {
    Reply(413,
          RouterErrorJson(absl::StrCat("request body larger than ", core_->options.max_request_bytes,
                                 " bytes")),
          true);
  }

  void OnRequest(beast::error_code ec) {
    if (ec == http::error::body_limit) return RefuseTooLarge();
    if (ec) return Shut();
    stream_.expires_never();
    req_ = parser_->release();
    parser_.reset();
    keep_alive_ = req_.keep_alive();
    version_ = req_.version();
    Route();
  }

  void Route() {
    std::string path(req_.target());
    if (size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    const http::verb method = req_.method();
    const bool completion = path == "/v1/completions" || path == "/v1/chat/completions";
    const bool get_route = path == "/health" || path == "/v1/models" || path == "/metrics";
    if (!completion && !get_route) {
      return Reply(404, RouterErrorJson("route: no route " + path));
    }
    if (completion ? method != http::verb::post : method != http::verb::get) {
      return Reply(405,
                   RouterErrorJson(absl::StrCat("route: ", path, " takes ", completion ? "POST" : "GET",
                                          ", not ", std::string(req_.method_string()))),
                   false, completion ? "POST" : "GET");
    }
    if (path == "/health") {
      bool ready = false;
      std::string body = core_->backend->Health(&ready);
      return Reply(ready ? 200 : 503, std::move(body));
    }
    const bool open_metrics = path == "/metrics" && core_->options.metrics_without_key;
    if (absl::Status a = core_->backend->Authenticate(req_[http::field::authorization]);
        !a.ok() && !open_metrics) {
      return Reply(HttpStatusFor(a.code()), RouterErrorJson(std::string(a.message())));
    }
    if (path == "/v1/models") {
      return Reply(200,
                   absl::StrCat(R"({"object":"list","data":)", core_->backend->ModelsJson(), "}"));
    }
    if (path == "/metrics") {
      return Reply(200, core_->Metrics(), false, "", "text/plain; version=0.0.4");
    }
    path_ = path;
    net::post(*core_->handlers, [self = shared_from_this()] {
      absl::StatusOr<UpstreamTarget> t =
          self->core_->backend->Place(self->path_, self->req_.body());
      net::post(self->strand_,
                [self, t = std::move(t)]() mutable { self->OnPlaced(std::move(t)); });
    });
  }

  // One reply with a body; `close` ends the connection after it.
  void Reply(int status, std::string body, bool close = false, const char* allow = "",
             const char* content_type = "application/json") {
    core_->CountResponse(status);
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(version_);
    res->result(static_cast<unsigned>(status));
    res->set(http::field::server, "kvserve-route");
    res->set(http::field::content_type, content_type);
    if (*allow != '\0') res->set(http::field::allow, allow);
    if (status == 401) res->set(http::field::www_authenticate, "Bearer");
    res->body() = std::move(body);
    res->keep_alive(keep_alive_ && !close && !core_->stopping.load());
    res->prepare_payload();
    stream_.expires_after(core_->options.write_timeout);
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec) return self->Shut();
                        self->EndExchange(res->keep_alive());
                      });
  }

  void EndExchange(bool keep_alive) {
    CallDone();
    if (!keep_alive) return Shut();
    ReadRequest();
  }

  void Shut() {
    if (shut_) return;
    shut_ = true;
    CloseUpstream();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
    CallDone();
  }

  // The placed request's end (the lease's release), once, on the handler pool.
  // After Stop (the pool joined) it is dropped: the prefill node's lease ttl
  // frees what a router that shuts down mid-request held.
  void CallDone() {
    if (!target_.done) return;
    std::function<void()> done = std::move(target_.done);
    target_.done = nullptr;
    if (!core_->stopping.load()) net::post(*core_->handlers, std::move(done));
  }

  // --- the upstream side ---------------------------------------------------

  void OnPlaced(absl::StatusOr<UpstreamTarget> t) {
    if (shut_) {
      if (t.ok() && t->done && !core_->stopping.load()) {
        net::post(*core_->handlers, std::move(t->done));
      }
      return;
    }
    if (!t.ok())
      return Reply(HttpStatusFor(t.status().code()), RouterErrorJson(std::string(t.status().message())));
    target_ = std::move(*t);
    const std::string& a = target_.http_address;
    const size_t colon = a.rfind(':');
    if (a.empty() || colon == std::string::npos) {
      return Reply(503, RouterErrorJson("route: the chosen node reports no HTTP address"));
    }
    up_host_ = a.substr(0, colon);
    up_port_ = a.substr(colon + 1);
    up_req_ = {};
    up_req_.method(http::verb::post);
    up_req_.target(path_);
    up_req_.version(11);
    up_req_.set(http::field::host, a);
    up_req_.set(http::field::content_type, "application/json");
    if (auto it = req_.find(http::field::authorization); it != req_.end()) {
      up_req_.set(http::field::authorization, it->value());
    }
    up_req_.keep_alive(true);
    up_req_.body() = std::move(req_.body());
    up_req_.prepare_payload();
    sent_to_client_ = false;
    retried_ = false;
    WatchClient();
    Upstream(/*fresh=*/false);
  }

  void Upstream(bool fresh) {
    up_buffer_.clear();
    up_parser_.reset();
    if (!fresh) up_ = core_->pool->Take(target_.http_address);
    if (up_ != nullptr) {
      ++core_->counters.upstream_reused;
      return WriteUpstream();
    }
    up_ = std::make_shared<UpstreamConn>(core_->ioc, &core_->counters);
    ArmUpTimer(core_->options.connect_timeout);
    resolver_.async_resolve(
        up_host_, up_port_,
        net::bind_executor(strand_, [self = shared_from_this(), up = up_](
                                        beast::error_code ec, tcp::resolver::results_type r) {
          if (self->up_ != up) return;
          if (ec) return self->UpstreamFailed(ec, "resolve");
          net::async_connect(up->sock, r,
                             net::bind_executor(self->strand_, [self, up](beast::error_code ec,
                                                                          const tcp::endpoint&) {
                               if (self->up_ != up) return;
                               if (ec) return self->UpstreamFailed(ec, "connect");
                               up->connected = true;
                               ++self->core_->counters.upstream_open;
                               ++self->core_->counters.upstream_opened;
                               self->WriteUpstream();
                             }));
        }));
  }

  void WriteUpstream() {
    ArmUpTimer(core_->options.upstream_timeout);
    auto up = up_;
    http::async_write(
        up->sock, up_req_,
        net::bind_executor(strand_, [self = shared_from_this(), up](beast::error_code ec, size_t) {
          if (self->up_ != up) return;
          if (ec) return self->UpstreamFailed(ec, "write");
          self->up_parser_.emplace();
          // Not boost::none: Boost 1.74 compares a Content-Length with an empty
          // optional as larger (a false body_limit error).
          self->up_parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
          http::async_read_header(
              up->sock, self->up_buffer_, *self->up_parser_,
              net::bind_executor(self->strand_, [self, up](beast::error_code ec, size_t) {
                if (self->up_ != up) return;
                if (ec) return self->UpstreamFailed(ec, "read");
                self->OnUpstreamHeader();
              }));
        }));
  }

  void OnUpstreamHeader() {
    const auto& h = up_parser_->get();
    up_status_ = static_cast<int>(h.result_int());
    up_content_type_ = std::string(h[http::field::content_type]);
    if (up_content_type_.empty()) up_content_type_ = "application/json";
    relay_ = up_parser_->chunked();
    whole_.clear();
    if (!relay_) return up_parser_->is_done() ? FinishSized() : ReadUpstreamBody();
    // A streamed reply: the head now, then every upstream read as a chunk.
    core_->CountResponse(up_status_);
    sent_to_client_ = true;
    const bool keep = keep_alive_ && version_ >= 11 && !core_->stopping.load();
    client_keep_alive_ = keep;
    auto head = std::make_shared<std::string>(
        absl::StrCat("HTTP/1.1 ", up_status_, " ", std::string(http::obsolete_reason(h.result())),
                     "\r\nServer: kvserve-route\r\nContent-Type: ", up_content_type_,
                     "\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: ",
                     keep ? "keep-alive" : "close", "\r\n\r\n"));
    WriteClient(head, [self = shared_from_this()] { self->ReadUpstreamBody(); });
  }

  void ReadUpstreamBody() {
    auto& body = up_parser_->get().body();
    body.data = up_chunk_;
    body.size = sizeof up_chunk_;
    auto up = up_;
    ArmUpTimer(core_->options.upstream_timeout);
    http::async_read_some(
        up->sock, up_buffer_, *up_parser_,
        net::bind_executor(strand_, [self = shared_from_this(), up](beast::error_code ec, size_t) {
          if (self->up_ != up) return;
          if (ec == http::error::need_buffer) ec = {};
          if (ec) return self->UpstreamFailed(ec, "read");
          const size_t n = sizeof self->up_chunk_ - self->up_parser_->get().body().size;
          const bool done = self->up_parser_->is_done();
          if (!self->relay_) {
            self->whole_.append(self->up_chunk_, n);
            if (!done) return self->ReadUpstreamBody();
            return self->FinishSized();
          }
          std::string bytes;
          if (n > 0)
            absl::StrAppend(&bytes, absl::Hex(n), "\r\n", absl::string_view(self->up_chunk_, n),
                            "\r\n");
          if (done) bytes += "0\r\n\r\n";
          if (bytes.empty()) return self->ReadUpstreamBody();
          self->WriteClient(std::make_shared<std::string>(std::move(bytes)), [self, done] {
            if (!done) return self->ReadUpstreamBody();
            self->FinishRelay();
          });
        }));
  }

  // Writes raw bytes of a relayed reply; `next` runs once they are out.
  void WriteClient(std::shared_ptr<std::string> bytes, std::function<void()> next) {
    stream_.expires_after(core_->options.write_timeout);
    net::async_write(
        stream_, net::buffer(*bytes),
        [self = shared_from_this(), bytes, next = std::move(next)](beast::error_code ec, size_t) {
          if (self->shut_) return;
          if (ec) return self->ClientGone();
          self->stream_.expires_never();
          next();
        });
  }

  // The client went away while its request ran: the node's connection is
  // closed (the node cancels the request) and the lease released.
  void ClientGone() {
    if (shut_) return;
    ++core_->counters.client_disconnects;
    spdlog::info("route: HTTP client went away during {} on {}", path_, target_.http_address);
    Shut();
  }

  void FinishSized() {
    PoolUpstream();
    Reply(up_status_, std::move(whole_), false, "", up_content_type_.c_str());
  }

  void FinishRelay() {
    PoolUpstream();
    EndExchange(client_keep_alive_);
  }

  // The reply is complete: the connection goes back to the pool if the node
  // keeps it alive and sent nothing past the reply.
  void PoolUpstream() {
    StopWatchingClient();
    up_timer_.cancel();
    if (up_ != nullptr && up_parser_ && up_parser_->is_done() && up_parser_->keep_alive() &&
        up_buffer_.size() == 0) {
      core_->pool->Give(target_.http_address, std::move(up_));
    }
    up_.reset();
  }

  void CloseUpstream() {
    up_timer_.cancel();
    if (up_ == nullptr) return;
    beast::error_code ec;
    up_->sock.shutdown(tcp::socket::shutdown_both, ec);
    up_->sock.close(ec);
    up_.reset();
  }

  void UpstreamFailed(beast::error_code ec, const char* what) {
    ++core_->counters.upstream_errors;
    spdlog::warn("route: upstream {} {} failed: {}", target_.http_address, what, ec.message());
    CloseUpstream();
    if (sent_to_client_) return Shut();  // the client sees its stream cut
    if (!retried_) {
      retried_ = true;
      ++core_->counters.upstream_retries;
      return Upstream(/*fresh=*/true);
    }
    StopWatchingClient();
    Reply(502, RouterErrorJson(absl::StrCat("route: node ", target_.http_address, " did not answer (",
                                      what, ": ", ec.message(), ")")));
  }

  // Closes the upstream connection when the upstream timer runs out.
  void ArmUpTimer(std::chrono::milliseconds d) {
    up_timer_.expires_after(d);
    up_timer_.async_wait([self = shared_from_this(), up = up_](beast::error_code ec) {
      if (ec || self->up_ != up || up == nullptr) return;
      beast::error_code ignored;
      up->sock.close(ignored);  // the pending operation fails: UpstreamFailed
    });
  }

  // While the node works, a readable client socket means either a closed
  // connection (the client went away) or a pipelined request (left alone).
  void WatchClient() {
    const uint64_t gen = ++watch_gen_;
    watching_ = true;
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        net::bind_executor(strand_, [self = shared_from_this(), gen](beast::error_code ec) {
          if (ec || gen != self->watch_gen_ || !self->watching_ || self->shut_) return;
          self->watching_ = false;
          char b;
          const ssize_t n =
              ::recv(self->stream_.socket().native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) self->ClientGone();
        }));
  }

  void StopWatchingClient() {
    if (!watching_) return;
    watching_ = false;
    ++watch_gen_;
    beast::error_code ec;
    stream_.socket().cancel(ec);  // only the wait is pending here
  }

  Core* core_;
  beast::tcp_stream stream_;
  net::any_io_executor strand_;
  tcp::resolver resolver_;
  net::steady_timer up_timer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> req_;
  bool keep_alive_ = true;
  bool client_keep_alive_ = true;
  unsigned version_ = 11;
  bool shut_ = false;
  std::string path_;
  UpstreamTarget target_;
  std::string up_host_, up_port_;
  http::request<http::string_body> up_req_;
  std::shared_ptr<UpstreamConn> up_;
  beast::flat_buffer up_buffer_;
  std::optional<http::response_parser<http::buffer_body>> up_parser_;
  char up_chunk_[16384];
  int up_status_ = 0;
  std::string up_content_type_;
  bool relay_ = false;
  std::string whole_;
  bool sent_to_client_ = false;
  bool retried_ = false;
  bool watching_ = false;
  uint64_t watch_gen_ = 0;
};

}  // namespace

struct RouterHttp::Impl {
  Core core;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  int port = 0;
  bool stopped = false;

  void Accept() {
    acceptor->async_accept(net::make_strand(core.ioc),
                           [this](beast::error_code ec, tcp::socket socket) {
                             if (core.stopping.load()) return;
                             if (!ec) {
                               std::make_shared<Session>(&core, std::move(socket))->Run();
                             }
                             Accept();
                           });
  }
};

absl::StatusOr<std::unique_ptr<RouterHttp>> RouterHttp::Start(RouterHttpOptions options,
                                                              RouterHttpBackend* backend) {
  if (options.io_threads < 1 || options.handler_threads < 1) {
    return absl::InvalidArgumentError("route: HTTP needs at least one I/O and one handler thread");
  }
  auto impl = std::make_unique<Impl>();
  Core& core = impl->core;
  core.options = std::move(options);
  core.backend = backend;
  core.handlers.emplace(static_cast<size_t>(core.options.handler_threads));
  core.pool = std::make_unique<UpstreamPool>(
      static_cast<size_t>(std::max(0, core.options.upstream_idle_per_node)));
  beast::error_code ec;
  net::ip::address addr = net::ip::make_address(core.options.host, ec);
  if (ec) {  // a host name (e.g. localhost): its first address
    tcp::resolver resolver(core.ioc);
    const auto found = resolver.resolve(core.options.host, "", ec);
    if (ec || found.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("route: --http-host ", core.options.host, ": ",
                                                     ec ? ec.message() : "no address"));
    }
    addr = found.begin()->endpoint().address();
  }
  impl->acceptor.emplace(core.ioc);
  const tcp::endpoint ep(addr, static_cast<unsigned short>(core.options.port));
  impl->acceptor->open(ep.protocol(), ec);
  if (!ec) impl->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor->bind(ep, ec);
  if (!ec) impl->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("route: cannot listen on HTTP ", core.options.host,
                                               ":", core.options.port, ": ", ec.message()));
  }
  impl->port = impl->acceptor->local_endpoint().port();
  impl->Accept();
  for (int i = 0; i < core.options.io_threads; ++i) {
    impl->threads.emplace_back([c = &core] { c->ioc.run(); });
  }
  return std::unique_ptr<RouterHttp>(new RouterHttp(std::move(impl)));
}

RouterHttp::RouterHttp(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RouterHttp::~RouterHttp() { Stop(); }
int RouterHttp::port() const { return impl_->port; }

void RouterHttp::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  Core& core = impl_->core;
  core.stopping.store(true);
  core.pool->Clear();
  // Sessions end with the io_context: their sockets close as they are destroyed.
  core.ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  beast::error_code ec;
  impl_->acceptor->close(ec);  // no I/O thread runs any more
  core.handlers->join();
}

}  // namespace kvserve
