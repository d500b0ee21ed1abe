#!/usr/bin/env python3
"""Writes the tokenizer reference fixtures under tests/fixtures/tokenizer/.

    python3 scripts/make_tokenizer_fixtures.py --gguf PATH/gemma-3-270m-q4_k_m.gguf

1. gemma3_270m.json — for ~80 varied strings, the ids transformers' tokenizer gives for the GGUF
   (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`; BOS included as it adds it) and its
   decoding with special tokens skipped, plus the ids the SentencePiece library itself gives with
   a model rebuilt from the same GGUF metadata (the reference where the two disagree, see
   `notes` in the file).
2. tiny_bpe/tokenizer.json + tokenizer_config.json + expected.json — a small BPE with byte
   fallback built with the `tokenizers` package, and its ids / decodings from Python.
3. chat_templates.json — conversations rendered by transformers' chat-template renderer with
   Gemma 3's own template (from google/gemma-3 tokenizer_config.json) and with a ChatML-style
   template that uses Python string methods.
"""

import argparse
import json
import os
import re
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")

# Varied strings: ASCII, accents, CJK, emoji (incl. ones only reachable by byte fallback), code,
# runs of spaces / newlines / tabs, leading and trailing whitespace, special-token text, digits,
# long words, the empty string.
STRINGS = [
    "",
    "Hello world",
    "Hello, world!",
    " Hello",
    "Hello ",
    "  Hello  ",
    "Hello  world",
    "a   b",
    "x     y",
    " " * 40 + "forty spaces",
    " " * 70,
    "tab\tseparated\tvalues",
    "\t\t\tindented",
    "\t" * 40 + "deep",
    "line one\nline two",
    "para one\n\npara two",
    "\n\n\n\nfour newlines first",
    "ends with newline\n",
    "\n",
    " \n \n ",
    "mixed \t \n whitespace \r\n windows",
    "Café au lait, naïve résumé, façade, jalapeño",
    "Ærøskøbing, Straße, İstanbul, ǅemal",
    "日本語のテキストです。",
    "中文分词测试：你好，世界！",
    "한국어 문장입니다.",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "😀",
    "I ❤️ Rust 🦀 and 🦙 llamas 🧑‍🚀👩🏽‍💻",
    "🏳️‍🌈 flags 🇫🇷🇯🇵",
    "emoji at end 🎉",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∑∫∂√∞ ≤≥≠",
    "\u200b zero\u200dwidth\ufeff marks",
    "\u00a0non-breaking\u00a0spaces",
    "control \u0001\u0002\u007f chars",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<div class=\"a\"><table><tr><td>1</td></tr></table></div>",
    "<b>bold</b> <i>it</i> <code>x</code>",
    "SELECT * FROM users WHERE id = 42;",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "https://example.com/path?query=1&b=two#frag",
    "user@example.org",
    "0123456789",
    "3.14159265358979",
    "1,000,000 and 1e-9 and -42",
    "2026-11-29T17:38:43Z",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "Donaudampfschifffahrtsgesellschaftskapitän",
    "supercalifragilisticexpialidocious " * 3,
    "ALL CAPS SHOUTING",
    "camelCaseIdentifier snake_case_identifier kebab-case",
    "!!!???...,,,;;;:::",
    "¯\\_(ツ)_/¯",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos",
    "<bos><bos>",
    "a<end_of_turn>b",
    "<start_of_turn> spaced <end_of_turn>",
    "<eos>",
    "<pad><unk><mask>",
    "<unused0> and <unused99>",
    "<start_of_image>",
    "[multimodal]",
    "<start_of_turn",
    "start_of_turn>",
    "<<start_of_turn>>",
    "<|im_start|>not gemma<|im_end|>",
    "The quick brown fox jumps over the lazy dog.",
    "It's a dog's life; they're here, we'll see.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "\u2581literal sentencepiece marker\u2581\u2581",
    "a" * 300,
    "ab" * 100,
    "x",
    " ",
]


def build_spm_reference(gguf_path):
    """A SentencePiece model rebuilt from the GGUF's pieces, scores and types, with the
    normalizer Gemma uses (identity, no dummy prefix, spaces escaped, nothing collapsed) and BPE
    with byte fallback. The llama.cpp converter stores user-defined pieces with bare spaces where
    tokenizer.model has '▁'; they are written back as '▁' here."""
    import sentencepiece as spm
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as pb

    r = GGUFReader(gguf_path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.pad_id, m.trainer_spec.eos_id, m.trainer_spec.bos_id, m.trainer_spec.unk_id = 0, 1, 2, 3
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for t, ty, s in zip(tokens, types, scores):
        p = m.pieces.add()
        p.piece = t.replace(" ", "\u2581") if ty == 4 else t
        p.score = s
        p.type = ty
    sp = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
    # Control / unknown pieces written in the text are cut out first (llama.cpp and HF both do
    # this; SentencePiece alone would spell them out), leftmost-longest.
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (2, 3)), key=len, reverse=True)
    special_ids = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (2, 3)}
    pattern = re.compile("|".join(re.escape(t) for t in specials))

    def encode(text):
        ids, pos = [2], 0
        for match in pattern.finditer(text):
            ids += sp.encode(text[pos:match.start()])
            ids.append(special_ids[match.group(0)])
            pos = match.end()
        return ids + sp.encode(text[pos:])

    return encode


def gemma3_fixture(gguf_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    spm_encode = build_spm_reference(gguf_path)
    cases = []
    for s in STRINGS:
        hf = tok(s)["input_ids"]
        cases.append({
            "text": s,
            "hf_ids": hf,
            "hf_decoded": tok.decode(hf, skip_special_tokens=True),
            "spm_ids": spm_encode(s),
        })
    differ = [c["text"] for c in cases if c["hf_ids"] != c["spm_ids"]]
    return {
        "source": "transformers AutoTokenizer(gguf_file=gemma-3-270m-q4_k_m.gguf) and sentencepiece "
                  "(model rebuilt from the same GGUF); made by scripts/make_tokenizer_fixtures.py",
        "notes": "hf_ids: transformers, <bos> prepended as it adds it. spm_ids: the SentencePiece library "
                 "(<bos> + control tokens cut out of the text + sp.encode of the rest), which is what "
                 "llama.cpp reproduces. They differ only where user-defined whitespace pieces (runs of "
                 "2-31 spaces, ids 138-167) apply: transformers' GGUF conversion turns them into ordinary "
                 "BPE pieces reached by merges, SentencePiece matches them atomically and longest-first.",
        "strings_where_hf_and_spm_differ": differ,
        "vocab_size": len(tok),
        "cases": cases,
    }


TINY_CORPUS = (
    "the quick brown fox jumps over the lazy dog . the dog sleeps . a fox runs and the dog barks . "
    "hello world , hello tokenizer , byte fallback handles the rest . numbers 1 2 3 and more words ."
)


def tiny_bpe_fixture(folder):
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    os.makedirs(folder, exist_ok=True)
    # Train merges on the corpus (spaces as '▁', as in SentencePiece vocabularies), then put the
    # trained vocabulary behind the specials and the 256 byte pieces.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=160, show_progress=False, special_tokens=[])
    trainer_tok.train_from_iterator([TINY_CORPUS], trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {}
    for t in specials + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[t] = len(vocab)
    for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    tok.add_special_tokens(specials)
    tok.add_tokens(["<note>"])  # a non-special added token: matched in text, rendered when decoding
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}}, f, indent=1)
        f.write("\n")
    strings = ["the quick brown fox", "hello world", "the dog barks .", "  two  spaces", "",
               "unseen word zebra", "Ünïcödé ✓", "日本 😀 🦀", "<start_of_turn>hello<end_of_turn>",
               "a <note> here", "tabs\tand\nnewlines", "numbers 123 4567"]
    cases = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=True).ids
        cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    return {"source": "tokenizers " + __import__("tokenizers").__version__ + ", scripts/make_tokenizer_fixtures.py",
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "bos_id": vocab["<bos>"],
            "eos_id": vocab["<eos>"], "cases": cases}


# Gemma 3's own chat template (google/gemma-3 tokenizer_config.json).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

# A ChatML-style template in the HF manner: statement blocks relying on trim_blocks /
# lstrip_blocks, Python string methods, `raise_exception`, eos after assistant turns.
CHATML_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'].strip() %}
{% set rest = messages[1:] %}
{% else %}
{% set system = 'You are a helpful assistant.' %}
{% set rest = messages %}
{% endif %}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in rest %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'].lstrip() | trim }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi there  \n"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": " Quatre. "}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Line one\nLine two"}, {"role": "assistant", "content": "Ok\n\n"},
     {"role": "user", "content": "😀 日本"}],
]


def chat_template_fixture(tiny_folder):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tiny_folder, "tokenizer.json"),
                                  bos_token="<bos>", eos_token="<eos>")
    out = []
    for name, src in [("gemma3", GEMMA3_TEMPLATE), ("chatml", CHATML_TEMPLATE)]:
        for conv in CONVERSATIONS:
            for gen in (True, False):
                text = tok.apply_chat_template(conv, chat_template=src, tokenize=False, add_generation_prompt=gen)
                out.append({"template": name, "messages": conv, "add_generation_prompt": gen, "rendered": text})
    return {"source": "transformers apply_chat_template (bos_token <bos>, eos_token <eos>), "
                      "scripts/make_tokenizer_fixtures.py",
            "templates": {"gemma3": GEMMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}, "cases": out}


def dump(path, value):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="path to gemma-3-270m-q4_k_m.gguf")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    dump(os.path.join(OUT, "gemma3_270m.json"), gemma3_fixture(os.path.abspath(args.gguf)))
    tiny = os.path.join(OUT, "tiny_bpe")
    dump(os.path.join(tiny, "expected.json"), tiny_bpe_fixture(tiny))
    dump(os.path.join(OUT, "chat_templates.json"), chat_template_fixture(tiny))


if __name__ == "__main__":
    main()
