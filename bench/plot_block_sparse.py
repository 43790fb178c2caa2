#!/usr/bin/env python3
"""plot_block_sparse.py — block-sparse attention: time against the mask's density.

Reads a result file of bench/block_sparse_bench.py (rows {"impl": "flare" | "flare-dense",
"pass", "s", "h", "h_kv", "causal", "density", "us", "ratio_to_ideal"}) and draws one panel per
pass: time as a fraction of the all-on time against the density, one line per (s, heads, causal)
cell, beside the ideal (time proportional to the blocks computed) and the issue's bound, 1.15×
the ideal.

usage: plot_block_sparse.py --out CHART.png RESULT.json
"""
import matplotlib

from bench_common import load_result_for_plot

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    args, doc = load_result_for_plot(__doc__)
    rows = [r for r in doc["rows"] if r["impl"] == "flare" and r["ratio_to_ideal"] is not None]
    passes = sorted({r["pass"] for r in rows}, reverse=True)  # fwd, bwd
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.5), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        cells = sorted({(r["s"], r["h"], r["h_kv"], r["causal"]) for r in rows
                        if r["pass"] == pass_})
        for s, h, h_kv, causal in cells:
            pts = sorted((r["density"], r["ratio_to_ideal"] * r["density"]) for r in rows
                         if r["pass"] == pass_ and (r["s"], r["h"], r["h_kv"], r["causal"]) ==
                         (s, h, h_kv, causal))
            label = f"s {s // 1024}k, h {h}" + (f"/{h_kv}" if h_kv != h else "") + (
                ", causal" if causal else "")
            ax.plot(*zip(*pts), marker="o", label=label)
        grid = [i / 100 for i in range(3, 101)]
        ax.plot(grid, grid, color="gray", linestyle="--", linewidth=1, label="ideal: density")
        ax.plot(grid, [1.15 * x for x in grid], color="gray", linestyle=":", linewidth=1,
                label="1.15 × ideal")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (blocks computed / all)")
        ax.set_ylabel("time / time with every block on")
        ax.set_title(f"{pass_}, bf16, d 128, 128×128 blocks", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"block-sparse attention · {doc.get('card', '?')} · commit "
                 f"{doc.get('commit', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
