#!/usr/bin/env python3
"""ncu-lines.py — where a kernel's instructions and stall samples come from, by source line.

Joins an Nsight Compute source-counter export (executed instructions and warp-stall samples per
SASS instruction) with nvdisasm's line table for the same kernel (built with -lineinfo, as flare's
CUDA sources are), and prints per-source-line totals: instructions, share of stall samples, the
top opcodes. Also: per-opcode totals, stall reasons, and a side-by-side opcode diff of two
profiles (e.g. flare's backward against PyTorch's FlashAttention-2 backward on the same problem).

  # on the GPU machine: profile one launch with source counters, export its SASS table
  ncu --section SourceCounters -k regex:attention_backward_kernel --launch-skip 1 \\
      --launch-count 1 -o prof build-gpu/apps/flare/flare bench --device cuda --pass bwd \\
      --b 2 --s 4096 --h 16 --d 128 --no-causal --warmup 1 --iters 1
  ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > prof.csv.gz
  # anywhere with nvdisasm (CUDA toolkit, or the nvidia-cuda-nvdisasm wheel): the line table
  cuobjdump -xelf all <object>.o && nvdisasm -g -c <unit>.sm_90a.cubin > kernel.sass
  scripts/ncu-lines.py lines prof.csv.gz kernel.sass <mangled kernel name> [N]
  scripts/ncu-lines.py ops prof.csv.gz [other.csv.gz]     # opcode totals, or the diff of two
  scripts/ncu-lines.py stalls prof.csv.gz [other.csv.gz]  # stall reasons, or both side by side
  scripts/ncu-lines.py size prof.csv.gz [other.csv.gz ...] # code footprint and hot-set size

The SASS must come from the same compiler and flags as the profiled binary (same sm_90a code);
the join checks every instruction's opcode and reports mismatches.
"""
import collections
import csv
import gzip
import re
import signal
import sys


def load(path):
    rows = list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
    hdr = rows[1]  # row 0 names the kernel
    return hdr, [dict(zip(hdr, r)) for r in rows[2:] if len(r) == len(hdr)]


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    parts = sass.split()
    if not parts:
        return "?"
    return (parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]).split(".")[0]


def opcode_totals(path):
    _, data = load(path)
    totals = collections.Counter()
    for r in data:
        totals[opcode(r["Source"])] += num(r["Instructions Executed"])
    return totals


def cmd_ops(paths):
    totals = [opcode_totals(p) for p in paths]
    ops = sorted(set().union(*totals), key=lambda o: -(totals[0][o] - (totals[1][o] if len(totals) > 1 else 0)))
    print("%-10s" % "opcode" + "".join("%14s" % p.split("/")[-1][:13] for p in paths))
    for o in ops[:40]:
        print("%-10s" % o + "".join("%13.2fM" % (t[o] / 1e6) for t in totals))
    print("%-10s" % "total" + "".join("%13.2fM" % (sum(t.values()) / 1e6) for t in totals))


def stall_totals(path):
    hdr, data = load(path)
    cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    totals = collections.Counter()
    for r in data:
        for c in cols:
            totals[c[len("stall_"):]] += num(r[c])
    return totals


def cmd_stalls(paths):
    """Stall reasons as shares of all samples; with two profiles of the same problem, each
    reason's sample counts side by side and the difference as a share of the second's samples
    (the ncu sampling interval is the same for both, so samples compare as time)."""
    totals = [stall_totals(p) for p in paths]
    if len(totals) == 1:
        all_samples = sum(totals[0].values()) or 1.0
        for c, n in totals[0].most_common(14):
            print("%-20s %5.1f%%" % (c, 100 * n / all_samples))
        return
    a, b = totals
    peer = sum(b.values()) or 1.0
    print("%-20s %10s %10s %9s" % ("reason", paths[0].split("/")[-1][:10],
                                   paths[1].split("/")[-1][:10], "diff/peer"))
    for c in sorted(set(a) | set(b), key=lambda c: -abs(a[c] - b[c])):
        if a[c] or b[c]:
            print("%-20s %10d %10d %+8.1f%%" % (c, a[c], b[c], 100 * (a[c] - b[c]) / peer))
    print("%-20s %10d %10d %+8.1f%%" % ("all", sum(a.values()), peer,
                                        100 * (sum(a.values()) - peer) / peer))


def cmd_size(paths):
    """Code footprint: SASS instructions in the kernel, those executed at all, and the fewest
    that account for 95% of the executed instructions (the hot loop the instruction caches hold)."""
    print("%-30s %8s %9s %8s" % ("profile", "sass", "executed", "hot 95%"))
    for path in paths:
        _, data = load(path)
        counts = sorted((num(r["Instructions Executed"]) for r in data), reverse=True)
        total, acc, hot = sum(counts), 0.0, 0
        for n in counts:
            if acc >= 0.95 * total:
                break
            acc, hot = acc + n, hot + 1
        print("%-30s %8d %9d %8d" % (path.split("/")[-1][:30], len(counts),
                                      sum(1 for n in counts if n > 0), hot))


def line_table(sass_path, kernel):
    lines = open(sass_path).read().splitlines()
    start = [i for i, l in enumerate(lines) if l.startswith(kernel + ":")]
    if not start:
        sys.exit("ncu-lines.py: kernel %s not found in %s" % (kernel, sass_path))
    where, table = None, {}
    for l in lines[start[0]:]:
        m = re.search(r'//## File "([^"]+)", line (\d+)', l)
        if m:
            where = "%s:%s" % (m.group(1).split("/")[-1], m.group(2))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", l)
        if m:
            offset = int(m.group(1), 16)
            if offset in table:  # the next function starts over at 0
                break
            table[offset] = (where, m.group(2))
    return table


def cmd_lines(prof, sass_path, kernel, top):
    table = line_table(sass_path, kernel)
    _, data = load(prof)
    base = int(data[0]["Address"], 16)
    count, stall = collections.Counter(), collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    mismatches = 0
    for r in data:
        offset = int(r["Address"], 16) - base
        if offset not in table or opcode(r["Source"]) != opcode(table[offset][1]):
            mismatches += 1
            continue
        where = table[offset][0] or "-"
        n = num(r["Instructions Executed"])
        count[where] += n
        stall[where] += num(r["Warp Stall Sampling (All Samples)"])
        ops[where][opcode(r["Source"])] += n
    if mismatches:
        print("warning: %d of %d instructions do not match the SASS given" % (mismatches, len(data)))
    total, samples = sum(count.values()) or 1.0, sum(stall.values()) or 1.0
    print("%-28s %9s %6s %7s  top opcodes (M)" % ("line", "instr", "share", "stalls"))
    for where, n in count.most_common(top):
        print("%-28s %8.1fM %5.1f%% %6.1f%%  %s" % (
            where, n / 1e6, 100 * n / total, 100 * stall[where] / samples,
            " ".join("%s=%.1f" % (o, c / 1e6) for o, c in ops[where].most_common(5))))


def main(argv):
    if len(argv) >= 3 and argv[1] == "ops":
        cmd_ops(argv[2:4])
    elif len(argv) in (3, 4) and argv[1] == "stalls":
        cmd_stalls(argv[2:4])
    elif len(argv) >= 3 and argv[1] == "size":
        cmd_size(argv[2:])
    elif len(argv) in (5, 6) and argv[1] == "lines":
        cmd_lines(argv[2], argv[3], argv[4], int(argv[5]) if len(argv) == 6 else 40)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    main(sys.argv)
