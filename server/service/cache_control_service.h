// CacheControlService: the admin API of cache control (docs/cache-control.md)
// as JSON in, JSON out, shared by the HTTP routes (/admin/cache/...) and the
// gRPC CacheControl call, so both speak the same fields and messages:
//
//   retain   {prompt | messages | prompt_ids, cache_salt?, tokens?, ttl_s?, warm?}
//   renew    {lease_id, ttl_s?}
//   release  {lease_id}
//   list     {}
//   explain  {prompt | messages | prompt_ids, cache_salt?, model?}
//   public   {prompt | prompt_ids, public?: true|false, ttl_s?}   (operator only)
//
// A tenant's key sees and touches its own scope and leases only; the
// operator's key (--api-key) sees all. Every call runs its cache part on the
// engine thread through the Engine's named KV operations (Engine::Retain,
// ExplainCache, ...) and waits for it.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "nlohmann/json.hpp"
#include "scheduler/cache_control.h"
#include "server/service/auth.h"
#include "server/service/model_service.h"

namespace kvserve {

struct JsonReply {
  int status = 200;  // HTTP status; the gRPC front end maps it
  nlohmann::json body;
};

// The JSON of a retention answer (the admin call's body and the reply's
// kvserve_cache_control.retention).
std::string RetainAnswerJson(const RetainAnswer& a);

class CacheControlService {
 public:
  CacheControlService(ModelService* service, Engine* engine, std::shared_ptr<CacheControl> control);

  // op: retain | renew | release | list | explain | public.
  JsonReply Handle(std::string_view op, std::string_view body, const CallerAuth& auth);
  // The cache report of a prepared request (the OpenAI field cache_report),
  // as JSON text; the explain call's body.
  std::string ReportJson(const PreparedRequest& request, const CallerAuth& auth);

 private:
  JsonReply Retain(const nlohmann::json& body, const CallerAuth& auth);
  JsonReply Renew(const nlohmann::json& body, const CallerAuth& auth);
  JsonReply Release(const nlohmann::json& body, const CallerAuth& auth);
  JsonReply List(const CallerAuth& auth);
  JsonReply Explain(const nlohmann::json& body, const CallerAuth& auth);
  JsonReply Public(const nlohmann::json& body, const CallerAuth& auth);
  // The prompt of a body as the engine would see it (Prepare: tenant
  // scope, chat template, canonicalization).
  absl::StatusOr<PreparedRequest> PrepareBody(const nlohmann::json& body, const CallerAuth& auth);
  nlohmann::json Report(const PreparedRequest& request, const CallerAuth& auth);
  // Runs the prompt through the engine for one token so its blocks are
  // cached (retain/public with warm).
  absl::Status Warm(PreparedRequest request);

  ModelService* service_;
  Engine* engine_;
  std::shared_ptr<CacheControl> control_;
};

}  // namespace kvserve
