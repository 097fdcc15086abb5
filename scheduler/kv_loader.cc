#include "scheduler/kv_loader.h"

#include <algorithm>
#include <utility>

namespace kvserve {
namespace {

// Both halves of a chained load: done when both are, failed when either
// failed, the sources summed.
class ChainedLoad final : public KvLoad {
 public:
  ChainedLoad(std::shared_ptr<KvLoad> a, std::shared_ptr<KvLoad> b, absl::Status start)
      : a_(std::move(a)), b_(std::move(b)), start_(std::move(start)) {}
  bool Done() override { return a_->Done() && (b_ == nullptr || b_->Done()); }
  absl::Status status() override {
    if (!start_.ok()) return start_;
    absl::Status s = a_->status();
    if (s.ok() && b_ != nullptr) s = b_->status();
    return s;
  }
  KvLoadSources sources() override {
    KvLoadSources s = a_->sources();
    if (b_ != nullptr) {
      const KvLoadSources t = b_->sources();
      s.host_tokens += t.host_tokens;
      s.disk_tokens += t.disk_tokens;
      s.lossy_tokens += t.lossy_tokens;
    }
    return s;
  }

 private:
  std::shared_ptr<KvLoad> a_, b_;
  absl::Status start_;
};

}  // namespace

int32_t ChainedKvLoader::Split(std::string_view salt, absl::Span<const int32_t> tokens,
                               int32_t from, int32_t limit, double recompute_seconds_per_token) {
  const int32_t n1 = std::max(0, std::min(first_->LookupWorthLoading(salt, tokens, from, limit,
                                                                     recompute_seconds_per_token),
                                          limit - from));
  last_from_ = from;
  last_first_ = n1;
  const int32_t n2 = from + n1 < limit ? second_->Lookup(salt, tokens, from + n1, limit) : 0;
  return n1 + std::max(0, std::min(n2, limit - from - n1));
}

int32_t ChainedKvLoader::Lookup(std::string_view salt, absl::Span<const int32_t> tokens,
                                int32_t from, int32_t limit) {
  return Split(salt, tokens, from, limit, 0);
}

int32_t ChainedKvLoader::LookupWorthLoading(std::string_view salt, absl::Span<const int32_t> tokens,
                                            int32_t from, int32_t limit,
                                            double recompute_seconds_per_token) {
  return Split(salt, tokens, from, limit, recompute_seconds_per_token);
}

std::shared_ptr<KvLoad> ChainedKvLoader::Start(const KvLoadTarget& t) {
  const int32_t end = t.first_slot + t.num_tokens;
  int32_t n1 = t.first_slot == last_from_
                   ? std::min(last_first_, t.num_tokens)
                   : std::min(first_->Lookup(t.salt, t.tokens, t.first_slot, end), t.num_tokens);
  last_from_ = -1;
  if (n1 <= 0) return second_->Start(t);
  KvLoadTarget a = t;
  a.num_tokens = n1;
  std::shared_ptr<KvLoad> first = first_->Start(a);
  if (first == nullptr) {
    // The first loader lost its blocks since the lookup (a tier evicted
    // them): the second may still supply the whole range.
    if (second_->Lookup(t.salt, t.tokens, t.first_slot, end) >= t.num_tokens) {
      return second_->Start(t);
    }
    return nullptr;
  }
  if (n1 == t.num_tokens) {
    // The first covered it all: whatever the second holds for these tokens
    // (a prefill node's lease) is not needed.
    second_->Forgo(t.salt, t.tokens, t.first_slot, end);
    return first;
  }
  KvLoadTarget b = t;
  b.first_slot = t.first_slot + n1;
  b.num_tokens = t.num_tokens - n1;
  std::shared_ptr<KvLoad> second = second_->Start(b);
  if (second == nullptr) {
    return std::make_shared<ChainedLoad>(
        std::move(first), nullptr,
        absl::UnavailableError("the second half of a chained KV load did not start"));
  }
  return std::make_shared<ChainedLoad>(std::move(first), std::move(second), absl::OkStatus());
}

}  // namespace kvserve
