#!/usr/bin/env bash
# GPU check of the `--device` paths of the release binary:
#   1. bench of a synthetic Gemma 4 E4B (bf16) on cuda;
#   2. greedy generation of the real model on cpu and on cuda, texts diffed (PASS/FAIL each);
#   3. with SERVE_MODEL set (a GGUF with a tokenizer, e.g. a random-weight Gemma 4 from
#      synth_gemma4_gguf.py --tokenizer-from), `serve --device cuda` under bench-serve.
#
# Environment: BIN (default target/release/markbase), MODEL (default the pulled Gemma 3 270M),
# TOKENS (generated per prompt, default 48), SERVE_MODEL (optional), PORT (default 18080).
# Exit status 0 only when every check passes.
set -u

BIN=${BIN:-target/release/markbase}
MODEL=${MODEL:-$HOME/.cache/markbase/models/gemma-3-270m-q4_k_m.gguf}
TOKENS=${TOKENS:-48}
PORT=${PORT:-18080}
failed=0

pass() { echo "PASS: $*"; }
fail() {
    echo "FAIL: $*"
    failed=1
}

echo "== bench: synthetic e4b:bf16 on cuda"
if "$BIN" bench --synthetic e4b:bf16 --device cuda -p 512 -n 128 -r 3; then
    pass "bench on cuda"
else
    fail "bench on cuda"
fi

echo "== greedy generation of $MODEL: cpu vs cuda ($TOKENS tokens, exact LM head)"
prompts=(
    "The capital of France is"
    "Write a haiku about the sea."
    "def fibonacci(n):"
)
# gen DEVICE [run options...] PROMPT: the greedy text.
gen() {
    local device=$1
    shift
    "$BIN" -m "$MODEL" --device "$device" --lm-head exact run \
        --temperature 0 --max-tokens "$TOKENS" "$@"
}
for i in "${!prompts[@]}"; do
    p=${prompts[$i]}
    # The first prompt runs raw, the others through the chat template.
    args=("$p")
    [ "$i" -eq 0 ] && args=(--raw "$p")
    if ! cpu=$(gen cpu "${args[@]}"); then
        fail "cpu run of '$p'"
        continue
    fi
    if ! gpu=$(gen cuda "${args[@]}"); then
        fail "cuda run of '$p'"
        continue
    fi
    if [ "$cpu" == "$gpu" ]; then
        pass "'$p' gives the same text on cpu and cuda"
    else
        fail "'$p' differs between cpu (<) and cuda (>)"
        diff <(printf '%s\n' "$cpu") <(printf '%s\n' "$gpu")
    fi
done

if [ -n "${SERVE_MODEL:-}" ]; then
    echo "== serve -m $SERVE_MODEL --device cuda, under bench-serve"
    "$BIN" -m "$SERVE_MODEL" --device cuda serve --port "$PORT" &
    server=$!
    up=0
    for _ in $(seq 1 600); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
            up=1
            break
        fi
        kill -0 "$server" 2>/dev/null || break
        sleep 1
    done
    if [ "$up" -eq 1 ] &&
        "$BIN" bench-serve "http://127.0.0.1:$PORT" --concurrency 1,8 --max-tokens 64; then
        pass "serve on cuda"
    else
        fail "serve on cuda"
    fi
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
fi

if [ "$failed" -eq 0 ]; then
    echo "gpu_check: PASS"
else
    echo "gpu_check: FAIL"
fi
exit "$failed"
