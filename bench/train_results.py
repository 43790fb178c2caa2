#!/usr/bin/env python3
"""train_results.py — one result file of the training benchmark: flare-train's runs and
bench/train_torch.py's rows from the same card in the same call, in the issue's schema.

    python3 bench/train_results.py --out DIR --card "NVIDIA H100 80GB HBM3" \\
        --flare gpt2:16:1024:DIR/tp_flare_gpt2.log:DIR/tp_flare_gpt2.jsonl \\
        --torch DIR/torch_gpt2/train_torch-*.json \\
        --missing torch-compile:gpt3-2.7b:8:1024:"timed out after 240 s"

Writes DIR/train-<card>-<date>.json:
  {"card", "date", "commit", "software", "rows": [{"impl": "flare-train" | "torch-compile",
   "model", "gpus", "seq", "batch_per_gpu", "tokens_per_s", "mfu", "peak_mem_bytes", "step_ms",
   ...}], "comparison": [{"model", "seq", "batch_per_gpu", "tokens_per_s_ratio", ...}]}
and prints one line per row and per comparison.

flare-train rows are taken from the program's own summary line ("throughput: median of steps
A-B: X ms/step, Y tokens/s, MFU Z%, ...", print_throughput in apps/train/main.cpp), so the
steady-state rule lives in one place; peak_mem_bytes is the largest "memory_bytes" of its --log
(device memory in use: total - free, the CUDA context included). A run without that line (refused
before allocating, killed by a timeout) becomes a row with "error": the program's own message
(its last "flare-train: ..." line) or the reason. torch rows are train_torch.py's rows as written
(peak_mem_bytes there is torch.cuda.max_memory_allocated); --missing adds an error row for a run
that wrote no JSON. Each row says which memory it counts ("peak_mem_kind").
"""

import argparse
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import git_commit, result_path  # noqa: E402

THROUGHPUT = re.compile(r"^throughput: median of steps (\d+)-(\d+): ([0-9.]+) ms/step, ([0-9.]+) "
                        r"tokens/s(?:, MFU ([0-9.]+)%)?")
FLARE_MEM_KIND = "device memory in use (total - free, CUDA context included)"
TORCH_MEM_KIND = "torch.cuda.max_memory_allocated"


def split_spec(text, fields, flag):
    """'a:b:c:...' into len(fields) parts; the last part keeps any further colons."""
    parts = text.split(":", len(fields) - 1)
    if len(parts) != len(fields):
        raise argparse.ArgumentTypeError(f"{flag} '{text}': must be {':'.join(fields)}")
    return parts


def case_key(model, batch, seq):
    return model, int(batch), int(seq)


def flare_row(model, batch, seq, stdout_path, jsonl_path):
    """The issue's row for one flare-train run, from its output and its JSON log."""
    row = {"impl": "flare-train", "model": model, "gpus": 1, "seq": int(seq),
           "batch_per_gpu": int(batch)}
    text = open(stdout_path, errors="replace").read() if os.path.exists(stdout_path) else ""
    summary = next((m for m in map(THROUGHPUT.match, text.splitlines()) if m), None)
    if summary is None:
        # The program's own last word, or train-check.sh's when it did not start the run.
        messages = [line.removeprefix("flare-train:").strip() for line in text.splitlines()
                    if line.startswith(("flare-train:", "not started:"))]
        row["error"] = (messages[-1] if messages else
                        f"no throughput line in {os.path.basename(stdout_path)} (killed or timed out)")
        return row
    first, last, step_ms, tokens_per_s, mfu = summary.groups()
    peak = 0
    if os.path.exists(jsonl_path):
        for line in open(jsonl_path):
            if line.strip():
                peak = max(peak, int(json.loads(line).get("memory_bytes", 0)))
    row.update({"tokens_per_s": float(tokens_per_s), "mfu": float(mfu) / 100 if mfu else None,
                "peak_mem_bytes": peak or None, "step_ms": float(step_ms),
                "peak_mem_kind": FLARE_MEM_KIND, "steps": f"median of steps {first}-{last}"})
    return row


def torch_rows(paths):
    """(rows, card, software) of train_torch.py result files."""
    rows, cards, software = [], set(), {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        cards.add(doc.get("card"))
        software.update(doc.get("software", {}))
        for row in doc.get("rows", []):
            if "error" not in row:
                row.setdefault("peak_mem_kind", TORCH_MEM_KIND)
            rows.append(row)
    return rows, cards, software


def comparison(rows):
    """flare-train over torch-compile for each (model, seq, batch) where both ran."""
    ok = {(r["impl"], r["model"], r["seq"], r["batch_per_gpu"]): r for r in rows if "error" not in r}
    out = []
    for (impl, model, seq, batch), f in ok.items():
        t = ok.get(("torch-compile", model, seq, batch))
        if impl != "flare-train" or t is None:
            continue
        entry = {"model": model, "seq": seq, "batch_per_gpu": batch,
                 "tokens_per_s_ratio": f["tokens_per_s"] / t["tokens_per_s"]}
        if f.get("peak_mem_bytes") and t.get("peak_mem_bytes"):
            entry["peak_mem_ratio"] = f["peak_mem_bytes"] / t["peak_mem_bytes"]
        out.append(entry)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for train-<card>-<date>.json")
    p.add_argument("--flare", action="append", default=[],
                   help="MODEL:BATCH:SEQ:STDOUT:JSONL of one flare-train run (repeatable)")
    p.add_argument("--torch", action="append", default=[], help="train_torch.py result JSON (repeatable)")
    p.add_argument("--missing", action="append", default=[],
                   help="IMPL:MODEL:BATCH:SEQ:REASON, a run that left no result (repeatable)")
    p.add_argument("--card", help="the card's name (default: the torch results'; required without them)")
    p.add_argument("--software", action="append", default=[], help="KEY=VALUE to record (repeatable)")
    p.add_argument("--note", help="free text recorded as 'benchmark'")
    args = p.parse_args(argv)

    rows = []
    for spec in args.flare:
        model, batch, seq, stdout_path, jsonl_path = split_spec(
            spec, ["MODEL", "BATCH", "SEQ", "STDOUT", "JSONL"], "--flare")
        rows.append(flare_row(model, batch, seq, stdout_path, jsonl_path))
    t_rows, cards, software = torch_rows(args.torch)
    rows += t_rows
    for spec in args.missing:
        impl, model, batch, seq, reason = split_spec(
            spec, ["IMPL", "MODEL", "BATCH", "SEQ", "REASON"], "--missing")
        rows.append({"impl": impl, "model": model, "gpus": 1, "seq": int(seq),
                     "batch_per_gpu": int(batch), "error": reason})
    cards.discard(None)
    if args.card:
        cards.add(args.card)
    if len(cards) != 1:
        p.error(f"--card: the results name {len(cards)} cards ({sorted(cards)}); "
                "one card per file (give --card when no torch result is there)")
    for kv in args.software:
        key, _, value = kv.partition("=")
        if not key or not _:
            p.error(f"--software '{kv}': must be KEY=VALUE")
        software[key] = value
    result = {"card": cards.pop(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "software": software}
    if args.note:
        result["benchmark"] = args.note
    result["rows"] = rows
    result["comparison"] = comparison(rows)

    for r in rows:
        what = f"{r['impl']:14s} {r['model']:12s} b{r['batch_per_gpu']:<3d} s{r['seq']:<5d}"
        if "error" in r:
            print(f"{what} error: {r['error']}")
        else:
            mfu = f"MFU {100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "MFU    -"
            mem = (f"{r['peak_mem_bytes'] / 2**30:6.2f} GiB" if r.get("peak_mem_bytes")
                   else "     - GiB")
            print(f"{what} {r['tokens_per_s']:12,.0f} tokens/s {r['step_ms']:9.2f} ms  {mfu}  {mem}")
    for c in result["comparison"]:
        mem = f", memory x{c['peak_mem_ratio']:.2f}" if "peak_mem_ratio" in c else ""
        print(f"flare-train / torch-compile {c['model']} b{c['batch_per_gpu']} s{c['seq']}: "
              f"tokens/s x{c['tokens_per_s_ratio']:.3f}{mem}")
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "train", result, None)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
