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
steps (tensors alive, not the caching allocator's reserve, which is peak_reserved_bytes);
device_in_use_bytes is the device's total − free memory right after them, flare-train's measure
(the caching allocator still holds its peak reserve then, and the CUDA context counts), so that
the two programs' memory compares like with like.

Several GPUs (bench mode under torchrun, WORLD_SIZE > 1): one process per GPU, device LOCAL_RANK,
NCCL (gloo with --cpu, for tests). The model is wrapped in DistributedDataParallel and then
compiled (the order PyTorch recommends, so that Dynamo splits the graph at DDP's gradient
buckets), or with --fsdp sharded by FSDP2 (fully_shard on each block, then the root; same
precision recipe: fp32 sharded parameters, bf16 autocast). Each rank trains on its own batches
(random tokens seeded by seed + rank, or the shards dealt to the ranks as flare's loader does).
A step's time is its slowest rank's: step_ms is the largest of the ranks' medians,
tokens_per_s = ranks · batch · seq / step_ms, MFU is per GPU, peak_mem_bytes the largest over
the ranks. Rank 0 alone prints and writes the JSON (impl torch-ddp-compile or
torch-fsdp2-compile; "gpus" is the number of ranks; file name suffix -ddp-x<N> or -fsdp2-x<N>
unless --name; the result adds "launch": {"launcher", "world", "parallel", "backend"} and each
row "step_ms_per_rank" and "peak_mem_bytes_per_rank"). With --cpu (fp32 or fp64, eager) the
steps are timed on the host clock and the peak memory is the process's peak resident set.

Output: one line per case and <out>/train_torch-<card>-<date>.json:
  {"card", "date", "commit", "software", "rows": [{"impl": "torch-compile", "model", "gpus", "seq",
   "batch_per_gpu", "tokens_per_s", "mfu", "peak_mem_bytes", "step_ms", ...}]}

Examples (from the repository root, on one H100; RUN=bench/results/<date>-<card>-<commit>, the
run's folder):
  python3 bench/train_torch.py --out $RUN                          # gpt2, gpt3-2.7b, llama3.2-1b
  python3 bench/train_torch.py --case gpt3-2.7b:8:1024 --case gpt3-2.7b:4:2048 --out $RUN
  python3 bench/train_torch.py --case gpt2:16:1024 --data 'data/pydoc/pydoc_train_*.bin'
  torchrun --nproc-per-node 4 bench/train_torch.py --case gpt3-2.7b:4:1024 --vocab 50257 \
      --out $RUN                                                  # DDP on 4 GPUs (--fsdp: FSDP2)
  python3 bench/train_torch.py --log /tmp/torch-gpt2.json --case gpt2:16:1024 \\
      --data 'data/pydoc/pydoc_train_*.bin' --val-data 'data/pydoc/pydoc_val_*.bin' \\
      --train-steps 500 --eval-every 100
  (the loss-curve mode starts from flare-train's own initial weights for --seed, computed here
  (flare:SEED), reads the shards in flare's loader order for that seed, and follows flare-train's
  schedule defaults, so `flare-train --model gpt2 --batch 16 --seq 1024 --steps 500 --log F`
  and this run differ only in their arithmetic)
"""

import argparse
import collections
import datetime
import json
import os
import platform
import resource
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


Launch = collections.namedtuple("Launch", "rank world local_rank")


def launch_from_env(env=os.environ):
    """The torchrun launch this process belongs to (RANK, WORLD_SIZE, LOCAL_RANK), or None when it
    runs alone (no WORLD_SIZE, or a world of one). Raises ValueError for a partial or inconsistent
    environment, before any rendezvous."""
    if "WORLD_SIZE" not in env:
        return None
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        text = env.get(name)
        if text is None:
            raise ValueError(f"{name}: unset while WORLD_SIZE is {env['WORLD_SIZE']} "
                             "(launch with torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK)")
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"{name}: '{text}' is not an integer")
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1:
        raise ValueError(f"WORLD_SIZE: {world} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"RANK: {rank} must be in [0, WORLD_SIZE {world})")
    if local < 0:
        raise ValueError(f"LOCAL_RANK: {local} must be >= 0")
    return Launch(rank, world, local) if world > 1 else None


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
    p.add_argument("--device", type=int, help="CUDA device (default 0; under torchrun LOCAL_RANK)")
    p.add_argument("--kernel-profile", metavar="DIR", help="after each case's timed steps, profile 2 more "
                   "with torch.profiler and write DIR/kernel-profile-<impl>-<model>.txt (GPU only)")
    p.add_argument("--fsdp", action="store_true", help="under torchrun: shard with FSDP2 "
                   "(impl torch-fsdp2-*) instead of DistributedDataParallel")
    args = p.parse_args(argv)
    try:
        args.launch = launch_from_env()
    except ValueError as e:
        p.error(f"torchrun environment: {e}")
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
    if args.launch and args.log:
        p.error("--log: one process only (under torchrun, bench mode)")
    if args.launch and args.device is not None:
        p.error("--device: under torchrun each rank takes device LOCAL_RANK")
    if args.fsdp and not args.launch:
        p.error("--fsdp: shards over the ranks of a torchrun launch (WORLD_SIZE > 1)")
    if args.cpu and (not (args.log or args.launch) or args.precision == "bf16"):
        p.error("--cpu: for --log runs or a torchrun launch (gloo), in --precision fp32 or fp64")
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
    if args.device is None:
        args.device = args.launch.local_rank if args.launch else 0
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


def impl_name(args):
    """The row's "impl": torch-compile alone; torch-ddp-compile or torch-fsdp2-compile under a
    launch (-eager for --no-compile and --cpu)."""
    mode = "eager" if args.no_compile else "compile"
    if not args.launch:
        return f"torch-{mode}"
    return f"torch-{'fsdp2' if args.fsdp else 'ddp'}-{mode}"


def fsdp2_fully_shard():
    """FSDP2's fully_shard (torch.distributed.fsdp since torch 2.6, _composable.fsdp before)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            import torch
            raise RuntimeError(f"--fsdp: this torch ({torch.__version__}) has no FSDP2 "
                               "(torch.distributed.fsdp.fully_shard; torch >= 2.6)") from None
    return fully_shard


def parallelize(model, args):
    """The module the step calls: the model itself alone; under a launch, the model in
    DistributedDataParallel, or (--fsdp) the model sharded in place by FSDP2, each block its own
    unit so that one block's parameters are gathered at a time, then the root (embeddings, final
    norm, head)."""
    if not args.launch:
        return model
    if args.fsdp:
        fully_shard = fsdp2_fully_shard()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=None if args.cpu else [args.device])


class Run:
    """One model on one GPU (or one rank's replica or shard): the (compiled) model, its
    optimizer, and the step."""

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
        # Wrapped before compiling: Dynamo then splits the graph at DDP's buckets (DDPOptimizer).
        wrapped = parallelize(self.model, args)
        self.forward = wrapped if args.no_compile else torch.compile(wrapped)
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


def batches_for(torch, tm, args, config, batch, seq, count, device="cuda"):
    """`count` batches on the device: from the shards in flare's order, or random tokens. Under a
    launch, this rank's: the shards' windows dealt to the ranks as flare's loader deals them, or
    tokens drawn from seed + rank."""
    rank, world = (args.launch.rank, args.launch.world) if args.launch else (0, 1)
    if args.data:
        loader = tm.ShardLoader(args.data, batch, seq, config.vocab_size, seed=args.seed,
                                rank=rank, world_size=world)
        return [to_device(torch, loader.next_batch(), device) for _ in range(count)]
    g = torch.Generator(device=device).manual_seed(args.seed + rank)
    out = []
    for _ in range(min(count, 4)):
        window = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device, generator=g)
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


def kernel_profile(torch, run, data, first_step, steps, path, title):
    """Per-kernel device time of `steps` steps (torch.profiler, CUDA activity), written to `path`
    as ms per step, calls per step and the kernel's name, largest first: the peer's side of the
    per-kernel profiles flare-train's steps get from ncu (bench/results/*/kernel-profile-*.txt)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            run.step(*data[(first_step + i) % len(data)], first_step + i)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            rows.append((us / 1e3 / steps, e.count / steps, e.key))
    rows.sort(key=lambda r: -r[0])
    with open(path, "w") as f:
        f.write(title + "\n")
        f.write(f"torch.profiler over {steps} steps after the timed ones, per step; "
                f"sum of kernel times per step: {sum(r[0] for r in rows):.1f} ms\n")
        f.write(" ms/step  calls  kernel\n")
        for ms, calls, name in rows:
            f.write(f"{ms:8.2f} {calls:6.0f}  {name[:140]}\n")


class StepClock:
    """Times consecutive steps. On the GPU, a CUDA event after each step and no host wait inside
    the loop (each interval is one step's device time); on the CPU, where every operation has
    finished when it returns, the host clock."""

    def __init__(self, torch, cpu, steps):
        self.torch, self.cpu = torch, cpu
        self.marks = [] if cpu else [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        self.count = 0

    def mark(self):
        if self.cpu:
            self.marks.append(time.perf_counter())
        else:
            self.marks[self.count].record()
        self.count += 1

    def elapsed_ms(self):
        """Milliseconds between consecutive marks (waits for the device)."""
        if self.cpu:
            return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]
        self.torch.cuda.synchronize()
        return [self.marks[i].elapsed_time(self.marks[i + 1]) for i in range(self.count - 1)]


def peak_memory(torch, cpu):
    """(peak bytes allocated, peak bytes reserved, device bytes in use now) since the last reset
    on the GPU; on the CPU the process's peak resident set (Linux reports it in KiB), and neither
    a reserve nor a device."""
    if cpu:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None, None
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), total - free


# One rank's measurement of a case, as exchanged between the ranks.
RankStats = collections.namedtuple(
    "RankStats", "step_ms step_ms_mean step_ms_min peak_mem_bytes peak_reserved_bytes "
    "device_in_use_bytes finite loss_first loss_last")


def gather_ranks(torch, args, stats):
    """Every rank's RankStats, in rank order ([stats] alone). A collective: every rank calls it."""
    if not args.launch:
        return [stats]
    import torch.distributed as dist
    values = [float("nan") if v is None else float(v) for v in stats]
    mine = torch.tensor(values, dtype=torch.float64, device="cpu" if args.cpu else "cuda")
    everyone = [torch.empty_like(mine) for _ in range(args.launch.world)]
    dist.all_gather(everyone, mine)
    out = []
    for t in everyone:
        v = t.tolist()
        optional = [None if x != x else int(x) for x in v[4:6]]  # NaN: not measured
        out.append(RankStats(v[0], v[1], v[2], int(v[3]), *optional, bool(v[6]), v[7], v[8]))
    return out


def combine_ranks(ranks):
    """One measurement from the ranks': a data-parallel step lasts as long as its slowest rank, so
    each time and memory is the largest over the ranks; the losses are the ranks' mean (each rank
    trains on its own batches); finite only if every rank's losses were."""
    reserved = [r.peak_reserved_bytes for r in ranks]
    in_use = [r.device_in_use_bytes for r in ranks]
    return RankStats(
        step_ms=max(r.step_ms for r in ranks), step_ms_mean=max(r.step_ms_mean for r in ranks),
        step_ms_min=max(r.step_ms_min for r in ranks),
        peak_mem_bytes=max(r.peak_mem_bytes for r in ranks),
        peak_reserved_bytes=None if None in reserved else max(reserved),
        device_in_use_bytes=None if None in in_use else max(in_use),
        finite=all(r.finite for r in ranks),
        loss_first=statistics.fmean(r.loss_first for r in ranks),
        loss_last=statistics.fmean(r.loss_last for r in ranks))


def bench_case(torch, tm, args, config, batch, seq, backend):
    cpu = args.cpu
    if not cpu:
        set_sdpa_backend(torch, backend)
    torch._dynamo.reset()
    if not cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = Run(torch, tm, args, config, batch, seq)
    data = batches_for(torch, tm, args, config, batch, seq, args.warmup + args.steps, run.device)
    for i in range(args.warmup):
        x, y = data[i % len(data)]
        loss, _ = run.step(x, y, i)
    first_loss = loss.item()
    kernels = []
    if not cpu:  # the profile's evidence is of CUDA kernels
        kernels = attention_kernels(torch, run, *data[0])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(torch, cpu, args.steps)
    losses = []
    clock.mark()
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        loss, _ = run.step(x, y, args.warmup + i)
        losses.append(loss)
        clock.mark()
    ms = clock.elapsed_ms()
    peak, reserved, in_use = peak_memory(torch, cpu)
    if args.kernel_profile and not cpu:
        os.makedirs(args.kernel_profile, exist_ok=True)
        kernel_profile(torch, run, data, args.warmup + args.steps, 2,
                       os.path.join(args.kernel_profile, f"kernel-profile-{impl_name(args)}-{config.name}.txt"),
                       f"{impl_name(args)} {config.name} b{batch} s{seq}, {torch.cuda.get_device_name()}, "
                       f"torch {torch.__version__}: median step {statistics.median(ms):.1f} ms in the timed run")
    mine = RankStats(statistics.median(ms), statistics.fmean(ms), min(ms), peak, reserved, in_use,
                     all(map(lambda t: bool(torch.isfinite(t)), losses)), first_loss,
                     losses[-1].item())
    ranks = gather_ranks(torch, args, mine)
    stats = combine_ranks(ranks)
    world = args.launch.world if args.launch else 1
    tokens_per_s = world * batch * seq / (stats.step_ms / 1e3)
    flops = tm.model_flops_per_token(config, seq)
    mfu = tokens_per_s * flops / (world * PEAK_BF16_FLOPS)  # per GPU
    if mfu >= 1.0:  # above peak means the timing or the FLOP count is wrong, not a fast run
        raise RuntimeError(f"{config.name}: MFU {mfu:.2f} >= 1, a measurement error")
    if not stats.finite:
        raise RuntimeError(f"{config.name}: non-finite loss in the timed steps")
    row = {
        "impl": impl_name(args),
        "model": config.name, "gpus": world, "seq": seq, "batch_per_gpu": batch,
        "tokens_per_s": tokens_per_s, "mfu": mfu,
        "peak_mem_bytes": stats.peak_mem_bytes,
        "step_ms": stats.step_ms,
        "step_ms_mean": stats.step_ms_mean, "step_ms_min": stats.step_ms_min,
        "steps_timed": args.steps,
        "peak_reserved_bytes": stats.peak_reserved_bytes,
        "device_in_use_bytes": stats.device_in_use_bytes,
        "flops_per_token": flops, "parameters": tm.parameter_count(config),
        "precision": "bf16-autocast-fp32-weights" if args.precision == "bf16" else args.precision,
        "attention_backend": backend, "attention_kernels": kernels,
        "data": "shards" if args.data else "random",
        "loss_first": stats.loss_first, "loss_last": stats.loss_last,
    }
    if args.launch:
        row["step_ms_per_rank"] = [r.step_ms for r in ranks]
        row["peak_mem_bytes_per_rank"] = [r.peak_mem_bytes for r in ranks]
    return row


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
    """Every --case, timed; rank 0 (the only process when alone) prints and writes the JSON."""
    lead = not args.launch or args.launch.rank == 0
    say = print if lead else (lambda *a, **k: None)
    result = {"card": "cpu" if args.cpu else torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "software": software(torch),
              "optimizer": {"name": "AdamW" if args.cpu else "AdamW(fused)", "lr": args.lr,
                            "betas": [args.beta1, args.beta2],
                            "eps": args.eps, "weight_decay": args.weight_decay,
                            "grad_clip": args.grad_clip},
              "peak_flops": PEAK_BF16_FLOPS, "rows": []}
    name_suffix = args.name
    if args.launch:
        parallel = "fsdp2" if args.fsdp else "ddp"
        result["launch"] = {"launcher": "torchrun", "world": args.launch.world,
                            "parallel": parallel, "backend": "gloo" if args.cpu else "nccl"}
        name_suffix = name_suffix or f"{parallel}-x{args.launch.world}"
    world = args.launch.world if args.launch else 1
    failed = False
    for name, batch, seq in args.case:
        config = config_for(tm, args, name)
        backends = ([args.backend] + (["flash"] if args.backend == "cudnn" else [])
                    if not args.cpu else ["cpu"])
        row, refusal = None, ""
        for backend in backends:
            try:
                row = bench_case(torch, tm, args, config, batch, seq, backend)
                if backend != backends[0]:
                    row["attention_backend_note"] = f"{args.backend} refused: {refusal}"
                break
            except torch.cuda.OutOfMemoryError as e:
                row = {"impl": impl_name(args), "model": config.name, "gpus": world, "seq": seq,
                       "batch_per_gpu": batch, "error": f"out of memory: {str(e).splitlines()[0]}"}
                break
            except Exception as e:  # compile and SDPA refusals come as several exception types
                refusal = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                where = f"rank {args.launch.rank}: " if args.launch else ""
                print(f"{where}{config.name} b{batch} s{seq}: backend {backend} failed: {refusal}",
                      file=sys.stderr)
        if row is None:
            row = {"impl": impl_name(args), "model": config.name, "gpus": world, "seq": seq,
                   "batch_per_gpu": batch, "error": refusal}
        if not args.cpu:
            torch.cuda.empty_cache()
        result["rows"].append(row)
        if "error" in row:
            failed = True
            say(f"{config.name:12s} b{batch:<3d} s{seq:<5d} FAILED: {row['error']}")
        else:
            say(f"{config.name:12s} b{batch:<3d} s{seq:<5d} {row['tokens_per_s']:12,.0f} tokens/s "
                  f"{row['step_ms']:9.2f} ms  MFU {100 * row['mfu']:5.1f}%  "
                  f"peak {row['peak_mem_bytes'] / 2**30:6.2f} GiB  [{row['attention_backend']}]")
    if args.out and lead:
        os.makedirs(args.out, exist_ok=True)
        path = result_path(args.out, "train_torch", result, name_suffix)
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
    if args.launch:
        return run_launched(torch, tm, args)
    if args.cpu:
        return run_log(torch, tm, args)
    if not torch.cuda.is_available():
        sys.exit("train_torch.py: no CUDA device visible to torch")
    torch.cuda.set_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return run_log(torch, tm, args) if args.log else run_bench(torch, tm, args)


def run_launched(torch, tm, args):
    """Bench mode as one rank of a torchrun launch: joins the process group (NCCL on CUDA device
    LOCAL_RANK, gloo with --cpu), runs the cases with the other ranks, and leaves the group."""
    import torch.distributed as dist
    where = f"train_torch.py (rank {args.launch.rank} of {args.launch.world})"
    if not dist.is_available():
        sys.exit(f"{where}: this torch was built without torch.distributed")
    if args.fsdp:
        try:
            fsdp2_fully_shard()
        except RuntimeError as e:
            sys.exit(f"{where}: {e}")
    if args.cpu:
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            sys.exit(f"{where}: no CUDA device visible to torch (--cpu runs the ranks on gloo)")
        if args.device >= torch.cuda.device_count():
            sys.exit(f"{where}: LOCAL_RANK {args.device} but only {torch.cuda.device_count()} "
                     "CUDA devices are visible (at most one process per GPU)")
        torch.cuda.set_device(args.device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", device_id=torch.device("cuda", args.device))
    try:
        return run_bench(torch, tm, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
