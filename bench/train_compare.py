#!/usr/bin/env python3
"""train_compare.py — does flare's trainer compute what the PyTorch reference computes? The first
step's loss, logits and every parameter's gradient, from the same weights and the same batch.

Two commands:

  prepare --model M --batch B --seq T --out DIR [--data GLOB] [--seed S]
      Writes inputs flare can start from: DIR/weights.bin (the flat fp32 buffer of
      parameter_layout(), initialised as the layout says), DIR/tokens.bin and DIR/targets.bin
      (int32 (B, T); from the shards in flare's loader order, or random, with a few targets -1).
      Optional: flare may as well write its own initial weights into the dump (below).

  compare DIR [--device cuda] [--out FILE.json]
      Reads flare's step dump and checks it (exit status 0 when every tensor passes).

The step dump (what flare-train writes with its dump option, after the first forward/backward,
before clipping and the optimizer):
  DIR/step.json       {"model": {ModelConfig fields} | "preset name", "batch": B, "seq": T,
                       "loss": <fp32 mean loss>, "precision": "bf16" | "fp32",
                       "logits_dtype": "bf16" | "fp32"}
  DIR/weights.safetensors or DIR/weights.bin
                      the weights the step ran with, fp32 master: export_safetensors(path, config,
                      master, n, kFloat32), or the raw flat buffer (layout.total fp32)
  DIR/grads.safetensors or DIR/grads.bin
                      the fp32 gradient buffer of that step, the same two ways (export_safetensors
                      of the gradient buffer names each gradient by its tensor's export name)
  DIR/tokens.bin, DIR/targets.bin   int32 (B, T), little-endian, row-major
  DIR/logits.bin      optional: (B·T, padded_vocab) row-major in logits_dtype, the logits before
                      the fused classifier overwrites them with their gradient

The rule (docs/architecture.md's tolerance rule, applied to the model): the ground truth is the
reference in fp64. A naive run is the reference in flare's precision: bf16 autocast over fp32
weights for flare's GPU path ("bf16"), plain fp32 (TF32 off) for its CPU path ("fp32"). For the
loss, the logits (first vocab_size columns) and each gradient tensor separately, max|flare - fp64|
<= 2 · max|naive - fp64| + u · max|fp64| where u is the dtype's unit roundoff (2^-8 bf16, 2^-24
fp32): the rounding noise at the tensor's magnitude, so a tensor the naive run happens to get almost
exactly right still has a floor. Gradients are compared where flare keeps them, export rows included
(padding rows are cut by the export, and they must be zero in a flat dump).

    python3 bench/train_compare.py prepare --model gpt2 --batch 4 --seq 256 --out /tmp/step
    flare-train --model gpt2 --init-weights /tmp/step/weights.bin ... --dump-step /tmp/step
    python3 bench/train_compare.py compare /tmp/step \\
        --out bench/results/<date>-<card>-<commit>/train_compare-gpt2.json
"""

import argparse
import datetime
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp32": 2.0 ** -24}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write initial weights and a batch for flare")
    prep.add_argument("--model", required=True, help="preset name")
    prep.add_argument("--config-json", help="a model config as JSON (ModelConfig's fields)")
    prep.add_argument("--batch", type=int, required=True)
    prep.add_argument("--seq", type=int, required=True)
    prep.add_argument("--data", help="shards (glob): the first batch in flare's loader order")
    prep.add_argument("--seed", type=int, default=1337)
    prep.add_argument("--out", required=True, help="directory (created)")
    cmp = sub.add_parser("compare", help="check flare's step dump against the reference")
    cmp.add_argument("dir", help="flare's step dump")
    cmp.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    cmp.add_argument("--precision", choices=sorted(UNIT_ROUNDOFF),
                     help="flare's precision (default: step.json's)")
    cmp.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args(argv)
    if args.command == "prepare" and (args.batch < 1 or args.seq < 1):
        p.error(f"--batch {args.batch} and --seq {args.seq} must be >= 1")
    return args


def config_from(tm, spec):
    if isinstance(spec, dict):
        return tm.config_from_json(spec)
    return tm.model_preset(spec)


def prepare(torch, tm, args):
    if args.config_json:
        with open(args.config_json) as f:
            config = tm.config_from_json(json.load(f))
    else:
        config = tm.model_preset(args.model)
    if args.seq > config.max_seq:
        sys.exit(f"--seq {args.seq}: exceeds the model's max_seq {config.max_seq}")
    torch.manual_seed(args.seed)
    model = tm.FlareModel(config, rope_len=args.seq)
    tm.init_like_flare(model, torch.Generator().manual_seed(args.seed))
    if args.data:
        tokens, targets = tm.ShardLoader(args.data, args.batch, args.seq, config.vocab_size,
                                         seed=args.seed).next_batch()
    else:
        g = np.random.default_rng(args.seed)
        window = g.integers(0, config.vocab_size, (args.batch, args.seq + 1))
        tokens, targets = window[:, :-1], window[:, 1:].copy()
        targets[g.random(targets.shape) < 0.05] = -1  # ignored targets take part in the check
    os.makedirs(args.out, exist_ok=True)
    tm.write_flat_bin(os.path.join(args.out, "weights.bin"), tm.flat_from_model(model))
    tokens.astype("<i4").tofile(os.path.join(args.out, "tokens.bin"))
    targets.astype("<i4").tofile(os.path.join(args.out, "targets.bin"))
    with open(os.path.join(args.out, "prepared.json"), "w") as f:
        json.dump({"model": config.name, "batch": args.batch, "seq": args.seq,
                   "data": args.data or "random", "seed": args.seed}, f, indent=1)
    print(f"wrote {args.out}/weights.bin ({tm.parameter_layout(config).total} fp32), "
          f"tokens.bin, targets.bin ({args.batch}x{args.seq} int32)")
    return 0


def read_named(torch, tm, config, directory, stem):
    """{flare name: fp32 tensor} from DIR/<stem>.safetensors (export names) or DIR/<stem>.bin."""
    st = os.path.join(directory, stem + ".safetensors")
    if os.path.exists(st):
        tensors, _ = tm.load_safetensors(st)
        return tm.from_export(config, tensors), "export"
    flat = tm.read_flat_bin(os.path.join(directory, stem + ".bin"), tm.parameter_layout(config))
    layout = tm.parameter_layout(config)
    return {p.name: flat[p.offset:p.offset + p.numel].reshape(p.shape).clone()
            for p in layout.params}, "flat"


def reference_step(torch, tm, config, weights, tokens, targets, device, mode):
    """(loss, logits, {name: grad}) of the reference in `mode`: fp64, fp32 or bf16 (autocast)."""
    dtype = torch.float64 if mode == "fp64" else torch.float32
    model = tm.FlareModel(config, rope_len=tokens.shape[1]).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].to(dtype))
    model = model.to(device)
    x, y = tokens.to(device), targets.to(device)
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=mode == "bf16"):
        logits = model(x)
    loss = tm.classifier_loss(logits, y, config.vocab_size)
    loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    result = (loss.detach().double().cpu(),
              logits.detach()[..., :config.vocab_size].double().cpu().reshape(-1, config.vocab_size),
              grads)
    del model, logits, loss
    if device_type == "cuda":
        torch.cuda.empty_cache()
    return result


def check(name, flare, ref, naive, u):
    err = float((flare.double() - ref).abs().max())
    naive_err = float((naive - ref).abs().max())
    scale = float(ref.abs().max())
    bound = 2.0 * naive_err + u * scale
    return {"tensor": name, "flare_err": err, "naive_err": naive_err, "max_ref": scale,
            "bound": bound, "ratio": err / bound if bound > 0 else float("inf") * (err > 0),
            "pass": err <= bound}


def compare(torch, tm, args):
    d = args.dir
    with open(os.path.join(d, "step.json")) as f:
        step = json.load(f)
    config = config_from(tm, step["model"])
    B, T = int(step["batch"]), int(step["seq"])
    precision = args.precision or step.get("precision", "bf16")
    u = UNIT_ROUNDOFF[precision]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def ints(stem):
        a = np.fromfile(os.path.join(d, stem + ".bin"), dtype="<i4")
        if a.size != B * T:
            sys.exit(f"{d}/{stem}.bin: {a.size} int32, step.json says {B}x{T}")
        return torch.from_numpy(a.astype(np.int64).reshape(B, T))

    tokens, targets = ints("tokens"), ints("targets")
    weights, _ = read_named(torch, tm, config, d, "weights")
    flare_grads, grad_form = read_named(torch, tm, config, d, "grads")

    ref = reference_step(torch, tm, config, weights, tokens, targets, device, "fp64")
    naive = reference_step(torch, tm, config, weights, tokens, targets, device,
                           "bf16" if precision == "bf16" else "fp32")

    rows = [check("loss", torch.tensor(float(step["loss"])), ref[0], naive[0], u)]
    logits_path = os.path.join(d, "logits.bin")
    if os.path.exists(logits_path):
        ldt = step.get("logits_dtype", "fp32")
        raw = np.fromfile(logits_path, dtype="<u2" if ldt == "bf16" else "<f4")
        if raw.size != B * T * config.padded_vocab:
            sys.exit(f"{logits_path}: {raw.size} values, expected {B}x{T}x{config.padded_vocab}")
        if ldt == "bf16":
            flare_logits = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float()
        else:
            flare_logits = torch.from_numpy(raw)
        flare_logits = flare_logits.reshape(B * T, config.padded_vocab)[:, :config.vocab_size]
        rows.append(check("logits", flare_logits, ref[1], naive[1], u))
    # Gradients by export name when flare exported them (what a reader of its file sees), with the
    # same rows either way: padding rows are compared only in a flat dump, where they must be 0.
    if grad_form == "export":
        for t in tm.export_tensors(config):
            sl = slice(t.row_begin, t.row_begin + t.rows)
            rows.append(check(t.name, flare_grads[t.source][sl], ref[2][t.source][sl],
                              naive[2][t.source][sl], u))
    else:
        for p in tm.parameter_layout(config).params:
            rows.append(check(p.name, flare_grads[p.name], ref[2][p.name], naive[2][p.name], u))

    failed = [r for r in rows if not r["pass"]]
    width = max(len(r["tensor"]) for r in rows)
    print(f"{config.name}: {B}x{T}, flare {precision}, naive = torch "
          f"{'bf16 autocast' if precision == 'bf16' else 'fp32'}, ground truth torch fp64 on {device}")
    print(f"{'tensor':{width}s}  {'flare err':>10s}  {'naive err':>10s}  {'bound':>10s}  ratio")
    for r in rows:
        print(f"{r['tensor']:{width}s}  {r['flare_err']:10.3e}  {r['naive_err']:10.3e}  "
              f"{r['bound']:10.3e}  {r['ratio']:5.2f}{'' if r['pass'] else '  FAIL'}")
    print(f"{len(rows) - len(failed)}/{len(rows)} tensors within 2·naive + u·max|ref|")
    if args.out:
        from bench_common import git_commit
        out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": git_commit(), "model": config.name, "batch": B, "seq": T,
               "precision": precision, "device": (torch.cuda.get_device_name()
                                                  if device.startswith("cuda") else "cpu"),
               "software": {"torch": torch.__version__}, "rows": rows,
               "pass": not failed}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if failed else 0


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("train_compare.py: needs torch (pip install torch)")
    import torch_models as tm
    return prepare(torch, tm, args) if args.command == "prepare" else compare(torch, tm, args)


if __name__ == "__main__":
    sys.exit(main())
