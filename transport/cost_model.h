// Cost model of moving bytes over a link:
//   time = latency + messages * per_message_overhead + bytes / bandwidth
// Latency is paid once per batch (pipelined messages overlap it), the
// per-message term is what makes many small KV pieces slower than one large
// copy, and bandwidth bounds large payloads. Later issues use it to decide
// between shipping KV from a prefill node and recomputing it.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvserve::transport {

struct LinkModel {
  std::string name;
  double latency_s = 0;
  double per_message_s = 0;
  double bandwidth_bytes_per_s = 1;
};

// Effective (not line-rate) figures from vendor data and published
// measurements; good to within tens of percent, which is all the
// transfer-vs-recompute decision needs.
LinkModel PcieGen5x16();      // ~52 GB/s effective of 64 GB/s
LinkModel NvLink4();          // H100 NVLink, ~370 GB/s effective per direction
LinkModel Infiniband400G();   // NDR 400G / RoCE 400G, ~46 GB/s effective

// Seconds to move `bytes` in `messages` messages.
double EstimateTransferSeconds(const LinkModel& link, uint64_t bytes,
                               uint64_t messages);

// One observation: moving `bytes` as `messages` messages took `seconds`.
struct LinkSample {
  uint64_t bytes;
  uint64_t messages;
  double seconds;
};
// Least-squares fit of the three coefficients to samples from the actual
// link (e.g. kvserve-transfer-bench). Needs at least three samples that vary
// bytes and messages independently; coefficients are clamped non-negative.
absl::StatusOr<LinkModel> FitLinkModel(std::string name,
                                       absl::Span<const LinkSample> samples);

struct TransferDecision {
  bool transfer = false;  // true: ship the KV; false: recompute it
  double transfer_s = 0;
  double recompute_s = 0;
};
// Compares shipping `bytes` of KV (in `messages` pieces) with recomputing
// `tokens` tokens of prefill at `recompute_tokens_per_s`.
TransferDecision ChooseTransferOrRecompute(const LinkModel& link,
                                           uint64_t bytes, uint64_t messages,
                                           uint64_t tokens,
                                           double recompute_tokens_per_s);

}  // namespace kvserve::transport
