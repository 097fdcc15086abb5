// The Engine's named KV operations (declared in scheduler/engine.h): what
// code off the engine thread may do to blocks, each one a task on the engine
// thread with a plain answer. Prefill leases of the P/D node pin, follow and
// give back cached blocks (PinPrefix, PinCachedBlocks, Unpin, ReleaseBlocks,
// and a test hook that frees and overwrites them); cache control retains,
// renews, releases and lists leases, explains what a prompt would get, and
// marks prefixes public, all on EngineOptions::cache_control. The KV cache
// manager and the tiers stay behind these: server/ never names them.

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/runtime.h"
#include "scheduler/engine.h"

namespace kvserve {

// A sequence-less SeqKv: it holds a reference on each block it matched,
// given back by KvCacheManager::Discard on the engine thread.
class KvPin {
 public:
  explicit KvPin(KvPool* pool) : kv(pool) {}
  SeqKv kv;
};

namespace {

absl::Status NoCacheControl() {
  return absl::FailedPreconditionError(
      "cache control is off (it needs the prefix cache: drop --no-prefix-cache)");
}

}  // namespace

template <typename T>
absl::StatusOr<T> Engine::AskEngineThread(
    std::function<absl::StatusOr<T>(KvCacheManager*, KvTiers*)> fn) {
  // Shared with the task, which may run after a timed-out caller is gone.
  auto answer = std::make_shared<std::promise<absl::StatusOr<T>>>();
  std::future<absl::StatusOr<T>> f = answer->get_future();
  (void)RunOnEngineThread([answer, fn = std::move(fn)](KvCacheManager* kv, KvTiers* tiers) {
    answer->set_value(fn(kv, tiers));
  });
  if (f.wait_for(kEngineOpTimeout) != std::future_status::ready) {
    return absl::DeadlineExceededError(
        absl::StrCat("the engine did not answer within ", kEngineOpTimeout.count(), " s"));
  }
  return f.get();
}

absl::StatusOr<PinnedPrefix> Engine::PinPrefix(std::string salt, std::vector<int32_t> tokens,
                                               int32_t max_tokens) {
  return AskEngineThread<PinnedPrefix>(
      [salt = std::move(salt), tokens = std::move(tokens), max_tokens](
          KvCacheManager* m, KvTiers*) -> absl::StatusOr<PinnedPrefix> {
        if (m->pool().on_device()) {
          // Every write to the blocks about to be pinned was enqueued on the
          // forward's stream before now: wait for it, so a staging sync (or
          // a peer's direct read) sees the finished KV.
          absl::StatusOr<cuda::CudaEvent> e = cuda::CudaEvent::Create();
          absl::Status s = e.ok() ? e->Record(m->pool().options().device_stream) : e.status();
          if (s.ok()) s = e->Synchronize();
          if (!s.ok()) {
            return absl::InternalError(
                absl::StrCat("waiting for the device's KV writes failed: ", s.message()));
          }
        }
        PinnedPrefix p;
        p.pin = std::make_shared<KvPin>(m->mutable_pool());
        const int32_t bs = m->block_size();
        int32_t matched = 0;
        if (max_tokens >= bs) matched = m->MatchPrefix(&p.pin->kv, salt, tokens, max_tokens);
        const std::vector<BlockHandle>& hs = p.pin->kv.table.blocks();
        for (int32_t i = 0; i < matched / bs && i < static_cast<int32_t>(hs.size()); ++i) {
          p.blocks.push_back(hs[i]);
        }
        p.held_blocks = p.pin->kv.table.num_blocks();
        if (m->hybrid()) {
          // Every other group's blocks a continuation from the end of the
          // whole blocks reads: a window group's from the first block its
          // window reaches (the rest are its placeholder).
          const int32_t nb = static_cast<int32_t>(p.blocks.size());
          const int32_t end = nb * bs;
          bool served = true;
          for (int32_t g = 1; g < m->num_groups() && served; ++g) {
            const int32_t w = m->group_window(g);
            PinnedPrefix::Group pg;
            pg.first_block = w > 0 ? std::max(0, end - w + 1) / bs : 0;
            pg.first_block = std::min(pg.first_block, nb);
            const BlockTable& t = m->group_table(p.pin->kv, g);
            for (int32_t b = pg.first_block; b < nb && served; ++b) {
              served = b < t.num_blocks() && !m->IsGroupPlaceholder(g, t.blocks()[b]);
              if (served) pg.blocks.push_back(t.blocks()[b]);
            }
            p.held_blocks += t.num_blocks();
            p.groups.push_back(std::move(pg));
          }
          if (!served) {
            // The match ended inside a block and a window group let go of
            // a block the whole-block end needs: offer nothing.
            p.blocks.clear();
            p.groups.clear();
          }
        }
        return p;
      });
}

void Engine::Unpin(std::shared_ptr<KvPin> pin) {
  if (pin == nullptr) return;
  (void)RunOnEngineThread(
      [pin = std::move(pin)](KvCacheManager* m, KvTiers*) { m->Discard(&pin->kv); });
}

void Engine::PinCachedBlocks(
    std::string salt, std::vector<int32_t> tokens, int32_t max_tokens, std::function<bool()> before,
    std::function<void(const absl::Status&, std::vector<BlockHandle>*)> take) {
  (void)RunOnEngineThread([salt = std::move(salt), tokens = std::move(tokens), max_tokens,
                           before = std::move(before),
                           take = std::move(take)](KvCacheManager* m, KvTiers*) {
    if (before != nullptr && !before()) return;
    std::vector<BlockHandle> none;
    if (m->mutable_prefix_cache() == nullptr) {
      take(absl::FailedPreconditionError("the prefix cache is off"), &none);
      return;
    }
    std::vector<uint64_t> hashes;
    PrefixMatch pin = m->mutable_prefix_cache()->Pin(salt, tokens, max_tokens, &hashes);
    take(absl::OkStatus(), &pin.blocks);
    m->mutable_pool()->Release(pin.blocks);
  });
}

void Engine::ReleaseBlocks(std::vector<BlockHandle> blocks) {
  if (blocks.empty()) return;
  (void)RunOnEngineThread([blocks = std::move(blocks)](KvCacheManager* m, KvTiers*) {
    m->mutable_pool()->Release(blocks);
  });
}

std::future<void> Engine::EvictAllCachedForTest() {
  return RunOnEngineThread([](KvCacheManager* kv, KvTiers* tiers) {
    kv->EnsureFree(kv->num_blocks());
    if (tiers != nullptr) tiers->Flush();
  });
}

absl::Status Engine::DiscardAndScribbleForTest(std::shared_ptr<KvPin> pin,
                                               std::vector<BlockHandle> refs) {
  return AskEngineThread<bool>([pin = std::move(pin), refs = std::move(refs)](
                                   KvCacheManager* m, KvTiers*) -> absl::StatusOr<bool> {
           if (pin != nullptr) m->Discard(&pin->kv);
           m->mutable_pool()->Release(refs);
           (void)m->ClearPrefixCache();
           KvPool* pool = m->mutable_pool();
           std::vector<BlockHandle> hs;
           if (pool->Allocate(pool->num_free_blocks(), &hs).ok()) {
             const std::vector<uint8_t> junk(static_cast<size_t>(pool->block_bytes()), 0x5a);
             for (const BlockHandle& h : hs) {
               uint8_t* block = pool->storage() + static_cast<int64_t>(h.id) * pool->block_bytes();
               if (pool->on_device()) {
                 (void)cuda::CopyToDevice(block, junk.data(), junk.size());
               } else {
                 std::memcpy(block, junk.data(), junk.size());
               }
             }
             pool->Release(hs);
           }
           return true;
         })
      .status();
}

absl::StatusOr<int32_t> Engine::PeekCachedPrefix(std::string salt, std::vector<int32_t> tokens,
                                                 int32_t max_tokens) {
  return AskEngineThread<int32_t>(
      [salt = std::move(salt), tokens = std::move(tokens), max_tokens](
          KvCacheManager* m, KvTiers*) -> absl::StatusOr<int32_t> {
        return m->PeekPrefix(salt, tokens, max_tokens);
      });
}

absl::StatusOr<std::string> Engine::PublicSalt() {
  return AskEngineThread<std::string>([](KvCacheManager* m, KvTiers*) -> absl::StatusOr<std::string> {
    return m->prefix_cache() != nullptr ? m->prefix_cache()->public_salt() : std::string();
  });
}

absl::StatusOr<RetainAnswer> Engine::Retain(RetainRequest request) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<RetainAnswer>(
      [cc, request = std::move(request)](KvCacheManager* m, KvTiers*) -> absl::StatusOr<RetainAnswer> {
        return cc->Retain(m, request);
      });
}

void Engine::RetainThen(RetainRequest request,
                        std::function<void(absl::StatusOr<RetainAnswer>)> then) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) {
    then(NoCacheControl());
    return;
  }
  (void)RunOnEngineThread([cc, request = std::move(request),
                           then = std::move(then)](KvCacheManager* m, KvTiers*) {
    then(cc->Retain(m, request));
  });
}

absl::StatusOr<std::optional<LeaseInfo>> Engine::RenewLease(uint64_t id, double ttl_s,
                                                            std::optional<std::string> tenant) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<std::optional<LeaseInfo>>(
      [cc, id, ttl_s, tenant = std::move(tenant)](
          KvCacheManager* m, KvTiers*) -> absl::StatusOr<std::optional<LeaseInfo>> {
        return cc->Renew(m, id, ttl_s, tenant);
      });
}

absl::StatusOr<bool> Engine::ReleaseLease(uint64_t id, std::optional<std::string> tenant) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<bool>(
      [cc, id, tenant = std::move(tenant)](KvCacheManager* m, KvTiers*) -> absl::StatusOr<bool> {
        return cc->Release(m, id, tenant);
      });
}

absl::StatusOr<std::vector<LeaseInfo>> Engine::ListLeases(std::optional<std::string> tenant) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<std::vector<LeaseInfo>>(
      [cc, tenant = std::move(tenant)](KvCacheManager*,
                                       KvTiers*) -> absl::StatusOr<std::vector<LeaseInfo>> {
        return cc->List(tenant);
      });
}

absl::StatusOr<CacheReport> Engine::ExplainCache(std::string salt, std::vector<int32_t> tokens,
                                                 std::function<bool(const std::string&)> may_see) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<CacheReport>(
      [cc, salt = std::move(salt), tokens = std::move(tokens), may_see = std::move(may_see)](
          KvCacheManager* m, KvTiers* tiers) -> absl::StatusOr<CacheReport> {
        return cc->Explain(*m, tiers, salt, tokens, may_see);
      });
}

absl::StatusOr<PublicMarking> Engine::MarkPublic(RetainRequest request) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<PublicMarking>(
      [cc, request = std::move(request)](KvCacheManager* m,
                                         KvTiers*) -> absl::StatusOr<PublicMarking> {
        if (m->mutable_prefix_cache() == nullptr) {
          return absl::FailedPreconditionError("the prefix cache is off");
        }
        PublicMarking out;
        out.marked_blocks = m->mutable_prefix_cache()->MarkPublic(request.tokens);
        // Pinned while public: every tenant relies on it.
        out.retention = cc->Retain(m, request);
        return out;
      });
}

absl::StatusOr<int32_t> Engine::UnmarkPublic(std::vector<int32_t> tokens,
                                             std::string lease_tenant) {
  CacheControl* cc = options_.cache_control.get();
  if (cc == nullptr) return NoCacheControl();
  return AskEngineThread<int32_t>(
      [cc, tokens = std::move(tokens), lease_tenant = std::move(lease_tenant)](
          KvCacheManager* m, KvTiers*) -> absl::StatusOr<int32_t> {
        if (m->mutable_prefix_cache() == nullptr) {
          return absl::FailedPreconditionError("the prefix cache is off");
        }
        const int32_t unmarked = m->mutable_prefix_cache()->UnmarkPublic(tokens);
        for (const LeaseInfo& l : cc->List(lease_tenant)) cc->Release(m, l.id, std::nullopt);
        return unmarked;
      });
}

}  // namespace kvserve
