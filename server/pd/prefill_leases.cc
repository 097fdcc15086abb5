// The prefill side of the P/D node (PdNode::Impl's members of this role;
// the node: server/pd/pd_node.h, its members: server/pd/pd_node_impl.h).
// It owns the lease table (held_): Prefill runs a prompt through the engine
// and grants a lease on its full cached blocks, pinned through the engine's
// named KV operations (PinPrefix; a progressive lease follows the running
// prefill with PinCachedBlocks and reports blocks as they are committed);
// RenewLease checks a lease against its grant (digests) and restarts its
// ttl; ReleaseLease and expiry (ExpireLeases, from housekeeping) give the
// blocks back (Unpin, ReleaseBlocks); DebugEarlyFree is the test hook that
// frees them early. Before a whole lease is granted its blocks are synced to
// staging (device_staging.cc) and re-encoded for the wire (wire_codec.cc).

#include <future>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "proto/kvserve.pb.h"
#include "server/frontend/grpc_server.h"
#include "server/frontend/openai_request.h"
#include "server/frontend/status_map.h"
#include "server/pd/pd_node_impl.h"
#include "spdlog/spdlog.h"

namespace kvserve {

grpc::Status PdNode::Impl::Prefill(grpc::ServerContext* ctx, const pb::PrefillRequest* req,
                                   pb::Lease* out) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (role_ != PdRole::kPrefill) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("Prefill: this node's role is ", PdRoleName(role_),
                                     ", not prefill"));
  }
  // The request in the form the decode node receives it, read by the same
  // code, so the prompt's tokens (a rendered chat template included) are
  // the same on both nodes.
  absl::StatusOr<CompletionParams> params;
  if (!req->chat_request().empty()) {
    v1::ChatRequest cr;
    if (!cr.ParseFromString(req->chat_request())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "chat_request: not a serialized kvserve.v1.ChatRequest");
    }
    params = ChatRequestToParams(cr);
  } else if (!req->openai_chat_body().empty()) {
    OpenAiRequest o;
    if (std::optional<ApiError> err = ParseOpenAiRequest(req->openai_chat_body(), true, &o)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("openai_chat_body: ", err->message));
    }
    params = std::move(o.params);
  } else {
    v1::GenerateRequest gr;
    if (!gr.ParseFromString(req->generate_request())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "generate_request: not a serialized kvserve.v1.GenerateRequest");
    }
    params = GenerateRequestToParams(gr);
  }
  if (!params.ok()) return ToGrpc(params.status());
  // Scoped and validated as the decode node's front ends do (the caller is
  // the operator: P/D calls take the operator's key).
  absl::StatusOr<PreparedRequest> prepared = admission_->Prepare(*std::move(params), CallerAuth{});
  if (!prepared.ok()) return ToGrpc(prepared.status());
  EngineRequest er = std::move(prepared->engine);
  const std::vector<int32_t> tokens = er.prompt;
  const std::string salt = er.cache_salt;
  er.params.max_tokens = 1;  // the prompt's KV is what this node makes
  er.n = 1;
  er.draft_tokens.clear();
  er.kv_policy = KvPolicy{};
  er.grammar = nullptr;  // the decode node samples, under its own Prepare's grammar
  const auto deadline = PdClock::now() + std::chrono::seconds(120);
  er.deadline = deadline;
  // Overlap: lease the blocks before they exist and report each as the
  // prefill commits it. Host pools moved in their own codec only (a
  // staged device pool or a wire codec needs a copy per block after its
  // write; those leases are granted whole).
  const int32_t full_blocks =
      block_size_ > 0 ? (static_cast<int32_t>(tokens.size()) - 1) / block_size_ : 0;
  // KV cache groups (a hybrid model): whole leases only (a progressive
  // lease follows group 0's index alone).
  const bool hybrid = !group_windows_.empty();
  if (req->progressive() && !device_pool_ && !wire_ && !hybrid && full_blocks >= 1) {
    return GrantProgressive(*req, std::move(er), tokens, salt, full_blocks, out);
  }
  if (hybrid && full_blocks >= 1) {
    // The lease ends at full_blocks * block_size and the decode node
    // computes from there; its window groups need the blocks their window
    // reaches from that end. A prompt's end is where the prefix cache keeps
    // a window's blocks, so this node prefills the prompt up to one token
    // past the lease's end: that boundary's window is exactly the lease's.
    er.prompt.resize(static_cast<size_t>(full_blocks) * block_size_ + 1);
  }
  auto finished = std::make_shared<std::promise<SeqEvent>>();
  auto fired = std::make_shared<std::atomic<bool>>(false);
  std::future<SeqEvent> fin = finished->get_future();
  absl::StatusOr<uint64_t> id =
      engine_->Submit(std::move(er), [finished, fired](const SeqEvent& e) {
        if (e.finish != FinishReason::kNone && !fired->exchange(true)) finished->set_value(e);
      });
  if (!id.ok()) return ToGrpc(id.status());
  while (fin.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
    if (ctx->IsCancelled() || PdClock::now() > deadline) {
      engine_->Cancel(*id);
      return grpc::Status(grpc::StatusCode::CANCELLED, "Prefill: cancelled before it finished");
    }
  }
  const SeqEvent done = fin.get();
  if (done.finish == FinishReason::kCancelled || done.finish == FinishReason::kDeadline) {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        absl::StrCat("Prefill: the prompt's prefill ended ",
                                     FinishReasonName(done.finish)));
  }
  // Pin the prompt's full blocks (all but the last token's block: decode
  // computes the last token itself, its logits pick the first token),
  // once the device's writes to them landed.
  absl::StatusOr<PinnedPrefix> pinned =
      engine_->PinPrefix(salt, tokens, full_blocks * block_size_);
  if (absl::IsDeadlineExceeded(pinned.status())) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the engine did not answer");
  }
  if (!pinned.ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat("Prefill: ", pinned.status().message()));
  }
  PinnedPrefix& p = *pinned;
  // Every block the lease names: group 0's, then the other groups'.
  std::vector<BlockHandle> moved = p.blocks;
  for (const PinnedPrefix::Group& g : p.groups) {
    moved.insert(moved.end(), g.blocks.begin(), g.blocks.end());
  }
  if (absl::Status s = SyncStaging(moved); !s.ok()) {
    engine_->Unpin(p.pin);
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat("Prefill: copying the leased KV blocks to the transport's "
                                     "host staging failed: ",
                                     s.message()));
  }
  EncodeForWire(moved);
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) {
    engine_->Unpin(p.pin);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the node is shutting down");
  }
  pb::Lease& l = *out;
  StartLease(salt, req->ttl_ms(), &l);
  const size_t leased_tokens = p.blocks.size() * static_cast<size_t>(block_size_);
  for (size_t i = 0; i < leased_tokens; ++i) l.add_tokens(tokens[i]);
  for (const BlockHandle& h : p.blocks) {
    l.add_block_ids(h.id);
    l.add_generations(h.generation);
  }
  if (!p.blocks.empty()) {
    for (const PinnedPrefix::Group& g : p.groups) {
      pb::LeaseGroup* lg = l.add_groups();
      lg->set_first_block(g.first_block);
      for (const BlockHandle& h : g.blocks) {
        lg->add_block_ids(h.id);
        lg->add_generations(h.generation);
      }
    }
  }
  l.set_prefill_cached_tokens(done.cached_tokens);
  if (wire_) {
    l.set_wire_dtype(std::string(kernels::KvDTypeName(wire_dtype_)));
    l.set_wire_block_bytes(wire_block_bytes_);
  }
  l.set_digest(LeaseDigest(l));
  Held h;
  h.pin = std::move(p.pin);
  h.held_blocks = p.held_blocks;
  h.digest = l.digest();
  h.ttl = std::chrono::milliseconds(l.ttl_ms());
  h.expiry = PdClock::now() + h.ttl;
  held_.emplace(l.transfer_id(), std::move(h));
  ++leases_granted_;
  return grpc::Status::OK;
}

grpc::Status PdNode::Impl::GrantProgressive(const pb::PrefillRequest& req, EngineRequest er,
                                            const std::vector<int32_t>& tokens,
                                            const std::string& salt, int32_t full_blocks,
                                            pb::Lease* out) {
  auto progress = std::make_shared<Progress>();
  progress->tokens.assign(tokens.begin(),
                          tokens.begin() + static_cast<int64_t>(full_blocks) * block_size_);
  progress->salt = salt;
  progress->full_blocks = full_blocks;
  // The request's end (engine thread): the next progress answer matches
  // once more and tells whether every block made it.
  std::weak_ptr<Progress> weak = progress;
  absl::StatusOr<uint64_t> id = engine_->Submit(std::move(er), [this, weak](const SeqEvent& e) {
    if (e.finish == FinishReason::kNone) return;
    std::shared_ptr<Progress> p = weak.lock();
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (p->finished) return;
      p->finished = true;
      if (e.finish == FinishReason::kCancelled || e.finish == FinishReason::kDeadline) {
        p->error = absl::AbortedError(
            absl::StrCat("the prompt's prefill ended ", FinishReasonName(e.finish)));
      }
    }
    cv_.notify_all();
  });
  if (!id.ok()) return ToGrpc(id.status());
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) {
    engine_->Cancel(*id);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Prefill: the node is shutting down");
  }
  progress->request_id = *id;
  progress->granted = PdClock::now();
  pb::Lease& l = *out;
  StartLease(salt, req.ttl_ms(), &l);
  for (int32_t t : progress->tokens) l.add_tokens(t);
  l.set_progressive(true);
  l.set_digest(LeaseDigest(l));
  Held h;
  h.digest = l.digest();
  h.ttl = std::chrono::milliseconds(l.ttl_ms());
  h.expiry = PdClock::now() + h.ttl;
  h.progress = std::move(progress);
  held_.emplace(l.transfer_id(), std::move(h));
  ++leases_granted_;
  ++progressive_leases_;
  return grpc::Status::OK;
}

void PdNode::Impl::StartLease(const std::string& salt, uint32_t ttl_ms, pb::Lease* l) const {
  l->set_transfer_id(RandomNonZero());
  l->set_node_id(node_id_);
  l->set_incarnation(incarnation_);
  l->set_grpc_address(grpc_address_);
  l->set_ucx_address(ucx_address_);
  l->set_kv_region(kv_descriptor_);
  l->set_generation_region(gen_descriptor_);
  *l->mutable_layout() = layout_;
  l->set_cache_salt(salt);
  const double ttl = ttl_ms > 0 ? ttl_ms / 1000.0 : flags_.lease_ttl;
  l->set_ttl_ms(static_cast<uint32_t>(ttl * 1000));
}

void PdNode::Impl::PostRematch(uint64_t id, const std::shared_ptr<Progress>& p) {
  p->rematch_pending = true;
  p->next_rematch = PdClock::now() + std::chrono::milliseconds(2);
  auto finished = std::make_shared<bool>(false);  // as seen before the pin
  engine_->PinCachedBlocks(
      p->salt, p->tokens, p->full_blocks * block_size_,
      [this, p, finished] { return RematchBegin(p, finished.get()); },
      [this, id, p, finished](const absl::Status& s, std::vector<BlockHandle>* hs) {
        RematchEnd(id, p, *finished, s, hs);
      });
}

bool PdNode::Impl::RematchBegin(const std::shared_ptr<Progress>& p, bool* finished) {
  std::lock_guard<std::mutex> lock(mu_);
  if (p->released || p->early_freed) {
    p->rematch_pending = false;
    cv_.notify_all();
    return false;
  }
  *finished = p->finished;
  return true;
}

void PdNode::Impl::RematchEnd(uint64_t id, const std::shared_ptr<Progress>& p, bool finished,
                              const absl::Status& pinned, std::vector<BlockHandle>* hs) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    p->rematch_pending = false;
    if (!pinned.ok()) {
      if (p->error.ok()) {
        p->error = absl::AbortedError(
            "the prefill node has no prefix cache to follow the prefill in");
      }
    } else if (auto it = held_.find(id);
               !p->released && !p->early_freed && it != held_.end() &&
               it->second.progress == p && p->error.ok()) {
      const size_t have = p->blocks.size();
      bool same = hs->size() >= have;
      for (size_t i = 0; same && i < have; ++i) {
        same = (*hs)[i].id == p->blocks[i].id && (*hs)[i].generation == p->blocks[i].generation;
      }
      if (!same) {
        p->error = absl::InternalError(
            "the prefix cache no longer holds the lease's reported blocks");
      } else {
        // The earlier blocks' references are held already: this pin's go.
        p->blocks.insert(p->blocks.end(), hs->begin() + static_cast<int64_t>(have), hs->end());
        hs->resize(have);
      }
      if (finished && p->error.ok()) {
        p->final = true;
        if (static_cast<int32_t>(p->blocks.size()) < p->full_blocks) {
          p->error = absl::AbortedError(absl::StrCat(
              "the prefill finished with ", p->blocks.size(), " of the lease's ",
              p->full_blocks, " blocks in the prefix cache (the rest were evicted before "
              "they could be pinned)"));
        }
      }
    }
  }
  cv_.notify_all();
}

grpc::Status PdNode::Impl::AnswerProgress(std::unique_lock<std::mutex>* lock, uint64_t id,
                                          std::shared_ptr<Progress> p,
                                          const pb::RenewLeaseRequest& req,
                                          pb::RenewLeaseResponse* out) {
  const int32_t have = req.have_blocks();
  if (have < 0 || have > p->full_blocks) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("have_blocks: ", have, " of a lease of ", p->full_blocks,
                                     " blocks"));
  }
  const auto until =
      PdClock::now() + std::chrono::milliseconds(std::min<uint32_t>(req.wait_ms(), 1000));
  // --pd-test-progress-delay S (tests only): block i of n is shown from
  // (i + 1) / n of S after the grant, as a prefill that slow would.
  const double reveal = flags_.test_progress_delay;
  auto shown = [&](PdClock::time_point now) {
    if (reveal <= 0 || p->early_freed) return p->blocks.size();
    const double f = std::chrono::duration<double>(now - p->granted).count() / reveal;
    return std::min(p->blocks.size(), static_cast<size_t>(f * p->full_blocks));
  };
  size_t n = 0;
  bool complete = false;
  for (;;) {
    if (!p->error.ok()) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          absl::StrCat("transfer id ", id, ": ", p->error.message()));
    }
    if (p->released) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("transfer id ", id, " was released"));
    }
    const auto now = PdClock::now();
    n = shown(now);
    complete = (p->final || p->early_freed) && n == p->blocks.size();
    if (static_cast<int32_t>(n) > have || complete || now >= until) break;
    if (!p->rematch_pending && now >= p->next_rematch) PostRematch(id, p);
    auto wake = p->rematch_pending ? until : std::min(until, p->next_rematch);
    if (reveal > 0 && n < p->blocks.size()) {
      wake = std::min(wake, p->granted + std::chrono::duration_cast<PdClock::duration>(
                                             std::chrono::duration<double>(
                                                 reveal * static_cast<double>(n + 1) /
                                                 p->full_blocks)));
    }
    cv_.wait_until(*lock, wake);
  }
  for (size_t i = static_cast<size_t>(have); i < n; ++i) {
    out->add_block_ids(p->blocks[i].id);
    out->add_generations(p->blocks[i].generation);
  }
  out->set_complete(complete);
  ++progress_answers_;
  return grpc::Status::OK;
}

grpc::Status PdNode::Impl::RenewLease(grpc::ServerContext* ctx, const pb::RenewLeaseRequest* req,
                                      pb::RenewLeaseResponse* out) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  std::unique_lock<std::mutex> lock(mu_);
  if (grpc::Status s = CheckIncarnation(req->incarnation(), "RenewLease"); !s.ok()) return s;
  auto it = held_.find(req->transfer_id());
  if (it == held_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("unknown transfer id ", req->transfer_id(),
                                     " (released, expired, or never granted by node ", node_id_,
                                     ")"));
  }
  if (it->second.digest != req->digest() && req->endpoint_digest() != 0 &&
      req->endpoint_digest() != EndpointDigest(ucx_address_, kv_descriptor_, gen_descriptor_)) {
    ++forged_endpoints_;
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("lease digest mismatch for transfer id ", req->transfer_id(),
                     ": the lease's UCX worker address or KV/generation region descriptors "
                     "are not node ",
                     node_id_, "'s (the lease was altered or forged)"));
  }
  if (it->second.digest != req->digest()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("lease digest mismatch for transfer id ",
                                     req->transfer_id(),
                                     ": the lease was altered or forged (blocks, generations, "
                                     "tokens or salt differ from the grant)"));
  }
  it->second.expiry = PdClock::now() + it->second.ttl;
  out->set_ttl_ms(static_cast<uint32_t>(it->second.ttl.count()));
  if (req->progress()) {
    if (it->second.progress == nullptr) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("transfer id ", req->transfer_id(),
                                       " is a whole lease: its blocks are in the lease"));
    }
    return AnswerProgress(&lock, req->transfer_id(), it->second.progress, *req, out);
  }
  return grpc::Status::OK;
}

grpc::Status PdNode::Impl::ReleaseLease(grpc::ServerContext* ctx,
                                        const pb::ReleaseLeaseRequest* req,
                                        pb::ReleaseLeaseResponse* out) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  std::lock_guard<std::mutex> lock(mu_);
  if (grpc::Status s = CheckIncarnation(req->incarnation(), "ReleaseLease"); !s.ok()) {
    ++stale_releases_;
    return s;
  }
  auto it = held_.find(req->transfer_id());
  if (it == held_.end()) {
    if (std::find(gone_.begin(), gone_.end(), req->transfer_id()) != gone_.end()) {
      ++duplicate_releases_;
      out->set_released(false);
      return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("unknown transfer id ", req->transfer_id(),
                                     " (never granted by node ", node_id_, ")"));
  }
  ReleaseHeld(&it->second);
  held_.erase(it);
  RememberGone(req->transfer_id());
  ++leases_released_;
  out->set_released(true);
  return grpc::Status::OK;
}

grpc::Status PdNode::Impl::DebugEarlyFree(grpc::ServerContext* ctx,
                                          const pb::ReleaseLeaseRequest* req,
                                          pb::ReleaseLeaseResponse* out) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (!flags_.test_hooks) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "DebugEarlyFree needs --pd-test-hooks");
  }
  std::shared_ptr<KvPin> pin;
  std::vector<BlockHandle> pinned;  // a progressive lease's references
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (grpc::Status s = CheckIncarnation(req->incarnation(), "DebugEarlyFree"); !s.ok()) {
      return s;
    }
    auto it = held_.find(req->transfer_id());
    const std::shared_ptr<Progress>& p = it != held_.end() ? it->second.progress : nullptr;
    if (it == held_.end() || (p == nullptr && it->second.pin == nullptr) ||
        (p != nullptr && p->early_freed)) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("unknown transfer id ", req->transfer_id()));
    }
    if (p != nullptr) {
      if (!p->final) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("transfer id ", req->transfer_id(),
                                         ": the progressive lease is not complete yet"));
      }
      p->early_freed = true;  // its answers stay as they were
      pinned = p->blocks;
    }
    // The lease record stays (Renew still succeeds), as with a buggy
    // node that freed the blocks but kept answering for them.
    pin = std::move(it->second.pin);
    ++early_frees_;
  }
  // Free the blocks (drop the lease's pin and the prefix cache's), then
  // reuse every free block with other bytes: what a decode node reads
  // from them now is someone else's KV.
  (void)engine_->DiscardAndScribbleForTest(std::move(pin), std::move(pinned));
  out->set_released(true);
  return grpc::Status::OK;
}

void PdNode::Impl::ReleaseHeld(Held* h) {
  if (Progress* p = h->progress.get(); p != nullptr && !p->released) {
    p->released = true;
    if (!p->finished && engine_ != nullptr) engine_->Cancel(p->request_id);
    if (!p->early_freed && !p->blocks.empty() && engine_ != nullptr) {
      // Its references (RematchEnd's pins; the block list stays for
      // answers in flight, which see `released` first).
      engine_->ReleaseBlocks(p->blocks);
    }
  }
  if (engine_ != nullptr) engine_->Unpin(std::move(h->pin));
  h->pin = nullptr;
}

void PdNode::Impl::RememberGone(uint64_t id) {
  gone_.push_back(id);
  if (gone_.size() > 4096) gone_.pop_front();
}

void PdNode::Impl::ExpireLeases(PdClock::time_point now) {
for (auto it = held_.begin(); it != held_.end();) {
    if (now < it->second.expiry) {
      ++it;
      continue;
    }
    spdlog::info("pd: lease of transfer {} expired unreleased; freeing {} blocks", it->first,
                 it->second.pin ? it->second.held_blocks : 0);
    ReleaseHeld(&it->second);
    RememberGone(it->first);
    ++leases_expired_;
    it = held_.erase(it);
  }
}

}  // namespace kvserve
