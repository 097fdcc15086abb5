#!/usr/bin/env python3
"""Writes a GGUF of the same shape as a real one, small enough to travel.

The lent GPU machines take at most 64 MiB of files and reach no network, so
SmolLM2 (98 MB) cannot go there. Timing a serving engine needs the model's
shape (layers, heads, vocabulary, weight types, tokenizer), not its trained
values: every kernel kvserve runs costs the same for any weight bytes. This
keeps the header, the tokenizer and the f32 tensors (norms) as they are and
fills every other tensor with its own first rows repeated, whole rows so each
quantized block stays a valid block. The result is an xz stream that
compresses to a few MiB; `--unpack` turns it back into a GGUF there.
Outputs are not the model's (ignore_eos keeps output lengths fixed).

  python3 bench/gpu/same_shape_model.py models/SmolLM2-135M-Instruct.Q4_1.gguf gpu-pack/smol-shape.gguf.xz
  python3 bench/gpu/same_shape_model.py --unpack gpu-pack/smol-shape.gguf.xz /tmp/smol-shape.gguf
"""
import argparse
import lzma
import shutil
import struct
import sys

# ggml type -> (elements per block, bytes per block)
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
          8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
          13: (256, 176), 14: (256, 210), 15: (256, 292), 30: (1, 2)}
SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
KEEP_BYTES = 1 << 12  # rows kept per tensor: at least this many bytes


class Reader:
    def __init__(self, data):
        self.d, self.p = data, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.d, self.p)
        self.p += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = self.d[self.p:self.p + n]
        self.p += n
        return s.decode("utf-8", "replace")

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("I"), self.take("Q")
            if et in SCALARS:  # skip scalar arrays without decoding them
                self.p += SCALARS[et] * n
                return None
            return [self.value(et) for _ in range(n)]
        if t not in SCALARS:
            sys.exit(f"unknown GGUF value type {t}")
        self.p += SCALARS[t]
        return None


def shrink(src, dst):
    data = bytearray(open(src, "rb").read())
    r = Reader(data)
    if r.take("4s") != b"GGUF":
        sys.exit(f"{src}: not a GGUF file")
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    alignment = 32
    for _ in range(n_kv):
        key, t = r.string(), r.take("I")
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", data, r.p)[0]
        r.value(t)
    tensors = []
    for _ in range(n_tensors):
        name, nd = r.string(), r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        ttype, offset = r.take("I"), r.take("Q")
        tensors.append((name, dims, ttype, offset))
    base = (r.p + alignment - 1) // alignment * alignment
    kept = 0
    for name, dims, ttype, offset in tensors:
        if ttype == 0:
            continue  # f32: norms, tiny, kept as they are
        if ttype not in BLOCKS:
            sys.exit(f"{name}: ggml type {ttype} not handled")
        per, nbytes = BLOCKS[ttype]
        row = dims[0] // per * nbytes
        rows = 1
        for d in dims[1:]:
            rows *= d
        keep = min(rows, max(1, -(-KEEP_BYTES // row)))
        start = base + offset
        head = bytes(data[start:start + keep * row])
        total = rows * row
        filled = (head * (-(-total // len(head))))[:total]
        data[start:start + total] = filled
        kept += len(head)
    with lzma.open(dst, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(data)
    print(f"{dst}: {len(tensors)} tensors of {src}, {kept} bytes of rows kept, "
          f"GGUF v{version}, {len(data)} bytes unpacked")


def unpack(src, dst):
    with lzma.open(src, "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 24)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unpack", action="store_true", help="xz stream -> GGUF")
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args()
    (unpack if a.unpack else shrink)(a.src, a.dst)


if __name__ == "__main__":
    main()
