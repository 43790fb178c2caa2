#!/usr/bin/env python3
"""Side-by-side table of bench/results JSON files: flare against its peers, case by case.

Rows are matched on (pass, dtype, b, s_q, s_k, h, h_kv, d, causal); each peer column shows its
TFLOP/s and flare's ratio to it (> 1: flare is faster). Cards must agree, or the comparison means
nothing: a mismatch is reported and the script exits 1.

usage: compare_table.py FLARE.json PEER.json [PEER.json ...]
"""
import json
import sys


def key(r):
    return (r["pass"], r["dtype"], r["b"], r["s_q"], r["s_k"], r["h"], r["h_kv"], r["d"], r["causal"])


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    files = [json.load(open(p)) for p in sys.argv[1:]]
    cards = {f.get("card") for f in files}
    if len(cards) != 1:
        print(f"compare_table: results come from different cards: {sorted(map(str, cards))}")
        sys.exit(1)
    table = {}
    impls = []
    for f in files:
        for r in f["rows"]:
            table.setdefault(key(r), {})[r["impl"]] = r
            if r["impl"] not in impls:
                impls.append(r["impl"])
    peers = [i for i in impls if i != "flare"]
    print(f"card: {cards.pop()}   (TFLOP/s; ratio = flare / peer)")
    head = f"{'pass':4s} {'dtype':5s} {'b':>3s} {'s':>6s} {'h':>3s} {'d':>4s} {'causal':>6s} {'flare':>8s}"
    for p in peers:
        head += f" {p:>12s} {'ratio':>6s}"
    print(head)
    ratios = {}
    for k in sorted(table, key=lambda k: (k[0], k[7], k[8], k[3])):
        row = table[k]
        fl = row.get("flare")
        line = (f"{k[0]:4s} {k[1]:5s} {k[2]:3d} {k[3]:6d} {k[5]:3d} {k[7]:4d} {str(k[8]):>6s} "
                f"{(fl['tflops'] if fl else float('nan')):8.1f}")
        for p in peers:
            pr = row.get(p)
            if pr and fl:
                ratio = fl["tflops"] / pr["tflops"]
                ratios.setdefault((p, k[0]), []).append(ratio)
                line += f" {pr['tflops']:12.1f} {ratio:6.2f}"
            elif pr:
                line += f" {pr['tflops']:12.1f} {'-':>6s}"
            else:
                line += f" {'-':>12s} {'-':>6s}"
        print(line)
    for (p, pass_), r in sorted(ratios.items()):
        r = sorted(r)
        print(f"{pass_:6s} flare / {p}: median {r[len(r) // 2]:.2f}, min {r[0]:.2f}, "
              f"max {r[-1]:.2f} over {len(r)} cases")


if __name__ == "__main__":
    main()
