// The implementation of kv_events_zmq.h. What it owns and how it is used: the
// opening paragraph of server/observe/kv_events_zmq.h.

#include "server/observe/kv_events_zmq.h"

#include <chrono>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "msgpack.hpp"
#include "spdlog/spdlog.h"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace kvserve {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// Well-formed UTF-8 (what msgspec accepts as str); anything else goes as bin.
bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;  // continuation bytes
    if (c < 0x80) {
      n = 0;
    } else if (c >= 0xc2 && c <= 0xdf) {
      n = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
    } else {
      return false;
    }
    if (n > 0 && i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += n + 1;
  }
  return true;
}

void PackKey(Packer& pk, const std::string& key) {
  if (IsUtf8(key)) {
    PackStr(pk, key);
  } else {
    pk.pack_bin(static_cast<uint32_t>(key.size()));
    pk.pack_bin_body(key.data(), static_cast<uint32_t>(key.size()));
  }
}

const std::string& MediumOf(const VllmKvEvent& e, const VllmEventFormat& f) {
  switch (e.tier) {
    case KvTier::kHost:
      return f.host_medium;
    case KvTier::kDisk:
      return f.disk_medium;
    case KvTier::kNone:
      break;
  }
  return f.medium;
}

void PackEvent(Packer& pk, const VllmKvEvent& e, const VllmEventFormat& format) {
  // Every group publishing: the event's own group and that group's spec.
  VllmEventFormat per_group;
  if (!format.group_windows.empty()) {
    per_group = format;
    const int32_t w = e.group >= 0 && static_cast<size_t>(e.group) < format.group_windows.size()
                          ? format.group_windows[static_cast<size_t>(e.group)]
                          : 0;
    per_group.group_idx = e.group;
    per_group.kv_cache_spec_kind = w > 0 ? "sliding_window" : "full_attention";
    per_group.kv_cache_spec_sliding_window =
        w > 0 ? std::optional<int32_t>(w) : std::optional<int32_t>();
  }
  const VllmEventFormat& f = format.group_windows.empty() ? format : per_group;
  switch (e.kind) {
    case VllmKvEvent::Kind::kBlockStored: {
      // type, block_hashes, parent_block_hash, token_ids, block_size,
      // lora_id, medium, lora_name (no defaults: always present), then the
      // fields whose default is None, each only when set: extra_keys (some
      // block has keys), group_idx, kv_cache_spec_kind and
      // kv_cache_spec_sliding_window (a hybrid model's group).
      pk.pack_map(8 + (e.extra_keys.empty() ? 0 : 1) + (f.group_idx.has_value() ? 1 : 0) +
                  (f.kv_cache_spec_kind.empty() ? 0 : 1) +
                  (f.kv_cache_spec_sliding_window.has_value() ? 1 : 0));
      PackStr(pk, "type");
      PackStr(pk, "BlockStored");
      PackStr(pk, "block_hashes");
      pk.pack_array(static_cast<uint32_t>(e.block_hashes.size()));
      for (uint64_t h : e.block_hashes) pk.pack_uint64(h);
      PackStr(pk, "parent_block_hash");
      if (e.parent_block_hash.has_value()) {
        pk.pack_uint64(*e.parent_block_hash);
      } else {
        pk.pack_nil();
      }
      PackStr(pk, "token_ids");
      pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
      for (int32_t t : e.token_ids) pk.pack_int32(t);
      PackStr(pk, "block_size");
      pk.pack_int32(f.block_size);
      PackStr(pk, "lora_id");
      pk.pack_nil();
      PackStr(pk, "medium");
      PackStr(pk, MediumOf(e, f));
      PackStr(pk, "lora_name");
      pk.pack_nil();
      if (!e.extra_keys.empty()) {
        PackStr(pk, "extra_keys");
        pk.pack_array(static_cast<uint32_t>(e.extra_keys.size()));
        for (const std::vector<std::string>& keys : e.extra_keys) {
          if (keys.empty()) {
            pk.pack_nil();
            continue;
          }
          pk.pack_array(static_cast<uint32_t>(keys.size()));
          for (const std::string& k : keys) PackKey(pk, k);
        }
      }
      if (f.group_idx.has_value()) {
        PackStr(pk, "group_idx");
        pk.pack_int32(*f.group_idx);
      }
      if (!f.kv_cache_spec_kind.empty()) {
        PackStr(pk, "kv_cache_spec_kind");
        PackStr(pk, f.kv_cache_spec_kind);
      }
      if (f.kv_cache_spec_sliding_window.has_value()) {
        PackStr(pk, "kv_cache_spec_sliding_window");
        pk.pack_int32(*f.kv_cache_spec_sliding_window);
      }
      return;
    }
    case VllmKvEvent::Kind::kBlockRemoved:
      pk.pack_map(f.group_idx.has_value() ? 4 : 3);
      PackStr(pk, "type");
      PackStr(pk, "BlockRemoved");
      PackStr(pk, "block_hashes");
      pk.pack_array(static_cast<uint32_t>(e.block_hashes.size()));
      for (uint64_t h : e.block_hashes) pk.pack_uint64(h);
      PackStr(pk, "medium");
      PackStr(pk, MediumOf(e, f));
      if (f.group_idx.has_value()) {
        PackStr(pk, "group_idx");
        pk.pack_int32(*f.group_idx);
      }
      return;
    case VllmKvEvent::Kind::kAllBlocksCleared:
      pk.pack_map(1);
      PackStr(pk, "type");
      PackStr(pk, "AllBlocksCleared");
      return;
  }
}

std::string BigEndian(int64_t v) {
  std::string out(8, '\0');
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xff);
  return out;
}

// vLLM's rule for its PUB endpoint: bind a stable address, connect to a
// volatile one.
bool BindsPub(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

}  // namespace

std::string EncodeVllmEventBatch(double ts, const std::vector<VllmKvEvent>& events,
                                 const VllmEventFormat& format) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  pk.pack_map(3);
  PackStr(pk, "ts");
  // Always float 64 (msgspec's encoding of a float): msgpack-c's
  // pack_double writes a whole number as an integer.
  uint64_t bits;
  std::memcpy(&bits, &ts, sizeof bits);
  char f64[9];
  f64[0] = static_cast<char>(0xcb);
  for (int i = 0; i < 8; ++i) f64[1 + i] = static_cast<char>((bits >> (56 - 8 * i)) & 0xff);
  buf.write(f64, sizeof f64);
  PackStr(pk, "events");
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const VllmKvEvent& e : events) PackEvent(pk, e, format);
  PackStr(pk, "data_parallel_rank");
  pk.pack_int32(format.data_parallel_rank);
  return std::string(buf.data(), buf.size());
}

void VllmEventTranslator::Add(const KvCacheEvent& e, std::vector<VllmKvEvent>* out) {
  switch (e.kind) {
    case KvCacheEvent::Kind::kBlockStored: {
      // vLLM publishes full blocks only.
      if (static_cast<int32_t>(e.token_ids.size()) != block_size_) return;
      if (!PublishedFor(e).insert(e.block_hash).second) return;
      VllmKvEvent* last = out->empty() ? nullptr : &out->back();
      const bool extends = last != nullptr && last->kind == VllmKvEvent::Kind::kBlockStored &&
                           last->tier == e.tier && last->group == e.group &&
                           e.parent_hash != 0 && last->block_hashes.back() == e.parent_hash;
      if (!extends) {
        VllmKvEvent s;
        s.kind = VllmKvEvent::Kind::kBlockStored;
        s.tier = e.tier;
        s.group = e.group;
        if (e.parent_hash != 0) s.parent_block_hash = e.parent_hash;
        out->push_back(std::move(s));
        last = &out->back();
      }
      last->block_hashes.push_back(e.block_hash);
      // extra_keys: a namespaced first block carries its scope (vLLM puts a
      // request's cache_salt in its first block's extra keys); the others
      // of the event get None, and an event with no scope has no list.
      if (!e.scope.empty() || !last->extra_keys.empty()) {
        last->extra_keys.resize(last->block_hashes.size() - 1);
        last->extra_keys.push_back(e.scope.empty() ? std::vector<std::string>{}
                                                   : std::vector<std::string>{e.scope});
      }
      last->token_ids.insert(last->token_ids.end(), e.token_ids.begin(), e.token_ids.end());
      return;
    }
    case KvCacheEvent::Kind::kBlockRemoved: {
      if (PublishedFor(e).erase(e.block_hash) == 0) return;
      if (out->empty() || out->back().kind != VllmKvEvent::Kind::kBlockRemoved ||
          out->back().tier != e.tier || out->back().group != e.group) {
        VllmKvEvent r;
        r.kind = VllmKvEvent::Kind::kBlockRemoved;
        r.tier = e.tier;
        r.group = e.group;
        out->push_back(std::move(r));
      }
      out->back().block_hashes.push_back(e.block_hash);
      return;
    }
    case KvCacheEvent::Kind::kAllCleared: {
      if (e.group != 0) {
        // Another group's index emptied (the engine empties every group
        // with group 0's, whose AllBlocksCleared the consumer already has).
        group_published_.erase(e.group);
        return;
      }
      // vLLM's AllBlocksCleared clears every group: so do we.
      group_published_.clear();
      published_[0].clear();  // the index: the tiers keep their pages
      VllmKvEvent c;
      c.kind = VllmKvEvent::Kind::kAllBlocksCleared;
      out->push_back(std::move(c));
      return;
    }
  }
}

std::unordered_set<uint64_t>& VllmEventTranslator::PublishedFor(const KvCacheEvent& e) {
  if (e.group != 0 && e.tier == KvTier::kNone) return group_published_[e.group];
  return published_[static_cast<int>(e.tier)];
}

void VllmEventTranslator::AddSnapshot(const std::vector<KvCacheEvent>& blocks,
                                      std::vector<VllmKvEvent>* out) {
  KvCacheEvent clear;
  clear.kind = KvCacheEvent::Kind::kAllCleared;
  Add(clear, out);
  // The snapshot lists the tiers' pages too.
  published_[1].clear();
  published_[2].clear();
  for (const KvCacheEvent& b : blocks) Add(b, out);
}

struct VllmEventPublisher::Impl {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;
  std::deque<std::pair<uint64_t, std::string>> buffer;  // (seq, payload)
};

absl::StatusOr<std::unique_ptr<VllmEventPublisher>> VllmEventPublisher::Start(
    KvEventLog* log, VllmEventPublisherOptions options) {
  std::unique_ptr<VllmEventPublisher> p(new VllmEventPublisher());
  p->log_ = log;
  p->options_ = std::move(options);
  p->impl_ = std::make_unique<Impl>();
  Impl& m = *p->impl_;
  try {
    m.pub.set(zmq::sockopt::sndhwm, 100000);
    m.pub.set(zmq::sockopt::linger, 500);
    if (BindsPub(p->options_.endpoint)) {
      m.pub.bind(p->options_.endpoint);
    } else {
      m.pub.connect(p->options_.endpoint);
    }
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-events-endpoint ", p->options_.endpoint, ": ", e.what()));
  }
  if (!p->options_.replay_endpoint.empty()) {
    try {
      m.replay.emplace(m.ctx, zmq::socket_type::router);
      m.replay->set(zmq::sockopt::linger, 0);
      m.replay->bind(p->options_.replay_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-events-replay-endpoint ",
                                                     p->options_.replay_endpoint, ": ", e.what()));
    }
  }
  spdlog::info("KV events (vLLM format): PUB {} {}{}, medium {}, block size {}",
               BindsPub(p->options_.endpoint) ? "bound to" : "connecting to",
               p->options_.endpoint,
               p->options_.replay_endpoint.empty()
                   ? std::string()
                   : absl::StrCat(", replay on ", p->options_.replay_endpoint),
               p->options_.format.medium, p->options_.format.block_size);
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  return p;
}

VllmEventPublisher::~VllmEventPublisher() { Stop(); }

void VllmEventPublisher::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void VllmEventPublisher::Loop() {
  Impl& m = *impl_;
  VllmEventTranslator translator(options_.format.block_size);
  uint64_t after = 0;
  auto service_replay = [&] {
    while (true) {
      std::vector<zmq::message_t> frames;
      zmq::recv_result_t got =
          zmq::recv_multipart(*m.replay, std::back_inserter(frames), zmq::recv_flags::dontwait);
      if (!got.has_value()) return;
      if (frames.size() != 3 || frames[2].size() != 8) {
        spdlog::warn("KV events replay: ignored a request of {} frames", frames.size());
        continue;
      }
      uint64_t start = 0;
      const auto* b = static_cast<const unsigned char*>(frames[2].data());
      for (int i = 0; i < 8; ++i) start = (start << 8) | b[i];
      const std::string id = frames[0].to_string();
      for (const auto& [seq, payload] : m.buffer) {
        if (seq < start) continue;
        const std::string seq_bytes = BigEndian(static_cast<int64_t>(seq));
        m.replay->send(zmq::buffer(id), zmq::send_flags::sndmore);
        m.replay->send(zmq::message_t(), zmq::send_flags::sndmore);
        m.replay->send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
        m.replay->send(zmq::buffer(payload), zmq::send_flags::none);
      }
      const std::string end = BigEndian(-1);
      m.replay->send(zmq::buffer(id), zmq::send_flags::sndmore);
      m.replay->send(zmq::message_t(), zmq::send_flags::sndmore);
      m.replay->send(zmq::buffer(end), zmq::send_flags::sndmore);
      m.replay->send(zmq::message_t(), zmq::send_flags::none);
    }
  };
  while (true) {
    // Stop flushes: one last read without waiting after the flag is seen.
    const bool last_round = stop_.load();
    if (m.replay.has_value()) {
      try {
        service_replay();
      } catch (const zmq::error_t& e) {
        spdlog::warn("KV events replay: {}", e.what());
      }
    }
    const KvEventRead r =
        log_->Read(after, 4096, last_round ? std::chrono::milliseconds(0) : std::chrono::milliseconds(20));
    std::vector<VllmKvEvent> events;
    if (r.is_snapshot) {
      translator.AddSnapshot(r.snapshot, &events);
      after = r.snapshot_sequence;
    }
    for (const SequencedKvEvent& se : r.events) {
      translator.Add(se.event, &events);
      after = se.sequence;
    }
    if (!events.empty()) {
      const double ts =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      std::string payload = EncodeVllmEventBatch(ts, events, options_.format);
      const uint64_t seq = next_seq_.load();
      const std::string seq_bytes = BigEndian(static_cast<int64_t>(seq));
      try {
        m.pub.send(zmq::buffer(options_.topic), zmq::send_flags::sndmore);
        m.pub.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
        m.pub.send(zmq::buffer(payload), zmq::send_flags::none);
      } catch (const zmq::error_t& e) {
        spdlog::warn("KV events publish: {}", e.what());
      }
      m.buffer.emplace_back(seq, std::move(payload));
      while (m.buffer.size() > options_.replay_batches) m.buffer.pop_front();
      next_seq_.store(seq + 1);
    }
    if (r.closed || (last_round && r.events.empty() && !r.is_snapshot)) break;
  }
}

}  // namespace kvserve
