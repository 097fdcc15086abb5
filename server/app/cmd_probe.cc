// `kvserve probe`: GPU memory bandwidth (device copy, pinned host<->device)
// through kernels/cuda/probe.h; an error without CUDA.
//
// Thread-safety: runs on the main thread.
#include <cstdint>
#include <cstdio>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "kernels/cuda/probe.h"
#include "server/app/command.h"

namespace kvserve {
namespace {

class ProbeCommand final : public Command {
 public:
  explicit ProbeCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "probe", "GPU memory bandwidth: device copy and pinned host<->device (needs CUDA)")) {
    app_->add_option("--mib", mib_, "MiB per copy")->capture_default_str();
    app_->add_option("--iters", iters_, "timed copies each way (best is reported)")
        ->capture_default_str();
  }

  int Run(const GlobalFlags& /*global*/) override {
    if (mib_ < 1 || iters_ < 1) {
      Die(absl::InvalidArgumentError("--mib and --iters must be >= 1"));
    }
    auto r = ValueOrDie(cuda::ProbeBandwidth(static_cast<size_t>(mib_) << 20, iters_));
    std::printf("%s", cuda::FormatBandwidthReport(r).c_str());
    return 0;
  }

 private:
  int64_t mib_ = 1024;
  int iters_ = 10;
};

}  // namespace

std::unique_ptr<Command> NewProbeCommand(CLI::App* root) {
  return std::make_unique<ProbeCommand>(root);
}

}  // namespace kvserve
