#!/usr/bin/env python3
"""Write the quant-format fixtures in tests/fixtures/quant/ from gguf-py, the reference oracle.

For every format the script writes `<FMT>.bin` (raw ggml blocks, concatenated) and `<FMT>.f32`
(the weights gguf-py dequantizes them to, little-endian f32). The blocks are random bytes,
except that every f16 scale/min field is overwritten with a finite random f16 of moderate
magnitude (so that the expected weights are finite); the legacy 32-weight formats also get
blocks made by gguf-py's own quantizer from random floats. gguf-py has no Q8_K dequantizer,
so Q8_K's expected weights are computed here in float32 numpy, exactly as ggml does (d * q).

For the quantizers, `quantize_input.f32` holds random floats (blocks of assorted scales, one
all-zero block, one block of equal values) and `quantize_<FMT>.bin` what gguf-py's quantizer
makes of them for each legacy format.

Run from the repository root:  python3 scripts/make_quant_fixtures.py
Needs numpy and gguf (gguf-py). Output is deterministic (fixed seed).
"""

from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "quant"
SEED = 20261129

# format -> (number of random-byte blocks, byte offsets of the f16 scale fields in a block)
FORMATS = {
    "F32": (512, []),
    "F16": (512, []),
    "BF16": (512, []),
    "Q4_0": (48, [0]),
    "Q4_1": (48, [0, 2]),
    "Q5_0": (48, [0]),
    "Q5_1": (48, [0, 2]),
    "Q8_0": (48, [0]),
    "Q2_K": (6, [80, 82]),
    "Q3_K": (6, [108]),
    "Q4_K": (6, [0, 2]),
    "Q5_K": (6, [0, 2]),
    "Q6_K": (6, [208]),
    "Q8_K": (6, []),
}
# legacy formats gguf-py can quantize: also this many blocks quantized from random floats
QUANTIZED_BLOCKS = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q5_1": 16, "Q8_0": 16}


def moderate_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values with random sign and magnitudes from 2^-16 (subnormal) to 2^3."""
    mag = np.exp2(rng.uniform(-16.0, 3.0, n))
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * mag).astype(np.float16)


def random_float_bits(rng: np.random.Generator, n: int, dtype, exp_mask: int) -> np.ndarray:
    """Random bit patterns of a float type, redrawn where they would be inf or NaN."""
    bits = rng.integers(0, 1 << (8 * np.dtype(dtype).itemsize), n, dtype=np.uint64)
    while True:
        bad = (bits & exp_mask) == exp_mask
        if not bad.any():
            break
        bits[bad] = rng.integers(0, 1 << (8 * np.dtype(dtype).itemsize), int(bad.sum()), dtype=np.uint64)
    return bits.astype(dtype)


def make(name: str, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    qtype = T[name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks, f16_fields = FORMATS[name]

    if name == "F32":
        raw = random_float_bits(rng, n_blocks, np.uint32, 0x7F800000).view(np.uint8)
    elif name in ("F16", "BF16"):
        mask = 0x7C00 if name == "F16" else 0x7F80
        raw = random_float_bits(rng, n_blocks, np.uint16, mask).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
        for off in f16_fields:
            blocks[:, off : off + 2] = moderate_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        if name == "Q8_K":
            d = (rng.choice([-1.0, 1.0], n_blocks) * np.exp2(rng.uniform(-20.0, 3.0, n_blocks))).astype("<f4")
            blocks[:, 0:4] = d.view(np.uint8).reshape(n_blocks, 4)
        raw = blocks.reshape(-1)
        if name in QUANTIZED_BLOCKS:
            floats = rng.standard_normal(QUANTIZED_BLOCKS[name] * block_size)
            floats = (floats * rng.uniform(0.01, 2.0)).astype(np.float32)
            quantized = gguf.quants.quantize(floats, qtype).reshape(-1)
            raw = np.concatenate([raw, quantized])

    if name == "Q8_K":
        blocks = raw.reshape(-1, type_size)
        d = blocks[:, 0:4].copy().view("<f4").astype(np.float32)
        q = blocks[:, 4 : 4 + block_size].view(np.int8).astype(np.float32)
        expected = (d * q).reshape(-1)
    else:
        expected = gguf.quants.dequantize(raw, qtype).reshape(-1)
    expected = np.ascontiguousarray(expected, dtype="<f4")
    assert np.isfinite(expected).all(), name
    assert expected.size * type_size == raw.size * block_size, name
    return raw.tobytes(), expected


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    total = 0
    for name in FORMATS:
        raw, expected = make(name, rng)
        (OUT / f"{name}.bin").write_bytes(raw)
        (OUT / f"{name}.f32").write_bytes(expected.tobytes())
        total += len(raw) + expected.nbytes
        print(f"{name:5} {len(raw):6} bytes -> {expected.size:5} weights")
    floats = quantizer_input(np.random.default_rng(SEED + 1))
    (OUT / "quantize_input.f32").write_bytes(floats.tobytes())
    for name in QUANTIZED_BLOCKS:
        quantized = gguf.quants.quantize(floats, T[name]).reshape(-1).tobytes()
        (OUT / f"quantize_{name}.bin").write_bytes(quantized)
        total += len(quantized)
        print(f"quantize {name:5} {floats.size} weights -> {len(quantized)} bytes")
    print(f"total {total} bytes in {OUT}")


def quantizer_input(rng: np.random.Generator) -> np.ndarray:
    """64 blocks of 32 floats at assorted scales, then an all-zero block and a constant block."""
    blocks = rng.standard_normal((64, 32)) * np.exp2(rng.uniform(-12.0, 4.0, (64, 1)))
    blocks = np.concatenate([blocks, np.zeros((1, 32)), np.full((1, 32), -0.75)])
    return np.ascontiguousarray(blocks.reshape(-1), dtype="<f4")


if __name__ == "__main__":
    main()
