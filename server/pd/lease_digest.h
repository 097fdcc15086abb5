// What ties a P/D lease to its grant: digests a prefill node records when it
// grants a lease and a decode node recomputes from the lease it received
// (LeaseDigest over everything a decode node acts on, EndpointDigest over
// where its reads go), the KV layout's hash and the field-by-field
// difference between two layouts, and the random non-zero ids (transfer
// ids, incarnations) both sides key leases by. Pure functions of the
// protobuf messages; shared by server/pd/prefill_leases.cc and
// server/pd/decode_pulls.cc.
#pragma once

#include <cstdint>
#include <string>

#include "proto/pd.pb.h"

namespace kvserve {

// A layout's KV cache groups for messages: "1 (all layers in one block)",
// "6 (full, window 512, ...)".
std::string GroupWindowsName(const pd::v1::KvLayout& l);

// The hash of a KV layout's fields (KvLayout.hash).
uint64_t LayoutHash(const pd::v1::KvLayout& l);

// The digest of where a decode node's GETs go: the UCX worker address and
// the two region descriptors (length-prefixed, so no field bleeds into
// another).
uint64_t EndpointDigest(const std::string& ucx_address, const std::string& kv_region,
                        const std::string& generation_region);
uint64_t EndpointDigest(const pd::v1::Lease& l);

// The prefill node's digest over everything a decode node acts on: the
// blocks it reads and where it reads them from.
uint64_t LeaseDigest(const pd::v1::Lease& l);

// A random 64-bit id, never 0 (0 means "missing" on the wire).
uint64_t RandomNonZero();

}  // namespace kvserve
