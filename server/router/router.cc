// The implementation of Router. What it owns and how it is used: the
// opening paragraph of server/router/router.h.

#include "server/router/router.h"

#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "proto/kvserve.grpc.pb.h"
#include "proto/pd.grpc.pb.h"
#include "server/service/auth.h"
#include "server/pd/pd_node.h"
#include "server/frontend/status_map.h"
#include "server/observe/metrics.h"
#include "server/router/router_http.h"
#include "spdlog/spdlog.h"

namespace kvserve {
namespace {

namespace pdv1 = ::kvserve::pd::v1;
using RouteClock = std::chrono::steady_clock;

// A replica of one node's radix prefix index, built from its KV events:
// blocks by hash, and children by (parent hash, hash of the block's tokens),
// so a prompt's cached prefix is found by walking its blocks from the root
// without knowing the node's hash function.
class Replica {
 public:
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.clear();
    children_.clear();
  }
  void Store(const v1::KvBlockStored& b) {
    const uint64_t key = TokensKey(b.token_ids().data(), b.token_ids_size());
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[b.block_hash()] = {b.parent_hash(), key, b.token_ids_size()};
    children_[{b.parent_hash(), key}] = b.block_hash();
  }
  void Remove(uint64_t hash) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(hash);
    if (it == blocks_.end()) return;
    auto c = children_.find({it->second.parent, it->second.key});
    if (c != children_.end() && c->second == hash) children_.erase(c);
    blocks_.erase(it);
  }
  // Tokens of `tokens` the node holds as a cached prefix (whole blocks).
  int32_t Match(const std::vector<int32_t>& tokens, int32_t block_size) const {
    if (block_size <= 0) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t parent = 0;
    int32_t matched = 0;
    for (size_t i = 0; i + block_size <= tokens.size(); i += block_size) {
      auto it = children_.find({parent, TokensKey(tokens.data() + i, block_size)});
      if (it == children_.end()) break;
      parent = it->second;
      matched += block_size;
    }
    return matched;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return blocks_.size();
  }

 private:
  static uint64_t TokensKey(const int32_t* t, int n) {
    return XXH3_64bits(t, static_cast<size_t>(n) * sizeof(int32_t));
  }
  struct Block {
    uint64_t parent, key;
    int n;
  };
  mutable std::mutex mu_;
  absl::flat_hash_map<uint64_t, Block> blocks_;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, uint64_t> children_;
};

struct Node {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvserve::Stub> api;
  std::unique_ptr<pdv1::KvTransfer::Stub> pd;
  Replica replica;
  // Guarded by Router::Impl::mu_.
  bool up = false;
  bool refused = false;
  std::string refused_reason;
  pdv1::NodeInfo info;
  v1::Stats stats;
  v1::ModelInfo model;  // GetModelInfo, asked at registration and on restart
  int64_t pending_prefill_tokens = 0;  // sent here, first token not yet back
  int64_t in_flight = 0;
  bool removed = false;
  // The event subscription.
  std::thread subscriber;
  std::mutex sub_mu;
  grpc::ClientContext* sub_ctx = nullptr;  // guarded by sub_mu
};

// Cancels every registered client context once the server call is cancelled
// (the client went away or its deadline passed), so a cancel reaches the
// prefill and the decode node alike.
class CancelScope {
 public:
  explicit CancelScope(grpc::ServerContext* ctx) : ctx_(ctx) {
    watcher_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!done_) {
        cv_.wait_for(lock, std::chrono::milliseconds(10));
        if (!cancelled_ && ctx_->IsCancelled()) {
          cancelled_ = true;
          for (grpc::ClientContext* c : contexts_) c->TryCancel();
        }
      }
    });
  }
  ~CancelScope() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    watcher_.join();
  }
  void Add(grpc::ClientContext* c) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.push_back(c);
    if (cancelled_) c->TryCancel();
  }
  void Remove(grpc::ClientContext* c) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), c), contexts_.end());
  }
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_ || ctx_->IsCancelled();
  }

 private:
  grpc::ServerContext* ctx_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<grpc::ClientContext*> contexts_;
  bool done_ = false, cancelled_ = false;
  std::thread watcher_;
};

double Secs(double ms) { return ms / 1000.0; }

}  // namespace

struct Router::Impl final : public v1::Kvserve::Service, public RouterHttpBackend {
  RouterOptions o;
  Authenticator auth{""};  // o.api_key's check of incoming calls (set with o)
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<RouterHttp> http;  // server/router/router_http.h
  int http_port = -1;
  // Requests by (route or RPC, placement "local" | "disaggregated").
  std::mutex requests_mu_;
  std::map<std::pair<std::string, std::string>, int64_t> requests_;  // guarded by requests_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::shared_ptr<Node>> nodes_;  // guarded by mu_
  std::thread membership_;
  std::atomic<uint64_t> rr_{0};
  std::atomic<int64_t> disaggregated_{0}, local_{0}, pd_fallbacks_{0}, pd_retries_{0};
  const int64_t created_ = std::time(nullptr);

  // ---- membership ----

  std::shared_ptr<Node> NewNode(const std::string& address) {
    auto n = std::make_shared<Node>();
    n->address = address;
    n->channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    n->api = v1::Kvserve::NewStub(n->channel);
    n->pd = pdv1::KvTransfer::NewStub(n->channel);
    Node* raw = n.get();
    n->subscriber = std::thread([this, raw] { Subscribe(raw); });
    return n;
  }

  void AddAuth(grpc::ClientContext* c) const {
    if (!o.api_key.empty()) c->AddMetadata("authorization", "Bearer " + o.api_key);
  }

  std::vector<std::string> Resolve() {
    std::vector<std::string> out = o.nodes;
    if (o.nodes_dns.empty()) return out;
    const size_t colon = o.nodes_dns.rfind(':');
    const std::string host = o.nodes_dns.substr(0, colon);
    const std::string port = colon == std::string::npos ? "50051" : o.nodes_dns.substr(colon + 1);
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return out;
    std::set<std::string> seen;
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      if (seen.insert(buf).second) out.push_back(absl::StrCat(buf, ":", port));
    }
    freeaddrinfo(res);
    return out;
  }

  void MembershipLoop() {
    for (;;) {
      const std::vector<std::string> addresses = Resolve();
      std::vector<std::shared_ptr<Node>> nodes;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        for (const std::string& a : addresses) {
          auto it = std::find_if(nodes_.begin(), nodes_.end(),
                                 [&](const auto& n) { return n->address == a; });
          if (it == nodes_.end()) nodes_.push_back(NewNode(a));
        }
        for (auto& n : nodes_) {
          n->removed =
              std::find(addresses.begin(), addresses.end(), n->address) == addresses.end();
        }
        nodes = nodes_;
      }
      for (auto& n : nodes) Poll(n.get());
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(o.poll_ms), [&] { return stop_; });
      if (stop_) return;
    }
  }

  void Poll(Node* n) {
    pdv1::NodeInfo info;
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::Status s = n->pd->GetNodeInfo(&c, pdv1::GetNodeInfoRequest(), &info);
    v1::Stats stats;
    grpc::Status ss = s;
    if (s.ok()) {
      grpc::ClientContext c2;
      AddAuth(&c2);
      c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      ss = n->api->GetStats(&c2, v1::GetStatsRequest(), &stats);
    }
    // The model it serves (/v1/models): once per incarnation.
    std::optional<v1::ModelInfo> model;
    bool known = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      known = n->info.incarnation() == info.incarnation() && !n->model.name().empty();
    }
    if (s.ok() && ss.ok() && !known) {
      grpc::ClientContext c3;
      AddAuth(&c3);
      c3.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      v1::ModelInfo m;
      if (n->api->GetModelInfo(&c3, v1::GetModelInfoRequest(), &m).ok()) model = std::move(m);
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok() || !ss.ok()) {
      if (n->up) spdlog::warn("route: node {} is down: {}", n->address, s.ok() ? ss.error_message() : s.error_message());
      n->up = false;
      return;
    }
    if (n->info.incarnation() != 0 && n->info.incarnation() != info.incarnation()) {
      spdlog::info("route: node {} restarted (incarnation {:016x} -> {:016x})", n->address,
                   n->info.incarnation(), info.incarnation());
      n->replica.Clear();
      n->pending_prefill_tokens = 0;
    }
    // Registration: the KV layout must match every other registered node's.
    std::string diff;
    for (const auto& other : nodes_) {
      if (other.get() == n || !other->up || other->refused) continue;
      diff = KvLayoutDifference(other->info.layout(), info.layout());
      if (!diff.empty()) {
        diff = absl::StrCat("KV layout of ", info.node_id(), " differs from ",
                            other->info.node_id(), "'s: ", diff);
        break;
      }
    }
    if (!diff.empty()) {
      if (!n->refused || n->refused_reason != diff) {
        spdlog::error("route: refusing node {}: {}", n->address, diff);
      }
      n->refused = true;
      n->refused_reason = diff;
    } else {
      if (!n->up || n->refused) {
        spdlog::info("route: node {} registered: id {}, role {}, incarnation {:016x}, {} blocks",
                     n->address, info.node_id(), info.role(), info.incarnation(),
                     info.num_blocks());
      }
      n->refused = false;
      n->refused_reason.clear();
    }
    if (n->info.incarnation() != info.incarnation()) n->model.Clear();
    if (model) n->model = std::move(*model);
    n->info = std::move(info);
    n->stats = std::move(stats);
    n->up = true;
  }

  void Subscribe(Node* n) {
    uint64_t last = 0, epoch = 0;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
      }
      grpc::ClientContext c;
      AddAuth(&c);
      {
        std::lock_guard<std::mutex> lock(n->sub_mu);
        n->sub_ctx = &c;
      }
      v1::SubscribeKvEventsRequest req;
      req.set_after_sequence(last);
      req.set_epoch(epoch);
      auto reader = n->api->SubscribeKvEvents(&c, req);
      v1::KvEventsResponse r;
      while (reader->Read(&r)) {
        if (r.has_snapshot()) {
          if (r.snapshot().index() == 0) n->replica.Clear();
          for (const auto& b : r.snapshot().blocks()) {
            // Tiers' pages and other KV cache groups' blocks (same hashes as
            // the full group's): not the index the replica predicts from.
            if (b.tier() == v1::KV_TIER_NONE && b.group_idx() == 0) n->replica.Store(b);
          }
        }
        for (const v1::KvEvent& e : r.events()) {
          if (e.has_block_stored() && e.block_stored().tier() == v1::KV_TIER_NONE &&
              e.block_stored().group_idx() == 0) {
            n->replica.Store(e.block_stored());
          }
          if (e.has_block_removed() && e.block_removed().tier() == v1::KV_TIER_NONE &&
              e.block_removed().group_idx() == 0) {
            n->replica.Remove(e.block_removed().block_hash());
          }
          if (e.has_all_cleared() && e.all_cleared().group_idx() == 0) n->replica.Clear();
        }
        last = r.sequence();
        epoch = r.epoch();
      }
      (void)reader->Finish();
      {
        std::lock_guard<std::mutex> lock(n->sub_mu);
        n->sub_ctx = nullptr;
      }
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(300), [&] { return stop_; });
    }
  }

  // ---- placement ----

  struct Placement {
    std::shared_ptr<Node> decode;
    std::shared_ptr<Node> prefill;  // null: entirely on the decode node
    // The other prefill nodes, best first: where a failed Prefill is retried.
    std::vector<std::shared_ptr<Node>> prefill_alternatives;
    int64_t prompt_tokens = 0;
    int64_t prefill_tokens = 0;  // charged to the prefill node's queue
  };

  static double PrefillRate(const v1::Stats& s) {
    return s.step_prefill_ms_per_token() > 0 ? Secs(s.step_prefill_ms_per_token()) : 2e-4;
  }
  static double DecodeLoad(const v1::Stats& s) {
    return s.running() * Secs(std::max(0.0, s.step_decode_ms_per_token()));
  }

  absl::StatusOr<std::vector<int32_t>> PromptTokens(const v1::GenerateRequest& r,
                                                    const std::shared_ptr<Node>& n) {
    if (r.prompt_ids_size() > 0) return std::vector<int32_t>(r.prompt_ids().begin(), r.prompt_ids().end());
    v1::TokenizeRequest t;
    t.set_model(r.model());
    t.set_text(r.prompt());
    if (r.has_add_special_tokens()) t.set_add_special_tokens(r.add_special_tokens());
    v1::TokenizeResponse resp;
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status s = n->api->Tokenize(&c, t, &resp);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end());
  }

  absl::StatusOr<Placement> Place(const v1::GenerateRequest* r) {
    std::vector<std::shared_ptr<Node>> decoders, prefillers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& n : nodes_) {
        if (!n->up || n->refused || n->removed) continue;
        if (n->info.role() == "prefill") {
          prefillers.push_back(n);
        } else {
          decoders.push_back(n);
        }
      }
    }
    if (decoders.empty()) {
      return absl::UnavailableError("route: no decode-capable node (role decode or both) is up");
    }
    Placement p;
    std::vector<int32_t> tokens;
    const bool need_tokens =
        r != nullptr && (decoders.size() > 1 || !prefillers.empty()) && o.policy != "round-robin";
    if (need_tokens) {
      absl::StatusOr<std::vector<int32_t>> t = PromptTokens(*r, decoders[0]);
      if (!t.ok()) return t.status();
      tokens = std::move(*t);
    }
    const int64_t n = static_cast<int64_t>(tokens.size());
    p.prompt_tokens = n;
    std::lock_guard<std::mutex> lock(mu_);
    if (o.policy == "round-robin" && prefillers.empty()) {
      p.decode = decoders[rr_++ % decoders.size()];
      return p;
    }
    auto local_seconds = [&](const std::shared_ptr<Node>& d, int64_t* uncached) {
      const int32_t bs = d->info.layout().block_size();
      *uncached = n - d->replica.Match(tokens, bs);
      const double rate = PrefillRate(d->stats);
      return (d->pending_prefill_tokens + d->stats.waiting()) * rate + *uncached * rate +
             DecodeLoad(d->stats);
    };
    double best = 1e300;
    int64_t best_uncached = n;
    for (const auto& d : decoders) {
      int64_t unc = 0;
      const double t = local_seconds(d, &unc);
      if (t < best) {
        best = t;
        best_uncached = unc;
        p.decode = d;
      }
    }
    p.prefill_tokens = best_uncached;
    if (prefillers.empty() || o.pd_mode == "never" || p.decode->info.role() != "decode") return p;
    // The decode node's measured pull bandwidth (bytes/s).
    const pdv1::NodeInfo& di = p.decode->info;
    const double bw = di.pull_seconds() > 0 && di.bytes_pulled() > 0
                          ? di.bytes_pulled() / di.pull_seconds()
                          : 1e9;
    const double bytes_per_token =
        static_cast<double>(di.layout().block_bytes()) / std::max(1, di.layout().block_size());
    struct Option {
      double seconds;
      size_t order;
      int64_t uncached;
      std::shared_ptr<Node> node;
    };
    std::vector<Option> options;
    for (const auto& pf : prefillers) {
      const int64_t unc = n - pf->replica.Match(tokens, pf->info.layout().block_size());
      const double rate = PrefillRate(pf->stats);
      const double t = (pf->pending_prefill_tokens + pf->stats.waiting()) * rate + unc * rate +
                       best_uncached * bytes_per_token / bw + 0.002 + DecodeLoad(p.decode->stats);
      options.push_back({t, options.size(), unc, pf});
    }
    std::sort(options.begin(), options.end(), [](const Option& a, const Option& b) {
      return a.seconds != b.seconds ? a.seconds < b.seconds : a.order < b.order;
    });
    const double best_remote = options[0].seconds;
    std::shared_ptr<Node> best_p = options[0].node;
    const int64_t best_p_uncached = options[0].uncached;
    for (size_t k = 1; k < options.size(); ++k) p.prefill_alternatives.push_back(options[k].node);
    const bool remote =
        o.pd_mode == "always" ||
        (best_uncached >= o.pd_min_remote_tokens && best_remote < best);
    if (remote) {
      p.prefill = best_p;
      p.prefill_tokens = best_p_uncached;
    }
    return p;
  }

  grpc::Status Authorize(grpc::ServerContext* ctx) const {
    absl::StatusOr<CallerAuth> caller = AuthorizeGrpc(auth, *ctx, true);
    return caller.ok() ? grpc::Status::OK : ToGrpc(caller.status());
  }

  void CopyDeadline(grpc::ServerContext* from, grpc::ClientContext* to) {
    if (from->deadline() < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
      to->set_deadline(from->deadline());
    }
    AddAuth(to);
  }

  void Release(Node* p, const pdv1::Lease& l, const char* reason) {
    grpc::ClientContext c;
    AddAuth(&c);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    pdv1::ReleaseLeaseRequest r;
    r.set_transfer_id(l.transfer_id());
    r.set_incarnation(l.incarnation());
    r.set_reason(reason);
    pdv1::ReleaseLeaseResponse resp;
    (void)p->pd->ReleaseLease(&c, r, &resp);
  }

  // Streams one request from node `d` back to the client.
  using ReaderFactory =
      std::function<std::unique_ptr<grpc::ClientReaderInterface<v1::GenerateResponse>>(
          grpc::ClientContext*)>;
  grpc::Status Stream(grpc::ServerContext* ctx, CancelScope* scope, Node* d,
                      grpc::ServerWriter<v1::GenerateResponse>* w, int64_t charged,
                      const ReaderFactory& call) {
    grpc::ClientContext dc;
    CopyDeadline(ctx, &dc);
    scope->Add(&dc);
    auto reader = call(&dc);
    v1::GenerateResponse resp;
    bool first = true;
    while (reader->Read(&resp)) {
      if (first) {
        first = false;
        std::lock_guard<std::mutex> lock(mu_);
        d->pending_prefill_tokens -= charged;
        charged = 0;
      }
      if (!w->Write(resp)) {
        dc.TryCancel();
        break;
      }
    }
    grpc::Status s = reader->Finish();
    scope->Remove(&dc);
    if (charged != 0) {
      std::lock_guard<std::mutex> lock(mu_);
      d->pending_prefill_tokens -= charged;
    }
    return s;
  }

  // Test hook (--test-stall): this request's thread stops here until the
  // router is killed (or stopped).
  void MaybeStall(const char* state) {
    if (o.test_stall != state) return;
    spdlog::warn("route: --test-stall: request stopped with its lease {}", state);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return stop_; });
  }

  static bool Retryable(grpc::StatusCode c) {
    // The node died, restarted, shut down or is overloaded; another node
    // may well succeed. Bad requests fail the same everywhere.
    return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::ABORTED ||
           c == grpc::StatusCode::UNKNOWN || c == grpc::StatusCode::INTERNAL ||
           c == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }

  // Prefill on p.prefill and hand the lease to p.decode; nullopt (decode
  // computes the prompt itself) when either step fails. A prefill node that
  // fails (it died, restarted, shut down) is marked down and the request is
  // retried on the next-best prefill node while the request's deadline
  // allows. `ctx`/`scope` (null for HTTP) carry the client's deadline and
  // cancel.
  std::optional<pdv1::Lease> PrefillAndAttach(Placement& p, const pdv1::PrefillRequest& base,
                                              grpc::ServerContext* ctx, CancelScope* scope) {
    if (p.prefill == nullptr) return std::nullopt;
    std::vector<std::shared_ptr<Node>> candidates = {p.prefill};
    candidates.insert(candidates.end(), p.prefill_alternatives.begin(),
                      p.prefill_alternatives.end());
    const auto deadline =
        ctx != nullptr && ctx->deadline() < std::chrono::system_clock::now() + std::chrono::hours(24)
            ? ctx->deadline()
            : std::chrono::system_clock::now() + std::chrono::seconds(300);
    pdv1::PrefillRequest pr = base;
    pr.set_ttl_ms(o.lease_ttl_ms);
    pr.set_progressive(o.overlap);
    pdv1::Lease l;
    bool granted = false;
    for (size_t k = 0; k < candidates.size() && !granted; ++k) {
      const std::shared_ptr<Node>& pf = candidates[k];
      if (k > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!pf->up || pf->refused || pf->removed) continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        pf->pending_prefill_tokens += p.prefill_tokens;
      }
      grpc::ClientContext pc;
      AddAuth(&pc);
      pc.set_deadline(deadline);
      if (scope != nullptr) scope->Add(&pc);
      l.Clear();
      grpc::Status s = pf->pd->Prefill(&pc, pr, &l);
      if (scope != nullptr) scope->Remove(&pc);
      {
        std::lock_guard<std::mutex> lock(mu_);
        pf->pending_prefill_tokens -= p.prefill_tokens;
      }
      if (s.ok()) {
        p.prefill = pf;
        granted = true;
        break;
      }
      if (scope != nullptr && scope->cancelled()) return std::nullopt;
      const bool more = k + 1 < candidates.size() && Retryable(s.error_code()) &&
                        std::chrono::system_clock::now() < deadline;
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        std::lock_guard<std::mutex> lock(mu_);
        pf->up = false;  // unreachable: skipped until its next poll answers
      }
      if (more) {
        spdlog::warn("route: prefill on {} failed: {}; retrying on another prefill node",
                     pf->address, s.error_message());
        ++pd_retries_;
        continue;
      }
      spdlog::warn("route: prefill on {} failed: {}; decoding locally on {}", pf->address,
                   s.error_message(), p.decode->address);
      ++pd_fallbacks_;
      return std::nullopt;
    }
    if (!granted) {
      ++pd_fallbacks_;
      return std::nullopt;
    }
    MaybeStall("granted");
    grpc::ClientContext ac;
    AddAuth(&ac);
    ac.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pdv1::AttachLeaseResponse ar;
    grpc::Status as = p.decode->pd->AttachLease(&ac, l, &ar);
    if (!as.ok()) {
      spdlog::warn("route: decode node {} refused the lease of {}: {}; decoding locally",
                   p.decode->address, p.prefill->address, as.error_message());
      Release(p.prefill.get(), l, "attach failed");
      ++pd_fallbacks_;
      return std::nullopt;
    }
    MaybeStall("attached");
    return l;
  }

  // A GenerateRequest standing in for a chat request in placement: its
  // prompt is the messages' text (the router does not render the chat
  // template, so the estimate ignores the template's tokens and the radix
  // match mostly misses).
  static v1::GenerateRequest ChatPlacementStandIn(const std::vector<std::string>& texts,
                                                  const std::string& salt) {
    v1::GenerateRequest g;
    g.set_prompt(absl::StrJoin(texts, "\n"));
    g.set_cache_salt(salt);
    return g;
  }

  void CountRequest(const std::string& path, bool disaggregated) {
    std::lock_guard<std::mutex> lock(requests_mu_);
    ++requests_[{path, disaggregated ? "disaggregated" : "local"}];
  }

  // ---- RouterHttpBackend (server/router/router_http.h) ----

  absl::Status Authenticate(std::string_view authorization) override {
    return auth.Check(authorization, true).status();
  }

  // OpenAI HTTP: the body goes unchanged to the chosen decode-capable node's
  // HTTP port (the front end relays the reply; a client that goes away
  // closes the upstream connection, which cancels the request there). A
  // completion with a text prompt, or a chat, is placed and disaggregated
  // like Generate and Chat; the lease is released when the exchange ends.
  absl::StatusOr<UpstreamTarget> Place(const std::string& path,
                                       const std::string& raw) override {
    nlohmann::json body = nlohmann::json::parse(raw, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded() || !body.is_object()) {
      return absl::InvalidArgumentError("request body: not a JSON object");
    }
    v1::GenerateRequest gr;
    pdv1::PrefillRequest pr;
    const bool text_completion =
        path == "/v1/completions" && body.contains("prompt") && body["prompt"].is_string();
    const bool chat = path == "/v1/chat/completions" && body.contains("messages") &&
                      body["messages"].is_array();
    const std::string salt = body.contains("cache_salt") && body["cache_salt"].is_string()
                                 ? body["cache_salt"].get<std::string>()
                                 : std::string();
    if (text_completion) {
      gr.set_prompt(body["prompt"].get<std::string>());
      gr.set_cache_salt(salt);
      pr.set_generate_request(gr.SerializeAsString());
    } else if (chat) {
      // The prefill node parses the body exactly as the decode node's HTTP
      // front end will (template, tools, salt) and prefills the result.
      std::vector<std::string> texts;
      for (const auto& m : body["messages"]) {
        if (m.is_object() && m.contains("content") && m["content"].is_string()) {
          texts.push_back(m["content"].get<std::string>());
        }
      }
      gr = ChatPlacementStandIn(texts, salt);
      pr.set_openai_chat_body(raw);
    }
    const bool disaggregable = text_completion || chat;
    absl::StatusOr<Placement> placed = Place(disaggregable ? &gr : nullptr);
    if (!placed.ok()) return absl::UnavailableError(placed.status().message());
    auto p = std::make_shared<Placement>(std::move(*placed));
    auto lease = std::make_shared<std::optional<pdv1::Lease>>(
        disaggregable ? PrefillAndAttach(*p, pr, nullptr, nullptr) : std::nullopt);
    if (*lease) {
      ++disaggregated_;
    } else {
      ++local_;
    }
    CountRequest(path, lease->has_value());
    UpstreamTarget t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      t.http_address = p->decode->info.http_address();
    }
    t.done = [this, p, lease] {
      if (*lease) Release(p->prefill.get(), **lease, "request ended");
    };
    return t;
  }

  std::string Health(bool* ready) override { return HealthJson(ready); }

  // The models of the registered decode-capable nodes, each once.
  std::string ModelsJson() override {
    std::map<std::string, nlohmann::json> models;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& n : nodes_) {
        if (!n->up || n->refused || n->removed || n->model.name().empty()) continue;
        nlohmann::json& m = models[n->model.name()];
        if (m.is_null()) {
          m = {{"id", n->model.name()},
               {"object", "model"},
               {"created", created_},
               {"owned_by", "kvserve"},
               {"max_model_len", n->model.context_length()},
               {"nodes", nlohmann::json::array()}};
        }
        m["nodes"].push_back({{"address", n->address}, {"role", n->info.role()}});
      }
    }
    nlohmann::json data = nlohmann::json::array();
    for (auto& [name, m] : models) data.push_back(std::move(m));
    return data.dump();
  }

  std::string MetricsText() override {
    std::string out;
    AppendHeader("kvserve:router_requests_total",
                 "Requests the router placed, by route and placement.", "counter", &out);
    {
      std::lock_guard<std::mutex> lock(requests_mu_);
      for (const auto& [key, n] : requests_) {
        AppendSample("kvserve:router_requests_total",
                     absl::StrCat("path=\"", key.first, "\",placement=\"", key.second, "\""), n,
                     &out);
      }
    }
    std::map<std::string, int64_t> states = {{"up", 0}, {"down", 0}, {"refused", 0}};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& n : nodes_) {
        if (n->removed) continue;
        ++states[n->refused ? "refused" : n->up ? "up" : "down"];
      }
    }
    AppendHeader("kvserve:router_nodes", "Nodes known to the router by state.", "gauge", &out);
    for (const auto& [state, n] : states) {
      AppendSample("kvserve:router_nodes", absl::StrCat("state=\"", state, "\""), n, &out);
    }
    AppendCounter("kvserve:router_pd_fallbacks_total",
                  "Disaggregations that fell back to decoding locally.", "", pd_fallbacks_.load(),
                  &out);
    AppendCounter("kvserve:router_pd_retries_total", "Prefills retried on another prefill node.",
                  "", pd_retries_.load(), &out);
    return out;
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* w) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    pdv1::PrefillRequest pr;
    pr.set_generate_request(req->SerializeAsString());
    return Serve(ctx, *req, pr, w,
                 [req](Node* d, grpc::ClientContext* c) { return d->api->Generate(c, *req); },
                 "/kvserve.v1.Kvserve/Generate");
  }

  using NodeCall =
      std::function<std::unique_ptr<grpc::ClientReaderInterface<v1::GenerateResponse>>(
          Node*, grpc::ClientContext*)>;

  // Generate and Chat: place (by `placement`'s prompt), prefill remotely
  // when chosen (`pr` carries the request as the prefill node reads it),
  // stream the decode node's reply, release the lease at the end.
  grpc::Status Serve(grpc::ServerContext* ctx, const v1::GenerateRequest& placement,
                     const pdv1::PrefillRequest& pr, grpc::ServerWriter<v1::GenerateResponse>* w,
                     const NodeCall& call, const std::string& rpc) {
    absl::StatusOr<Placement> placed = Place(&placement);
    if (!placed.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(placed.status().code()),
                          std::string(placed.status().message()));
    }
    Placement p = std::move(*placed);
    CancelScope scope(ctx);
    std::optional<pdv1::Lease> lease = PrefillAndAttach(p, pr, ctx, &scope);
    if (!lease && scope.cancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
    }
    if (lease) {
      ++disaggregated_;
    } else {
      ++local_;
    }
    CountRequest(rpc, lease.has_value());
    const int64_t charged = lease ? 0 : p.prefill_tokens;
    {
      std::lock_guard<std::mutex> lock(mu_);
      p.decode->pending_prefill_tokens += charged;
      ++p.decode->in_flight;
    }
    Node* d = p.decode.get();
    grpc::Status s = Stream(ctx, &scope, d, w, charged,
                            [d, &call](grpc::ClientContext* c) { return call(d, c); });
    {
      std::lock_guard<std::mutex> lock(mu_);
      --p.decode->in_flight;
    }
    // Whatever happened, the lease ends with the request (idempotent on the
    // prefill node; the decode node has usually released it already).
    if (lease) Release(p.prefill.get(), *lease, "request ended");
    return s;
  }

  grpc::Status Chat(grpc::ServerContext* ctx, const v1::ChatRequest* req,
                    grpc::ServerWriter<v1::GenerateResponse>* w) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    std::vector<std::string> texts;
    for (const v1::ChatMessage& m : req->messages()) texts.push_back(m.content());
    const v1::GenerateRequest stand_in = ChatPlacementStandIn(texts, req->cache_salt());
    pdv1::PrefillRequest pr;
    pr.set_chat_request(req->SerializeAsString());
    return Serve(ctx, stand_in, pr, w,
                 [req](Node* d, grpc::ClientContext* c) { return d->api->Chat(c, *req); },
                 "/kvserve.v1.Kvserve/Chat");
  }

  std::shared_ptr<Node> AnyDecoder() {
    absl::StatusOr<Placement> p = Place(nullptr);
    return p.ok() ? p->decode : nullptr;
  }

  grpc::Status Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    auto n = AnyDecoder();
    if (!n) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "route: no node is up");
    grpc::ClientContext c;
    CopyDeadline(ctx, &c);
    return n->api->Tokenize(&c, *req, resp);
  }
  grpc::Status Detokenize(grpc::ServerContext* ctx, const v1::DetokenizeRequest* req,
                          v1::DetokenizeResponse* resp) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    auto n = AnyDecoder();
    if (!n) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "route: no node is up");
    grpc::ClientContext c;
    CopyDeadline(ctx, &c);
    return n->api->Detokenize(&c, *req, resp);
  }
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req,
                            v1::ModelInfo* resp) override {
    if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
    auto n = AnyDecoder();
    if (!n) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "route: no node is up");
    grpc::ClientContext c;
    CopyDeadline(ctx, &c);
    return n->api->GetModelInfo(&c, *req, resp);
  }

  std::string HealthJson(bool* ready) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> parts;
    *ready = false;
    for (const auto& n : nodes_) {
      if (n->up && !n->refused && !n->removed && n->info.role() != "prefill") *ready = true;
      parts.push_back(absl::StrCat(
          "{\"address\":\"", n->address, "\",\"node_id\":\"", n->info.node_id(),
          "\",\"role\":\"", n->info.role(), "\",\"up\":", n->up ? "true" : "false",
          ",\"refused\":\"", n->refused_reason, "\",\"cached_blocks\":", n->replica.size(),
          "}"));
    }
    return absl::StrCat("{\"ready\":", *ready ? "true" : "false", ",\"disaggregated\":",
                        disaggregated_.load(), ",\"local\":", local_.load(),
                        ",\"pd_fallbacks\":", pd_fallbacks_.load(),
                        ",\"pd_retries\":", pd_retries_.load(), ",\"nodes\":[",
                        absl::StrJoin(parts, ","), "]}\n");
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (http) http->Stop();
    if (membership_.joinable()) membership_.join();
    std::vector<std::shared_ptr<Node>> nodes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      nodes = nodes_;
    }
    for (auto& n : nodes) {
      {
        std::lock_guard<std::mutex> lock(n->sub_mu);
        if (n->sub_ctx) n->sub_ctx->TryCancel();
      }
      if (n->subscriber.joinable()) n->subscriber.join();
    }
  }
};

absl::StatusOr<std::unique_ptr<Router>> Router::Start(RouterOptions options) {
  if (options.nodes.empty() && options.nodes_dns.empty()) {
    return absl::InvalidArgumentError("route: give the nodes with --nodes and/or --nodes-dns");
  }
  if (options.policy != "kv" && options.policy != "round-robin") {
    return absl::InvalidArgumentError("--policy: '" + options.policy +
                                      "' is not one of kv, round-robin");
  }
  if (options.pd_mode != "auto" && options.pd_mode != "always" && options.pd_mode != "never") {
    return absl::InvalidArgumentError("--pd-mode: '" + options.pd_mode +
                                      "' is not one of auto, always, never");
  }
  auto impl = std::make_unique<Impl>();
  impl->o = std::move(options);
  impl->auth = Authenticator(impl->o.api_key);
  Impl* i = impl.get();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  b.AddListeningPort(i->o.grpc_address, grpc::InsecureServerCredentials(), &i->port);
  b.RegisterService(i);
  i->server = b.BuildAndStart();
  if (i->server == nullptr || i->port == 0) {
    return absl::UnavailableError("route: cannot listen on " + i->o.grpc_address);
  }
  if (i->o.http_port >= 0) {
    RouterHttpOptions ho;
    ho.host = i->o.http_host;
    ho.port = i->o.http_port;
    ho.metrics_without_key = i->o.metrics_without_key;
    absl::StatusOr<std::unique_ptr<RouterHttp>> h = RouterHttp::Start(ho, i);
    if (!h.ok()) {
      i->server->Shutdown();
      return h.status();
    }
    i->http = std::move(h).value();
    i->http_port = i->http->port();
  }
  i->membership_ = std::thread([i] { i->MembershipLoop(); });
  spdlog::info("route: gRPC on {} (port {}), HTTP /health on {}:{}, nodes [{}]{}",
               i->o.grpc_address, i->port, i->o.http_host, i->http_port,
               absl::StrJoin(i->o.nodes, ", "),
               i->o.nodes_dns.empty() ? "" : " + DNS " + i->o.nodes_dns);
  if (!i->o.port_file.empty()) {
    const std::string tmp = i->o.port_file + ".tmp";
    std::ofstream(tmp) << "{\"grpc\": " << i->port << ", \"http\": " << i->http_port << "}\n";
    std::rename(tmp.c_str(), i->o.port_file.c_str());
  }
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() { Shutdown(); }
int Router::grpc_port() const { return impl_->port; }
int Router::http_port() const { return impl_->http_port; }
void Router::Shutdown() { impl_->Stop(); }

void Router::WaitForSignal() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  int sig = 0;
  sigwait(&s, &sig);
  spdlog::info("route: {}: stopping", sig == SIGTERM ? "SIGTERM" : "SIGINT");
}

}  // namespace kvserve
