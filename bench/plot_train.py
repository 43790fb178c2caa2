#!/usr/bin/env python3
"""plot_train.py — loss curves of flare's trainer and the PyTorch reference, as a PNG, and how far
apart they are.

Each LOG is a training log, read leniently so flare-train's and train_torch.py's both work:
  - a JSON document with a list of per-step entries under "steps" (train_torch.py --log), "log"
    or "rows", or a bare list; or
  - JSON Lines, one object per line (a line without "step"/"loss", a header, is kept as metadata).
An entry has "step" and "loss" (or "train_loss"); "val_loss" where a validation pass ran. The
label is --label, else the log's "impl", else the file name.

Agreement (printed, and written with --json): for each log after the first, the largest distance
between its trailing mean over --window steps and the first log's, over the steps both have, and
the distance of the last --window steps' means; besides, the largest relative difference of the
raw losses, |b - a| / |a|, over the last --last common steps, and the validation losses' difference
at the last step both evaluated. With --noise A B (two more logs, e.g. the torch
run in bf16 and in fp32, or two seeds of data order held fixed), the bound is
    --factor · (the same distance between A and B) + --floor
fixed in advance, as gpt_loss.py does; the exit status is 1 when a curve is farther than that.

    python3 bench/plot_train.py flare.jsonl torch.json \\
        --out bench/results/<date>-<card>-<commit>/train_loss-gpt2.png
    python3 bench/plot_train.py flare.jsonl torch-bf16.json --noise torch-bf16.json torch-fp32.json
"""

import argparse
import json
import os
import sys


def read_log(path):
    """(metadata dict, steps list of dicts sorted by step) of a flare or torch training log."""
    with open(path) as f:
        text = f.read()
    meta, entries = {}, None
    try:
        doc = json.loads(text)
        if isinstance(doc, list):
            entries = doc
        else:
            for key in ("steps", "log", "rows"):
                if isinstance(doc.get(key), list):
                    entries = doc[key]
                    meta = {k: v for k, v in doc.items() if k != key}
                    break
            if entries is None:
                raise ValueError(f"{path}: a JSON object without a 'steps', 'log' or 'rows' list")
    except json.JSONDecodeError:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})")
            if "step" in obj and ("loss" in obj or "train_loss" in obj or "val_loss" in obj):
                entries.append(obj)
            else:
                meta.update(obj)
    steps = []
    for e in entries:
        if "step" not in e:
            continue
        s = {"step": int(e["step"])}
        if "loss" in e or "train_loss" in e:
            s["loss"] = float(e.get("loss", e.get("train_loss")))
        if e.get("val_loss") is not None:
            s["val_loss"] = float(e["val_loss"])
        steps.append(s)
    if not any("loss" in s for s in steps):
        raise ValueError(f"{path}: no entry with a 'step' and a 'loss'")
    steps.sort(key=lambda s: s["step"])
    return meta, steps


def trailing_mean(curve, window):
    """{step: mean of the losses of the last `window` logged steps up to it}."""
    items = sorted(curve.items())
    out = {}
    for i, (step, _) in enumerate(items):
        chunk = [v for _, v in items[max(0, i - window + 1):i + 1]]
        out[step] = sum(chunk) / len(chunk)
    return out


def distance(a_steps, b_steps, window):
    """(max over common steps of |smooth(a) - smooth(b)|, |mean of last window of each|, steps)."""
    a = {s["step"]: s["loss"] for s in a_steps if "loss" in s}
    b = {s["step"]: s["loss"] for s in b_steps if "loss" in s}
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the logs share no step")
    a = {k: a[k] for k in common}
    b = {k: b[k] for k in common}
    sa, sb = trailing_mean(a, window), trailing_mean(b, window)
    curve = max(abs(sa[k] - sb[k]) for k in common)
    final = abs(sa[common[-1]] - sb[common[-1]])
    return curve, final, len(common)


def recent_differences(a_steps, b_steps, last):
    """(max |b - a| / |a| of the raw losses over the last `last` common steps, and the validation
    losses (step, a, b) at the last step where both evaluated, or None)."""
    a = {s["step"]: s["loss"] for s in a_steps if "loss" in s}
    b = {s["step"]: s["loss"] for s in b_steps if "loss" in s}
    common = sorted(set(a) & set(b))[-last:]
    rel = max(abs(b[k] - a[k]) / abs(a[k]) for k in common)
    va = {s["step"]: s["val_loss"] for s in a_steps if "val_loss" in s}
    vb = {s["step"]: s["val_loss"] for s in b_steps if "val_loss" in s}
    both = sorted(set(va) & set(vb))
    return rel, ((both[-1], va[both[-1]], vb[both[-1]]) if both else None)


def label_of(meta, path, given):
    return given or meta.get("impl") or os.path.splitext(os.path.basename(path))[0]


def plot(logs, labels, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (meta, steps), label in zip(logs, labels):
        xs = [s["step"] for s in steps if "loss" in s]
        ys = [s["loss"] for s in steps if "loss" in s]
        line, = axes[0].plot(xs, ys, label=f"{label} (train)", linewidth=1)
        vx = [s["step"] for s in steps if "val_loss" in s]
        if vx:
            axes[0].plot(vx, [s["val_loss"] for s in steps if "val_loss" in s], "o--",
                         color=line.get_color(), label=f"{label} (val)", markersize=3)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss (nats)")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[0].set_title(title)
    base = {s["step"]: s["loss"] for s in logs[0][1] if "loss" in s}
    for (meta, steps), label in zip(logs[1:], labels[1:]):
        xs = [s["step"] for s in steps if "loss" in s and s["step"] in base]
        axes[1].plot(xs, [next(t["loss"] for t in steps if t["step"] == x) - base[x] for x in xs],
                     label=f"{label} - {labels[0]}", linewidth=1)
    axes[1].axhline(0, color="gray", linewidth=0.5)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("loss difference (nats)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="training logs; the first is the reference curve")
    p.add_argument("--label", action="append", help="a label per log, in order")
    p.add_argument("--out", help="PNG to write (needs matplotlib)")
    p.add_argument("--title", default="loss: flare vs PyTorch")
    p.add_argument("--window", type=int, default=10, help="steps in the trailing mean")
    p.add_argument("--noise", nargs=2, metavar=("A", "B"),
                   help="two logs whose distance is the noise the bound is built from")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--floor", type=float, default=0.02, help="nats")
    p.add_argument("--last", type=int, default=20,
                   help="steps at the end over which the relative difference is taken")
    p.add_argument("--json", help="write the distances and the curves as JSON here")
    args = p.parse_args(argv)
    if args.label and len(args.label) != len(args.logs):
        p.error(f"--label: {len(args.label)} labels for {len(args.logs)} logs")
    if args.window < 1:
        p.error(f"--window: {args.window} must be >= 1")
    if args.last < 1:
        p.error(f"--last: {args.last} must be >= 1")

    logs = [read_log(path) for path in args.logs]
    labels = [label_of(m, path, args.label[i] if args.label else None)
              for i, ((m, _), path) in enumerate(zip(logs, args.logs))]
    bound = None
    report = {"window": args.window, "last": args.last, "factor": args.factor,
              "floor": args.floor, "pairs": []}
    if args.noise:
        noise_curve, noise_final, _ = distance(read_log(args.noise[0])[1],
                                               read_log(args.noise[1])[1], args.window)
        bound = {"curve": args.factor * noise_curve + args.floor,
                 "final": args.factor * noise_final + args.floor}
        report.update(noise_curve=noise_curve, noise_final=noise_final, bound=bound)
        print(f"noise ({args.noise[0]} vs {args.noise[1]}): curve {noise_curve:.4f}, final "
              f"{noise_final:.4f}; bound {args.factor} x noise + {args.floor}")
    failed = False
    for (meta, steps), label in zip(logs[1:], labels[1:]):
        curve, final, n = distance(logs[0][1], steps, args.window)
        rel, val = recent_differences(logs[0][1], steps, args.last)
        ok = bound is None or (curve <= bound["curve"] and final <= bound["final"])
        failed |= not ok
        pair = {"a": labels[0], "b": label, "steps": n, "curve": curve, "final": final,
                "max_rel_diff_last": rel, "pass": ok if bound else None}
        if val:
            pair["val"] = {"step": val[0], "a": val[1], "b": val[2], "diff": val[2] - val[1]}
        report["pairs"].append(pair)
        verdict = "" if bound is None else (
            f"  (bound {bound['curve']:.4f} / {bound['final']:.4f}: {'ok' if ok else 'FAIL'})")
        val_text = f", val at step {val[0]} {val[1]:.4f} vs {val[2]:.4f}" if val else ""
        print(f"{label} vs {labels[0]} over {n} steps: max smoothed distance {curve:.4f}, "
              f"final {final:.4f} nats, max relative difference over the last {args.last} steps "
              f"{rel:.2%}{val_text}{verdict}")
    if args.out:
        plot(logs, labels, args.out, args.title)
    if args.json:
        report["curves"] = {label: steps for (_, steps), label in zip(logs, labels)}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
