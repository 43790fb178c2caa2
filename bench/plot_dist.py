#!/usr/bin/env python3
"""plot_dist.py — context-parallel efficiency against sequence length, per strategy and GPU count.

Reads the result files of `flare bench-dist` (and bench/ring_bench), rows {"impl": "flare-ring" |
"flare-zigzag" | "flare-a2a", "gpus", "s_total", "pass", "efficiency", ...}, and draws one panel
per pass (fwd, fwdbwd): efficiency = (single-GPU time of the whole problem / N) / measured time,
one line per (strategy, GPU count). Rows without an efficiency (no single-GPU time) are skipped.

usage: plot_dist.py --out CHART.png RESULT.json [RESULT.json ...]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_rows(paths):
    """(rows, title) from the files; the title names the cards and commits."""
    rows, cards, commits = [], set(), set()
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        cards.add(doc.get("card", "?"))
        commits.add(str(doc.get("commit", "?")))
        rows += [r for r in doc["rows"] if r.get("efficiency") is not None and r.get("gpus", 1) > 1]
    return rows, f"{', '.join(sorted(cards))} · commit {', '.join(sorted(commits))}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("results", nargs="+")
    args = ap.parse_args()
    rows, title = load_rows(args.results)
    if not rows:
        raise SystemExit("plot_dist.py: no rows with an efficiency in " + ", ".join(args.results))
    passes = sorted({r["pass"] for r in rows})
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.2), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        lines = {}
        for r in rows:
            if r["pass"] == pass_:
                key = (r["impl"].removeprefix("flare-"), r["gpus"])
                lines.setdefault(key, []).append((r["s_total"], r["efficiency"]))
        for (strategy, gpus), points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"{strategy}, {gpus} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("total sequence length (tokens)")
        ax.set_ylabel("efficiency (1-GPU time / N) / time")
        ax.set_title(pass_)
        ax.legend(fontsize=8)
    fig.suptitle("context-parallel attention · " + title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
