#!/usr/bin/env python3
"""plot_decode.py — KV-cache decoding: the fraction of the card's memory bandwidth each cell reaches.

Reads a result file of bench/decode_bench.py (rows {"impl": "flare" | "torch-sdpa", "b",
"s_cache", "h_kv", "paged", "block_size", "kv_gbps", "frac_peak", ...}, and the file's
"peak_tbps") and draws one bar pair per cell: flare and SDPA, as the share of the peak bandwidth
the K/V bytes of the cache were read at. Cells are ordered by the bytes they read, so the latency
bound short caches sit on the left and the bandwidth-bound long ones on the right.

usage: plot_decode.py --out CHART.png RESULT.json
"""
import matplotlib

from bench_common import load_result_for_plot

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def cell_of(row):
    """The cell a row measures: everything but the implementation and its results."""
    return (row["b"], row["s_cache"], row["h_kv"], bool(row["paged"]), row.get("block_size"))


def label_of(cell):
    b, s, h_kv, paged, page = cell
    kib = f"{s // 1024}k" if s >= 1024 else str(s)
    return f"b{b}×{kib} kv{h_kv}" + (f" p{page}" if paged else "")


def main():
    args, doc = load_result_for_plot(__doc__)
    frac = {}  # cell -> impl -> fraction of the peak
    for row in doc["rows"]:
        frac.setdefault(cell_of(row), {})[row["impl"]] = row["frac_peak"]
    cells = sorted(frac, key=lambda c: (c[0] * c[1] * c[2], c[3], c[4] or 0))
    impls = sorted({impl for per in frac.values() for impl in per})
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(cells)), 4.5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, [frac[c].get(impl, 0.0) for c in cells], width, label=impl)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([label_of(c) for c in cells], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel(f"K/V bytes / time, share of {doc.get('peak_tbps', '?')} TB/s")
    ax.set_ylim(0, 1)
    ax.axhline(0.85, color="gray", linestyle=":", linewidth=1)
    ax.set_title(f"decoding, s_q 1, h 32, d 128 · {doc.get('card', '?')} · commit "
                 f"{doc.get('commit', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
