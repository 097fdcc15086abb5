// The implementation of CacheControlService. What it owns and how it is used: the
// opening paragraph of server/service/cache_control_service.h.

#include "server/service/cache_control_service.h"
#include "server/service/admission.h"

#include <chrono>
#include <future>

#include "absl/strings/str_cat.h"
#include "server/service/tenants.h"

namespace kvserve {

using nlohmann::json;

namespace {

JsonReply ControlError(int status, std::string message, std::string param = "",
                std::string code = "invalid_request") {
  JsonReply r;
  r.status = status;
  r.body = json{{"error",
                 {{"message", std::move(message)},
                  {"type", status >= 500 ? "server_error" : "invalid_request_error"},
                  {"param", param.empty() ? json(nullptr) : json(param)},
                  {"code", std::move(code)}}}};
  return r;
}

JsonReply FromStatus(const absl::Status& s) {
  int code = 500;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      code = 400;
      break;
    case absl::StatusCode::kNotFound:
      code = 404;
      break;
    case absl::StatusCode::kFailedPrecondition:
      code = 409;
      break;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
      code = 503;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      code = 504;
      break;
    default:
      break;
  }
  return ControlError(code, std::string(s.message()));
}

// A few detokenized tokens may cut a UTF-8 sequence (or be byte tokens):
// such bytes become U+FFFD, so the report always serializes (a JSON dump
// of invalid UTF-8 throws).
std::string ValidUtf8(const std::string& s) {
  return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace))
      .get<std::string>();
}

json LeaseJson(const LeaseInfo& l) {
  return json{{"lease_id", l.id},     {"tenant", l.tenant},   {"tokens", l.tokens},
              {"blocks", l.blocks},   {"bytes", l.bytes},     {"ttl_s", l.ttl_s},
              {"remaining_s", l.remaining_s}, {"tier", l.tier}};
}

// The tenant the public prefixes' leases are held under.
constexpr char kPublicTenant[] = "__public__";

// Reads an optional positive number field.
std::optional<std::string> ReadNumber(const json& body, const char* name, double* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return absl::StrCat(name, " must be a number");
  *out = it->get<double>();
  return std::nullopt;
}

}  // namespace

std::string RetainAnswerJson(const RetainAnswer& a) {
  json j{{"outcome", RetainOutcomeName(a.outcome)},
         {"tokens_requested", a.tokens_requested},
         {"detail", a.detail}};
  if (a.outcome == RetainAnswer::Outcome::kRefused) {
    j["reason"] = a.reason;
  } else {
    j["reason"] = nullptr;
    j.update(LeaseJson(a.lease));
  }
  return j.dump();
}

CacheControlService::CacheControlService(ModelService* service, Engine* engine,
                                         std::shared_ptr<CacheControl> control)
    : service_(service), engine_(engine), control_(std::move(control)) {}

absl::StatusOr<PreparedRequest> CacheControlService::PrepareBody(const json& body,
                                                                 const CallerAuth& auth) {
  CompletionParams p;
  if (!body.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return absl::InvalidArgumentError("model must be a string");
    p.model = it->get<std::string>();
  }
  if (auto it = body.find("prompt"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return absl::InvalidArgumentError("prompt must be a string");
    p.prompt_text = it->get<std::string>();
  }
  for (const char* name : {"prompt_ids", "tokens_ids"}) {
    if (auto it = body.find(name); it != body.end() && !it->is_null()) {
      if (!it->is_array()) return absl::InvalidArgumentError(absl::StrCat(name, " must be an array of token ids"));
      std::vector<int32_t> ids;
      for (const json& t : *it) {
        if (!t.is_number_integer()) {
          return absl::InvalidArgumentError(absl::StrCat(name, " must be an array of token ids"));
        }
        ids.push_back(t.get<int32_t>());
      }
      p.prompt_ids = std::move(ids);
    }
  }
  if (auto it = body.find("messages"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) return absl::InvalidArgumentError("messages must be an array");
    std::vector<ChatMessage> msgs;
    for (const json& m : *it) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string()) {
        return absl::InvalidArgumentError(
            "messages: each message must be {\"role\": string, \"content\": string}");
      }
      msgs.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    p.messages = std::move(msgs);
  }
  if (auto it = body.find("cache_salt"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return absl::InvalidArgumentError("cache_salt must be a string");
    p.cache_salt = it->get<std::string>();
  }
  CallerAuth scope = auth;
  if (auth.admin) {
    // The operator may look at a tenant's scope.
    if (auto it = body.find("tenant"); it != body.end() && !it->is_null()) {
      if (!it->is_string()) return absl::InvalidArgumentError("tenant must be a string");
      scope.tenant = it->get<std::string>();
    }
  }
  p.max_tokens = 1;  // not run (or run for one token when warming)
  p.temperature = 0;
  // The scope rule of every request (server/service/admission.h); no
  // response cache is involved, so the operator's scope is empty.
  ScopeToCaller(scope, "", &p);
  return service_->Prepare(p);
}

absl::Status CacheControlService::Warm(PreparedRequest request) {
  request.cache.lookup = false;  // the response cache must not answer it
  request.cache.store = false;
  request.retain.reset();
  request.messages.reset();  // not a turn of a conversation
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> f = done->get_future();
  auto left = std::make_shared<std::atomic<int32_t>>(request.engine.n);
  absl::StatusOr<uint64_t> id =
      service_->Start(std::move(request), [done, left](const SeqEvent& ev) {
        if (ev.finish != FinishReason::kNone && left->fetch_sub(1) == 1) done->set_value();
      });
  if (!id.ok()) return id.status();
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    service_->Cancel(*id);
    return absl::DeadlineExceededError("warming the prompt did not finish within 120 s");
  }
  return absl::OkStatus();
}

JsonReply CacheControlService::Handle(std::string_view op, std::string_view body,
                                      const CallerAuth& auth) {
  json parsed = body.empty() ? json::object()
                             : json::parse(body.begin(), body.end(), nullptr, false);
  if (parsed.is_discarded()) return ControlError(400, "the request body is not valid JSON", "", "invalid_json");
  if (!parsed.is_object()) return ControlError(400, "the body must be a JSON object");
  if (op == "retain") return Retain(parsed, auth);
  if (op == "renew") return Renew(parsed, auth);
  if (op == "release") return Release(parsed, auth);
  if (op == "list") return List(auth);
  if (op == "explain") return Explain(parsed, auth);
  if (op == "public") return Public(parsed, auth);
  return ControlError(404, absl::StrCat("no cache-control call '", std::string(op),
                                 "' (retain, renew, release, list, explain, public)"),
               "", "not_found");
}

JsonReply CacheControlService::Retain(const json& body, const CallerAuth& auth) {
  double ttl = 300, tokens = 0;
  if (auto e = ReadNumber(body, "ttl_s", &ttl)) return ControlError(400, *e, "ttl_s");
  if (auto e = ReadNumber(body, "tokens", &tokens)) return ControlError(400, *e, "tokens");
  if (!(ttl > 0)) return ControlError(400, "ttl_s must be > 0 seconds", "ttl_s");
  if (tokens < 0) return ControlError(400, "tokens must be >= 0 (0: the whole prompt)", "tokens");
  bool warm = true;
  if (auto it = body.find("warm"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return ControlError(400, "warm must be a boolean", "warm");
    warm = it->get<bool>();
  }
  absl::StatusOr<PreparedRequest> prepared = PrepareBody(body, auth);
  if (!prepared.ok()) return FromStatus(prepared.status());
  RetainRequest rr;
  rr.tenant = prepared->cache_tenant;
  rr.salt = prepared->engine.cache_salt;
  rr.tokens = prepared->engine.prompt;
  rr.max_tokens = static_cast<int32_t>(tokens);
  rr.ttl_s = ttl;
  if (warm) {
    const int32_t want = rr.max_tokens > 0 ? std::min<int32_t>(rr.max_tokens, rr.tokens.size())
                                           : static_cast<int32_t>(rr.tokens.size());
    absl::StatusOr<int32_t> cached = engine_->PeekCachedPrefix(rr.salt, rr.tokens, want);
    if (!cached.ok()) return FromStatus(cached.status());
    if (*cached / std::max(1, engine_->options().block_size) <
        want / std::max(1, engine_->options().block_size)) {
      absl::Status s = Warm(*prepared);
      if (!s.ok()) return FromStatus(s);
    }
  }
  absl::StatusOr<RetainAnswer> answer = engine_->Retain(rr);
  if (!answer.ok()) return FromStatus(answer.status());
  const RetainAnswer& a = *answer;
  JsonReply r;
  r.body = json::parse(RetainAnswerJson(a));
  // Refused is an answer, not a malformed call: 409 with the reason.
  r.status = a.outcome == RetainAnswer::Outcome::kRefused
                 ? (a.reason == "bad_request" ? 400 : 409)
                 : 200;
  return r;
}

JsonReply CacheControlService::Renew(const json& body, const CallerAuth& auth) {
  auto it = body.find("lease_id");
  if (it == body.end() || !it->is_number_unsigned()) {
    return ControlError(400, "lease_id must be a lease id (a positive integer)", "lease_id");
  }
  const uint64_t id = it->get<uint64_t>();
  double ttl = 0;
  if (auto e = ReadNumber(body, "ttl_s", &ttl)) return ControlError(400, *e, "ttl_s");
  const std::optional<std::string> tenant =
      auth.admin ? std::nullopt : std::optional<std::string>(auth.tenant);
  absl::StatusOr<std::optional<LeaseInfo>> renewed = engine_->RenewLease(id, ttl, tenant);
  if (!renewed.ok()) return FromStatus(renewed.status());
  const std::optional<LeaseInfo>& l = *renewed;
  if (!l) return ControlError(404, absl::StrCat("no lease ", id), "lease_id", "lease_not_found");
  JsonReply r;
  r.body = LeaseJson(*l);
  return r;
}

JsonReply CacheControlService::Release(const json& body, const CallerAuth& auth) {
  auto it = body.find("lease_id");
  if (it == body.end() || !it->is_number_unsigned()) {
    return ControlError(400, "lease_id must be a lease id (a positive integer)", "lease_id");
  }
  const uint64_t id = it->get<uint64_t>();
  const std::optional<std::string> tenant =
      auth.admin ? std::nullopt : std::optional<std::string>(auth.tenant);
  absl::StatusOr<bool> released = engine_->ReleaseLease(id, tenant);
  if (!released.ok()) return FromStatus(released.status());
  if (!*released) return ControlError(404, absl::StrCat("no lease ", id), "lease_id", "lease_not_found");
  JsonReply r;
  r.body = json{{"released", true}, {"lease_id", id}};
  return r;
}

JsonReply CacheControlService::List(const CallerAuth& auth) {
  const std::optional<std::string> tenant =
      auth.admin ? std::nullopt : std::optional<std::string>(auth.tenant);
  absl::StatusOr<std::vector<LeaseInfo>> leases = engine_->ListLeases(tenant);
  if (!leases.ok()) return FromStatus(leases.status());
  JsonReply r;
  json arr = json::array();
  int64_t bytes = 0;
  for (const LeaseInfo& l : *leases) {
    arr.push_back(LeaseJson(l));
    bytes += l.bytes;
  }
  r.body = json{{"leases", arr}, {"retained_bytes", bytes}};
  if (!auth.admin) r.body["budget_bytes"] = control_->BudgetFor(auth.tenant);
  return r;
}

json CacheControlService::Report(const PreparedRequest& request, const CallerAuth& auth) {
  const std::vector<int32_t>& tokens = request.engine.prompt;
  const std::string salt = request.engine.cache_salt;
  const bool admin = auth.admin;
  const std::string tenant = request.cache_tenant;
  // Who may see which scope: the operator every one; a tenant (or an
  // unauthenticated caller without tenants) only its own tenant's salts.
  auto may_see = [admin, tenant](const std::string& scope) {
    return admin || TenantOfScope(scope) == tenant;
  };
  absl::StatusOr<CacheReport> explained = engine_->ExplainCache(salt, tokens, may_see);
  if (!explained.ok()) return json{{"error", std::string(explained.status().message())}};
  const CacheReport& rep = *explained;
  std::string reason = rep.reason;
  std::string detail = rep.detail;
  if (rep.reason == "diverged" && request.drift.drift) {
    reason = "template_drift";
    control_->CountTemplateDrift();
    detail = absl::StrCat("the chat template renders the earlier turns differently from the "
                          "cached turn (first difference at character ",
                          request.drift.char_pos, " of the prompt); ", rep.detail,
                          "; --chat-canonicalize-history renders history as cached");
  }
  auto text = [&](size_t from, size_t to) {
    from = std::min(from, tokens.size());
    to = std::min(to, tokens.size());
    if (from >= to) return std::string();
    return ValidUtf8(
        service_->Detokenize(std::vector<int32_t>(tokens.begin() + from, tokens.begin() + to))
            .value_or(""));
  };
  json j;
  j["prompt_tokens"] = rep.prompt_tokens;
  j["cached_tokens"] = rep.cached_tokens;
  j["cached_by_tier"] = {{"primary", rep.primary_tokens},
                         {"host", rep.host_tokens},
                         {"disk", rep.disk_tokens}};
  j["reason"] = reason;
  constexpr size_t kContext = 4;
  if (rep.diverged_at) {
    const size_t n = static_cast<size_t>(*rep.diverged_at);
    j["diverged_at"] = *rep.diverged_at;
    j["context_before"] = text(n >= kContext ? n - kContext : 0, n);
    j["context_after"] = text(n, n + kContext);
    std::vector<int32_t> cached(rep.cached_next.begin(),
                                rep.cached_next.begin() +
                                    std::min(rep.cached_next.size(), kContext));
    j["cached_after"] = cached.empty() ? "" : ValidUtf8(service_->Detokenize(cached).value_or(""));
  } else {
    j["diverged_at"] = nullptr;
    const size_t n = static_cast<size_t>(rep.cached_tokens);
    j["context_before"] = text(n >= kContext ? n - kContext : 0, n);
    j["context_after"] = text(n, n + kContext);
  }
  j["detail"] = detail;
  j["public_tokens"] = rep.public_tokens;
  if (rep.reason == "evicted" || rep.reason == "retained_expired") {
    j["evicted"] = {{"ago_s", rep.evicted_ago_s},
                    {"policy", rep.evicted_policy},
                    {"moved_to", rep.evicted_to}};
  }
  if (rep.reason == "window_dropped") j["window_dropped_tokens"] = rep.window_dropped_tokens;
  if (rep.reason == "scope_mismatch" && admin) {
    const std::string other_tenant = TenantOfScope(rep.other_scope);
    j["other_scope"] = {{"tenant", other_tenant}, {"tokens", rep.other_scope_tokens}};
  }
  return j;
}

std::string CacheControlService::ReportJson(const PreparedRequest& request, const CallerAuth& auth) {
  // The report quotes detokenized prompt pieces (context_before/after),
  // which can cut a UTF-8 character (byte tokens): replace, never throw.
  return Report(request, auth).dump(-1, ' ', false, json::error_handler_t::replace);
}

JsonReply CacheControlService::Explain(const json& body, const CallerAuth& auth) {
  absl::StatusOr<PreparedRequest> prepared = PrepareBody(body, auth);
  if (!prepared.ok()) return FromStatus(prepared.status());
  JsonReply r;
  r.body = Report(*prepared, auth);
  if (r.body.contains("error")) return ControlError(504, r.body["error"].get<std::string>());
  return r;
}

JsonReply CacheControlService::Public(const json& body, const CallerAuth& auth) {
  if (!auth.admin) {
    return ControlError(403, "marking a prefix public takes the operator's key (--api-key)", "",
                 "forbidden");
  }
  bool make_public = true;
  if (auto it = body.find("public"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return ControlError(400, "public must be a boolean", "public");
    make_public = it->get<bool>();
  }
  double ttl = control_->options().max_ttl_s;
  if (auto e = ReadNumber(body, "ttl_s", &ttl)) return ControlError(400, *e, "ttl_s");
  if (body.contains("messages") && !body["messages"].is_null()) {
    return ControlError(400, "public takes prompt (text) or prompt_ids, not messages", "messages");
  }
  if (body.contains("cache_salt") && !body["cache_salt"].is_null()) {
    return ControlError(400, "a public prefix belongs to no scope: drop cache_salt", "cache_salt");
  }
  CallerAuth none;  // tokenized without any tenant's scope
  absl::StatusOr<PreparedRequest> prepared = PrepareBody(body, none);
  if (!prepared.ok()) return FromStatus(prepared.status());
  absl::StatusOr<std::string> salt = engine_->PublicSalt();
  if (!salt.ok()) return FromStatus(salt.status());
  const std::string public_salt = *salt;
  if (public_salt.empty()) return ControlError(409, "the prefix cache is off", "", "prefix_cache_disabled");
  prepared->engine.cache_salt = public_salt;
  const std::vector<int32_t> tokens = prepared->engine.prompt;
  JsonReply r;
  if (!make_public) {
    // The public leases go too (every public prefix's: one lease per
    // marking, not told apart yet).
    absl::StatusOr<int32_t> unmarked = engine_->UnmarkPublic(tokens, kPublicTenant);
    if (!unmarked.ok()) return FromStatus(unmarked.status());
    r.body = json{{"public", false}, {"blocks_unmarked", *unmarked}};
    return r;
  }
  if (absl::Status s = Warm(*prepared); !s.ok()) return FromStatus(s);
  const int32_t bs = engine_->options().block_size;
  // Marked and pinned in one engine step: every tenant relies on it.
  RetainRequest rr;
  rr.tenant = kPublicTenant;
  rr.salt = public_salt;
  rr.tokens = tokens;
  rr.ttl_s = ttl;
  absl::StatusOr<PublicMarking> marking = engine_->MarkPublic(std::move(rr));
  if (!marking.ok()) return FromStatus(marking.status());
  const int32_t marked = marking->marked_blocks;
  const RetainAnswer& a = marking->retention;
  r.body = json{{"public", true},
                {"public_tokens", marked * bs},
                {"prompt_tokens", tokens.size()},
                {"retention", json::parse(RetainAnswerJson(a))}};
  if (marked == 0) {
    r.status = 409;
    r.body["detail"] = absl::StrCat("the prompt has no full block of ", bs,
                                    " tokens to share (or its warm-up was evicted)");
  }
  return r;
}

}  // namespace kvserve
