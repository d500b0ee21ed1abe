#!/usr/bin/env bash
# Builds what scripts/device_ab.sh runs on the GPU machine and stages it in .stage (stripped
# and gzipped, for the device tool's 64 MiB carry limit): m_NAME (the markbase CLI), cb_NAME
# (the cuda_bench example), and, for the working tree only, gpu_ops_NAME / gpu_models_NAME /
# markbase_cuda_NAME (markbase-cuda's GPU test binaries and its unit tests).
# Usage: scripts/stage_for_device.sh NAME [REV]
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
cargo build --release -p markbase-cuda --example cuda_bench
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
ls -la "$stage"
du -sh "$stage"
