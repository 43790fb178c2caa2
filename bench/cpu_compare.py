#!/usr/bin/env python3
"""cpu_compare.py — flare's CPU attention against PyTorch's CPU flash attention, side by side: the
same process, the same tensors, the same thread count.

    python3 bench/cpu_compare.py --out bench/results/<date>-<card>-<commit> \\
        [--threads 2] [--tiny] [--chart]

Cells: b 1, h 8, s 512 … 8192, d 64 and 128, causal and not, fp32 (and bf16 where the CPU has
AVX-512 BF16 or AMX), forward and backward. flare runs through its PyTorch path
(flare.flash_attn_func on CPU tensors, backend "auto" = the CPU flash kernel); torch through
scaled_dot_product_attention held to its flash backend (torch.nn.attention.sdpa_kernel). Each
time is the median of --iters runs after --warmup; "bwd" repeats the backward of one forward
(retain_graph), as bench_common.pass_step does on the GPU. Peak memory is the process's resident
high-water mark over the cell's runs beyond what it held before them (Linux: VmHWM, reset through
/proc/self/clear_refs): it counts work buffers that make new memory resident, not those an
allocator serves from pages the process already holds (torch's often are: it then shows 0).

Beside them, the physical limit: the machine's fp32 FMA peak for the same threads, from a small
loop of independent FMAs compiled here (cc -O3 -march=native), and the fraction of it each row
reaches. Without a C compiler that row is left out.

Writes DIR/cpu_compare-<cpu>-<date>.json: {"card": the CPU model, "date", "commit", "software",
"threads", "fma_peak_gflops", "rows": [{"impl": "flare" | "torch-cpu", "pass", "dtype", "b",
"s_q", "s_k", "h", "h_kv", "d", "causal", "ms", "gflops", "threads", "peak_mem_bytes",
"fraction_of_peak"}], "ratios": [{cell…, "flare_over_torch"}]} and, with --chart, a PNG of the
ratios. --tiny runs two small cells with few iterations (CI keeps the script from rotting).
--decode runs decoding cells instead (forward only, one query row against a long K/V, with and
without GQA: the shapes of a KV-cache decode step; torch with enable_gqa), and times beside them
the decode step itself, flare.flash_attn_with_kvcache over the same K/V as a contiguous cache
("flare-kvcache") and as a paged one of 16-token pages in shuffled order ("flare-kvcache-paged").
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import git_commit, result_path  # noqa: E402

FMA_LOOP = r"""
#include <omp.h>
/* GFLOP/s of independent fp32 FMAs on `threads` threads: 12 vector accumulators per thread (in
   registers: 14 of AVX2's 16 with x and y) cover the FMA latency times two FMA ports; the widest
   vector the compiler targets, 2 flops per lane. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
double fma_gflops(int threads, long iters) {
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = omp_get_wtime();
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      vec x, y, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
      for (int i = 0; i < LANES; ++i) { x[i] = 1.0f + 1e-7f * i; y[i] = 1e-7f; }
      /* Distinct starting values: with equal ones GCC merges the twelve chains into one and the
         loop times one FMA chain's latency, not the peak (it reported 2.4x the real one). */
      a0 = y; a1 = a0 + y; a2 = a1 + y; a3 = a2 + y; a4 = a3 + y; a5 = a4 + y;
      a6 = a5 + y; a7 = a6 + y; a8 = a7 + y; a9 = a8 + y; a10 = a9 + y; a11 = a10 + y;
      for (long n = 0; n < iters; ++n) {
        a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y;
        a4 = a4 * x + y; a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y;
        a8 = a8 * x + y; a9 = a9 * x + y; a10 = a10 * x + y; a11 = a11 * x + y;
      }
      vec t = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
      for (int i = 0; i < LANES; ++i) sink += t[i];
    }
    double dt = omp_get_wtime() - t0;
    double gflops = 2.0 * 12 * LANES * (double)iters * threads / dt / 1e9;
    if (sink == 12345.0f) gflops = 0.0; /* keep the result */
    if (gflops > best) best = gflops;
  }
  return best;
}
"""


def fma_peak_gflops(threads):
    """The fp32 FMA peak on `threads` threads, or None without a C compiler."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma.so")
        with open(src, "w") as f:
            f.write(FMA_LOOP)
        try:
            subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
                            src, "-o", lib],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        fn = ctypes.CDLL(lib).fma_gflops
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_int, ctypes.c_long]
        return fn(threads, 20_000_000)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class PeakMemory:
    """Resident high-water mark growth over a block (Linux; None elsewhere)."""

    def __enter__(self):
        self.base = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = self._read("VmRSS")
        except OSError:
            pass
        return self

    def __exit__(self, *exc):
        self.peak = None if self.base is None else max(0, self._read("VmHWM") - self.base)

    @staticmethod
    def _read(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0


def median_ms(step, warmup, iters):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention_flops(b, h, s_q, s_k, d, causal, pass_):
    fwd = 4.0 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)
    return fwd if pass_ == "fwd" else 2.5 * fwd


# Decoding cells (b, s_k, h, h_kv, d), one query row each: LLaMA-like GQA 32/8 at d 128 and 64,
# a batch of four, MQA over a long cache, and no grouping at all.
DECODE_CELLS = ((1, 8192, 32, 8, 128), (4, 4096, 32, 8, 128), (1, 8192, 32, 8, 64),
                (1, 32768, 8, 1, 128), (1, 8192, 32, 32, 128))


PAGE = 16  # tokens per page of the paged decode step


def kvcache_steps(torch, flare, q, k, v):
    """(name, step) of flare's decode step over k, v (b, s_k, h_kv, d) held as a KV cache: every
    position cached, no new token appended (so repeated calls read the same cache)."""
    b, s_k, h_kv, d = k.shape
    seqlens = torch.full((b,), s_k, dtype=torch.int32)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    steps = [("flare-kvcache", lambda: flare.flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=seqlens))]
    if s_k % PAGE == 0:
        blocks = b * s_k // PAGE
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks))
        k_pages, v_pages = torch.empty(blocks, PAGE, h_kv, d, dtype=k.dtype), torch.empty(blocks, PAGE, h_kv, d, dtype=k.dtype)
        k_pages[perm] = kd.reshape(blocks, PAGE, h_kv, d)
        v_pages[perm] = vd.reshape(blocks, PAGE, h_kv, d)
        table = perm.reshape(b, s_k // PAGE).to(torch.int32)
        steps.append(("flare-kvcache-paged", lambda: flare.flash_attn_with_kvcache(
            qd, k_pages, v_pages, cache_seqlens=seqlens, block_table=table)))
    return steps


def cells(args):
    """The (b, s_q, s_k, h, h_kv, d, causal) cells of the run."""
    if args.decode:
        return [(b, 1, s_k, h, h_kv, d, False) for b, s_k, h, h_kv, d in DECODE_CELLS]
    lengths = [256] if args.tiny else [int(x) for x in args.s.split(",")]
    dims = [64] if args.tiny else [int(x) for x in args.d.split(",")]
    return [(1, s, s, 8, 8, d, causal) for d in dims for s in lengths for causal in (False, True)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON (and PNG)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all)")
    p.add_argument("--s", default="512,1024,2048,4096,8192", help="sequence lengths")
    p.add_argument("--d", default="64,128", help="head dims")
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="float32 and/or bfloat16 (bfloat16 only where the CPU has AVX-512 BF16 or AMX)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="two small cells, one iteration (CI)")
    p.add_argument("--decode", action="store_true", help="decoding cells (s_q 1, GQA), forward only")
    p.add_argument("--chart", action="store_true", help="also a PNG of flare / torch per cell")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads: {args.threads} must be >= 1")
    # Both libraries read their thread count when they start their pools.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import flare
    torch.set_num_threads(args.threads)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    passes = ["fwd"] if args.decode else args.passes.split(",")
    warmup, iters = (0, 1) if args.tiny else (args.warmup, args.iters)
    flags = cpu_flags()
    wanted = args.dtypes.split(",")
    unknown = [x for x in wanted if x not in ("float32", "bfloat16")]
    if unknown:
        p.error(f"--dtypes: expected float32 and/or bfloat16, got {','.join(unknown)}")
    dtypes = [torch.float32] if "float32" in wanted else []
    if "bfloat16" in wanted and not args.tiny and ("avx512_bf16" in flags or "amx_bf16" in flags):
        dtypes.append(torch.bfloat16)
    peak = None if args.tiny else fma_peak_gflops(args.threads)

    # The process's first calls run cold (thread pools started, first pages touched; torch's
    # first backward with a given gradient imports its nested-tensor and sympy modules, 0.3 s):
    # the first cells' warm-up calls did not cover it (the s 512 cells read up to 1.4x slower
    # than the same calls later in the process). The measured operations once each first.
    warm = [torch.randn(1, 256, 2, 64, requires_grad=True) for _ in range(3)]
    warm_t = [t.detach().transpose(1, 2).requires_grad_(True) for t in warm]
    for _ in range(3):
        with torch.no_grad():
            flare.flash_attn_func(*warm)
            torch.nn.functional.scaled_dot_product_attention(*warm_t)
        torch.autograd.grad(flare.flash_attn_func(*warm), warm, torch.randn(1, 256, 2, 64))
        torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*warm_t), warm_t,
                            torch.randn(1, 2, 256, 64))

    rows, ratios = [], []
    for dtype in dtypes:
        for b, s_q, s_k, h, h_kv, d, causal in cells(args):
            g = torch.Generator().manual_seed(s_k * 1000 + d)
            # Drawn in the order q, k, v, dO (the grid's inputs as before decoding cells).
            q, k, v, dout = (torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
                             for shape in ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d),
                                           (b, s_q, h, d)))
            for t in (q, k, v):
                t.requires_grad_(True)
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
            dout_t = dout.transpose(1, 2)

            def run_flare():
                return flare.flash_attn_func(q, k, v, causal=causal)

            def run_torch():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal, enable_gqa=h != h_kv)

            impls = [("flare", run_flare, (q, k, v), dout), ("torch-cpu", run_torch, (qt, kt, vt), dout_t)]
            if args.decode:
                impls += [(name, step, None, None) for name, step in kvcache_steps(torch, flare, q, k, v)]

            for pass_ in passes:
                cell = {"pass": pass_, "dtype": str(dtype).replace("torch.", ""), "b": b, "s_q": s_q,
                        "s_k": s_k, "h": h, "h_kv": h_kv, "d": d, "causal": causal}
                ms = {}
                for impl, fwd, ins, grad in impls:
                    if pass_ == "fwd":
                        def step(fwd=fwd):
                            with torch.no_grad():
                                fwd()
                    else:
                        out = fwd()

                        def step(out=out, ins=ins, grad=grad):
                            torch.autograd.grad(out, ins, grad, retain_graph=True)
                    with PeakMemory() as mem:
                        ms[impl] = median_ms(step, warmup, iters)
                    gflops = attention_flops(b, h, s_q, s_k, d, causal, pass_) / (ms[impl] * 1e6)
                    rows.append(dict(cell, impl=impl, ms=ms[impl], gflops=gflops, threads=args.threads,
                                     peak_mem_bytes=mem.peak,
                                     fraction_of_peak=gflops / peak if peak else None))
                    print(f"{impl:9s} {pass_} {cell['dtype']:8s} b {b} s {s_q:5d}/{s_k:5d} h {h:2d}/{h_kv:2d} d {d:3d} "
                          f"{'causal' if causal else 'full  '} {ms[impl]:9.3f} ms {gflops:8.1f} GFLOP/s",
                          flush=True)
                ratios.append(dict(cell, flare_over_torch=ms["torch-cpu"] / ms["flare"]))

    result = {"card": cpu_model(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(),
              "software": {"torch": torch.__version__, "python": platform.python_version()},
              "threads": args.threads, "fma_peak_gflops": peak, "tiny": args.tiny,
              "rows": rows, "ratios": ratios}
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "cpu_compare", result, None)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    below = [r for r in ratios if r["flare_over_torch"] < 1.2]
    print(f"wrote {path}: {len(rows)} rows; flare / torch {min(r['flare_over_torch'] for r in ratios):.2f}"
          f"-{max(r['flare_over_torch'] for r in ratios):.2f}, {len(below)} of {len(ratios)} cells below 1.2"
          + (f"; FMA peak {peak:.0f} GFLOP/s on {args.threads} threads" if peak else ""))
    if args.chart:
        chart(ratios, path.replace(".json", ".png"))
    return 0


def chart(ratios, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("cpu_compare.py: matplotlib is missing; no chart", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, pass_ in zip(axes, ("fwd", "bwd")):
        for d in sorted({r["d"] for r in ratios}):
            for causal in (False, True):
                pts = sorted((r["s_q"], r["flare_over_torch"]) for r in ratios
                             if r["pass"] == pass_ and r["d"] == d and r["causal"] == causal and r["dtype"] == "float32")
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                            label=f"d {d} {'causal' if causal else 'full'}")
        ax.axhline(1.2, color="gray", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_}: flare / torch CPU flash (fp32, same threads)")
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up (torch ms / flare ms)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
