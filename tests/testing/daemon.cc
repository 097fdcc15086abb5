#include "tests/testing/daemon.h"

#include <algorithm>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_models.h"

namespace kvserve::testing {

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const std::string& binary,
                                                      const std::vector<std::string>& global_args,
                                                      const std::vector<std::string>& serve_args) {
  return StartSubcommand(binary, global_args, "serve", serve_args);
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::StartSubcommand(
    const std::string& binary, const std::vector<std::string>& global_args,
    const std::string& subcommand, const std::vector<std::string>& serve_args) {
  static int counter = 0;
  std::unique_ptr<Daemon> d(new Daemon());
  d->dir_ = absl::StrCat(TempDir(), "/daemon-", getpid(), "-", counter++);
  std::filesystem::create_directories(d->dir_);
  const std::string port_file = d->dir_ + "/ports.json";
  std::vector<std::string> args = {binary};
  args.insert(args.end(), global_args.begin(), global_args.end());
  args.push_back(subcommand);
  // A caller that names its own gRPC address (a fixed port) keeps it.
  if (std::find(serve_args.begin(), serve_args.end(), "--grpc-address") == serve_args.end()) {
    args.push_back("--grpc-address");
    args.push_back("127.0.0.1:0");
  }
  for (const char* a : {"--http-port", "0", "--port-file"}) {
    args.push_back(a);
  }
  args.push_back(port_file);
  args.insert(args.end(), serve_args.begin(), serve_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = d->dir_ + "/log";
  d->pid_ = fork();
  if (d->pid_ < 0) return absl::InternalError("fork failed");
  if (d->pid_ == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
      d->pid_ = -1;
      return absl::InternalError(absl::StrCat("daemon exited at start-up:\n", d->Log()));
    }
    std::ifstream in(port_file);
    if (in.good()) {
      auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) {
        d->grpc_port_ = j["grpc"];
        d->http_port_ = j["http"];
        return d;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("daemon did not start listening within 60 s");
}

int Daemon::StopWith(int sig, double timeout_s) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return -1;
}

std::string Daemon::Log() const {
  std::ifstream in(dir_ + "/log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Daemon::~Daemon() { StopWith(SIGTERM, 10); }

std::unique_ptr<Daemon> StartServe(const std::string& binary, const std::string& model,
                                   const std::string& log_level,
                                   const std::vector<std::string>& serve_flags,
                                   const std::vector<std::string>& extra_flags, int threads) {
  std::vector<std::string> serve = serve_flags;
  serve.insert(serve.end(), extra_flags.begin(), extra_flags.end());
  auto d = Daemon::Start(
      binary, {"--log-level", log_level, "-t", std::to_string(threads), "-m", model}, serve);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? std::move(d).value() : nullptr;
}

CommandResult RunCommand(const std::string& command_line) {
  CommandResult r;
  FILE* p = popen(command_line.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace kvserve::testing
