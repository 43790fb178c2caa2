#!/usr/bin/env python3
"""fp8_accuracy.py — how far FP8 (e4m3) attention inputs move the output, by scaling scheme.

Q, K, V are drawn from N(0, 1) with a small fraction of entries (0.1% by default) scaled by 10,
the outliers that make per-tensor scaling costly (the setting of FlashAttention-3's FP8 accuracy
study). The ground truth is flare's float64 reference on the float32 inputs. Each scheme
quantizes Q, K and V to float8_e4m3 with descales amax / 448 over its group of elements and
runs flare.attention_forward_fp8 (CPU): per tensor, per (batch, head), per block of `block_rows`
rows of one (batch, head), each with and without a rotation of Q and K by one random orthogonal
matrix along head_dim (random signs times a normalised Hadamard matrix: (QM)(KM)ᵀ = QKᵀ, and the
rotation spreads an outlier over the whole row). bf16 inputs through attention_forward are the
baseline. Reported: RMSE of O against the reference, and that RMSE over the reference's RMS.

What flare's rows measure is the error of quantizing the inputs: its FP8 path runs on the CPU
today, dequantizing to float32, so P is not rounded to e4m3 before P·V as an FP8 kernel's is.
The "simulated kernel" rows add that rounding in a float64 model of such a kernel (this script's
own, not flare's): P = exp(S − rowmax) scaled by 256 (a power of two, undone exactly) and rounded
to e4m3 for P·V, the row sum taken from the unrounded P, as an FP8 kernel would.

    PYTHONPATH=build-py/python python3 bench/fp8_accuracy.py --out bench/results/<dir>
"""

import argparse
import datetime
import json
import os
import platform

from bench_common import git_commit

E4M3_MAX = 448.0


def hadamard(d, torch):
    """d × d normalised Hadamard matrix (d a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


def quantize(x, granularity, block_rows, torch):
    """x (b, s, h, d) float64 → (e4m3 codes, float32 descale (b|1, h|1, blocks|1))."""
    b, s, h, _ = x.shape
    a = x.abs()
    if granularity == "tensor":
        amax = a.amax().reshape(1, 1, 1)
    elif granularity == "head":
        amax = a.amax(dim=(1, 3)).reshape(b, h, 1)
    else:
        blocks = -(-s // block_rows)
        padded = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, blocks * block_rows - s))
        amax = padded.reshape(b, blocks, block_rows, h, -1).amax(dim=(2, 4)).permute(0, 2, 1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    if granularity == "block":
        per_row = scale.permute(0, 2, 1).repeat_interleave(block_rows, dim=1)[:, :s]  # (b, s, h)
        codes = (x / per_row.double().unsqueeze(-1)).to(torch.float8_e4m3fn)
    else:
        per = scale.permute(0, 2, 1).unsqueeze(-1).double()  # (b|1, 1, h|1, 1)
        codes = (x / per).to(torch.float8_e4m3fn)
    return codes, scale


def simulated_kernel(q8, qs, k8, ks, v8, vs, block_rows, torch):
    """O of a float64 model of an FP8 kernel: dequantized inputs, causal, P rounded to e4m3
    (scaled by 256) before P·V, the row sum from the unrounded P."""
    def deq(codes, scale):
        b, s, h, _ = codes.shape
        if scale.shape[2] > 1:
            per = scale.permute(0, 2, 1).repeat_interleave(block_rows, dim=1)[:, :s]
            return codes.double() * per.double().unsqueeze(-1)
        return codes.double() * scale.permute(0, 2, 1).unsqueeze(-1).double()
    q, k, v = (deq(c, sc).permute(0, 2, 1, 3) for c, sc in ((q8, qs), (k8, ks), (v8, vs)))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s_q, s_k = scores.shape[-2:]
    visible = torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q)
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p8 = (p * 256.0).to(torch.float8_e4m3fn).double() / 256.0
    return ((p8 @ v) / p.sum(-1, keepdim=True)).permute(0, 2, 1, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for fp8-accuracy.json")
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--h", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block-rows", type=int, default=128)
    ap.add_argument("--outlier-fraction", type=float, default=0.001)
    ap.add_argument("--outlier-scale", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import flare

    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.b, args.s, args.h, args.d)

    def draw():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        outliers = torch.rand(shape, generator=gen) < args.outlier_fraction
        return torch.where(outliers, x * args.outlier_scale, x)

    q, k, v = draw(), draw(), draw()
    # One random orthogonal rotation of head_dim: random signs, then Hadamard.
    signs = torch.where(torch.rand(args.d, generator=gen) < 0.5, -1.0, 1.0).double()
    rotation = signs[:, None] * hadamard(args.d, torch)

    ref, _ = flare.attention_forward(q.float(), k.float(), v.float(), causal=True,
                                     backend="reference")
    ref = ref.double()
    ref_rms = ref.pow(2).mean().sqrt().item()

    def row(scheme, granularity, hadamard_on, out):
        err = (out.double() - ref).pow(2).mean().sqrt().item()
        return {"scheme": scheme, "granularity": granularity, "hadamard": hadamard_on,
                "rmse": err, "rel_rmse": err / ref_rms}

    rows = []
    out, _ = flare.attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    rows.append(row("bf16", "-", False, out))
    for hadamard_on in (False, True):
        qr, kr = (q @ rotation, k @ rotation) if hadamard_on else (q, k)
        for granularity in ("tensor", "head", "block"):
            (q8, qs), (k8, ks), (v8, vs) = (quantize(x, granularity, args.block_rows, torch)
                                            for x in (qr, kr, v))
            out, _ = flare.attention_forward_fp8(
                q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                block_rows=args.block_rows, causal=True)
            rows.append(row("fp8_e4m3", granularity, hadamard_on, out))
            rows.append(row("fp8_e4m3_p8_sim", granularity, hadamard_on,
                            simulated_kernel(q8, qs, k8, ks, v8, vs, args.block_rows, torch)))

    result = {
        "card": "cpu: " + (platform.processor() or platform.machine()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "software": {"torch": torch.__version__, "flare": flare.__version__},
        "method": ("RMSE of O against flare's float64 reference on the float32 inputs; inputs "
                   "N(0, 1) with outliers; fp8_e4m3: attention_forward_fp8 on the CPU (inputs "
                   "dequantized to float32; P not rounded to e4m3), O in bfloat16; "
                   "fp8_e4m3_p8_sim: this script's float64 model of an FP8 kernel, P*256 "
                   "rounded to e4m3 before P.V; causal"),
        "benchmark": "bench/fp8_accuracy.py",
        "args": vars(args),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8-accuracy.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"b {args.b} s {args.s} h {args.h} d {args.d}, outliers {args.outlier_fraction} x "
          f"{args.outlier_scale}, block_rows {args.block_rows}; reference RMS {ref_rms:.4g}")
    print(f"{'scheme':16} {'granularity':12} {'hadamard':9} {'rmse':>10} {'rel_rmse':>10}")
    for r in rows:
        print(f"{r['scheme']:16} {r['granularity']:12} {str(r['hadamard']):9} "
              f"{r['rmse']:10.3e} {r['rel_rmse']:10.3e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
