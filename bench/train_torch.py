#!/usr/bin/env python3
"""train_torch.py — the PyTorch peer of flare's trainer: the same models (torch_models.py), trained
with torch.compile and SDPA's cuDNN backend, timed and, with --log, trained on the shards for a
loss curve to lay next to flare's (plot_train.py).

Precision (nanoGPT's recipe, the one the issue's baseline numbers were measured with): fp32
parameters, which are also the master weights the optimizer updates, and bf16 autocast over the
forward (matmuls and attention in bf16; norms, RoPE and the loss in fp32, as torch_models does);
fp32 gradients. Optimizer: torch.optim.AdamW(fused=True) with flare's defaults (train_config.h:
lr 6e-4 to min_lr 6e-5, warm-up 100 then cosine, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the
matrices only, global-norm clip 1.0). TF32 is off, so fp32 means fp32.

Attention: F.scaled_dot_product_attention with only the cuDNN backend enabled, so a shape cuDNN
refuses fails loudly instead of running another backend. If it refuses (GQA, say), the case is
rerun with the flash backend and the row says so ("attention_backend"). The attention kernels a
profiled step ran are recorded ("attention_kernels") as evidence of which backend ran.

Timing (bench mode): --warmup steps (compilation included) then --steps steps, each between CUDA
events with no host synchronisation inside; step_ms is the median, tokens_per_s = batch·seq /
step_ms. One step = forward, backward, gradient clip, AdamW, zero_grad: what flare-train's step
does. MFU = tokens_per_s · model_flops_per_token / 989e12 (H100 SXM dense bf16), the FLOP count of
src/train/core/model_config.cpp model_flops_per_token() (6·N + 6·L·H·Q·T, PaLM's count with the
causal attention term halved). peak_mem_bytes is torch.cuda.max_memory_allocated over the timed
steps (tensors alive, not the caching allocator's reserve, which is peak_reserved_bytes).

Output: one line per case and <out>/train_torch-<card>-<date>.json:
  {"card", "date", "commit", "software", "rows": [{"impl": "torch-compile", "model", "gpus", "seq",
   "batch_per_gpu", "tokens_per_s", "mfu", "peak_mem_bytes", "step_ms", ...}]}

Examples (from the repository root, on one H100):
  python3 bench/train_torch.py --out bench/results                 # gpt2, gpt3-2.7b, llama3.2-1b
  python3 bench/train_torch.py --case gpt3-2.7b:8:1024 --case gpt3-2.7b:4:2048 --out bench/results
  python3 bench/train_torch.py --case gpt2:16:1024 --data 'data/pydoc/pydoc_train_*.bin'
  python3 bench/train_torch.py --log /tmp/torch-gpt2.json --case gpt2:16:1024 \\
      --data 'data/pydoc/pydoc_train_*.bin' --val-data 'data/pydoc/pydoc_val_*.bin' \\
      --train-steps 500 --eval-every 100
  (the loss-curve mode starts from flare-train's own initial weights for --seed, computed here
  (flare:SEED), reads the shards in flare's loader order for that seed, and follows flare-train's
  schedule defaults, so `flare-train --model gpt2 --batch 16 --seq 1024 --steps 500 --log F`
  and this run differ only in their arithmetic)
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import git_commit, result_path  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16 (the MFU denominator)
DEFAULT_CASES = ["gpt2:16:1024", "gpt3-2.7b:4:1024", "llama3.2-1b:4:4096"]
BACKENDS = ["cudnn", "flash", "efficient"]


def parse_case(text):
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--case '{text}': must be MODEL:BATCH:SEQ, e.g. gpt2:16:1024")
    try:
        return parts[0], int(parts[1]), int(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case '{text}': BATCH and SEQ must be integers")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", type=parse_case,
                   help=f"MODEL:BATCH:SEQ (repeatable; default {' '.join(DEFAULT_CASES)})")
    p.add_argument("--config-json", help="a model config as JSON (ModelConfig's fields) instead "
                   "of the preset named in --case")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (bench mode)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first, compilation included")
    p.add_argument("--data", help="training shards (glob); default: random tokens")
    p.add_argument("--val-data", help="validation shards (glob), for --eval-every")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the tokenizer.tiktoken "
                   "next to the --data shards, ranks + 1, as flare-train takes it; else the preset's)")
    p.add_argument("--out", help="directory for the result JSON (bench mode)")
    p.add_argument("--name", help="suffix of the result file name")
    p.add_argument("--no-compile", action="store_true", help="eager mode (impl torch-eager)")
    p.add_argument("--backend", choices=BACKENDS, default="cudnn", help="SDPA backend")
    p.add_argument("--precision", choices=["bf16", "fp32", "fp64"], default="bf16",
                   help="bf16: autocast over fp32 weights (default); fp32: no autocast, no TF32; "
                   "fp64: weights and arithmetic in double (--cpu only)")
    p.add_argument("--cpu", action="store_true", help="--log on the CPU, eager (checks the "
                   "curve against flare-train --device cpu; fp32 or fp64)")
    p.add_argument("--init", help="initial weights: flare's .safetensors export, its flat .bin, "
                   "or flare:SEED (flare-train's initialisation for SEED, computed here); "
                   "default flare:<--seed> with --log, else a draw of the same distributions")
    p.add_argument("--seed", type=int, default=1337, help="init (without --init) and data order")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, help="end of the cosine (default lr/10, as flare-train)")
    p.add_argument("--warmup-steps", type=int, help="schedule warm-up (default min(100, "
                   "train-steps/10), as flare-train's --warmup)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--log", help="training mode: train --train-steps steps and write the loss "
                   "curve to this JSON file")
    p.add_argument("--train-steps", type=int, default=1000, help="steps of the run (schedule "
                   "length; bench mode uses it for the learning rate only)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between validation passes")
    p.add_argument("--val-batches", type=int, default=8, help="batches per validation pass "
                   "(at most one epoch of the validation shards, as flare-train's --eval-batches)")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    args.case = args.case or [parse_case(c) for c in DEFAULT_CASES]
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.train_steps // 10)
    if args.init is None and args.log:
        args.init = f"flare:{args.seed}"
    if args.log and len(args.case) != 1:
        p.error("--log trains one model: give exactly one --case")
    if args.log and not args.data:
        p.error("--log trains on the shards: --data is required")
    if args.eval_every and not args.val_data:
        p.error("--eval-every needs --val-data")
    if args.cpu and (not args.log or args.precision == "bf16"):
        p.error("--cpu: for --log runs in --precision fp32 or fp64")
    if args.precision == "fp64" and not args.cpu:
        p.error("--precision fp64: CPU only (add --cpu)")
    if args.cpu:
        args.no_compile = True
    elif args.precision == "fp32" and args.backend != "efficient":
        p.error("--precision fp32: SDPA's cudnn and flash backends serve bf16/fp16 only; "
                "add --backend efficient")
    for name, value in [("--steps", args.steps), ("--train-steps", args.train_steps),
                        ("--warmup", args.warmup)]:
        if value < 1:
            p.error(f"{name}: {value} must be >= 1")
    return args


def set_sdpa_backend(torch, backend):
    """Only `backend` enabled, so SDPA cannot quietly pick another one."""
    if not torch.cuda.is_available():
        return  # the CPU runs SDPA's math path, the only one it has
    cuda = torch.backends.cuda
    cuda.enable_cudnn_sdp(backend == "cudnn")
    cuda.enable_flash_sdp(backend == "flash")
    cuda.enable_mem_efficient_sdp(backend == "efficient")
    cuda.enable_math_sdp(False)


class Run:
    """One model on one GPU: the (compiled) model, its optimizer, and the step."""

    def __init__(self, torch, tm, args, config, batch, seq):
        self.torch, self.tm, self.args = torch, tm, args
        self.config, self.batch, self.seq = config, batch, seq
        self.device = "cpu" if args.cpu else "cuda"
        torch.manual_seed(args.seed)
        model = tm.FlareModel(config, rope_len=seq)
        if args.init:
            tm.load_weights(model, args.init)
        if args.precision == "fp64":
            model = model.double()
        self.model = model.to(self.device)
        self.forward = self.model if args.no_compile else torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(
            tm.optimizer_groups(self.model, args.weight_decay), lr=args.lr,
            betas=(args.beta1, args.beta2), eps=args.eps, fused=not args.cpu)
        self.params = list(self.model.parameters())

    def step(self, tokens, targets, step_index):
        """One optimizer step; returns (loss, grad_norm) as device tensors (no synchronisation)."""
        torch, a = self.torch, self.args
        lr = self.tm.learning_rate(step_index, a.lr, a.min_lr, a.warmup_steps, a.train_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = self.forward(tokens, targets)
        loss.backward()
        # clip_grad_norm_ with an infinite max_norm only measures (scale 1), like flare with clip 0.
        norm = torch.nn.utils.clip_grad_norm_(self.params, a.grad_clip or float("inf"), foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm

    def evaluate(self, loader, batches):
        """Mean loss over the first `batches` batches of the validation shards."""
        torch = self.torch
        loader.reset()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        with torch.no_grad(), torch.autocast(self.device, dtype=torch.bfloat16,
                                             enabled=self.args.precision == "bf16"):
            for _ in range(batches):
                x, y = to_device(torch, loader.next_batch(), self.device)
                total += self.forward(x, y).double()
        return total.item() / batches


def to_device(torch, batch, device="cuda"):
    x, y = (torch.from_numpy(t) for t in batch)
    if device == "cpu":
        return x, y
    return x.pin_memory().cuda(non_blocking=True), y.pin_memory().cuda(non_blocking=True)


def batches_for(torch, tm, args, config, batch, seq, count):
    """`count` batches on the device: from the shards in flare's order, or random tokens."""
    if args.data:
        loader = tm.ShardLoader(args.data, batch, seq, config.vocab_size, seed=args.seed)
        return [to_device(torch, loader.next_batch()) for _ in range(count)]
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    out = []
    for _ in range(min(count, 4)):
        window = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda", generator=g)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def attention_kernels(torch, run, tokens, targets):
    """Names of the attention kernels one profiled step runs (evidence of the SDPA backend)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run.step(tokens, targets, 0)
        torch.cuda.synchronize()
    keys = ("sdpa", "fmha", "flash", "attention", "attn", "cudnn")
    names = {e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)}
    return sorted(names)[:4]


def bench_case(torch, tm, args, config, batch, seq, backend):
    set_sdpa_backend(torch, backend)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = Run(torch, tm, args, config, batch, seq)
    data = batches_for(torch, tm, args, config, batch, seq, args.warmup + args.steps)
    for i in range(args.warmup):
        x, y = data[i % len(data)]
        loss, _ = run.step(x, y, i)
    first_loss = loss.item()
    kernels = attention_kernels(torch, run, *data[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    losses = []
    events[0].record()
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        loss, _ = run.step(x, y, args.warmup + i)
        losses.append(loss)
        events[i + 1].record()
    torch.cuda.synchronize()
    ms = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]
    step_ms = statistics.median(ms)
    tokens_per_s = batch * seq / (step_ms / 1e3)
    flops = tm.model_flops_per_token(config, seq)
    mfu = tokens_per_s * flops / PEAK_BF16_FLOPS
    if mfu >= 1.0:  # above peak means the timing or the FLOP count is wrong, not a fast run
        raise RuntimeError(f"{config.name}: MFU {mfu:.2f} >= 1, a measurement error")
    last_loss = losses[-1].item()
    if not all(map(lambda t: bool(torch.isfinite(t)), losses)):
        raise RuntimeError(f"{config.name}: non-finite loss in the timed steps")
    return {
        "impl": "torch-eager" if args.no_compile else "torch-compile",
        "model": config.name, "gpus": 1, "seq": seq, "batch_per_gpu": batch,
        "tokens_per_s": tokens_per_s, "mfu": mfu,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(),
        "step_ms": step_ms,
        "step_ms_mean": statistics.fmean(ms), "step_ms_min": min(ms), "steps_timed": args.steps,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "flops_per_token": flops, "parameters": tm.parameter_count(config),
        "precision": "bf16-autocast-fp32-weights" if args.precision == "bf16" else "fp32",
        "attention_backend": backend, "attention_kernels": kernels,
        "data": "shards" if args.data else "random", "loss_first": first_loss, "loss_last": last_loss,
    }


def data_vocab(args):
    """flare-train's vocabulary rule: --vocab, else the data's tokenizer (ranks + end-of-text)."""
    if args.vocab:
        return args.vocab
    if args.data:
        ranks = os.path.join(os.path.dirname(args.data), "tokenizer.tiktoken")
        if os.path.exists(ranks):
            with open(ranks) as f:
                return sum(1 for line in f if line.strip()) + 1
    return None


def config_for(tm, args, name):
    if args.config_json:
        with open(args.config_json) as f:
            return tm.config_from_json(json.load(f))
    config = tm.model_preset(name)
    vocab = data_vocab(args)
    if vocab and vocab != config.vocab_size:
        config.vocab_size, config.padded_vocab = vocab, tm.padded_vocab_size(vocab)
    return config


def software(torch):
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "python": platform.python_version()}


def run_bench(torch, tm, args):
    result = {"card": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "software": software(torch),
              "optimizer": {"name": "AdamW(fused)", "lr": args.lr, "betas": [args.beta1, args.beta2],
                            "eps": args.eps, "weight_decay": args.weight_decay,
                            "grad_clip": args.grad_clip},
              "peak_flops": PEAK_BF16_FLOPS, "rows": []}
    failed = False
    for name, batch, seq in args.case:
        config = config_for(tm, args, name)
        backends = [args.backend] + (["flash"] if args.backend == "cudnn" else [])
        row, refusal = None, ""
        for backend in backends:
            try:
                row = bench_case(torch, tm, args, config, batch, seq, backend)
                if backend != args.backend:
                    row["attention_backend_note"] = f"{args.backend} refused: {refusal}"
                break
            except torch.cuda.OutOfMemoryError as e:
                row = {"impl": "torch-compile", "model": config.name, "gpus": 1, "seq": seq,
                       "batch_per_gpu": batch, "error": f"out of memory: {str(e).splitlines()[0]}"}
                break
            except Exception as e:  # compile and SDPA refusals come as several exception types
                refusal = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(f"{config.name} b{batch} s{seq}: backend {backend} failed: {refusal}",
                      file=sys.stderr)
        if row is None:
            row = {"impl": "torch-compile", "model": config.name, "gpus": 1, "seq": seq,
                   "batch_per_gpu": batch, "error": refusal}
        torch.cuda.empty_cache()
        result["rows"].append(row)
        if "error" in row:
            failed = True
            print(f"{config.name:12s} b{batch:<3d} s{seq:<5d} FAILED: {row['error']}")
        else:
            print(f"{config.name:12s} b{batch:<3d} s{seq:<5d} {row['tokens_per_s']:12,.0f} tokens/s "
                  f"{row['step_ms']:9.2f} ms  MFU {100 * row['mfu']:5.1f}%  "
                  f"peak {row['peak_mem_bytes'] / 2**30:6.2f} GiB  [{row['attention_backend']}]")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = result_path(args.out, "train_torch", result, args.name)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 1 if failed else 0


def run_log(torch, tm, args):
    """Trains one model on the shards; writes the loss curve as JSON."""
    name, batch, seq = args.case[0]
    config = config_for(tm, args, name)
    set_sdpa_backend(torch, args.backend)
    run = Run(torch, tm, args, config, batch, seq)
    loader = tm.ShardLoader(args.data, batch, seq, config.vocab_size, seed=args.seed)
    val_loader, val_batches = None, 0
    if args.eval_every:
        val_loader = tm.ShardLoader(args.val_data, batch, seq, config.vocab_size, shuffle=False)
        val_batches = min(args.val_batches, val_loader.batches_per_epoch)
    log = {"impl": "torch-eager" if args.no_compile else "torch-compile", "model": config.name,
           "batch_per_gpu": batch, "seq": seq,
           "card": "cpu" if args.cpu else torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "software": software(torch), "init": args.init or "torch",
           "precision": args.precision, "data": args.data, "seed": args.seed,
           "vocab_size": config.vocab_size,
           "schedule": {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup_steps,
                        "steps": args.train_steps},
           "steps": []}
    start = time.perf_counter()
    for step in range(args.train_steps):
        x, y = to_device(torch, loader.next_batch(), run.device)
        t0 = time.perf_counter()
        loss, norm = run.step(x, y, step)
        # "step" counts completed steps from 1, as flare-train's JSON log does.
        entry = {"step": step + 1, "loss": loss.item(), "grad_norm": norm.item(),
                 "lr": tm.learning_rate(step, args.lr, args.min_lr, args.warmup_steps,
                                        args.train_steps),
                 "step_ms": 1e3 * (time.perf_counter() - t0)}
        if val_loader and ((step + 1) % args.eval_every == 0 or step + 1 == args.train_steps):
            entry["val_loss"] = run.evaluate(val_loader, val_batches)
        log["steps"].append(entry)
        print(f"step {step + 1:5d} loss {entry['loss']:.4f} norm {entry['grad_norm']:.3f} "
              f"lr {entry['lr']:.2e}" + (f" val {entry['val_loss']:.4f}" if "val_loss" in entry else ""))
    log["seconds"] = time.perf_counter() - start
    with open(args.log, "w") as f:
        json.dump(log, f, indent=1)
    print(f"wrote {args.log}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("train_torch.py: needs torch with CUDA (pip install torch)")
    import torch_models as tm
    if args.cpu:
        return run_log(torch, tm, args)
    if not torch.cuda.is_available():
        sys.exit("train_torch.py: no CUDA device visible to torch")
    torch.cuda.set_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return run_log(torch, tm, args) if args.log else run_bench(torch, tm, args)


if __name__ == "__main__":
    sys.exit(main())
