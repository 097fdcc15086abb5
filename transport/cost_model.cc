#include "transport/cost_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvserve::transport {

LinkModel PcieGen5x16() {
  return {"pcie-gen5-x16", 2.0e-6, 1.0e-6, 52e9};
}
LinkModel NvLink4() { return {"nvlink4", 1.0e-6, 0.3e-6, 370e9}; }
LinkModel Infiniband400G() {
  return {"ib-roce-400g", 3.0e-6, 1.5e-6, 46e9};
}

double EstimateTransferSeconds(const LinkModel& link, uint64_t bytes,
                               uint64_t messages) {
  return link.latency_s + static_cast<double>(messages) * link.per_message_s +
         static_cast<double>(bytes) / link.bandwidth_bytes_per_s;
}

absl::StatusOr<LinkModel> FitLinkModel(std::string name,
                                       absl::Span<const LinkSample> samples) {
  if (samples.size() < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("need at least 3 samples, got ", samples.size()));
  }
  // Normal equations for t = a*1 + b*messages + c*bytes. Columns are scaled
  // to O(1) first so the 3x3 solve is well conditioned.
  double max_m = 1, max_b = 1;
  for (const LinkSample& s : samples) {
    max_m = std::max(max_m, static_cast<double>(s.messages));
    max_b = std::max(max_b, static_cast<double>(s.bytes));
  }
  double a[3][4] = {};
  for (const LinkSample& s : samples) {
    const double x[3] = {1.0, s.messages / max_m, s.bytes / max_b};
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) a[i][j] += x[i] * x[j];
      a[i][3] += x[i] * s.seconds;
    }
  }
  for (int col = 0; col < 3; ++col) {
    int pivot = col;
    for (int r = col + 1; r < 3; ++r) {
      if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
    }
    if (std::fabs(a[pivot][col]) < 1e-12) {
      return absl::InvalidArgumentError(
          "samples do not vary bytes and message counts independently");
    }
    std::swap(a[col], a[pivot]);
    for (int r = 0; r < 3; ++r) {
      if (r == col) continue;
      double f = a[r][col] / a[col][col];
      for (int k = col; k < 4; ++k) a[r][k] -= f * a[col][k];
    }
  }
  LinkModel link;
  link.name = std::move(name);
  link.latency_s = std::max(0.0, a[0][3] / a[0][0]);
  link.per_message_s = std::max(0.0, a[1][3] / a[1][1] / max_m);
  double per_byte = a[2][3] / a[2][2] / max_b;
  if (per_byte <= 0) {
    return absl::InvalidArgumentError("fit gives non-positive time per byte");
  }
  link.bandwidth_bytes_per_s = 1.0 / per_byte;
  return link;
}

TransferDecision ChooseTransferOrRecompute(const LinkModel& link,
                                           uint64_t bytes, uint64_t messages,
                                           uint64_t tokens,
                                           double recompute_tokens_per_s) {
  TransferDecision d;
  d.transfer_s = EstimateTransferSeconds(link, bytes, messages);
  d.recompute_s = recompute_tokens_per_s > 0
                      ? static_cast<double>(tokens) / recompute_tokens_per_s
                      : INFINITY;
  d.transfer = d.transfer_s <= d.recompute_s;
  return d;
}

}  // namespace kvserve::transport
