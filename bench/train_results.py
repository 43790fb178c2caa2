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
that wrote no JSON. Each row says which memory it counts ("peak_mem_kind"); a comparison's memory
ratio uses the peer's device memory in use (device_in_use_bytes) where its row has it, the measure
flare-train's is, and says which it used ("peak_mem_ratio_basis").
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
RUN_RANKS = re.compile(r" x (\d+) GPUs = \d+ tokens/step")
RUN_ACCUM = re.compile(r" x accum (\d+) x ")
RUN_ZERO = re.compile(r"\bZeRO-(\d)\b")
RUN_GRADIENTS = re.compile(r", gradients (bf16|fp32),")
PROFILE_FIELDS = ("fwd_ms", "bwd_ms", "comm_ms", "comm_exposed_ms", "optimizer_ms", "comm_gbps",
                  "cp_comm_ms")
TORCH_IMPLS = ("torch-compile", "torch-ddp-compile", "torch-fsdp-compile")


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
    records = []
    if os.path.exists(jsonl_path):
        records = [json.loads(line) for line in open(jsonl_path) if line.strip()]
    peak = max((int(r.get("memory_bytes", 0)) for r in records), default=0)
    row.update({"tokens_per_s": float(tokens_per_s), "mfu": float(mfu) / 100 if mfu else None,
                "peak_mem_bytes": peak or None, "step_ms": float(step_ms),
                "peak_mem_kind": FLARE_MEM_KIND, "steps": f"median of steps {first}-{last}"})
    # Several GPUs: the rank count, and the step profile (CUDA events), each field's median over
    # the steps the throughput line took.
    timed = [r for r in records if "step" in r and int(first) <= r["step"] <= int(last)]
    ranks = RUN_RANKS.search(text)  # the run line: "... x accum A x N GPUs = T tokens/step"
    if ranks or (timed and "dp" in timed[-1]):
        cp = int(timed[-1].get("cp", 1)) if timed else 1
        row["gpus"] = int(ranks.group(1)) if ranks else int(timed[-1]["dp"]) * cp
        row["dp"], row["cp"] = row["gpus"] // cp, cp
        zero = RUN_ZERO.search(text)  # "data parallel: N ranks (...), ZeRO-S (...)"
        if zero:
            row["zero"] = int(zero.group(1))
    gradients = RUN_GRADIENTS.search(text)  # the run line: "..., gradients bf16, ..."
    if gradients:
        row["gradients"] = gradients.group(1)
    accum = RUN_ACCUM.search(text)
    if accum and int(accum.group(1)) > 1:
        row["grad_accum"] = int(accum.group(1))
    for field in PROFILE_FIELDS:
        values = sorted(r[field] for r in timed if field in r)
        if values:
            row[field] = values[len(values) // 2]
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
    """flare-train over each PyTorch peer for each (model, seq, batch, GPUs) where both ran, and
    flare-train's scaling: tokens/s on N GPUs over N times one GPU's."""
    ok = {(r["impl"], r["model"], r["seq"], r["batch_per_gpu"], r.get("gpus", 1)): r
          for r in rows if "error" not in r}
    out = []
    for (impl, model, seq, batch, gpus), f in ok.items():
        if impl != "flare-train":
            continue
        case = {"model": model, "seq": seq, "batch_per_gpu": batch, "gpus": gpus}
        for peer in TORCH_IMPLS:
            t = ok.get((peer, model, seq, batch, gpus))
            if t is None:
                continue
            entry = dict(case, peer=peer, tokens_per_s_ratio=f["tokens_per_s"] / t["tokens_per_s"])
            # Memory by one measure on both sides: flare-train's device memory in use against the
            # peer's (train_torch.py's device_in_use_bytes); rows from before it recorded that
            # compare against the peer's allocated peak, and say so.
            peer_mem, basis = t.get("device_in_use_bytes"), FLARE_MEM_KIND
            if not peer_mem:
                peer_mem, basis = t.get("peak_mem_bytes"), f"flare-train's {FLARE_MEM_KIND} / {TORCH_MEM_KIND}"
            if f.get("peak_mem_bytes") and peer_mem:
                entry["peak_mem_ratio"] = f["peak_mem_bytes"] / peer_mem
                entry["peak_mem_ratio_basis"] = basis
            out.append(entry)
        one = ok.get(("flare-train", model, seq, batch, 1))
        if gpus > 1 and one is not None:
            out.append(dict(case, scaling=f["tokens_per_s"] / (gpus * one["tokens_per_s"])))
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
        what = (f"{r['impl']:17s} {r['model']:12s} x{r.get('gpus', 1)} b{r['batch_per_gpu']:<3d} "
                f"s{r['seq']:<5d}")
        if "error" in r:
            print(f"{what} error: {r['error']}")
        else:
            mfu = f"MFU {100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "MFU    -"
            mem = (f"{r['peak_mem_bytes'] / 2**30:6.2f} GiB" if r.get("peak_mem_bytes")
                   else "     - GiB")
            print(f"{what} {r['tokens_per_s']:12,.0f} tokens/s {r['step_ms']:9.2f} ms  {mfu}  {mem}")
    for c in result["comparison"]:
        case = f"{c['model']} b{c['batch_per_gpu']} s{c['seq']} x{c['gpus']} GPU"
        if "scaling" in c:
            print(f"flare-train scaling {case}: {100 * c['scaling']:.1f}%")
            continue
        mem = ""
        if "peak_mem_ratio" in c:
            like = c["peak_mem_ratio_basis"] == FLARE_MEM_KIND
            mem = f", memory x{c['peak_mem_ratio']:.2f}" + ("" if like else " (against the peer's allocated peak)")
        print(f"flare-train / {c['peer']} {case}: tokens/s x{c['tokens_per_s_ratio']:.3f}{mem}")
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "train", result, None)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
