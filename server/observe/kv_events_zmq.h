// KV events in vLLM's wire format, for routers built for vLLM (the Gateway
// API Inference Extension's endpoint picker, llm-d's KV-cache indexer,
// Dynamo). This file owns the translation of the prefix cache's event log
// (cache/kv_event_log.h, the same log the gRPC stream reads) into vLLM's
// KVEventBatch messages, their msgpack encoding, and the ZeroMQ sockets that
// carry them:
//   - a PUB socket sending multipart (topic, 8-byte big-endian sequence,
//     msgpack payload) messages, sequences counting from 0 per process;
//   - an optional ROUTER replay socket: a client sends (empty, 8-byte
//     big-endian start sequence) and gets (empty, sequence, payload) for
//     every buffered batch from there, then (empty, -1 as 8 bytes, empty).
// The encoding mirrors vLLM's msgspec structs (vllm/distributed/kv_events.py):
// KVEventBatch is a map {ts, events, data_parallel_rank}; each event is a map
// tagged by "type" (the class name, first) whose fields follow in declaration
// order, fields left at their None default omitted (omit_defaults=True).
// Block hashes are kvserve's chained 64-bit hashes, sent as msgpack integers
// (vLLM's ExternalBlockHash is bytes | int). Only full blocks are published
// (vLLM publishes no partial block); a partial tail block's later removal is
// not published either. A subscriber that fell out of the log's window gets
// AllBlocksCleared followed by the whole index (the log's snapshot).
//
// Thread-safety: VllmEventTranslator and EncodeVllmEventBatch are plain
// values; VllmEventPublisher owns one thread that alone touches its sockets.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/kv_event_log.h"

namespace kvserve {

// One vLLM event. Which fields matter depends on kind.
struct VllmKvEvent {
  enum class Kind { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Kind kind = Kind::kBlockStored;
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;  // stored: none for a first block
  std::vector<int32_t> token_ids;             // stored: block_size per hash
  // stored: one entry per block, or empty for none at all; an entry is the
  // block's extra keys (empty: None).
  std::vector<std::vector<std::string>> extra_keys;
  // Which tier the event is about (its `medium`): the primary pool or a
  // page of the host or disk tier.
  KvTier tier = KvTier::kNone;
  // The KV cache group whose index the event is about (KvCacheEvent::group).
  int32_t group = 0;
};

struct VllmEventFormat {
  int32_t block_size = 16;
  // `medium` per tier, as vLLM names them (vllm/v1/kv_offload/mediums.py):
  // the primary KV pool is "GPU" (as vLLM's own block pool says on every
  // platform), the host tier's pages "CPU" (its CPU offloading connector),
  // the disk tier's "Disk".
  std::string medium = "GPU";
  std::string host_medium = "CPU";
  std::string disk_medium = "Disk";
  int32_t data_parallel_rank = 0;
  // KV cache groups (a hybrid-attention model): the group whose radix index
  // the stream publishes, and its KV cache spec. Every BlockStored then
  // carries group_idx, kv_cache_spec_kind ("full_attention" or
  // "sliding_window") and, for a window, kv_cache_spec_sliding_window;
  // every BlockRemoved carries group_idx. Unset (a model with one group):
  // those fields stay at their None default, off the wire, as before.
  std::optional<int32_t> group_idx;
  std::string kv_cache_spec_kind;                       // empty: None
  std::optional<int32_t> kv_cache_spec_sliding_window;  // none: None
  // KV cache groups, every group publishing (a hybrid model): per group its
  // window (0: full attention). When set it replaces the three fields
  // above per event: group_idx is the event's group, kv_cache_spec_kind
  // "full_attention" or "sliding_window", kv_cache_spec_sliding_window the
  // window (None for full attention).
  std::vector<int32_t> group_windows;
};

// The msgpack bytes of KVEventBatch{ts, events, data_parallel_rank}.
std::string EncodeVllmEventBatch(double ts, const std::vector<VllmKvEvent>& events,
                                 const VllmEventFormat& format);

// Turns the log's events into vLLM events: consecutive stores that extend
// one chain in one tier become one BlockStored, consecutive removals from
// one tier one BlockRemoved. Remembers which hashes it published in each
// tier so that removals of blocks it never stored (partial tail blocks)
// are left out. A tier's page is published as the log describes it (the
// demoted block's parent and tokens), with that tier's medium; an
// AllCleared (the index emptied) clears the primary pool's blocks only,
// the tiers keep their pages.
class VllmEventTranslator {
 public:
  explicit VllmEventTranslator(int32_t block_size) : block_size_(block_size) {}
  void Add(const KvCacheEvent& e, std::vector<VllmKvEvent>* out);
  // A snapshot replaces everything published so far.
  void AddSnapshot(const std::vector<KvCacheEvent>& blocks, std::vector<VllmKvEvent>* out);
  // Published blocks in every tier (and every KV cache group).
  size_t published_blocks() const {
    size_t n = published_[0].size() + published_[1].size() + published_[2].size();
    for (const auto& [g, s] : group_published_) n += s.size();
    return n;
  }

 private:
  std::unordered_set<uint64_t>& PublishedFor(const KvCacheEvent& e);
  int32_t block_size_;
  std::unordered_set<uint64_t> published_[3];  // group 0's, by KvTier
  // Other KV cache groups' index blocks (the same hashes as group 0's).
  std::map<int32_t, std::unordered_set<uint64_t>> group_published_;
};

struct VllmEventPublisherOptions {
  std::string endpoint;          // PUB: bound when it has '*', '::', ipc:// or inproc://
  std::string replay_endpoint;   // ROUTER, bound; "" for none
  std::string topic;
  size_t replay_batches = 10000;
  VllmEventFormat format;
};

class VllmEventPublisher {
 public:
  // Opens the sockets (InvalidArgument naming the flag for a bad endpoint)
  // and starts the thread reading `log` from its first event.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<VllmEventPublisher>> Start(
      KvEventLog* log, VllmEventPublisherOptions options);
  // Stops the thread; call after log->Close() so it is not waiting.
  ~VllmEventPublisher();
  void Stop();

  uint64_t batches_sent() const { return next_seq_.load(); }

 private:
  struct Impl;
  VllmEventPublisher() = default;
  void Loop();

  KvEventLog* log_ = nullptr;
  VllmEventPublisherOptions options_;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> next_seq_{0};
  std::thread thread_;
};

}  // namespace kvserve
