#!/usr/bin/env python3
"""ncu_kernel_table.py — per-kernel GPU time of a profiled run, from ncu's CSV, largest first.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
        flare-train --model gpt3-2.7b ... --steps 2 --warmup 1 > run.csv
    python3 bench/ncu_kernel_table.py run.csv --steps 2 --title "GPT-3 2.7B b4, H200, commit X"

Each kernel's durations are summed over the run and divided by --steps (the run's training steps,
so the table is per step); kernels are grouped by name without their argument lists. ncu times
each kernel alone, so the sum is below the run's own step time (no overlap, boost clocks).
The output is the format of bench/results/*/kernel-profile-*.txt.
"""

import argparse
import collections
import csv
import sys


def kernel_table(lines, steps):
    """(sum of ms per step, [(ms per step, calls per step, name)] largest first) from ncu CSV lines."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    if not rows:
        raise ValueError("no CSV rows (was ncu run with --csv --page raw?)")
    header = rows[0]
    name_col, time_col = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    unit = rows[1][time_col] if len(rows) > 1 else "ns"
    to_ms = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "ms": 1.0, "msecond": 1.0}.get(unit)
    if to_ms is None:
        raise ValueError(f"unknown time unit {unit!r}")
    total, count = collections.defaultdict(float), collections.Counter()
    for row in rows[2:]:
        try:
            t = float(row[time_col].replace(",", ""))
        except (ValueError, IndexError):
            continue
        name = row[name_col].split("(")[0]
        total[name] += t * to_ms
        count[name] += 1
    table = sorted(((ms / steps, count[n] / steps, n) for n, ms in total.items()), key=lambda r: -r[0])
    return sum(r[0] for r in table), table


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", help="ncu --csv --page raw output (other lines are skipped)")
    p.add_argument("--steps", type=float, default=1, help="training steps in the run (the table is per step)")
    p.add_argument("--title", default="", help="first line of the table")
    a = p.parse_args()
    with open(a.csv, errors="replace") as f:
        total, table = kernel_table(f, a.steps)
    out = sys.stdout
    if a.title:
        out.write(a.title + "\n")
    out.write(f"sum of kernel times per step: {total:.1f} ms\n ms/step  calls  kernel\n")
    for ms, calls, name in table:
        out.write(f"{ms:8.2f} {calls:6.0f}  {name[:140]}\n")


if __name__ == "__main__":
    main()
