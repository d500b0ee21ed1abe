#!/usr/bin/env bash
# On the GPU machine, in one call: the GPU tests, then an A/B of markbase builds, alternating.
# Binaries come staged in DIR (each optionally gzipped, to fit the device tool's carry limit;
# scripts/stage_for_device.sh builds and stages them):
#   gpu_ops*, gpu_models*   test binaries of markbase-cuda (`cargo test --release -p
#                           markbase-cuda --no-run`, then copied out of target/release/deps;
#                           a suffix tells builds apart, e.g. gpu_ops_new);
#   cb_NAME                 cuda_bench examples: `--gemv` runs once per build (with
#                           FRESH_COMPILE=1, first each loads the kernels with an empty cache:
#                           the time of a fresh compile);
#   m_NAME                  markbase CLIs: each bench line below runs once per build per round
#                           (a wrapper script that sets MARKBASE_CUDA_DEFINES and execs another
#                           staged binary counts as a build).
#   cut.gguf                the Gemma 3 270M cut (scripts/make_gemma3_270m_cut.py), if present;
#   kc.tgz                  the kernel cache compiled off the GPU (stage_for_device.sh), which
#                           every step below loads from (MARKBASE_CUDA_CACHE), if present.
# Usage: scripts/device_ab.sh DIR [ROUNDS] [BENCH ...], where each BENCH is one quoted argument
# list for `markbase --device cuda bench`, e.g. "--synthetic e4b:q4_k -p 0 -n 64 -b 1,8 -r 1 -v".
# Kernel variants: VARIANTS="SET;SET…", each SET a MARKBASE_CUDA_DEFINES value (e.g.
# VARIANTS="GEMV_PLAIN_MIN_BLOCKS=2;GEMV_PREFETCH_LINES=8"): each runs `cuda_bench --gemv` under
# it and becomes a build m_vN wrapping the first m_*; with VARIANT_TESTS=1 each also runs
# gpu_ops' product tests ("matmul"; 2–3 minutes a variant on the H200, session 42 — check
# variants on the CPU first: MARKBASE_CUDA_DEFINES=SET cargo test --release -p markbase-cuda
# --test emu_kernels).
# GEMV_ARGS: more arguments for `cuda_bench --gemv` (e.g. "--tokens 64").
# GEMV=0: no `cuda_bench --gemv` runs (e.g. a sweep of chain variants only).
# CHAIN=1: also `cuda_bench --chain bf16` and `--chain q4_k` (E4B's products of 42 layers as one
# persistent launch, as a launch a product, and as the backend's own operations) for each build
# and variant.
# NCU_KERNEL=REGEX: also profile the first 3 launches of the kernels REGEX matches (e.g.
# "mmq_q4_k_8") in `cuda_bench --gemv` under Nsight Compute, for the first build and each
# variant: speed of light, occupancy, scheduler and warp-state (stall) sections.
# Steps that are missing are skipped; each step is bounded by `timeout`.
set -u
dir=${1:?usage: scripts/device_ab.sh DIR [ROUNDS] [BENCH ...]}
rounds=${2:-2}
shift $(($# < 2 ? $# : 2))
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=("--synthetic e4b:bf16 -p 0 -n 64 -b 1,8 -r 1 -v")
cd "$(dirname "$0")/.."
for f in "$dir"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x "$dir"/* 2>/dev/null
export MARKBASE_FIXTURES=$PWD/tests/fixtures
[ -f "$dir/cut.gguf" ] && export MARKBASE_GEMMA3_CUT=$PWD/$dir/cut.gguf
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -f "$dir/kc.tgz" ]; then
    kc_root=$(mktemp -d)
    tar xzf "$dir/kc.tgz" -C "$kc_root"
    export MARKBASE_CUDA_CACHE=$kc_root/kc
    echo "kernel cache: $(ls "$MARKBASE_CUDA_CACHE" | wc -l) units staged"
fi
for cb in "$dir"/cb_*; do
    [ -x "$cb" ] && [ "${FRESH_COMPILE:-0}" = 1 ] || continue
    echo "== $(basename "$cb"): every kernel compiled afresh (an empty cache)"
    fresh=$(mktemp -d)
    MARKBASE_CUDA_CACHE=$fresh timeout 300 "$cb" 2>&1 | head -1
    rm -rf "$fresh"
done
for t in "$dir"/gpu_ops* "$dir"/gpu_models*; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    timeout 300 "$t" --test-threads 1 2>&1 | grep -E "^test |test result|panicked|assert|replayed" | tail -40
done
for cb in "$dir"/cb_*; do
    [ -x "$cb" ] && [ "${GEMV:-1}" = 1 ] || continue
    echo "== $(basename "$cb") --gemv ${GEMV_ARGS:-}"
    timeout 90 "$cb" --gemv ${GEMV_ARGS:-} 2>&1 | tail -16
done
chain() {  # chain CUDA_BENCH: its --chain tables (bf16, Q4_K), when CHAIN=1
    [ "${CHAIN:-0}" = 1 ] || return 0
    for f in bf16 q4_k; do
        timeout 150 "$1" --chain $f 2>&1 | grep -E "^chain|^\|" | grep -v -- "---"
    done
}
for cb in "$dir"/cb_*; do
    [ -x "$cb" ] && [ "${CHAIN:-0}" = 1 ] || continue
    echo "== $(basename "$cb") --chain"
    chain "$cb"
done
ncu_gemv() {  # ncu_gemv CUDA_BENCH LABEL: its --gemv launches of NCU_KERNEL under Nsight Compute
    [ -n "${NCU_KERNEL:-}" ] || return 0
    echo "== ncu $2 --gemv ${GEMV_ARGS:-}: $NCU_KERNEL"
    # shellcheck disable=SC2086 # GEMV_ARGS is a word list on purpose
    timeout 240 /usr/local/cuda/bin/ncu --clock-control none -k "regex:$NCU_KERNEL" -c 3 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats \
        --section WarpStateStats "$1" --gemv ${GEMV_ARGS:-} 2>&1 | grep -vE "^==PROF==|^\s*$" |
        tail -80
}
for cb in "$dir"/cb_*; do
    [ -x "$cb" ] && ncu_gemv "$cb" "$(basename "$cb")"
done
builds=()
rm -f "$dir"/m_v[0-9]*  # wrappers of an earlier run
for m in "$dir"/m_*; do [ -x "$m" ] && builds+=("$m"); done
IFS=';' read -r -a variants <<< "${VARIANTS:-}"
for j in "${!variants[@]}"; do
    v=${variants[$j]}
    for t in "$dir"/gpu_ops*; do
        [ -x "$t" ] && [ "${VARIANT_TESTS:-0}" = 1 ] || continue
        echo "== MARKBASE_CUDA_DEFINES='$v' $(basename "$t") matmul"
        MARKBASE_CUDA_DEFINES=$v timeout 300 "$t" matmul --test-threads 1 2>&1 |
            grep -E "^test |test result|panicked|assert" | tail -20
    done
    for cb in "$dir"/cb_*; do
        [ -x "$cb" ] || continue
        if [ "${GEMV:-1}" = 1 ]; then
            echo "== MARKBASE_CUDA_DEFINES='$v' $(basename "$cb") --gemv"
            MARKBASE_CUDA_DEFINES=$v timeout 90 "$cb" --gemv ${GEMV_ARGS:-} 2>&1 | tail -16
        fi
        MARKBASE_CUDA_DEFINES=$v ncu_gemv "$cb" "MARKBASE_CUDA_DEFINES='$v' $(basename "$cb")"
        if [ "${CHAIN:-0}" = 1 ]; then
            echo "== MARKBASE_CUDA_DEFINES='$v' $(basename "$cb") --chain"
            MARKBASE_CUDA_DEFINES=$v chain "$cb"
        fi
    done
    [ ${#builds[@]} -gt 0 ] || continue
    w=$dir/m_v$j
    printf '#!/bin/sh\nMARKBASE_CUDA_DEFINES=%q exec %q "$@"\n' "$v" "$(realpath "${builds[0]}")" > "$w"
    chmod +x "$w"
    echo "== build $(basename "$w"): MARKBASE_CUDA_DEFINES='$v' over $(basename "${builds[0]}")"
    builds+=("$w")
done
for ((r = 1; r <= rounds; r++)); do
    for b in "${benches[@]}"; do
        for m in "${builds[@]}"; do
            echo "== $(basename "$m") round $r: bench $b"
            # shellcheck disable=SC2086 # each BENCH is a word list on purpose
            timeout 150 "$m" --device cuda bench $b 2>&1 | grep -E "^\| " | grep -v -- "---" | tail -6
        done
    done
done
