#!/usr/bin/env bash
# On the GPU machine: runs staged GPU test binaries of markbase-cuda many times and counts the
# runs that fail (a panic, a segmentation fault, a timeout), to measure a rare failure and
# compare builds. Binaries come staged in DIR (optionally gzipped) as scripts/stage_for_device.sh
# names them: gpu_ops_NAME, gpu_models_NAME.
# Usage: scripts/gpu_test_loop.sh DIR RUNS NAME [NAME ...]
#   Each run's extra `cargo test` arguments come from TEST_ARGS (e.g. "--test-threads=1").
# Prints, per binary, the failed runs' exit status and first panic, then "failed F of RUNS".
set -u
dir=${1:?usage: scripts/gpu_test_loop.sh DIR RUNS NAME [NAME ...]}
runs=${2:?usage: scripts/gpu_test_loop.sh DIR RUNS NAME [NAME ...]}
shift 2
for f in "$dir"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
export MARKBASE_FIXTURES=${MARKBASE_FIXTURES:-$PWD/tests/fixtures}
export MARKBASE_CUDA_CACHE=${MARKBASE_CUDA_CACHE:-/tmp/kc}
out=$(mktemp)
for name in "$@"; do
    for test in gpu_ops gpu_models; do
        bin=$dir/${test}_$name
        [ -e "$bin" ] || continue
        chmod +x "$bin"
        failed=0
        for i in $(seq 1 "$runs"); do
            # shellcheck disable=SC2086
            timeout 300 "$bin" ${TEST_ARGS:-} > "$out" 2>&1
            rc=$?
            if [ "$rc" != 0 ]; then
                failed=$((failed + 1))
                echo "${test}_$name run $i: exit $rc"
                grep -m1 -A3 panicked "$out"
            fi
        done
        echo "${test}_$name: failed $failed of $runs"
    done
done
rm -f "$out"
