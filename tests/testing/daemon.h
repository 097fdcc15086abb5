// Daemon: a real `kvserve serve` child process on free loopback ports, for
// end-to-end tests. The destructor stops it (SIGTERM, then SIGKILL) so no
// test leaves a process behind.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvserve::testing {

class Daemon {
 public:
  // Starts `binary [global_args] serve --grpc-address 127.0.0.1:0
  // --http-port 0 --port-file F [serve_args]` and waits until it listens.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const std::string& binary,
                                                       const std::vector<std::string>& global_args,
                                                       const std::vector<std::string>& serve_args);
  // The same for another subcommand that takes --grpc-address, --http-port
  // and --port-file (e.g. `route`).
  static absl::StatusOr<std::unique_ptr<Daemon>> StartSubcommand(
      const std::string& binary, const std::vector<std::string>& global_args,
      const std::string& subcommand, const std::vector<std::string>& args);
  ~Daemon();

  int grpc_port() const { return grpc_port_; }
  int http_port() const { return http_port_; }
  pid_t pid() const { return pid_; }
  // Sends `sig` and waits up to timeout_s for the exit; returns the exit
  // status (-1 if killed by a signal or still running, then SIGKILLed).
  int StopWith(int sig, double timeout_s);
  // Everything the daemon wrote to stdout/stderr so far.
  std::string Log() const;

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  int grpc_port_ = 0;
  int http_port_ = 0;
  std::string dir_;
};

// Starts `binary --log-level log_level -t threads -m model serve
// [serve_flags] [extra_flags]` (the per-test defaults, then the test's own).
// On failure records a non-fatal failure naming the status and returns
// null, so a test writes `ASSERT_TRUE(d)`.
std::unique_ptr<Daemon> StartServe(const std::string& binary, const std::string& model,
                                   const std::string& log_level,
                                   const std::vector<std::string>& serve_flags,
                                   const std::vector<std::string>& extra_flags = {},
                                   int threads = 1);

// Runs a shell command line and returns its exit status (-1 when it did not
// exit normally) and everything it wrote to stdout (add 2>&1 for stderr).
struct CommandResult {
  int exit_code = -1;
  std::string out;
};
CommandResult RunCommand(const std::string& command_line);

}  // namespace kvserve::testing
