// Lease digests, layout hashes and ids (server/pd/lease_digest.h says what
// they are for).

#include "server/pd/lease_digest.h"

#include <xxhash.h>

#include <chrono>
#include <mutex>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/pd/pd_node.h"

namespace kvserve {

namespace {

template <typename Repeated>
void AppendRepeated(const Repeated& v, std::string* s) {
  s->append(std::to_string(v.size())).push_back(':');
  for (auto x : v) s->append(reinterpret_cast<const char*>(&x), sizeof(x));
}

}  // namespace

std::string GroupWindowsName(const pd::v1::KvLayout& l) {
  if (l.group_windows_size() == 0) return "1 (all layers in one block)";
  std::string s = absl::StrCat(l.group_windows_size(), " (");
  for (int i = 0; i < l.group_windows_size(); ++i) {
    const int32_t w = l.group_windows(i);
    absl::StrAppend(&s, i > 0 ? ", " : "", w > 0 ? absl::StrCat("window ", w) : "full");
  }
  return s + ")";
}

std::string KvLayoutDifference(const pd::v1::KvLayout& a, const pd::v1::KvLayout& b) {
  std::vector<std::string> d;
  auto cmp = [&](const char* name, const auto& x, const auto& y) {
    if (x != y) d.push_back(absl::StrCat(name, " ", x, " (here) vs ", y, " (peer)"));
  };
  cmp("model_fingerprint", a.model_fingerprint().substr(0, 16),
      b.model_fingerprint().substr(0, 16));
  cmp("kv_dtype", a.kv_dtype(), b.kv_dtype());
  cmp("block_size", a.block_size(), b.block_size());
  cmp("block_bytes", a.block_bytes(), b.block_bytes());
  cmp("n_layers", a.n_layers(), b.n_layers());
  cmp("n_kv_heads", a.n_kv_heads(), b.n_kv_heads());
  cmp("head_dim", a.head_dim(), b.head_dim());
  cmp("kv_cache_groups", GroupWindowsName(a), GroupWindowsName(b));
  if (d.empty() && a.hash() != b.hash()) d.push_back("layout hash differs");
  return absl::StrJoin(d, "; ");
}

uint64_t LayoutHash(const pd::v1::KvLayout& l) {
  std::string s = absl::StrCat(l.model_fingerprint(), "|", l.kv_dtype(), "|",
                                     l.block_size(), "|", l.block_bytes(), "|", l.n_layers(), "|",
                                     l.n_kv_heads(), "|", l.head_dim());
  if (l.group_windows_size() > 0) {
    // Only when set, so a one-group layout hashes as it always did.
    s.append("|groups:");
    for (int32_t w : l.group_windows()) absl::StrAppend(&s, w, ",");
  }
  return XXH3_64bits(s.data(), s.size());
}

// The digest of where a decode node's GETs go: the UCX worker address and
// the two region descriptors (length-prefixed, so no field bleeds into
// another).
uint64_t EndpointDigest(const std::string& ucx_address, const std::string& kv_region,
                        const std::string& generation_region) {
  const std::string s = absl::StrCat(ucx_address.size(), ":", ucx_address, "|", kv_region.size(),
                                     ":", kv_region, "|", generation_region.size(), ":",
                                     generation_region);
  return XXH3_64bits(s.data(), s.size());
}

uint64_t EndpointDigest(const pd::v1::Lease& l) {
  return EndpointDigest(l.ucx_address(), l.kv_region(), l.generation_region());
}

// The prefill node's digest over everything a decode node acts on: the
// blocks it reads and where it reads them from.
uint64_t LeaseDigest(const pd::v1::Lease& l) {
  std::string s = absl::StrCat(l.transfer_id(), "|", l.node_id(), "|", l.incarnation(), "|",
                               l.layout().hash(), "|", l.cache_salt().size(), ":",
                               l.cache_salt(), "|", l.ttl_ms(), "|", l.grpc_address(), "|",
                               EndpointDigest(l), "|");
  AppendRepeated(l.tokens(), &s);
  AppendRepeated(l.block_ids(), &s);
  AppendRepeated(l.generations(), &s);
  absl::StrAppend(&s, "|", l.wire_dtype().size(), ":", l.wire_dtype(), "|", l.wire_block_bytes(),
                  "|", l.progressive() ? "progressive" : "whole");
  if (l.groups_size() > 0) {
    // KV cache groups: each group's blocks are read and fenced like group
    // 0's (absent for a one-group lease, whose digest is unchanged).
    absl::StrAppend(&s, "|groups:", l.groups_size());
    for (const pd::v1::LeaseGroup& g : l.groups()) {
      absl::StrAppend(&s, "|", g.first_block(), "|");
      AppendRepeated(g.block_ids(), &s);
      AppendRepeated(g.generations(), &s);
    }
  }
  return XXH3_64bits(s.data(), s.size());
}

uint64_t RandomNonZero() {
  static std::mutex mu;
  static std::mt19937_64 rng(
      std::random_device{}() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::lock_guard<std::mutex> lock(mu);
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}

}  // namespace kvserve
