#!/usr/bin/env bash
# Without a GPU: what one kernel compiles to on sm_90a. Writes every kernel unit's PTX (the
# nvrtc_compile test with MARKBASE_PTX_DIR), assembles UNIT's with ptxas and disassembles it
# with cuobjdump (ptxas, cuobjdump and nvdisasm from NVIDIA's PyPI wheels, installed under
# $TOOLS on first use), then prints KERNEL's registers, spills and shared memory, its
# instruction mix, its loops (each closed by a predicated branch back) and the mix of the
# longest loop holding no other: the SASS behind a kernel's issue count (docs/perf.md,
# session 26).
# Usage: scripts/kernel_sass.sh UNIT KERNEL   e.g. scripts/kernel_sass.sh gemv-q4_k gemv_gelu_q4_k_1
#   UNIT: a PTX file's name in $PTX without "unit_" and ".ptx" (ls it after a first run).
#   PTX (default /tmp/markbase-ptx) keeps the PTX; KEEP_PTX=1 reuses it instead of rewriting.
set -euo pipefail
unit=${1:?usage: scripts/kernel_sass.sh UNIT KERNEL}
kernel=${2:?usage: scripts/kernel_sass.sh UNIT KERNEL}
ptx_dir=${PTX:-/tmp/markbase-ptx}
tools=${TOOLS:-/tmp/markbase-sass-tools}
cd "$(dirname "$0")/.."
if [ ! -x "$tools/nvidia/cu13/bin/ptxas" ] || [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
    python3 -m pip install --quiet --no-deps --target "$tools" nvidia-cuda-nvcc==13.0.88 \
        nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
fi
if [ "${KEEP_PTX:-0}" != 1 ] || [ ! -e "$ptx_dir/unit_$unit.ptx" ]; then
    mkdir -p "$ptx_dir"
    MARKBASE_PTX_DIR=$ptx_dir cargo test --release -q -p markbase-cuda --test nvrtc_compile \
        >/dev/null
fi
ptx=$ptx_dir/unit_$unit.ptx
[ -e "$ptx" ] || { echo "no $ptx; units: $(ls "$ptx_dir")" >&2; exit 1; }
bin=$tools/nvidia/cu13/bin
cubin=$(mktemp --suffix .cubin)
trap 'rm -f "$cubin"' EXIT
info=$("$bin/ptxas" -arch=sm_90a -O3 -v "$ptx" -o "$cubin" 2>&1)
grep -A3 "entry function '$kernel'" <<< "$info" | grep -E "Used|spill" || true
# ptxas's performance notes on the kernel (e.g. C7514: wgmma serialized), each naming it.
grep -E "\(C[0-9]+\).*'$kernel'" <<< "$info" || true
PATH=$bin:$PATH "$bin/cuobjdump" -sass "$cubin" | python3 -c '
import re, sys
from collections import Counter
kernel = sys.argv[1]
lines, on = [], False
for line in sys.stdin:
    if "Function :" in line:
        on = line.split("Function :")[1].strip() == kernel
    elif on:
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(3), m.group(4), bool(m.group(2))))
if not lines:
    sys.exit(f"no kernel {kernel} in this unit")
def mix(ops, title):
    print(f"{title}: {len(ops)} instructions")
    for op, n in Counter(ops).most_common(14):
        print(f"  {n:6d}  {op}")
mix([op for _, op, _, _ in lines], kernel)
# A loop closes with a predicated branch back (unpredicated ones back are divergence exits).
loops = []
for at, op, rest, predicated in lines:
    t = re.search(r"0x([0-9a-f]+)", rest)
    if op == "BRA" and predicated and t and int(t.group(1), 16) < at:
        loops.append((at - int(t.group(1), 16), int(t.group(1), 16), at))
for _, lo, hi in sorted(loops, reverse=True):
    n = sum(lo <= at <= hi for at, _, _, _ in lines)
    print(f"loop 0x{lo:x}..0x{hi:x}: {n} instructions")
inner = [l for l in loops if not any(o != l and l[1] <= o[1] and o[2] <= l[2] for o in loops)]
if inner:
    _, lo, hi = max(inner)
    ops = [op for at, op, _, _ in lines if lo <= at <= hi]
    mix(ops, f"longest innermost loop 0x{lo:x}..0x{hi:x}")
' "$kernel"
