#!/usr/bin/env python3
"""Reference outputs of transformers for the default model (Gemma 3 270M Q4_K_M GGUF).

transformers dequantizes every GGUF tensor to float32 (with gguf-py) and runs its own Gemma 3
code, so these are independent of MarkBase. Writes tests/fixtures/gemma3_270m/:

  logits.json   prompts (token ids from transformers' tokenizer), the sampled vocabulary ids,
                and per position: argmax, full-vocabulary logsumexp and top-8 ids
  logits.bin    float32 little-endian logits at the sampled ids, position-major, prompts in order
  greedy.json   8 prompts with 64-token greedy continuations (token ids)

Full logit rows (262144 floats each) would not fit a small fixture, so each position keeps a
fixed random sample of 384 vocabulary ids plus its own top-8 ids, and the logsumexp of the
whole row (a check on every logit at once).

Usage: python3 scripts/make_gemma3_270m_references.py PATH/TO/gemma-3-270m-q4_k_m.gguf
Needs: torch, transformers, gguf, accelerate (pip).
"""
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gemma3_270m")
N_SAMPLED = 384

LOGIT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n",
    "Die Katze sitzt auf der Matte. 日本語のテキストも少し。 Emoji: 🚀✨",
]

GREEDY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def quicksort(arr):",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "<start_of_turn>user\nList three fruits.<end_of_turn>\n<start_of_turn>model\n",
]


def long_prompt_text():
    """An English text well past the 512-token sliding window (exercises the window)."""
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        return f.read()[:3200]


def main():
    gguf_path = os.path.abspath(sys.argv[1])
    directory, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(20261129)
    sampled = np.sort(rng.choice(vocab, size=N_SAMPLED, replace=False)).astype(np.int64)

    prompts = []
    blobs = []
    for text in LOGIT_PROMPTS + [long_prompt_text()]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        lse = torch.logsumexp(logits, dim=-1)
        top = logits.topk(8, dim=-1).indices
        positions = []
        for p in range(logits.shape[0]):
            positions.append(
                {
                    "argmax": int(logits[p].argmax()),
                    "logsumexp": float(lse[p]),
                    "top8": [int(i) for i in top[p]],
                    "top8_logits": [float(logits[p, i]) for i in top[p]],
                }
            )
        blobs.append(logits[:, torch.from_numpy(sampled)].float().numpy())
        prompts.append({"text": text, "ids": ids[0].tolist(), "positions": positions})
        print(f"{len(ids[0])} tokens: next = {tok.decode(logits[-1].argmax())!r}")

    os.makedirs(OUT, exist_ok=True)
    np.concatenate(blobs).astype("<f4").tofile(os.path.join(OUT, "logits.bin"))
    with open(os.path.join(OUT, "logits.json"), "w") as f:
        json.dump(
            {
                "source": "transformers "
                + __import__("transformers").__version__
                + ", float32, eager attention, GGUF dequantized by gguf-py",
                "sampled_ids": sampled.tolist(),
                "prompts": prompts,
            },
            f,
        )

    greedy = []
    for text in GREEDY_PROMPTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)
        cont = out[0, ids.shape[1]:].tolist()
        greedy.append({"text": text, "prompt_ids": ids[0].tolist(), "continuation_ids": cont})
        print(repr(text), "->", repr(tok.decode(cont)))
    with open(os.path.join(OUT, "greedy.json"), "w") as f:
        json.dump({"max_new_tokens": 64, "prompts": greedy}, f, indent=1)


if __name__ == "__main__":
    main()
