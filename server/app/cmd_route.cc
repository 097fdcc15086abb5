// `kvserve route`: the KV-aware router in front of prefill, decode and both
// nodes (server/router/router.h, docs/disaggregation.md). It loads no model.
//
// Thread-safety: runs on the main thread, which ends up in sigwait.
#include <pthread.h>
#include <signal.h>

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "server/app/command.h"
#include "server/router/router.h"

namespace kvserve {
namespace {

class RouteCommand final : public Command {
 public:
  explicit RouteCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "route", "Route requests over prefill/decode/both nodes (KV-aware, same gRPC API)")) {
    app_->add_option("--grpc-address", o_.grpc_address, "gRPC listen address (port 0: any)")
        ->capture_default_str();
    app_->add_option("--http-host", o_.http_host,
                     "HTTP listen host (OpenAI routes, /health, /v1/models, /metrics)")
        ->capture_default_str();
    app_->add_option("--http-port", o_.http_port, "HTTP port (0: any, -1: none)")
        ->capture_default_str();
    app_->add_option("--port-file", o_.port_file, "Write {\"grpc\": P, \"http\": H} here");
    app_->add_option("--nodes", o_.nodes, "Nodes' gRPC addresses host:port (comma-separated)")
        ->delimiter(',');
    app_->add_option("--nodes-dns", o_.nodes_dns,
                     "name:port whose A records are nodes (a Kubernetes headless Service)");
    app_->add_option("--policy", o_.policy, "Placement over decode-capable nodes: kv, round-robin")
        ->capture_default_str();
    app_->add_option("--pd-mode", o_.pd_mode,
                     "Disaggregation: auto (by predicted seconds), always, never")
        ->capture_default_str();
    app_->add_option("--pd-min-remote-tokens", o_.pd_min_remote_tokens,
                     "Uncached prompt tokens below which a request runs entirely on decode")
        ->capture_default_str();
    app_->add_option("--pd-lease-ttl-ms", o_.lease_ttl_ms,
                     "Lease ttl asked of prefill nodes (0: theirs)")
        ->capture_default_str();
    app_->add_option("--pd-overlap", overlap_,
                     "Pull each prompt block while the prefill computes the rest (progressive "
                     "leases): on, off")
        ->check(CLI::IsMember({"on", "off"}))
        ->capture_default_str();
    app_->add_option("--api-key", o_.api_key, "Required from clients and sent to the nodes");
    app_->add_option("--metrics-auth", metrics_auth_,
                     "Whether GET /metrics needs the API key: key, or none (for Prometheus)")
        ->check(CLI::IsMember({"key", "none"}))
        ->capture_default_str();
    app_->add_option("--poll-interval-ms", o_.poll_ms,
                     "Milliseconds between polls of each node's NodeInfo and stats")
        ->check(CLI::Range(20, 600000))
        ->capture_default_str();
    app_->add_option("--test-stall", o_.test_stall,
                     "Fault-injection tests only: stop a request's thread once its lease is "
                     "granted or attached (granted, attached)")
        ->check(CLI::IsMember({"", "granted", "attached"}));
  }

  void BeforeThreads(CLI::App*) override {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGTERM);
    sigaddset(&s, SIGINT);
    pthread_sigmask(SIG_BLOCK, &s, nullptr);
  }

  int Run(const GlobalFlags&) override {
    o_.overlap = overlap_ == "on";
    o_.metrics_without_key = metrics_auth_ == "none";
    std::unique_ptr<Router> r = ValueOrDie(Router::Start(o_));
    r->WaitForSignal();
    r->Shutdown();
    return 0;
  }

 private:
  RouterOptions o_;
  std::string overlap_ = "off";
  std::string metrics_auth_ = "key";
};

}  // namespace

std::unique_ptr<Command> NewRouteCommand(CLI::App* root) {
  return std::make_unique<RouteCommand>(root);
}

}  // namespace kvserve
