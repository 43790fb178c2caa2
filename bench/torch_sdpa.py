#!/usr/bin/env python3
"""PyTorch SDPA on the standard grid (docs/architecture.md, "Performance method"): the peers
flare's CUDA kernels are compared against.

Times torch.nn.functional.scaled_dot_product_attention under the flash backend (FlashAttention-2)
and the cuDNN backend, forward, backward (the backward call alone, its forward untimed) or both,
bf16, on the same grid and card as `flare bench --device cuda`: 16k tokens per batch, (b, s) in
(32,512) ... (1,16k), hidden 2048, head_dim 64/128/256, causal and not. Times are medians of
CUDA-event intervals between runs queued back to back after warm-up (GPU time, as `flare bench`
measures it), one input set per case (each tensor is 64 MiB, larger than L2). FLOPs as FlashAttention counts them: forward
4·b·s²·h·d, halved for causal; backward 2.5× forward. Writes bench/results' JSON schema.

usage: torch_sdpa.py --json OUT.json [--pass fwd|bwd|fwdbwd|all] [--warmup 5] [--iters 30]
                     [--d D] [--h H]
--d runs one head_dim (e.g. 192, outside the grid) and --h pins the query heads (default 2048 / d),
as the same options of `flare bench` do.
"""
import argparse
import datetime
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_common import git_commit, pass_step, queued_times_ms

GRID_BS = [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
HIDDEN = 2048
HEAD_DIMS = [64, 128, 256]
BACKENDS = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}


def flops(b, s, h, d, causal, pass_):
    f = 4.0 * b * s * s * h * d / (2 if causal else 1)
    return {"fwd": f, "bwd": 2.5 * f, "fwdbwd": 3.5 * f}[pass_]


def time_case(backend, b, s, h, d, causal, pass_, warmup, iters):
    # (b, h, s, d) views of (b, s, h, d) storage: flare's layout, so both read the same bytes.
    def make():
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = make(), make(), make()
    if pass_ != "fwd":
        for t in (q, k, v):
            t.requires_grad_(True)
    dout = torch.randn_like(q) if pass_ != "fwd" else None

    def forward():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # Runs queued back to back, as `flare bench` times its calls (bench_common.py).
    torch.cuda.reset_peak_memory_stats()
    times = queued_times_ms(torch, pass_step(torch, forward, q, k, v, dout, pass_), warmup, iters)
    ms = statistics.median(times)
    return ms, torch.cuda.max_memory_allocated()


def run_grid(pass_, warmup, iters, head_dims=HEAD_DIMS, heads=None):
    rows = []
    for d in head_dims:
        h = heads or HIDDEN // d
        for b, s in GRID_BS:
            for causal in (False, True):
                for impl, backend in BACKENDS.items():
                    try:
                        ms, mem = time_case(backend, b, s, h, d, causal, pass_, warmup, iters)
                    except RuntimeError as e:  # backend refuses this shape on this card
                        print(f"{impl:12s} d={d} b={b} s={s} causal={causal}: skipped ({e})".splitlines()[0])
                        torch.cuda.empty_cache()
                        continue
                    tf = flops(b, s, h, d, causal, pass_) / (ms * 1e-3) / 1e12
                    rows.append({"impl": impl, "pass": pass_, "dtype": "bf16", "b": b, "s_q": s,
                                 "s_k": s, "h": h, "h_kv": h, "d": d, "causal": causal, "ms": ms,
                                 "tflops": tf, "peak_mem_bytes": mem})
                    print(f"{impl:12s} {pass_} bf16 b={b:2d} s={s:5d} h={h:2d} d={d:3d} "
                          f"causal={int(causal)} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
                    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd", "fwdbwd", "all"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--d", type=int, help="one head_dim instead of the grid's (as `flare bench --d`)")
    ap.add_argument("--h", type=int, help="query heads instead of 2048 / d (as `flare bench --h`)")
    args = ap.parse_args()
    if args.d is not None and not 1 <= args.d <= 256:
        ap.error("--d must be in 1..256")
    if args.h is not None and args.h < 1:
        ap.error("--h must be at least 1")
    head_dims = [args.d] if args.d else HEAD_DIMS

    passes = ["fwd", "bwd", "fwdbwd"] if args.pass_ == "all" else [args.pass_]
    rows = []
    for pass_ in passes:
        rows += run_grid(pass_, args.warmup, args.iters, head_dims, args.h)
    commit = git_commit()
    out = {"card": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit,
           "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "cudnn": str(torch.backends.cudnn.version())},
           "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
