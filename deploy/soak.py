#!/usr/bin/env python3
"""Soak and abuse test for an OpenAI-compatible HTTP server (stdlib only).

Sends --requests requests from --concurrency client threads, a mix of:
  streaming and non-streaming /v1/completions and /v1/chat/completions,
  n > 1 samples, ~20% client cancels at a random point of a stream,
  ~5% malformed bodies (expect 400), ~1% oversized bodies (expect 413),
  ~1% /admin/clear_prefix_cache calls (kvserve; 200 or 409),
while --slowloris connections trickle header bytes. Then it checks:
  every well-formed request was answered correctly (greedy requests repeat
  the first answer seen for the same prompt; every stream ends in [DONE]),
  no connection error on well-formed requests, the server is healthy,
  (kvserve) the KV pool's free blocks are back at the baseline once idle,
  (--pid) the daemon's thread count and RSS stayed within bounds.

  python3 deploy/soak.py --base-url http://127.0.0.1:8000 --model stories260K \
      --requests 10000 --concurrency 64 --pid $(pgrep -n kvserve)

Exits 0 when every check passes; prints a JSON summary. Figures: docs/http.md.
"""
import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park",
    "One day, a girl named Sue",
    "The sun was shining and",
    "Tom had a big red ball",
]


class Stats:
    def __init__(self):
        self.mu = threading.Lock()
        self.counts = {}
        self.failures = []
        self.golden = {}  # (kind, prompt, max_tokens) -> text

    def count(self, key):
        with self.mu:
            self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, what):
        with self.mu:
            self.failures.append(what)
            self.counts["failed"] = self.counts.get("failed", 0) + 1

    def check_golden(self, key, text):
        with self.mu:
            prev = self.golden.setdefault(key, text)
        if prev != text:
            self.fail(f"wrong output for {key}: {text!r} != {prev!r}")
            return False
        return True


class Client:
    def __init__(self, args):
        u = urllib.parse.urlparse(args.base_url)
        self.host = u.hostname
        self.port = u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"

    def conn(self, timeout=300):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, raw=None):
        c = self.conn()
        try:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            c.request(method, path, body=data, headers=self.headers)
            r = c.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            c.close()


def metric(client, name, label=""):
    try:
        status, text = client.request("GET", "/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return int(out["Threads"]), int(out["VmRSS"].split()[0]) / 1024.0


def sse_texts(body, chat):
    """Concatenated text per choice, whether [DONE] ended it, any error."""
    texts, done, error = {}, False, None
    for line in body.split("\n"):
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        j = json.loads(data)
        if "error" in j:
            error = j["error"]
        for ch in j.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts, done, error


def completion_body(rng, args, chat, stream, n):
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.choice([8, 16, 24])
    b = {"model": args.model, "max_tokens": max_tokens, "temperature": 0, "n": n, "stream": stream}
    if chat:
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b, ("chat" if chat else "text", prompt, max_tokens)


def one_request(rng, args, client, stats):
    roll = rng.random()
    if roll < 0.05:
        bad = rng.choice(['{"prompt": "hi", ', '[1, 2]', '{"prompt": 7}', '{"max_tokens": "x"}',
                          '\x00\xff', '{"prompt": "x", "temperature": "hot"}'])
        status, body = client.request("POST", "/v1/completions", raw=bad)
        if status != 400 or '"error"' not in body:
            stats.fail(f"malformed body got {status}: {body[:200]}")
        stats.count("malformed")
        return
    if roll < 0.06:
        status, body = client.request("POST", "/v1/completions",
                                      raw=json.dumps({"prompt": "a" * args.oversize}))
        if status != 413:
            stats.fail(f"oversized body got {status}")
        stats.count("oversized")
        return
    if roll < 0.07:
        status, _ = client.request("POST", "/admin/clear_prefix_cache")
        if status not in (200, 404, 409):
            stats.fail(f"clear cache got {status}")
        stats.count("clear_cache")
        return
    chat = rng.random() < args.chat_fraction
    n = 2 if rng.random() < 0.15 else 1
    cancel = roll < 0.27
    stream = cancel or rng.random() < 0.5
    body, key = completion_body(rng, args, chat, stream, n)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if cancel:
        # Hang up after a random number of bytes of the stream. "Connection:
        # close" makes a stream shorter than `want` end in EOF; without it the
        # kept-alive connection stays open and recv waits for the idle timeout.
        s = socket.create_connection((client.host, client.port), timeout=60)
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Connection: close\r\nContent-Length: {len(data)}\r\n")
        if args.api_key:
            head += f"Authorization: Bearer {args.api_key}\r\n"
        s.sendall(head.encode() + b"\r\n" + data)
        want = rng.randint(0, 2000)
        got = 0
        try:
            while got < want:
                chunk = s.recv(min(4096, want - got) or 1)
                if not chunk:
                    break
                got += len(chunk)
        finally:
            s.close()
        stats.count("cancelled")
        return
    status, text = client.request("POST", path, body)
    if status != 200:
        stats.fail(f"{path} got {status}: {text[:200]}")
        return
    if stream:
        texts, done, error = sse_texts(text, chat)
        if not done or error is not None or len(texts) != n:
            stats.fail(f"bad stream ({done}, {error}): {text[:300]}")
            return
        outs = [texts[i] for i in range(n)]
    else:
        j = json.loads(text)
        outs = [(c["message"]["content"] if chat else c["text"]) for c in j["choices"]]
        if len(outs) != n:
            stats.fail(f"{len(outs)} choices for n={n}")
            return
    for o in outs:
        if not stats.check_golden(key, o):
            return
    stats.count("stream" if stream else "plain")
    if n > 1:
        stats.count("n>1")


def slowloris(client, stop, stats, count):
    """Connections that trickle header bytes; the server should close them."""
    socks = []
    while not stop.is_set():
        while len(socks) < count:
            try:
                s = socket.create_connection((client.host, client.port), timeout=5)
                s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
                socks.append(s)
            except OSError:
                break
        alive = []
        for s in socks:
            try:
                s.sendall(b"a")
                alive.append(s)
            except OSError:
                stats.count("slowloris_closed_by_server")
                s.close()
        socks = alive
        stop.wait(1.0)
    for s in socks:
        s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--chat-fraction", type=float, default=0.4,
                    help="share of chat requests (0 for a model without a chat template)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--slowloris", type=int, default=16, help="trickling connections")
    ap.add_argument("--oversize", type=int, default=2 << 20, help="bytes of an oversized body")
    ap.add_argument("--pid", type=int, default=0, help="the daemon's pid (threads/RSS checks)")
    ap.add_argument("--max-thread-growth", type=int, default=8)
    ap.add_argument("--max-rss-growth-mib", type=float, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--idle-wait", type=float, default=60, help="seconds to wait for idle")
    args = ap.parse_args()

    client = Client(args)
    stats = Stats()
    kvserve = metric(client, "kvserve:kv_blocks_free") is not None
    if kvserve:
        client.request("POST", "/admin/clear_prefix_cache")
        time.sleep(0.5)
    free_before = metric(client, "kvserve:kv_blocks_free") if kvserve else None
    threads0, rss0 = proc_status(args.pid) if args.pid else (0, 0)
    peak = {"threads": threads0, "rss": rss0}

    stop = threading.Event()
    loris = threading.Thread(target=slowloris, args=(client, stop, stats, args.slowloris))
    loris.start()

    def sampler():
        while not stop.is_set():
            if args.pid:
                t, r = proc_status(args.pid)
                peak["threads"] = max(peak["threads"], t)
                peak["rss"] = max(peak["rss"], r)
            stop.wait(0.5)

    samp = threading.Thread(target=sampler)
    samp.start()

    next_id = [0]
    id_mu = threading.Lock()

    def worker(wid):
        rng = random.Random(args.seed * 1000 + wid)
        while True:
            with id_mu:
                if next_id[0] >= args.requests:
                    return
                next_id[0] += 1
            try:
                one_request(rng, args, client, stats)
            except (OSError, http.client.HTTPException, ValueError) as e:
                stats.fail(f"transport error: {type(e).__name__}: {e}")

    t0 = time.time()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.time() - t0
    stop.set()
    loris.join()
    samp.join()

    checks = {}
    status, body = client.request("GET", "/health")
    checks["healthy"] = status == 200
    if kvserve:
        deadline = time.time() + args.idle_wait
        free_after = None
        while time.time() < deadline:
            running = metric(client, "kvserve:num_requests_running")
            waiting = metric(client, "kvserve:num_requests_waiting")
            if running == 0 and waiting == 0:
                client.request("POST", "/admin/clear_prefix_cache")
                time.sleep(0.3)
                free_after = metric(client, "kvserve:kv_blocks_free")
                if free_after == free_before:
                    break
            time.sleep(0.2)
        checks["free_blocks_at_baseline"] = free_after == free_before
    if args.pid:
        time.sleep(1)
        t_end, r_end = proc_status(args.pid)
        checks["threads_bounded"] = peak["threads"] <= threads0 + args.max_thread_growth
        checks["rss_bounded"] = peak["rss"] <= rss0 + args.max_rss_growth_mib
    checks["no_failures"] = not stats.failures
    summary = {
        "requests": args.requests, "seconds": round(elapsed, 1),
        "requests_per_s": round(args.requests / elapsed, 1), "counts": stats.counts,
        "checks": checks, "failures": stats.failures[:10],
    }
    if kvserve:
        summary["free_blocks"] = {"before": free_before, "after": free_after}
    if args.pid:
        summary["threads"] = {"start": threads0, "peak": peak["threads"], "end": t_end}
        summary["rss_mib"] = {"start": round(rss0), "peak": round(peak["rss"]), "end": round(r_end)}
    print(json.dumps(summary, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
