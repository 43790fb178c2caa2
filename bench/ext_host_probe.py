#!/usr/bin/env python3
"""ext_host_probe.py — host µs per call of flare's extension forward alone (outputs preallocated)
and of flare.flash_attn_func, for an A/B of the C++ path between two builds (run it once per
build, alternating): model shapes whose d 64/80 run the persistent kernel, and a d 256 control
(one CTA per tile). Timing as bench/host_overhead.py's host_us_per_call.

usage: PYTHONPATH=<build>/python python3 bench/ext_host_probe.py OUT.json [ROUNDS]
"""
import json, os, statistics, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import host_time_us
import flare
from flare import _torch as T, _ext
SHAPES = [("gpt3-2.7b", 4, 1024, 32, 32, 80), ("gpt2-124m", 16, 1024, 12, 12, 64),
          ("llama3-1b", 4, 2048, 32, 8, 64), ("tiny-d64", 1, 128, 1, 1, 64), ("tiny-d256", 1, 128, 1, 1, 256)]
steps = {}
for name, b, s, h, hk, d in SHAPES:
    mk = lambda n: torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = mk(h), mk(hk), mk(hk)
    out, lse = T.forward_outputs(q, False)
    st = T._stream(q)
    steps[name] = (lambda q=q, k=k, v=v, out=out, lse=lse, st=st:
                   _ext.forward(q, k, v, out, lse, None, None, 0, 0, 0.0, True, -1, -1, 0.0, None, 0.0, 0, 0, False, 0, st))
    steps[name + " eager"] = (lambda q=q, k=k, v=v: flare.flash_attn_func(q, k, v, causal=True))
res = {n: [] for n in steps}
with torch.no_grad():
    for f in steps.values():
        for _ in range(10): f()
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
        for n, f in steps.items():
            res[n].append(host_time_us(f, 200)[0])
row = {n: round(statistics.median(v), 2) for n, v in res.items()}
print(json.dumps(row))
json.dump(row, open(sys.argv[1], "w"))
