#!/usr/bin/env python3
"""Idle-connection probe for an HTTP daemon (127.0.0.1 only; stdlib only).

For each count N it opens N idle TCP connections to the daemon (optionally
sending half a request line, "--partial"), then reports the daemon's thread
count and RSS (from /proc/PID/status) and the latency of valid
/v1/completions requests sent alongside on a fresh connection; then closes
the N connections and reports the threads/RSS once more.

  python3 deploy/http_idle_probe.py --port 8000 --pid $(pgrep -n kvserve) \
      --model SmolLM2-135M-Instruct.Q4_1 --counts 0,2000,10000

Raise the open-file limit first (ulimit -n 20000); the probe raises its own
soft limit to the hard one. Figures are in docs/http.md.
"""
import argparse
import json
import resource
import socket
import statistics
import sys
import time
import urllib.request


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return int(out["Threads"]), int(out["VmRSS"].split()[0]) / 1024.0


def completion_latency(port, model, tries):
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 8,
                       "temperature": 0}).encode()
    times = []
    for _ in range(tries):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times)


def open_idle(port, n, partial):
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        s.connect(("127.0.0.1", port))
        if partial:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def alive(socks):
    """How many of the connections the server has not closed."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1, socket.MSG_PEEK) == b"":
                continue
        except BlockingIOError:
            pass
        except OSError:
            continue
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True, help="the daemon's pid")
    ap.add_argument("--model", required=True)
    ap.add_argument("--counts", default="0,2000,10000")
    ap.add_argument("--partial", action="store_true", help="send half a request line")
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after opening")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    completion_latency(args.port, args.model, 1)  # warm up
    print("idle_conns\tthreads\trss_mib\tlat_median_s\tlat_max_s\topen_after\tthreads_after"
          "\trss_after_mib")
    for n in [int(c) for c in args.counts.split(",")]:
        t_open = time.perf_counter()
        socks = open_idle(args.port, n, args.partial)
        opened_s = time.perf_counter() - t_open
        time.sleep(args.settle)
        threads, rss = proc_status(args.pid)
        med, worst = completion_latency(args.port, args.model, args.tries)
        still = alive(socks)
        for s in socks:
            s.close()
        time.sleep(args.settle)
        threads_after, rss_after = proc_status(args.pid)
        print(f"{n}\t{threads}\t{rss:.0f}\t{med:.3f}\t{worst:.3f}\t{still}\t{threads_after}"
              f"\t{rss_after:.0f}\t(opened in {opened_s:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
