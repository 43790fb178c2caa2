#!/usr/bin/env python3
"""compare.py — flare against PyTorch's attention backends, in one process on one card.

Implementations (all on the same bf16 tensors, (batch, seqlen, heads, head_dim) in memory):
    flare            flare.flash_attn_func (torch custom op; backward through flare's kernels)
    torch-flash      F.scaled_dot_product_attention, FLASH_ATTENTION backend (FlashAttention-2)
    torch-cudnn      ... CUDNN_ATTENTION backend
    torch-efficient  ... EFFICIENT_ATTENTION backend (memory-efficient, xformers-style)
    torch-math       ... MATH backend: standard attention, materialises the score matrix
SDPA gets the (batch, heads, seqlen, head_dim) view of the same storage (transpose, no copy), as
the flash_attn benchmarks do. torch-math runs only where --math-max-seqlen allows; its purpose
is the memory chart.

Grid and method: docs/architecture.md, "Performance method". The standard grid: 16k tokens per
batch, (b, s) in {(32,512), (16,1k), (8,2k), (4,4k), (2,8k), (1,16k)}, hidden 2048 (heads = 2048 /
head_dim), head_dim 64, 128, 256, causal and not, bf16; passes fwd, bwd and fwdbwd.

FLOPs as FlashAttention counts them: forward 4·b·s_q·s_k·h·d, halved for causal; backward 2.5×
forward; fwdbwd 3.5×. Each case is timed with CUDA events after warm-up: --iters runs queued
back to back, an event between each, and the median interval reported.
Peak memory is torch.cuda.max_memory_allocated() during one extra run of the pass, less what
was allocated before it (the inputs). A case an implementation cannot run (unsupported shape,
out of memory) becomes a row with "error" and no time.

Output: one standard line per case on stdout, a JSON file in --out in the result schema
(docs/architecture.md, "Result files"), and PNG charts next to it (TFLOP/s by seqlen, one panel
per head_dim × causal, one figure per pass, like the FlashAttention-2 paper's figures; peak
memory by seqlen, flare against standard attention). --plot-only FILE.json redraws the charts
of an earlier run without a GPU.

Runs offline: nothing is downloaded.

    PYTHONPATH=build/python python3 bench/compare.py --out bench/results/<date>-<card>-<commit>
    python3 bench/compare.py --plot-only bench/results/<date>-<card>-<commit>/compare-....json
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys

from bench_common import (git_commit, import_torch_and_flare, pass_step, queued_times_ms,
                          result_path)

IMPLS = ["flare", "torch-flash", "torch-cudnn", "torch-efficient", "torch-math"]
PASSES = ["fwd", "bwd", "fwdbwd"]
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
STANDARD_BATCH_SEQLENS = [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
COLORS = {"flare": "#d62728", "torch-flash": "#1f77b4", "torch-cudnn": "#2ca02c",
          "torch-efficient": "#ff7f0e", "torch-math": "#7f7f7f"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark flare against PyTorch SDPA backends on the standard grid.")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"),
                   help="directory for the JSON result and the PNG charts (default: %(default)s)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated subset of: " + ", ".join(IMPLS))
    p.add_argument("--passes", default=",".join(PASSES), help="comma-separated subset of: "
                   + ", ".join(PASSES))
    p.add_argument("--head-dims", default="64,128,256", help="comma-separated head dims")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--tokens", type=int, default=16384, help="batch × seqlen (default 16k)")
    p.add_argument("--hidden", type=int, default=2048, help="heads × head_dim (default 2048)")
    p.add_argument("--seqlens", default=",".join(str(s) for _, s in STANDARD_BATCH_SEQLENS),
                   help="comma-separated sequence lengths; batch = tokens / seqlen")
    p.add_argument("--heads-kv", type=int, default=0,
                   help="kv heads for GQA (0: same as query heads); SDPA gets enable_gqa")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per case")
    p.add_argument("--iters", type=int, default=20, help="timed runs per case (median)")
    p.add_argument("--math-max-seqlen", type=int, default=16384,
                   help="largest seqlen for torch-math (its memory is quadratic)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--name", default="", help="suffix for the output file name")
    p.add_argument("--no-plot", action="store_true", help="write JSON only")
    p.add_argument("--plot-only", metavar="JSON", help="draw the charts of an existing result")
    args = p.parse_args(argv)

    def csv(s, kind=str):
        return [kind(x) for x in s.split(",") if x.strip()]

    args.impls = csv(args.impls)
    args.passes = csv(args.passes)
    args.head_dims = csv(args.head_dims, int)
    args.seqlens = csv(args.seqlens, int)
    for impl in args.impls:
        if impl not in IMPLS:
            p.error(f"--impls: unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    for ps in args.passes:
        if ps not in PASSES:
            p.error(f"--passes: unknown pass {ps!r}; choose from {', '.join(PASSES)}")
    for d in args.head_dims:
        if d <= 0 or args.hidden % d:
            p.error(f"--head-dims: {d} must divide --hidden {args.hidden}")
    for s in args.seqlens:
        if s <= 0 or args.tokens % s:
            p.error(f"--seqlens: {s} must divide --tokens {args.tokens}")
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


def flops(b, s_q, s_k, h, d, causal, pass_):
    f = 4.0 * b * s_q * s_k * h * d
    if causal:
        f /= 2
    return f * FLOP_FACTOR[pass_]


# ---- running -----------------------------------------------------------------------------------

def _cudnn_version(torch):
    try:
        return torch.backends.cudnn.version()
    except RuntimeError as e:  # a cuDNN on the library path that torch refuses
        return f"unavailable: {str(e).splitlines()[0][:120]}"


def make_impl(name, torch, flare, heads_kv_differ):
    """A function (q, k, v, causal) → out on (b, s, h, d) tensors."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "flare":
        return lambda q, k, v, causal: flare.flash_attn_func(q, k, v, causal=causal)
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION,
               "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
               "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "torch-math": SDPBackend.MATH}[name]
    extra = {"enable_gqa": True} if heads_kv_differ else {}

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=causal, **extra)
        return o.transpose(1, 2)
    return run


def time_pass(torch, fn, q, k, v, dout, causal, pass_, warmup, iters):
    """Median milliseconds of one pass and its peak memory above the pre-call allocation."""
    step = pass_step(torch, lambda: fn(q, k, v, causal), q, k, v, dout, pass_)
    times = queued_times_ms(torch, step, warmup, iters)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def measure(torch, fn, q, k, v, dout, causal, pass_, warmup, iters):
    """The timed fields of one row (ms, tflops, peak_mem_bytes) and the tail of its printed line;
    where the implementation cannot run the case, those fields are null and "error" says why."""
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    message = None
    try:
        ms, peak = time_pass(torch, fn, q, k, v, dout, causal, pass_, warmup, iters)
    except (RuntimeError, NotImplementedError) as e:
        # SDPA raises RuntimeError when a backend refuses a case; OOM is
        # torch.cuda.OutOfMemoryError, also a RuntimeError.
        message = str(e).strip().splitlines()[0][:300] if str(e) else repr(e)
    if message is None:
        tflops = round(flops(b, s_q, s_k, h, d, causal, pass_) / (ms * 1e-3) / 1e12, 2)
        return (dict(ms=round(ms, 5), tflops=tflops, peak_mem_bytes=int(peak)),
                f"{ms:9.3f} ms {tflops:7.1f} TFLOP/s peak {peak / 2**20:9.1f} MiB")
    # Only here, outside the except block: the exception's traceback holds time_pass's frame and
    # its tensors until the block ends, so emptying the cache inside it could not return that
    # memory, and the next case would start with less.
    torch.cuda.empty_cache()
    return dict(ms=None, tflops=None, peak_mem_bytes=None, error=message), f"skipped: {message}"


def run_benchmark(args):
    torch, flare = import_torch_and_flare("compare.py", args.device)
    device = torch.device("cuda", args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    card = torch.cuda.get_device_name(device)
    result = {
        "card": card,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "software": {
            "flare": flare.__version__,
            "flare_cuda_built": flare.cuda_built(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": _cudnn_version(torch),
            "python": platform.python_version(),
        },
        "benchmark": "bench/compare.py",
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")},
        "rows": [],
    }
    print(f"# {card}, torch {torch.__version__}, flare {flare.__version__}, {args.dtype}, "
          f"{args.tokens} tokens, hidden {args.hidden}")

    for d in args.head_dims:
        h = args.hidden // d
        h_kv = args.heads_kv or h
        impls = {name: make_impl(name, torch, flare, h_kv != h) for name in args.impls}
        for causal in args.causals:
            for s in args.seqlens:
                b = args.tokens // s
                gen = torch.Generator(device=device).manual_seed(0)
                q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen)
                k = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
                v = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
                dout = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen)
                for t in (q, k, v):
                    t.requires_grad_()
                for name, fn in impls.items():
                    if name == "torch-math" and s > args.math_max_seqlen:
                        continue
                    for pass_ in args.passes:
                        row = dict(impl=name, **{"pass": pass_}, dtype=args.dtype, b=b, s_q=s,
                                   s_k=s, h=h, h_kv=h_kv, d=d, causal=causal)
                        fields, line = measure(torch, fn, q, k, v, dout, causal, pass_,
                                               args.warmup, args.iters)
                        row.update(fields)
                        result["rows"].append(row)
                        print(f"{name:16s} {pass_:6s} b={b:<3d} s={s:<6d} h={h:<3d} "
                              f"h_kv={h_kv:<3d} d={d:<4d} causal={int(causal)}  {line}",
                              flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()
    return result


# ---- writing and plotting ----------------------------------------------------------------------

def _rows(result, **match):
    return [r for r in result["rows"] if all(r.get(k) == v for k, v in match.items())]


def plot(result, json_path):
    """TFLOP/s charts (one PNG per pass) and a peak-memory chart; returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = os.path.splitext(json_path)[0]
    rows = result["rows"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    head_dims = sorted({r["d"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    seqlens = sorted({r["s_q"] for r in rows})
    card = result.get("card", "")
    written = []

    for pass_ in [p for p in PASSES if any(r["pass"] == p for r in rows)]:
        timed = [i for i in impls if i != "torch-math"] or impls
        fig, axes = plt.subplots(len(head_dims), len(causals), squeeze=False,
                                 figsize=(6.5 * len(causals), 3.6 * len(head_dims)))
        width = 0.8 / max(1, len(timed))
        for r_i, d in enumerate(head_dims):
            for c_i, causal in enumerate(causals):
                ax = axes[r_i][c_i]
                top = 0.0
                for i_i, impl in enumerate(timed):
                    by_s = {r["s_q"]: r for r in _rows(result, impl=impl, d=d, causal=causal,
                                                       **{"pass": pass_})}
                    xs = [x + (i_i - (len(timed) - 1) / 2) * width
                          for x in range(len(seqlens))]
                    ys = [by_s[s]["tflops"] if s in by_s and by_s[s].get("tflops") else 0.0
                          for s in seqlens]
                    bars = ax.bar(xs, ys, width, label=impl, color=COLORS.get(impl))
                    for bar, y in zip(bars, ys):
                        if y > 0:
                            ax.annotate(f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y),
                                        ha="center", va="bottom", fontsize=6)
                    top = max([top] + ys)
                ax.set_xticks(range(len(seqlens)))
                ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
                ax.set_ylim(0, top * 1.15 if top > 0 else 1)
                ax.set_xlabel("sequence length")
                ax.set_ylabel("TFLOP/s")
                ax.set_title(f"{pass_}, head dim {d}, {'causal' if causal else 'non-causal'}",
                             fontsize=10)
                ax.grid(axis="y", alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.suptitle(f"Attention {pass_} speed ({card}, {rows[0].get('dtype', '')})",
                     y=0.998)
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False,
                   bbox_to_anchor=(0.5, 0.975))
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        path = f"{base}-{pass_}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    # Peak memory against sequence length: flare against standard attention (and the peers).
    mem_pass = next((p for p in ("fwdbwd", "fwd", "bwd") if any(
        r["pass"] == p and r.get("peak_mem_bytes") for r in rows)), None)
    if mem_pass is not None:
        fig, axes = plt.subplots(1, len(head_dims), squeeze=False,
                                 figsize=(5.5 * len(head_dims), 4))
        causal = False if False in causals else causals[0]
        for c_i, d in enumerate(head_dims):
            ax = axes[0][c_i]
            for impl in impls:
                pts = sorted((r["s_q"], r["peak_mem_bytes"]) for r in _rows(
                    result, impl=impl, d=d, causal=causal, **{"pass": mem_pass})
                    if r.get("peak_mem_bytes"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], marker="o",
                            label="standard attention (torch-math)" if impl == "torch-math"
                            else impl, color=COLORS.get(impl),
                            linewidth=2.5 if impl in ("flare", "torch-math") else 1.2,
                            zorder=3 if impl == "flare" else 2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(seqlens)
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_xlabel("sequence length (batch × seqlen fixed)")
            ax.set_ylabel("peak memory above inputs (MiB)")
            ax.set_title(f"{mem_pass}, head dim {d}, {'causal' if causal else 'non-causal'}",
                         fontsize=10)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.suptitle(f"Attention peak memory ({card})")
        fig.tight_layout()
        path = f"{base}-memory.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def summarize(result):
    """flare's speed as a ratio to each peer, per pass (geometric mean over the grid)."""
    lines = []
    for pass_ in PASSES:
        flare_rows = {(r["d"], r["causal"], r["s_q"]): r for r in _rows(result, impl="flare")
                      if r["pass"] == pass_ and r.get("ms")}
        for peer in IMPLS[1:]:
            ratios = [r["ms"] / flare_rows[(r["d"], r["causal"], r["s_q"])]["ms"]
                      for r in _rows(result, impl=peer) if r["pass"] == pass_ and r.get("ms")
                      and (r["d"], r["causal"], r["s_q"]) in flare_rows]
            if ratios:
                gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                lines.append(f"# {pass_:6s} flare vs {peer:15s}: {gm:.2f}x speed "
                             f"(geometric mean over {len(ratios)} cases)")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            result = json.load(f)
        out_json = args.plot_only
        if args.out and os.path.abspath(os.path.dirname(args.plot_only)) != os.path.abspath(
                args.out):
            os.makedirs(args.out, exist_ok=True)
            out_json = os.path.join(args.out, os.path.basename(args.plot_only))
        for path in plot(result, out_json):
            print(f"wrote {path}")
        return 0
    result = run_benchmark(args)
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "compare", result, args.name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    for line in summarize(result):
        print(line)
    print(f"wrote {path}")
    if not args.no_plot:
        try:
            for png in plot(result, path):
                print(f"wrote {png}")
        except ImportError:
            print("matplotlib is not installed: no charts (rerun with --plot-only later)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
