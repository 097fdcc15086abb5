#!/usr/bin/env python3
"""kvserve's KV events in vLLM's wire format, read the way a vLLM consumer reads them.

The subscriber below is written from vLLM's published schema (the msgspec structs
of vllm/distributed/kv_events.py, restated here; nothing of kvserve's is imported)
and drives a real `kvserve serve` on 127.0.0.1:
  - every message is (topic, 8-byte big-endian seq, msgpack payload), seqs 0, 1, ...;
  - every payload decodes as KVEventBatch and re-encodes to the same bytes
    (so the encoding is msgspec's, byte for byte);
  - every stored block arrives once and every removal names a stored block, in
    order; the stored chains' token ids reproduce each scripted prompt's full
    blocks; the rebuilt index's size equals the prefix cache's own count;
  - a subscriber that joins late (after events it missed) recovers them through
    the replay socket, and the replay from 0 equals the live stream byte for byte;
  - a salted request's chain names its salt in the first block's extra_keys;
  - with a tcp://host:port endpoint the PUB connects to a consumer that binds
    (llm-d's layout) and the consumer gets the blocks;
  - group_idx and the kv_cache_spec fields are absent on a one-group model and,
    on a hybrid-attention model (Gemma 3 270M in KVSERVE_MODEL_DIR, when
    present), name each event's KV cache group: 0, "full_attention", no window
    for the full group, 1..5, "sliding_window", 512 for the window groups,
    which publish the same chains under the same hashes (kept apart by
    group_idx, each group's stream consistent on its own);
  - a tier round trip (tier_round_trip): a prompt's blocks leave "GPU" for
    "CPU" (and "Disk" when the host tier spills) and come back to "GPU", on
    the one-group model and on Gemma 3's KV cache groups.

usage: vllm_kv_events_test.py KVSERVE_BINARY MODEL.gguf
Exit 77 (skip) without msgspec/pyzmq or the model.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    import msgspec
    import zmq
except ImportError as e:  # the test venv has them (deploy/test.sh)
    print(f"SKIP: {e}; set KVSERVE_PYTHON to the test venv's python")
    sys.exit(77)


# --- vLLM's schema (vllm/distributed/kv_events.py), restated -------------------
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()
BLOCK = 16


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    fail(f"{name} not in /metrics")


MEDIA = ("GPU", "CPU", "Disk")  # the KV pool, the host tier, the disk tier


class Index:
    """A consumer's view of the node: block hash -> (parent, tokens), per medium.

    `blocks` is the GPU medium (the prefix cache); `tiers` holds the CPU and
    Disk media (blocks demoted to the host and disk tiers). A tier's block may
    outlive its parent (the parent may have left every tier), so only the GPU
    medium's parents are checked.
    """

    def __init__(self):
        self.blocks = {}
        self.tiers = {"CPU": {}, "Disk": {}}
        # Other KV cache groups' GPU blocks (group_idx > 0), by group: the same
        # hashes as group 0's. A window group's block may outlive its parent's
        # K/V (hollowed, published as removed), so parents are not checked.
        self.groups = {}
        self.group_log = []  # (kind, group, hash)
        self.stored = 0
        self.removed = 0
        self.log = []  # (kind, medium, hash) in stream order

    def media(self, medium):
        if medium not in MEDIA:
            fail(f"medium {medium!r}")
        return self.blocks if medium == "GPU" else self.tiers[medium]

    def apply(self, batch):
        for e in batch.events:
            group = getattr(e, "group_idx", None) or 0
            if group > 0 and not isinstance(e, AllBlocksCleared):
                if e.medium != "GPU":
                    fail(f"group {group} event in medium {e.medium}")
                blocks = self.groups.setdefault(group, {})
                for h in e.block_hashes:
                    if isinstance(e, BlockStored):
                        if h in blocks:
                            fail(f"block {h} stored twice in group {group} while there")
                        blocks[h] = True
                        self.group_log.append(("stored", group, h))
                    else:
                        if h not in blocks:
                            fail(f"BlockRemoved of block {h} that group {group} does not hold")
                        del blocks[h]
                        self.group_log.append(("removed", group, h))
                continue
            if isinstance(e, BlockStored):
                if e.block_size != BLOCK or len(e.token_ids) != BLOCK * len(e.block_hashes):
                    fail(f"BlockStored sizes: {len(e.token_ids)} tokens, {len(e.block_hashes)} blocks")
                blocks = self.media(e.medium)
                parent = e.parent_block_hash
                if e.medium == "GPU" and parent is not None and parent not in blocks:
                    fail(f"BlockStored under an unknown parent {parent}")
                for i, h in enumerate(e.block_hashes):
                    if h in blocks:
                        fail(f"block {h} stored twice in {e.medium} while there")
                    blocks[h] = (parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK])
                    parent = h
                    self.stored += 1
                    self.log.append(("stored", e.medium, h))
            elif isinstance(e, BlockRemoved):
                blocks = self.media(e.medium)
                for h in e.block_hashes:
                    if h not in blocks:
                        fail(f"BlockRemoved of block {h} that is not stored in {e.medium}")
                    del blocks[h]
                    self.removed += 1
                    self.log.append(("removed", e.medium, h))
            else:
                self.blocks.clear()  # the prefix cache emptied; the tiers keep their pages
                self.groups.clear()  # every group's

    def prefixes(self):
        """Every cached path's tokens from its root."""
        out = []
        for h in self.blocks:
            toks, cur = [], h
            while cur is not None:
                parent, t = self.blocks[cur]
                toks[:0] = t
                cur = parent
            out.append(toks)
        return out


def receive(sub, expect_seq, batches, quiet_s=1.5, known=None):
    """Reads until quiet_s passes without a message; checks frames and seqs.

    known: {seq: payload} already recovered through replay; a reconnecting
    PUB may still deliver those (ZeroMQ queues while disconnected), and a
    consumer drops them by sequence number (they must be the same bytes).
    """
    while sub.poll(int(quiet_s * 1000)):
        topic, seq_b, payload = sub.recv_multipart()
        if topic != b"kv":
            fail(f"topic {topic!r}")
        if len(seq_b) != 8:
            fail(f"sequence frame of {len(seq_b)} bytes")
        seq = int.from_bytes(seq_b, "big")
        if known is not None and seq < expect_seq:
            if known.get(seq) != payload:
                fail(f"live batch {seq} differs from its replay")
            continue
        if seq != expect_seq:
            fail(f"sequence {seq}, expected {expect_seq}")
        batch = DECODER.decode(payload)
        if ENCODER.encode(batch) != payload:
            fail(f"batch {seq} does not re-encode to the same bytes (not msgspec's encoding)")
        if batch.data_parallel_rank != 0:
            fail("data_parallel_rank")
        batches.append((seq, payload, batch))
        expect_seq += 1
    return expect_seq


def replay(ctx, endpoint, start):
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        if not dealer.poll(10000):
            fail("replay: no answer")
        frames = dealer.recv_multipart()
        if len(frames) != 3 or frames[0] != b"":
            fail(f"replay frames {frames!r}")
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == -1:
            break
        out.append((seq, frames[2]))
    dealer.close()
    return out


def start_daemon(binary, model, args, what, wait=lambda: time.sleep(0.05)):
    """Starts `kvserve serve` on 127.0.0.1 with `args`; returns (proc, http port).

    wait() runs while the port file is not there yet (a SUB that must poll
    passes its poll).
    """
    port_file = os.path.join(tempfile.mkdtemp(prefix="vllm-events-ports-"), "ports.json")
    proc = subprocess.Popen(
        [binary, "--log-level", "warn", "-t", "2", "-m", model, "serve", "--http-port", "0",
         "--grpc-address", "127.0.0.1:0", "--port-file", port_file, "--kv-events-topic", "kv",
         "--drain-timeout", "1"] + args)
    deadline = time.time() + 60
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            fail(f"{what}: daemon did not start")
        wait()
    return proc, json.load(open(port_file))["http"]


def stop_daemon(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def main():
    binary, model = sys.argv[1], sys.argv[2]
    if not os.path.exists(model):
        print(f"SKIP: no model at {model}")
        sys.exit(77)
    ctx = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="vllm-events-")
    # The daemon binds its PUB (vLLM's rule binds ipc:// and tcp://*:port;
    # tcp://host:port is connected to: connect_mode below).
    pub_ep = f"ipc://{tmp}/kv-events.sock"
    replay_ep = f"tcp://127.0.0.1:{replay_port}"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    # A small pool, so that later prompts evict earlier ones.
    proc, http = start_daemon(binary, model,
                              ["--kv-cache-memory", "160KiB", "--kv-events-endpoint", pub_ep,
                               "--kv-events-replay-endpoint", replay_ep], "bind mode")
    try:
        sub.connect(pub_ep)
        time.sleep(0.5)  # the subscription reaches the PUB

        rng_state = [12345]

        def rand_tokens(n):
            out = []
            for _ in range(n):
                rng_state[0] = (rng_state[0] * 1103515245 + 12345) % (1 << 31)
                out.append(3 + rng_state[0] % 400)
            return out

        # Phase 1: prompts with shared prefixes, then enough distinct ones to evict.
        shared = rand_tokens(48)
        prompts = [shared + rand_tokens(40), shared + rand_tokens(33)]
        prompts += [rand_tokens(70) for _ in range(6)]
        for p in prompts:
            post(http, "/v1/completions", {"prompt": p, "max_tokens": 1,
                                           "temperature": 0})
        # The last prompt again under a cache_salt: another namespace, so
        # its blocks are stored again under other hashes, the first one
        # naming the salt in its extra_keys (as vLLM's first block does).
        post(http, "/v1/completions", {"prompt": prompts[-1], "max_tokens": 1,
                                       "temperature": 0, "cache_salt": "salt-7"})
        batches = []
        seq = receive(sub, 0, batches)
        salted = [e for _, _, b in batches for e in b.events
                  if isinstance(e, BlockStored) and e.extra_keys is not None]
        if len(salted) != 1 or salted[0].parent_block_hash is not None:
            fail(f"expected one stored chain with extra_keys, a first block: {salted}")
        keys = salted[0].extra_keys
        if len(keys) != len(salted[0].block_hashes) or keys[0] != ("salt-7",) or \
                any(k is not None for k in keys[1:]):
            fail(f"extra_keys {keys}")
        full = prompts[-1][: len(prompts[-1]) // BLOCK * BLOCK]
        if salted[0].token_ids != full[: len(salted[0].token_ids)]:
            fail("the salted chain's tokens are not the prompt's")
        for _, _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored) and e.extra_keys is None and \
                        set(e.block_hashes) & set(salted[0].block_hashes):
                    fail("a salted block hash equals an unsalted one")
        if not batches:
            fail("no events")
        index = Index()
        for _, _, b in batches:
            index.apply(b)
        if index.removed == 0:
            fail("the workload evicted nothing (pool too large for the test)")
        # The last prompts are cached: their full blocks appear as stored paths.
        paths = index.prefixes()
        for p in prompts[-2:]:
            full = p[: len(p) // BLOCK * BLOCK]
            if not any(path[: len(full)] == full for path in paths):
                fail(f"no cached path reproduces the prompt's {len(full)} tokens")
        # Everything that was ever stored reproduces some prompt's blocks.
        for _, _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored) and e.parent_block_hash is None:
                    first = e.token_ids[:BLOCK]
                    if not any(p[:BLOCK] == first for p in prompts):
                        fail("a first block matches no prompt")
        cached = metric(get(http, "/metrics"), "kvserve:prefix_cache_cached_blocks")
        print(f"phase 1: {len(batches)} batches, {index.stored} stored, {index.removed} removed, "
              f"{len(index.blocks)} cached (node: {cached:.0f} incl. partial blocks)")

        # Phase 2: the subscriber leaves; events go on without it.
        sub.close(linger=0)
        for p in [rand_tokens(50) for _ in range(3)]:
            post(http, "/v1/completions", {"prompt": p, "max_tokens": 1,
                                           "temperature": 0})
        time.sleep(0.5)
        # A late subscriber: joins, then recovers what it missed through replay.
        late = ctx.socket(zmq.SUB)
        late.setsockopt(zmq.SUBSCRIBE, b"kv")
        late.connect(pub_ep)
        time.sleep(0.5)
        missed = replay(ctx, replay_ep, seq)
        if not missed or missed[0][0] != seq:
            fail(f"replay from {seq} gave {[s for s, _ in missed][:3]}")
        for s, payload in missed:
            if s != seq:
                fail(f"replay sequence {s}, expected {seq}")
            b = DECODER.decode(payload)
            index.apply(b)
            batches.append((s, payload, b))
            seq += 1
        # Phase 3: live again.
        for p in [shared + rand_tokens(20)]:
            post(http, "/v1/completions", {"prompt": p, "max_tokens": 1,
                                           "temperature": 0})
        live = []
        seq = receive(late, seq, live, known={s: p for s, p, _ in batches})
        if not live:
            fail("the late subscriber got no live events")
        for _, _, b in live:
            index.apply(b)
        batches += live
        # The whole history from replay equals what was received, byte for byte.
        all_replayed = replay(ctx, replay_ep, 0)
        if [(s, p) for s, p, _ in batches] != all_replayed:
            fail("replay from 0 differs from the stream")
        print(f"after replay and phase 3: {len(batches)} batches, {index.stored} stored, "
              f"{index.removed} removed, {len(index.blocks)} cached")
        late.close(linger=0)
    finally:
        stop_daemon(proc)
        ctx.term()
    connect_mode(binary, model)
    tier_round_trip(binary, model)
    tier_round_trip(binary, model, host="48KiB", spill=True)
    smol = os.path.join(os.environ.get("KVSERVE_MODEL_DIR", ""), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(smol):
        tier_round_trip(binary, smol, pool="4MiB", host="32MiB", expect_load=True)
    else:
        print(f"tier round trip with loads skipped: no {smol} (set KVSERVE_MODEL_DIR)")
    # A hybrid-attention model (KV cache groups): Gemma 3 270M when present.
    gemma = os.environ.get("KVSERVE_HYBRID_MODEL") or os.path.join(
        os.environ.get("KVSERVE_MODEL_DIR", ""), "gemma-3-270m-Q4_K_M.gguf")
    if os.path.exists(gemma):
        connect_mode(binary, gemma, hybrid=True)
        # Every KV cache group's blocks go to the tiers and come back; the
        # stream names the full group's (issue 41).
        tier_round_trip(binary, gemma, hybrid=True, pool="4MiB", host="16MiB", expect_load=True)
    else:
        print(f"hybrid part skipped: no {gemma} (set KVSERVE_MODEL_DIR or KVSERVE_HYBRID_MODEL)")
    print("PASS")


def connect_mode(binary, model, hybrid=False):
    """llm-d's layout: the consumer binds, kvserve's PUB connects to it.

    hybrid: the model has KV cache groups (Gemma 3): every event names its
    group (group_idx 0, kv_cache_spec_kind "full_attention", no window for the
    full group; 1..5, "sliding_window", 512 for the window groups), every group
    publishes, and a window group holds no block the full group does not;
    otherwise those fields are absent (None).

    ZeroMQ's SUB sends its subscription to a new peer when the SUB socket
    next runs (a poll or a receive), so the consumer polls while the daemon
    starts, as a real consumer's loop does; a PUB drops what it publishes
    before any subscription arrives.
    """
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    proc, http = start_daemon(binary, model, ["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"],
                              "connect mode", wait=lambda: sub.poll(50))
    try:
        end = time.time() + 0.5
        while time.time() < end:
            sub.poll(50)
        prompt = [5 + (i * 7) % 300 for i in range(3 * BLOCK + 5)]
        post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
        batches = []
        receive(sub, 0, batches)
        index = Index()
        for _, _, b in batches:
            index.apply(b)
        full = prompt[: len(prompt) // BLOCK * BLOCK]
        if not any(path[: len(full)] == full for path in index.prefixes()):
            fail(f"connect mode: {len(batches)} batches, no stored path reproduces the prompt")
        def want_for(g):
            if not hybrid:
                return (None, None, None)
            return (0, "full_attention", None) if g == 0 else (g, "sliding_window", 512)
        groups_seen = set()
        for _, _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored):
                    got = (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                elif isinstance(e, BlockRemoved):
                    got = (e.group_idx,) + want_for(e.group_idx or 0)[1:]
                else:
                    continue
                groups_seen.add(e.group_idx or 0)
                want = want_for(e.group_idx or 0)
                if got != want:
                    fail(f"{type(e).__name__} group fields {got}, want {want} (hybrid {hybrid})")
        if hybrid:
            if groups_seen != set(range(6)):
                fail(f"connect mode (hybrid): events of groups {sorted(groups_seen)}, want 0..5")
            for g in range(1, 6):
                if set(index.groups.get(g, {})) - set(index.blocks):
                    fail(f"group {g} holds blocks group 0 does not")
        want = want_for(0)
        print(f"connect mode{' (hybrid, KV cache groups)' if hybrid else ''}: {len(batches)} "
              f"batches, {index.stored} blocks stored through a PUB that connected to the "
              f"consumer; group fields {want}"
              + (f"; window groups hold {[len(index.groups.get(g, {})) for g in range(1, 6)]} "
                 f"blocks" if hybrid else ""))
    finally:
        stop_daemon(proc)
        sub.close(linger=0)
        ctx.term()


def tier_round_trip(binary, model, hybrid=False, pool="160KiB", host="1MiB", spill=False,
                    expect_load=False):
    """A demote -> promote round trip through the host and disk tiers.

    A prompt's blocks are evicted from the KV pool by other prompts: each full
    block is published as removed from "GPU" and stored in "CPU" (the host
    tier) with the same hash, parent and tokens. The prompt sent again loads
    its blocks from the host tier (cached tokens reported) and its blocks are
    stored in "GPU" again under the same hashes. spill: the host tier is
    small, so pages spill on to "Disk" (stored there, removed from "CPU");
    the prompt's blocks come back to "GPU" then too (loaded, or recomputed
    where the load-vs-recompute estimate says a tiny model's recompute is
    cheaper). The stream stays consistent per medium throughout (no double
    store, no removal of a block the medium does not hold). expect_load: a
    model whose recompute costs more than a load (not stories260K, whose
    prefill is as cheap as a host copy, so the engine's cost model may
    recompute): the returning prompt must report its blocks as cached.
    """
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="vllm-events-tiers-")
    pub_ep = f"ipc://{tmp}/kv-events.sock"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    proc, http = start_daemon(binary, model,
                              ["--kv-cache-memory", pool, "--kv-host-memory", host,
                               "--kv-disk-dir", os.path.join(tmp, "disk"), "--kv-disk-bytes",
                               "64MiB", "--kv-disk-min-hits", "0", "--kv-events-endpoint",
                               pub_ep], "tier round trip")
    what = "tier round trip" + (" (hybrid)" if hybrid else "") + (" with spills" if spill else "")
    try:
        sub.connect(pub_ep)
        time.sleep(0.5)
        target = [7 + (i * 13) % 350 for i in range(4 * BLOCK + 3)]
        post(http, "/v1/completions", {"prompt": target, "max_tokens": 1, "temperature": 0})
        for k in range(10):
            other = [9 + (i * (17 + k) + k * 31) % 380 for i in range(4 * BLOCK + 1)]
            post(http, "/v1/completions", {"prompt": other, "max_tokens": 1, "temperature": 0})
        again = post(http, "/v1/completions",
                     {"prompt": target, "max_tokens": 1, "temperature": 0})
        cached = (again.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        batches = []
        receive(sub, 0, batches)
        index = Index()
        for _, _, b in batches:
            index.apply(b)
        # The target's full blocks, by hash: the first GPU chain whose tokens are its own.
        full = target[: len(target) // BLOCK * BLOCK]
        chain = []
        for _, _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored) and e.medium == "GPU" and \
                        e.parent_block_hash is None and e.token_ids == full[: len(e.token_ids)]:
                    chain = list(e.block_hashes)
                    break
            if chain:
                break
        if len(chain) != len(full) // BLOCK:
            fail(f"{what}: the target's chain has {len(chain)} blocks, want {len(full) // BLOCK}")
        seen = {("removed", m): 0 for m in MEDIA}
        seen.update({("stored", m): 0 for m in MEDIA})
        for h in chain:
            moves = [(k, m) for k, m, x in index.log if x == h]
            # GPU stored, GPU removed, then in a tier, then GPU stored again.
            if moves[:1] != [("stored", "GPU")] or ("removed", "GPU") not in moves:
                fail(f"{what}: block {h} moves {moves}")
            out = moves.index(("removed", "GPU"))
            tiers_after = [m for k, m in moves[out - 1:] if k == "stored" and m != "GPU"]
            if not tiers_after:
                fail(f"{what}: block {h} left the GPU but was stored in no tier: {moves}")
            if ("stored", "GPU") not in moves[out + 1:]:
                fail(f"{what}: block {h} was not stored in the GPU again (promotion): {moves}")
            for k, m in moves:
                seen[(k, m)] += 1
        # A tier's description of a block is the block's own: same tokens.
        for medium, pages in index.tiers.items():
            for h, (_, toks) in pages.items():
                if h in chain and toks != full[chain.index(h) * BLOCK:(chain.index(h) + 1) * BLOCK]:
                    fail(f"{what}: {medium} page {h} carries other tokens")
        if expect_load and cached < len(chain) * BLOCK:
            fail(f"{what}: the repeated prompt reported {cached} cached tokens")
        if index.removed == 0 or not any(m == "CPU" for _, m, _ in index.log):
            fail(f"{what}: no block reached the host tier")
        if spill and not any(m == "Disk" for _, m, _ in index.log):
            fail(f"{what}: no block reached the disk tier")
        print(f"{what}: {len(batches)} batches; the target's {len(chain)} blocks: "
              f"{dict((f'{k} {m}', n) for (k, m), n in seen.items() if n)}; "
              f"{cached} tokens cached on its return; stream-wide "
              f"{sum(1 for k, m, _ in index.log if m == 'CPU' and k == 'stored')} stored in CPU, "
              f"{sum(1 for k, m, _ in index.log if m == 'Disk' and k == 'stored')} in Disk")
    finally:
        stop_daemon(proc)
        sub.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
