#!/usr/bin/env python3
"""plot_dp.py — the multi-GPU training study from bench/train_results.py's files: one table of
every run (forward, backward, communication and its exposed part per step, bandwidth, the
context-parallel attention's own exchanges, tokens/s, MFU, memory per GPU) and two charts, tokens/s against GPUs beside the ideal of N times one GPU,
and each run's step split into its parts.

    python3 bench/plot_dp.py bench/results/2026-11-27-h200x4-*/train-dp-*.json \\
        --table study.md --scaling scaling.png --breakdown breakdown.png

Rows are flare-train's (with the step profile that CUDA events give) and the PyTorch peers'
(tokens/s and memory only). A row names its card, so files from different machines can share a
table; the scaling chart draws one line per (card, model, sequence, batch per GPU), and its ideal
is N times that line's one-GPU row where the files hold one. Without matplotlib only the table is
written.
"""

import argparse
import json
import sys

PARTS = (("fwd_ms", "forward"), ("bwd_ms", "backward"), ("optimizer_ms", "optimizer"),
         ("comm_exposed_ms", "communication, exposed"))


def read_rows(paths):
    """Every row of the files that ran (no "error"), each with its file's card."""
    rows = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for row in doc.get("rows", []):
            if "error" in row or "tokens_per_s" not in row:
                continue
            rows.append(dict(row, card=doc.get("card", "?"), gpus=row.get("gpus", 1)))
    return rows


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def layout_label(r):
    """dp × cp of a flare-train run, with its ZeRO stage where data parallel; "-" for a peer."""
    if r["impl"] != "flare-train":
        return "-"
    dp = r.get("dp", r["gpus"])
    # Files from before `--zero 2` existed record no stage: their data parallelism is ZeRO-1.
    zero = r.get("zero") or (1 if dp > 1 else None)
    return f"{dp} × {r.get('cp', 1)}" + (f", ZeRO-{zero}" if zero else "")


def batch_label(r):
    """Sequences per GPU per micro-batch, and the micro-batches per step where more than one."""
    accum = r.get("grad_accum", 1)
    return f"{r['batch_per_gpu']} × {accum} accum" if accum > 1 else f"{r['batch_per_gpu']}"


def table(rows):
    """The study's table as Markdown."""
    head = ("| card | impl | model | GPUs | dp × cp | seq | batch/GPU | tokens/s | MFU | step ms | "
            "fwd ms | bwd ms | comm ms | exposed ms | GB/s | attention comm ms | memory/GPU GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=lambda r: (r["card"], r["model"], r["seq"], r["gpus"], r["impl"])):
        mem = r.get("peak_mem_bytes")
        mfu = r.get("mfu")
        layout = layout_label(r)
        lines.append(
            f"| {r['card']} | {r['impl']} | {r['model']} | {r['gpus']} | {layout} | {r['seq']} | "
            f"{batch_label(r)} | {r['tokens_per_s']:,.0f} | {fmt(mfu and 100 * mfu, '.1f')}% | "
            f"{fmt(r.get('step_ms'), '.1f')} | {fmt(r.get('fwd_ms'), '.1f')} | {fmt(r.get('bwd_ms'), '.1f')} | "
            f"{fmt(r.get('comm_ms'), '.1f')} | {fmt(r.get('comm_exposed_ms'), '.1f')} | "
            f"{fmt(r.get('comm_gbps'), '.0f')} | {fmt(r.get('cp_comm_ms'), '.1f')} | "
            f"{fmt(mem and mem / 2**30, '.1f')} |")
    return "\n".join(lines) + "\n"


def scaling_lines(rows):
    """{(card, model, seq, batch): [(gpus, tokens/s), ...]} of flare-train rows, and the ideal
    (N × one GPU) where a one-GPU row exists."""
    lines = {}
    for r in rows:
        if r["impl"] == "flare-train" and r.get("cp", 1) == 1:
            lines.setdefault((r["card"], r["model"], r["seq"], r["batch_per_gpu"]), []).append(
                (r["gpus"], r["tokens_per_s"]))
    return {key: sorted(points) for key, points in lines.items()}


def plot_scaling(rows, out, plt):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (card, model, seq, batch), points in scaling_lines(rows).items():
        if len(points) < 2:
            continue  # a scaling line needs a run at another GPU count; the table has the rest
        gpus = [g for g, _ in points]
        label = f"{model} s{seq} b{batch} ({card})"
        ax.plot(gpus, [t for _, t in points], marker="o", label=f"flare-train {label}")
        one = dict(points).get(1)
        if one:
            ax.plot(gpus, [g * one for g in gpus], linestyle=":", color="gray")
        for r in rows:
            if r["impl"] != "flare-train" and (r["card"], r["model"], r["seq"], r["batch_per_gpu"]) == (card, model, seq, batch):
                ax.scatter([r["gpus"]], [r["tokens_per_s"]], marker="x", label=f"{r['impl']} {label}")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s")
    ax.set_title("Data-parallel scaling (dotted: N × one GPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")


def plot_breakdown(rows, out, plt):
    """One horizontal bar per profiled flare-train run: its step split into its parts as shares
    of the step (runs of 50 ms and of 3 s side by side), the step's length in the label, and all
    of its communication, overlapped or not, as a thin bar under it."""
    profiled = [r for r in rows if r["impl"] == "flare-train" and r.get("fwd_ms") is not None]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.32 * len(profiled)))
    labels = [f"{r['model']} s{r['seq']} b{batch_label(r)}, {r['gpus']} GPU "
              f"{layout_label(r)}, {r['step_ms']:.0f} ms ({r['card']})"
              for r in profiled]
    y = [-i for i in range(len(profiled))]
    totals = [sum(r.get(key) or 0.0 for key, _ in PARTS) or 1.0 for r in profiled]
    left = [0.0] * len(profiled)
    for key, name in PARTS:
        share = [100 * (r.get(key) or 0.0) / t for r, t in zip(profiled, totals)]
        ax.barh(y, share, left=left, label=name, height=0.55)
        left = [a + b for a, b in zip(left, share)]
    ax.barh([v - 0.38 for v in y], [100 * (r.get("comm_ms") or 0.0) / t for r, t in zip(profiled, totals)],
            height=0.12, color="gray", alpha=0.6, label="communication, all (mostly overlapped)")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("% of the step (device time)")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6 / len(profiled) ** 0.5), ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench/train_results.py JSON files")
    p.add_argument("--table", help="write the table here (Markdown); default: print it")
    p.add_argument("--scaling", help="PNG: tokens/s against GPUs")
    p.add_argument("--breakdown", help="PNG: each flare-train run's step split into its parts")
    args = p.parse_args(argv)
    rows = read_rows(args.results)
    if not rows:
        p.error("no rows that ran in " + ", ".join(args.results))
    text = table(rows)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.scaling or args.breakdown:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("plot_dp.py: matplotlib is missing; table only", file=sys.stderr)
            return 0
        if args.scaling:
            plot_scaling(rows, args.scaling, plt)
        if args.breakdown:
            plot_breakdown(rows, args.breakdown, plt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
