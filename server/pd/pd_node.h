// PdNode: one daemon's part in prefill/decode disaggregation
// (docs/disaggregation.md, proto/pd.proto). Every node serves the KvTransfer
// gRPC service on its gRPC port; what it does depends on --role:
//
//   prefill  Prefill computes a request's prompt KV through the engine (its
//            prefix cache included) and pins the prompt's full blocks under
//            a lease {transfer_id, (block id, generation)..., ttl}. The KV
//            pool and its generation table are registered with UCX so decode
//            nodes read them. Leases end by ReleaseLease (idempotent, keyed
//            by transfer_id and this node's incarnation) or by expiry.
//   decode   AttachLease checks a lease (shape, KV layout, and with the
//            prefill node that it is held as described), connects to the
//            prefill node's UCX worker and keeps the lease for the request
//            that follows. As the engine's KvLoader it supplies, at
//            admission, the leased blocks past its own prefix-cache match:
//            its own fresh blocks are filled by UCX GETs, then the prefill
//            node's generations of those blocks are read back; any change
//            (the block was freed meanwhile) fails the load, and the engine
//            recomputes the tokens instead. A pull renews the lease while
//            it runs (every third of the ttl). Success or failure, the lease
//            is released at once. AttachLease is idempotent per
//            (transfer_id, incarnation); a lease larger than the whole pool
//            is refused (RESOURCE_EXHAUSTED).
//   both     only GetNodeInfo (a cache-aware router balances over these).
//
// Thread-safety: the service's handlers run on gRPC threads; the KvLoader
// calls on the engine thread; a housekeeping thread expires leases and a
// pull thread moves KV. Shared state is under mu_.
//
// The implementation, by role: server/pd/pd_node_impl.h lists PdNode::Impl's
// members and the file that defines each group (gRPC glue, prefill leases,
// decode pulls, wire codecs, device staging, lease digests).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "scheduler/engine.h"
#include "scheduler/kv_loader.h"
#include "server/service/model_service.h"
#include "server/pd/pd_flags.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace kvserve {

namespace pd::v1 {
class KvLayout;
}  // namespace pd::v1

enum class PdRole { kBoth, kPrefill, kDecode };
[[nodiscard]] absl::StatusOr<PdRole> ParsePdRole(const std::string& name);
const char* PdRoleName(PdRole role);

// "" when a and b describe byte-compatible KV blocks; else every differing
// field as "block_size 16 (here) vs 32 (peer)", joined by "; ".
std::string KvLayoutDifference(const pd::v1::KvLayout& here, const pd::v1::KvLayout& peer);

class PdNode {
 public:
  // Before the engine exists: the role, and for decode the KvLoader that
  // EngineOptions::kv_loader must point at (kv_loader()).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PdNode>> Create(
      const PdFlags& flags, std::string model_fingerprint, std::string api_key);
  ~PdNode();

  PdRole role() const;
  // The loader of a decode node (null for the other roles); outlives the
  // engine (PdNode is destroyed after it).
  KvLoader* kv_loader();

  // The engine is built (not yet started) and the service exists: computes
  // the KV layout, creates the UCX transport and registers the pool (not for
  // role both). REQUIRES: engine and service outlive Shutdown().
  [[nodiscard]] absl::Status Attach(Engine* engine, ModelService* service);
  // The gRPC server listens: the address peers reach it on.
  void SetGrpcPort(int port);
  void SetHttpPort(int port);
  grpc::Service* service();

  // Drops every lease (their blocks are released on the engine thread, so
  // call before the engine is destroyed) and stops the housekeeping thread.
  void Shutdown();

 private:
  class Impl;
  explicit PdNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvserve
