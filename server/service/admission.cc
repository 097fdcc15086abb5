// The implementation of Admission. What it owns and how it is used: the
// opening paragraph of server/service/admission.h.

#include "server/service/admission.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/service/cache_control_service.h"

namespace kvserve {

void ScopeToCaller(const CallerAuth& who, std::string_view operator_scope, CompletionParams* p) {
  if (who.tenant.empty()) {
    p->tenant = std::string(operator_scope);
    p->cache_tenant.clear();
    return;
  }
  // A tenant key: the response cache and the prefix cache are the tenant's.
  p->tenant = absl::StrCat("tenant:", who.tenant);
  p->cache_tenant = who.tenant;
}

Admission::Admission(ModelService* service, const std::string& api_key,
                     CacheControlService* cache_control)
    : service_(service), operator_scope_(TenantFromApiKey(api_key)), cache_control_(cache_control) {}

absl::StatusOr<PreparedRequest> Admission::Prepare(
    CompletionParams params, const CallerAuth& who,
    std::optional<std::chrono::steady_clock::time_point> deadline) const {
  ScopeToCaller(who, operator_scope_, &params);
  absl::StatusOr<PreparedRequest> prepared = service_->Prepare(params);
  if (!prepared.ok()) return prepared.status();
  if (deadline) prepared->engine.deadline = std::min(prepared->engine.deadline, *deadline);
  if (prepared->cache_report && cache_control_ != nullptr && prepared->notes) {
    // What the cache holds for this prompt as it is admitted.
    std::string report = cache_control_->ReportJson(*prepared, who);
    std::lock_guard<std::mutex> lock(prepared->notes->mu);
    prepared->notes->report_json = std::move(report);
  }
  return prepared;
}

absl::StatusOr<uint64_t> Admission::Start(PreparedRequest request, StreamSink sink,
                                          CacheOutcome* outcome) const {
  return service_->Start(std::move(request), std::move(sink), outcome);
}

void Admission::Cancel(uint64_t request_id) const { service_->Cancel(request_id); }

}  // namespace kvserve
