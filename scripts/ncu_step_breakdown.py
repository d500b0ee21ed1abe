#!/usr/bin/env python3
"""Where one decode step's GPU time goes, kernel by kernel, from Nsight Compute.

Run the CUDA timing harness under ncu with one metric, then feed the CSV here:

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv --print-units base cuda_bench --synthetic 31b:bf16 --steps 2 --prompt 4 \
        > step.csv
    python3 scripts/ncu_step_breakdown.py step.csv

The last step is the launches from the last `embed_*` kernel (a step's first) to the end.
Prints, per kernel name and grid, the launches, total and mean µs, and share of the step;
ncu serializes kernels, so the sum is the step without overlap between kernels (programmatic
dependent launch) and without launch gaps.
"""

import csv
import sys
from collections import OrderedDict


def rows_of(path):
    """(kernel name, grid, block, µs) of every profiled launch, in launch order."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    launches = []
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec.get("Metric Unit", "ns")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3}.get(unit, 1e-3)
        name = rec["Kernel Name"].split("(")[0]
        launches.append((name, rec.get("Grid Size", ""), rec.get("Block Size", ""), value * scale))
    return launches


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: ncu_step_breakdown.py NCU_CSV")
    launches = rows_of(sys.argv[1])
    starts = [i for i, (name, *_rest) in enumerate(launches) if name.startswith("embed_")]
    if not starts:
        sys.exit(f"{sys.argv[1]}: no embed_* launch among {len(launches)} profiled launches")
    step = launches[starts[-1]:]
    total = sum(us for *_rest, us in step)
    groups = OrderedDict()
    for name, grid, block, us in step:
        count, sum_us = groups.get((name, grid, block), (0, 0.0))
        groups[(name, grid, block)] = (count + 1, sum_us + us)
    print(f"one step: {len(step)} launches, {total:.1f} µs of kernel time (serialized)")
    print("| kernel | grid | block | launches | total µs | mean µs | share |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for (name, grid, block), (count, sum_us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(
            f"| {name} | {grid} | {block} | {count} | {sum_us:.1f} | {sum_us / count:.2f} "
            f"| {100 * sum_us / total:.1f} % |"
        )


if __name__ == "__main__":
    main()
