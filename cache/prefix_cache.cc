#include "cache/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"

namespace kvserve {
namespace {

class SteadyClockImpl final : public Clock {
 public:
  int64_t NowNanos() override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

class LruPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "lru"; }
  double Key(const CachedBlockInfo& b) const override {
    return static_cast<double>(b.last_access_ns);
  }
};

// Blocks up to this many tokens hash from a stack buffer; bigger ones (no
// model we serve uses them) take one heap allocation per hash.
constexpr int32_t kStackHashTokens = 256;

// The chained hash of one block: XXH3_64bits over the parent's hash (8 bytes,
// host order) followed by the block's tokens (int32, host order). Chaining
// makes a hash name the whole prefix, not just the block's own tokens, so a
// router can key its replica by hash alone.
uint64_t ChainHash(uint64_t parent_hash, absl::Span<const int32_t> tokens) {
  const size_t token_bytes = tokens.size() * sizeof(int32_t);
  const size_t n = sizeof(parent_hash) + token_bytes;
  if (tokens.size() <= static_cast<size_t>(kStackHashTokens)) {
    alignas(8) unsigned char buf[sizeof(uint64_t) + kStackHashTokens * sizeof(int32_t)];
    std::memcpy(buf, &parent_hash, sizeof(parent_hash));
    if (token_bytes > 0) std::memcpy(buf + sizeof(parent_hash), tokens.data(), token_bytes);
    return XXH3_64bits(buf, n);
  }
  std::vector<unsigned char> buf(n);
  std::memcpy(buf.data(), &parent_hash, sizeof(parent_hash));
  std::memcpy(buf.data() + sizeof(parent_hash), tokens.data(), token_bytes);
  return XXH3_64bits(buf.data(), n);
}

// Debian's Abseil has its own string_view, which the maps' heterogeneous
// lookup needs.
absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Leading tokens a and b share.
int32_t SharedPrefix(absl::Span<const int32_t> a, absl::Span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int32_t>(i);
}

}  // namespace

const char* KvTierName(KvTier t) {
  switch (t) {
    case KvTier::kHost:
      return "host";
    case KvTier::kDisk:
      return "disk";
    case KvTier::kNone:
      break;
  }
  return "none";
}

uint64_t PrefixCache::BlockHash(uint64_t parent_hash, absl::Span<const int32_t> tokens) {
  return ChainHash(parent_hash, tokens);
}

Clock* SteadyClock() {
  static SteadyClockImpl clock;
  return &clock;
}

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>(); }

namespace {

class CostAwarePolicy final : public EvictionPolicy {
 public:
  explicit CostAwarePolicy(const EvictionCosts* costs) : costs_(costs) {}
  const char* name() const override { return "cost"; }
  double Key(const CachedBlockInfo& b) const override {
    double restore = costs_->RecomputeSeconds(b);
    const double reload = costs_->ReloadSeconds(b);
    if (reload >= 0) restore = std::min(restore, reload);
    const double frequency = static_cast<double>(std::min<int64_t>(b.hits + 1, kMaxFrequency));
    return b.access_base + frequency * restore;
  }
  double AccessBase() const override { return inflation_; }
  void OnEvicted(double key) override { inflation_ = std::max(inflation_, key); }

 private:
  // Hits past this count no more: a prefix hot an hour ago must still age.
  static constexpr int64_t kMaxFrequency = 8;
  const EvictionCosts* costs_;
  double inflation_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(const EvictionCosts* costs) {
  return std::make_unique<CostAwarePolicy>(costs);
}

// One cached block, or a namespace root (parent == nullptr, no block, no
// tokens). Nodes sit on an intrusive list in insertion order; since a node is
// only ever created under an existing parent, that order is also a
// topological one (parents first), which Dump and CountEvictableBlocksSlow use
// instead of recursion (a long multi-turn chain is thousands of levels deep).
struct PrefixCache::Node {
  uint64_t hash = 0;
  Node* parent = nullptr;
  BlockHandle block;
  std::vector<int32_t> tokens;
  // Unordered (removal swaps with the last, so it is O(1) even under a root
  // with thousands of children); ties are broken by seq, never by position.
  std::vector<Node*> children;
  int32_t index_in_parent = 0;  // where this node sits in parent->children
  int64_t last_access_ns = 0;
  double access_base = 0;  // the policy's AccessBase() at that access
  int64_t hits = 0;
  int32_t depth = 0;
  uint64_t seq = 0;  // insertion order: the policy's tie-break
  Node* prev = nullptr;
  Node* next = nullptr;
  // Other nodes holding the same pool block (only ever a misuse of Insert;
  // the by-block index keeps them all so none misses a refcount change).
  Node* prev_same = nullptr;
  Node* next_same = nullptr;
  // Evictable count, kept incrementally: a node is blocked (not freeable by
  // repeated eviction) while its block has an outside reference (pinned) or
  // any child is blocked.
  bool pinned = false;
  int32_t blocked_children = 0;
  bool scratch_blocked = false;  // CountEvictableBlocksSlow only
  bool is_public = false;        // MarkPublic: shared with every salt
  // Sliding window (SetWindow): a hollow node keeps its tokens (a path to
  // its children) but no K/V; `block` is unset and it holds no reference.
  // A match never ends where a hollow block lies inside the window.
  bool hollow = false;
  // A cached prefix boundary's window: never hollowed (KeepWindowBlock).
  bool keep_window = false;
  // Its K/V went through a lossy tier re-encoding (--kv-host-dtype), or was
  // computed on top of such K/V: cached, but never exact (PrefixMatch::
  // lossy_tokens tells the matcher).
  bool lossy = false;
  std::string salt;      // roots only: their key in Impl::roots
};

struct PrefixCache::Impl final : public KvPoolObserver {
  KvPool* pool = nullptr;
  PrefixCacheOptions options;
  Clock* clock = nullptr;
  std::string root_key_prefix;  // length-prefixed model identity; salt follows

  // Roots by salt (exact string keys, so namespaces never merge on a hash).
  absl::flat_hash_map<std::string, std::unique_ptr<Node>> roots;
  // Every block node by chained hash: the child lookup. A hit is verified
  // (same parent, same tokens) before it is trusted.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Node>> nodes;
  Node* oldest = nullptr;  // insertion-order list
  Node* newest = nullptr;
  uint64_t next_seq = 1;
  PrefixCacheStats stats;
  // Pool block id -> a node holding that block (the head of its same-block
  // list), so a refcount change the pool reports finds its node in O(1).
  std::vector<Node*> by_block;
  int32_t num_blocked = 0;  // block nodes that are blocked
  int32_t num_public = 0;   // block nodes marked public
  // Sliding window (SetWindow): 0 is full attention.
  int32_t window = 0;
  BlockHandle stand_in{};     // what Match hands out for a hollow node
  int32_t num_hollow = 0;
  int32_t num_hollow_free = 0;  // hollow nodes that are not blocked (free no block)
  // Public marks by chained hash. They outlive the nodes: a public block
  // evicted to a lower tier is still public, so every scope keeps naming
  // it (and what follows it) the same way, and takes it back from the tier.
  absl::flat_hash_set<uint64_t> public_hashes;

  // Where a walk stopped (Probe).
  struct WalkEnd {
    const Node* node = nullptr;  // last full-block node, or the root (nullptr: no root)
    int32_t full_pos = 0;        // tokens the full blocks covered (relative to offset)
    const Node* partial = nullptr;
    int32_t partial_shared = 0;
    std::string ns;              // the namespace walked after the public part
    int32_t offset = 0;          // tokens served by public blocks before it
    bool public_cut = false;     // stopped inside a public prefix the pool lost part of
  };

  static bool IsDerived(std::string_view salt) {
    return salt.size() >= 5 && salt.substr(0, 5) == std::string_view("\0pub:", 5);
  }

  // The namespace a salt caches in after a public prefix ending at `last`.
  static std::string DerivedSalt(std::string_view salt, uint64_t last_hash) {
    std::string s("\0pub:", 5);
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(last_hash));
    s.append(hex);
    s.push_back('\0');
    s.append(salt);
    return s;
  }

  // The public-marked full blocks the prompt starts with, by their marks
  // (whether the pool still holds them or not); none for the public
  // namespace itself or a derived one. Returns the tokens they cover;
  // *pub gets the leading ones the pool holds (fewer than all when some
  // were evicted), *hashes (optional) all their chained hashes, *derived
  // the namespace the rest lives in.
  int32_t ResolvePublic(std::string_view salt, absl::Span<const int32_t> tokens, int32_t limit,
                        std::vector<Node*>* pub, std::string* derived,
                        std::vector<uint64_t>* hashes = nullptr) const {
    if (public_hashes.empty() || salt == options.public_salt || IsDerived(salt)) return 0;
    const Node* node = FindRoot(options.public_salt);
    bool in_pool = node != nullptr;
    uint64_t h = node != nullptr ? node->hash : RootHash(options.public_salt);
    const int32_t bs = pool->block_size();
    limit = std::max(0, std::min(static_cast<int32_t>(tokens.size()), limit));
    int32_t pos = 0;
    while (pos + bs <= limit) {
      const absl::Span<const int32_t> block = tokens.subspan(pos, bs);
      const uint64_t next = ChainHash(h, block);
      if (!public_hashes.contains(next)) break;
      if (in_pool) {
        Node* child = FindChild(node, block, next);
        if (child != nullptr && child->is_public) {
          pub->push_back(child);
          node = child;
        } else {
          in_pool = false;  // this one and the rest were evicted
        }
      }
      if (hashes != nullptr) hashes->push_back(next);
      h = next;
      pos += bs;
    }
    if (pos > 0) *derived = DerivedSalt(salt, h);
    return pos;
  }

  // The chained hashes of tokens' first n_blocks full blocks as salt's
  // requests name them: public blocks from the public root, the rest from
  // the namespace derived from them (or salt's own root).
  void ChainHashes(std::string_view salt, absl::Span<const int32_t> tokens, int32_t n_blocks,
                   std::vector<uint64_t>* out) const {
    const int32_t bs = pool->block_size();
    const int32_t limit =
        std::min(static_cast<int32_t>(tokens.size()) / bs, std::max(0, n_blocks)) * bs;
    std::vector<Node*> pub;
    std::string derived;
    const int32_t pub_tokens = ResolvePublic(salt, tokens, limit, &pub, &derived, out);
    uint64_t h = RootHash(pub_tokens > 0 ? std::string_view(derived) : salt);
    for (int32_t pos = pub_tokens; pos + bs <= limit; pos += bs) {
      h = ChainHash(h, tokens.subspan(pos, bs));
      out->push_back(h);
    }
  }

  static bool Blocked(const Node* n) { return n->pinned || n->blocked_children > 0; }

  // n's blocked state was `was` and may have changed: carry the change up
  // the path while it keeps flipping ancestors.
  void Propagate(Node* n, bool was) {
    for (;;) {
      const bool now = Blocked(n);
      if (now == was) return;
      num_blocked += now ? 1 : -1;
      if (n->hollow) num_hollow_free += now ? -1 : 1;
      Node* parent = n->parent;
      if (parent->parent == nullptr) return;  // roots are not blocks
      was = Blocked(parent);
      parent->blocked_children += now ? 1 : -1;
      n = parent;
    }
  }

  void SetPinned(Node* n, bool pinned) {
    if (n->pinned == pinned) return;
    const bool was = Blocked(n);
    n->pinned = pinned;
    Propagate(n, was);
  }

  // KvPoolObserver: a block went shared or sole. Sequences release their
  // blocks through the pool, never through the cache, so this is how the
  // cache learns a block it holds is evictable again.
  void OnSharedChanged(int32_t id, bool /*shared*/) override {
    if (id < 0 || static_cast<size_t>(id) >= by_block.size()) return;
    for (Node* n = by_block[id]; n != nullptr; n = n->next_same) {
      if (n->hollow) continue;
      SetPinned(n, pool->ref_count(n->block) != 1);
    }
  }

  void RegisterBlock(Node* n) {
    Node*& head = by_block[n->block.id];
    n->prev_same = nullptr;
    n->next_same = head;
    if (head != nullptr) head->prev_same = n;
    head = n;
  }

  void UnregisterBlock(Node* n) {
    if (n->prev_same != nullptr) {
      n->prev_same->next_same = n->next_same;
    } else {
      by_block[n->block.id] = n->next_same;
    }
    if (n->next_same != nullptr) n->next_same->prev_same = n->prev_same;
    n->prev_same = n->next_same = nullptr;
  }

  uint64_t RootHash(std::string_view salt) const {
    std::string key = root_key_prefix;
    key.append(salt);
    return XXH3_64bits(key.data(), key.size());
  }

  const Node* FindRoot(std::string_view salt) const {
    auto it = roots.find(AbslView(salt));
    return it == roots.end() ? nullptr : it->second.get();
  }

  Node* GetOrCreateRoot(std::string_view salt) {
    auto it = roots.find(AbslView(salt));
    if (it != roots.end()) return it->second.get();
    auto root = std::make_unique<Node>();
    root->hash = RootHash(salt);
    root->salt = std::string(salt);
    Node* raw = root.get();
    roots.emplace(std::string(salt), std::move(root));
    return raw;
  }

  // The child of parent holding exactly `tokens`, or nullptr. A hash hit on a
  // node elsewhere in the tree or with other tokens is a 64-bit collision and
  // counts as a miss.
  Node* FindChild(const Node* parent, absl::Span<const int32_t> tokens, uint64_t hash) const {
    auto it = nodes.find(hash);
    if (it == nodes.end()) return nullptr;
    Node* n = it->second.get();
    if (n->parent != parent || absl::Span<const int32_t>(n->tokens) != tokens) return nullptr;
    return n;
  }

  // Walks the longest cached prefix of tokens[0, max_tokens) and calls
  // visit(node) for each matched node in order (the partial one last).
  // Returns the tokens covered.
  template <typename Visit>
  int32_t Walk(std::string_view salt, absl::Span<const int32_t> tokens, int32_t max_tokens,
               Visit visit, WalkEnd* end = nullptr) const {
    std::vector<Node*> pub;
    std::string derived;
    const int32_t pub_tokens = ResolvePublic(salt, tokens, max_tokens, &pub, &derived);
    for (Node* n : pub) visit(n);
    if (pub_tokens == 0) return WalkFrom(salt, tokens, max_tokens, visit, end);
    const int32_t in_pool = static_cast<int32_t>(pub.size()) * pool->block_size();
    if (in_pool < pub_tokens) {
      // Part of the public prefix left the pool: the match ends there (a
      // lower tier may hold the rest, under the same hashes).
      if (end != nullptr) {
        end->ns = options.public_salt;
        end->node = pub.empty() ? FindRoot(options.public_salt) : pub.back();
        end->full_pos = in_pool;
        end->public_cut = true;
      }
      return in_pool;
    }
    if (end != nullptr) end->offset = pub_tokens;
    return pub_tokens + WalkFrom(derived, tokens.subspan(pub_tokens), max_tokens - pub_tokens,
                                 visit, end);
  }

  template <typename Visit>
  int32_t WalkFrom(std::string_view salt, absl::Span<const int32_t> tokens, int32_t max_tokens,
                   Visit visit, WalkEnd* end) const {
    if (end != nullptr) end->ns = std::string(salt);
    const Node* node = FindRoot(salt);
    if (node == nullptr) return 0;
    if (end != nullptr) end->node = node;
    const int32_t bs = pool->block_size();
    const int32_t limit =
        std::max(0, std::min(static_cast<int32_t>(tokens.size()), max_tokens));
    int32_t pos = 0;
    while (pos + bs <= limit) {
      const absl::Span<const int32_t> block = tokens.subspan(pos, bs);
      Node* child = FindChild(node, block, ChainHash(node->hash, block));
      if (child == nullptr) break;
      visit(child);
      node = child;
      pos += bs;
    }
    if (end != nullptr) {
      end->node = node;
      end->full_pos = pos;
    }
    if (pos == limit) return pos;
    // Past the full blocks: the child sharing the most leading tokens with
    // what is left (at most one block's worth, and never past the cap).
    const absl::Span<const int32_t> rest = tokens.subspan(pos, std::min(bs, limit - pos));
    Node* best = nullptr;
    int32_t best_shared = 0;
    for (Node* child : node->children) {
      const int32_t shared = SharedPrefix(child->tokens, rest);
      if (shared > best_shared || (shared == best_shared && shared > 0 && child->seq < best->seq)) {
        best = child;
        best_shared = shared;
      }
    }
    if (best != nullptr) visit(best);
    if (end != nullptr) {
      end->partial = best;
      end->partial_shared = best_shared;
    }
    return pos + best_shared;
  }

  void Link(Node* n) {
    n->prev = newest;
    n->next = nullptr;
    if (newest != nullptr) {
      newest->next = n;
    } else {
      oldest = n;
    }
    newest = n;
  }

  void Unlink(Node* n) {
    if (n->prev != nullptr) {
      n->prev->next = n->next;
    } else {
      oldest = n->next;
    }
    if (n->next != nullptr) {
      n->next->prev = n->prev;
    } else {
      newest = n->prev;
    }
  }

  // True when the cache holds the block's only reference and nothing hangs
  // below it: dropping it frees the block and orphans nothing.
  bool Evictable(const Node* n) const {
    return n->children.empty() && (n->hollow || pool->ref_count(n->block) == 1);
  }

  // The block a match hands out for n (the window's stand-in when hollow).
  BlockHandle Held(const Node* n) const { return n->hollow ? stand_in : n->block; }

  // Walk, then cut back to the longest prefix whose last `window` tokens
  // all still have their K/V (a continuation attends to them); the window
  // dropped what lies past it. *dropped: the tokens cut (0 without a window).
  template <typename Visit>
  int32_t WindowWalk(std::string_view salt, absl::Span<const int32_t> tokens, int32_t max_tokens,
                     Visit visit, WalkEnd* end = nullptr, int32_t* dropped = nullptr) const {
    std::vector<Node*> visited;
    const int32_t covered =
        Walk(salt, tokens, max_tokens, [&](Node* n) { visited.push_back(n); }, end);
    int32_t len = covered;
    size_t keep = visited.size();
    if (window > 0 && num_hollow > 0) {
      // visited[j] holds tokens [j * bs, ...): a match ending at len needs
      // the blocks from (len - window + 1) / bs to its last one.
      const int32_t bs = pool->block_size();
      while (len > 0) {
        const int32_t lo = std::max(0, len - window + 1) / bs;
        int32_t hollow_at = -1;
        for (int32_t j = static_cast<int32_t>(keep) - 1; j >= lo; --j) {
          if (visited[static_cast<size_t>(j)]->hollow) {
            hollow_at = j;
            break;
          }
        }
        if (hollow_at < 0) break;
        len = hollow_at * bs;  // end just before the hollow block, and retry
        keep = static_cast<size_t>(hollow_at);
      }
      if (len == 0) keep = 0;
    }
    if (dropped != nullptr) *dropped = covered - len;
    for (size_t i = 0; i < keep; ++i) visit(visited[i]);
    return len;
  }

  // Makes a hollow node hold `block` again (an Insert that computed it).
  void Refill(Node* n, BlockHandle block) {
    if (!Blocked(n)) --num_hollow_free;  // hollow nodes are never pinned
    n->hollow = false;
    --num_hollow;
    n->block = block;
    pool->AddRef(block);
    RegisterBlock(n);
    SetPinned(n, pool->ref_count(block) != 1);
  }

  void Touch(Node* n, int64_t now) const {
    n->last_access_ns = now;
    n->access_base = options.policy->AccessBase();
  }

  CachedBlockInfo Info(const Node* n) const {
    CachedBlockInfo info;
    info.last_access_ns = n->last_access_ns;
    info.access_base = n->access_base;
    info.hits = n->hits;
    info.depth = n->depth;
    info.hash = n->hash;
    return info;
  }

  // Removes a leaf and releases its block. Drops the namespace root with its
  // last child, so salts that come and go leave nothing behind.
  void RemoveLeaf(Node* n) {
    Node* parent = n->parent;
    std::vector<Node*>& siblings = parent->children;
    Node* moved = siblings.back();
    siblings[n->index_in_parent] = moved;
    moved->index_in_parent = n->index_in_parent;
    siblings.pop_back();
    Unlink(n);
    // A blocked leaf is only ever pinned; it stops blocking its ancestors.
    SetPinned(n, false);
    if (n->is_public) --num_public;
    if (n->hollow) {
      --num_hollow;
      --num_hollow_free;  // a leaf that is not pinned is not blocked
    } else {
      UnregisterBlock(n);  // before Release: its callback must not find n
      pool->Release(n->block);
    }
    nodes.erase(n->hash);  // destroys n
    if (parent->parent == nullptr && parent->children.empty()) {
      const std::string salt = parent->salt;  // the key dies with the root
      roots.erase(salt);
    }
  }

  // Insert and InsertFinished: the full blocks of tokens, then (with_tail)
  // the partly filled last block as a childless leaf, unless a cached
  // sibling already starts with its tokens. One walk, one Publish.
  int32_t InsertPath(std::string_view salt, absl::Span<const int32_t> tokens,
                     absl::Span<const BlockHandle> blocks, bool with_tail, bool lossy) {
    // A prompt that starts with a public prefix keeps that part where it
    // is and caches the rest in its salt's namespace derived from it.
    std::vector<Node*> pub;
    std::string derived;
    std::vector<uint64_t> pub_hashes;
    const int32_t pub_tokens = ResolvePublic(salt, tokens, static_cast<int32_t>(tokens.size()),
                                             &pub, &derived, &pub_hashes);
    if (pub_tokens > 0) {
      const int64_t t = clock->NowNanos();
      for (Node* n : pub) Touch(n, t);
      const size_t n_pub = pub_hashes.size();
      int32_t added = 0;
      if (pub.size() < n_pub) {
        // Public blocks that came back from a lower tier (or were
        // recomputed): cached under the public root again, still marked.
        const int32_t bs = pool->block_size();
        Node* node = pub.empty() ? GetOrCreateRoot(options.public_salt) : pub.back();
        std::vector<KvCacheEvent> events;
        size_t i = pub.size();
        for (; i < n_pub && i < blocks.size(); ++i) {
          const absl::Span<const int32_t> block = tokens.subspan(i * bs, bs);
          if (nodes.contains(pub_hashes[i])) break;  // a collision: stays uncached
          node = AddChild(node, pub_hashes[i], blocks[i], block, t, &events);  // marked
          node->lossy = lossy;
          ++added;
        }
        if (node->parent == nullptr && node->children.empty()) {
          roots.erase(AbslView(options.public_salt));
        }
        stats.inserted_blocks += added;
        Publish(std::move(events));
        if (i < n_pub) return added;  // the rest needs the public part first
      }
      return added + InsertPath(derived, tokens.subspan(pub_tokens),
                                blocks.subspan(std::min(n_pub, blocks.size())), with_tail, lossy);
    }
    const int32_t bs = pool->block_size();
    const size_t full = tokens.size() / bs;
    const size_t n_blocks = std::min(full, blocks.size());
    const size_t rest = tokens.size() % bs;
    const bool tail = with_tail && rest > 0 && blocks.size() > full;
    if (n_blocks == 0 && !tail) return 0;
    const int64_t now = clock->NowNanos();
    Node* node = GetOrCreateRoot(salt);
    std::vector<KvCacheEvent> events;
    int32_t added = 0;
    bool collided = false;
    for (size_t i = 0; i < n_blocks; ++i) {
      const absl::Span<const int32_t> block = tokens.subspan(i * bs, bs);
      const uint64_t hash = ChainHash(node->hash, block);
      auto it = nodes.find(hash);
      if (it != nodes.end()) {
        Node* existing = it->second.get();
        if (existing->parent != node || absl::Span<const int32_t>(existing->tokens) != block) {
          // A 64-bit collision with another prefix: two nodes cannot share a
          // published hash, so this prefix (and what would hang below it)
          // stays uncached.
          collided = true;
          break;
        }
        // Dedupe: the cached block already holds this K/V; keep it. A
        // hollow one takes the caller's block (it computed the K/V again).
        if (existing->hollow && !(blocks[i] == stand_in)) {
          Refill(existing, blocks[i]);
          if (options.publish_hollow) StoredEvent(existing, &events);
        }
        Touch(existing, now);
        node = existing;
        continue;
      }
      // The caller's table has the window's stand-in here: no K/V, and no
      // later token of the caller reads it (a load from the KV tiers parks
      // the blocks before its window's end this way). The path goes on as
      // a hollow node, so the blocks after it, which hold K/V, can be
      // cached and matched (a match never ends where its window needs a
      // hollow node).
      if (window > 0 && blocks[i] == stand_in) {
        node = AddHollowChild(node, hash, block, now, &events);
        continue;
      }
      node = AddChild(node, hash, blocks[i], block, now, &events);
      node->lossy = lossy;
      ++added;
    }
    // The tail hangs under the last full block, when the walk got there.
    if (tail && !collided && n_blocks == full) {
      const absl::Span<const int32_t> rest_tokens = tokens.subspan(full * bs, rest);
      Node* covering = nullptr;
      for (Node* child : node->children) {
        if (SharedPrefix(child->tokens, rest_tokens) == static_cast<int32_t>(rest)) {
          covering = child;
          break;
        }
      }
      const uint64_t hash = ChainHash(node->hash, rest_tokens);
      if (covering != nullptr) {
        Touch(covering, now);
      } else if (nodes.find(hash) == nodes.end() && !(window > 0 && blocks[full] == stand_in)) {
        AddChild(node, hash, blocks[full], rest_tokens, now, &events)->lossy = lossy;
        ++added;
      }
    }
    // A namespace that gained nothing (a lone collision) keeps no empty root.
    if (node->parent == nullptr && node->children.empty()) roots.erase(AbslView(salt));
    stats.inserted_blocks += added;
    Publish(std::move(events));
    return added;
  }

  // A new node under `parent` holding `tokens` in `block` (one reference
  // taken); its BlockStored event is appended to *events.
  Node* AddChild(Node* parent, uint64_t hash, BlockHandle block, absl::Span<const int32_t> tokens,
                 int64_t now, std::vector<KvCacheEvent>* events) {
    auto owned = std::make_unique<Node>();
    Node* child = owned.get();
    child->hash = hash;
    child->parent = parent;
    child->block = block;
    child->tokens.assign(tokens.begin(), tokens.end());
    Touch(child, now);
    child->depth = parent->depth + 1;
    child->seq = next_seq++;
    pool->AddRef(child->block);
    child->index_in_parent = static_cast<int32_t>(parent->children.size());
    parent->children.push_back(child);
    Link(child);
    nodes.emplace(hash, std::move(owned));
    // A public block back from a lower tier (or recomputed) is still public.
    if (public_hashes.contains(hash)) {
      child->is_public = true;
      ++num_public;
    }
    // Unblocked so far (no children, not pinned): pinned when the caller
    // still holds the block, as it normally does.
    RegisterBlock(child);
    SetPinned(child, pool->ref_count(child->block) != 1);
    StoredEvent(child, events);
    return child;
  }

  // n's BlockStored event, appended to *events (nothing without a sink).
  void StoredEvent(const Node* n, std::vector<KvCacheEvent>* events) const {
    if (options.events == nullptr) return;
    const Node* parent = n->parent;
    KvCacheEvent e;
    e.kind = KvCacheEvent::Kind::kBlockStored;
    e.block_hash = n->hash;
    e.parent_hash = parent->parent == nullptr ? 0 : parent->hash;
    if (parent->parent == nullptr) e.scope = parent->salt;
    e.token_ids = n->tokens;
    events->push_back(std::move(e));
  }

  // A child that is hollow from the start (HollowBlock's state: tokens, no
  // block, never pinned).
  Node* AddHollowChild(Node* parent, uint64_t hash, absl::Span<const int32_t> tokens, int64_t now,
                       std::vector<KvCacheEvent>* events) {
    const size_t published = events->size();
    Node* n = AddChild(parent, hash, stand_in, tokens, now, events);
    if (options.publish_hollow) events->resize(published);  // no K/V: not stored
    SetPinned(n, false);
    UnregisterBlock(n);
    n->hollow = true;
    ++num_hollow;
    if (!Blocked(n)) ++num_hollow_free;
    n->block = BlockHandle{};
    pool->Release(stand_in);
    return n;
  }

  void Publish(std::vector<KvCacheEvent> events) {
    if (options.events != nullptr && !events.empty()) options.events->Publish(std::move(events));
  }

  int32_t DropAll() {
    const int32_t dropped = static_cast<int32_t>(nodes.size());
    // Unindexed first, so the releases' callbacks find no node.
    for (Node* n = oldest; n != nullptr; n = n->next) {
      if (!n->hollow) by_block[n->block.id] = nullptr;
    }
    num_blocked = 0;
    num_public = 0;
    num_hollow = 0;
    num_hollow_free = 0;
    public_hashes.clear();
    for (Node* n = oldest; n != nullptr; n = n->next) {
      if (!n->hollow) pool->Release(n->block);
    }
    nodes.clear();
    roots.clear();
    oldest = newest = nullptr;
    return dropped;
  }
};

PrefixCache::PrefixCache(KvPool* pool, PrefixCacheOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->pool = pool;
  impl_->by_block.assign(static_cast<size_t>(pool->num_blocks()), nullptr);
  pool->AddObserver(impl_.get());
  impl_->options = std::move(options);
  impl_->clock = impl_->options.clock != nullptr ? impl_->options.clock : SteadyClock();
  if (impl_->options.policy == nullptr) impl_->options.policy = MakeLruPolicy();
  // The identity's length goes first so (identity, salt) splits one way only:
  // ("ab", "c") and ("a", "bc") must not share a namespace.
  const uint64_t len = impl_->options.model_identity.size();
  impl_->root_key_prefix.assign(reinterpret_cast<const char*>(&len), sizeof(len));
  impl_->root_key_prefix.append(impl_->options.model_identity);
}

PrefixCache::~PrefixCache() {
  impl_->pool->RemoveObserver(impl_.get());
  impl_->DropAll();
}

PrefixMatch PrefixCache::Match(std::string_view salt, absl::Span<const int32_t> tokens,
                               int32_t max_tokens) {
  Impl& m = *impl_;
  PrefixMatch match;
  const int64_t now = m.clock->NowNanos();
  int32_t dropped = 0;
  std::vector<bool> lossy;
  match.num_tokens = m.WindowWalk(salt, tokens, max_tokens, [&](Node* n) {
    const BlockHandle b = m.Held(n);
    m.pool->AddRef(b);
    match.blocks.push_back(b);
    lossy.push_back(n->lossy);
    m.Touch(n, now);
    ++n->hits;
  }, nullptr, &dropped);
  const int32_t lossy_bs = m.pool->block_size();
  for (size_t i = 0; i < lossy.size(); ++i) {
    const int32_t start = static_cast<int32_t>(i) * lossy_bs;
    if (lossy[i] && start < match.num_tokens) {
      match.lossy_tokens += std::min(lossy_bs, match.num_tokens - start);
    }
  }
  ++m.stats.queries;
  m.stats.query_tokens += std::max(0, std::min(static_cast<int32_t>(tokens.size()), max_tokens));
  m.stats.hit_tokens += match.num_tokens;
  m.stats.window_dropped_tokens += dropped;
  return match;
}

PrefixMatch PrefixCache::Pin(std::string_view salt, absl::Span<const int32_t> tokens,
                             int32_t max_tokens, std::vector<uint64_t>* hashes) {
  Impl& m = *impl_;
  PrefixMatch match;
  const int32_t bs = m.pool->block_size();
  std::vector<Node*> visited;
  const int32_t covered =
      m.WindowWalk(salt, tokens, max_tokens, [&](Node* n) { visited.push_back(n); });
  // Full blocks only: a partly shared candidate comes last, past covered / bs.
  const size_t full = std::min(visited.size(), static_cast<size_t>(covered / bs));
  for (size_t i = 0; i < full; ++i) {
    const BlockHandle b = m.Held(visited[i]);
    m.pool->AddRef(b);
    match.blocks.push_back(b);
    if (hashes != nullptr) hashes->push_back(visited[i]->hash);
  }
  match.num_tokens = static_cast<int32_t>(full) * bs;
  return match;
}

int32_t PrefixCache::MatchLength(std::string_view salt, absl::Span<const int32_t> tokens,
                                 int32_t max_tokens) const {
  return impl_->WindowWalk(salt, tokens, max_tokens, [](const Node*) {});
}

int32_t PrefixCache::PathLength(std::string_view salt, absl::Span<const int32_t> tokens,
                                int32_t max_tokens) const {
  return impl_->Walk(salt, tokens, max_tokens, [](const Node*) {});
}

void PrefixCache::SetWindow(int32_t window, BlockHandle stand_in) {
  impl_->window = window;
  impl_->stand_in = stand_in;
}

bool PrefixCache::HollowBlock(BlockHandle block) {
  Impl& m = *impl_;
  if (m.window <= 0 || block.id < 0 || static_cast<size_t>(block.id) >= m.by_block.size()) {
    return false;
  }
  Node* n = m.by_block[block.id];
  if (n == nullptr || !(n->block == block) || n->next_same != nullptr) return false;
  if (n->keep_window || n->is_public) return false;
  // Unpinned first (as if its block went sole), then hollow: from here on
  // it blocks nothing of its own and frees no block.
  m.SetPinned(n, false);
  m.UnregisterBlock(n);  // before Release: its callback must not find n
  n->hollow = true;
  ++m.num_hollow;
  if (!Impl::Blocked(n)) ++m.num_hollow_free;
  const BlockHandle b = n->block;
  n->block = BlockHandle{};
  m.pool->Release(b);
  ++m.stats.hollowed_blocks;
  if (m.options.publish_hollow && m.options.events != nullptr) {
    std::vector<KvCacheEvent> events(1);
    events[0].kind = KvCacheEvent::Kind::kBlockRemoved;
    events[0].block_hash = n->hash;
    m.Publish(std::move(events));
  }
  return true;
}

int32_t PrefixCache::KeepWindow(std::string_view salt, absl::Span<const int32_t> tokens,
                               int32_t first_block) {
  Impl& m = *impl_;
  int32_t marked = 0;
  int32_t i = 0;
  m.Walk(salt, tokens, static_cast<int32_t>(tokens.size()), [&](Node* n) {
    if (i++ >= first_block && !n->keep_window) {
      n->keep_window = true;
      ++marked;
    }
  });
  return marked;
}

int32_t PrefixCache::num_hollow_blocks() const { return impl_->num_hollow; }

int32_t PrefixCache::Insert(std::string_view salt, absl::Span<const int32_t> tokens,
                            absl::Span<const BlockHandle> blocks, bool lossy) {
  return impl_->InsertPath(salt, tokens, blocks, /*with_tail=*/false, lossy);
}

int32_t PrefixCache::InsertFinished(std::string_view salt, absl::Span<const int32_t> tokens,
                                    absl::Span<const BlockHandle> blocks, bool lossy) {
  return impl_->InsertPath(salt, tokens, blocks, /*with_tail=*/true, lossy);
}

int32_t PrefixCache::Evict(int32_t n) {
  Impl& m = *impl_;
  if (n <= 0 || m.nodes.empty()) return 0;
  // Min-heap over (policy key, insertion order). Keys are computed once per
  // call: nothing a policy reads changes while we evict.
  using Entry = std::tuple<double, uint64_t, Node*>;
  auto later = [](const Entry& a, const Entry& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) > std::tie(std::get<0>(b), std::get<1>(b));
  };
  std::vector<Entry> heap;
  for (Node* node = m.oldest; node != nullptr; node = node->next) {
    if (!m.Evictable(node)) continue;
    // A hollow leaf first: it can end no match (and frees no block).
    heap.emplace_back(node->hollow ? -std::numeric_limits<double>::infinity()
                                   : m.options.policy->Key(m.Info(node)),
                      node->seq, node);
  }
  std::make_heap(heap.begin(), heap.end(), later);
  std::vector<KvCacheEvent> events;
  int32_t evicted = 0;
  // A hollow leaf (its K/V gone, nothing below it) can end no match: it
  // goes as soon as it is a candidate, past n too, and frees no block.
  while (!heap.empty() && (evicted < n || std::get<2>(heap.front())->hollow)) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Node* victim = std::get<2>(heap.back());
    const double victim_key = std::get<0>(heap.back());
    heap.pop_back();
    if (!victim->hollow) m.options.policy->OnEvicted(victim_key);
    Node* parent = victim->parent;
    KvTier moved_to = KvTier::kNone;
    // Write-back: a full block's K/V goes to the tier below before its pool
    // block is released (the sink copies it now; the block is still live).
    const bool hollow = victim->hollow;
    if (m.options.demotion != nullptr && !hollow &&
        static_cast<int32_t>(victim->tokens.size()) == m.pool->block_size()) {
      EvictedBlock b;
      b.hash = victim->hash;
      b.depth = victim->depth;
      b.hits = victim->hits;
      b.lossy = victim->lossy;
      b.data = m.pool->BlockData(victim->block);
      b.bytes = m.pool->block_bytes();
      b.on_device = m.pool->on_device();
      moved_to = m.options.demotion->Demote(b);
      if (moved_to != KvTier::kNone) ++m.stats.demoted_blocks;
    }
    if (m.options.on_evict) m.options.on_evict(victim->hash, moved_to);
    // A hollow node was published as removed when it went hollow (or never
    // as stored) under publish_hollow.
    if (m.options.events != nullptr && !(hollow && m.options.publish_hollow)) {
      KvCacheEvent e;
      e.kind = KvCacheEvent::Kind::kBlockRemoved;
      e.block_hash = victim->hash;
      e.moved_to = moved_to;
      events.push_back(std::move(e));
    }
    const bool parent_is_root = parent->parent == nullptr;
    m.RemoveLeaf(victim);  // may destroy parent when it is an emptied root
    if (!hollow) ++evicted;  // a hollow leaf frees no block
    // The parent may just have become a leaf: a candidate in this same call.
    if (!parent_is_root && m.Evictable(parent)) {
      const double key = parent->hollow ? -std::numeric_limits<double>::infinity()
                                        : m.options.policy->Key(m.Info(parent));
      heap.emplace_back(key, parent->seq, parent);
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  m.stats.evicted_blocks += evicted;
  m.Publish(std::move(events));
  return evicted;
}

int32_t PrefixCache::Clear() {
  const int32_t dropped = impl_->DropAll();
  if (impl_->options.events != nullptr) {
    std::vector<KvCacheEvent> events(1);
    events[0].kind = KvCacheEvent::Kind::kAllCleared;
    impl_->options.events->Publish(std::move(events));
  }
  return dropped;
}

int32_t PrefixCache::num_cached_blocks() const {
  return static_cast<int32_t>(impl_->nodes.size()) - impl_->num_hollow;  // hollow: no block
}

int32_t PrefixCache::num_evictable_blocks() const {
  return static_cast<int32_t>(impl_->nodes.size()) - impl_->num_blocked - impl_->num_hollow_free;
}

int32_t PrefixCache::CountEvictableBlocksSlow() const {
  // A node is freeable by repeated eviction when neither it nor anything
  // below it has an outside reference. Children come after their parents in
  // insertion order, so one reverse pass settles each node before its parent.
  const Impl& m = *impl_;
  for (Node* n = m.oldest; n != nullptr; n = n->next) n->scratch_blocked = false;
  int32_t count = 0;
  for (Node* n = m.newest; n != nullptr; n = n->prev) {
    if (!n->hollow && m.pool->ref_count(n->block) != 1) n->scratch_blocked = true;
    if (n->scratch_blocked) {
      n->parent->scratch_blocked = true;  // roots are never read, so marking them is harmless
    } else if (!n->hollow) {
      ++count;
    }
  }
  return count;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = impl_->stats;
  s.cached_blocks = num_cached_blocks();
  return s;
}

const EvictionPolicy& PrefixCache::policy() const { return *impl_->options.policy; }

void PrefixCache::ForEachFullBlock(const std::function<void(const EvictedBlock&)>& fn) const {
  const Impl& m = *impl_;
  for (const Node* n = m.oldest; n != nullptr; n = n->next) {
    if (static_cast<int32_t>(n->tokens.size()) != m.pool->block_size() || n->hollow) continue;
    EvictedBlock b;
    b.hash = n->hash;
    b.depth = n->depth;
    b.hits = n->hits;
    b.lossy = n->lossy;
    b.data = m.pool->BlockData(n->block);
    b.bytes = m.pool->block_bytes();
    b.on_device = m.pool->on_device();
    fn(b);
  }
}

std::vector<KvCacheEvent> PrefixCache::Dump() const {
  std::vector<KvCacheEvent> out;
  out.reserve(impl_->nodes.size());
  for (const Node* n = impl_->oldest; n != nullptr; n = n->next) {
    KvCacheEvent e;
    e.kind = KvCacheEvent::Kind::kBlockStored;
    e.block_hash = n->hash;
    e.parent_hash = n->parent->parent == nullptr ? 0 : n->parent->hash;
    e.token_ids = n->tokens;
    out.push_back(std::move(e));
  }
  return out;
}

uint64_t PrefixCache::RootHash(std::string_view salt) const { return impl_->RootHash(salt); }

PrefixProbe PrefixCache::Probe(std::string_view salt, absl::Span<const int32_t> tokens) const {
  const Impl& m = *impl_;
  PrefixProbe p;
  Impl::WalkEnd end;
  const int32_t n = static_cast<int32_t>(tokens.size());
  int32_t public_tokens = 0;
  const Node* last = nullptr;
  p.matched_tokens = m.WindowWalk(salt, tokens, n, [&](const Node* node) {
    if (node->is_public) public_tokens += static_cast<int32_t>(node->tokens.size());
    last = node;
  }, &end, &p.window_dropped_tokens);
  p.public_tokens = public_tokens;
  const int32_t bs = m.pool->block_size();
  if (p.window_dropped_tokens > 0) {
    // Cut back to a block boundary: the rest is reported as window-dropped,
    // and what lies past it is looked up (tiers, history) from there.
    end.partial = nullptr;
    end.partial_shared = 0;
    if (last != nullptr) {
      end.node = last;
      end.full_pos = p.matched_tokens - end.offset;
    } else {
      end.node = nullptr;
      end.full_pos = 0;
      end.offset = 0;
      end.ns = std::string(salt);
    }
  }
  const int32_t full_end = end.offset + end.full_pos;  // absolute
  if (p.window_dropped_tokens == 0 && end.node != nullptr && full_end < n &&
      !end.node->children.empty() && !end.public_cut) {
    // Something cached continues here; the prompt went elsewhere unless the
    // best partial candidate is a finished tail it covers whole.
    const Node* best = end.partial;
    const int32_t shared = end.partial_shared;
    const bool tail_covered =
        best != nullptr && shared == static_cast<int32_t>(best->tokens.size());
    if (!tail_covered) {
      p.diverged = true;
      if (best == nullptr) {
        for (const Node* c : end.node->children) {
          if (best == nullptr || c->seq < best->seq) best = c;
        }
      }
      for (int32_t i = shared; i < static_cast<int32_t>(best->tokens.size()) && i < shared + 8; ++i) {
        p.cached_next.push_back(best->tokens[i]);
      }
    }
  }
  // Hashes of the full blocks past the match, as a lower tier knows them.
  p.next_block_start = full_end;
  std::vector<uint64_t> chain;
  m.ChainHashes(salt, tokens, std::min(n / bs, full_end / bs + 4096), &chain);
  for (size_t i = static_cast<size_t>(full_end / bs); i < chain.size(); ++i) {
    p.next_block_hashes.push_back(chain[i]);
  }
  return p;
}

std::vector<std::string> PrefixCache::Salts() const {
  std::vector<std::string> out;
  for (const auto& [salt, root] : impl_->roots) out.push_back(salt);
  return out;
}

int32_t PrefixCache::MarkPublic(absl::Span<const int32_t> tokens) {
  Impl& m = *impl_;
  const Node* node = m.FindRoot(m.options.public_salt);
  if (node == nullptr) return 0;
  const int32_t bs = m.pool->block_size();
  int32_t marked = 0;
  for (size_t pos = 0; pos + bs <= tokens.size(); pos += bs) {
    const absl::Span<const int32_t> block = tokens.subspan(pos, bs);
    Node* child = m.FindChild(node, block, ChainHash(node->hash, block));
    if (child == nullptr) break;
    if (!child->is_public) {
      child->is_public = true;
      ++m.num_public;
    }
    m.public_hashes.insert(child->hash);
    ++marked;
    node = child;
  }
  return marked;
}

int32_t PrefixCache::UnmarkPublic(absl::Span<const int32_t> tokens) {
  Impl& m = *impl_;
  // By the marks, so blocks that left the pool are unmarked too.
  const Node* node = m.FindRoot(m.options.public_salt);
  uint64_t h = m.RootHash(m.options.public_salt);
  const int32_t bs = m.pool->block_size();
  int32_t unmarked = 0;
  for (size_t pos = 0; pos + bs <= tokens.size(); pos += bs) {
    const absl::Span<const int32_t> block = tokens.subspan(pos, bs);
    h = ChainHash(h, block);
    Node* child = node != nullptr ? m.FindChild(node, block, h) : nullptr;
    const bool marked = m.public_hashes.erase(h) > 0;
    if (child != nullptr && child->is_public) {
      child->is_public = false;
      --m.num_public;
    }
    if (!marked && child == nullptr) break;
    if (marked) ++unmarked;
    node = child;
  }
  return unmarked;
}

void PrefixCache::ChainHashes(std::string_view salt, absl::Span<const int32_t> tokens,
                              int32_t n_blocks, std::vector<uint64_t>* out) const {
  impl_->ChainHashes(salt, tokens, n_blocks, out);
}

int32_t PrefixCache::num_public_blocks() const { return impl_->num_public; }

const std::string& PrefixCache::public_salt() const { return impl_->options.public_salt; }

}  // namespace kvserve
