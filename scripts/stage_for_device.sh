#!/usr/bin/env bash
# Builds what scripts/device_ab.sh runs on the GPU machine and stages it in .stage (stripped
# and gzipped, for the device tool's 64 MiB carry limit): m_NAME (the markbase CLI), cb_NAME
# (the cuda_bench example), and, for the working tree only, gpu_ops_NAME / gpu_models_NAME /
# markbase_cuda_NAME (markbase-cuda's GPU test binaries and its unit tests); and kc.tgz, the
# kernel cache with every unit compiled for sm_90 by NVRTC here (the cuda_precompile example),
# for the default kernels and each `MARKBASE_CUDA_DEFINES` set of VARIANTS="SET;SET…", so the
# GPU machine loads them instead of compiling (scripts/device_ab.sh unpacks it). The cache's
# keys hold NVRTC's major.minor version: this side's wheel is 13.0, as CUDA 13.0 there.
# Usage: [VARIANTS="SET;SET…"] scripts/stage_for_device.sh NAME [REV]
#   REV: build that revision instead of the working tree, in a worktree of its own with a
#   target directory of its own (two checkouts of this workspace in one target directory
#   overwrite each other's libraries: cargo names workspace crates by their path relative
#   to the workspace root).
set -eu
name=${1:?usage: scripts/stage_for_device.sh NAME [REV]}
rev=${2:-}
cd "$(dirname "$0")/.."
stage=$PWD/.stage
mkdir -p "$stage"
src=$PWD
target=${CARGO_TARGET_DIR:-$PWD/target}
if [ -n "$rev" ]; then
    src=/tmp/markbase-stage-$rev
    target=/tmp/markbase-stage-target-$rev
    [ -d "$src" ] || git worktree add --detach "$src" "$rev"
fi
cd "$src"
export CARGO_TARGET_DIR=$target
cargo build --release --bin markbase
cargo build --release -p markbase-cuda --example cuda_bench --example cuda_precompile
put() {  # put FILE STAGED_NAME
    strip -o "$stage/$2" "$1"
    gzip -f "$stage/$2"
}
put "$target/release/markbase" "m_$name"
put "$target/release/examples/cuda_bench" "cb_$name"
if [ -z "$rev" ]; then
    cargo test --release -p markbase-cuda --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
            and msg["target"]["name"] in ("gpu_ops", "gpu_models", "markbase_cuda"):
        print(msg["target"]["name"], msg["executable"])
' | while read -r test exe; do put "$exe" "${test}_$name"; done
fi
nvrtc=${MARKBASE_NVRTC:-$target/tmp/nvrtc-13.0.88/nvidia/cu13/lib/libnvrtc.so.13}
if [ ! -f "$nvrtc" ]; then
    python3 -m pip install --quiet --no-deps --target "$target/tmp/nvrtc-13.0.88" \
        nvidia-cuda-nvrtc==13.0.88
fi
cache=$(mktemp -d)
IFS=';' read -r -a sets <<< ";${VARIANTS:-}"
for set in "${sets[@]}"; do
    MARKBASE_NVRTC=$nvrtc MARKBASE_CUDA_CACHE=$cache/kc MARKBASE_CUDA_DEFINES=$set \
        "$target/release/examples/cuda_precompile" 90
done
tar czf "$stage/kc.tgz" -C "$cache" kc
rm -rf "$cache"
ls -la "$stage"
du -sh "$stage"
