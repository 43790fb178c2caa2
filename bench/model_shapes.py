#!/usr/bin/env python3
"""model_shapes.py — flare against SDPA's cuDNN and flash backends on the attention shapes of the
models people train, in one process on one card, on the same tensors.

The standard grid (bench/compare.py) sweeps head_dim at a fixed hidden size; this grid takes the
(heads, kv heads, head_dim) of real models instead: GPT-2 small to XL (12, 16, 20 and 25 heads of
64), GPT-3 2.7B (32 of 80), LLaMA-2 7B (32 of 128), LLaMA-3.2 1B and 3B and LLaMA-3 8B (GQA:
32/8 of 64, 24/8 of 128, 32/8 of 128), Phi-3-mini (32 of 96) and a layer of 16 heads of 192 (the
query/key width of DeepSeek-V2/V3's MLA attention; its values are 128 wide there, 192 here, as
both implementations take one head_dim). Sequence lengths are powers of two from 512 to 8k and
lengths that are not a multiple of any tile (1000, 3000), whose last tile is ragged. Every model
runs causal (they are decoders); the GPT-2 small, GPT-2 medium and LLaMA-2 7B shapes also run
non-causal (the encoder shapes of BERT/ViT base and large, and a 32x128 layer).

Batch rule: b = max(1, round(16384 / s)), so every case holds 16k tokens give or take half a
sequence (s 3000: b 5, 15000 tokens), as the standard grid does; the inputs stay larger than L2.

Implementations, named as in compare.py: flare (flare.flash_attn_func), torch-cudnn and
torch-flash (F.scaled_dot_product_attention restricted to one backend; enable_gqa=True where
h_kv < h). Passes fwd and bwd (the backward of one forward, its forward untimed); FLOPs, timing
(CUDA events between queued runs, median) and error rows are compare.py's. bf16.

Output: one line per case on stdout; DIR/model-shapes-<card>-<date>.json in the result schema
(docs/architecture.md, "Result files"; rows add "model"); and a table, printed and written beside
it as .txt: per (model, s, causal, pass) the TFLOP/s of flare, cuDNN and flash and flare's ratio
to each (> 1: flare is faster), then per pass the median and minimum ratio and the cells below
1.10x cuDNN, the bar the Hopper kernels aim for. --table-only FILE.json redraws the table of an
earlier run without a GPU.

    PYTHONPATH=build-py/python python3 bench/model_shapes.py \\
        --out bench/results/<date>-<card>-<commit>
    PYTHONPATH=build-py/python python3 bench/model_shapes.py --quick --models gpt2,llama3-8b
    python3 bench/model_shapes.py --table-only \\
        bench/results/<date>-<card>-<commit>/model-shapes-....json
"""

import argparse
import collections
import json
import os
import statistics
import sys

from bench_common import import_torch_and_flare, result_header, result_path
from compare import IMPLS, _cudnn_version, make_impl, measure

TOKENS = 16384
BATCH_RULE = f"b = max(1, round({TOKENS} / s))"
BAR = 1.10  # flare / cuDNN below this is listed

Model = collections.namedtuple("Model", "name h h_kv d seqlens causals")
BOTH = (True, False)
CAUSAL = (True,)
# The shapes. seqlens ascending: --quick takes each model's first (shortest) with its first mask.
MODELS = [
    Model("gpt2",        12, 12,  64, (512, 1000, 1024, 2048), BOTH),
    Model("gpt2-medium", 16, 16,  64, (512, 1024, 2048), BOTH),
    Model("gpt2-large",  20, 20,  64, (1000, 1024, 2048), CAUSAL),
    Model("gpt2-xl",     25, 25,  64, (1024, 2048, 3000), CAUSAL),
    Model("gpt3-2.7b",   32, 32,  80, (1024, 2048), CAUSAL),
    Model("llama2-7b",   32, 32, 128, (512, 1000, 1024, 2048, 3000, 4096, 8192), BOTH),
    Model("llama3.2-1b", 32,  8,  64, (1024, 2048, 3000, 4096, 8192), CAUSAL),
    Model("llama3.2-3b", 24,  8, 128, (1000, 2048, 4096, 8192), CAUSAL),
    Model("llama3-8b",   32,  8, 128, (512, 1024, 2048, 3000, 4096, 8192), CAUSAL),
    Model("phi3-mini",   32, 32,  96, (1000, 2048, 4096), CAUSAL),
    Model("d192-h16",    16, 16, 192, (1024, 2048, 3000, 4096), CAUSAL),
]
MODEL_NAMES = [m.name for m in MODELS]

# The peers of the bar; flare first (its row anchors each table line).
SHAPE_IMPLS = ["flare", "torch-cudnn", "torch-flash"]
assert set(SHAPE_IMPLS) <= set(IMPLS)
PASSES = ["fwd", "bwd"]


def batch_for(s):
    """The batch of a case of sequence length s: about TOKENS tokens in all."""
    return max(1, round(TOKENS / s))


def cases(models, quick=False):
    """(model, s, causal) in run order; quick keeps one per model."""
    for m in models:
        if quick:
            yield m, m.seqlens[0], m.causals[0]
            continue
        for s in m.seqlens:
            for causal in m.causals:
                yield m, s, causal


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark flare against SDPA cuDNN and flash on model attention shapes.")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"),
                   help="directory for the JSON result and its .txt table (default: %(default)s)")
    p.add_argument("--models", default=",".join(MODEL_NAMES),
                   help="comma-separated subset of: " + ", ".join(MODEL_NAMES))
    p.add_argument("--passes", default=",".join(PASSES),
                   help="comma-separated subset of: " + ", ".join(PASSES))
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per case")
    p.add_argument("--iters", type=int, default=20, help="timed runs per case (median)")
    p.add_argument("--quick", action="store_true",
                   help="one case per model (its shortest sequence): a smoke run")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--table-only", metavar="JSON", help="print the table of an existing result")
    args = p.parse_args(argv)

    args.models = [x.strip() for x in args.models.split(",") if x.strip()]
    args.passes = [x.strip() for x in args.passes.split(",") if x.strip()]
    for name in args.models:
        if name not in MODEL_NAMES:
            p.error(f"--models: unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")
    for pass_ in args.passes:
        if pass_ not in PASSES:
            p.error(f"--passes: unknown pass {pass_!r}; choose from {', '.join(PASSES)}")
    if not args.models or not args.passes:
        p.error("--models and --passes must each name at least one entry")
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    return args


# ---- running -----------------------------------------------------------------------------------

def run_benchmark(args):
    torch, flare = import_torch_and_flare("model_shapes.py", args.device)
    device = torch.device("cuda", args.device)
    result = result_header(torch, flare, "median of `iters` runs queued back to back after "
                           "`warmup`, CUDA events between runs (bench/compare.py's time_pass)")
    result["software"].update(cudnn=_cudnn_version(torch), flare_cuda_built=flare.cuda_built())
    result.update(benchmark="bench/model_shapes.py", tokens=TOKENS, batch_rule=BATCH_RULE,
                  args={k: v for k, v in vars(args).items() if k not in ("out", "table_only")},
                  rows=[])
    print(f"# {result['card']}, torch {torch.__version__}, flare {flare.__version__}, bf16, "
          f"{BATCH_RULE}", flush=True)

    models = [m for m in MODELS if m.name in args.models]
    by_shape = collections.defaultdict(list)  # tensors are made once per (model, s)
    for m, s, causal in cases(models, args.quick):
        by_shape[(m, s)].append(causal)
    for (m, s), causals in by_shape.items():
        b = batch_for(s)
        impls = {name: make_impl(name, torch, flare, m.h_kv != m.h) for name in SHAPE_IMPLS}
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, s, m.h, m.d, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, s, m.h_kv, m.d, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, s, m.h_kv, m.d, device=device, dtype=torch.bfloat16, generator=gen)
        dout = torch.randn(b, s, m.h, m.d, device=device, dtype=torch.bfloat16, generator=gen)
        for t in (q, k, v):
            t.requires_grad_()
        for causal in causals:
            for name, fn in impls.items():
                for pass_ in args.passes:
                    row = dict(impl=name, model=m.name, **{"pass": pass_}, dtype="bf16", b=b,
                               s_q=s, s_k=s, h=m.h, h_kv=m.h_kv, d=m.d, causal=causal)
                    fields, line = measure(torch, fn, q, k, v, dout, causal, pass_,
                                           args.warmup, args.iters)
                    row.update(fields)
                    result["rows"].append(row)
                    print(f"{name:12s} {pass_:4s} {m.name:12s} b={b:<3d} s={s:<5d} h={m.h:<3d} "
                          f"h_kv={m.h_kv:<3d} d={m.d:<4d} causal={int(causal)}  {line}",
                          flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return result


# ---- the table ---------------------------------------------------------------------------------

def _ratio(flare_row, peer_row):
    """flare's TFLOP/s over the peer's (> 1: flare is faster), or None where either did not run."""
    if flare_row and peer_row and flare_row.get("tflops") and peer_row.get("tflops"):
        return flare_row["tflops"] / peer_row["tflops"]
    return None


def _num(x, width, digits):
    return f"{x:{width}.{digits}f}" if x is not None else f"{'-':>{width}s}"


def table_lines(result):
    """The text table of a result: one line per (model, s, causal, pass), then per pass the
    ratios' median and minimum and the cells below BAR x cuDNN."""
    cells = {}  # (model, s, causal, pass) -> {impl: row}, in the order the run made them: a
    # case's fwd and bwd lines next to each other
    for r in (r for r in result["rows"] if r["pass"] in PASSES):
        cells.setdefault((r["model"], r["s_q"], r["causal"], r["pass"]), {})[r["impl"]] = r
    lines = [f"model shapes: {result.get('card', '?')}, {result.get('batch_rule', BATCH_RULE)}; "
             "TFLOP/s, ratio = flare / peer (> 1: flare is faster)",
             f"{'model':12s} {'h/kv':>6s} {'d':>4s} {'b':>3s} {'s':>5s} {'causal':>6s} "
             f"{'pass':4s} {'flare':>7s} {'cuDNN':>7s} {'flash':>7s} {'/cuDNN':>7s} "
             f"{'/flash':>7s}"]
    ratios = {p: {"torch-cudnn": [], "torch-flash": []} for p in PASSES}
    below = {p: [] for p in PASSES}
    flare_failed = {p: [] for p in PASSES}
    for (model, s, causal, pass_), by_impl in cells.items():
        any_row = next(iter(by_impl.values()))
        fl = by_impl.get("flare")
        tf = {i: by_impl[i].get("tflops") if i in by_impl else None for i in SHAPE_IMPLS}
        rat = {p: _ratio(fl, by_impl.get(p)) for p in ("torch-cudnn", "torch-flash")}
        where = f"{model} s={s} {'causal' if causal else 'non-causal'}"
        for p, x in rat.items():
            if x is not None:
                ratios[pass_][p].append(x)
        if rat["torch-cudnn"] is not None and rat["torch-cudnn"] < BAR:
            below[pass_].append(f"{where} {rat['torch-cudnn']:.2f}x")
        if fl is not None and fl.get("error"):
            flare_failed[pass_].append(f"{where}: {fl['error']}")
        lines.append(f"{model:12s} {any_row['h']:>3d}/{any_row['h_kv']:<2d} {any_row['d']:4d} "
                     f"{any_row['b']:3d} {s:5d} {int(causal):6d} {pass_:4s} "
                     f"{_num(tf['flare'], 7, 1)} {_num(tf['torch-cudnn'], 7, 1)} "
                     f"{_num(tf['torch-flash'], 7, 1)} {_num(rat['torch-cudnn'], 7, 2)} "
                     f"{_num(rat['torch-flash'], 7, 2)}")
    for pass_ in [p for p in PASSES if any(key[3] == p for key in cells)]:
        for peer, label in (("torch-cudnn", "cuDNN"), ("torch-flash", "flash")):
            xs = ratios[pass_][peer]
            if xs:
                lines.append(f"{pass_}: flare / {label}: median {statistics.median(xs):.2f}, "
                             f"min {min(xs):.2f} over {len(xs)} cells")
        lines.append(f"{pass_}: {len(below[pass_])} of {len(ratios[pass_]['torch-cudnn'])} cells "
                     f"below {BAR:.2f}x cuDNN" + (":" if below[pass_] else ""))
        lines.extend(f"  {cell}" for cell in below[pass_])
        if flare_failed[pass_]:
            lines.append(f"{pass_}: flare could not run {len(flare_failed[pass_])} cells:")
            lines.extend(f"  {cell}" for cell in flare_failed[pass_])
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.table_only:
        with open(args.table_only) as f:
            result = json.load(f)
        print("\n".join(table_lines(result)))
        return 0
    result = run_benchmark(args)
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "model-shapes", result, "")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    table = "\n".join(table_lines(result)) + "\n"
    txt = os.path.splitext(path)[0] + ".txt"
    with open(txt, "w") as f:
        f.write(table)
    print(table, end="")
    print(f"wrote {path}\nwrote {txt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
