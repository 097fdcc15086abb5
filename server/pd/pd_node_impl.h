// PdNode::Impl, the P/D node (what it does: server/pd/pd_node.h): one object
// that serves the KvTransfer gRPC service and is a decode node's KvLoader.
// This header holds its state and its member list, grouped by role; each
// role's members are defined in a file of its own:
//
//   pd_node.cc         gRPC glue: start-up (KV layout, UCX transport, the
//                      registered regions), node info, auth, shutdown, the
//                      housekeeping thread
//   prefill_leases.cc  the prefill side: the lease table, whole and
//                      progressive grants, renewal, release, expiry, the
//                      blocks pinned through the engine's named KV operations
//   decode_pulls.cc    the decode side: attached leases, the KvLoader, UCX
//                      pulls behind the generation fence, renewals while a
//                      pull or an admission waits
//   wire_codec.cc      --kv-wire-dtype: blocks re-encoded for the wire on the
//                      prefill node and decoded into the pool on arrival
//   device_staging.cc  CUDA pools: copies through the transport's host
//                      staging buffers
//   lease_digest.cc    digests, layout hashes and ids (free functions)
//
// Internal to server/pd/. Thread-safety: as pd_node.h says; shared state is
// under mu_ unless a member says otherwise.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cpu/kv_transcode.h"
#include "proto/pd.grpc.pb.h"
#include "scheduler/engine.h"
#include "scheduler/kv_loader.h"
#include "server/pd/lease_digest.h"
#include "server/pd/pd_flags.h"
#include "server/pd/pd_node.h"
#include "server/service/admission.h"
#include "server/service/auth.h"
#include "server/service/model_service.h"
#include "transport/ucx_transport.h"

namespace kvserve {

namespace pb = ::kvserve::pd::v1;
namespace kt = ::kvserve::transport;
using PdClock = std::chrono::steady_clock;

// A load the engine polls: done only once no transfer touches its blocks.
class PullLoad final : public KvLoad {
 public:
  bool Done() override { return done_.load(std::memory_order_acquire); }
  absl::Status status() override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  // lossy_tokens: of the loaded tokens, those decoded from a lossy wire
  // codec (--kv-wire-dtype): the radix nodes they enter are marked lossy.
  void Finish(absl::Status s, int32_t lossy_tokens = 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      lossy_tokens_ = lossy_tokens;
    }
    done_.store(true, std::memory_order_release);
  }
  KvLoadSources sources() override {
    std::lock_guard<std::mutex> lock(mu_);
    KvLoadSources src;
    src.lossy_tokens = lossy_tokens_;
    return src;
  }

 private:
  std::atomic<bool> done_{false};
  std::mutex mu_;
  absl::Status status_;
  int32_t lossy_tokens_ = 0;
};

class PdNode::Impl final : public pb::KvTransfer::Service, public KvLoader {
  struct Progress;  // a progressive lease's prefill (below)
  struct Attached;

 public:
  Impl(const PdFlags& flags, PdRole role, std::string fingerprint, std::string api_key)
      : flags_(flags), role_(role), fingerprint_(std::move(fingerprint)),
        api_key_(std::move(api_key)), auth_(api_key_), incarnation_(RandomNonZero()) {}

  ~Impl() override { Shutdown(); }

  PdRole role() const { return role_; }

  // ---- gRPC glue (pd_node.cc) ----

  absl::Status Attach(Engine* engine, ModelService* service);
  void SetGrpcPort(int port);
  void SetHttpPort(int port);
  void Shutdown();
  grpc::Status GetNodeInfo(grpc::ServerContext* ctx, const pb::GetNodeInfoRequest*,
                           pb::NodeInfo* out) override;

  // ---- Prefill leases: the KvTransfer calls (prefill_leases.cc) ----

  grpc::Status Prefill(grpc::ServerContext* ctx, const pb::PrefillRequest* req,
                       pb::Lease* out) override;
  grpc::Status RenewLease(grpc::ServerContext* ctx, const pb::RenewLeaseRequest* req,
                          pb::RenewLeaseResponse* out) override;
  grpc::Status ReleaseLease(grpc::ServerContext* ctx, const pb::ReleaseLeaseRequest* req,
                            pb::ReleaseLeaseResponse* out) override;
  grpc::Status DebugEarlyFree(grpc::ServerContext* ctx, const pb::ReleaseLeaseRequest* req,
                              pb::ReleaseLeaseResponse* out) override;

  // ---- Decode pulls: the KvTransfer call and the KvLoader (decode_pulls.cc) ----

  grpc::Status AttachLease(grpc::ServerContext* ctx, const pb::Lease* lease,
                           pb::AttachLeaseResponse*) override;

  // KvLoader (engine thread). Pulls write whole blocks from a block
  // boundary (FindLease).
  bool RematchWholeBlocks() const override { return true; }
  int32_t Lookup(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
                 int32_t limit) override;
  // The decode node's tiers supplied these tokens: the lease for them goes
  // back now (housekeeping releases it), not after its ttl.
  void Forgo(std::string_view salt, absl::Span<const int32_t> tokens, int32_t from,
             int32_t limit) override;
  std::shared_ptr<KvLoad> Start(const KvLoadTarget& t) override;

 private:
  static constexpr size_t kMaxLeaseBlocks = 1 << 16;

  // A progressive lease's prefill, as the prefill node follows it. Guarded
  // by mu_; `blocks` (one pool reference each) grows only on the engine
  // thread (RematchEnd), under mu_.
  struct Progress {
    uint64_t request_id = 0;
    std::vector<int32_t> tokens;  // the prompt's full blocks' tokens
    std::string salt;
    int32_t full_blocks = 0;
    std::vector<BlockHandle> blocks;  // pinned so far, in prompt order
    bool finished = false;            // the engine request ended
    bool final = false;               // ... and a re-match after that ran
    absl::Status error;               // the prefill failed: the lease is void
    bool rematch_pending = false;
    PdClock::time_point next_rematch;  // re-matches at most every 2 ms
    PdClock::time_point granted;
    bool released = false;
    bool early_freed = false;  // test hook: the blocks are gone, keep answering
  };
  struct Held {
    std::shared_ptr<KvPin> pin;  // whole leases; null once early-freed (test hook)
    int32_t held_blocks = 0;     // blocks pin holds
    uint64_t digest = 0;
    std::chrono::milliseconds ttl{0};
    PdClock::time_point expiry;
    std::shared_ptr<Progress> progress;  // progressive leases only
  };
  struct Attached {
    pb::Lease lease;
    PdClock::time_point attached;  // when AttachLease accepted it
    // At attach, then at each renewal: by housekeeping while no request has
    // claimed it, by the pull thread once one has. Guarded by mu_.
    PdClock::time_point received;
    std::chrono::milliseconds ttl{0};
    bool consumed = false;
    bool renewing = false;  // a housekeeping renewal is in flight (mu_)
    bool forgone = false;   // the decode node's own tiers supplied its tokens (mu_)
  };
  struct Job {
    std::shared_ptr<Attached> lease;
    int32_t first_block = 0;
    // Where each pulled block lands: group 0's lease blocks [first_block,
    // first_block + n0) first, then (KV cache groups) the other groups'
    // blocks, whose prefill-node ids and generations are group_remote and
    // group_gens (in the same order).
    std::vector<int32_t> local_ids;
    std::vector<int32_t> group_remote;
    std::vector<uint32_t> group_gens;
    std::shared_ptr<PullLoad> load;
    int32_t group0_blocks() const {
      return static_cast<int32_t>(local_ids.size() - group_remote.size());
    }
  };
  struct Peer {
    kt::PeerId id = 0;
    kt::RemoteRegionId kv = 0, gen = 0;
  };


  // ---- gRPC glue (pd_node.cc) ----

  // The P/D node's calls take the operator's key (tenant keys are the
  // front ends' business): Authenticator's rule and wording.
  grpc::Status Authorize(grpc::ServerContext* ctx) const;

  // REQUIRES: mu_ held.
  grpc::Status CheckIncarnation(uint64_t incarnation, const char* what) const;

  std::shared_ptr<pb::KvTransfer::Stub> StubFor(const std::string& address);

  void AddAuth(grpc::ClientContext* c) const;

  // Every 50 ms until Shutdown: ExpireLeases, then (decode) the attached
  // leases' renewals and returns.
  void HousekeepingLoop();

  // ---- Prefill leases (prefill_leases.cc) ----

  // Prefill with PrefillRequest.progressive: submits the request and grants
  // the lease at once, with the prompt's full-block tokens and no blocks;
  // AnswerProgress reports the blocks as the prefill commits them.
  grpc::Status GrantProgressive(const pb::PrefillRequest& req, EngineRequest er,
                                const std::vector<int32_t>& tokens, const std::string& salt,
                                int32_t full_blocks, pb::Lease* out);

  // The fields every lease of this node carries: a fresh transfer id, who
  // and where the node is, its KV layout, the salt, and the ttl asked for
  // (0: --pd-lease-ttl). REQUIRES: mu_ held.
  void StartLease(const std::string& salt, uint32_t ttl_ms, pb::Lease* l) const;

  // REQUIRES: mu_ held.
  void PostRematch(uint64_t id, const std::shared_ptr<Progress>& p);

  // Engine thread, before the re-match's pin: false when the lease is
  // gone (nothing to pin). *finished: whether the prefill had ended then.
  bool RematchBegin(const std::shared_ptr<Progress>& p, bool* finished);

  // Engine thread: hs holds the full blocks of the prompt the prefix cache
  // holds now (the prefill commits its blocks there chunk by chunk), one
  // reference each; the lease keeps the new ones and leaves the rest in hs,
  // whose references go back when this returns. PrefixCache::Pin neither
  // touches nor counts them, so following a prefill does not make its
  // blocks look reused to the eviction policy or the disk tier. Blocks
  // already reported stay what they were: referenced, they cannot be
  // evicted or reused.
  void RematchEnd(uint64_t id, const std::shared_ptr<Progress>& p, bool finished,
                  const absl::Status& pinned, std::vector<BlockHandle>* hs);

  // RenewLease with progress: waits (up to wait_ms, at most 1 s) until the
  // lease holds more blocks than the decode node has, is complete, or
  // failed; the prefill's engine thread re-matches meanwhile (at most one
  // re-match in flight, 2 ms apart). REQUIRES: *lock holds mu_.
  grpc::Status AnswerProgress(std::unique_lock<std::mutex>* lock, uint64_t id,
                              std::shared_ptr<Progress> p, const pb::RenewLeaseRequest& req,
                              pb::RenewLeaseResponse* out);

  // Drops a lease's hold: its pinned blocks go back on the engine thread,
  // and a progressive lease's prefill, if still running, is cancelled (its
  // own blocks are freed with it). REQUIRES: mu_ held.
  void ReleaseHeld(Held* h);

  // REQUIRES: mu_ held.
  void RememberGone(uint64_t id);

  // Housekeeping: frees the leases whose ttl lapsed unreleased.
  // REQUIRES: mu_ held.
  void ExpireLeases(PdClock::time_point now);

  // ---- Decode pulls (decode_pulls.cc) ----

  // The blocks a lease covers: a progressive one's grow to its tokens'.
  int32_t LeaseBlocks(const pb::Lease& l) const;

  absl::Status CheckLeaseShape(const pb::Lease& l) const;

  // KV cache groups: whether lease l holds every block each other group's
  // window reaches from slot `end` (a block boundary within the lease).
  // True for a lease without groups.
  bool GroupsCover(const pb::Lease& l, int32_t end) const;

  absl::StatusOr<uint32_t> RemoteRenew(const pb::Lease& l);

  // A RenewLease for lease l: its id, incarnation, and our own digests of
  // what we received (a lease altered on the way, or made up, does not
  // match the grant the prefill node recorded).
  static pb::RenewLeaseRequest RenewRequestFor(const pb::Lease& l);

  void RemoteRelease(const pb::Lease& l, const std::string& reason);

  static std::string PeerKey(const pb::Lease& l);

  absl::Status EnsurePeer(const pb::Lease& l);

  void DropPeer(const pb::Lease& l);

  // REQUIRES: mu_ held. The unconsumed lease that supplies the most tokens
  // of tokens[from, limit) (whole blocks from a block boundary: a pull
  // writes whole blocks, and a block the sequence shares is never written);
  // *end is the slot its supply ends at.
  std::shared_ptr<Attached> FindLease(std::string_view salt, absl::Span<const int32_t> tokens,
                                      int32_t from, int32_t limit, int32_t* end);

  // Keeps a lease alive through a long pull: once a third of its ttl has
  // passed since the last renewal, the prefill node renews it. A refused
  // renewal (released, expired, restarted node) fails the pull.
  absl::Status KeepAlive(Attached* a);

  // Waits for transfer t until `deadline`, renewing the lease meanwhile.
  // A failed or timed-out transfer is cancelled and drained (the backend no
  // longer touches our blocks) before this returns.
  absl::Status WaitDrained(kt::TransferId t, Attached* a, PdClock::time_point deadline);

  // What a pull reports besides its status.
  struct PullStats {
    int32_t overlapped = 0;  // blocks read while the lease's prefill still ran
    PdClock::time_point complete_at{};  // when every block of the lease was known
    double active = 0;  // seconds spent reading (data and fence), not waiting on the prefill
  };

  // A progressive lease's blocks past the first `have`, as the prefill node
  // reports them (RenewLease with progress, which also renews the lease).
  struct ProgressAnswer {
    std::vector<int32_t> block_ids;
    std::vector<uint32_t> generations;
    bool complete = false;
  };
  absl::StatusOr<ProgressAnswer> RemoteProgress(Attached* a, int32_t have, uint32_t wait_ms);

  // GETs the job's blocks [k0, k1) from the prefill node's blocks `remote`
  // (indexed by lease block) into their places: the pool's blocks, or in
  // order into the wire staging buffer.
  absl::Status ReadBlocks(const Job& job, const Peer& peer, const std::vector<int32_t>& remote,
                          int32_t k0, int32_t k1, bool wire, uint64_t read_bytes,
                          PdClock::time_point deadline);

  absl::Status Pull(const Job& job, PullStats* st);

  // Whole leases are pulled one after another on the pull thread; a
  // progressive lease waits on its prefill, so it gets a thread of its own
  // (counted in progressive_pulls_; Shutdown waits for them).
  void PullLoop();

  void RunJob(const Job& job);

  // Renews the unclaimed attached leases a third of whose ttl has passed
  // (at most --pd-admission-wait after their attach). A refused renewal
  // (the prefill node let it go or restarted) drops the lease: its request
  // recomputes. REQUIRES: *lock holds mu_; released around the RPCs.
  void RenewWaitingLeases(std::unique_lock<std::mutex>* lock, PdClock::time_point now);

  // Housekeeping: renews the attached leases of requests waiting for
  // admission (RenewWaitingLeases) and gives back those no request claimed
  // within their ttl or whose tokens the tiers supplied. REQUIRES: *lock
  // holds mu_; released around the engine's stats and the RPCs.
  void TendAttachedLeases(std::unique_lock<std::mutex>* lock, PdClock::time_point now);

  // ---- Wire codecs (wire_codec.cc) ----

  // Attach: checks --kv-wire-dtype and, on a prefill node whose codec is
  // smaller than the pool's, sets up the re-encoded copies (wire_*).
  absl::Status ConfigureWire();
  // --kv-wire-dtype: re-encodes the leased blocks into the wire region
  // (block i at i * wire_block_bytes_). A block's copy is made once per
  // generation: a block shared by several leases is encoded once, and a
  // copy is rewritten only for a later generation, which fails the fence of
  // any earlier lease still reading it. The leased blocks are full and
  // pinned, so the engine does not write them meanwhile.
  void EncodeForWire(const std::vector<BlockHandle>& blocks);

  // Bytes one of the lease's blocks moves as: the pool's block, or its
  // re-encoded copy (--kv-wire-dtype on the prefill node).
  int64_t MovedBlockBytes(const pb::Lease& l) const;

  // Pull thread: a staging buffer for re-encoded blocks of at least
  // `bytes`, grown (re-registered) when a lease needs more.
  absl::Status EnsureWireStaging(size_t bytes);

  // Pull thread, after the fence passed: decodes the job's blocks from
  // the wire staging buffer (in order, read_bytes each, as wire_dtype)
  // into their places in the pool.
  void DecodeWireBlocks(const Job& job, kernels::KvDType wire_dtype, uint64_t read_bytes);

  // ---- Device staging (device_staging.cc) ----

  // A staged device pool: brings the leased blocks' bytes to the host
  // buffer the decode node reads (runs of consecutive blocks in one copy).
  // Nothing to do for host pools and direct (GPUDirect) ones.
  absl::Status SyncStaging(const std::vector<BlockHandle>& blocks);

  // ---- State ----

  const PdFlags flags_;
  const PdRole role_;
  const std::string fingerprint_;
  const std::string api_key_;
  const Authenticator auth_;  // api_key_'s check of incoming calls
  const uint64_t incarnation_;
  Engine* engine_ = nullptr;
  ModelService* service_ = nullptr;
  // The prefill node's door into the model service: the same scope and
  // validation as the decode node's front ends (server/service/admission.h).
  std::unique_ptr<Admission> admission_;
  pb::KvLayout layout_;
  int32_t block_size_ = 0;
  int64_t block_bytes_ = 0;
  int32_t num_blocks_ = 0;
  // KV cache groups of a hybrid model: per group its window (0: full),
  // group 0 first; empty for one group (layout_.group_windows).
  std::vector<int32_t> group_windows_;

  std::unique_ptr<kt::Transport> transport_;
  kernels::KvDType pool_dtype_ = kernels::KvDType::kF16;
  kernels::KvBlockShape shape_;
  uint8_t* pool_bytes_ = nullptr;  // host pools: the blocks (null on the device)
  // Prefill, --kv-wire-dtype: kv_region_ holds the re-encoded copies.
  bool wire_ = false;
  kernels::KvDType wire_dtype_ = kernels::KvDType::kF16;
  int64_t wire_block_bytes_ = 0;
  std::mutex wire_mu_;
  std::vector<int64_t> wire_gen_;  // guarded by wire_mu_: generation each copy holds (-1: none)
  // Decode: where re-encoded blocks land before they are decoded (pull thread).
  kt::LocalRegion wire_staging_;
  bool device_pool_ = false;  // the KV pool is CUDA memory
  bool staged_ = false;       // ... moved through host staging buffers
  std::string ucx_address_, kv_descriptor_, gen_descriptor_;
  kt::LocalRegion kv_region_, gen_region_, gen_buffer_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool shutdown_ = false;                 // guarded by mu_
  std::string node_id_, grpc_address_, http_address_;  // guarded by mu_
  std::map<uint64_t, Held> held_;         // prefill: leases, guarded by mu_
  std::deque<uint64_t> gone_;             // prefill: released/expired ids, guarded by mu_
  std::vector<std::shared_ptr<Attached>> attached_;  // decode, guarded by mu_
  std::deque<std::shared_ptr<Job>> jobs_;            // decode, guarded by mu_
  int64_t leases_granted_ = 0, leases_released_ = 0, leases_expired_ = 0;
  int64_t duplicate_releases_ = 0, stale_releases_ = 0, early_frees_ = 0;
  int64_t transfers_ok_ = 0, transfers_failed_ = 0, generation_mismatches_ = 0;
  int64_t blocks_pulled_ = 0, bytes_pulled_ = 0, leases_attached_ = 0, leases_unused_ = 0;
  int64_t duplicate_attaches_ = 0;
  int64_t admission_renewals_ = 0;  // of lease_renewals_, while requests waited to be admitted
  int64_t lease_renewals_ = 0, leases_refused_no_blocks_ = 0, forged_endpoints_ = 0;
  double pull_seconds_ = 0;
  int64_t staged_blocks_ = 0;  // prefill, staged device pool: blocks synced to staging
  int64_t progressive_leases_ = 0, progress_answers_ = 0;  // prefill
  int64_t overlapped_blocks_ = 0;                         // decode
  int32_t progressive_pulls_ = 0;  // decode: pull threads of progressive leases running
  double exposed_pull_seconds_ = 0;                       // decode
  int64_t wire_blocks_ = 0;  // re-encoded (prefill) or decoded (decode) for the wire

  std::mutex peer_mu_;
  std::map<std::string, Peer> peers_;  // guarded by peer_mu_
  std::mutex stub_mu_;
  std::map<std::string, std::shared_ptr<pb::KvTransfer::Stub>> stubs_;  // guarded by stub_mu_

  std::thread housekeeping_, pull_thread_;
};

}  // namespace kvserve
