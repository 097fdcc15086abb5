#!/usr/bin/env python3
"""deploy/Containerfile cannot drift from deploy/setup.sh or from the binary.

  check_containerfile.py CONTAINERFILE SETUP_SH [BINARY...]   (kvserve, kvserve-cli, kvserve-bench)

1. The build stage installs exactly setup.sh's PACKAGES (the README's install
   steps run setup.sh), so a package added there and not here fails.
2. The runtime stage installs the Debian packages owning the shared libraries
   `ldd KVSERVE_BINARY` resolves (dpkg -S), minus what debian:12 already has,
   and nothing else except the health check's curl and ca-certificates.
3. The image's shape: two stages on Debian 12, a non-root USER, /models as a
   VOLUME, a HEALTHCHECK on /health.
Podman may not run here, so this is the check that always can.
"""
import re
import subprocess
import sys

# In debian:12 already (essential or required by apt), so not listed.
BASE_IMAGE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libzstd1", "liblzma5", "libbz2-1.0",
              "libcrypt1", "libsystemd0", "libudev1", "libgcrypt20", "libgpg-error0", "liblz4-1",
              "libcap2", "libselinux1", "libpcre2-8-0", "libseccomp2", "libgnutls30", "libnettle8"}
# Listed for reasons other than linking.
TOOLS = {"curl", "ca-certificates"}
# NVIDIA's toolkit installs outside dpkg (/usr/local/cuda-13.0/lib/libcudart.so.13).
CUDA_TOOLKIT = re.compile(r"^/usr/local/cuda[^/]*/|^/opt/nvidia/")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def setup_packages(text):
    m = re.search(r"^PACKAGES=\((.*?)^\)", text, re.S | re.M)
    if not m:
        fail("no PACKAGES=( ... ) in setup.sh")
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#", 1)[0].split()
    return words


def block_packages(text, name):
    m = re.search(r"# %s:begin.*?\n(.*?)# %s:end" % (name, name), text, re.S)
    if not m:
        fail("no %s:begin/end block in the Containerfile" % name)
    body = m.group(1).replace("\\\n", " ")
    m2 = re.search(r"--no-install-recommends(.*?)&&", body, re.S)
    if not m2:
        fail("the %s block has no apt-get install --no-install-recommends ... &&" % name)
    return m2.group(1).split()


_OWNERS = {}


def linked_packages(binary):
    out = subprocess.run(["ldd", binary], capture_output=True, text=True)
    if out.returncode != 0:
        fail("ldd %s: %s" % (binary, out.stderr))
    libs = []
    for line in out.stdout.splitlines():
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s*(/\S+)", line)
        if m:
            libs.append(m.group(1))
    pkgs = {}
    for lib in libs:
        if CUDA_TOOLKIT.match(lib):
            # The image is the CPU build (-DKVSERVE_WITH_CUDA=OFF); a CUDA
            # build's runtime comes with NVIDIA's toolkit, not from Debian.
            print("note: %s is from the CUDA toolkit; the image is the CPU build" % lib)
            continue
        owner = _OWNERS.get(lib)
        for path in () if owner else (lib, lib.replace("/usr/lib/", "/lib/", 1), lib.replace("/lib/", "/usr/lib/", 1)):
            r = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
            if r.returncode == 0:
                owner = r.stdout.split(":", 1)[0].strip()
                break
        if owner is None:
            fail("no Debian package owns %s (a library built by hand?)" % lib)
        _OWNERS[lib] = owner
        pkgs.setdefault(owner, []).append(lib)
    return pkgs


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    cf = open(sys.argv[1]).read()
    setup = open(sys.argv[2]).read()

    want = setup_packages(setup)
    build = block_packages(cf, "build-packages")
    if sorted(want) != sorted(build):
        fail("build stage and setup.sh differ: only in setup.sh %s, only in the Containerfile %s" %
             (sorted(set(want) - set(build)), sorted(set(build) - set(want))))
    print("ok: build stage installs setup.sh's %d packages" % len(want))

    stages = re.findall(r"^FROM\s+(\S+)", cf, re.M)
    if len(stages) < 2 or not all(re.search(r"debian:12\b", s) for s in stages):
        fail("want a multi-stage build on debian:12, got FROM %s" % stages)
    users = re.findall(r"^USER\s+(\S+)", cf, re.M)
    if not users or users[-1] in ("root", "0"):
        fail("the runtime stage must run as a non-root USER")
    if not re.search(r"^VOLUME\s+.*\"/models\"", cf, re.M):
        fail("the model directory /models must be a VOLUME")
    if not re.search(r"^HEALTHCHECK\b.*(\\\n.*)*?/health", cf, re.M):
        fail("no HEALTHCHECK asking /health")
    print("ok: %d stages on debian:12, USER %s, VOLUME /models, HEALTHCHECK /health" % (len(stages), users[-1]))

    runtime = set(block_packages(cf, "runtime-packages"))
    if len(sys.argv) > 3:
        linked = {}
        for binary in sys.argv[3:]:
            for pkg, libs in linked_packages(binary).items():
                linked.setdefault(pkg, []).extend(libs)
        need = set(linked) - BASE_IMAGE
        missing = need - runtime
        extra = runtime - need - TOOLS - BASE_IMAGE
        if missing:
            fail("the runtime stage lacks %s (linked: %s)" %
                 (sorted(missing), {p: linked[p] for p in sorted(missing)}))
        if extra:
            fail("the runtime stage installs %s, which no binary links" % sorted(extra))
        print("ok: runtime stage = the %d packages %d binaries link (+ %s)" %
              (len(need), len(sys.argv) - 3, sorted(runtime & (TOOLS | BASE_IMAGE))))
    else:
        print("note: no binary given, the runtime list was not checked against ldd")
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
