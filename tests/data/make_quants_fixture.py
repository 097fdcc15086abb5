#!/usr/bin/env python3
"""Writes tests/data/quants_fixture.bin: random blocks of every extended ggml
weight format with their dequantized values as computed by the `gguf` PyPI
package's numpy dequantizers (gguf/quants.py, which mirror ggml's
dequantize_row_*), an implementation independent of kvserve's. quants_test
compares kvserve's reference dequantizer against it bit for bit.

Usage: python3 -m venv v && v/bin/pip install gguf==0.19.0 numpy &&
       v/bin/python tests/data/make_quants_fixture.py

Format (little-endian): b"KVQF", u32 record count; per record: u32 ggml
type id, u32 element count n, u32 byte count, the blocks, n float32 values.
"""
import os
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

# Byte offsets of the fp16 fields of each block (scale d, and dmin / m).
HALF_FIELDS = {
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.IQ4_NL: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_XS: [0],
}


def main():
    rng = np.random.default_rng(40)
    records = []
    for qtype, halves in HALF_FIELDS.items():
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n_blocks = max(4, 1024 // block_elems)
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        # Scales: finite halves of both signs over several decades, plus one
        # subnormal and one zero so those conversions are covered too.
        for off in halves:
            vals = (rng.uniform(0.5, 2.0, n_blocks) * 10.0 ** rng.integers(-5, 1, n_blocks)
                    * rng.choice([-1.0, 1.0], n_blocks)).astype(np.float16)
            vals[0] = np.float16(3e-6)  # subnormal in fp16
            vals[1] = np.float16(0.0)
            raw[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
        values = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert values.size == n_blocks * block_elems and np.all(np.isfinite(values))
        records.append((int(qtype), values.size, raw.tobytes(), values.astype('<f4').tobytes()))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quants_fixture.bin")
    with open(out, "wb") as f:
        f.write(b"KVQF" + struct.pack("<I", len(records)))
        for qtype, n, raw, values in records:
            f.write(struct.pack("<III", qtype, n, len(raw)))
            f.write(raw)
            f.write(values)
    print("wrote", out, os.path.getsize(out), "bytes")


if __name__ == "__main__":
    main()
