// The decode side of the P/D node (PdNode::Impl's members of this role;
// the node: server/pd/pd_node.h, its members: server/pd/pd_node_impl.h).
// It owns the attached leases (attached_) and the pull jobs (jobs_):
// AttachLease checks a lease's shape and layout, confirms it with the
// prefill node (RemoteRenew) and connects to its UCX worker; as the engine's
// KvLoader it offers the leased tokens at admission and starts a pull; the
// pull thread (PullLoop, RunJob, Pull) GETs the blocks into the pool's own
// fresh blocks, then reads the prefill node's generations back (the fence)
// and fails the load if any block was freed meanwhile, renewing the lease
// while it runs; housekeeping (TendAttachedLeases) renews leases of
// requests waiting for admission and gives back unclaimed ones. Blocks
// re-encoded on the wire are decoded by wire_codec.cc.

#include <algorithm>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/frontend/status_map.h"
#include "server/pd/pd_node_impl.h"
#include "spdlog/spdlog.h"

namespace kvserve {

grpc::Status PdNode::Impl::AttachLease(grpc::ServerContext* ctx, const pb::Lease* lease,
                                       pb::AttachLeaseResponse*) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (role_ != PdRole::kDecode) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("AttachLease: this node's role is ", PdRoleName(role_),
                                     ", not decode"));
  }
  if (absl::Status s = CheckLeaseShape(*lease); !s.ok()) return ToGrpc(s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Idempotent, keyed by (transfer_id, incarnation): a repeated attach
    // (a retried RPC) is a no-op, not a second claim on the lease.
    for (const auto& a : attached_) {
      if (a->lease.transfer_id() == lease->transfer_id() &&
          a->lease.incarnation() == lease->incarnation()) {
        ++duplicate_attaches_;
        return grpc::Status::OK;
      }
    }
    // Out of blocks for good: this pool could never hold the pull (a
    // transiently full pool only delays admission; the engine waits).
    if (LeaseBlocks(*lease) > num_blocks_) {
      ++leases_refused_no_blocks_;
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("AttachLease: the lease has ", LeaseBlocks(*lease),
                       " KV blocks; this decode node's pool has ", num_blocks_));
    }
  }
  // The prefill node confirms the lease is held exactly as described (a
  // forged or altered one fails here) and restarts its ttl.
  absl::StatusOr<uint32_t> ttl = RemoteRenew(*lease);
  if (!ttl.ok()) return ToGrpc(ttl.status());
  if (absl::Status s = EnsurePeer(*lease); !s.ok()) {
    RemoteRelease(*lease, "decode could not connect");
    return ToGrpc(s);
  }
  auto a = std::make_shared<Attached>();
  a->lease = *lease;
  a->attached = a->received = PdClock::now();
  a->ttl = std::chrono::milliseconds(*ttl);
  {
    std::lock_guard<std::mutex> lock(mu_);
    attached_.push_back(std::move(a));
    ++leases_attached_;
  }
  return grpc::Status::OK;
}

int32_t PdNode::Impl::Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                             int32_t limit) {
  std::lock_guard<std::mutex> lock(mu_);
  int32_t end = 0;
  FindLease(salt, tokens, from, limit, &end);
  return end > from ? end - from : 0;
}

void PdNode::Impl::Forgo(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                         int32_t limit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    int32_t end = 0;
    std::shared_ptr<Attached> a = FindLease(salt, tokens, from, limit, &end);
    if (a == nullptr) return;
    a->forgone = true;
  }
  cv_.notify_all();
}

std::shared_ptr<KvLoad> PdNode::Impl::Start(const KvLoadTarget& t) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    int32_t end = 0;
    std::shared_ptr<Attached> a =
        FindLease(t.salt, t.tokens, t.first_slot, t.first_slot + t.num_tokens, &end);
    if (a == nullptr || end != t.first_slot + t.num_tokens || shutdown_) return nullptr;
    job->lease = a;
    job->first_block = t.first_slot / block_size_;
    const int32_t end_block = end / block_size_;
    const int32_t* ids = t.view.block_ids + t.view.seq_block_offsets[0];
    for (int32_t b = job->first_block; b < end_block; ++b) job->local_ids.push_back(ids[b]);
    // KV cache groups: each other group's blocks the load writes (a window
    // group's from where its window reaches, PrepareGroupLoad), pulled from
    // the same lease blocks of that group's table on the prefill node.
    const pb::Lease& l = a->lease;
    if (static_cast<int32_t>(t.groups.size()) != l.groups_size()) return nullptr;
    for (int i = 0; i < l.groups_size(); ++i) {
      const pb::LeaseGroup& lg = l.groups(i);
      const KvLoadTarget::Group& tg = t.groups[static_cast<size_t>(i)];
      const int32_t first = std::max(t.first_slot, tg.first_slot) / block_size_;
      const int32_t* gids = tg.view.block_ids + tg.view.seq_block_offsets[0];
      for (int32_t b = first; b < end_block; ++b) {
        const int32_t k = b - lg.first_block();
        if (k < 0 || k >= lg.block_ids_size()) return nullptr;  // not leased: recompute
        job->local_ids.push_back(gids[b]);
        job->group_remote.push_back(lg.block_ids(k));
        job->group_gens.push_back(lg.generations(k));
      }
    }
    a->consumed = true;
  }
  job->load = std::make_shared<PullLoad>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(job);
  }
  cv_.notify_all();
  return job->load;
}

int32_t PdNode::Impl::LeaseBlocks(const pb::Lease& l) const {
  int32_t n = l.progressive() ? l.tokens_size() / block_size_ : l.block_ids_size();
  for (const pb::LeaseGroup& g : l.groups()) n += g.block_ids_size();
  return n;
}

bool PdNode::Impl::GroupsCover(const pb::Lease& l, int32_t end) const {
  for (int i = 0; i < l.groups_size(); ++i) {
    const int32_t w = group_windows_[static_cast<size_t>(i) + 1];
    const int32_t first = w > 0 ? std::max(0, end - w + 1) / block_size_ : 0;
    if (first < l.groups(i).first_block()) return false;
  }
  return true;
}

absl::Status PdNode::Impl::CheckLeaseShape(const pb::Lease& l) const {
  if (l.transfer_id() == 0) return absl::InvalidArgumentError("lease.transfer_id: missing (0)");
  if (l.incarnation() == 0) return absl::InvalidArgumentError("lease.incarnation: missing (0)");
  if (l.grpc_address().empty()) {
    return absl::InvalidArgumentError("lease.grpc_address: empty");
  }
  if (l.block_ids_size() != l.generations_size()) {
    return absl::InvalidArgumentError(absl::StrCat("lease.generations: ", l.generations_size(),
                                                   " entries for ", l.block_ids_size(),
                                                   " block_ids"));
  }
  if (static_cast<size_t>(l.block_ids_size()) > kMaxLeaseBlocks ||
      static_cast<size_t>(l.tokens_size()) > kMaxLeaseBlocks * block_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease.block_ids: ", std::max(l.block_ids_size(), LeaseBlocks(l)),
                     " blocks, at most ", kMaxLeaseBlocks));
  }
  if (const std::string d = KvLayoutDifference(layout_, l.layout()); !d.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV layout mismatch with prefill node ", l.node_id(), ": ", d));
  }
  if (!l.wire_dtype().empty()) {
    kernels::KvDType w;
    if (!kernels::ParseKvDType(l.wire_dtype(), &w)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.wire_dtype: unknown codec '", l.wire_dtype(), "'"));
    }
    if (l.wire_block_bytes() != kernels::KvBlockBytes(w, shape_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.wire_block_bytes: ", l.wire_block_bytes(), " for ", l.wire_dtype(),
                       " blocks of this layout, which take ", kernels::KvBlockBytes(w, shape_)));
    }
    if (device_pool_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "prefill node ", l.node_id(), " sends blocks re-encoded as ", l.wire_dtype(),
          " (--kv-wire-dtype), which this decode node decodes on the host; its KV pool is "
          "in device memory"));
    }
  } else if (l.wire_block_bytes() != 0) {
    return absl::InvalidArgumentError("lease.wire_block_bytes: set without lease.wire_dtype");
  }
  if (l.progressive()) {
    // Tokens of whole blocks; the blocks known at the grant, at most those.
    if (l.tokens_size() % block_size_ != 0 || l.block_ids_size() > LeaseBlocks(l)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.tokens: ", l.tokens_size(), " tokens of a progressive lease with ",
                       l.block_ids_size(), " blocks of ", block_size_,
                       " known (whole blocks, at least the known ones)"));
    }
    if (!l.wire_dtype().empty()) {
      return absl::InvalidArgumentError(
          "lease.wire_dtype: a progressive lease moves the pool's own bytes");
    }
  } else if (l.tokens_size() != l.block_ids_size() * block_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease.tokens: ", l.tokens_size(), " tokens for ", l.block_ids_size(),
                     " blocks of ", block_size_));
  }
  // KV cache groups (the layouts matched above, so both nodes have these
  // groups): a lease with blocks names every other group's.
  const int want_groups =
      group_windows_.empty() ? 0 : static_cast<int>(group_windows_.size()) - 1;
  if (want_groups == 0 && l.groups_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease.groups: ", l.groups_size(), " KV cache groups for a layout with one group"));
  }
  if (want_groups > 0 && l.progressive()) {
    return absl::InvalidArgumentError(
        "lease.progressive: a lease on KV cache groups (a hybrid-attention model) is granted "
        "whole");
  }
  if (want_groups > 0 && l.block_ids_size() > 0 && l.groups_size() != want_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease.groups: ", l.groups_size(), " groups besides group 0; the layout has ",
        want_groups));
  }
  for (int i = 0; i < l.groups_size(); ++i) {
    const pb::LeaseGroup& g = l.groups(i);
    if (g.block_ids_size() != g.generations_size() || g.first_block() < 0 ||
        g.first_block() + g.block_ids_size() != l.block_ids_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lease.groups[", i, "]: blocks [", g.first_block(), ", ",
          g.first_block() + g.block_ids_size(), ") with ", g.generations_size(),
          " generations; group 0 has ", l.block_ids_size(), " blocks (a group's run ends there)"));
    }
    const int32_t w = group_windows_[static_cast<size_t>(i) + 1];
    const int32_t end = l.block_ids_size() * block_size_;
    if ((w > 0 ? std::max(0, end - w + 1) / block_size_ : 0) < g.first_block()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lease.groups[", i, "].first_block: ", g.first_block(), " leaves out blocks the ",
          w > 0 ? absl::StrCat("window of ", w, " tokens") : std::string("full attention"),
          " of group ", i + 1, " reaches from the lease's end"));
    }
    for (int j = 0; j < g.block_ids_size(); ++j) {
      if (g.block_ids(j) < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("lease.groups[", i, "].block_ids[", j, "]: negative id ",
                         g.block_ids(j)));
      }
    }
  }
  for (int i = 0; i < l.block_ids_size(); ++i) {
    // Block ids index the prefill node's pool, which has the same layout
    // but maybe another size; the transport checks the range exactly.
    if (l.block_ids(i) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease.block_ids[", i, "]: negative id ", l.block_ids(i)));
    }
  }
  if (LeaseBlocks(l) > 0 && (l.ucx_address().empty() || l.kv_region().empty() ||
                                 l.generation_region().empty())) {
    return absl::InvalidArgumentError(
        "lease.ucx_address/kv_region/generation_region: empty");
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> PdNode::Impl::RemoteRenew(const pb::Lease& l) {
  grpc::ClientContext c;
  AddAuth(&c);
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  // A prefill node restarted on the same address: wait out the channel's
  // reconnect backoff (within the deadline) instead of failing at once.
  c.set_wait_for_ready(true);
  pb::RenewLeaseResponse resp;
  grpc::Status s = StubFor(l.grpc_address())->RenewLease(&c, RenewRequestFor(l), &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("prefill node ", l.node_id(), " (", l.grpc_address(),
                                     "): ", s.error_message()));
  }
  return resp.ttl_ms();
}

pb::RenewLeaseRequest PdNode::Impl::RenewRequestFor(const pb::Lease& l) {
  pb::RenewLeaseRequest r;
  r.set_transfer_id(l.transfer_id());
  r.set_incarnation(l.incarnation());
  r.set_digest(LeaseDigest(l));
  r.set_endpoint_digest(EndpointDigest(l));
  return r;
}

void PdNode::Impl::RemoteRelease(const pb::Lease& l, const std::string& reason) {
  grpc::ClientContext c;
  AddAuth(&c);
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  pb::ReleaseLeaseRequest r;
  r.set_transfer_id(l.transfer_id());
  r.set_incarnation(l.incarnation());
  r.set_reason(reason);
  pb::ReleaseLeaseResponse resp;
  grpc::Status s = StubFor(l.grpc_address())->ReleaseLease(&c, r, &resp);
  if (!s.ok()) {
    spdlog::debug("pd: release of transfer {} at {}: {}", l.transfer_id(), l.grpc_address(),
                  s.error_message());
  }
}

std::string PdNode::Impl::PeerKey(const pb::Lease& l) {
  return absl::StrCat(l.node_id(), "#", l.incarnation());
}

absl::Status PdNode::Impl::EnsurePeer(const pb::Lease& l) {
  if (LeaseBlocks(l) == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(peer_mu_);
  if (peers_.count(PeerKey(l)) > 0) return absl::OkStatus();
  Peer p;
  absl::StatusOr<kt::PeerId> id = transport_->Connect(l.ucx_address());
  if (!id.ok()) {
    return absl::UnavailableError(absl::StrCat("prefill node ", l.node_id(),
                                               ": UCX connect: ", id.status().message()));
  }
  p.id = *id;
  absl::StatusOr<kt::RemoteRegionId> kv = transport_->ImportRegion(p.id, l.kv_region());
  absl::StatusOr<kt::RemoteRegionId> gen =
      kv.ok() ? transport_->ImportRegion(p.id, l.generation_region()) : kv;
  if (!kv.ok() || !gen.ok()) {
    (void)transport_->Disconnect(p.id);
    return absl::InvalidArgumentError(
        absl::StrCat("lease.kv_region/generation_region of prefill node ", l.node_id(), ": ",
                     (kv.ok() ? gen : kv).status().message()));
  }
  p.kv = *kv;
  p.gen = *gen;
  peers_[PeerKey(l)] = p;
  return absl::OkStatus();
}

void PdNode::Impl::DropPeer(const pb::Lease& l) {
  std::lock_guard<std::mutex> lock(peer_mu_);
  auto it = peers_.find(PeerKey(l));
  if (it == peers_.end()) return;
  (void)transport_->ReleaseRemoteRegion(it->second.kv);
  (void)transport_->ReleaseRemoteRegion(it->second.gen);
  (void)transport_->Disconnect(it->second.id);
  peers_.erase(it);
}

std::shared_ptr<PdNode::Impl::Attached> PdNode::Impl::FindLease(std::string_view salt,
                                                                absl::Span<const int32_t> tokens,
                                                                int32_t from, int32_t limit,
                                                                int32_t* end) {
  *end = 0;
  if (block_size_ <= 0 || from % block_size_ != 0) return nullptr;
  std::shared_ptr<Attached> best;
  for (const auto& a : attached_) {
    if (a->consumed || a->lease.cache_salt() != salt) continue;
    int32_t e = std::min<int32_t>(a->lease.tokens_size(), limit);
    e = std::min<int32_t>(e, static_cast<int32_t>(tokens.size()));
    e -= e % block_size_;
    if (e <= from || e <= *end) continue;
    // KV cache groups: a supply that ends before the lease's end needs
    // window blocks from before the lease's (each window reaches back from
    // where the supply ends).
    if (a->lease.groups_size() > 0 && !GroupsCover(a->lease, e)) continue;
    if (!std::equal(tokens.begin(), tokens.begin() + e, a->lease.tokens().begin())) continue;
    best = a;
    *end = e;
  }
  return best;
}

absl::Status PdNode::Impl::KeepAlive(Attached* a) {
  const auto now = PdClock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (now < a->received + a->ttl / 3) return absl::OkStatus();
  }
  absl::StatusOr<uint32_t> ttl = RemoteRenew(a->lease);
  if (!ttl.ok()) {
    return absl::Status(ttl.status().code(),
                        absl::StrCat("lease renewal during the pull of transfer ",
                                     a->lease.transfer_id(), ": ", ttl.status().message()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  a->received = now;
  a->ttl = std::chrono::milliseconds(*ttl);
  ++lease_renewals_;
  return absl::OkStatus();
}

absl::Status PdNode::Impl::WaitDrained(kt::TransferId t, Attached* a,
                                       PdClock::time_point deadline) {
  absl::Status s;
  for (;;) {
    const auto now = PdClock::now();
    if (now >= deadline) {
      s = absl::DeadlineExceededError(
          absl::StrCat("the pull took longer than --pd-transfer-timeout ",
                       flags_.transfer_timeout, " s"));
      break;
    }
    const auto slice = std::min<PdClock::duration>(deadline - now, std::chrono::milliseconds(100));
    s = transport_->Wait(t, absl::FromChrono(slice));
    if (!absl::IsDeadlineExceeded(s)) break;
    absl::StatusOr<bool> moving = transport_->Poll(t);
    if (!moving.ok()) {
      s = moving.status();  // the transfer itself failed (timed out, peer gone)
      break;
    }
    if (*moving) {
      s = absl::OkStatus();
      break;
    }
    s = KeepAlive(a);
    if (!s.ok()) break;
  }
  if (!s.ok()) {
    // A failed transfer has not necessarily stopped: cancel and wait
    // until the backend no longer touches our blocks before they go back.
    (void)transport_->Cancel(t);
    for (;;) {
      absl::StatusOr<bool> p = transport_->Poll(t);
      if (!p.ok() || *p) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  (void)transport_->ReleaseTransfer(t);
  return s;
}

absl::StatusOr<PdNode::Impl::ProgressAnswer> PdNode::Impl::RemoteProgress(Attached* a, int32_t have,
                                                                          uint32_t wait_ms) {
  const pb::Lease& l = a->lease;
  grpc::ClientContext c;
  AddAuth(&c);
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms) +
                 std::chrono::seconds(3));
  pb::RenewLeaseRequest r = RenewRequestFor(l);
  r.set_progress(true);
  r.set_have_blocks(have);
  r.set_wait_ms(wait_ms);
  pb::RenewLeaseResponse resp;
  const auto sent = PdClock::now();
  grpc::Status s = StubFor(l.grpc_address())->RenewLease(&c, r, &resp);
  if (!s.ok()) {
    return absl::Status(
        static_cast<absl::StatusCode>(s.error_code()),
        absl::StrCat("progress of transfer ", l.transfer_id(), " from prefill node ", l.node_id(),
                     " (", l.grpc_address(), "): ", s.error_message()));
  }
  if (resp.block_ids_size() != resp.generations_size() ||
      have + resp.block_ids_size() > l.tokens_size() / block_size_) {
    return absl::InternalError(absl::StrCat("progress of transfer ", l.transfer_id(), ": ",
                                            resp.block_ids_size(), " blocks past ", have,
                                            " for a lease of ", l.tokens_size() / block_size_));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    a->received = sent;
    a->ttl = std::chrono::milliseconds(resp.ttl_ms());
  }
  ProgressAnswer out;
  out.block_ids.assign(resp.block_ids().begin(), resp.block_ids().end());
  out.generations.assign(resp.generations().begin(), resp.generations().end());
  out.complete = resp.complete();
  return out;
}

absl::Status PdNode::Impl::ReadBlocks(const Job& job, const Peer& peer,
                                      const std::vector<int32_t>& remote, int32_t k0, int32_t k1,
                                      bool wire, uint64_t read_bytes,
                                      PdClock::time_point deadline) {
  const kt::RegionId local_region = wire ? wire_staging_.id : kv_region_.id;
  std::vector<kt::TransferOp> ops;
  for (int32_t k = k0; k < k1; ++k) {
    const uint64_t local = wire ? static_cast<uint64_t>(k) * read_bytes
                                : static_cast<uint64_t>(job.local_ids[k]) * block_bytes_;
    const uint64_t rem = static_cast<uint64_t>(remote[job.first_block + k]) * read_bytes;
    if (!ops.empty() && ops.back().local_offset + ops.back().length == local &&
        ops.back().remote_offset + ops.back().length == rem) {
      ops.back().length += read_bytes;  // contiguous on both sides: one op
      continue;
    }
    ops.push_back({local_region, local, peer.kv, rem, read_bytes});
  }
  absl::StatusOr<kt::TransferId> t = transport_->PostTransfer(peer.id, kt::Direction::kRead, ops);
  if (!t.ok()) return t.status();
  return WaitDrained(*t, job.lease.get(), deadline);
}

absl::Status PdNode::Impl::Pull(const Job& job, PullStats* st) {
  const pb::Lease& l = job.lease->lease;
  Attached* a = job.lease.get();
  if (flags_.test_pull_delay > 0) {
    // Test hook (--pd-test-pull-delay): a link slower than the lease's
    // ttl. The lease must stay alive meanwhile (not counted against
    // --pd-transfer-timeout).
    const auto until = PdClock::now() + std::chrono::duration_cast<PdClock::duration>(
                                            std::chrono::duration<double>(flags_.test_pull_delay));
    while (PdClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      RETURN_IF_ERROR(KeepAlive(a));
    }
  }
  const auto timeout = std::chrono::duration_cast<PdClock::duration>(
      std::chrono::duration<double>(flags_.transfer_timeout));
  auto deadline = PdClock::now() + timeout;
  RETURN_IF_ERROR(KeepAlive(a));
  PdClock::time_point received;
  std::chrono::milliseconds ttl;
  {
    std::lock_guard<std::mutex> lock(mu_);
    received = a->received;
    ttl = a->ttl;
  }
  const auto margin = std::chrono::milliseconds(std::min<int64_t>(2000, ttl.count() / 4));
  if (PdClock::now() > received + ttl - margin) {
    return absl::DeadlineExceededError(
        absl::StrCat("lease of transfer ", l.transfer_id(), " too close to expiry to pull"));
  }
  Peer peer;
  {
    std::lock_guard<std::mutex> lock(peer_mu_);
    auto it = peers_.find(PeerKey(l));
    if (it == peers_.end()) {
      return absl::UnavailableError(absl::StrCat("no UCX endpoint to prefill node ",
                                                 l.node_id()));
    }
    peer = it->second;
  }
  const int32_t n = static_cast<int32_t>(job.local_ids.size());
  const int32_t n0 = job.group0_blocks();  // group 0's; the other groups' follow
  // Blocks re-encoded on the wire land in a staging buffer, in order, and
  // are decoded into the pool once the fence passed; others land in the
  // pool's blocks directly.
  kernels::KvDType wire_dtype = pool_dtype_;
  const bool wire = !l.wire_dtype().empty() && kernels::ParseKvDType(l.wire_dtype(), &wire_dtype);
  const uint64_t read_bytes = static_cast<uint64_t>(MovedBlockBytes(l));
  if (wire) RETURN_IF_ERROR(EnsureWireStaging(static_cast<size_t>(n) * read_bytes));
  // The lease's blocks as far as known: all of a whole lease's; a
  // progressive lease's grow as its prefill commits them, and each is read
  // as soon as it is known while the prefill computes the rest.
  std::vector<int32_t> remote(l.block_ids().begin(), l.block_ids().end());
  std::vector<uint32_t> gens(l.generations().begin(), l.generations().end());
  bool complete = !l.progressive();
  if (complete) st->complete_at = PdClock::now();
  const int32_t end = job.first_block + n0;
  for (int32_t done = 0; done < n0;) {
    const int32_t known = std::min<int32_t>(static_cast<int32_t>(remote.size()), end) -
                          job.first_block;
    if (known > done) {
      if (!complete) deadline = PdClock::now() + timeout;  // per read while it overlaps
      const auto r0 = PdClock::now();
      RETURN_IF_ERROR(ReadBlocks(job, peer, remote, done, known, wire, read_bytes, deadline));
      st->active += std::chrono::duration<double>(PdClock::now() - r0).count();
      if (!complete) st->overlapped += known - done;
      done = known;
      continue;
    }
    if (complete) {
      return absl::InternalError(absl::StrCat("transfer ", l.transfer_id(), ": the lease holds ",
                                              remote.size(), " blocks; the pull needs ", end));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shutdown_) return absl::UnavailableError("the node is shutting down");
    }
    // The prefill is still running: wait for its next committed blocks.
    // Each answer proves the prefill node alive and renews the lease; a
    // dead or stopped node fails the call within its deadline, a failed
    // prefill answers an error, and the prefill node gives a prefill 120 s.
    ASSIGN_OR_RETURN(ProgressAnswer pr,
                     RemoteProgress(a, static_cast<int32_t>(remote.size()), 200));
    remote.insert(remote.end(), pr.block_ids.begin(), pr.block_ids.end());
    gens.insert(gens.end(), pr.generations.begin(), pr.generations.end());
    if (pr.complete) {
      complete = true;
      st->complete_at = PdClock::now();
      deadline = st->complete_at + timeout;
    }
  }
  if (!complete) {
    // Every block this pull needs is in, but not the lease's last ones
    // (the decode node held some of the prompt itself): the fence below
    // still applies; the time after this point is what the request waits.
    st->complete_at = PdClock::now();
  }
  if (n > n0) {
    // KV cache groups (whole leases): the other groups' blocks, indexed on
    // after group 0's, then fenced with them.
    remote.resize(static_cast<size_t>(end));
    gens.resize(static_cast<size_t>(end));
    remote.insert(remote.end(), job.group_remote.begin(), job.group_remote.end());
    gens.insert(gens.end(), job.group_gens.begin(), job.group_gens.end());
    const auto r0 = PdClock::now();
    RETURN_IF_ERROR(ReadBlocks(job, peer, remote, n0, n, wire, read_bytes, deadline));
    st->active += std::chrono::duration<double>(PdClock::now() - r0).count();
  }
  // The fence: only now, after every data read completed, read the
  // generations. A block freed at any time since the grant has advanced.
  // Progressive pulls run on threads of their own: their own buffer.
  kt::LocalRegion own_gen;
  if (l.progressive()) {
    ASSIGN_OR_RETURN(own_gen, transport_->AllocateRegion(static_cast<size_t>(std::max(n, 1)) * 4));
  }
  const kt::LocalRegion& gen_buf = l.progressive() ? own_gen : gen_buffer_;
  const auto f0 = PdClock::now();
  absl::Status fenced = [&]() -> absl::Status {
    std::vector<kt::TransferOp> gops;
    for (int32_t k = 0; k < n; ++k) {
      gops.push_back({gen_buf.id, static_cast<uint64_t>(k) * 4, peer.gen,
                      static_cast<uint64_t>(remote[job.first_block + k]) * 4, 4});
    }
    absl::StatusOr<kt::TransferId> t =
        transport_->PostTransfer(peer.id, kt::Direction::kRead, gops);
    if (!t.ok()) return t.status();
    RETURN_IF_ERROR(WaitDrained(*t, a, deadline));
    const auto* got = static_cast<const uint32_t*>(gen_buf.address);
    int32_t changed = 0;
    std::string first;
    for (int32_t k = 0; k < n; ++k) {
      const uint32_t want = gens[job.first_block + k];
      if (got[k] != want) {
        if (changed++ == 0) {
          first = absl::StrCat("block ", remote[job.first_block + k], " generation ", want,
                               " -> ", got[k]);
        }
      }
    }
    if (changed > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      ++generation_mismatches_;
      return absl::DataLossError(absl::StrCat(
          "transfer ", l.transfer_id(), ": ", changed, " of ", n,
          " leased blocks were freed on the prefill node during the pull (", first,
          "); their KV is not committed"));
    }
    return absl::OkStatus();
  }();
  if (own_gen.address != nullptr) (void)transport_->DeregisterRegion(own_gen.id);
  st->active += std::chrono::duration<double>(PdClock::now() - f0).count();
  RETURN_IF_ERROR(fenced);
  if (wire) DecodeWireBlocks(job, wire_dtype, read_bytes);
  return absl::OkStatus();
}

void PdNode::Impl::PullLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return shutdown_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // shutdown with nothing left
      job = jobs_.front();
      jobs_.pop_front();
      if (job->lease->lease.progressive()) ++progressive_pulls_;
    }
    if (job->lease->lease.progressive()) {
      std::thread([this, job] {
        RunJob(*job);
        std::lock_guard<std::mutex> lock(mu_);
        --progressive_pulls_;
        cv_.notify_all();
      }).detach();
    } else {
      RunJob(*job);
    }
  }
}

void PdNode::Impl::RunJob(const Job& job) {
  const auto t0 = PdClock::now();
  PullStats st;
  absl::Status s = Pull(job, &st);
  const auto t1 = PdClock::now();
  // A progressive pull's wall time is mostly its prefill's: its rate (and
  // pull_seconds, which routers divide bytes by) counts only the reads.
  const double secs = job.lease->lease.progressive()
                          ? st.active
                          : std::chrono::duration<double>(t1 - t0).count();
  const pb::Lease& pl = job.lease->lease;
  const int64_t moved = static_cast<int64_t>(job.local_ids.size()) * MovedBlockBytes(pl);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (s.ok()) {
      const double exposed =
          std::chrono::duration<double>(t1 - std::max(st.complete_at, t0)).count();
      // One line per transfer: bench/pd/run.sh reads the pull rate from it.
      spdlog::info("pd: transfer {}: pulled {} blocks, {} bytes in {:.3f} ms ({:.1f} MB/s){}{}",
                   pl.transfer_id(), job.local_ids.size(), moved, secs * 1e3,
                   static_cast<double>(moved) / 1e6 / std::max(secs, 1e-9),
                   pl.wire_dtype().empty() ? "" : absl::StrCat(", as ", pl.wire_dtype()),
                   pl.progressive()
                       ? absl::StrFormat("; progressive: %d blocks during the prefill, "
                                         "%.3f ms after it, %.3f ms from the lease to done",
                                         st.overlapped, exposed * 1e3,
                                         std::chrono::duration<double>(t1 - t0).count() * 1e3)
                       : "");
      ++transfers_ok_;
      blocks_pulled_ += static_cast<int64_t>(job.local_ids.size());
      bytes_pulled_ += moved;
      pull_seconds_ += secs;
      overlapped_blocks_ += st.overlapped;
      exposed_pull_seconds_ += exposed;
    } else {
      ++transfers_failed_;
    }
    attached_.erase(std::remove(attached_.begin(), attached_.end(), job.lease), attached_.end());
  }
  if (!s.ok()) {
    spdlog::warn("pd: pull of transfer {} from {} failed, recomputing locally: {}",
                 pl.transfer_id(), pl.node_id(), s.ToString());
    // A transport failure (dead or wedged peer): reconnect next time. Not
    // for a fenced block or a prefill that failed or was released: the
    // peer itself is fine.
    if (s.code() != absl::StatusCode::kDataLoss && s.code() != absl::StatusCode::kAborted &&
        s.code() != absl::StatusCode::kNotFound) {
      DropPeer(pl);
    }
  }
  // The blocks are ours alone again; decoded wire blocks are lossy.
  job.load->Finish(s, s.ok() && !pl.wire_dtype().empty()
                          ? job.group0_blocks() * block_size_
                          : 0);
  RemoteRelease(pl, s.ok() ? "committed" : "failed");
}

void PdNode::Impl::RenewWaitingLeases(std::unique_lock<std::mutex>* lock, PdClock::time_point now) {
  const auto max_wait = std::chrono::duration_cast<PdClock::duration>(
      std::chrono::duration<double>(flags_.admission_wait));
  std::vector<std::shared_ptr<Attached>> due;
  for (const auto& a : attached_) {
    if (!a->consumed && !a->renewing && now >= a->received + a->ttl / 3 &&
        now < a->attached + max_wait) {
      a->renewing = true;
      due.push_back(a);
    }
  }
  if (due.empty()) return;
  lock->unlock();
  std::vector<absl::StatusOr<uint32_t>> ttls;
  for (const auto& a : due) ttls.push_back(RemoteRenew(a->lease));
  lock->lock();
  for (size_t i = 0; i < due.size(); ++i) {
    Attached* a = due[i].get();
    a->renewing = false;
    if (ttls[i].ok()) {
      a->received = now;
      a->ttl = std::chrono::milliseconds(*ttls[i]);
      ++lease_renewals_;
      ++admission_renewals_;
    } else if (!a->consumed) {
      spdlog::info("pd: lease of transfer {} could not be renewed while its request waits "
                   "for admission ({}); it will be recomputed",
                   a->lease.transfer_id(), ttls[i].status().ToString());
      attached_.erase(std::remove(attached_.begin(), attached_.end(), due[i]),
                      attached_.end());
    }
  }
}

void PdNode::Impl::TendAttachedLeases(std::unique_lock<std::mutex>* lock, PdClock::time_point now) {
  // Decode: while requests wait for admission (the pool or the seats
  // are full for now), an attached lease may belong to one of them:
  // renew it rather than let it lapse into a recompute, up to
  // --pd-admission-wait from its attach.
  if (role_ == PdRole::kDecode && !attached_.empty()) {
    lock->unlock();
    const int32_t waiting = engine_ != nullptr ? engine_->Stats().waiting : 0;
    lock->lock();
    if (waiting > 0) RenewWaitingLeases(lock, now);
    if (shutdown_) return;
  }
  // Decode: leases no request claimed within their ttl go back.
  std::vector<std::shared_ptr<Attached>> unused;
  for (auto it = attached_.begin(); it != attached_.end();) {
    if (!(*it)->consumed && !(*it)->renewing &&
        ((*it)->forgone || now > (*it)->received + (*it)->ttl)) {
      unused.push_back(*it);
      it = attached_.erase(it);
    } else {
      ++it;
    }
  }
  leases_unused_ += static_cast<int64_t>(unused.size());
  if (!unused.empty()) {
    lock->unlock();
    for (const auto& a : unused) {
      RemoteRelease(a->lease, a->forgone ? "served from the decode node's KV tiers" : "unused");
    }
    lock->lock();
  }
}

}  // namespace kvserve
