#!/usr/bin/env python3
"""/metrics for Prometheus and the inference gateway; health for orchestrators.

Against a real `kvserve serve` on 127.0.0.1 (issue 42, items 2 and 3):
  - /metrics parses as the Prometheus text format 0.0.4, with and without
    --metrics-compat vllm: prometheus_client's parser plus the checks promtool's
    `check metrics` makes that matter here (valid names, one TYPE per family
    before its samples, families contiguous, counters ending in _total,
    histogram buckets cumulative with +Inf equal to _count); when `promtool` is
    on PATH or in KVSERVE_PROMTOOL (Debian's prometheus package) it must parse
    the text and raise no lint but "metric names should not contain ':'",
    which every vllm: name (what the gateway reads) raises;
  - with --metrics-compat vllm: the endpoint picker's names are present with
    the right semantics: vllm:num_requests_waiting > 0 while requests queue
    behind --max-seqs 1, vllm:kv_cache_usage_perc in [0, 1] and higher with a
    long context running than idle, vllm:cache_config_info's block_size and
    num_gpu_blocks equal the node's own, vllm:lora_requests_info present;
    without it no vllm: series;
  - --metrics-auth none serves /metrics without the API key, the default does
    not; /health/live needs no key;
  - while the model loads (the model path is a FIFO nobody writes yet, so the
    load blocks in open()): HTTP /health is 503, /health/live 200, and the
    gRPC health service reports NOT_SERVING (kvserve-cli health).

usage: metrics_compat_test.py KVSERVE KVSERVE_CLI MODEL.gguf
Exit 77 (skip) without prometheus_client or the model.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:
    print(f"SKIP: {e}; set KVSERVE_PYTHON to the test venv's python")
    sys.exit(77)

KEY = "sk-metrics-test"
NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port, path, key=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def check_exposition(text, where, run_promtool=True):
    """promtool-like checks; returns {family: type} and the samples."""
    types, seen_done, current = {}, set(), None
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if not NAME.match(parts[2]):
                    fail(f"{where}:{n}: bad metric name {parts[2]!r}")
                if parts[1] == "TYPE":
                    fam = parts[2]
                    if fam in types:
                        fail(f"{where}:{n}: second TYPE for {fam}")
                    if fam in seen_done:
                        fail(f"{where}:{n}: TYPE for {fam} after its samples")
                    types[fam] = parts[3]
                    if parts[3] == "counter" and not fam.endswith("_total"):
                        fail(f"{where}:{n}: counter {fam} does not end in _total")
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)(\s+\d+)?$", line)
        if not m:
            fail(f"{where}:{n}: not a sample line: {line!r}")
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if not NAME.match(name):
            fail(f"{where}:{n}: bad metric name {name!r}")
        fam = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                fam = name[: -len(suffix)]
        if fam not in types:
            fail(f"{where}:{n}: sample of {fam} before (or without) its TYPE")
        if fam != current:
            if fam in seen_done:
                fail(f"{where}:{n}: samples of {fam} are not contiguous")
            if current is not None:
                seen_done.add(current)
            current = fam
        lab = dict(LABEL.findall(labels))
        float(value)  # raises on a bad value
        samples.append((name, lab, float(value)))
    # Histograms: cumulative buckets, +Inf == _count.
    for fam, t in types.items():
        if t != "histogram":
            continue
        series = {}
        for name, lab, v in samples:
            if name == fam + "_bucket":
                key = tuple(sorted((k, x) for k, x in lab.items() if k != "le"))
                series.setdefault(key, []).append((lab["le"], v))
        counts = {tuple(sorted(lab.items())): v for name, lab, v in samples if name == fam + "_count"}
        for key, buckets in series.items():
            if buckets[-1][0] != "+Inf":
                fail(f"{where}: {fam} has no +Inf bucket last")
            vals = [v for _, v in buckets]
            if vals != sorted(vals):
                fail(f"{where}: {fam} buckets not cumulative")
            if counts.get(key) != vals[-1]:
                fail(f"{where}: {fam} +Inf bucket {vals[-1]} != _count {counts.get(key)}")
    # And the reference parser.
    list(text_string_to_metric_families(text))
    promtool = os.environ.get("KVSERVE_PROMTOOL") or shutil.which("promtool")
    if not run_promtool:
        promtool = None
    elif not promtool and os.environ.get("KVSERVE_REQUIRE_PROMTOOL") == "1":
        fail(f"{where}: KVSERVE_REQUIRE_PROMTOOL=1 but no promtool (KVSERVE_PROMTOOL or PATH)")
    if promtool:
        r = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                           capture_output=True)
        # Exit 1: the text does not parse. Exit 3: lint problems; promtool
        # flags every name with a colon, and the colon is in vLLM's names
        # (vllm:...), the very names the gateway reads, and in kvserve's own
        # (kvserve:..., vLLM's with our prefix): that one lint is accepted,
        # any other fails.
        # Older kvserve: names promtool also lints (renaming them would break
        # dashboards): known, listed here so a new one still fails.
        known = {"kvserve:kv_blocks_total", "kvserve:spec_step_fixed_ms",
                 "kvserve:spec_step_ms_per_token", "kvserve:step_decode_ms_per_token",
                 "kvserve:step_prefill_ms_per_token"}
        problems = [l for l in (r.stdout + r.stderr).splitlines()
                    if l.strip() and not l.endswith("metric names should not contain ':'")
                    and l.split(" ", 1)[0] not in known]
        if r.returncode not in (0, 3) or problems:
            fail(f"{where}: promtool check metrics (exit {r.returncode}): {problems}")
        print(f"{where}: promtool check metrics: parses; lint: only the colon in names "
              f"({r.returncode})")
    return types, samples


def value(samples, name):
    for n, lab, v in samples:
        if n == name:
            return v, lab
    fail(f"{name} missing")


def start(binary, model, extra, port_file):
    return subprocess.Popen([binary, "--log-level", "warn", "-t", "2", "-m", model, "serve",
                             "--http-port", "0", "--grpc-address", "127.0.0.1:0",
                             "--port-file", port_file, "--api-key", KEY, "--drain-timeout", "1"]
                            + extra)


def wait_port(proc, port_file):
    deadline = time.time() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            fail("daemon did not start")
        time.sleep(0.05)
    return json.load(open(port_file))["http"]


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def loading_phase(binary, cli, tmp):
    """Health while the model loads: the load blocks opening a FIFO."""
    fifo = os.path.join(tmp, "model.gguf")
    os.mkfifo(fifo)
    http, grpc = free_port(), free_port()
    proc = subprocess.Popen([binary, "--log-level", "warn", "-m", fifo, "serve",
                             "--http-port", str(http), "--grpc-address", f"127.0.0.1:{grpc}",
                             "--api-key", KEY])
    try:
        deadline = time.time() + 30
        while True:
            try:
                live = http_get(http, "/health/live")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.time() > deadline or proc.poll() is not None:
                    fail("no /health/live while loading")
                time.sleep(0.05)
        if live[0] != 200:
            fail(f"/health/live while loading: {live}")
        ready = http_get(http, "/health")
        if ready[0] != 503 or "loading" not in ready[1]:
            fail(f"/health while loading: {ready}")
        other = http_get(http, "/v1/models", KEY)
        if other[0] != 503:
            fail(f"/v1/models while loading: {other}")
        r = subprocess.run([cli, "--address", f"127.0.0.1:{grpc}", "health"], capture_output=True,
                           text=True, timeout=30)
        out = r.stdout + r.stderr
        if "NOT_SERVING" not in out:
            fail(f"gRPC health while loading: rc {r.returncode}: {out!r}")
        print(f"while loading: /health/live 200, /health {ready[0]} {ready[1]!r}, gRPC: "
              f"{out.strip()!r}")
    finally:
        # Unblock the load (it fails on an empty file) and end the process.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody reading: the daemon is gone already
        stop(proc)


def main():
    binary, cli, model = sys.argv[1], sys.argv[2], sys.argv[3]
    if not os.path.exists(model):
        print(f"SKIP: no model at {model}")
        sys.exit(77)
    tmp = tempfile.mkdtemp(prefix="metrics-compat-")

    # Default: /metrics behind the key, no vllm: names.
    pf = os.path.join(tmp, "a.json")
    proc = start(binary, model, [], pf)
    try:
        port = wait_port(proc, pf)
        if http_get(port, "/metrics")[0] != 401:
            fail("/metrics without the key answered under --metrics-auth key")
        if http_get(port, "/health/live")[0] != 200:
            fail("/health/live needs a key")
        post(port, {"prompt": "Once upon a time", "max_tokens": 8})
        status, text = http_get(port, "/metrics", KEY)
        if status != 200:
            fail(f"/metrics: {status}")
        types, _ = check_exposition(text, "default")
        if any(f.startswith("vllm:") for f in types):
            fail("vllm: series without --metrics-compat vllm")
        if any(f.startswith("kvserve_") for f in types):
            fail(f"kvserve_ names: {[f for f in types if f.startswith('kvserve_')]}")
        print(f"default: {len(types)} families pass the exposition checks")
    finally:
        stop(proc)

    # --metrics-compat vllm --metrics-auth none, one sequence at a time.
    pf = os.path.join(tmp, "b.json")
    proc = start(binary, model, ["--metrics-compat", "vllm", "--metrics-auth", "none",
                                 "--max-seqs", "1", "--block-size", "16"], pf)
    try:
        port = wait_port(proc, pf)
        status, text = http_get(port, "/metrics")
        if status != 200:
            fail(f"/metrics without the key under --metrics-auth none: {status}")
        if http_get(port, "/v1/models")[0] != 401:
            fail("--metrics-auth none opened more than /metrics")
        types, samples = check_exposition(text, "vllm idle")
        for fam in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                    "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:lora_requests_info",
                    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                    "vllm:e2e_request_latency_seconds"):
            if fam not in types:
                fail(f"{fam} missing under --metrics-compat vllm")
        idle_usage, _ = value(samples, "vllm:kv_cache_usage_perc")
        _, info = value(samples, "vllm:cache_config_info")
        total, _ = value(samples, "kvserve:kv_blocks_total")
        if info.get("block_size") != "16" or info.get("num_gpu_blocks") != str(int(total)):
            fail(f"cache_config_info {info}, node has {total} blocks of 16")
        _, lora = value(samples, "vllm:lora_requests_info")
        if lora.get("running_lora_adapters") != "" or lora.get("max_lora") != "0":
            fail(f"lora_requests_info {lora}")
        # Load: twelve long generations behind --max-seqs 1 (the tiny model drains fast).
        long_prompt = " ".join(["the little dog ran to the park and"] * 3)
        threads = [threading.Thread(target=post, args=(port, {"prompt": long_prompt,
                                                              "max_tokens": 80,
                                                              "ignore_eos": True}))
                   for _ in range(12)]
        for t in threads:
            t.start()
        max_waiting, max_running, max_usage = 0.0, 0.0, 0.0
        while any(t.is_alive() for t in threads):
            _, text = http_get(port, "/metrics")
            # No promtool here (a process start per call): the loop must
            # scrape faster than the tiny model drains the queue; promtool
            # checks the idle scrapes and the one right after the load.
            _, s = check_exposition(text, "vllm load", run_promtool=False)
            max_waiting = max(max_waiting, value(s, "vllm:num_requests_waiting")[0])
            max_running = max(max_running, value(s, "vllm:num_requests_running")[0])
            u = value(s, "vllm:kv_cache_usage_perc")[0]
            if not 0 <= u <= 1:
                fail(f"kv_cache_usage_perc {u} outside [0, 1]")
            max_usage = max(max_usage, u)
            time.sleep(0.02)
        for t in threads:
            t.join()
        print(f"under load: waiting max {max_waiting:.0f}, running max {max_running:.0f}, "
              f"usage idle {idle_usage:.4f} -> max {max_usage:.4f}")
        if max_waiting < 1:
            fail("vllm:num_requests_waiting never rose while requests queued")
        if max_running != 1:
            fail(f"vllm:num_requests_running max {max_running} with --max-seqs 1")
        if not max_usage > idle_usage:
            fail("vllm:kv_cache_usage_perc did not rise with a long context")
        _, text = http_get(port, "/metrics")
        _, s = check_exposition(text, "vllm after")
        count, _ = value(s, "vllm:e2e_request_latency_seconds_count")
        if count < 4:
            fail(f"vllm:e2e_request_latency_seconds_count {count} after 4 requests")
    finally:
        stop(proc)

    if os.path.exists(cli):
        loading_phase(binary, cli, tmp)
    else:
        fail(f"no kvserve-cli at {cli}")
    print("PASS")


if __name__ == "__main__":
    main()
