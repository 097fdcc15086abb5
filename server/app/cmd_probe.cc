// `kvserve probe`: GPU memory bandwidth (device copy, pinned host<->device)
// through kernels/cuda/probe.h, an error without CUDA; with --cpu, the
// host's memory-read bandwidth on -t threads (kernels/cpu/read_probe.h), the
// limit a batch-1 decode streams its weights against.
//
// Thread-safety: runs on the main thread.
#include <cstdint>
#include <cstdio>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "kernels/cpu/read_probe.h"
#include "kernels/cuda/probe.h"
#include "server/app/command.h"

namespace kvserve {
namespace {

class ProbeCommand final : public Command {
 public:
  explicit ProbeCommand(CLI::App* root)
      : Command(root->add_subcommand(
            "probe",
            "Memory bandwidth: GPU device copy and pinned host<->device (needs CUDA), or with "
            "--cpu the host's read bandwidth")) {
    app_->add_flag("--cpu", cpu_, "Measure the host's memory-read bandwidth on -t threads instead");
    app_->add_option("--mib", mib_, "MiB per copy")->capture_default_str();
    app_->add_option("--iters", iters_, "timed copies each way, or with --cpu read passes (best is reported)")
        ->capture_default_str();
  }

  int Run(const GlobalFlags& /*global*/) override {
    if (mib_ < 1 || iters_ < 1) {
      Die(absl::InvalidArgumentError("--mib and --iters must be >= 1"));
    }
    if (cpu_) {
      kernels::ReadProbe probe(static_cast<size_t>(mib_) << 20);
      ThreadPool* pool = &ThreadPool::Global();
      const double gbps = probe.BestGbps(pool, iters_);
      std::printf(
          "host memory read: %.1f GB/s (best of %d passes over %lld MiB, %d threads; huge pages "
          "advised, %s)\n",
          gbps, iters_, static_cast<long long>(probe.bytes() >> 20), pool->num_threads(),
          probe.HugePageNote().c_str());
      return 0;
    }
    auto r = ValueOrDie(cuda::ProbeBandwidth(static_cast<size_t>(mib_) << 20, iters_));
    std::printf("%s", cuda::FormatBandwidthReport(r).c_str());
    return 0;
  }

 private:
  int64_t mib_ = 1024;
  int iters_ = 10;
  bool cpu_ = false;
};

}  // namespace

std::unique_ptr<Command> NewProbeCommand(CLI::App* root) {
  return std::make_unique<ProbeCommand>(root);
}

}  // namespace kvserve
