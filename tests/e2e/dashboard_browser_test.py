#!/usr/bin/env python3
"""The dashboard end to end: a real daemon under load, the page in headless
Chromium driven over the DevTools protocol (--remote-debugging-pipe).

Checks, in order:
  1. HTTP: /dashboard follows /metrics's API-key rule (401 with the key form
     for a browser, 401 JSON for the stream), the page is self-contained (no
     http(s) URL it would fetch), /dashboard/events streams snapshots.
  2. Browser: the page goes live, shows running sequences while the load
     runs, lists the prefix this test created in the radix-tree table, and -
     once the load has stopped - shows the block counts /metrics shows.
  3. The "why did this miss" box answers with the explain endpoint's table
     (POST /admin/cache/explain), and it counts some of the prompt, which
     extends the prefix the load cached, as cached tokens.
  4. The screenshot (saved under OUT_DIR) is not blank: decoded, its pixels
     vary and use several colours.

Exit 77 (CTest's SKIP_RETURN_CODE) after the HTTP checks when Chromium is
missing or cannot start.

usage: dashboard_browser_test.py KVSERVE_BINARY MODEL.gguf OUT_DIR
"""
import base64
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib

SKIP = 77
# Words the page must show in its top-prefixes table after the test sends
# this prompt a few times (long enough to fill several KV blocks).
PREFIX_MARK = "lighthouse keeper"
PREFIX_PROMPT = ("Once upon a time the old lighthouse keeper Tim had a small red boat and a big "
                 "grey cat. Every day the lighthouse keeper Tim and the cat went to the sea to "
                 "look for fish, and every night they came home and sat by the warm fire.")


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


class Daemon:
    def __init__(self, binary, model, extra, tmp):
        self.port_file = os.path.join(tmp, "ports-%d.json" % len(os.listdir(tmp)))
        self.log_path = self.port_file + ".log"
        args = [binary, "--log-level", "warn", "-m", model, "serve", "--grpc-address", "127.0.0.1:0",
                "--http-port", "0", "--port-file", self.port_file] + extra
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                fail("daemon exited at start-up:\n" + open(self.log_path).read())
            try:
                with open(self.port_file) as f:
                    self.port = json.load(f)["http"]
                return
            except (OSError, ValueError, KeyError):
                time.sleep(0.05)
        self.stop()
        fail("daemon did not start within 60 s")

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def http(method, url, body=None, headers=None, timeout=120):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def complete(d, prompt, max_tokens, headers=None):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    status, _, out = http("POST", d.url("/v1/completions"), body, h)
    if status != 200:
        fail("completion answered %d: %s" % (status, out[:300]))
    return json.loads(out)


def metrics(d, headers=None):
    status, _, body = http("GET", d.url("/metrics"), headers=headers)
    if status != 200:
        fail("/metrics answered %d" % status)
    values = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name.split("{", 1)[0]] = float(value)
    return values


def first_sse_event(url, headers=None, timeout=10):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            fail("/dashboard/events is not an event stream: " + r.headers.get("Content-Type", ""))
        buf = b""
        while b"\n\n" not in buf:
            chunk = r.read1(65536)
            if not chunk:
                fail("the event stream ended before its first event")
            buf += chunk
        event = buf.split(b"\n\n", 1)[0].decode()
        data = "".join(l[6:] for l in event.splitlines() if l.startswith("data: "))
        return json.loads(data)


# --- DevTools protocol over a pipe -------------------------------------------

class Browser:
    def __init__(self, tmp):
        exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if not exe:
            raise RuntimeError("no chromium on PATH (apt-get install chromium)")
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes replies to fd 4.
        def setup():
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--user-data-dir=" + os.path.join(tmp, "chromium-profile"), "--window-size=1400,1900",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(tmp, "chromium.log"), "w"),
            # Not close_fds: it would run after setup() and close 3 and 4
            # (Python's own descriptors are not inheritable anyway).
            preexec_fn=setup, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buf = b""
        self.next_id = 1
        self.session = None
        targets = self.call("Target.getTargets", timeout=30)["targetInfos"]
        page = next((t for t in targets if t["type"] == "page"), None)
        if page is None:
            page_id = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        else:
            page_id = page["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": page_id, "flatten": True})["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1400, "height": 1900, "deviceScaleFactor": 1, "mobile": False})

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            if time.time() > deadline:
                raise RuntimeError("chromium did not answer in time")
            if self.proc.poll() is not None:
                raise RuntimeError("chromium exited (%d)" % self.proc.returncode)
            import select
            r, _, _ = select.select([self.from_chrome], [], [], 0.5)
            if r:
                chunk = os.read(self.from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its pipe")
                self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, params=None, timeout=30):
        mid = self.next_id
        self.next_id += 1
        msg = {"id": mid, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self.to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == mid:
                if "error" in reply:
                    raise RuntimeError("%s: %s" % (method, reply["error"]))
                return reply.get("result", {})

    def eval(self, expression):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError("page script failed: %s" % r["exceptionDetails"])
        return r["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_for(what, fn, timeout):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
        except RuntimeError as e:  # e.g. the page is still navigating
            if "chromium" in str(e):
                raise
            last = "error: %s" % e
        else:
            if last:
                return last
        time.sleep(0.25)
    fail("timed out waiting for " + what + " (last: %r)" % (last,))


# --- PNG ---------------------------------------------------------------------

def decode_png(data):
    """Returns (width, height, channels, rows of bytes) of an 8-bit PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail("the screenshot is not a PNG")
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            if depth != 8 or interlace != 0 or ctype not in (2, 6):
                fail("unexpected PNG format (depth %d, colour type %d)" % (depth, ctype))
            ch = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
    raw = zlib.decompress(idat)
    stride = w * ch
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - ch] if i >= ch else 0
            b = prev[i]
            c = prev[i - ch] if i >= ch else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, ch, rows


def screenshot_stats(png):
    w, h, ch, rows = decode_png(png)
    # Sample every 4th pixel of every 4th row: mean, variance, colours.
    n, s, s2, colours = 0, 0.0, 0.0, set()
    for y in range(0, h, 4):
        row = rows[y]
        for x in range(0, w, 4):
            r, g, b = row[x * ch], row[x * ch + 1], row[x * ch + 2]
            lum = 0.299 * r + 0.587 * g + 0.114 * b
            n += 1
            s += lum
            s2 += lum * lum
            colours.add((r >> 3, g >> 3, b >> 3))
    mean = s / n
    return w, h, s2 / n - mean * mean, len(colours)


# --- the test ----------------------------------------------------------------

def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    binary, model, out_dir = sys.argv[1:]
    if not os.path.isfile(model):
        print("SKIP: model %s not found" % model)
        return SKIP
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvserve-dash-")
    daemons = []
    try:
        # 1a. The API-key rule.
        keyed = Daemon(binary, model, ["--api-key", "dash-key"], tmp)
        daemons.append(keyed)
        st, ctype, body = http("GET", keyed.url("/dashboard"))
        if st != 401 or "text/html" not in ctype or b"API key" not in body:
            fail("/dashboard without the key: want 401 with the key form, got %d %s" % (st, ctype))
        if b"dashboard/events" in body or b"pool-free" in body:
            fail("the 401 page carries dashboard content")
        st, _, _ = http("GET", keyed.url("/dashboard/events"))
        if st != 401:
            fail("/dashboard/events without the key answered %d, want 401" % st)
        st, _, _ = http("GET", keyed.url("/dashboard/snapshot"), headers={"Authorization": "Bearer wrong"})
        if st != 401:
            fail("/dashboard/snapshot with a wrong key answered %d, want 401" % st)
        st, _, body = http("GET", keyed.url("/dashboard"), headers={"Authorization": "Bearer dash-key"})
        if st != 200 or b"blockmap" not in body:
            fail("/dashboard with the key answered %d" % st)
        ev = first_sse_event(keyed.url("/dashboard/events"), {"Authorization": "Bearer dash-key"})
        if "pool" not in ev:
            fail("the first event has no pool: %r" % ev)
        keyed.stop()
        daemons.remove(keyed)
        print("ok: API-key rule (401 form / 401 JSON / 200 with the key)", flush=True)

        # 1b. The open daemon the browser looks at.
        # A small pool (a few hundred blocks), so the map shows one cell per block.
        d = Daemon(binary, model, ["--max-seqs", "8", "--kv-cache-memory", "4MiB"], tmp)
        daemons.append(d)
        st, _, page = http("GET", d.url("/dashboard"))
        if st != 200:
            fail("/dashboard answered %d" % st)
        for needle in (b"src=\"http", b"href=\"http", b"@import", b"//cdn"):
            if needle in page:
                fail("the page refers to another origin: %r" % needle)
        print("ok: page is self-contained (%d bytes)" % len(page), flush=True)

        # The prefix the tree must show: sent three times (the 2nd and 3rd hit).
        for _ in range(3):
            r = complete(d, PREFIX_PROMPT, 4)
        cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        if cached <= 0:
            fail("the repeated prompt hit no cached tokens: %r" % r["usage"])
        print("ok: the test prefix is cached (%d of %d prompt tokens)" % (cached, r["usage"]["prompt_tokens"]),
              flush=True)
        # What the page's "why did this miss" box asks, over HTTP (so it is
        # checked without Chromium too): the endpoint exists and counts the
        # cached prefix of a prompt that extends it.
        st, _, body = http("POST", d.url("/admin/cache/explain"),
                           json.dumps({"prompt": PREFIX_PROMPT + " And then"}).encode(),
                           {"Content-Type": "application/json"})
        if st != 200:
            fail("POST /admin/cache/explain answered %d: %r" % (st, body[:300]))
        explained = json.loads(body)
        if explained.get("cached_tokens", 0) <= 0:
            fail("explain counts none of the cached prefix: %r" % explained)
        print("ok: explain counts %d cached tokens" % explained["cached_tokens"], flush=True)
        snap = json.loads(http("GET", d.url("/dashboard/snapshot"))[2])
        if not any(PREFIX_MARK in p["text"] for p in snap["tree"]["top_by_hits"]):
            fail("the snapshot's tree lacks the test prefix: %r" % snap["tree"])

        # Load: four clients with distinct prompts, until told to stop.
        stop = threading.Event()
        errors = []

        def load(i):
            n = 0
            while not stop.is_set():
                try:
                    complete(d, "Client %d request %d: the little dog ran to the park and" % (i, n), 48)
                except SystemExit as e:
                    errors.append(str(e))
                    return
                n += 1

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()

        # 2. The browser.
        try:
            browser = Browser(tmp)
        except Exception as e:  # noqa: BLE001 - any failure to start means skip
            stop.set()
            print("SKIP: chromium cannot run here: %s" % e, flush=True)
            return SKIP
        try:
            browser.call("Page.navigate", {"url": d.url("/dashboard")})
            wait_for("the page to go live",
                     lambda: browser.eval("document.getElementById('conn') && "
                                          "document.getElementById('conn').textContent === 'live' && "
                                          "document.body.dataset.tick !== undefined"), 30)
            print("ok: page live", flush=True)
            seen = wait_for("running sequences on the page",
                            lambda: browser.eval("(() => { const r = document.getElementById('seq-rows').innerText;"
                                                 " return r.includes('decoding') || r.includes('prefill') ? r : null; })()"),
                            30)
            print("ok: sequences shown under load: %s" % seen.splitlines()[0], flush=True)
            tree = wait_for("the test prefix in the tree",
                            lambda: browser.eval("(() => { const t = document.getElementById('tree-rows').innerText;"
                                                 " return t.includes(%s) ? t : null; })()" % json.dumps(PREFIX_MARK)), 20)
            print("ok: tree shows the test prefix: %s" % [l for l in tree.splitlines() if PREFIX_MARK in l][0][:120],
                  flush=True)
            time.sleep(1.0)  # let the histograms fill
            shot = base64.b64decode(browser.call("Page.captureScreenshot", {"format": "png"})["data"])
            path = os.path.join(out_dir, "dashboard.png")
            with open(path, "wb") as f:
                f.write(shot)

            # Idle: the page's block counts equal /metrics.
            stop.set()
            for t in threads:
                t.join(120)
            if errors:
                fail("load failed: " + errors[0])
            wait_for("the engine to go idle",
                     lambda: metrics(d)["kvserve:num_requests_running"] == 0 and
                     metrics(d)["kvserve:num_requests_waiting"] == 0, 60)

            def counts_match():
                m = metrics(d)
                want = {"total": m["kvserve:kv_blocks_total"], "used": m["kvserve:kv_blocks_used"],
                        "free": m["kvserve:kv_blocks_free"],
                        "cached": m.get("kvserve:prefix_cache_cached_blocks", 0),
                        "evictable": m.get("kvserve:prefix_cache_evictable_blocks", 0)}
                tick = browser.eval("Number(document.body.dataset.tick)")
                # A snapshot taken after the metrics were read.
                wait_for("a fresh snapshot", lambda: browser.eval("Number(document.body.dataset.tick)") > tick + 1, 10)
                got = browser.eval(
                    "(() => { const n = (id) => Number(document.getElementById(id).textContent.replace(/,/g, ''));"
                    " return {total: n('pool-total'), used: n('pool-used'), free: n('pool-free'),"
                    " cached: n('pool-cached'), pinned: n('pool-pinned'), running: n('pool-running')}; })()")
                ok = (got["total"] == want["total"] and got["used"] == want["used"] and
                      got["free"] + got["cached"] == want["free"] and got["cached"] == want["evictable"] and
                      got["pinned"] + got["cached"] == want["cached"] and
                      got["free"] + got["cached"] + got["pinned"] + got["running"] == want["total"])
                return (got, want) if ok else None

            got, want = wait_for("the page's block counts to equal /metrics", counts_match, 20)
            print("ok: block counts equal /metrics: page %s, metrics %s" % (got, want), flush=True)

            # 3. Why did this miss.
            browser.eval("document.getElementById('explain-prompt').value = %s;"
                         "document.getElementById('explain-go').click(); true" % json.dumps(PREFIX_PROMPT + " And then"))
            answer = wait_for("the explain answer",
                              lambda: browser.eval("document.getElementById('explain-out').innerText"), 20)
            cached = re.search(r"cached tokens\s+([0-9,]+)", answer)
            if not cached:
                fail("the explain box shows no cached-token count: %r" % answer)
            if int(cached.group(1).replace(",", "")) <= 0:
                fail("the explain box counts none of the cached prefix: %r" % answer)
            print("ok: why-miss view answers: %s" % answer.splitlines()[0], flush=True)
        finally:
            browser.close()

        # 4. The screenshot is not blank.
        w, h, var, colours = screenshot_stats(shot)
        print("screenshot %s: %dx%d, luminance variance %.1f, %d colours" % (path, w, h, var, colours), flush=True)
        if w < 800 or h < 600:
            fail("the screenshot is too small")
        if var < 100 or colours < 8:
            fail("the screenshot looks blank (variance %.1f, %d colours)" % (var, colours))
        print("PASS", flush=True)
        return 0
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
