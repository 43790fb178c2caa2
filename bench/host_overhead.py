#!/usr/bin/env python3
"""host_overhead.py — what one attention call costs the host, against what it costs the GPU.

In a training step the host must queue work ahead of the GPU; an attention call whose Python and
launch path takes longer than its kernels leaves the GPU idle, however fast the kernels are. For
each implementation (flare's flash_attn_func, PyTorch SDPA with its cuDNN and flash backends),
pass (forward; forward + backward through autograd) and shape, this script measures:

  host_us_per_call  wall time of the host to queue N calls back to back behind a spin kernel
                    that outlasts the queueing, so that the calls' own execution cannot slow the
                    host and a host that waited for the GPU (a synchronising call, a full launch
                    queue) is detected: host_never_waited says the spin outlasted it every round;
  gpu_us_per_call   GPU time of N calls queued behind a spin kernel (torch.cuda._sleep), so the
                    host is far ahead and the interval is the GPU's work alone;
  host_ran_ahead    whether, when the host finished queueing the N calls (no spin kernel), the
                    GPU still had work left: the end event had not completed.

Each row is measured eagerly and, with --compile, under torch.compile (fullgraph) as well
("compiled": true). --profile writes a cProfile table of flare's calls to DIR/profile-*.txt.

usage: host_overhead.py --json OUT.json [--iters 100] [--rounds 9] [--compile] [--profile DIR]
"""
import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flare
from bench_common import git_commit

# (name, b, s, h, h_kv, d, causal): the shapes of the issue plus a GQA model shape.
SHAPES = [
    ("gpt3-2.7b", 4, 1024, 32, 32, 80, True),
    ("gpt2-124m", 16, 1024, 12, 12, 64, True),
    ("llama3-1b", 4, 2048, 32, 8, 64, True),
]
SDPA_BACKENDS = {"torch-cudnn": SDPBackend.CUDNN_ATTENTION,
                 "torch-flash": SDPBackend.FLASH_ATTENTION}


def attention_fn(impl, causal, h, h_kv):
    """A callable (q, k, v) → out in flare's (b, s, h, d) layout for one implementation."""
    if impl == "flare":
        return lambda q, k, v: flare.flash_attn_func(q, k, v, causal=causal)
    gqa = h != h_kv

    def sdpa(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)
    return sdpa


def backend_scope(impl):
    """The SDPA backend an implementation runs under, entered around its timed loops rather than
    in each call: a user picks the backend once, and sdpa_kernel's own host time per call would
    otherwise count against SDPA."""
    if impl == "flare":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPA_BACKENDS[impl])


def make_step(fn, q, k, v, dout, pass_):
    if pass_ == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v)
    else:
        def step():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    return step


def host_time_us(step, iters):
    """Host µs per call queueing `iters` calls behind a spin kernel, so the host measures only
    itself: none of the calls runs meanwhile, nothing they launch competes with the host for the
    driver, and a host that had to wait for the GPU (a synchronising call, a full launch queue)
    shows up as a spin that ended before queueing did. The spin doubles until it outlasts the
    queueing; a host that still waits for the GPU at 2^33 cycles is reported as such."""
    cycles = 1 << 27
    while True:
        torch.cuda.synchronize()
        spin_done = torch.cuda.Event()
        torch.cuda._sleep(cycles)
        spin_done.record()
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            step()
        t1 = time.perf_counter_ns()
        hidden = not spin_done.query()
        torch.cuda.synchronize()
        if hidden or cycles >= 1 << 33:
            return (t1 - t0) / 1e3 / iters, hidden
        cycles *= 2


def host_ran_ahead(step, iters):
    """Whether, queueing `iters` calls back to back with nothing in front of them, the host
    finished while the GPU still had work left (the end event had not completed)."""
    torch.cuda.synchronize()
    end = torch.cuda.Event()
    for _ in range(iters):
        step()
    end.record()
    ran_ahead = not end.query()
    torch.cuda.synchronize()
    return ran_ahead


def gpu_time_us(step, iters):
    """GPU µs per call: `iters` calls queued behind a spin kernel long enough to hide the host."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))  # ~1 s at H100 clocks: the host queues everything meanwhile
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


IMPLS = ("flare", "torch-cudnn", "torch-flash")


def measure_case(shape, pass_, compiled, iters, rounds, profile_dir):
    """One row per implementation. Host time drifts over seconds on a shared machine, so the
    implementations are timed in interleaved rounds (flare, cuDNN, flash, flare, ...) and each
    reports its median: a slow stretch costs all of them alike."""
    name, b, s, h, h_kv, d, causal = shape
    grad = pass_ != "fwd"

    def make(heads):
        return torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=grad)
    q, k, v = make(h), make(h_kv), make(h_kv)
    dout = torch.randn_like(q) if grad else None
    if compiled:
        torch._dynamo.reset()  # each case compiles afresh: no recompile limit across cases
    steps, errors = {}, {}
    for impl in IMPLS:
        try:
            fn = attention_fn(impl, causal, h, h_kv)
            if compiled:
                fn = torch.compile(fn, fullgraph=True)
            step = make_step(fn, q, k, v, dout, pass_)
            with backend_scope(impl):
                for _ in range(10):
                    step()
            steps[impl] = step
        except Exception as e:  # a backend that refuses a shape: say so, go on
            errors[impl] = f"{type(e).__name__}: {e}"[:300]
    host = {impl: [] for impl in steps}
    ahead = {impl: [] for impl in steps}
    for _ in range(rounds):
        for impl, step in steps.items():
            with backend_scope(impl):
                host[impl].append(host_time_us(step, iters))
                ahead[impl].append(host_ran_ahead(step, iters))
    rows = []
    for impl in IMPLS:
        row = {"impl": impl, "pass": pass_, "model": name, "b": b, "s": s, "h": h, "h_kv": h_kv,
               "d": d, "causal": causal, "compiled": compiled, "iters": iters}
        if impl in errors:
            rows.append({**row, "error": errors[impl]})
            continue
        step = steps[impl]
        with backend_scope(impl):
            gpu_us = statistics.median(gpu_time_us(step, iters) for _ in range(3))
        row.update(host_us_per_call=round(statistics.median(t for t, _ in host[impl]), 2),
                   gpu_us_per_call=round(gpu_us, 2),
                   host_ran_ahead=all(ahead[impl]),
                   host_never_waited=all(hidden for _, hidden in host[impl]))
        if profile_dir and impl == "flare":
            write_profile(step, iters, profile_dir, f"{name}-{pass_}{'-compiled' if compiled else ''}")
        rows.append(row)
    return rows


def write_profile(step, iters, profile_dir, tag):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(profile_dir, f"profile-{tag}.txt"), "w") as f:
        f.write(text.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved host-time rounds")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--profile", default="")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rows = []
    for shape in SHAPES:
        for compiled in ([False, True] if args.compile else [False]):
            for pass_ in ("fwd", "fwdbwd"):
                for row in measure_case(shape, pass_, compiled, args.iters, args.rounds,
                                        args.profile):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    result = {
        "card": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "flare": flare.__version__},
        "method": "host_us_per_call: host wall time to queue `iters` calls behind a spin "
                  "kernel that outlasts the queueing (host_never_waited: it did, in every round), "
                  "median of `rounds` rounds interleaved across implementations; "
                  "gpu_us_per_call: the same calls queued behind torch.cuda._sleep, CUDA events, "
                  "median of 3; host_ran_ahead: queueing `iters` calls with nothing in front, the "
                  "GPU was still busy when queueing ended (in every round)",
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
