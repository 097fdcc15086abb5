// Admission: the one path a generation request takes from a front end into
// the engine, whichever protocol carried it. Each step has one home:
//
//   1. who is asking     Authenticator::Check (service/auth.h); the front end
//                        only fetches the header or metadata it reads from
//   2. parse             the protocol's own reader into CompletionParams
//                        (frontend/openai_request.cc, frontend/grpc_server.cc)
//   3. scope             ScopeToCaller below: the response-cache and prefix-
//                        cache scopes come from the caller, never the body
//   4. validate, render, tokenize
//                        ModelService::Prepare (the engine request's rules are
//                        scheduler/request.h's ValidateEngineRequest)
//   5. cache report      Admission::Prepare, when the request asks for one
//                        (service/cache_control_service.h)
//   6. response cache, submit
//                        ModelService::Start (a cached reply is replayed,
//                        anything else goes to Engine::Submit)
//
// The HTTP and gRPC front ends, the prefill node's Prefill call and the
// cache-control admin API (explain, retain, warm) all come through here, so a
// request is scoped, validated and reported the same way whichever door it
// used. Front ends stay adapters: they parse, call Prepare and Start, and
// turn the events into their protocol; errors are absl::Status, mapped once
// by frontend/status_map.h.
//
// Thread-safety: immutable after construction; every method may be called
// from any thread.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/service/auth.h"
#include "server/service/model_service.h"

namespace kvserve {

class CacheControlService;

// Step 3. Sets the request's response-cache scope (`tenant`) and prefix-cache
// tenant (`cache_tenant`) from the caller: a tenant's key scopes both to that
// tenant (its cache_salt then only narrows the prefix scope,
// service/tenants.h); the operator's scope is `operator_scope` (the operator
// key's fingerprint, TenantFromApiKey, or "" where no response cache is
// involved). Whatever the body said about either is overwritten.
void ScopeToCaller(const CallerAuth& who, std::string_view operator_scope, CompletionParams* p);

class Admission {
 public:
  // `cache_control` may be null (no cache reports then: a request asking for
  // one gets it empty, as before cache control existed). `api_key` is the
  // operator's key, whose fingerprint scopes the operator's response cache.
  Admission(ModelService* service, const std::string& api_key,
            CacheControlService* cache_control = nullptr);

  // Steps 3-5. `deadline`, when given, tightens the engine request's own
  // (a gRPC call's deadline). Errors name the field (InvalidArgument), the
  // model (NotFound), or say the server is draining (Unavailable).
  [[nodiscard]] absl::StatusOr<PreparedRequest> Prepare(
      CompletionParams params, const CallerAuth& who,
      std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) const;

  // Step 6: see ModelService::Start.
  [[nodiscard]] absl::StatusOr<uint64_t> Start(PreparedRequest request, StreamSink sink,
                                               CacheOutcome* outcome = nullptr) const;
  void Cancel(uint64_t request_id) const;

  ModelService* service() const { return service_; }
  const std::string& operator_scope() const { return operator_scope_; }

 private:
  ModelService* service_;
  std::string operator_scope_;
  CacheControlService* cache_control_;
};

}  // namespace kvserve
