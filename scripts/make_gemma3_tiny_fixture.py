#!/usr/bin/env python3
"""Build the tiny random Gemma 3 text model fixture used by markbase-models' tests.

Writes tests/fixtures/gemma3_tiny/: config.json + model.safetensors (f32, a Gemma3ForCausalLM
saved by transformers), tokens.json (the token sequence) and logits.f32 (transformers' float32
eager logits for every position, little-endian, row-major tokens x vocab).

The model has 7 layers (sliding layers 0-4 and 6, a full-attention layer 5), GQA (4 query
heads over 2 KV heads), a sliding window of 8 (shorter than the 20-token sequence),
query_pre_attn_scalar 24 (so the attention scale differs from head_dim^-0.5) and linear RoPE
scaling on the global layer. Weights are drawn with scales large enough that the logits are far
from uniform and every norm weight is non-trivial.

It also writes gguf/: the same model as a llama.cpp-style GGUF (arch gemma3; norms stored as
1 + w; tied embeddings; token_embd and the attention matrices Q8_0, the MLP matrices F16) with
the logits transformers computes for exactly those stored weights (dequantized) and
query_pre_attn_scalar = head_dim, which is what a GGUF implies (it does not store the scalar).

Run from the repository root: python3 scripts/make_gemma3_tiny_fixture.py
"""

import json
import os

import gguf
import numpy as np
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gemma3_tiny")
SEED = 1234
SEQ_LEN = 20


def main():
    torch.manual_seed(SEED)
    config = Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.15)

    tokens = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0].to(torch.float32).numpy()

    os.makedirs(OUT, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    for extra in ("generation_config.json",):
        path = os.path.join(OUT, extra)
        if os.path.exists(path):
            os.remove(path)
    with open(os.path.join(OUT, "tokens.json"), "w") as f:
        json.dump({"tokens": tokens[0].tolist(), "vocab_size": config.vocab_size}, f)
    np.asarray(logits, dtype="<f4").tofile(os.path.join(OUT, "logits.f32"))
    write_gguf(model, config, tokens)
    probs = torch.softmax(torch.from_numpy(logits), -1)
    print("layer types:", config.layer_types)
    print("max prob per position:", [round(float(x), 3) for x in probs.max(-1).values])
    print("wrote", OUT)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest[: -len('.weight')]]}.weight"


def write_gguf(model, config, tokens):
    """The model as GGUF, plus transformers logits for the stored (quantized) weights."""
    Q = gguf.GGMLQuantizationType
    out = os.path.join(OUT, "gguf")
    os.makedirs(out, exist_ok=True)
    config = Gemma3TextConfig.from_dict(config.to_dict())
    config.query_pre_attn_scalar = config.head_dim
    qmodel = Gemma3ForCausalLM(config).eval()
    qmodel.load_state_dict(model.state_dict())
    w = gguf.GGUFWriter(os.path.join(out, "model.gguf"), "gemma3")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_sliding_window(config.sliding_window)
    with torch.no_grad():
        for name, p in qmodel.named_parameters():
            data = p.detach().numpy().astype(np.float32)
            if name.endswith("norm.weight"):
                w.add_tensor(gguf_name(name), data + 1.0)
                continue
            ty = Q.F16 if ".mlp." in name else Q.Q8_0
            stored = gguf.quants.quantize(data, ty)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(stored, ty).astype(np.float32)))
            w.add_tensor(gguf_name(name), stored, raw_dtype=ty)
        logits = qmodel(input_ids=tokens).logits[0].to(torch.float32).numpy()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    np.asarray(logits, dtype="<f4").tofile(os.path.join(out, "logits.f32"))


if __name__ == "__main__":
    main()
