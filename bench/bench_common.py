"""bench_common.py — what the Python benchmarks share: the commit they record and how they time.

Imported by compare.py, gpt_loss.py and torch_sdpa.py (run as scripts from any directory:
Python puts their own folder, bench/, first on the import path).
"""
import os
import subprocess


def git_commit():
    """$FLARE_COMMIT when set (a copy of the tree without .git), else git's HEAD (-dirty)."""
    if os.environ.get("FLARE_COMMIT"):
        return os.environ["FLARE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pass_step(torch, forward, q, k, v, dout, pass_):
    """One run of a pass as a callable. forward() returns the attention output; "bwd" repeats the
    backward of a single forward (retain_graph), so its forward stays out of the timing."""
    if pass_ == "bwd":
        out = forward()

        def step():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    elif pass_ == "fwd":
        def step():
            with torch.no_grad():
                forward()
    else:
        def step():
            torch.autograd.grad(forward(), (q, k, v), dout)
    return step


def queued_times_ms(torch, step, warmup, iters, spin_cycles=0):
    """Milliseconds of each of `iters` runs queued back to back after `warmup` runs.

    An event between each run: the host queues ahead of the GPU, so each interval is one run's
    GPU time, not the Python dispatch before it (the same ~10-100 µs for every implementation,
    which would otherwise dominate the small cases). `flare bench` times its calls the same way.
    Runs shorter than their own dispatch need `spin_cycles`: a spin kernel queued first keeps the
    GPU busy while the host queues them all.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    if spin_cycles:
        torch.cuda._sleep(spin_cycles)
    events[0].record()
    for i in range(iters):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(iters)]

def import_torch_and_flare(script, device):
    """torch (with a CUDA device) and flare, or exit with what is missing and how to get it."""
    import sys
    try:
        import torch
    except ImportError:
        sys.exit(f"{script}: needs torch with CUDA (pip install torch)")
    if not torch.cuda.is_available():
        sys.exit(f"{script}: no CUDA device visible to torch")
    try:
        import flare
    except ImportError as e:
        sys.exit(f"{script}: cannot import flare ({e}); build with -DFLARE_BUILD_PYTHON=ON "
                 "and set PYTHONPATH=<build>/python, or pip install .")
    torch.cuda.set_device(device)
    return torch, flare


def result_path(out_dir, prefix, result, name):
    """<out_dir>/<prefix>-<card>-<date>[-name].json for a result dict with "card" and "date"."""
    import re
    card = re.sub(r"[^A-Za-z0-9]+", "-", result.get("card", "card")).strip("-").lower()
    date = result.get("date", "")[:19].replace(":", "").replace("-", "")
    suffix = f"-{name}" if name else ""
    return os.path.join(out_dir, f"{prefix}-{card}-{date}{suffix}.json")


# The "method" of results timed with queued_times_ms, before what each bench adds.
QUEUED_METHOD = ("median GPU time of `iters` calls queued behind a spin kernel, CUDA events "
                 "between calls")


def result_header(torch, flare, method):
    """The fields a GPU result file opens with: card, date (UTC), commit, software, method."""
    import datetime
    return {
        "card": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "flare": flare.__version__},
        "method": method,
    }


def load_result_for_plot(doc):
    """(args, result) of a plot script called `plot.py --out CHART.png RESULT.json`; `doc` is
    the script's docstring, whose first line describes it."""
    import argparse
    import json
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("result")
    args = ap.parse_args()
    with open(args.result) as f:
        return args, json.load(f)
