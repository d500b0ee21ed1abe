#!/usr/bin/env python3
"""Writes a cut-down copy of the real Gemma 3 270M GGUF for GPU tests on machines that cannot
hold or fetch the 253 MB file: the first N decoder layers and the first V rows of the (tied)
embedding, every tensor byte-for-byte as stored (Q8_0 / Q5_0 / Q4_K / Q6_K / F32), the model
metadata with block_count = N, and no tokenizer (tests feed token ids).

    python3 scripts/make_gemma3_270m_cut.py SRC.gguf DST.gguf [--layers 6] [--vocab 8192]

With the defaults the result is about 28 MB. Needs gguf-py (`pip install gguf`).
"""
import argparse

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    r = GGUFReader(a.src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(a.dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name.startswith("tokenizer.") or name == "general.architecture":
            continue
        t = f.types[0]
        if name == f"{arch}.block_count":
            w.add_uint32(name, a.layers)
        elif t == GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[-1]).decode())
        elif t == GGUFValueType.ARRAY:
            if f.types[1] == GGUFValueType.STRING:
                w.add_array(name, [bytes(f.parts[i]).decode() for i in f.data])
            else:
                w.add_array(name, [f.parts[i][0].item() for i in f.data])
        else:
            w.add_key_value(name, f.parts[-1][0].item(), t)
    for t in r.tensors:
        keep = not t.name.startswith("blk.") or int(t.name.split(".")[1]) < a.layers
        if not keep:
            continue
        data = np.asarray(t.data)
        if t.name == "token_embd.weight":
            data = data[: a.vocab]
        # Quantized tensors: the raw block bytes with the logical (PyTorch-order) shape.
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
