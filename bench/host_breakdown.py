#!/usr/bin/env python3
"""host_breakdown.py — host µs per call of the layers of flare's eager forward at GPT-3 2.7B's
attention shape (b 4, s 1024, h 32, d 80, causal, bf16), beside SDPA's: flash_attn_func, the
operator torch.ops.flare.attention it ends in, the operator fwd into preallocated outputs (the C
ABI and the launches), the two output allocations, and one torch.add (one launch through torch);
each with inputs that do and do not require grad. Timing as bench/host_overhead.py's
host_us_per_call, median of 9 rounds of 100 calls. Then a torch profile of 50 calls of
flash_attn_func and of SDPA flash (the runtime calls and kernels behind each).

usage: PYTHONPATH=<build>/python python3 bench/host_breakdown.py OUT.json
"""
import contextlib
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flare  # noqa: E402
from host_overhead import host_time_us  # noqa: E402

B, S, H, D = 4, 1024, 32, 80


def cases():
    """name -> (SDPA backend or None, callable)."""
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    # The operators' options after q, k, v (flare/_torch.py's schema): dense, causal, defaults.
    options = (None, None, 0, 0, 0.0, 0.0, True, -1, -1, 0.0, None, False, None, 0)
    flash, cudnn = SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION
    return {
        "flash_attn_func": (None, lambda: flare.flash_attn_func(q, k, v, causal=True)),
        "op attention": (None, lambda: torch.ops.flare.attention.default(q, k, v, *options)),
        "op fwd into preallocated": (None, lambda: torch.ops.flare.fwd.default(q, k, v, out, lse,
                                                                               *options)),
        "empty_like + empty": (None, lambda: (torch.empty_like(q),
                                              torch.empty(B, H, S, device="cuda"))),
        "sdpa flash (b,h,s,d)": (flash, lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True)),
        "sdpa cudnn (b,h,s,d)": (cudnn, lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True)),
        "sdpa flash + transposes": (flash, lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True).transpose(1, 2)),
        "torch.add (one launch)": (None, lambda: torch.add(out, out)),
    }


def scope(backend):
    return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    table = cases()
    rows = {}
    for grad in (False, True):
        for name, (backend, fn) in table.items():
            with scope(backend), torch.set_grad_enabled(grad):
                for _ in range(20):
                    fn()
                times = [host_time_us(fn, 100)[0] for _ in range(9)]
            rows[f"{name} grad={grad}"] = statistics.median(times)
            print(f"{name:28s} grad={grad!s:5s} {statistics.median(times):7.2f} us "
                  f"(min {min(times):.2f})", flush=True)
    for name in ("flash_attn_func", "sdpa flash (b,h,s,d)"):
        backend, fn = table[name]
        with scope(backend), torch.no_grad():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
        print(f"== profile: {name}, 50 calls")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    json.dump({"card": torch.cuda.get_device_name(), "shape": [B, S, H, D],
               "host_us_per_call": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
